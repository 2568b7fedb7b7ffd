"""FP8 e4m3 payloads with FP32 scales that travel with their rows (spec 0x0AB-0x0AF)."""

from __future__ import annotations

import math

import pytest
import torch

from ray_moe.moe.dispatch.engine import combine, dispatch
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.moe.dispatch.precision import BLOCK, FP8_DTYPE, FP8_MAX, dequantize, quantize, scales_per_row
from ray_moe.core.routes import RouteBatch
from ray_moe.placement.selector import ExplicitSelector
from ray_moe_dev.testing import fixtures as fx
from ray_moe.core.types import PayloadFormat

FP8 = (PayloadFormat.FP8_ROW, PayloadFormat.FP8_BLOCK128)
HALF_ULP = 2.0**-4  # e4m3 keeps 3 mantissa bits: round-to-nearest relative error <= 2^-4 in the normal range
SUBNORMAL_HALF_STEP = 2.0**-10  # half of the smallest e4m3 subnormal step 2^-9, in units of the scale


def _randn(n: int, d: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g).to(dtype)


def _elem_scale(scales: torch.Tensor, fmt: PayloadFormat, d: int) -> torch.Tensor:
    """[N, S] scales expanded to the [N, d] scale of every element."""
    if fmt is PayloadFormat.FP8_ROW:
        return scales.expand(-1, d)
    return scales.repeat_interleave(BLOCK, dim=1)[:, :d]


# ---------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("d", [3, 16, 128, 200, 7168])
def test_scale_shape_and_dtypes(d):
    x = _randn(5, d)
    for fmt in FP8:
        q, s = quantize(x, fmt)
        assert q.dtype == FP8_DTYPE and tuple(q.shape) == (5, d)
        assert s is not None and s.dtype == torch.float32
        assert tuple(s.shape) == (5, scales_per_row(fmt, d))
    assert scales_per_row(PayloadFormat.FP8_ROW, d) == 1
    assert scales_per_row(PayloadFormat.FP8_BLOCK128, d) == math.ceil(d / 128)
    assert scales_per_row(PayloadFormat.NATIVE, d) == 0


# ---------------------------------------------------------------------------------------------- error bounds


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("d", [16, 128, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_error_bounds(fmt, d, dtype):
    x = _randn(64, d, seed=d, dtype=dtype)
    q, s = quantize(x, fmt)
    y = dequantize(q, s, fmt, torch.float32)
    xf = x.to(torch.float32)
    err = (y - xf).abs()
    # per element: e4m3 rounding in the normal range, or half a subnormal step below it
    bound = torch.maximum(HALF_ULP * xf.abs(), SUBNORMAL_HALF_STEP * _elem_scale(s, fmt, d))
    assert bool((err <= bound * (1 + 1e-5) + 1e-30).all())
    rel = err / xf.abs().clamp_min(1e-12)
    assert float(rel[xf.abs() > 1e-3].mean()) < 2.0**-5  # mean relative error is small
    assert float(rel[xf.abs() > 1e-3].max()) <= 2.0**-3  # worst case stays within the e4m3 class


@pytest.mark.parametrize("fmt", FP8)
def test_scale_is_amax_over_fp8_max(fmt):
    x = _randn(8, 300)
    q, s = quantize(x, fmt)
    if fmt is PayloadFormat.FP8_ROW:
        want = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    else:
        pad = torch.nn.functional.pad(x, (0, 3 * BLOCK - 300))
        want = pad.view(8, 3, BLOCK).abs().amax(dim=2) / FP8_MAX
    assert torch.allclose(s, want, rtol=0, atol=0)
    assert float(q.to(torch.float32).abs().max()) <= FP8_MAX  # the row/block maximum maps to 448, no overflow


def test_block_scales_isolate_an_outlier_block():
    x = _randn(4, 256) * 0.01
    x[:, 0] = 1e5  # one outlier in the first block: under one row scale the tail underflows
    qr, sr = quantize(x, PayloadFormat.FP8_ROW)
    qb, sb = quantize(x, PayloadFormat.FP8_BLOCK128)
    tail = slice(128, 256)
    err_row = (dequantize(qr, sr, PayloadFormat.FP8_ROW, torch.float32) - x)[:, tail].abs().mean()
    err_blk = (dequantize(qb, sb, PayloadFormat.FP8_BLOCK128, torch.float32) - x)[:, tail].abs().mean()
    assert float(err_blk) < float(err_row) / 10


def test_d_not_a_multiple_of_128():
    x = _randn(6, 200)
    x[:, 128:] *= 1e-3  # the 72-value fringe block gets its own, much smaller scale
    q, s = quantize(x, PayloadFormat.FP8_BLOCK128)
    assert tuple(s.shape) == (6, 2)
    assert bool((s[:, 1] < s[:, 0] / 100).all())
    y = dequantize(q, s, PayloadFormat.FP8_BLOCK128, torch.float32)
    assert tuple(y.shape) == (6, 200)
    fringe = (y - x)[:, 128:].abs() / x[:, 128:].abs().clamp_min(1e-12)
    assert float(fringe[x[:, 128:].abs() > 1e-6].mean()) < 2.0**-5


def test_zero_rows_stay_zero():
    x = torch.zeros(3, 130)
    for fmt in FP8:
        q, s = quantize(x, fmt)
        y = dequantize(q, s, fmt, torch.float32)
        assert bool(torch.isfinite(s).all()) and bool((y == 0).all())


def test_empty_batch():
    x = torch.zeros(0, 300)
    for fmt in FP8:
        q, s = quantize(x, fmt)
        assert tuple(s.shape) == (0, scales_per_row(fmt, 300))
        assert tuple(dequantize(q, s, fmt, torch.float32).shape) == (0, 300)


# ---------------------------------------------------------------------------------------------- scales travel with rows


@pytest.mark.parametrize("fmt", FP8)
def test_scales_travel_with_rows(fmt):
    x = _randn(16, 200, seed=3) * torch.logspace(-3, 3, 16)[:, None]  # very different row magnitudes
    q, s = quantize(x, fmt)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    moved = dequantize(q[perm], s[perm], fmt, torch.float32)
    assert torch.equal(moved, dequantize(q, s, fmt, torch.float32)[perm])
    # 0x0AC hazard: rows permuted, scales left token-major -> shapes match, values are wrong
    stale = dequantize(q[perm], s, fmt, torch.float32)
    assert not torch.allclose(stale, x[perm], rtol=0.1)


@pytest.mark.parametrize("fmt", FP8)
def test_scale_count_mismatch_names_scales(fmt):
    q, s = quantize(_randn(4, 300), fmt)
    n, k = s.shape
    for bad in (torch.ones(n, k + 1), torch.ones(n + 1, k), torch.ones(n)):
        with pytest.raises(ValueError, match=r"^scales: "):
            dequantize(q, bad, fmt, torch.float32)
    with pytest.raises(ValueError, match=r"^scales: None"):
        dequantize(q, None, fmt, torch.float32)


def test_native_passthrough():
    x = _randn(4, 7, dtype=torch.bfloat16)
    q, s = quantize(x, PayloadFormat.NATIVE)
    assert q is x and s is None
    y = dequantize(q, None, PayloadFormat.NATIVE, torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, x.to(torch.float32))


# ---------------------------------------------------------------------------------------------- through dispatch


def _fixture_step(fmt: PayloadFormat):
    snap = fx.snapshot()
    sel = ExplicitSelector({o: fx.route_tensors(o)[3] for o in (0, 1)})
    grp = LocalExchangeGroup(fx.flat_group())

    def step(ex):
        h, ids, g, _ = fx.route_tensors(ex.rank)
        out = dispatch(RouteBatch(ex.rank, h.to(torch.float32), ids, g), snap, ex, selector=sel,
                       tag=f"prec-{fmt.value}", payload_format=fmt)
        rows = dequantize(out.rows, out.scales, fmt, torch.float32)
        slots = out.handle.receive.slot_ids
        scale = torch.tensor([fx.SCALES[int(snap.phy2log[q])] for q in slots.tolist()])
        y = rows * torch.repeat_interleave(scale, out.expert_counts)[:, None]
        res = combine(y, out.handle, snap, ex, tag=f"prec-{fmt.value}", out_dtype=torch.float32)
        return out, rows, res

    return grp.run(step)


@pytest.mark.parametrize("fmt", FP8)
def test_dispatch_moves_scales_with_rows(fmt):
    native = _fixture_step(PayloadFormat.NATIVE)
    fp8 = _fixture_step(fmt)
    for rank, ((n_out, n_rows, _), (q_out, q_rows, q_res)) in enumerate(zip(native, fp8)):
        assert q_out.rows.dtype == FP8_DTYPE
        assert q_out.scales is not None
        assert tuple(q_out.scales.shape) == (q_out.rows.shape[0], scales_per_row(fmt, 3))
        # expert-major rows dequantized with their own scales are the native rows, within e4m3 rounding
        assert torch.allclose(q_rows, n_rows, rtol=HALF_ULP, atol=0)
        if rank in fx.EXPECTED_OUTPUT:
            want = torch.tensor(fx.EXPECTED_OUTPUT[rank], dtype=torch.float32)
            assert torch.allclose(q_res, want, rtol=HALF_ULP, atol=0)
