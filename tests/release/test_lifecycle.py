"""Release lifecycle of 0x0EA: the transition table, guards, and the registry's invariants."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.release.gate import PromotionGate
from ray_moe.release.lifecycle import (
    TRANSITIONS,
    EdgeGuard,
    IllegalTransitionError,
    ReleaseRegistry,
    check_edge,
)
from ray_moe_dev.testing.fixtures import six_slot_manifest
from ray_moe.core.types import ReleaseState as S
from tests.release.test_bundle import spec_release, synthetic_digest
from tests.release.test_gate import spec_evidence

CANDIDATE_PATH = (S.BUILT, S.VERIFIED, S.LOADED, S.SHADOW, S.CANARY, S.ACTIVE, S.DRAINING, S.RETIRED)


def prior_release():
    """placement-v18 on the same checkpoint: the release v19 is a candidate against."""
    return spec_release(
        name="m66-placement-v18-01",
        placement_generation="placement-v18",
        placement_digest=six_slot_manifest(18).content_digest(),
        process_group_generation="groups-v18-ep4-etp1",
        graph_manifest_digest=synthetic_digest("decode.bucket4.v18"),
    )


def passing_verdict(release_id: str):
    return PromotionGate().evaluate(spec_evidence(release_id=release_id))


def bring_up(reg: ReleaseRegistry, bundle, *, to=S.LOADED):
    reg.register(bundle)
    for s in (S.VERIFIED, S.LOADED):
        reg.transition(bundle.release_id, s, f"-> {s.value}")
        if s is to:
            break
    return bundle.release_id


def active_prior_and_canary_candidate(fraction=0.25):
    reg = ReleaseRegistry()
    prior = bring_up(reg, prior_release())
    reg.activate(prior)  # bootstrap: nothing was ever active
    cand = bring_up(reg, spec_release())
    reg.transition(cand, S.SHADOW, "shadow")
    reg.begin_canary(cand, fraction)
    return reg, prior, cand


def test_table_contains_the_spec_trace():
    for a, b in zip(CANDIDATE_PATH, CANDIDATE_PATH[1:]):
        assert b in TRANSITIONS[a], (a, b)
    assert TRANSITIONS[S.RETIRED] == {}
    assert TRANSITIONS[S.CANARY][S.ACTIVE].guard is EdgeGuard.GATE_VERDICT
    assert TRANSITIONS[S.LOADED][S.ACTIVE].guard is EdgeGuard.REACTIVATION
    assert TRANSITIONS[S.DRAINING][S.ACTIVE].guard is EdgeGuard.REACTIVATION
    for s in (S.SHADOW, S.CANARY, S.ACTIVE):
        assert S.DRAINING in TRANSITIONS[s]  # the stop fence
    assert set(TRANSITIONS) == set(S)


@pytest.mark.parametrize(
    "src, dst",
    [(S.BUILT, S.LOADED), (S.VERIFIED, S.ACTIVE), (S.SHADOW, S.ACTIVE), (S.ACTIVE, S.RETIRED),
     (S.RETIRED, S.ACTIVE), (S.CANARY, S.SHADOW), (S.ACTIVE, S.LOADED)],
)
def test_illegal_edges_name_both_states(src, dst):
    with pytest.raises(IllegalTransitionError, match=f"illegal transition {src.value} -> {dst.value}"):
        check_edge("r", src, dst)


def test_full_candidate_trace_with_promotion_and_timeline():
    reg, prior, cand = active_prior_and_canary_candidate()
    assert reg.candidate() == cand and reg.active() == prior and reg.canary_fraction == 0.25
    superseded = reg.promote(cand, passing_verdict(cand))
    assert superseded == prior
    assert reg.active() == cand and reg.candidate() is None and reg.canary_fraction == 0.0
    assert reg.get(prior).state is S.DRAINING
    reg.transition(cand, S.DRAINING, "superseded by next")
    reg.retire(cand)
    rec = reg.get(cand)
    assert rec.path() == CANDIDATE_PATH
    assert [e.seq for e in rec.timeline] == sorted(e.seq for e in rec.timeline)
    assert [(e.from_state, e.to_state) for e in rec.timeline[:2]] == [(None, S.BUILT), (S.BUILT, S.VERIFIED)]
    # promotion drains the prior *before* the candidate becomes ACTIVE: never two ACTIVE releases
    tl = [(e.release_id, e.to_state) for e in reg.timeline()]
    assert tl.index((prior, S.DRAINING)) + 1 == tl.index((cand, S.ACTIVE))


def test_canary_to_active_needs_a_passing_verdict_for_that_release():
    reg, prior, cand = active_prior_and_canary_candidate()
    with pytest.raises(IllegalTransitionError, match="CANARY -> ACTIVE: needs promote"):
        reg.transition(cand, S.ACTIVE, "skip the gate")
    with pytest.raises(IllegalTransitionError, match="CANARY -> ACTIVE"):
        reg.promote(cand, passing_verdict(prior))  # a verdict for another release
    failing = PromotionGate().evaluate(spec_evidence(release_id=cand, n_canary=199))
    with pytest.raises(IllegalTransitionError, match="passed=False"):
        reg.promote(cand, failing)
    assert reg.get(cand).state is S.CANARY and reg.active() == prior  # nothing moved


def test_at_most_one_active_and_one_candidate():
    reg, prior, cand = active_prior_and_canary_candidate()
    third = bring_up(reg, spec_release(name="third", route_abi="route-abi-v9"))
    with pytest.raises(IllegalTransitionError, match="already the candidate"):
        reg.transition(third, S.SHADOW, "second candidate")
    reg.transition(prior, S.DRAINING, "stop")
    reg.transition(prior, S.LOADED, "standby")
    with pytest.raises(IllegalTransitionError, match="LOADED -> ACTIVE: only a release that was ACTIVE"):
        reg.activate(third)  # never active before, and not a bootstrap
    reg.activate(prior)
    assert reg.active() == prior and sum(1 for r in reg.records() if r.state is S.ACTIVE) == 1


def test_reactivation_rules():
    reg = ReleaseRegistry()
    a = bring_up(reg, prior_release())
    reg.activate(a)  # bootstrap
    b = bring_up(reg, spec_release())
    with pytest.raises(IllegalTransitionError, match="only a release that was ACTIVE before"):
        reg.activate(b)
    reg.transition(b, S.SHADOW, "shadow")
    reg.begin_canary(b, 1.0)
    reg.promote(b, passing_verdict(b))
    # a is DRAINING and was ACTIVE: it can come back while b is stopped
    with pytest.raises(IllegalTransitionError, match=f"{b} is ACTIVE; stop it first"):
        reg.activate(a)
    reg.stop_new_dispatch(b)
    reg.activate(a)
    assert reg.active() == a and reg.get(a).path()[-2:] == (S.DRAINING, S.ACTIVE)


def test_select_for_new_dispatch_follows_canary_fraction():
    reg, prior, cand = active_prior_and_canary_candidate(fraction=0.25)
    assert reg.select_for_new_dispatch(0.0) == cand
    assert reg.select_for_new_dispatch(0.2499) == cand
    assert reg.select_for_new_dispatch(0.25) == prior
    assert reg.select_for_new_dispatch(0.99) == prior
    reg.set_canary_fraction(cand, 0.5)
    assert reg.select_for_new_dispatch(0.4) == cand
    reg.stop_new_dispatch(cand)  # blocked canary: CANARY -> DRAINING
    assert reg.select_for_new_dispatch(0.0) == prior and reg.canary_fraction == 0.0
    with pytest.raises(ValueError, match="u=1.0"):
        reg.select_for_new_dispatch(1.0)


def test_shadow_never_serves_and_no_active_is_an_error():
    reg = ReleaseRegistry()
    r = bring_up(reg, spec_release())
    reg.transition(r, S.SHADOW, "shadow")
    with pytest.raises(ValueError, match="none is ACTIVE"):
        reg.select_for_new_dispatch(0.0)


def test_bad_inputs():
    reg = ReleaseRegistry()
    b = spec_release()
    reg.register(b)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(b)
    with pytest.raises(ValueError, match="release_id='nope'"):
        reg.get("nope")
    with pytest.raises(ValueError, match="reason=''"):
        reg.transition(b.release_id, S.VERIFIED, "")
    with pytest.raises(ValueError, match="fraction=0"):
        reg.begin_canary(b.release_id, 0)
    with pytest.raises(ValueError, match="needs state CANARY, got BUILT"):
        reg.set_canary_fraction(b.release_id, 0.5)
    with pytest.raises(ValueError, match="bundle=dict"):
        reg.register({})


def test_reject_build_and_reject_load_edges():
    reg = ReleaseRegistry()
    b = spec_release()
    reg.register(b)
    reg.transition(b.release_id, S.RETIRED, "reject build: hash drift")
    assert reg.get(b.release_id).path() == (S.BUILT, S.RETIRED)
    assert not reg.get(b.release_id).loaded
    with pytest.raises(IllegalTransitionError, match="RETIRED -> VERIFIED: .*none \\(terminal\\)"):
        reg.transition(b.release_id, S.VERIFIED, "again")


def test_concurrent_candidates_only_one_wins():
    reg = ReleaseRegistry()
    ids = [bring_up(reg, spec_release(name=f"c{i}", route_abi=f"abi-{i}")) for i in range(6)]
    wins, errors = [], []

    def go(rid):
        try:
            reg.transition(rid, S.SHADOW, "race")
            wins.append(rid)
        except IllegalTransitionError as e:
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(errors) == 5 and reg.candidate() == wins[0]


@settings(deadline=None, max_examples=60)
@given(st.lists(st.sampled_from(list(S)), max_size=12))
def test_random_walks_follow_the_table(targets):
    reg = ReleaseRegistry()
    b = spec_release()
    reg.register(b)
    for dst in targets:
        src = reg.get(b.release_id).state
        try:
            reg.transition(b.release_id, dst, "walk")
        except IllegalTransitionError as e:
            assert e.src is src and e.dst is dst
            assert reg.get(b.release_id).state is src
        else:
            assert dst in TRANSITIONS[src]
    rec = reg.get(b.release_id)
    for e in rec.timeline[1:]:
        assert e.to_state in TRANSITIONS[e.from_state]
    assert sum(1 for r in reg.records() if r.state is S.ACTIVE) <= 1
