"""Expert runners: padded, grouped, block against the loop baseline and a naive per-row SwiGLU.

Golden values are the spec's frozen fixture (0x04A-0x04F, 0x0AD): counts [2,2,1,1,1,1], d=3, d_ff=4.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.moe.experts.runners import LoopRunner, make_runner
from ray_moe.moe.experts.runners.block import BlockRunner, make_block_diagonal_topology
from ray_moe.moe.experts.runners.grouped import (
    GroupedRunner,
    grouped_mm_available,
    segment_positions,
)
from ray_moe.moe.experts.runners.padded import PaddedRunner
from ray_moe.moe.experts.weights import SeededWeightSource, SlotWeights, swiglu
from ray_moe.core.types import RunnerKind

FIXTURE_COUNTS = [2, 2, 1, 1, 1, 1]
FIXTURE_SLOT_EXPERTS = [0, 0, 1, 1, 2, 3]  # q0,q1 -> e0; q2,q3 -> e1; q4 -> e2; q5 -> e3 (0x02B1)
D, F = 3, 4


def slot_weights(experts, d, f, dtype=torch.float32, seed=0, tagged=False) -> SlotWeights:
    src = SeededWeightSource(num_layers=1, num_experts=max(experts) + 1, hidden_size=d, ffn_size=f, seed=seed,
                             dtype=dtype, tagged=tagged)
    return SlotWeights.stack(0, list(range(len(experts))), [src.expert(0, e) for e in experts])


def naive(x: torch.Tensor, counts, w: SlotWeights) -> torch.Tensor:
    """Per-row float64 SwiGLU reference: row i of slot q -> E_q(x_i)."""
    out = []
    q_of_row = [q for q, c in enumerate(counts) for _ in range(c)]
    for i, q in enumerate(q_of_row):
        ew = w.expert_weights(q)
        out.append(swiglu(x[i:i + 1].double(), ew.w_gate.double(), ew.w_up.double(), ew.w_down.double()))
    return torch.cat(out) if out else torch.zeros(0, x.shape[1], dtype=torch.float64)


def fixture_runners():
    return {
        "padded": PaddedRunner(capacity=3, alignment=2),
        "grouped": GroupedRunner(),
        "block": BlockRunner(block_size=2, column_block=2),
    }


# ---------------------------------------------------------------------------------------------------
# Golden ledgers (0x04B, 0x04C, 0x04D, 0x04F, 0x0AD)
# ---------------------------------------------------------------------------------------------------

# kind: (executed rows, utilization, input values, intermediate values, FLOPs, metadata bytes)
TABLE_04F = {
    "padded": (24, 8 / 24, 72, 96, 1728, 24),
    "grouped": (8, 1.0, 24, 32, 576, 384),
    "block": (12, 8 / 12, 36, 48, 864, 172),
}


@pytest.mark.parametrize("kind", sorted(TABLE_04F))
def test_fixture_ledger_table_04f(kind):
    led = fixture_runners()[kind].ledger(FIXTURE_COUNTS, D, F)
    executed, util, inputs, inter, flops, meta = TABLE_04F[kind]
    assert led.kind is RunnerKind(kind)
    assert led.useful_rows == 8
    assert led.executed_rows == executed
    assert led.utilization == pytest.approx(util)
    assert led.input_values == inputs
    assert led.intermediate_values == inter
    assert led.flops == flops
    assert led.useful_flops == 576
    assert led.metadata_bytes == meta
    assert led.evidence == "analytical"


def test_padded_capacity_then_alignment_04b_04e():
    plan = PaddedRunner(capacity=3, alignment=2).plan(FIXTURE_COUNTS)
    assert (plan.capacity, plan.exec_capacity) == (3, 4)
    assert plan.capacity_rows == 18 and plan.capacity_unused == 10  # capacity alone: 18 slots, 10 unused
    assert plan.alignment_only == 6  # 6 more alignment-only rows
    assert plan.executed_rows == 24 and plan.waste == 16
    # Capacity without alignment reserves exactly the 18 slots.
    assert PaddedRunner(capacity=3).ledger(FIXTURE_COUNTS, D, F).executed_rows == 18


def test_alignment_four_is_local_work_0ad():
    runner = PaddedRunner(alignment=4)
    plan = runner.plan(FIXTURE_COUNTS)
    assert (plan.capacity, plan.exec_capacity) == (2, 4)
    assert plan.useful_rows == 8 and plan.executed_rows == 24 and plan.waste == 16
    assert runner.ledger(FIXTURE_COUNTS, D, F).executed_rows == 24


def test_capacity_below_max_count_raises_04g():
    with pytest.raises(ValueError, match=r"capacity=1.*max\(counts\)=2.*counts=\[2, 2, 1, 1, 1, 1\]"):
        PaddedRunner(capacity=1).plan(FIXTURE_COUNTS)
    w = slot_weights(FIXTURE_SLOT_EXPERTS, D, F)
    with pytest.raises(ValueError, match="capacity"):
        PaddedRunner(capacity=1).run(torch.randn(8, D), FIXTURE_COUNTS, w)


def test_grouped_descriptor_table_04c():
    desc = GroupedRunner().descriptors(FIXTURE_COUNTS, D, F)
    assert desc.table.shape == (6, 8) and desc.table.dtype == torch.int64
    assert desc.nbytes == 384
    assert desc.table[:, 0].tolist() == [2, 2, 1, 1, 1, 1]  # m
    assert desc.table[:, 3].tolist() == [0, 6, 12, 15, 18, 21]  # input offsets o_q * d, o = [0,2,4,5,6,7]
    assert desc.table[:, 4].tolist() == [q * F * D for q in range(6)]


def test_grouped_descriptors_keep_slot_identity_after_empty_slot_04g():
    desc = GroupedRunner().descriptors([2, 0, 1], D, F)
    assert desc.slots == (0, 2)
    assert desc.nbytes == 128
    assert desc.table[1].tolist() == [1, F, D, 2 * D, 2 * F * D, 2 * F * D, 2 * D * F, 2 * D]
    assert GroupedRunner().ledger([2, 0, 1], D, F).metadata_bytes == 128


def test_block_topology_04d():
    runner = BlockRunner(block_size=2, column_block=2)
    plan = runner.plan(FIXTURE_COUNTS)
    assert plan.padded_counts == (2, 2, 2, 2, 2, 2)
    assert plan.bins == (2, 4, 6, 8, 10, 12)
    topo = runner.topology(FIXTURE_COUNTS, F)
    assert topo.row_offsets.tolist() == [0, 2, 4, 6, 8, 10, 12]
    assert topo.column_indices.tolist() == list(range(12))
    assert topo.row_indices.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert topo.transpose_indices.tolist() == list(range(12))  # block-diagonal: CSC order = CSR order
    assert all(t.dtype == torch.int32 for t in (topo.row_offsets, topo.column_indices, topo.row_indices,
                                                topo.transpose_indices))
    assert topo.nnz == 12 and topo.nbytes == 172


def test_block_topology_transpose_with_two_row_blocks():
    # slot 0 has two row blocks sharing columns 0,1: CSC visits (r0,c0),(r1,c0),(r0,c1),(r1,c1).
    topo = BlockRunner(block_size=2, column_block=2).topology([3, 0], F)
    assert topo.row_offsets.tolist() == [0, 2, 4]
    assert topo.column_indices.tolist() == [0, 1, 0, 1]
    assert topo.row_indices.tolist() == [0, 0, 1, 1]
    assert topo.transpose_indices.tolist() == [0, 2, 1, 3]


def test_block_default_is_megablocks_128():
    r = BlockRunner()
    assert (r.block_size, r.column_block) == (128, 128)
    assert r.ledger(FIXTURE_COUNTS, D, F).executed_rows == 6 * 128


# ---------------------------------------------------------------------------------------------------
# Execution parity
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,f", [(3, 4), (8, 16)])  # the fixture widths (loop path) and aligned widths
@pytest.mark.parametrize("kind", ["padded", "grouped", "block"])
def test_fixture_outputs_match_loop_and_naive(kind, d, f):
    torch.manual_seed(1)
    w = slot_weights(FIXTURE_SLOT_EXPERTS, d, f, seed=7)
    x = torch.randn(8, d)
    y = fixture_runners()[kind].run(x, FIXTURE_COUNTS, w)
    assert y.shape == (8, d) and y.dtype == x.dtype
    torch.testing.assert_close(y, LoopRunner().run(x, FIXTURE_COUNTS, w), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y.double(), naive(x, FIXTURE_COUNTS, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["padded", "grouped", "block"])
def test_each_slot_uses_its_own_expert_tagged(kind):
    """Tagged weights: expert e = (e+1) * expert 0. A descriptor bound to the wrong slot shows up."""
    d, f = 8, 16
    w = slot_weights(FIXTURE_SLOT_EXPERTS, d, f, tagged=True)
    base = slot_weights([0] * 6, d, f, tagged=True)
    x = torch.randn(8, d)
    y = fixture_runners()[kind].run(x, FIXTURE_COUNTS, w)
    y0 = LoopRunner().run(x, FIXTURE_COUNTS, base)
    scale = torch.tensor([e + 1.0 for q, e in enumerate(FIXTURE_SLOT_EXPERTS) for _ in range(FIXTURE_COUNTS[q])])
    torch.testing.assert_close(y, y0 * scale[:, None], atol=1e-5, rtol=1e-5)


def test_backend_selection_follows_16_byte_rule():
    cpu = torch.device("cpu")
    assert grouped_mm_available(cpu, torch.float32, 8, 16)
    assert not grouped_mm_available(cpu, torch.float32, 3, 4)  # 12-byte rows
    assert not grouped_mm_available(cpu, torch.float32, 8, 6)  # 24-byte hidden rows
    assert not grouped_mm_available(cpu, torch.bfloat16, 4, 8)  # 8-byte rows in bf16
    assert grouped_mm_available(cpu, torch.bfloat16, 8, 16)
    assert not grouped_mm_available(cpu, torch.float64, 8, 16)
    w = slot_weights([0, 1], 3, 4)
    assert GroupedRunner().backend(torch.randn(2, 3), w) == "loop"
    with pytest.raises(ValueError, match="use_grouped_mm=True"):
        GroupedRunner(use_grouped_mm=True).run(torch.randn(2, 3), [1, 1], w)


@pytest.mark.parametrize("runner_cls", [GroupedRunner, BlockRunner])
def test_grouped_mm_path_equals_forced_loop(runner_cls):
    counts = [5, 0, 3, 0, 0, 9]
    w = slot_weights([0, 1, 2, 3, 4, 5], 16, 32)
    x = torch.randn(sum(counts), 16)
    fast, slow = runner_cls(use_grouped_mm=True), runner_cls(use_grouped_mm=False)
    assert fast.backend(x, w) == "grouped_mm" and slow.backend(x, w) == "loop"
    torch.testing.assert_close(fast.run(x, counts, w), slow.run(x, counts, w), atol=1e-5, rtol=1e-5)


def test_runners_keep_no_weight_copy():
    """Gate/up/down run as views of the stored stacks: no derived copy lands in weights.cache."""
    w = slot_weights([0, 1], 8, 16)
    x = torch.randn(3, 8)
    for kind in ("padded", "grouped", "block"):
        make_runner(kind).run(x, [2, 1], w)
    assert w.cache == {}


@pytest.mark.parametrize("kind", ["padded", "grouped", "block"])
def test_misaligned_and_strided_rows(kind):
    """A view starting 4 bytes into its storage and a strided view still give the loop's answer."""
    w = slot_weights([0, 1, 2], 8, 16)
    big = torch.randn(40)
    x = big[1:33].view(4, 8)  # data_ptr off by 4 bytes
    assert x.data_ptr() % 16 != 0
    counts = [1, 0, 3]
    ref = LoopRunner().run(x.clone(), counts, w)
    torch.testing.assert_close(make_runner(kind).run(x, counts, w), ref, atol=1e-6, rtol=1e-5)
    xt = torch.randn(8, 4).T  # non-contiguous [4, 8]
    torch.testing.assert_close(make_runner(kind).run(xt, counts, w), LoopRunner().run(xt.contiguous(), counts, w),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["padded", "grouped", "block"])
def test_no_rows(kind):
    w = slot_weights([0, 1], 8, 16)
    y = make_runner(kind).run(torch.zeros(0, 8), [0, 0], w)
    assert y.shape == (0, 8)
    led = make_runner(kind).ledger([0, 0], 8, 16)
    assert led.useful_rows == 0 and led.executed_rows == 0 and led.flops == 0


def test_segment_positions():
    slot, pos = segment_positions([2, 0, 3], "cpu")
    assert slot.tolist() == [0, 0, 2, 2, 2]
    assert pos.tolist() == [0, 1, 0, 1, 2]


@pytest.mark.parametrize("kind", ["padded", "grouped", "block"])
def test_bad_input_names_the_field(kind):
    w = slot_weights([0, 1], 8, 16)
    r = make_runner(kind)
    with pytest.raises(ValueError, match="counts"):
        r.run(torch.randn(3, 8), [3], w)  # one count for two slots
    with pytest.raises(ValueError, match="counts"):
        r.run(torch.randn(3, 8), [1, 1], w)  # sum 2 != 3 rows
    with pytest.raises(ValueError, match="counts"):
        r.run(torch.randn(1, 8), [2, -1], w)
    with pytest.raises(ValueError, match="x: dtype"):
        r.run(torch.randn(2, 8, dtype=torch.float64), [1, 1], w)
    with pytest.raises(ValueError, match="x: expected"):
        r.run(torch.randn(2, 5), [1, 1], w)


def test_constructor_errors():
    with pytest.raises(ValueError, match="alignment=0"):
        PaddedRunner(alignment=0)
    with pytest.raises(ValueError, match="capacity=-1"):
        PaddedRunner(capacity=-1)
    with pytest.raises(ValueError, match="block_size=0"):
        BlockRunner(block_size=0)
    with pytest.raises(ValueError, match="column_block=2.5"):
        BlockRunner(column_block=2.5)


def test_make_runner_kinds():
    assert isinstance(make_runner("padded", alignment=4), PaddedRunner)
    assert isinstance(make_runner(RunnerKind.GROUPED), GroupedRunner)
    assert make_runner("block", block_size=2).block_size == 2


# ---------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------


@st.composite
def cases(draw):
    q = draw(st.integers(1, 6))
    counts = draw(st.lists(st.integers(0, 20), min_size=q, max_size=q))
    d = draw(st.sampled_from([3, 4, 8, 12, 16]))
    f = draw(st.sampled_from([4, 6, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    kind = draw(st.sampled_from(["padded", "grouped", "block"]))
    if kind == "padded":
        extra = draw(st.none() | st.integers(0, 5))
        runner = PaddedRunner(capacity=None if extra is None else max(counts) + extra,
                              alignment=draw(st.integers(1, 5)))
    elif kind == "block":
        runner = BlockRunner(block_size=draw(st.integers(1, 8)), column_block=draw(st.integers(1, 8)))
    else:
        runner = GroupedRunner()
    seed = draw(st.integers(0, 2**16))
    return counts, d, f, dtype, runner, seed


@settings(max_examples=50, deadline=None)
@given(cases())
def test_property_runner_equals_naive(case):
    counts, d, f, dtype, runner, seed = case
    g = torch.Generator().manual_seed(seed)
    w = slot_weights(list(range(len(counts))), d, f, dtype=dtype, seed=seed)
    x = torch.randn(sum(counts), d, generator=g).to(dtype)
    y = runner.run(x, counts, w)
    assert y.shape == x.shape and y.dtype == dtype
    ref = naive(x, counts, w)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)


@settings(max_examples=50, deadline=None)
@given(cases())
def test_property_ledger_invariants(case):
    counts, d, f, _, runner, _ = case
    led = runner.ledger(counts, d, f)
    n = sum(counts)
    assert led.useful_rows == n and led.executed_rows >= n
    assert led.input_values == led.executed_rows * d
    assert led.intermediate_values == led.executed_rows * f
    assert led.flops == 6 * led.executed_rows * d * f and led.useful_flops == 6 * n * d * f
    if isinstance(runner, PaddedRunner):
        plan = runner.plan(counts)
        assert plan.exec_capacity % runner.alignment == 0 and plan.exec_capacity >= max(counts)
        assert led.executed_rows == len(counts) * plan.exec_capacity
    elif isinstance(runner, BlockRunner):
        b = runner.block_size
        assert led.executed_rows == sum(b * math.ceil(c / b) for c in counts)
        assert led.metadata_bytes == make_block_diagonal_topology(runner.plan(counts), f, runner.column_block).nbytes
    else:
        assert led.executed_rows == n
        assert led.metadata_bytes == 64 * sum(1 for c in counts if c) == runner.descriptors(counts, d, f).nbytes


# ---------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): the bf16 grouped_mm fast path with odd and empty segments
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["padded", "grouped", "block"])
def test_cuda_runners_match_loop(kind, dtype):
    counts = [0, 5, 1, 0, 130, 7, 0, 33]
    d, f = 256, 512
    w = slot_weights(list(range(len(counts))), d, f, dtype=dtype, seed=5)
    w = SlotWeights(w.layer, w.slot_ids, w.experts, w.w_gate.cuda(), w.w_up.cuda(), w.w_down.cuda())
    x = torch.randn(sum(counts), d, device="cuda").to(dtype)
    runner = make_runner(kind, **({"block_size": 16, "column_block": 16} if kind == "block" else {}))
    if kind != "padded":
        major, _ = torch.cuda.get_device_capability()
        fast = dtype == torch.bfloat16 and major in (9, 10)
        assert runner.backend(x, w) == ("grouped_mm" if fast else "loop")
    y = runner.run(x, counts, w)
    ref = naive(x.cpu(), counts, SlotWeights(w.layer, w.slot_ids, w.experts, w.w_gate.cpu(), w.w_up.cpu(),
                                             w.w_down.cpu()))
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y.cpu().double(), ref, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("counts,d,f", [([0, 5, 1, 0, 16, 7, 0, 33], 256, 512),  # empty slots, > 16 rows (row loop)
                                        ([1] * 8 + [0] * 120, 2048, 768),        # a decode step: most slots empty
                                        ([3, 0, 2, 9], 64, 96),                  # f not a multiple of 64
                                        ([0, 0, 0], 128, 64),                    # nothing routed
                                        ([100, 2, 0, 40], 128, 64),              # hot slots: many row blocks
                                        # a mixed step's rows (~110 a slot): the kernels' row loop, several
                                        # blocks a slot (the runner keeps grouped_mm there)
                                        ([90 + (7 * i) % 41 for i in range(128)], 2048, 768)])
def test_cuda_skinny_kernels_match_the_reference(counts, d, f):
    """The decode-size Triton kernels (device offsets, no host sync) against the float64 per-row loop, the
    grouped runner's choice of them at decode sizes, and padding rows past the last offset left unread."""
    from ray_moe.moe.experts.runners import skinny
    from ray_moe.moe.experts.runners.grouped import SKINNY_ROWS_PER_SLOT

    w = slot_weights(list(range(len(counts))), d, f, dtype=torch.bfloat16, seed=9)
    w = SlotWeights(w.layer, w.slot_ids, w.experts, w.w_gate.cuda(), w.w_up.cuda(), w.w_down.cuda())
    n = sum(counts)
    x = torch.randn(n + 3, d, device="cuda").to(torch.bfloat16)  # 3 padding rows past offsets[-1]
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    assert skinny.available(x, w.w_gate, w.w_down)
    y = skinny.skinny_swiglu(x, offsets, w.w_gate, w.w_up, w.w_down)
    ref = naive(x[:n].cpu(), counts, SlotWeights(w.layer, w.slot_ids, w.experts, w.w_gate.cpu(), w.w_up.cpu(),
                                                 w.w_down.cpu()))
    torch.testing.assert_close(y[:n].cpu().double(), ref, atol=5e-2, rtol=5e-2)
    for bm in skinny.ROW_BLOCKS:  # every row block, slots with more rows than one block included
        yb = skinny.skinny_swiglu(x, offsets, w.w_gate, w.w_up, w.w_down, block_m=bm)
        torch.testing.assert_close(yb[:n].cpu().double(), ref, atol=5e-2, rtol=5e-2)
    runner = GroupedRunner()
    via_runner = runner.run_offsets(x, offsets, w)
    if n + 3 <= SKINNY_ROWS_PER_SLOT * len(counts):
        torch.testing.assert_close(via_runner[:n], y[:n], atol=0, rtol=0)  # the runner took the kernels
    assert not skinny.available(x.float(), w.w_gate, w.w_down)  # fp32: grouped_mm / loop instead


def test_skinny_row_block_fits_a_slots_rows_in_one_block():
    """The row block holds the mean rows per slot plus 2.5 binomial deviations: 16 rows up to 128 decoding
    sequences over 128 experts with top-8 (8 rows per slot on average), 32 at 256 (16), 64 above ~21."""
    from ray_moe.moe.experts.runners import skinny

    assert skinny.row_block(8, 128) == 16 and skinny.row_block(1024, 128) == 16  # mean 8 + 2.5 x 2.83 = 15.1
    assert skinny.row_block(2048, 128) == 32  # mean 16 + 2.5 x 4 = 26
    assert skinny.row_block(2700, 128) == 64 and skinny.row_block(10**6, 8) == 64  # never above the largest
    assert skinny.row_block(0, 0) == 16


def test_skinny_kernels_are_cuda_only():
    """Off CUDA (or in float32) the grouped runner keeps its own paths: the kernels report unavailable."""
    from ray_moe.moe.experts.runners import skinny

    w = slot_weights([0, 1], 64, 32, dtype=torch.bfloat16)
    assert not skinny.available(torch.zeros(4, 64, dtype=torch.bfloat16), w.w_gate, w.w_down)
