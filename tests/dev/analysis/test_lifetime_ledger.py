"""Buffer lifetimes and safe release (spec 0x03D3-0x03D5): the baseline step's fourteen buffers with
shape-derived bytes, the 904-byte peak at epoch 4, and the release checker's rejections."""

from __future__ import annotations

import dataclasses

import pytest

from ray_moe.release.lifetimes import Buffer, LifetimeLedger, check_release
from ray_moe_dev.analysis.step_ledger import baseline_step_buffers, baseline_step_operations
from tests.dev.analysis.ledger_fixture import SLOTS_PER_RANK, TOKENS, C, D, fixture_count_matrix


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


def fixture_lifetimes() -> LifetimeLedger:
    return baseline_step_buffers(fixture_count_matrix(), D, TOKENS, SLOTS_PER_RANK)


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
    b = Buffer("x", 8, 1, 3)
    assert (b.live_at(0), b.live_at(1), b.live_at(2), b.live_at(3)) == (False, True, True, False)


def test_peak_follows_bytes_not_a_constant():
    led = baseline_step_buffers(C, 16, TOKENS, SLOTS_PER_RANK)  # wider rows move the peak
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
        LifetimeLedger(tuple(bufs))
    assert "'expert_output_return_payload'" in str(ei.value)
    assert "'returned_source_order_rows'" in str(ei.value)


def test_alias_group_allows_disjoint_reuse():
    a = Buffer("expert_output", 48, 4, 6, alias_group="g")
    b = Buffer("return_payload", 48, 6, 7, alias_group="g")  # [4,6) and [6,7) are disjoint
    assert LifetimeLedger((a, b)).peak == (48, 4)


def test_buffer_validation():
    with pytest.raises(ValueError, match=r"x.end=2: must be >= start=3"):
        Buffer("x", 1, 3, 2)
    assert not Buffer("x", 1, 3, 3).live_at(3)  # empty half-open lifetime
    with pytest.raises(ValueError, match=r"x.bytes=-1"):
        Buffer("x", -1, 0, 1)
    with pytest.raises(ValueError, match="duplicate buffer name 'x'"):
        LifetimeLedger((Buffer("x", 1, 0, 1), Buffer("x", 1, 1, 2)))


# ---------------------------------------------------------------------------------------------- 0x03D5


def _replace_op(ops, name, **kw):
    return tuple(dataclasses.replace(o, **kw) if o.name == name else o for o in ops)


def _replace_buf(bufs, name, **kw):
    return tuple(dataclasses.replace(b, **kw) if b.name == name else b for b in bufs)


def test_release_fixture_is_safe_and_last_readers_match_the_spec():
    led = fixture_lifetimes()
    report = check_release(led.buffers, baseline_step_operations())
    assert report.evidence == "analytical"
    last = {b: op for b, op, _ in report.last_reader}
    assert last == {b.name: b.last_completion for b in led.buffers}
    for name, op, tau in report.last_reader:
        assert led[name].end >= tau  # z_U >= max completion of its readers


def _mutations():
    bufs = fixture_lifetimes().buffers
    ops = baseline_step_operations()
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
        check_release(bufs, ops)
    assert str(ei.value).startswith(needle), str(ei.value)


def test_release_mutation_messages_are_distinct():
    msgs = []
    for bufs, ops in _mutations().values():
        with pytest.raises(ValueError) as ei:
            check_release(bufs, ops)
        msgs.append(str(ei.value).split(":")[0])
    assert len(set(msgs)) == len(msgs) == 6


def test_release_rejects_undeclared_references():
    bufs = fixture_lifetimes().buffers
    ops = baseline_step_operations()
    with pytest.raises(ValueError, match="missing dependency: operation 'expert_complete' waits for undeclared"):
        check_release(bufs, _replace_op(ops, "expert_complete", deps=("ghost",)))
    with pytest.raises(ValueError, match="unknown buffer: expert_complete.reads"):
        check_release(bufs, _replace_op(ops, "expert_complete", reads=("ghost",)))
    with pytest.raises(ValueError, match="write before allocation"):
        check_release(_replace_buf(bufs, "source_major_receive", start=3.5), ops)


def test_release_uses_declared_last_completion_without_a_reader():
    bufs = fixture_lifetimes().buffers
    ops = _replace_op(baseline_step_operations(), "handle_released", reads=())
    ops = _replace_op(ops, "output_ready", reads=("returned_source_order_rows",))
    # no operation reads the handle any more, but its release still waits for handle_released (epoch 9)
    with pytest.raises(ValueError, match="early handle release"):
        check_release(_replace_buf(bufs, "route_handle", end=8.5), ops)
