"""Promotion gate of 0x0DC: the exact conjunction, every failed clause listed."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.release.faults import FAULT_TABLE, check_fault, fault_report
from ray_moe.release.gate import (
    CLAUSES,
    GateClause,
    GateEvidence,
    GateThresholds,
    GateVerdict,
    PromotionGate,
    RatioCounts,
    gather_evidence,
)
from ray_moe.core.telemetry.metrics import MetricName, Telemetry
from tests.core.telemetry.test_ratios import spec_cells

REL = "m66-placement-v19-canary-01"


def spec_evidence(**overrides) -> GateEvidence:
    """The fixture evidence: aggregate r_drop = 2/800 and r_fallback = 24/240 (0x0D), all checks OK, zero
    counters. N_shadow = 100 and N_canary = 200 are CONSTRUCTED at the 0x0DC bounds (the spec does not
    list them; it says the fixture passes), so a one-less mutation must fail."""
    base = dict(
        release_id=REL, hash_ok=True, manifest_ok=True, faults_ok=True, rollback_ok=True,
        n_shadow=100, n_canary=200,
        drop=RatioCounts(numerator=2, denominator=800), fallback=RatioCounts(numerator=24, denominator=240),
        route_mismatches=0, stale_accepts=0, count_failures=0,
    )
    return GateEvidence(**{**base, **overrides})


def test_fixture_passes():
    v = PromotionGate().evaluate(spec_evidence())
    assert v.passed and v.failed == ()
    assert [r.clause for r in v.results] == list(GateClause)
    assert len(v.results) == 11
    r_drop = next(r for r in v.results if r.clause is GateClause.R_DROP)
    assert r_drop.observed == "2/800 = 0.0025" and r_drop.required == "<= 0.005"
    assert "promote" in v.describe()


SINGLE_MUTATIONS = [
    (dict(hash_ok=False), GateClause.HASH_OK),
    (dict(manifest_ok=False), GateClause.MANIFEST_OK),
    (dict(faults_ok=False), GateClause.FAULTS_OK),
    (dict(rollback_ok=False), GateClause.ROLLBACK_OK),
    (dict(n_shadow=99), GateClause.N_SHADOW),
    (dict(n_canary=199), GateClause.N_CANARY),
    (dict(drop=RatioCounts(numerator=5, denominator=800)), GateClause.R_DROP),  # 0.00625
    (dict(fallback=RatioCounts(numerator=37, denominator=240)), GateClause.R_FALLBACK),  # 0.154
    (dict(route_mismatches=1), GateClause.ROUTE_MISMATCH),
    (dict(stale_accepts=1), GateClause.STALE_ACCEPT),
    (dict(count_failures=1), GateClause.COUNT_FAILURE),
]


@pytest.mark.parametrize("change, clause", SINGLE_MUTATIONS, ids=[c.value for _, c in SINGLE_MUTATIONS])
def test_single_clause_mutation_fails_with_that_clause_named(change, clause):
    v = PromotionGate().evaluate(spec_evidence(**change))
    assert not v.passed
    assert v.failed == (clause,)
    assert f"{clause.value}: observed" in v.describe()


def test_every_failed_clause_is_listed_not_just_the_first():
    every = {k: v for change, _ in SINGLE_MUTATIONS for k, v in change.items()}
    v = PromotionGate().evaluate(spec_evidence(**every))
    assert v.failed == tuple(GateClause)
    assert v.describe().startswith(f"release {REL}: blocked by 11 clause(s)")


def test_boundaries_are_inclusive_and_exact():
    gate = PromotionGate()
    # 4/800 is exactly 0.005 and 36/240 exactly 0.15: both hold (exact fractions, no float slop)
    assert gate.evaluate(spec_evidence(drop=RatioCounts(numerator=4, denominator=800),
                                       fallback=RatioCounts(numerator=36, denominator=240))).passed
    assert gate.evaluate(spec_evidence(drop=RatioCounts(numerator=5, denominator=1000))).passed
    assert gate.evaluate(spec_evidence(drop=RatioCounts(numerator=5001, denominator=1_000_000))).failed == (
        GateClause.R_DROP,)


def test_zero_denominator_fails_the_ratio_clause():
    v = PromotionGate().evaluate(spec_evidence(drop=RatioCounts(numerator=0, denominator=0)))
    assert v.failed == (GateClause.R_DROP,)
    assert "no observations" in v.describe()


def test_thresholds_are_configurable():
    strict = PromotionGate(GateThresholds(min_shadow=1000, max_fallback=Decimal("0.05")))
    assert strict.evaluate(spec_evidence()).failed == (GateClause.N_SHADOW, GateClause.R_FALLBACK)
    lenient = PromotionGate(GateThresholds(max_route_mismatches=2))
    assert lenient.evaluate(spec_evidence(route_mismatches=2)).passed
    with pytest.raises(ValueError, match="max_drop"):
        GateThresholds(max_drop=Decimal("1.5"))
    assert PromotionGate().thresholds == GateThresholds(min_shadow=100, min_canary=200, max_drop=Decimal("0.005"),
                                                       max_fallback=Decimal("0.15"))


def test_verdict_cannot_claim_a_pass_it_did_not_earn():
    v = PromotionGate().evaluate(spec_evidence(n_canary=0))
    with pytest.raises(ValueError, match="not the conjunction"):
        GateVerdict(release_id=REL, passed=True, results=v.results)
    with pytest.raises(ValueError, match="not every clause"):
        GateVerdict(release_id=REL, passed=True, results=v.results[:3])


def test_bad_evidence_names_the_field():
    with pytest.raises(ValueError, match="n_shadow"):
        spec_evidence(n_shadow=-1)
    with pytest.raises(ValueError, match="numerator=3 exceeds denominator=2"):
        RatioCounts(numerator=3, denominator=2)
    with pytest.raises(ValueError, match="evidence=dict"):
        PromotionGate().evaluate({})


def test_gather_evidence_from_artifacts():
    from tests.release.test_bundle import spec_release, upstream_reports
    from tests.release.test_rollback import spec_rollback_report
    from ray_moe_dev.testing.fixtures import six_slot_manifest

    bundle = spec_release()
    rid = bundle.release_id
    tel = Telemetry("driver")
    for c in spec_cells():
        tel.record_cell(c.__class__(**{**c.__dict__, "release": rid}), topology="topology-v3", graph="g",
                        reason="oversize")
    tel.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": rid, "phase": "decode"}, 0)
    faults = fault_report(rid, [check_fault(k, s.outcome) for k, s in FAULT_TABLE.items()])
    ev = gather_evidence(
        release_id=rid, bundle_check=bundle.verify(upstream_reports()),
        manifest_failures=bundle.manifest_failures(six_slot_manifest(19)), fault_report=faults,
        rollback_report=spec_rollback_report(candidate_id=rid), telemetry=tel.snapshot(), n_shadow=100, n_canary=200,
    )
    assert (ev.drop.numerator, ev.drop.denominator) == (2, 800)
    assert (ev.fallback.numerator, ev.fallback.denominator) == (24, 240)
    assert ev.hash_ok and ev.manifest_ok and ev.faults_ok and ev.rollback_ok
    assert PromotionGate().evaluate(ev).passed
    # one missing fault and the wrong manifest: both clauses fail, both are listed
    partial = fault_report(rid, [check_fault(k, s.outcome) for k, s in list(FAULT_TABLE.items())[:9]])
    ev2 = gather_evidence(
        release_id=rid, bundle_check=bundle.verify(upstream_reports()),
        manifest_failures=bundle.manifest_failures(six_slot_manifest(18)), fault_report=partial,
        rollback_report=spec_rollback_report(candidate_id=rid), telemetry=tel.snapshot(), n_shadow=100, n_canary=200,
    )
    assert PromotionGate().evaluate(ev2).failed == (GateClause.MANIFEST_OK, GateClause.FAULTS_OK)


def test_clause_table_covers_every_clause():
    assert list(CLAUSES) == list(GateClause)


@settings(deadline=None, max_examples=80)
@given(
    st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.integers(0, 300), st.integers(0, 400),
    st.integers(0, 10), st.integers(0, 60), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2),
)
def test_verdict_is_the_conjunction(h, m, f, r, ns, nc, drop, fb, rm, sa, cf):
    ev = spec_evidence(hash_ok=h, manifest_ok=m, faults_ok=f, rollback_ok=r, n_shadow=ns, n_canary=nc,
                       drop=RatioCounts(numerator=drop, denominator=800),
                       fallback=RatioCounts(numerator=fb, denominator=240),
                       route_mismatches=rm, stale_accepts=sa, count_failures=cf)
    expected = (h and m and f and r and ns >= 100 and nc >= 200 and drop * 1000 <= 5 * 800 and fb * 100 <= 15 * 240
                and rm == sa == cf == 0)
    v = PromotionGate().evaluate(ev)
    assert v.passed == expected
    assert (len(v.failed) == 0) == expected
