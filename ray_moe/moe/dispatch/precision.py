"""Payload precision: FP8 e4m3 rows with FP32 scales that travel with their rows (spec 0x0AB-0x0AE).

Pure torch. ``quantize`` returns the data and scale tensors as one pair; every permutation and split
of the dispatch path is applied to both, so a scale can never be separated from its row.
"""

from __future__ import annotations

import math

import torch

from ray_moe.moe.dispatch.kernels import dequantize_fp8, quantize_fp8
from ray_moe.core.types import PayloadFormat

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def scales_per_row(fmt: PayloadFormat, d: int) -> int:
    """Number of FP32 scales each row carries."""
    if fmt is PayloadFormat.FP8_ROW:
        return 1
    if fmt is PayloadFormat.FP8_BLOCK128:
        return math.ceil(d / BLOCK)
    return 0


def quantize(x: torch.Tensor, fmt: PayloadFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [N, d] float -> (data [N, d] e4m3 or x itself, scales [N, S] float32 or None)."""
    if fmt is PayloadFormat.NATIVE:
        return x, None
    fast = quantize_fp8(x, None if fmt is PayloadFormat.FP8_ROW else BLOCK, FP8_DTYPE, FP8_MAX)
    if fast is not None:  # CUDA: one Triton pass, same math
        return fast
    n, d = x.shape
    s = scales_per_row(fmt, d)
    xf = x.to(torch.float32)
    if fmt is PayloadFormat.FP8_ROW:
        amax = xf.abs().amax(dim=1, keepdim=True)
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(1e-12)  # correctly rounded, as the kernel
        q = (xf / scale).to(FP8_DTYPE)
        return q, scale
    pad = s * BLOCK - d
    xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    blocks = xp.view(n, s, BLOCK)
    amax = blocks.abs().amax(dim=2)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(1e-12)  # correctly rounded, as the kernel
    q = (blocks / scale[:, :, None]).view(n, s * BLOCK)[:, :d].to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scales: torch.Tensor | None, fmt: PayloadFormat, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize``: [N, d] e4m3 + [N, S] scales -> [N, d] ``out_dtype``."""
    if fmt is PayloadFormat.NATIVE:
        return q.to(out_dtype)
    if scales is None:
        raise ValueError(f"scales: None for payload format {fmt.value}")
    n, d = q.shape
    s = scales_per_row(fmt, d)
    if tuple(scales.shape) != (n, s):
        raise ValueError(f"scales: shape {tuple(scales.shape)} != expected [{n}, {s}] for {fmt.value}")
    fast = dequantize_fp8(q, scales, None if fmt is PayloadFormat.FP8_ROW else BLOCK, out_dtype)
    if fast is not None:  # CUDA: one Triton pass, same math
        return fast
    qf = q.to(torch.float32)
    if fmt is PayloadFormat.FP8_ROW:
        return (qf * scales).to(out_dtype)
    pad = s * BLOCK - d
    qp = torch.nn.functional.pad(qf, (0, pad)) if pad else qf
    return (qp.view(n, s, BLOCK) * scales[:, :, None]).view(n, s * BLOCK)[:, :d].to(out_dtype)
