# ======================================================================================================
#  ONE GEMM FOR AN ATTENTION MODULE'S Q / K / V PROJECTIONS (one rank; pure torch: no Ray)
#
#   hidden [.., d] ── q_proj(hidden) ──> one F.linear over the concatenated weight [nq + nk + nv, d]
#       ──> y [.., nq + nk + nv];  q_proj returns y[.., :nq]; k / v slices kept for the same input
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
own ``F.linear`` otherwise. The three weights become views of the concatenated buffer (no copy is kept), and
every call checks they still are (weights replaced later run unfused).

Applied on CUDA to bf16 / fp16 models only: FP32 stays the reference precision of the token-equality tests,
and a GEMM of another width may round apart from the separate ones (the outputs agree to the dtype's
rounding: tests compare). ``unfuse_qkv`` gives the projections their own forwards back (the weights stay
views of one buffer: the same values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ray_moe.model.swap import restore_forwards, swap_forward

_ORIGINAL_ATTR = "_ray_moe_unfused_qkv_forward"
HALF_DTYPES = (torch.bfloat16, torch.float16)


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


def _triple(module: torch.nn.Module) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear] | None:
    q, k, v = (getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj"))
    if not all(type(p) is torch.nn.Linear for p in (q, k, v)):
        return None
    if len({p.in_features for p in (q, k, v)}) != 1 or len({(p.weight.dtype, p.weight.device) for p in (q, k, v)}) != 1:
        return None
    if len({p.bias is None for p in (q, k, v)}) != 1:
        return None
    if any(p._forward_hooks or p._forward_pre_hooks for p in (q, k, v)):
        return None
    return q, k, v


def _install(q: torch.nn.Linear, k: torch.nn.Linear, v: torch.nn.Linear) -> None:
    """Concatenate the three weights (and biases) into one buffer, make them views of it, and give the
    three linears the sharing forwards."""
    nq, nk = q.out_features, k.out_features
    with torch.no_grad():
        w = torch.cat([q.weight, k.weight, v.weight])
        b = torch.cat([q.bias, k.bias, v.bias]) if q.bias is not None else None
    for lin, lo, hi in ((q, 0, nq), (k, nq, nq + nk), (v, nq + nk, w.shape[0])):
        lin.weight = torch.nn.Parameter(w[lo:hi], requires_grad=False)
        if b is not None:
            lin.bias = torch.nn.Parameter(b[lo:hi], requires_grad=False)
    ptrs = tuple(p.weight.data_ptr() for p in (q, k, v))
    slices = _Slices()

    def whole() -> bool:  # the linears' weights are still the views made here
        return (q.weight.data_ptr(), k.weight.data_ptr(), v.weight.data_ptr()) == ptrs

    q_own, k_own, v_own = q.forward, k.forward, v.forward

    def q_forward(x: torch.Tensor) -> torch.Tensor:
        if not whole():
            return q_own(x)
        y = F.linear(x, w, b)
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


@dataclass(frozen=True)
class FusedQKV:
    """What ``fuse_qkv`` did: ``modules`` attention modules now run one Q/K/V GEMM."""

    modules: int = 0


def fuse_qkv(model: torch.nn.Module, dtypes: tuple[torch.dtype, ...] = HALF_DTYPES,
             cuda_only: bool = True) -> FusedQKV:
    """Fuse the Q/K/V projections of every attention module of ``model`` whose three linears share their
    input width, dtype (one of ``dtypes``), device (CUDA unless ``cuda_only`` is False) and bias presence."""
    n = 0
    for module in model.modules():
        t = _triple(module)
        if t is None or any(hasattr(p, _ORIGINAL_ATTR) for p in t):
            continue
        w = t[0].weight
        if w.dtype not in dtypes or (cuda_only and w.device.type != "cuda"):
            continue
        _install(*t)
        n += 1
    return FusedQKV(n)


def unfuse_qkv(model: torch.nn.Module) -> int:
    """Give every fused projection its own forward back; returns how many attention modules."""
    return restore_forwards(model, _ORIGINAL_ATTR) // 3


__all__ = ["FusedQKV", "HALF_DTYPES", "fuse_qkv", "unfuse_qkv"]
