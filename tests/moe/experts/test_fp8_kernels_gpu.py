"""The block-FP8 expert kernels (``runners/fp8_kernels.py``) on CUDA: the start check at the serving shapes,
the kernels against the naive float64 oracle (small shapes) and the float32 torch reference
(``fp8_swiglu_reference``, at the 48-layer Qwen3-30B-A3B expert shape: 128 experts, d 2048, f 768, top-8),
every row layout (expert-major, token rows through the route order with row-mapped weights, the decode
bucket's capacity), inside CUDA graphs replayed with new routes, and the runner taking them on FP8 slots.

Tolerances (max |kernel - reference| / max |reference|): 2e-2 with bfloat16 activations (the output's bf16
rounding, 2^-8, plus the rare intermediate element whose FP32 sum lands on the other side of an e4m3 rounding
boundary than the reference's), 1e-2 with float32 ones; against the dequantized bf16 path (activations NOT
quantized): a relative Frobenius error below 6e-2 (e4m3 keeps 3 mantissa bits: ~2-3% per activation).
Run: ``python -m pytest -q tests/moe/experts/test_fp8_kernels_gpu.py`` on the GPU machine (TRITON_INTERPRET
unset)."""

from __future__ import annotations

import os
from itertools import accumulate

import pytest
import torch

from ray_moe.moe.dispatch.local import LocalDispatchOutput, PlannedDispatchOutput
from ray_moe.moe.dispatch.records import Handle
from ray_moe.moe.experts import slab
from ray_moe.moe.experts.fp8 import quantize
from ray_moe.moe.experts.runners import fp8_kernels, make_runner
from ray_moe.moe.experts.runners.fp8 import CHECK_TOLERANCE, Fp8Runner, check_fp8_kernel, fast_path_reason, fp8_swiglu_reference
from ray_moe.moe.experts.weights import SlotWeights
from ray_moe.moe.layer import run_experts
from ray_moe_dev.testing.reference import naive_fp8_experts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton interprets on CPU here")]
DEV = torch.device("cuda")
BLOCK = (128, 128)
BF16_TOL, FP32_TOL = 2e-2, 1e-2
HANDLE = Handle(handle_id="h", generation=1, layer=0, pg_epoch=0, rank=0)


@pytest.fixture(autouse=True)
def _triton():
    pytest.importorskip("triton")


def experts(c: int, d: int, f: int, block=BLOCK, seed: int = 0):
    """Codes and scales of ``c`` seeded experts on the GPU (drawn there: CUDA's generator)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dense = [torch.randn(c, f, d, generator=g, device=DEV) / d ** 0.5,
             torch.randn(c, f, d, generator=g, device=DEV) / d ** 0.5,
             torch.randn(c, d, f, generator=g, device=DEV) / f ** 0.5]
    pairs = [quantize(w, block) for w in dense]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def routed(tokens: int, e: int, k: int, seed: int = 0) -> list[int]:
    """Rows per expert of ``tokens`` tokens each routed to k distinct experts at random."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).reshape(-1)
    return torch.bincount(ids, minlength=e).tolist()


def bounds_of(counts) -> torch.Tensor:
    return torch.tensor(list(accumulate(counts)), dtype=torch.int32, device=DEV)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want.double().cpu()).abs().max() / want.double().cpu().abs().max())


def close_at_scale(got: torch.Tensor, want: torch.Tensor) -> None:
    """Many rows against the torch reference: the largest difference within the start check's bound
    (``CHECK_TOLERANCE``; one e4m3 code of the quantized intermediate that the two round on either side of a tie
    moves a row by up to a code step, ~1/8 of that value, and the maximum over more rows meets more such ties:
    at 2,048 tokens on an H100 the maximum was 2.3e-2), and the mean difference far below it (a wrong scale or
    row moves every element)."""
    diff = (got.double().cpu() - want.double().cpu()).abs()
    scale = want.double().cpu().abs()
    assert float(diff.max() / scale.max()) < CHECK_TOLERANCE
    assert float(diff.mean() / scale.mean()) < 5e-3


@pytest.mark.parametrize("d,f", [(2048, 768), (7168, 2048), (200, 136)])
def test_the_start_check_passes_at_the_serving_shapes(d, f):
    assert check_fp8_kernel(DEV, torch.bfloat16, d, f, BLOCK) is None
    assert fast_path_reason(DEV, torch.bfloat16, d, f, BLOCK) is None
    assert "K blocks" in fast_path_reason(DEV, torch.bfloat16, d, f, (128, 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("counts,d,f,block", [([3, 0, 17, 40], 256, 384, BLOCK),
                                              ([0, 0, 70, 0], 256, 256, BLOCK),    # one hot slot
                                              ([5, 0, 20], 200, 136, BLOCK),       # partial K / N blocks
                                              ([9, 4], 192, 160, (32, 64))])
def test_kernels_match_the_naive_reference(counts, d, f, block, dtype):
    codes, scales = experts(len(counts), d, f, block, seed=1)
    x = (torch.randn(sum(counts) + 3, d, device=DEV) * 2).to(dtype)  # 3 padding rows past bounds[-1]
    y = fp8_kernels.fp8_swiglu(x, bounds_of(counts), codes, scales, block)
    n = sum(counts)
    want = naive_fp8_experts(x[:n].cpu(), counts, [t.cpu() for t in codes], [s.cpu() for s in scales], block)
    assert y.dtype == dtype and torch.isfinite(y[:n]).all()
    assert rel(y[:n], want) < (BF16_TOL if dtype == torch.bfloat16 else FP32_TOL)


@pytest.mark.parametrize("tokens", [1, 16, 256, 2048])
def test_kernels_at_the_qwen3_expert_shape(tokens):
    counts = routed(tokens, 128, 8, seed=tokens)
    codes, scales = experts(128, 2048, 768, seed=2)
    x = torch.randn(tokens * 8, 2048, device=DEV).to(torch.bfloat16)
    want = fp8_swiglu_reference(x, counts, codes, scales, BLOCK)
    close_at_scale(fp8_kernels.fp8_swiglu(x, bounds_of(counts), codes, scales, BLOCK), want)
    if tokens == 256:
        for bm in fp8_kernels.ROW_BLOCKS:
            close_at_scale(fp8_kernels.fp8_swiglu(x, bounds_of(counts), codes, scales, BLOCK, block_m=bm), want)


def test_token_rows_through_the_order_with_row_mapped_weights_and_the_capacity_layout():
    counts, d, f = [6, 0, 11, 30], 2048, 768
    codes, scales = experts(6, d, f, seed=3)  # a buffer of 6 rows; slots at rows 5, 0, 2, 3
    hidden = torch.randn(40, d, device=DEV).to(torch.bfloat16)
    order = torch.randperm(80, device=DEV)[:47].to(torch.int32)
    got = fp8_kernels.fp8_swiglu(hidden, bounds_of(counts), codes, scales, BLOCK, order=order, top_k=2,
                                 weight_rows=torch.tensor([5, 0, 2, 3], device=DEV))
    want = fp8_swiglu_reference(hidden[order.long() // 2], counts, codes, scales, BLOCK, rows=(5, 0, 2, 3))
    assert rel(got, want) < BF16_TOL
    valid = [2, 0, 16, 9, 0, 1]
    cap = torch.zeros(6, 16, d, device=DEV, dtype=torch.bfloat16)
    for q, n in enumerate(valid):
        cap[q, :n] = torch.randn(n, d, device=DEV).to(torch.bfloat16)
    y = fp8_kernels.fp8_swiglu_capacity(cap, torch.tensor(valid, device=DEV), codes, scales, BLOCK)
    for q, n in enumerate(valid):
        if n:
            ref = fp8_swiglu_reference(cap[q, :n], [n], [t[q:q + 1] for t in codes], [s[q:q + 1] for s in scales],
                                       BLOCK)
            assert rel(y[q, :n], ref) < BF16_TOL
        assert not y[q, n:].any()


def test_the_kernels_replay_in_a_cuda_graph_with_new_routes():
    """Fixed shapes, device-side bounds: one capture serves any routing of its rows (no host read, no
    data-dependent allocation); a replay equals the eager call on the same inputs bit for bit."""
    d, f, e, rows = 2048, 768, 16, 64
    codes, scales = experts(e, d, f, seed=4)
    x = torch.zeros(rows, d, device=DEV, dtype=torch.bfloat16)
    bounds = torch.zeros(e, dtype=torch.int32, device=DEV)
    cap_x = torch.zeros(e, 8, d, device=DEV, dtype=torch.bfloat16)
    valid = torch.zeros(e, dtype=torch.int64, device=DEV)
    fp8_kernels.fp8_swiglu(x, bounds, codes, scales, BLOCK)  # compiled outside the capture
    fp8_kernels.fp8_swiglu_capacity(cap_x, valid, codes, scales, BLOCK)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_kernels.fp8_swiglu(x, bounds, codes, scales, BLOCK)
        y_cap = fp8_kernels.fp8_swiglu_capacity(cap_x, valid, codes, scales, BLOCK)
    for seed, counts in enumerate([[4] * 16, [0] * 15 + [64], [1, 0, 0, 30, 2] + [0] * 10 + [31]]):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(rows, d, device=DEV, generator=g).to(torch.bfloat16))
        bounds.copy_(bounds_of(counts))
        cap_x.copy_(torch.randn(e, 8, d, device=DEV, generator=g).to(torch.bfloat16))
        valid.copy_(torch.tensor([min(c, 8) for c in counts], device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, fp8_kernels.fp8_swiglu(x, bounds, codes, scales, BLOCK))
        want_cap = fp8_kernels.fp8_swiglu_capacity(cap_x, valid, codes, scales, BLOCK)
        assert torch.equal(y_cap, want_cap)


@pytest.mark.parametrize("rows", [(0, 1, 2, 3), (3, 5, 0, 1)])
def test_the_runner_takes_the_kernels_on_fp8_slots(rows):
    d, f = 2048, 768
    codes, scales = experts(6, d, f, seed=6)
    w = SlotWeights.over_buffer(0, [0, 1, 2, 3], [0, 1, 2, 3], *codes, list(rows), scales=scales, block=BLOCK)
    counts = [5, 0, 12, 3]
    x = torch.randn(sum(counts), d, device=DEV).to(torch.bfloat16)
    runner = make_runner("grouped")
    assert Fp8Runner(runner).fast(x, w) and Fp8Runner(runner).takes_indexed(x, 20, w)
    out = LocalDispatchOutput(rows=x, counts_list=(), handle=HANDLE, offsets=bounds_of(counts),
                              valid=torch.tensor(counts, device=DEV))
    got = run_experts(runner, out, w, d)
    assert rel(got, fp8_swiglu_reference(x, counts, codes, scales, BLOCK, rows=rows)) < BF16_TOL
    ref_runner = Fp8Runner(runner, kernels=False)  # the dequantized path: bf16 weights, unquantized activations
    dense = (slab.run_offsets(ref_runner, x, bounds_of(counts), w) if w.row_mapped
             else ref_runner.run_offsets(x, bounds_of(counts), w))
    frob = float((got.float() - dense.float()).norm() / dense.float().norm())
    assert frob < 6e-2, f"FP8 kernels vs the dequantized bf16 path: relative Frobenius error {frob:.3g}"
    order = torch.randperm(2 * sum(counts), device=DEV)[:sum(counts)].to(torch.int32)
    hidden = torch.randn(sum(counts), d, device=DEV).to(torch.bfloat16)
    got = run_experts(runner, PlannedDispatchOutput(rows=hidden, counts_list=(), handle=HANDLE, order=order,
                                                    offsets=bounds_of(counts), valid=torch.tensor(counts, device=DEV),
                                                    top_k=2), w, d)
    want = fp8_swiglu_reference(hidden[order.long() // 2], counts, codes, scales, BLOCK, rows=rows)
    assert rel(got, want) < BF16_TOL

