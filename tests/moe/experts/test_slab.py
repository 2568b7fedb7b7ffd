"""Row-mapped slot weights at the runner boundary (``moe.experts.slab`` through ``moe.layer.run_experts``): for
every dispatch output format and every runner kind, a generation that maps local slots onto arbitrary rows of a
slot buffer computes exactly what the plain stacked weights compute, and nothing is copied."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.moe.dispatch.bucket import BucketDispatchOutput
from ray_moe.moe.dispatch.local import LocalDispatchOutput
from ray_moe.moe.dispatch.records import DispatchOutputFormat, Handle, NormalDispatchOutput
from ray_moe.moe.experts import slab
from ray_moe.moe.experts.runners import make_runner
from ray_moe.moe.experts.weights import SeededWeightSource, SlotWeights, swiglu
from ray_moe.moe.layer import run_experts

D, F = 8, 12
HANDLE = Handle(handle_id="h", generation=1, layer=0, pg_epoch=0, rank=0)
RUNNERS = [("loop", {}), ("grouped", {}), ("grouped", {"use_grouped_mm": False}), ("padded", {}),
           ("padded", {"alignment": 4}), ("block", {"block_size": 2, "column_block": 4})]


def buffers(c: int, seed: int = 0, device: str = "cpu", dtype=torch.float32):
    """A slot buffer of ``c`` distinct experts: w_gate [c, F, D], w_up [c, F, D], w_down [c, D, F]."""
    src = SeededWeightSource(num_layers=1, num_experts=c, hidden_size=D, ffn_size=F, seed=seed, tagged=True)
    ws = [src.expert(0, e) for e in range(c)]
    return tuple(torch.stack([getattr(w, n) for w in ws]).to(device, dtype) for n in ("w_gate", "w_up", "w_down"))


def mapped_and_plain(rows, c, seed=0, device="cpu", dtype=torch.float32):
    bg, bu, bd = buffers(c, seed, device, dtype)
    q = len(rows)
    mapped = SlotWeights.over_buffer(0, [10 + i for i in range(q)], list(rows), bg, bu, bd, rows)
    plain = SlotWeights.stack(0, mapped.slot_ids, [mapped.expert_weights(i) for i in range(q)])
    return mapped, plain


def naive(x: torch.Tensor, counts, w: SlotWeights) -> torch.Tensor:
    """float64 per-segment SwiGLU in local slot order: x [N, d] -> [N, d]."""
    out, start = [], 0
    for q, c in enumerate(counts):
        e = w.expert_weights(q)
        out.append(swiglu(x[start:start + c].double(), e.w_gate.double(), e.w_up.double(), e.w_down.double()))
        start += c
    return torch.cat(out)


@st.composite
def layouts(draw):
    """(rows, C, counts): Q local slots mapped onto a buffer of C rows (a permutation's prefix, or with repeats)."""
    q = draw(st.integers(1, 6))
    c = q + draw(st.integers(0, 3))
    if draw(st.booleans()):
        rows = draw(st.permutations(list(range(c))))[:q]
    else:
        rows = draw(st.lists(st.integers(0, c - 1), min_size=q, max_size=q))
    counts = draw(st.lists(st.integers(0, 5), min_size=q, max_size=q))
    return tuple(rows), c, counts


@pytest.mark.parametrize("kind,options", RUNNERS)
@settings(max_examples=30, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 3))
def test_expert_major_host_counts_equal_the_stacked_run(kind, options, layout, seed):
    rows, c, counts = layout
    mapped, plain = mapped_and_plain(rows, c, seed)
    runner = make_runner(kind, **options)
    x = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(seed))
    y = run_experts(runner, NormalDispatchOutput(rows=x, counts_list=tuple(counts), handle=HANDLE), mapped, D)
    assert y.shape == x.shape
    if sum(counts):
        torch.testing.assert_close(y, runner.run(x, counts, plain), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y.double(), naive(x, counts, plain), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,options", RUNNERS)
@settings(max_examples=30, deadline=None)
@given(layout=layouts(), pad=st.integers(0, 4), seed=st.integers(0, 3))
def test_device_offsets_equal_the_stacked_run(kind, options, layout, pad, seed):
    rows, c, counts = layout
    mapped, plain = mapped_and_plain(rows, c, seed)
    runner = make_runner(kind, **options)
    n = sum(counts)
    x = torch.randn(n + pad, D, generator=torch.Generator().manual_seed(seed))
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    out = LocalDispatchOutput(rows=x, counts_list=(), handle=HANDLE, offsets=offsets, valid=torch.tensor(counts))
    assert out.format is DispatchOutputFormat.EXPERT_MAJOR_DEVICE_OFFSETS
    y = run_experts(runner, out, mapped, D)
    assert y.shape == x.shape
    ref = runner.run_offsets(x, offsets, plain)
    torch.testing.assert_close(y[:n], ref[:n], atol=1e-5, rtol=1e-5)  # rows past offsets[-1] are padding
    if n:
        torch.testing.assert_close(y[:n].double(), naive(x[:n], counts, plain), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,options", RUNNERS)
@pytest.mark.parametrize("with_valid", [True, False])
@settings(max_examples=20, deadline=None)
@given(layout=layouts(), extra=st.integers(0, 2), seed=st.integers(0, 3))
def test_slot_capacity_equals_the_stacked_run(kind, options, with_valid, layout, extra, seed):
    rows, c, counts = layout
    mapped, plain = mapped_and_plain(rows, c, seed)
    runner = make_runner(kind, **options)
    cap = max(counts) + extra
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(len(rows), cap, D)
    for q, n in enumerate(counts):
        x[q, :n] = torch.randn(n, D, generator=g)
    valid = torch.tensor(counts, dtype=torch.int64) if with_valid else None
    y = run_experts(runner, BucketDispatchOutput(rows=x, counts_list=(), handle=HANDLE, valid=valid), mapped, D)
    assert y.shape == x.shape
    ref = runner.run_capacity(x, plain, valid)
    for q, n in enumerate(counts):
        torch.testing.assert_close(y[q, :n], ref[q, :n], atol=1e-5, rtol=1e-5)
        if n:
            torch.testing.assert_close(y[q, :n].double(), naive(x[q, :n], [n], SlotWeights.stack(
                0, [0], [plain.expert_weights(q)])), atol=1e-4, rtol=1e-4)


def test_identity_rows_are_plain_views_and_a_mapping_copies_nothing():
    bg, bu, bd = buffers(5)
    plain = SlotWeights.over_buffer(0, [3, 4, 5], [0, 1, 2], bg, bu, bd, [0, 1, 2])
    assert not plain.row_mapped and plain.num_slots == 3 and plain.w_gate.shape == (3, F, D)
    assert plain.w_gate.data_ptr() == bg.data_ptr() and plain.w_down.data_ptr() == bd.data_ptr()
    mapped = SlotWeights.over_buffer(0, [3, 4, 5], [4, 0, 2], bg, bu, bd, [4, 0, 2])
    assert mapped.row_mapped and mapped.num_slots == 3 and mapped.rows == (4, 0, 2)
    assert mapped.w_gate.data_ptr() == bg.data_ptr() and mapped.w_up.data_ptr() == bu.data_ptr()
    assert torch.equal(mapped.expert_weights(0).w_down, bd[4]) and mapped.expert_weights(0).expert == 4
    idx = slab.slab_index(mapped)
    assert idx is slab.slab_index(mapped)  # built once
    assert idx.full.num_slots == 5 and idx.full.experts == (0, -1, 2, -1, 4)
    assert idx.full.w_gate.data_ptr() == bg.data_ptr() and not idx.full.row_mapped
    assert len(idx.passes) == 1


def test_shared_rows_take_one_capacity_pass_per_repeat():
    mapped, _ = mapped_and_plain((2, 0, 2, 2), 3)
    idx = slab.slab_index(mapped)
    assert [p[0].tolist() for p in idx.passes] == [[0, 1], [2], [3]]
    assert idx.before.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0]]


@pytest.mark.parametrize("bad,field", [([0, 5], "rows"), ([0], "rows")])
def test_bad_rows_are_refused_naming_the_field(bad, field):
    bg, bu, bd = buffers(3)
    with pytest.raises(ValueError, match=field):
        SlotWeights.over_buffer(0, [0, 1], [0, 1], bg, bu, bd, bad)


def test_translation_refuses_plain_weights_and_wrong_counts():
    bg, bu, bd = buffers(3)
    plain = SlotWeights.over_buffer(0, [0, 1], [0, 1], bg, bu, bd, [0, 1])
    with pytest.raises(ValueError, match="weights"):
        slab.slab_index(plain)
    mapped, _ = mapped_and_plain((1, 0), 3)
    with pytest.raises(ValueError, match="counts"):
        slab.run_counts(make_runner("loop"), torch.zeros(3, D), [1, 1], mapped)
    with pytest.raises(ValueError, match="offsets"):
        slab.run_offsets(make_runner("loop"), torch.zeros(3, D), torch.tensor([1, 2, 3], dtype=torch.int32), mapped)


# ---------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): the device-offset translation inside a CUDA graph capture
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["grouped", "loop"])
def test_cuda_device_offsets_translation_captures_in_a_graph(kind):
    counts = [3, 0, 5, 1]
    mapped, plain = mapped_and_plain((3, 0, 5, 2), 6, device="cuda", dtype=torch.bfloat16)
    plain = SlotWeights(0, plain.slot_ids, plain.experts, plain.w_gate.cuda(), plain.w_up.cuda(), plain.w_down.cuda())
    slab.slab_index(mapped)
    runner = make_runner(kind)
    n = sum(counts)
    x = torch.randn(n + 3, D, device="cuda").to(torch.bfloat16)
    offsets = torch.cumsum(torch.tensor(counts, device="cuda"), 0).to(torch.int32)
    out = LocalDispatchOutput(rows=x, counts_list=(), handle=HANDLE, offsets=offsets, valid=None)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_experts(runner, out, mapped, D)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run_experts(runner, out, mapped, D)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y[:n].float(), runner.run_offsets(x, offsets, plain)[:n].float(), atol=2e-2, rtol=2e-2)
