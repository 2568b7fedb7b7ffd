# ======================================================================================================
#  ONE GEMM FOR AN ATTENTION MODULE'S Q / K / V PROJECTIONS (one rank; pure torch: no Ray)
#
#   hidden [.., d] ── q_proj(hidden) ──> one GEMM over the concatenated weight [nq + nk + nv, d]
#       (nn.Linear trios: F.linear; Fp8Linear trios: fp8_kernels.fp8_linear over the concatenated codes and
#       block scales) ──> y [.., nq + nk + nv];  q_proj returns y[.., :nq]; k / v slices kept for the same input
#   ── k_proj(hidden), v_proj(hidden) (the module's own next calls, the same tensor) ──> their slices
#   any other call (another input, another order, weights replaced since) ──> the projection's own forward
# ======================================================================================================
"""Fused Q/K/V projections for the attention modules of a transformers model (Llama-style ``q_proj`` /
``k_proj`` / ``v_proj`` linears: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...).

At decode sizes each projection is a weight read that cuBLAS runs below HBM bandwidth: on an H200 a
256-token step of the Qwen3-30B-A3B shape spent ~22 us a layer in three GEMMs (q 10.4 us, k and v 5.8 us
each; bench/results/logs/step_profile-h200x1-48l-decode-heavy-6210425.json), about 1 ms of a 48-layer token
step. One GEMM over the three weights reads the same bytes in one launch. The attention module's own forward
still runs: ``q_proj`` computes the three projections and returns the query slice, ``k_proj`` and ``v_proj``
return theirs when called with the same input tensor (its identity, held until both are taken), and run their
own forward otherwise. The three weights become views of the concatenated buffer (no copy is kept), and
every call checks they still are (weights replaced later run unfused).

Two kinds of trio:

* ``torch.nn.Linear`` (bf16 / fp16 by default, ``dtypes``): one ``F.linear`` over the concatenated weight
  (and bias). FP32 stays the reference precision of the token-equality tests, and a GEMM of another width may
  round apart from the separate ones (the outputs agree to the dtype's rounding: tests compare).
* ``Fp8Linear`` (an FP8 checkpoint's projections kept in block FP8, ``model/fp8_linear.py``): one
  ``fp8_kernels.fp8_linear`` over the concatenated codes [nq + nk + nv, d] float8_e4m3fn and block scales
  (their rows concatenated: q's and k's ``out_features`` must be multiples of the block's rows, else the trio
  stays unfused), one activation quantization instead of three. On an H100 at 256 decode rows the three
  separate FP8 GEMMs (and their three activation quantizations) took ~42 us a layer where one over the
  concatenated weight takes ~16 us. ``dtypes`` does not apply to these trios (their weights are e4m3 codes;
  the activations keep the model's dtype). Per output column the block-FP8 GEMM computes what the separate
  ones do (the same activation groups, the same weight blocks): ``fp8_linear_reference`` gives the separate
  projections' outputs bit for bit.

Applied on CUDA only by default (``cuda_only``). ``unfuse_qkv`` gives the projections their own forwards back
(the weights stay views of one buffer: the same values, the same bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ray_moe.model.fp8_linear import Fp8Linear
from ray_moe.model.swap import restore_forwards, swap_forward
from ray_moe.moe.experts.fp8 import FP8_DTYPE, scale_shape
from ray_moe.moe.experts.runners import fp8_kernels

_ORIGINAL_ATTR = "_ray_moe_unfused_qkv_forward"
HALF_DTYPES = (torch.bfloat16, torch.float16)

_Projection = torch.nn.Linear | Fp8Linear


class _Slices:
    """The fused GEMM's pending k / v outputs for one input tensor (held by identity until both are taken)."""

    __slots__ = ("x", "k", "v")

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def take(self, x: torch.Tensor, name: str) -> torch.Tensor | None:
        if self.x is not x:
            return None
        out = getattr(self, name)
        setattr(self, name, None)
        if self.k is None and self.v is None:
            self.x = None
        return out


def _fp8_trio_ok(q: Fp8Linear, k: Fp8Linear, v: Fp8Linear) -> bool:
    """Three ``Fp8Linear`` whose codes and scales concatenate into one block-FP8 weight: one block, codes of
    ``FP8_DTYPE`` and scales of one dtype on one device, each scale grid the shape of its codes, and q's and k's
    ``out_features`` whole blocks of rows (so the scale rows concatenate exactly)."""
    trio = (q, k, v)
    if len({p.block for p in trio}) != 1 or any(p.codes.dtype != FP8_DTYPE for p in trio):
        return False
    if len({(p.scale_inv.dtype, p.codes.device, p.scale_inv.device) for p in trio}) != 1:
        return False
    if any(tuple(p.scale_inv.shape) != scale_shape(p.codes.shape, p.block) for p in trio):
        return False
    b0 = q.block[0]
    return q.out_features % b0 == 0 and k.out_features % b0 == 0


def _triple(module: torch.nn.Module) -> tuple[_Projection, _Projection, _Projection] | None:
    """``module``'s (q_proj, k_proj, v_proj) when they can run as one GEMM: all three ``torch.nn.Linear`` of one
    weight dtype and device, or all three ``Fp8Linear`` (``_fp8_trio_ok``); one input width, biases all present
    or all absent, no hooks. Else None."""
    q, k, v = (getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj"))
    kinds = {type(p) for p in (q, k, v)}
    if kinds == {torch.nn.Linear}:
        if len({(p.weight.dtype, p.weight.device) for p in (q, k, v)}) != 1:
            return None
    elif kinds != {Fp8Linear} or not _fp8_trio_ok(q, k, v):
        return None
    if len({p.in_features for p in (q, k, v)}) != 1 or len({p.bias is None for p in (q, k, v)}) != 1:
        return None
    if any(p._forward_hooks or p._forward_pre_hooks for p in (q, k, v)):
        return None
    return q, k, v


def _share(q: _Projection, k: _Projection, v: _Projection, gemm: Callable[[torch.Tensor], torch.Tensor],
           whole: Callable[[], bool]) -> None:
    """Give the three projections the sharing forwards: q runs ``gemm`` (x [..., d] -> y [..., nq + nk + nv]) and
    returns y[..., :nq], keeping k's and v's slices for the same tensor; k / v return theirs, or run their own
    forward (another input, called twice, or ``whole()`` False: the weights replaced since)."""
    nq, nk = q.out_features, k.out_features
    slices = _Slices()
    q_own, k_own, v_own = q.forward, k.forward, v.forward

    def q_forward(x: torch.Tensor) -> torch.Tensor:
        if not whole():
            return q_own(x)
        y = gemm(x)
        slices.x, slices.k, slices.v = x, y[..., nq:nq + nk], y[..., nq + nk:]
        return y[..., :nq]

    def k_forward(x: torch.Tensor) -> torch.Tensor:
        out = slices.take(x, "k")
        return out if out is not None and whole() else k_own(x)

    def v_forward(x: torch.Tensor) -> torch.Tensor:
        out = slices.take(x, "v")
        return out if out is not None and whole() else v_own(x)

    for lin, fwd in ((q, q_forward), (k, k_forward), (v, v_forward)):
        swap_forward(lin, _ORIGINAL_ATTR, lambda _own, f=fwd: f)


def _install(q: torch.nn.Linear, k: torch.nn.Linear, v: torch.nn.Linear) -> None:
    """Concatenate the three weights (and biases) into one buffer [nq + nk + nv, d], make them views of it, and
    give the three linears the sharing forwards (one ``F.linear``)."""
    nq, nk = q.out_features, k.out_features
    with torch.no_grad():
        w = torch.cat([q.weight, k.weight, v.weight])
        b = torch.cat([q.bias, k.bias, v.bias]) if q.bias is not None else None
    for lin, lo, hi in ((q, 0, nq), (k, nq, nq + nk), (v, nq + nk, w.shape[0])):
        lin.weight = torch.nn.Parameter(w[lo:hi], requires_grad=False)
        if b is not None:
            lin.bias = torch.nn.Parameter(b[lo:hi], requires_grad=False)
    ptrs = tuple(p.weight.data_ptr() for p in (q, k, v))

    def whole() -> bool:  # the linears' weights are still the views made here
        return (q.weight.data_ptr(), k.weight.data_ptr(), v.weight.data_ptr()) == ptrs

    _share(q, k, v, lambda x: F.linear(x, w, b), whole)


def _install_fp8(q: Fp8Linear, k: Fp8Linear, v: Fp8Linear) -> None:
    """Concatenate the three ``Fp8Linear``'s codes [n*, d] float8_e4m3fn into one [nq + nk + nv, d], their block
    scales [n* / b0, ceil(d / b1)] float32 into one [ceil((nq + nk + nv) / b0), ceil(d / b1)] (and biases [n*]),
    re-register each module's ``codes`` / ``scale_inv`` / ``bias`` buffers as views of them (no second copy), and
    give the three the sharing forwards: x [..., d] -> one ``fp8_kernels.fp8_linear`` -> y [..., nq + nk + nv] in
    x's dtype (+ bias). The kernel is looked up on ``fp8_kernels`` at each call (tests patch it)."""
    nq, nk, b0 = q.out_features, k.out_features, q.block[0]
    block, d = q.block, q.in_features
    with torch.no_grad():
        codes = torch.cat([q.codes, k.codes, v.codes])
        scales = torch.cat([q.scale_inv, k.scale_inv, v.scale_inv])
        bias = torch.cat([q.bias, k.bias, v.bias]) if q.bias is not None else None
    n = int(codes.shape[0])
    for mod, lo, hi in ((q, 0, nq), (k, nq, nq + nk), (v, nq + nk, n)):
        mod.codes = codes[lo:hi]  # an existing buffer's name: re-registered (persistence kept)
        mod.scale_inv = scales[lo // b0:-(-hi // b0)]
        if bias is not None:
            mod.bias = bias[lo:hi]

    def now() -> tuple[int | None, ...]:  # where the three modules' codes, scales and biases are
        return tuple(None if t is None else t.data_ptr() for p in (q, k, v) for t in (p.codes, p.scale_inv, p.bias))

    ptrs = now()

    def whole() -> bool:  # the modules' codes, scales (and biases) are still the views made here
        return now() == ptrs

    def gemm(x: torch.Tensor) -> torch.Tensor:
        y = fp8_kernels.fp8_linear(x.reshape(-1, d), codes, scales, block).reshape(*x.shape[:-1], n)
        return y if bias is None else y + bias

    _share(q, k, v, gemm, whole)


@dataclass(frozen=True)
class FusedQKV:
    """What ``fuse_qkv`` did: ``modules`` attention modules now run one Q/K/V GEMM, ``fp8_modules`` of them
    over ``Fp8Linear`` projections (one block-FP8 GEMM)."""

    modules: int = 0
    fp8_modules: int = 0
    fp8_shapes: tuple[tuple[int, int, tuple[int, int]], ...] = ()  # (nq + nk + nv, d, block) of each FP8 GEMM run


def fuse_qkv(model: torch.nn.Module, dtypes: tuple[torch.dtype, ...] = HALF_DTYPES,
             cuda_only: bool = True) -> FusedQKV:
    """Fuse the Q/K/V projections of every attention module of ``model`` whose three projections share their
    kind, input width, device (CUDA unless ``cuda_only`` is False) and bias presence: ``torch.nn.Linear`` trios of
    one weight dtype among ``dtypes``; ``Fp8Linear`` trios of one block whose q and k ``out_features`` are whole
    blocks of rows (``dtypes`` does not apply to them: their weights are float8_e4m3fn codes)."""
    n = fp8 = 0
    shapes: list[tuple[int, int, tuple[int, int]]] = []
    for module in model.modules():
        t = _triple(module)
        if t is None or any(hasattr(p, _ORIGINAL_ATTR) for p in t):
            continue
        if isinstance(t[0], Fp8Linear):
            if cuda_only and t[0].codes.device.type != "cuda":
                continue
            _install_fp8(*t)
            fp8 += 1
            shapes.append((sum(p.out_features for p in t), t[0].in_features, tuple(t[0].block)))
        else:
            w = t[0].weight
            if w.dtype not in dtypes or (cuda_only and w.device.type != "cuda"):
                continue
            _install(*t)
        n += 1
    return FusedQKV(n, fp8, tuple(shapes))


def is_fused(projection: torch.nn.Module) -> bool:
    """Whether ``projection`` (a q / k / v module) runs inside its module's one Q/K/V GEMM."""
    return hasattr(projection, _ORIGINAL_ATTR)


def unfuse_qkv(model: torch.nn.Module) -> int:
    """Give every fused projection its own forward back; returns how many attention modules."""
    return restore_forwards(model, _ORIGINAL_ATTR) // 3


__all__ = ["FusedQKV", "HALF_DTYPES", "fuse_qkv", "is_fused", "unfuse_qkv"]
