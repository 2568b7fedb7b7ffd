"""Fused RMSNorm for a transformers model's own norm layers, through the layer's ``forward`` (the seam that
transformers' kernels hub replaces for ``@use_kernel_forward_from_hub("RMSNorm")`` layers).

transformers' Llama-style RMSNorm (Mixtral, Qwen3-MoE, DeepSeek-V3, ...) runs as separate kernels: to(float32),
pow, mean, add, rsqrt, mul, to(dtype), then the weight mul, moving about ten times the tensor's bytes. In a
4096-token prefill of a Qwen3-30B-A3B-shaped decoder layer (two layer norms plus the per-head q/k norms) they
took about 0.46 ms of the layer's 2.34 ms of device time on an H200; fused, an 8-layer step went from 18.7 to
15.0 ms (measured in process, bench/results/logs/h200-s6-run6.log). One Triton kernel reads each row once and
writes it once, with the layer's arithmetic:

  1. x32 = x.float(); var = mean(x32 ** 2) over the last dim            (FP32)
  2. y = (x32 * rsqrt(var + eps)).to(x.dtype)
  3. out = (weight * y), rounded to x.dtype                             (weight and input of one dtype)

``fuse_rms_norms(model)`` gives every Llama-style RMSNorm module an instance ``forward`` that takes the kernel
for CUDA inputs of the weight's dtype with a contiguous last dim, and the layer's own forward otherwise. A
class is recognised by checking, once per class on the model's device, that the kernel reproduces the
class's own forward on random rows (to two units in the last place of the dtype); a class with another
formula (``(1 + weight)``, a bias) fails the check and keeps its forward, and inputs the kernel cannot take
(another dtype than the weight's, a strided last dim) run the layer's own forward, call by call. The layer's
own forward stays the reference (tests compare on CUDA); on CPU or without Triton nothing is replaced. ``unfuse_rms_norms`` restores every replaced forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ray_moe.model.swap import Fused, fuse_by_class, restore_forwards

_ORIGINAL_ATTR = "_ray_moe_unfused_forward"
# 2 ulps of the dtype (relative): the kernel's sum order differs from torch's reduction, so the normalised
# row can round one unit apart, which the weight multiply (also rounded) can make two
_RTOL = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 1e-5}


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _rms_norm(x_ptr, w_ptr, y_ptr, n_rows, H, B, stride_a, stride_b, eps, BLOCK_R: tl.constexpr,
                  BLOCK_H: tl.constexpr):
        # row r of the input is x[r // B, r % B, :] of an [A, B, H] view (a head-major slice of a wider
        # projection reads in place); the output is contiguous [A * B, H]
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        m = (rows < n_rows)[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)
        src = ((r64 // B) * stride_a + (r64 % B) * stride_b)[:, None] + cols[None, :]
        offs = r64[:, None] * H + cols[None, :]
        x = tl.load(x_ptr + src, mask=m, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=1) / H
        y = (x * tl.math.rsqrt(var + eps)[:, None]).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
        tl.store(y_ptr + offs, (w.to(tl.float32) * y.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=m)

    return _rms_norm


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: CUDA, one floating dtype for both, a 1-D weight as wide as the
    rows, a contiguous last dimension, Triton importable."""
    return (x.is_cuda and x.dtype in _RTOL and weight.dtype == x.dtype and weight.dim() == 1
            and x.dim() >= 1 and x.shape[-1] == weight.shape[0] and x.stride(-1) == 1 and _kernel() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] (CUDA, contiguous last dim), weight: [H] of x's dtype -> [..., H] of x's dtype (contiguous).
    Rows read in place when x views as [A, B, H] (e.g. the heads of a Q/K slice of a fused projection), else
    from a contiguous copy."""
    if not available(x, weight):
        raise ValueError(f"x: {tuple(x.shape)} {x.dtype} on {x.device} with weight {tuple(weight.shape)} "
                         f"{weight.dtype}: the fused RMSNorm takes CUDA rows of the weight's dtype and width")
    h = x.shape[-1]
    b = x.shape[-2] if x.dim() >= 2 else 1
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    try:
        rows = x.view(-1, b, h)
    except RuntimeError:  # leading dims that do not merge: copied
        rows = x.reshape(-1, h).contiguous().view(-1, b, h)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = rows.shape[0] * b
    if n:
        block_h = 1 << max(0, h - 1).bit_length()
        block_r = max(1, min(64, 4096 // block_h))
        per_program = block_r * block_h
        warps = 4 if per_program <= 2048 else 8 if per_program <= 8192 else 16
        _kernel()[((n + block_r - 1) // block_r,)](rows, weight, out, n, h, b, rows.stride(0), rows.stride(1),
                                                     float(eps), BLOCK_R=block_r, BLOCK_H=block_h, num_warps=warps,
                                                     enable_fp_fusion=False)
    return out


def _eps_of(module: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        v = getattr(module, name, None)
        if isinstance(v, float):
            return v
    return None


def _candidate(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(w, torch.nn.Parameter) and w.dim() == 1
            and getattr(module, "bias", None) is None and _eps_of(module) is not None)


def _matches(module: torch.nn.Module) -> str | None:
    """None when the kernel reproduces ``module``'s own forward on random rows, else why not."""
    w = module.weight
    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(37, w.shape[0], generator=g, device=w.device, dtype=torch.float32).mul_(3.0).to(w.dtype)
    if not available(x, w):
        return f"weight {w.dtype} on {w.device}: not taken by the kernel"
    with torch.no_grad():
        want = module.forward(x)
        got = rms_norm(x, w, _eps_of(module))
    if want.dtype != got.dtype or want.shape != got.shape:
        return f"its forward returns {want.dtype} {tuple(want.shape)}, the kernel {got.dtype} {tuple(got.shape)}"
    try:
        torch.testing.assert_close(got, want, rtol=_RTOL[w.dtype], atol=1e-6)
    except AssertionError as exc:
        return "another formula: " + str(exc).splitlines()[0]
    return None


def _fused_forward(module: torch.nn.Module, original: Any, eps: float):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if available(hidden_states, module.weight):
            return rms_norm(hidden_states, module.weight, eps)
        return original(hidden_states)

    return forward


class FusedNorms(Fused):
    """What ``fuse_rms_norms`` did: ``modules`` norm layers now take the kernel, of the classes ``classes``;
    ``skipped``: class name -> why its layers keep their own forward."""


def fuse_rms_norms(model: torch.nn.Module) -> FusedNorms:
    """Replace the forward of every Llama-style RMSNorm layer of ``model`` (on CUDA) by the fused kernel."""
    return fuse_by_class(model, _ORIGINAL_ATTR, FusedNorms, _candidate, lambda m: (_matches(m), None),
                         lambda m, original, _: _fused_forward(m, original, _eps_of(m)))


def unfuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every fused layer its own forward back; returns how many."""
    return restore_forwards(model, _ORIGINAL_ATTR)


__all__ = ["FusedNorms", "available", "fuse_rms_norms", "rms_norm", "unfuse_rms_norms"]
