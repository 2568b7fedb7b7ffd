"""Analytical ledgers (spec 0x03C1, 0x03D1-0x03D6, 0x0AB, 0x0AD): computed from inputs, pinned to the
spec's golden numbers, and rebuilt from the real dispatch handles of the eight-route fixture."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.dispatch import ledger as L
from ray_moe.dispatch.engine import combine, dispatch
from ray_moe.dispatch.exchange.local import LocalExchangeGroup
from ray_moe.dispatch.records import RouteBatch
from ray_moe.placement.selector import ExplicitSelector
from ray_moe.testing import fixtures as fx
from ray_moe.types import PayloadFormat

C = [[1, 2, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]  # spec 0x03B
D = 3
TOKENS = 4  # two origin ranks x two tokens
SLOTS_PER_RANK = (1, 2, 2, 1)  # six slots of placement-v17
SLOT_COUNTS = (2, 2, 1, 1, 1, 1)  # spec 0x0AA n


def fixture_count_matrix() -> list[list[int]]:
    """C computed from the fixture's route table, not copied from the spec."""
    c = [[0] * 4 for _ in range(4)]
    for _, src, _, _, _, _, _, dst in fx.EIGHT_ROUTES:
        c[src][dst] += 1
    return c


def test_fixture_count_matrix_matches_spec():
    assert fixture_count_matrix() == C


# ---------------------------------------------------------------------------------------------- 0x03C1


def test_row_slots_padded_vs_all_to_all_v():
    rs = L.RowSlotLedger(fixture_count_matrix())
    assert rs.evidence == "analytical"
    assert (rs.useful_rows, rs.padded_rows, rs.padding_rows) == (8, 32, 24)
    assert (rs.local_rows, rs.remote_rows, rs.max_split, rs.num_ranks) == (2, 6, 2, 4)
    assert rs.send_rows == (4, 4, 0, 0)
    assert rs.recv_rows == (2, 3, 2, 1)


def test_row_slots_accept_tensor_and_follow_the_input():
    rs = L.RowSlotLedger(torch.tensor(C, dtype=torch.int64))
    assert rs.counts == tuple(tuple(r) for r in C)
    hotter = [row[:] for row in C]
    hotter[1][3] = 5  # one hot pair raises every cell's padded capacity
    h = L.RowSlotLedger(hotter)
    assert (h.useful_rows, h.padded_rows, h.padding_rows) == (12, 80, 68)


@pytest.mark.parametrize(
    "bad, needle",
    [
        ([[1, 2], [3]], "counts: row 1"),
        ([[1, -1], [0, 0]], "counts[0][1]=-1"),
        ([[1, 0.5], [0, 0]], "counts[0][1]=0.5"),
        ([], "counts: empty"),
    ],
)
def test_row_slots_reject_bad_matrices(bad, needle):
    with pytest.raises(ValueError) as ei:
        L.RowSlotLedger(bad)
    assert needle in str(ei.value)


def test_row_slots_reject_float_tensor():
    with pytest.raises(ValueError, match="counts: expected an integer count matrix"):
        L.RowSlotLedger(torch.tensor(C, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------- 0x03D1


def test_staging_payload_is_not_remote_payload():
    pl = L.PayloadLedger.from_counts(fixture_count_matrix(), D)
    assert pl.evidence == "analytical"
    assert (pl.rows, pl.remote_rows) == (8, 6)
    assert (pl.staging_dispatch_bytes, pl.staging_combine_bytes) == (48, 48)
    assert (pl.remote_dispatch_bytes, pl.remote_combine_bytes) == (36, 36)
    assert pl.remote_payload_bytes == 72


def test_payload_widths_come_from_dtypes():
    rep = L.Representation.from_dtypes(activation=torch.float8_e4m3fn, output=torch.float32)
    pl = L.PayloadLedger.from_counts(C, D, rep)
    assert (pl.staging_dispatch_bytes, pl.staging_combine_bytes) == (8 * 3 * 1, 8 * 3 * 4)
    assert (pl.remote_dispatch_bytes, pl.remote_combine_bytes) == (18, 72)


def test_payload_rejects_bad_fields():
    with pytest.raises(ValueError, match="remote_rows=7: exceeds rows=6"):
        L.PayloadLedger(6, 7, 3)
    with pytest.raises(ValueError, match="hidden_size=0"):
        L.PayloadLedger(6, 1, 0)
    with pytest.raises(ValueError, match="activation_bytes"):
        L.Representation(activation_bytes=0)


# ---------------------------------------------------------------------------------------------- 0x03D2


def test_transport_metadata_handle_and_control_tables():
    tl = L.TransportLedger(fixture_count_matrix(), SLOTS_PER_RANK, D)
    assert tl.evidence == "analytical"
    assert tl.dispatch_meta_bytes == 48  # 6 remote rows * 2 INT32
    assert tl.combine_meta_bytes == 24  # 6 remote rows * 1 INT32
    assert tl.route_handle_bytes == 256  # 8 routes * 8 INT32
    assert tl.count_matrix_bytes == 128
    assert tl.send_offsets_bytes == 160  # P (P + 1) INT64
    assert tl.recv_splits_bytes == 128
    assert tl.local_expert_offset_entries == 10
    assert tl.local_expert_offsets_bytes == 80
    assert tl.remote_logical_bytes == 144  # 36 + 36 + 48 + 24


def test_transport_slots_per_rank_must_match_ranks():
    with pytest.raises(ValueError, match="slots_per_rank: 3 entries for a 4-rank"):
        L.TransportLedger(C, (1, 2, 2), D)
    with pytest.raises(ValueError, match=r"slots_per_rank\[1\]"):
        L.TransportLedger(C, (1, -2, 2, 1), D)


# ---------------------------------------------------------------------------------------------- 0x03D3

SPEC_TABLE = {  # name: (bytes, start, end) from spec 0x03D3
    "input_hidden": (24, 0, 9),
    "route_handle": (256, 0, 9),
    "count_matrix": (128, 1, 7),
    "send_offsets": (160, 1, 7),
    "receive_splits": (128, 1, 7),
    "packed_send_payload": (48, 1, 3),
    "send_metadata": (64, 1, 3),
    "source_major_receive": (48, 2, 4),
    "local_expert_offsets": (80, 3, 5),
    "local_expert_input": (48, 3, 5),
    "expert_output_return_payload": (48, 4, 7),
    "return_metadata": (32, 4, 7),
    "returned_source_order_rows": (48, 6, 8),
    "output_hidden": (24, 7, 10),
}


def fixture_lifetimes() -> L.LifetimeLedger:
    return L.baseline_step_buffers(fixture_count_matrix(), D, TOKENS, SLOTS_PER_RANK)


def test_fourteen_buffers_bytes_derived_from_shapes():
    led = fixture_lifetimes()
    assert led.evidence == "analytical"
    assert {b.name: (b.bytes, b.start, b.end) for b in led.buffers} == SPEC_TABLE


def test_lifetime_total_and_peak():
    led = fixture_lifetimes()
    assert led.total_bytes == 1136
    assert led.peak == (904, 4)
    assert led.live_bytes(4) == 904
    # every epoch of the table, recomputed by hand from the intervals
    expected = {0: 280, 1: 808, 2: 856, 3: 872, 4: 904, 5: 776, 6: 824, 7: 352, 8: 304, 9: 24, 10: 0}
    assert {t: led.live_bytes(t) for t in expected} == expected
    assert set(led.live_names(4)) == {
        "input_hidden", "route_handle", "count_matrix", "send_offsets", "receive_splits",
        "local_expert_offsets", "local_expert_input", "expert_output_return_payload", "return_metadata",
    }


def test_half_open_interval_excludes_end():
    b = L.Buffer("x", 8, 1, 3)
    assert (b.live_at(0), b.live_at(1), b.live_at(2), b.live_at(3)) == (False, True, True, False)


def test_peak_follows_bytes_not_a_constant():
    led = L.baseline_step_buffers(C, 16, TOKENS, SLOTS_PER_RANK)  # wider rows move the peak
    rows_bytes = 8 * 16 * 2
    assert led["packed_send_payload"].bytes == rows_bytes
    assert led.total_bytes == 1136 - 5 * 48 + 5 * rows_bytes - 2 * 24 + 2 * (4 * 16 * 2)  # five [R,d], two [T,d]
    assert led.peak_bytes == max(led.live_bytes(t) for t in range(11))


def test_alias_group_rejects_two_live_members_naming_both():
    led = fixture_lifetimes()
    bufs = list(led.buffers)
    i = [b.name for b in bufs].index("returned_source_order_rows")
    bufs[i] = dataclasses.replace(bufs[i], alias_group="expert_output_return_payload")
    with pytest.raises(ValueError, match="overlapping live alias") as ei:
        L.LifetimeLedger(tuple(bufs))
    assert "'expert_output_return_payload'" in str(ei.value)
    assert "'returned_source_order_rows'" in str(ei.value)


def test_alias_group_allows_disjoint_reuse():
    a = L.Buffer("expert_output", 48, 4, 6, alias_group="g")
    b = L.Buffer("return_payload", 48, 6, 7, alias_group="g")  # [4,6) and [6,7) are disjoint
    assert L.LifetimeLedger((a, b)).peak == (48, 4)


def test_buffer_validation():
    with pytest.raises(ValueError, match=r"x.end=2: must be >= start=3"):
        L.Buffer("x", 1, 3, 2)
    assert not L.Buffer("x", 1, 3, 3).live_at(3)  # empty half-open lifetime
    with pytest.raises(ValueError, match=r"x.bytes=-1"):
        L.Buffer("x", -1, 0, 1)
    with pytest.raises(ValueError, match="duplicate buffer name 'x'"):
        L.LifetimeLedger((L.Buffer("x", 1, 0, 1), L.Buffer("x", 1, 1, 2)))


# ---------------------------------------------------------------------------------------------- 0x03D5


def _replace_op(ops, name, **kw):
    return tuple(dataclasses.replace(o, **kw) if o.name == name else o for o in ops)


def _replace_buf(bufs, name, **kw):
    return tuple(dataclasses.replace(b, **kw) if b.name == name else b for b in bufs)


def test_release_fixture_is_safe_and_last_readers_match_the_spec():
    led = fixture_lifetimes()
    report = L.check_release(led.buffers, L.baseline_step_operations())
    assert report.evidence == "analytical"
    last = {b: op for b, op, _ in report.last_reader}
    assert last == {b.name: b.last_completion for b in led.buffers}
    for name, op, tau in report.last_reader:
        assert led[name].end >= tau  # z_U >= max completion of its readers


def _mutations():
    bufs = fixture_lifetimes().buffers
    ops = L.baseline_step_operations()
    return {
        # send rows released when the host submitted them, before dispatch completes
        "early send release": (_replace_buf(bufs, "packed_send_payload", end=2), ops),
        # generation/handle retired after dispatch but before the output scatter
        "early handle release": (_replace_buf(bufs, "route_handle", end=8), ops),
        # expert input repack no longer waits for dispatch completion
        "missing dependency": (bufs, _replace_op(ops, "expert_input_ready", deps=("dispatch_packed",))),
        "cyclic event graph": (bufs, _replace_op(ops, "dispatch_packed", deps=("route_ready", "combine_complete"))),
        "epoch before dependency": (bufs, _replace_op(ops, "expert_complete", completes=3)),
        "overlapping live alias": (
            _replace_buf(bufs, "return_metadata", alias_group="expert_output_return_payload"), ops),
    }


@pytest.mark.parametrize("needle", list(_mutations()))
def test_release_mutations_are_rejected(needle):
    bufs, ops = _mutations()[needle]
    with pytest.raises(ValueError) as ei:
        L.check_release(bufs, ops)
    assert str(ei.value).startswith(needle), str(ei.value)


def test_release_mutation_messages_are_distinct():
    msgs = []
    for bufs, ops in _mutations().values():
        with pytest.raises(ValueError) as ei:
            L.check_release(bufs, ops)
        msgs.append(str(ei.value).split(":")[0])
    assert len(set(msgs)) == len(msgs) == 6


def test_release_rejects_undeclared_references():
    bufs = fixture_lifetimes().buffers
    ops = L.baseline_step_operations()
    with pytest.raises(ValueError, match="missing dependency: operation 'expert_complete' waits for undeclared"):
        L.check_release(bufs, _replace_op(ops, "expert_complete", deps=("ghost",)))
    with pytest.raises(ValueError, match="unknown buffer: expert_complete.reads"):
        L.check_release(bufs, _replace_op(ops, "expert_complete", reads=("ghost",)))
    with pytest.raises(ValueError, match="write before allocation"):
        L.check_release(_replace_buf(bufs, "source_major_receive", start=3.5), ops)


def test_release_uses_declared_last_completion_without_a_reader():
    bufs = fixture_lifetimes().buffers
    ops = _replace_op(L.baseline_step_operations(), "handle_released", reads=())
    ops = _replace_op(ops, "output_ready", reads=("returned_source_order_rows",))
    # no operation reads the handle any more, but its release still waits for handle_released (epoch 9)
    with pytest.raises(ValueError, match="early handle release"):
        L.check_release(_replace_buf(bufs, "route_handle", end=8.5), ops)


# ---------------------------------------------------------------------------------------------- 0x03D6


def test_regular_padding_fixture():
    pd = L.PaddingLedger.from_counts(fixture_count_matrix(), D)
    assert pd.evidence == "analytical"
    assert pd.padded_dispatch_bytes == 192
    assert pd.padded_round_trip_bytes == 384
    assert pd.useful_dispatch_bytes == 48
    assert pd.useful_round_trip_bytes == 96
    assert pd.reservation_ratio == 4.0


def test_regular_padding_large_shape():
    pl = L.PayloadLedger.from_shape(num_tokens=4096, top_k=2, hidden_size=4096, remote_fraction=0.75)
    assert pl.staging_dispatch_bytes == 64 * L.MIB
    assert pl.staging_round_trip_bytes == 128 * L.MIB
    assert pl.remote_payload_bytes == 96 * L.MIB
    assert pl.remote_rows == 6144


def test_remote_fraction_must_give_whole_rows():
    with pytest.raises(ValueError, match="remote_fraction=0.3"):
        L.PayloadLedger.from_shape(num_tokens=1, top_k=2, hidden_size=8, remote_fraction=0.3)
    with pytest.raises(ValueError, match="remote_fraction=1.5"):
        L.PayloadLedger.from_shape(num_tokens=1, top_k=2, hidden_size=8, remote_fraction=1.5)


# ---------------------------------------------------------------------------------------------- 0x0AB / 0x0AD


def test_fp8_payload_table():
    table = L.precision_table(6, (3, 16, 7168))
    got = {d: tuple(table[d][f].total_bytes for f in PayloadFormat) for d in table}
    assert [f.value for f in PayloadFormat] == ["native", "fp8_row", "fp8_block128"]
    assert got == {3: (36, 42, 42), 16: (192, 120, 120), 7168: (86016, 43032, 44352)}
    row = table[7168][PayloadFormat.FP8_BLOCK128]
    assert (row.data_bytes, row.scales_per_row, row.scale_total_bytes) == (43008, 56, 1344)
    assert row.evidence == "analytical"


def test_fp8_is_not_smaller_for_tiny_rows():
    t = L.precision_table(6, (3,))[3]
    assert t[PayloadFormat.FP8_ROW].total_bytes > t[PayloadFormat.NATIVE].total_bytes
    assert t[PayloadFormat.FP8_ROW].data_bytes < t[PayloadFormat.NATIVE].data_bytes  # scales dominate


def test_precision_ledger_rejects_unknown_format():
    with pytest.raises(ValueError, match="fmt: unknown payload format 'fp4'"):
        L.PrecisionPayloadLedger(6, 3, "fp4")


def test_alignment_is_local_work_not_remote_rows():
    al = L.AlignmentLedger(SLOT_COUNTS, 4)
    assert al.evidence == "analytical"
    assert (al.useful_rows, al.executed_rows, al.align_waste_rows) == (8, 24, 16)
    assert al.executed_per_slot == (4, 4, 4, 4, 4, 4)
    assert L.AlignmentLedger((0, 5), 4).executed_per_slot == (0, 8)
    with pytest.raises(ValueError, match="alignment=0"):
        L.AlignmentLedger(SLOT_COUNTS, 0)


# ---------------------------------------------------------------------------------------------- whole step


def _golden(step: L.StepLedger) -> None:
    assert step.evidence == "analytical"
    assert (step.rows.useful_rows, step.rows.padded_rows, step.rows.padding_rows) == (8, 32, 24)
    assert (step.payload.staging_dispatch_bytes, step.payload.staging_combine_bytes) == (48, 48)
    assert (step.payload.remote_dispatch_bytes, step.payload.remote_combine_bytes) == (36, 36)
    t = step.transport
    assert (t.dispatch_meta_bytes, t.combine_meta_bytes, t.route_handle_bytes) == (48, 24, 256)
    assert (t.count_matrix_bytes, t.send_offsets_bytes, t.recv_splits_bytes) == (128, 160, 128)
    assert (t.local_expert_offsets_bytes, t.remote_logical_bytes) == (80, 144)
    assert (step.padding.padded_dispatch_bytes, step.padding.padded_round_trip_bytes) == (192, 384)
    assert (step.buffers.total_bytes, step.buffers.peak) == (1136, (904, 4))
    assert step.slot_counts == SLOT_COUNTS
    assert step.slots_per_rank == SLOTS_PER_RANK
    assert step.alignment is not None
    assert (step.alignment.executed_rows, step.alignment.align_waste_rows) == (24, 16)


def test_step_ledger_from_declared_shapes():
    _golden(L.StepLedger(C, SLOT_COUNTS, SLOTS_PER_RANK, TOKENS, D, row_alignment=4))


def test_step_ledger_rejects_non_conserving_slot_counts():
    with pytest.raises(ValueError, match="slot_counts: sum 9 != routes in the count matrix 8"):
        L.StepLedger(C, (3, 2, 1, 1, 1, 1), SLOTS_PER_RANK, TOKENS, D)


def _run_fixture_step():
    """The eight-route fixture through the real SPMD data path (local exchange, four ranks)."""
    snap = fx.snapshot()
    sel = ExplicitSelector({o: fx.route_tensors(o)[3] for o in (0, 1)})
    grp = LocalExchangeGroup(fx.flat_group())

    def step(ex):
        h, ids, g, _ = fx.route_tensors(ex.rank)
        out = dispatch(RouteBatch(ex.rank, h, ids, g), snap, ex, selector=sel, tag="ledger")
        slots = out.handle.receive.slot_ids
        scale = torch.tensor([fx.SCALES[int(snap.phy2log[q])] for q in slots.tolist()], dtype=out.rows.dtype)
        y = out.rows * torch.repeat_interleave(scale, out.expert_counts)[:, None]
        res = combine(y, out.handle, snap, ex, tag="ledger", out_dtype=torch.float64)
        return out.handle, res

    return grp.run(step)


@pytest.fixture(scope="module")
def fixture_step():
    return _run_fixture_step()


def test_ledger_from_real_handles(fixture_step):
    handles = [h for h, _ in fixture_step]
    for rank, (_, out) in enumerate(fixture_step):  # the data path really ran
        if rank in fx.EXPECTED_OUTPUT:
            assert torch.allclose(out, torch.tensor(fx.EXPECTED_OUTPUT[rank], dtype=torch.float64), rtol=1e-6)
    step = L.ledger_from_handles(handles, hidden_size=D, row_alignment=4)
    _golden(step)
    assert step.num_tokens == TOKENS
    d = step.as_dict()
    assert d["evidence"] == "analytical" and d["transport"]["remote_logical_bytes"] == 144
    assert d["buffers"]["peak_bytes"] == 904


def test_ledger_from_handles_order_independent(fixture_step):
    handles = [h for h, _ in fixture_step]
    a = L.ledger_from_handles(handles[::-1], hidden_size=D)
    assert a.counts == tuple(tuple(r) for r in C) and a.slot_counts == SLOT_COUNTS


def test_ledger_from_handles_rejects_inconsistent_inputs(fixture_step):
    handles = [h for h, _ in fixture_step]
    with pytest.raises(ValueError, match="handles: empty"):
        L.ledger_from_handles([], hidden_size=D)
    with pytest.raises(ValueError, match=r"handles: ranks \[0, 1, 2\] do not cover the 4 ranks"):
        L.ledger_from_handles(handles[:3], hidden_size=D)
    with pytest.raises(ValueError, match=r"handles\[3\].rank=2: two handles for one rank"):
        L.ledger_from_handles(handles[:3] + [handles[2]], hidden_size=D)
    other = torch.tensor(C)
    other[1, 3] = 2
    bad = dataclasses.replace(handles[2], count_matrix=other)
    with pytest.raises(ValueError, match=r"handles\[2\].count_matrix=.*differs from rank 0"):
        L.ledger_from_handles(handles[:2] + [bad] + handles[3:], hidden_size=D)
    short = dataclasses.replace(handles[1].receive, expert_counts=torch.tensor([2, 0]))
    bad = dataclasses.replace(handles[1], receive=short)
    with pytest.raises(ValueError, match=r"handles\[rank 1\].receive.expert_counts=\[2, 0\]: sum 2 != column sum 3"):
        L.ledger_from_handles([handles[0], bad] + handles[2:], hidden_size=D)


# ---------------------------------------------------------------------------------------------- properties


square = st.integers(min_value=1, max_value=5).flatmap(
    lambda p: st.lists(st.lists(st.integers(0, 9), min_size=p, max_size=p), min_size=p, max_size=p)
)


@settings(max_examples=40, deadline=None)
@given(counts=square, d=st.integers(1, 64))
def test_ledger_identities(counts, d):
    rs = L.RowSlotLedger(counts)
    p = len(counts)
    assert rs.local_rows + rs.remote_rows == rs.useful_rows == sum(map(sum, counts))
    assert rs.padded_rows >= rs.useful_rows
    assert sum(rs.send_rows) == sum(rs.recv_rows) == rs.useful_rows
    pl = L.PayloadLedger.from_counts(counts, d)
    assert pl.remote_payload_bytes <= pl.staging_round_trip_bytes
    tl = L.TransportLedger(counts, (1,) * p, d)
    assert tl.remote_logical_bytes == rs.remote_rows * (d * 4 + 2 * 4 + 1 * 4)
    assert tl.send_offsets_bytes - tl.count_matrix_bytes == p * 8
