"""The healing policy (``control/healing.py``) without Ray or threads: retries with backoff, lines left out, healing
off; and the rank-state transitions and the next reconcile step it feeds (``control/target.py``)."""

from __future__ import annotations

import pytest

from ray_moe.control.healing import HealPolicy
from ray_moe.control.target import (BundleRef, DeploymentTarget, RankRecord, RankState, ReconcileAction,
                                    next_step)
from ray_moe.core.errors import RequestError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_failed_start_is_retried_with_doubling_backoff_then_heals():
    clock = Clock()
    h = HealPolicy(3, backoff_s=1.0, clock=clock)
    assert h.lost(2) and h.due() == (2,) and h.attempt(2) == 1
    assert h.failed(2, "no GPU free yet")  # retried: after 1 s
    assert h.due() == () and h.healing
    clock.t += 0.99
    assert h.due() == ()
    clock.t += 0.02
    assert h.due() == (2,) and h.attempt(2) == 2
    assert h.failed(2, "no GPU free yet")  # after 2 s more
    clock.t += 1.5
    assert h.due() == ()
    clock.t += 0.6
    assert h.due() == (2,)
    h.started(2, 7)
    ev = list(h.events)
    assert [e.get("attempt") for e in ev[:2]] == [1, 2] and "no GPU free yet" in ev[0]["error"]
    assert ev[2] == {"lost": 2, "replacement": 7, "attempts": 3, "seconds": pytest.approx(3.11)}
    assert not h.healing and h.lineage(7) == 2


def test_a_line_that_keeps_dying_is_left_out_and_another_line_still_heals():
    h = HealPolicy(2, backoff_s=0.0, clock=Clock())
    assert h.lost(1)
    h.started(1, 10)
    assert h.lost(10)  # the replacement died: the same line's second loss
    h.started(10, 11)
    assert h.lineage(11) == 1
    assert not h.lost(11)  # the third loss of the line: over heal_retries=2
    assert h.events[-1] == {"lost": 11, "left_out": True, "reason": "its line lost 3 shards (heal_retries=2)"}
    assert h.lost(5)
    h.started(5, 12)
    assert h.events[-1]["replacement"] == 12 and h.events[-1]["attempts"] == 1


def test_every_attempt_failing_is_left_out_healing_off_and_bad_values_refused():
    h = HealPolicy(2, backoff_s=0.0, clock=Clock())
    assert h.lost(0)
    assert h.failed(0, "actor start failed")
    assert not h.failed(0, "actor start failed")  # the second failed attempt: left out
    assert list(h.events)[-1] == {"lost": 0, "left_out": True, "reason": "2 start attempts failed"}
    assert not h.healing and h.due() == ()
    off = HealPolicy(0)
    assert not off.lost(3) and off.events[-1]["reason"] == "healing is off (heal_retries=0)"
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="retries="):
            HealPolicy(bad)


def _records(**states: str) -> dict[int, RankRecord]:
    return {int(k[1:]): RankRecord(int(k[1:]), RankState(v), BundleRef("pg", int(k[1:]))) for k, v in states.items()}


def test_next_step_order_dead_first_then_removal_replacement_addition():
    t = DeploymentTarget(ranks=3)
    recs = _records(r0="live", r1="dead", r2="live")
    assert next_step(t, recs).action is ReconcileAction.REGROUP_DEAD
    assert next_step(t, recs, dead_blocked=True).action is ReconcileAction.HOLD
    recs = _records(r0="live", r1="gone", r2="live")
    assert next_step(t, recs, replace_due=(1,)) .ranks == (1,)
    assert next_step(t, recs, replace_due=(1,)).action is ReconcileAction.REPLACE
    assert next_step(t, recs, replace_pending=True).action is ReconcileAction.HOLD
    assert next_step(t, recs).action is ReconcileAction.ADD
    out = t.changed(ranks=1, remove=(2,), set_by="caller", reason="remove rank 2")
    assert out.version == 1 and out.set_by == "caller"
    step = next_step(out, recs)
    assert step.action is ReconcileAction.REMOVE and step.ranks == (2,)
    assert next_step(DeploymentTarget(ranks=1), _records(r0="live", r3="live")).ranks == (3,)  # highest leaves
    assert next_step(DeploymentTarget(ranks=2), _records(r0="live", r3="live")).action is ReconcileAction.HOLD


def test_rank_states_follow_their_table_and_bad_targets_are_refused():
    rec = RankRecord(4, RankState.STARTING)
    assert rec.lineage == 4
    rec.move(RankState.LIVE)
    rec.move(RankState.DRAINING)
    rec.move(RankState.LIVE)  # an evacuation that failed
    rec.move(RankState.DEAD)
    with pytest.raises(RequestError, match=r"rank 4: state dead -> live is not a transition"):
        rec.move(RankState.LIVE)
    rec.move(RankState.GONE)
    assert rec.as_dict()["state"] == "gone"
    t = DeploymentTarget(ranks=2)
    with pytest.raises(RequestError, match=r"target: ranks=0"):
        t.changed(ranks=0, set_by="caller", reason="x")
    with pytest.raises(RequestError, match=r"remove="):
        t.changed(remove=(1, 1), set_by="caller", reason="x")
    assert t.version == 0 and t.ranks == 2  # nothing changed
