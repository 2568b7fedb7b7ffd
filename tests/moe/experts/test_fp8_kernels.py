"""The block-FP8 expert kernels (``runners/fp8_kernels.py``) and the FP8 runner's fast path (``runners/fp8.py``)
against the naive float64 oracle (``ray_moe_dev.testing.reference.naive_fp8_experts``: weights dequantized
block by block, activations quantized per 1 x b1 group with the kernels' float32 rounding, float64 matmuls).

Triton is not in the CPU CI install: the kernel tests take ``pytest.importorskip("triton")`` and run the real
kernels under Triton's CPU interpreter on CPU tensors (tiny shapes, the interpreter is slow), which must be on
from the start of the process: ``TRITON_INTERPRET=1 python -m pytest tests/moe/experts/test_fp8_kernels.py``
(without it they skip, saying so). Without the interpreter, Triton's compiler builds the kernels for sm_90 on
this CPU host (no GPU needed): that they compile, pipeline their loads and fit an H100's shared memory. The same kernels on CUDA: ``test_fp8_kernels_gpu.py``. Tolerance here: max |kernel - naive| below
1% of max |naive| (float32 activations: the kernels and the oracle differ by FP32 summation order, and where
that moves a value across an e4m3 rounding boundary, by one code of one intermediate element)."""

from __future__ import annotations

import os
from itertools import accumulate

import pytest
import torch

from ray_moe.moe.dispatch.bucket import BucketDispatchOutput
from ray_moe.moe.dispatch.local import LocalDispatchOutput, PlannedDispatchOutput
from ray_moe.moe.dispatch.records import Handle, NormalDispatchOutput
from ray_moe.moe.experts.fp8 import quantize, quantize_groups
from ray_moe.moe.experts.runners import fp8 as fp8_runner
from ray_moe.moe.experts.runners import fp8_kernels, make_runner
from ray_moe.moe.experts.runners.fp8_configs import LaunchConfig, LinearBackend, LinearChoice, SwigluChoice
from ray_moe.moe.experts.runners.fp8 import Fp8Runner, check_fp8_kernel, fast_path_reason, fp8_swiglu_reference
from ray_moe.moe.experts.weights import SlotWeights
from ray_moe.moe.layer import run_experts
from ray_moe_dev.testing.reference import _naive_group_quant, naive_fp8_experts

pytestmark = pytest.mark.triton  # its Triton kernels also run under the CPU interpreter (TRITON_INTERPRET=1)

TOL = 1e-2
HANDLE = Handle(handle_id="h", generation=1, layer=0, pg_epoch=0, rank=0)


@pytest.fixture
def interpret():
    """The kernels under Triton's CPU interpreter, which has to be on when Triton is first imported (its
    library functions are built then): ``TRITON_INTERPRET=1 python -m pytest tests/moe/experts/...``."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the FP8 kernels run on CPU under Triton's interpreter: set TRITON_INTERPRET=1 for pytest")
    fp8_kernels._kernels.cache_clear()


def experts(c: int, d: int, f: int, block, seed: int = 0):
    """Codes and scales of ``c`` seeded experts quantized in ``block`` blocks (w_gate, w_up, w_down)."""
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(c, f, d, generator=g) / d ** 0.5, torch.randn(c, f, d, generator=g) / d ** 0.5,
             torch.randn(c, d, f, generator=g) / f ** 0.5 * (1 + torch.arange(c))[:, None, None]]
    pairs = [quantize(w, block) for w in dense]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def rows_of(n: int, d: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.logspace(-2, 1, n)[:, None] if n else torch.zeros(0, d)


def close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    err = float((got.double().cpu() - want.double().cpu()).abs().max() / want.double().abs().max().clamp_min(1e-30))
    assert err < tol, f"max |got - want| / max |want| = {err:.3g} >= {tol}"


# ------------------------------------------------------------------------------ quantizers and references
def test_quantize_groups_is_the_naive_group_quantizer():
    x = rows_of(6, 200)
    x[2] = 0  # an all-zero row: scale 1e-12, codes 0
    x[3, :64] *= 1e-6  # subnormal codes inside a group
    for group in (128, 64):
        q, s = quantize_groups(x, group)
        assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (6, -(-200 // group))
        back = q.double() * s.double().repeat_interleave(group, dim=1)[:, :200]
        assert torch.equal(back, torch.stack([_naive_group_quant(r, group) for r in x]))
        assert float(q.float().abs().max()) == 448.0 and not q[2].float().any()


def test_the_torch_reference_agrees_with_the_naive_one():
    codes, scales = experts(3, 200, 136, (128, 128))
    x = rows_of(9, 200)
    counts = [4, 0, 5]
    close(fp8_swiglu_reference(x, counts, codes, scales, (128, 128), rows=(2, 0, 1)),
          naive_fp8_experts(x, counts, codes, scales, (128, 128), rows=(2, 0, 1)))


def test_the_fast_path_is_cuda_only_and_says_why():
    assert "CUDA" in fast_path_reason(torch.device("cpu"), torch.float32, 256, 256, (128, 128))
    assert "CUDA" in check_fp8_kernel(torch.device("cpu"), torch.bfloat16, 256, 256, (128, 128))
    assert "K blocks" in fp8_kernels.supports((16, 16), 256, 256)
    assert fp8_kernels.supports((128, 128), 200, 136) is None and fp8_kernels.supports((1, 32), 8, 8) is None
    codes, scales = experts(2, 64, 64, (16, 16))
    w = SlotWeights.over_buffer(0, [0, 1], [0, 1], *codes, [0, 1], scales=scales, block=(16, 16))
    assert not Fp8Runner(make_runner("grouped")).fast(torch.zeros(1, 64), w)


# ------------------------------------------------------------------------------------------ the kernels
def test_quantize_rows_kernel_equals_quantize_groups(interpret):
    x = rows_of(7, 200)
    x[3] = 0
    x[4, :100] *= 1e-7
    x[5] *= 1e4
    for group in (128, 32):
        q, s = fp8_kernels.quantize_rows(x, group)
        qr, sr = quantize_groups(x, group)
        assert torch.equal(s, sr) and torch.equal(q.float(), qr.float())


CASES = {  # name: (counts per slot, d, f, block)
    "ragged": ([3, 0, 17, 1], 256, 256, (128, 128)),
    "one hot slot": ([0, 0, 33, 0], 256, 256, (128, 128)),
    "partial blocks": ([5, 0, 20], 200, 136, (128, 128)),  # K and N not multiples of 128
    "small blocks": ([4, 9], 96, 160, (32, 64)),  # 32-row scale blocks inside a 64-column tile
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_naive_reference(interpret, case):
    counts, d, f, block = CASES[case]
    codes, scales = experts(len(counts), d, f, block)
    x = rows_of(sum(counts), d)
    bounds = torch.tensor(list(accumulate(counts)), dtype=torch.int32)
    y = fp8_kernels.fp8_swiglu(x, bounds, codes, scales, block)
    assert y.dtype == x.dtype and y.shape == x.shape
    close(y, naive_fp8_experts(x, counts, codes, scales, block))


def test_every_row_block_and_padding_rows(interpret):
    counts, d, f, block = [16, 17, 0, 33], 128, 128, (128, 128)  # tile edges at 16 / 32 / 64 rows
    codes, scales = experts(4, d, f, block, seed=3)
    x = rows_of(sum(counts) + 5, d)  # 5 padding rows past bounds[-1]: never read, never written
    bounds = torch.tensor(list(accumulate(counts)), dtype=torch.int32)
    want = naive_fp8_experts(x[:66], counts, codes, scales, block)
    for bm in fp8_kernels.ROW_BLOCKS:
        close(fp8_kernels.fp8_swiglu(x, bounds, codes, scales, block, block_m=bm)[:66], want)
    with pytest.raises(ValueError, match="block_m"):
        fp8_kernels.fp8_swiglu(x, bounds, codes, scales, block, block_m=8)


@pytest.mark.parametrize("choice", [
    SwigluChoice(LaunchConfig(16, 128, 4, 3), LaunchConfig(64, 32, 4, 3)),  # gate/up and down tiled apart
    SwigluChoice(LaunchConfig(64, 128, 8, 5), LaunchConfig(16, 64, 8, 2)),
    SwigluChoice(LaunchConfig(128, 128, 8, 4), LaunchConfig(128, 128, 4, 3)),  # prefill tiles: one per slot here
], ids=str)
def test_every_launch_setting_computes_the_same_experts(interpret, choice):
    """The tuner's candidates (row tiles of their own per launch, 32 / 64-column down tiles over a d that is not a
    multiple of them) compute what the naive reference does; padding rows past the bounds stay unread."""
    counts, d, f, block = [16, 17, 0, 33], 200, 136, (128, 128)
    codes, scales = experts(4, d, f, block, seed=5)
    x = rows_of(sum(counts) + 3, d)
    bounds = torch.tensor(list(accumulate(counts)), dtype=torch.int32)
    close(fp8_kernels.fp8_swiglu(x, bounds, codes, scales, block, choice=choice)[:66],
          naive_fp8_experts(x[:66], counts, codes, scales, block))


@pytest.mark.parametrize("config", [LaunchConfig(16, 32, 4, 3), LaunchConfig(32, 64, 8, 5), LaunchConfig(64, 128, 4, 2),
                                    LaunchConfig(16, 64, 4, 3, split_k=2), LaunchConfig(32, 32, 4, 3, split_k=8)],
                         ids=str)
def test_every_dense_launch_setting_computes_the_same_linear(interpret, config):
    """``fp8_linear`` at the tuner's Triton candidates against its torch reference (out not a multiple of the
    column tile, rows not of the row tile; K split over more programs than it has blocks: the extra ones add
    zeros); scaled_mm is refused on CPU, naming why."""
    from ray_moe.model.fp8_linear import fp8_linear_reference

    g = torch.Generator().manual_seed(9)
    codes, scales = quantize(torch.randn(200, 136, generator=g) / 136 ** 0.5, (128, 128))
    x = torch.randn(37, 136, generator=g) * 3
    got = fp8_kernels.fp8_linear(x, codes, scales, (128, 128), choice=LinearChoice(LinearBackend.TRITON, config))
    close(got, fp8_linear_reference(x, codes, scales, (128, 128)))
    with pytest.raises(ValueError, match="scaled_mm takes CUDA"):
        fp8_kernels.fp8_linear(x, codes, scales, (128, 128), choice=LinearChoice(LinearBackend.SCALED_MM))


def test_kernel_reads_token_rows_through_the_order_and_slots_through_buffer_rows(interpret):
    counts, d, f, block = [6, 0, 11], 256, 128, (128, 128)
    codes, scales = experts(4, d, f, block, seed=5)  # a buffer of 4 rows; slots at rows 3, 0, 2
    hidden = rows_of(12, d)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(2))[:17].to(torch.int32)
    bounds = torch.tensor(list(accumulate(counts)), dtype=torch.int32)
    y = fp8_kernels.fp8_swiglu(hidden, bounds, codes, scales, block, order=order, top_k=2,
                               weight_rows=torch.tensor([3, 0, 2]))
    assert y.shape == (17, d)
    close(y, naive_fp8_experts(hidden[order.long() // 2], counts, codes, scales, block, rows=(3, 0, 2)))


def test_kernel_capacity_layout(interpret):
    valid, cap, d, f, block = [2, 0, 5, 9], 9, 128, 256, (128, 128)
    codes, scales = experts(4, d, f, block, seed=7)
    x = torch.zeros(4, cap, d)
    for q, n in enumerate(valid):
        x[q, :n] = rows_of(n, d, seed=q)
    y = fp8_kernels.fp8_swiglu_capacity(x, torch.tensor(valid), codes, scales, block)
    assert y.shape == x.shape
    for q, n in enumerate(valid):
        if n:
            close(y[q, :n], naive_fp8_experts(x[q, :n], [n], [t[q:q + 1] for t in codes],
                                              [s[q:q + 1] for s in scales], block))
        assert not y[q, n:].any()  # padding positions zero


def test_no_rows_and_refused_inputs(interpret):
    codes, scales = experts(2, 128, 128, (128, 128))
    assert fp8_kernels.fp8_swiglu(torch.zeros(0, 128), torch.zeros(2, dtype=torch.int32), codes, scales,
                                  (128, 128)).shape == (0, 128)
    with pytest.raises(ValueError, match="expected \\[N, 128\\]"):
        fp8_kernels.fp8_swiglu(torch.zeros(3, 64), torch.tensor([3, 3], dtype=torch.int32), codes, scales, (128, 128))
    with pytest.raises(ValueError, match="K blocks"):
        fp8_kernels.fp8_swiglu(torch.zeros(3, 128), torch.tensor([3, 3], dtype=torch.int32), codes, scales, (128, 16))
    with pytest.raises(ValueError, match="block scales"):
        fp8_kernels.fp8_swiglu(torch.zeros(3, 128), torch.tensor([3, 3], dtype=torch.int32), codes,
                               [scales[0], scales[1], torch.ones(2, 2, 1)], (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_kernels.fp8_swiglu(torch.zeros(3, 128), torch.tensor([3, 3], dtype=torch.int32),
                               [c.float() for c in codes], scales, (128, 128))


# -------------------------------------------------------------------------------- the runner's fast path
@pytest.mark.parametrize("rows", [(0, 1, 2), (3, 0, 2)])
def test_run_experts_takes_the_kernels_for_every_dispatch_format(interpret, monkeypatch, rows):
    """With the fast path on (on CUDA: ``check_fp8_kernel`` passed), every dispatch format and row mapping
    runs the FP8 kernels and matches the naive reference."""
    monkeypatch.setattr(fp8_runner, "fast_path_reason", lambda *a: None)
    calls = []
    for name in ("fp8_swiglu", "fp8_swiglu_capacity"):
        real = getattr(fp8_kernels, name)
        monkeypatch.setattr(fp8_kernels, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    d, f, block = 128, 128, (128, 128)
    codes, scales = experts(4, d, f, block, seed=11)
    w = SlotWeights.over_buffer(0, [0, 1, 2], [0, 1, 2], *codes, list(rows), scales=scales, block=block)
    assert w.row_mapped == (rows != (0, 1, 2))
    counts = [3, 0, 4]
    x = rows_of(7, d)
    want = naive_fp8_experts(x, counts, codes, scales, block, rows=rows)
    runner = make_runner("grouped")
    offsets = torch.tensor(list(accumulate(counts)), dtype=torch.int32)
    close(run_experts(runner, NormalDispatchOutput(rows=x, counts_list=tuple(counts), handle=HANDLE), w, d), want)
    got = run_experts(runner, LocalDispatchOutput(rows=torch.cat([x, torch.zeros(2, d)]), counts_list=(),
                                                  handle=HANDLE, offsets=offsets, valid=torch.tensor(counts)), w, d)
    close(got[:7], want)
    order = torch.tensor([5, 0, 3, 2, 7, 1, 6], dtype=torch.int32)  # top-2 routes of 4 tokens
    hidden = rows_of(4, d, seed=9)  # route r reads token r // 2
    assert Fp8Runner(runner).takes_indexed(hidden, 7, w)
    got = run_experts(runner, PlannedDispatchOutput(rows=hidden, counts_list=(), handle=HANDLE, order=order,
                                                    offsets=offsets, valid=torch.tensor(counts), top_k=2), w, d)
    close(got, naive_fp8_experts(hidden[order.long() // 2], counts, codes, scales, block, rows=rows))
    cap = torch.zeros(3, 4, d)
    for q, (a, b) in enumerate(zip([0, *offsets.tolist()[:-1]], offsets.tolist())):
        cap[q, :b - a] = x[a:b]
    got = run_experts(runner, BucketDispatchOutput(rows=cap, counts_list=(), handle=HANDLE,
                                                   valid=torch.tensor(counts)), w, d)
    close(torch.cat([got[0, :3], got[2, :4]]), want)
    assert calls == ["fp8_swiglu"] * 3 + ["fp8_swiglu_capacity"]
    # the reference path stays one flag away: unquantized activations, within their FP8 error of the kernels
    close(Fp8Runner(runner, kernels=False).run(x, counts, w), want, tol=0.1)
    assert len(calls) == 4


# ------------------------------------------------------------------------------- compiled for Hopper, no GPU
# the heuristic settings at each row tile, and the corners of the tuner's candidates (fp8_configs' ranges)
COMPILED = [fp8_kernels.launch_config(bm) for bm in fp8_kernels.ROW_BLOCKS] + [
    SwigluChoice(LaunchConfig(64, 128, 8, 5), LaunchConfig(64, 128, 8, 5)),
    SwigluChoice(LaunchConfig(128, 128, 8, 4), LaunchConfig(128, 128, 8, 5)),
    SwigluChoice(LaunchConfig(16, 128, 4, 2), LaunchConfig(16, 32, 4, 5))]


@pytest.mark.parametrize("choice", COMPILED, ids=str)
def test_the_kernels_compile_for_hopper(choice):
    """Triton's own compiler (no GPU needed) builds the three kernels for sm_90 at the serving shape's settings
    (pointers and d / f 16-divisible, as Triton specializes them at a launch), software-pipelined (async copies)
    and within an H100's 227 KiB of shared memory per block: the heuristic settings and the largest and smallest
    of the tuner's candidates."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("the kernels are built for the interpreter here, or run for real (test_fp8_kernels_gpu.py)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    quant, gate_up, down, _ = fp8_kernels._kernels()

    def build(fn, types, consts, warps, stages=3):
        sig = dict(zip([a for a in fn.arg_names if a not in consts], types.split()))
        attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t[0] == "*" or n in "DF"}
        k = triton.compile(ASTSource(fn, {**sig, **{c: "constexpr" for c in consts}}, consts, attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        assert k.metadata.shared <= 227 * 1024
        return k.asm["ttgir"]

    gu = build(gate_up, "*fp8e4nv *fp32 *fp8e4nv *fp8e4nv *fp32 *fp32 *i32 *i32 *i64 *fp8e4nv *fp32" + " i32" * 8,
               dict(B0=128, BLOCK_M=choice.gate_up.block_m, BLOCK_N=128, QP=128, TOP_K=8, GATHER=True, ROWS=True,
                    CAPACITY=False, EVEN_K=True, EVEN_N=True, FP8_MAX=448.0, SCALE_MIN=1e-12, EMULATE=False,
                    UNIFORM=True), choice.gate_up.warps, choice.gate_up.stages)
    dn = build(down, "*fp8e4nv *fp32 *fp8e4nv *fp32 *i64 *i64 *bf16" + " i32" * 8,
               dict(B0=128, BLOCK_M=choice.down.block_m, BLOCK_N=choice.down.block_n, BLOCK_K=128, QP=128, ROWS=False,
                    CAPACITY=True, EVEN_K=True, EVEN_N=True, SPLIT_K=1, UNIFORM=True), choice.down.warps,
               choice.down.stages)
    assert "async_copy" in gu and "async_copy" in dn  # the weight tiles stream through the pipeline
    lin = build(down, "*fp8e4nv *fp32 *fp8e4nv *fp32 *i32 *i32 *fp32" + " i32" * 8,  # a dense Linear, K split in 4
                dict(B0=128, BLOCK_M=choice.down.block_m, BLOCK_N=choice.down.block_n, BLOCK_K=128, QP=2, ROWS=False,
                     CAPACITY=False, EVEN_K=True, EVEN_N=True, SPLIT_K=4, UNIFORM=False), choice.down.warps,
                choice.down.stages)
    assert "async_copy" in lin
    build(quant, "*bf16 *fp8e4nv *fp32 i32 i32", dict(G=128, NGP=16, FP8_MAX=448.0, SCALE_MIN=1e-12, EMULATE=False), 4)


def test_one_weight_scale_per_tile_rescales_with_one_fma():
    """Where a tile's columns sit in one weight-scale block (every tile of 128 x 128 checkpoints), the K loop's FP32
    rescale is one FMA per accumulator element: the sm_90 PTX of the down kernel at 64 x 128 keeps (almost) no
    multiplies, against one per element (with the FMA) where each column reads its own scale."""
    import re

    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("the kernels are built for the interpreter here, or run for real (test_fp8_kernels_gpu.py)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    down = fp8_kernels._kernels()[2]

    def ptx(uniform: bool) -> str:
        consts = dict(B0=128, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, QP=128, ROWS=False, CAPACITY=False, EVEN_K=True,
                      EVEN_N=True, SPLIT_K=1, UNIFORM=uniform)
        sig = dict(zip([a for a in down.arg_names if a not in consts],
                       ("*fp8e4nv *fp32 *fp8e4nv *fp32 *i32 *i32 *bf16" + " i32" * 8).split()))
        src = ASTSource(down, {**sig, **{c: "constexpr" for c in consts}}, consts)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

    def muls(text: str) -> int:
        return len(re.findall(r"\bmul(\.rn)?\.f32", text))

    per_column, one = muls(ptx(False)), muls(ptx(True))
    assert per_column >= 64 and one <= per_column // 8, (per_column, one)
