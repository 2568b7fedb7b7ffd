"""Ratios of 0x0D: golden aggregate of the four fixture cells, denominators, zero-denominator handling."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.telemetry.ratios import (
    RATIO_DEFINITIONS,
    Ratio,
    RatioKind,
    WorkloadCell,
    aggregate,
    cell_ratio,
)
from ray_moe.core.types import Phase

REL = "m66-placement-v19-canary-01"


def spec_cells() -> list[WorkloadCell]:
    """The four synthetic cells of 0x0D, column by column from the spec table."""
    return [
        WorkloadCell(REL, "prefill", 40, 320, 320, 0, 240, 120, 0, 0, name="prefill uniform"),
        WorkloadCell(REL, "decode", 100, 200, 200, 0, 120, 60, 96, 4, name="decode fixed bucket"),
        WorkloadCell(REL, "decode", 80, 160, 158, 2, 120, 70, 70, 10, name="decode hot expert"),
        WorkloadCell(REL, "mixed", 20, 120, 120, 0, 90, 50, 10, 10, name="mixed burst"),
    ]


def test_golden_aggregate_of_the_four_cells():
    agg = aggregate(spec_cells())
    assert (agg.attempted, agg.accepted, agg.dropped, agg.steps) == (800, 798, 2, 240)
    assert (agg.drop.numerator, agg.drop.denominator) == (2, 800)
    assert agg.drop.fraction == Fraction(1, 400) and agg.drop.value == 0.0025
    assert (agg.remote.numerator, agg.remote.denominator) == (570, 798)
    assert agg.remote.value == pytest.approx(0.714286, abs=5e-7)
    assert (agg.inter_node.numerator, agg.inter_node.denominator) == (300, 798)
    assert agg.inter_node.value == pytest.approx(0.375940, abs=5e-7)
    assert (agg.graph_replay.numerator, agg.graph_replay.denominator) == (176, 200)
    assert agg.graph_replay.fraction == Fraction(88, 100)
    assert (agg.fallback.numerator, agg.fallback.denominator) == (24, 240)
    assert agg.fallback.fraction == Fraction(1, 10)
    assert [r.name for r in agg] == [
        "moe_route_drop_ratio", "moe_remote_route_ratio", "moe_inter_node_route_ratio",
        "moe_graph_replay_ratio", "moe_fallback_step_ratio",
    ]
    assert agg.by_kind()[RatioKind.REMOTE] is agg.remote


def test_remote_uses_accepted_not_attempted():
    # 570/800 answers a different question (0x0D): the aggregate must not produce it.
    agg = aggregate(spec_cells())
    assert agg.remote.denominator == 798
    assert agg.remote.value != pytest.approx(570 / 800)


def test_pooled_ratio_is_not_the_mean_of_cell_ratios():
    cells = spec_cells()
    mean = sum(cell_ratio(RatioKind.FALLBACK, c).value for c in cells) / len(cells)
    assert aggregate(cells).fallback.value == pytest.approx(0.10)
    assert mean == pytest.approx((0 + 0.04 + 0.125 + 0.5) / 4)
    assert mean != pytest.approx(0.10)


def test_per_cell_ratios():
    hot = spec_cells()[2]
    assert cell_ratio(RatioKind.DROP, hot) == Ratio("moe_route_drop_ratio", 2, 160)
    assert cell_ratio(RatioKind.GRAPH_REPLAY, hot) == Ratio("moe_graph_replay_ratio", 70, 80)
    prefill = spec_cells()[0]
    # prefill replays no graph and falls back never: graph ratio has no observations, not 0
    assert cell_ratio(RatioKind.GRAPH_REPLAY, prefill).value is None
    assert cell_ratio(RatioKind.FALLBACK, prefill).value == 0.0


def test_zero_denominator_is_none_never_zero():
    r = Ratio("moe_route_drop_ratio", 0, 0)
    assert r.value is None and r.fraction is None
    assert r.render() == "0/0 = n/a"
    empty = aggregate([])
    assert all(x.value is None for x in empty)


def test_ratio_add_pools_counts():
    a = Ratio("x", 1, 4) + Ratio("x", 3, 4)
    assert (a.numerator, a.denominator, a.value) == (4, 8, 0.5)
    with pytest.raises(ValueError, match="cannot be pooled"):
        Ratio("x", 1, 2) + Ratio("y", 1, 2)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(numerator=3, denominator=2), "numerator=3 exceeds denominator=2"),
        (dict(numerator=-1, denominator=2), "numerator=-1"),
        (dict(numerator=1, denominator=2.0), "denominator=2.0"),
        (dict(numerator=True, denominator=2), "numerator=True"),
    ],
)
def test_ratio_rejects_bad_counts(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Ratio("moe_route_drop_ratio", **kwargs)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(accepted=319), "attempted=320 != accepted=319 \\+ dropped=0"),
        (dict(remote=321, accepted=320), "remote=321 exceeds accepted=320"),
        (dict(inter_node=241), "inter_node=241 exceeds remote=240"),
        (dict(replay=30, fallback=11), "replay=30 \\+ fallback=11 exceeds steps=40"),
        (dict(phase="training"), "phase='training'"),
        (dict(release=""), "release=''"),
        (dict(steps=-1), "steps=-1"),
    ],
)
def test_cell_rejects_inconsistent_counts(change, message):
    base = dict(release=REL, phase="prefill", steps=40, attempted=320, accepted=320, dropped=0, remote=240,
                inter_node=120, replay=0, fallback=0)
    with pytest.raises(ValueError, match=message):
        WorkloadCell(**{**base, **change})


def test_cell_accepts_phase_enum():
    c = WorkloadCell(REL, Phase.DECODE, 1, 1, 1, 0, 0, 0, 1, 0)
    assert c.phase == "decode"


def test_aggregate_refuses_mixed_releases():
    cells = spec_cells()
    other = WorkloadCell("other-release", "prefill", 1, 1, 1, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="cells\\[4\\].release='other-release'"):
        aggregate([*cells, other])


def test_definitions_table_names_the_terms():
    d = RATIO_DEFINITIONS
    assert (d[RatioKind.REMOTE].numerator_label, d[RatioKind.REMOTE].denominator_label) == (
        "remote routes", "accepted routes")
    assert d[RatioKind.GRAPH_REPLAY].denominator_label == "replay + fallback"
    assert d[RatioKind.FALLBACK].denominator_label == "all steps"


cell_strategy = st.builds(
    lambda acc, drop, rem_frac, inter_frac, steps, rp, fb: WorkloadCell(
        REL, "decode", steps + rp + fb, acc + drop, acc, drop, int(acc * rem_frac), int(int(acc * rem_frac) * inter_frac),
        rp, fb),
    st.integers(0, 500), st.integers(0, 20), st.floats(0, 1), st.floats(0, 1),
    st.integers(0, 50), st.integers(0, 50), st.integers(0, 50),
)


@settings(deadline=None, max_examples=60)
@given(st.lists(cell_strategy, max_size=6))
def test_aggregate_is_order_independent_and_additive(cells):
    agg = aggregate(cells)
    assert agg == aggregate(list(reversed(cells)))
    for kind, d in RATIO_DEFINITIONS.items():
        r = agg.by_kind()[kind]
        assert r.numerator == sum(d.numerator(c) for c in cells)
        assert r.denominator == sum(d.denominator(c) for c in cells)
        assert r.value is None or 0.0 <= r.value <= 1.0
        assert (r.value is None) == (r.denominator == 0)
