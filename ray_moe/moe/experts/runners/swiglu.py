# ======================================================================================================
#  SWIGLU'S ACTIVATION IN ONE PASS (one rank; torch + Triton: no Ray)
#
#   g [.., f], u [.., f]   the gate and up projections of a step's expert-major rows (two grouped_mm outputs, or
#                          two bmm outputs of the capacity layout), contiguous, one dtype
#   ──> swiglu_: ONE kernel; program i reads elements [i * BLOCK, (i + 1) * BLOCK) of g and u once and writes
#       silu(g) * u over g (in place), with torch's two roundings:
#         1. a = round(silu(g))       (silu in FP32, rounded to the dtype: what ``F.silu(g, inplace=True)`` stores)
#         2. g = round(a * u)         (the product in FP32, rounded: what ``g.mul_(u)`` stores)
#
#  Why: torch runs the activation as two passes, ``silu_`` (read g, write g) and ``mul_`` (read g and u, write g):
#  five tensor passes where one kernel needs three. On an H100 a 16,384-token prompt step of the Qwen3-30B-A3B shape
#  (131,072 routed rows of 768) spent ~140 us a layer in silu and ~210 us in the multiply on the grouped_mm path
#  (bench/results/serving-h100x1-0114027/kernel_mix-long.json: 10.3 + 15.2 ms over 72 layer steps). The decode and
#  mid-size kernels (skinny.py, tiled.py) already fuse the activation into their gate/up GEMM.
#  ``swiglu_reference`` (torch's two calls) is the oracle.
# ======================================================================================================
"""SwiGLU's activation ``silu(g) * u`` in place in ``g``, one kernel (CUDA; any device under Triton's interpreter)."""

from __future__ import annotations

import functools

import torch

from ray_moe.core.env import triton_interpreted

BLOCK = 2048  # elements a program reads of each operand
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
        import triton.language.extra.libdevice  # noqa: F401 - tl.extra.libdevice below
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _swiglu(g_ptr, u_ptr, n, BLOCK: tl.constexpr, CUDA_EXP: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # 1. silu in FP32 with torch's arithmetic (CUDA's expf and a correctly rounded division: tl.exp and "/"
        #    lower to approximations a unit or two apart, which an H100 showed as 243 fp16 results of 3.1 million
        #    one unit off), rounded to the dtype as torch stores it; 2. the product in FP32, rounded
        #    (the interpreter has no libdevice: its tl.exp is numpy's, correctly rounded as a rule)
        if CUDA_EXP:
            e = tl.extra.libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        a = tl.math.div_rn(g, 1.0 + e).to(g_ptr.dtype.element_ty).to(tl.float32)
        tl.store(g_ptr + offs, (a * u).to(g_ptr.dtype.element_ty), mask=mask)

    return _swiglu


def available(g: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: CUDA tensors (any device under Triton's interpreter) of one shape,
    device and dtype (bf16 / fp16 / fp32), both contiguous, Triton importable, and the kernel checked on that device
    and dtype (``works``)."""
    if not (g.is_cuda and u.is_cuda) and not triton_interpreted():
        return False
    return (g.shape == u.shape and g.dtype == u.dtype and g.dtype in DTYPES and g.device == u.device
            and g.is_contiguous() and u.is_contiguous() and _kernel() is not None and works(g.device, g.dtype))


def works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel compiles and reproduces ``swiglu_reference`` on ``device`` for ``dtype`` (seeded operands,
    within four units of the dtype), decided at its first use outside a CUDA-graph capture (the steps' eager warm-ups
    come first) and kept for the process; False while a capture runs before that (torch's calls are captured)."""
    try:
        return _verdict(device, dtype)
    except _Capturing:
        return False


class _Capturing(Exception):
    """A capture is running: no check now (an exception, so that ``_verdict`` caches nothing)."""


@functools.lru_cache(maxsize=None)
def _verdict(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise _Capturing
    return _check(device, dtype)


def _check(device: torch.device, dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(3, 1000, generator=g) * 4.0).to(device, dtype)
    up = torch.randn(3, 1000, generator=g).to(device, dtype)
    want = swiglu_reference(gate.clone(), up)
    try:
        got = _launch(gate.clone(), up)
    except Exception:  # noqa: BLE001 - it does not compile or run here: torch's calls serve
        return False
    rel = 4.0 * torch.finfo(dtype).eps  # the exp and division a few FP32 units apart (the tests' bound)
    return bool(((got.float() - want.float()).abs() <= rel * want.float().abs() + 1e-30).all())


def swiglu_(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g [.., f], u [.., f] (same shape, dtype and device, contiguous) -> g, now silu(g) * u with torch's roundings
    (module banner). Raises ValueError naming ``g`` where the kernel does not take the operands."""
    if not available(g, u):
        raise ValueError(f"g: {tuple(g.shape)} {g.dtype} on {g.device} with u {tuple(u.shape)} {u.dtype} on "
                         f"{u.device}: the one-pass SwiGLU takes contiguous CUDA tensors of one shape and of "
                         f"dtype {[str(d) for d in DTYPES]}")
    return _launch(g, u)


def _launch(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    n = g.numel()
    if n:
        _kernel()[(-(-n // BLOCK),)](g, u, n, BLOCK=BLOCK, CUDA_EXP=not triton_interpreted(), num_warps=8)
    return g


def swiglu_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """torch's two in-place calls (the oracle): silu(g) stored in g, then g * u stored in g -> g."""
    return torch.nn.functional.silu(g, inplace=True).mul_(u)


__all__ = ["BLOCK", "DTYPES", "available", "swiglu_", "swiglu_reference", "works"]
