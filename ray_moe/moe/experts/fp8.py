# ======================================================================================================
#  BLOCK-SCALED FP8 WEIGHTS (pure torch: no Ray)
#
#   the DeepSeek-V3 / Qwen3-FP8 layout: a Linear weight W [out, in] is stored as
#       codes     [out, in]                               float8_e4m3fn
#       scale_inv [ceil(out / b_out), ceil(in / b_in)]    float32 (the checkpoint's ``weight_scale_inv``)
#   and its value is  W[i, j] = float32(codes[i, j]) * scale_inv[i // b_out, j // b_in]   (one float32
#   product, partial edge blocks included): ``dequantize`` computes exactly that, ``quantize`` writes it
#   (scale = block amax / 448, the e4m3 maximum); ``quantize_groups`` quantizes activations per token group
#   (1 x 128, dynamic); ``runners/fp8.py`` (``Fp8Runner``) runs a rank's FP8 slots: the block-FP8 Triton
#   kernels (``runners/fp8_kernels.py``) on CUDA, else any expert runner on the dequantized values.
# ======================================================================================================
"""Block-scaled FP8 (e4m3) weights: the format, exact dequantization and quantization, and the per-token-group
activation quantizer (pure math: the slot records live in ``weights``, the runner entry in ``runners/fp8.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def check_block(block: Sequence[int], what: str = "weight_block_size") -> tuple[int, int]:
    """``block`` as (rows, columns) of one scale block, both integers >= 1; ValueError naming ``what``."""
    try:
        b = tuple(int(v) for v in block)
        ok = len(b) == 2 and all(v >= 1 and v == x and not isinstance(x, bool) for v, x in zip(b, block))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{what}={list(block) if isinstance(block, (list, tuple)) else block!r}: expected two "
                         f"integers >= 1 ([rows, columns] of one scale block)")
    return b  # type: ignore[return-value]


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scales of a weight of ``shape`` [..., out, in]: [..., ceil(out / b0), ceil(in / b1)]."""
    b0, b1 = block
    *lead, rows, cols = (int(s) for s in shape)
    return (*lead, -(-rows // b0), -(-cols // b1))


def dequantize(codes: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., R, C] float8_e4m3fn, scale_inv [..., ceil(R / b0), ceil(C / b1)] (float32, or a dtype that
    converts to it exactly) -> [..., R, C] in ``dtype``: float32(code) * scale of its block, one float32
    product per element (edge blocks partial), then cast to ``dtype``. ValueError names a shape mismatch."""
    b0, b1 = block
    rows, cols = int(codes.shape[-2]), int(codes.shape[-1])
    want = scale_shape(codes.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv: shape {list(scale_inv.shape)} does not match codes {list(codes.shape)} in "
                         f"blocks of {[b0, b1]} (expected {list(want)})")
    w = codes.to(torch.float32)
    s = scale_inv.to(torch.float32).repeat_interleave(b0, dim=-2)[..., :rows, :]  # [..., R, ceil(C / b1)]
    full, rem = divmod(cols, b1)
    if full:  # columns broadcast through a view of the weight: no second weight-sized tensor
        w[..., :full * b1].unflatten(-1, (full, b1)).mul_(s[..., :full, None])
    if rem:
        w[..., full * b1:].mul_(s[..., full:])
    return w if dtype == torch.float32 else w.to(dtype)


def quantize(weight: torch.Tensor, block: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., R, C] (any float dtype) -> (codes [..., R, C] float8_e4m3fn, scale_inv [..., ceil(R / b0),
    ceil(C / b1)] float32), per block: scale = amax / 448 (1.0 for an all-zero block), code = e4m3(w / scale)
    (round to nearest, within +-448). ``dequantize`` of the result is the FP8 model's weight."""
    b0, b1 = check_block(block)
    w = weight.detach().to(torch.float32)
    rows, cols = int(w.shape[-2]), int(w.shape[-1])
    sr, sc = -(-rows // b0), -(-cols // b1)
    pad = torch.nn.functional.pad(w, (0, sc * b1 - cols, 0, sr * b0 - rows))
    blocks = pad.unflatten(-1, (sc, b1)).unflatten(-3, (sr, b0))  # [..., sr, b0, sc, b1]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., sr, sc]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(b0, dim=-2)[..., :rows, :].repeat_interleave(b1, dim=-1)[..., :cols]
    codes = (w / full).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale.contiguous()


ACT_SCALE_MIN = 1e-12  # the smallest activation group scale (as the FP8_BLOCK128 dispatch payload)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization per token group (1 x ``group``): x [N, d] (any float dtype) -> (codes
    [N, d] float8_e4m3fn, scales [N, ceil(d / group)] float32), per row and group of ``group`` columns (the last
    one partial): scale = max(amax / 448, 1e-12) in float32, code = e4m3(float32(x) / scale) (round to nearest
    even, within +-448). The FP8 expert kernels' activation quantizer computes exactly this."""
    n, d = int(x.shape[0]), int(x.shape[1])
    ng = -(-d // group)
    xf = x.to(torch.float32)
    pad = torch.nn.functional.pad(xf, (0, ng * group - d)).view(n, ng, group)
    amax = pad.abs().amax(dim=2)
    # a correctly rounded division on every device (a Python-number divisor makes CUDA multiply by its rounded
    # reciprocal, an ulp off at times: bf16 activations' exact e4m3 ties then round the other way)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(ACT_SCALE_MIN)
    codes = (pad / scale[:, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(n, ng * group)[:, :d].to(FP8_DTYPE)
    return codes, scale


def round_trip_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [N, d] quantized per 1 x ``group`` (``quantize_groups``) and taken back: code x its group's scale, [N, d]
    float32. What the FP8 kernels compute on in place of their activations (the torch references' step 1)."""
    codes, scales = quantize_groups(x, group)
    return codes.to(torch.float32) * scales.repeat_interleave(group, dim=1)[:, :x.shape[1]]


@dataclass(frozen=True)
class Fp8Format:
    """How a layer's experts are stored: block-scaled e4m3 codes with float32 scales in ``block``
    (rows, columns) blocks. ``shapes(f, d)``: the (shape, dtype) of each of an expert's six tensors (w_gate,
    w_up, w_down codes, then their scales), the order they travel in (NCCL copies, the wire)."""

    block: tuple[int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", check_block(self.block, "block"))

    def shapes(self, f: int, d: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        codes = [(f, d), (f, d), (d, f)]
        return ([(s, FP8_DTYPE) for s in codes]
                + [(scale_shape(s, self.block), torch.float32) for s in codes])


__all__ = ["ACT_SCALE_MIN", "FP8_DTYPE", "FP8_MAX", "Fp8Format", "check_block", "dequantize", "quantize",
           "quantize_groups", "round_trip_groups", "scale_shape"]
