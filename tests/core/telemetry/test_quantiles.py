"""Nearest-rank quantiles of 0x0DA."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.telemetry.quantiles import (
    EvidenceClass,
    QuantileSummary,
    nearest_rank,
    nearest_rank_index,
    summarize,
)

# CONSTRUCTED: the spec (0x0DA) states twenty positive synthetic units with p50=11, p95=23, max=24 but does
# not list them. This list is one sample consistent with those three numbers: sorted, x_(10)=11,
# x_(19)=23, x_(20)=24 (and x_(11)=12, x_(18)=21 differ, so an off-by-one rank would be caught).
TWENTY_UNITS = [17, 3, 24, 11, 5, 13, 7, 23, 8, 10, 4, 12, 16, 6, 21, 14, 9, 18, 15, 2]


def test_constructed_sample_shape():
    xs = sorted(TWENTY_UNITS)
    assert len(xs) == 20 and min(xs) > 0
    assert (xs[9], xs[10], xs[17], xs[18], xs[19]) == (11, 12, 21, 23, 24)


def test_golden_p50_p95_max():
    s = summarize(TWENTY_UNITS, unit="analytical units", evidence=EvidenceClass.ANALYTICAL)
    assert (s.n, s.p50, s.p95, s.max) == (20, 11, 23, 24)
    assert not s.is_latency  # synthetic units are not latency (0x0DA, 0x0EB)
    assert s.convention.startswith("nearest-rank")


def test_ranks_are_ceil_q_n():
    assert nearest_rank_index(0.5, 20) == 10
    assert nearest_rank_index(0.95, 20) == 19
    assert nearest_rank_index(1, 20) == 20
    assert nearest_rank_index(0.01, 20) == 1
    assert nearest_rank_index(0.5, 21) == 11
    # exact arithmetic: 0.07 * 100 is 7.000000000000001 in binary floating point
    assert nearest_rank_index(0.07, 100) == 7
    assert nearest_rank_index(Fraction(1, 3), 3) == 1
    assert nearest_rank_index("0.95", 40) == 38


def test_single_observation():
    assert nearest_rank([5.0], 0.5) == 5.0 and nearest_rank([5.0], 1) == 5.0


@pytest.mark.parametrize("q", [0, -0.1, 1.01, "x", True, None])
def test_bad_level_raises(q):
    with pytest.raises(ValueError, match="q="):
        nearest_rank([1, 2, 3], q)


@pytest.mark.parametrize(
    "sample, message", [([], "sample=\\[\\] is empty"), ([1, math.nan], "sample\\[1\\]=nan"),
                        ([1, math.inf], "sample\\[1\\]=inf"), (["a"], "sample\\[0\\]='a'")]
)
def test_bad_sample_raises(sample, message):
    with pytest.raises(ValueError, match=message):
        nearest_rank(sample, 0.5)


def test_summary_rejects_unordered_fields():
    with pytest.raises(ValueError, match="not ordered"):
        QuantileSummary(n=3, p50=5, p95=4, max=6, unit="s", evidence=EvidenceClass.MEASURED)


samples = st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=60)
levels = st.fractions(min_value=Fraction(1, 1000), max_value=1)


@settings(deadline=None, max_examples=80)
@given(samples, levels)
def test_quantile_is_an_element(xs, q):
    assert nearest_rank(xs, q) in xs


@settings(deadline=None, max_examples=80)
@given(samples, levels, levels)
def test_quantile_is_monotone_in_q(xs, q1, q2):
    lo, hi = min(q1, q2), max(q1, q2)
    assert nearest_rank(xs, lo) <= nearest_rank(xs, hi)


@settings(deadline=None, max_examples=80)
@given(samples, levels)
def test_at_least_q_of_the_sample_is_at_or_below(xs, q):
    v = nearest_rank(xs, q)
    below = sum(1 for x in xs if x <= v)
    assert Fraction(below, len(xs)) >= q
    assert nearest_rank(xs, 1) == max(xs)
