"""Rollback as ordered state transfer (0x0EA): golden order, drain to zero, refused mutations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.release.lifecycle import ReleaseRegistry
from ray_moe.release.rollback import (
    NEXT_STEP,
    STEP_ORDER,
    CompositeRollbackPort,
    RollbackExecution,
    RollbackOrderError,
    RollbackPlan,
    RollbackPort,
    RollbackStalledError,
    RollbackStep,
    RollbackTarget,
    rollback,
)
from ray_moe.core.types import ReleaseState as S
from tests.release.test_bundle import spec_release
from tests.release.test_lifecycle import bring_up, passing_verdict, prior_release

V19 = RollbackTarget("m66-placement-v19-canary-01", "placement-v19", "checkpoint-0042", loaded=True)
V18 = RollbackTarget("m66-placement-v18-01", "placement-v18", "checkpoint-0042", loaded=True)


class RecordingPort:
    """A port whose candidate holds ``handles`` in-flight dispatches; each refcount poll lets one combine
    finish (the handles drain against the snapshot they acquired). Records every call."""

    def __init__(self, handles: int = 3, registry: ReleaseRegistry | None = None, late_acquire: bool = False):
        self.handles = handles
        self.calls: list[tuple[str, str]] = []
        self.registry = registry
        self.late_acquire = late_acquire
        self.active_during_drain: list[str | None] = []

    def stop_new_dispatch(self, release_id):
        self.calls.append(("stop_new_dispatch", release_id))
        if self.registry:
            self.registry.stop_new_dispatch(release_id)

    def activate(self, release_id):
        self.calls.append(("activate", release_id))
        if self.registry:
            self.registry.activate(release_id)

    def refcount(self, release_id):
        self.calls.append(("refcount", release_id))
        if self.registry:
            self.active_during_drain.append(self.registry.active())
        n = self.handles
        if self.handles:
            self.handles -= 1  # one in-flight combine completes and releases its reference
        elif self.late_acquire:
            self.handles = 1  # a dispatch slipped past the stop fence
            self.late_acquire = False
        return n

    def release_graphs(self, release_id):
        self.calls.append(("release_graphs", release_id))

    def retire(self, release_id):
        self.calls.append(("retire", release_id))
        if self.registry:
            self.registry.retire(release_id)


def spec_rollback_report(candidate_id: str = V19.release_id):
    """A completed rollback drill of ``candidate_id`` to placement-v18 (used by the gate tests)."""
    cand = RollbackTarget(candidate_id, "placement-v19", "checkpoint-0042", True)
    return RollbackExecution(RollbackPlan(cand, V18), RecordingPort(3)).run()


def test_golden_rollback_order():
    port = RecordingPort(handles=3)
    report = RollbackExecution(RollbackPlan(V19, V18), port).run()
    assert report.ok and report.completed
    assert report.steps == (
        RollbackStep.STOP_NEW_DISPATCH, RollbackStep.ACTIVATE_PRIOR, RollbackStep.DRAIN_CANDIDATE,
        RollbackStep.RELEASE_GRAPHS, RollbackStep.RETIRE_CANDIDATE, RollbackStep.COMPLETE,
    )
    assert [e.detail for e in report.events] == [
        "stop new placement-v19 dispatch",
        "activate loaded placement-v18 for new dispatch",
        "drain 3 placement-v19 handles to zero",
        "release placement-v19 graph resources",
        "retire placement-v19",
        "rollback complete",
    ]
    assert [e.release_id for e in report.events] == [V19.release_id, V18.release_id] + [V19.release_id] * 4
    assert [e.seq for e in report.events] == [1, 2, 3, 4, 5, 6]
    assert report.refcount_trace == (3, 2, 1, 0)
    ordered = [c for c in port.calls if c[0] != "refcount"]
    assert ordered == [("stop_new_dispatch", V19.release_id), ("activate", V18.release_id),
                       ("release_graphs", V19.release_id), ("retire", V19.release_id)]
    # refcount is re-read (0) right before graph release and before retirement
    assert port.calls[-4:] == [("refcount", V19.release_id), ("release_graphs", V19.release_id),
                               ("refcount", V19.release_id), ("retire", V19.release_id)]


def test_rollback_against_the_release_registry():
    """Active candidate v19 faults; v18 (superseded, drained, kept LOADED) takes new dispatch back."""
    reg = ReleaseRegistry()
    prior = bring_up(reg, prior_release())
    reg.activate(prior)
    cand = bring_up(reg, spec_release())
    reg.transition(cand, S.SHADOW, "shadow")
    reg.begin_canary(cand, 0.1)
    reg.promote(cand, passing_verdict(cand))
    reg.transition(prior, S.LOADED, "drained; kept as fallback")
    port = RecordingPort(3, registry=reg)
    report = RollbackExecution(RollbackPlan.from_registry(reg, cand, prior), port).run()
    assert report.ok
    assert port.active_during_drain == [prior] * 6  # new work flowed to v18 during the whole drain
    assert reg.active() == prior and reg.get(cand).state is S.RETIRED
    tail = [(e.release_id, e.from_state, e.to_state) for e in reg.timeline()][-3:]
    assert tail == [(cand, S.ACTIVE, S.DRAINING), (prior, S.LOADED, S.ACTIVE), (cand, S.DRAINING, S.RETIRED)]


def test_rollback_of_a_blocked_canary_over_composite_port():
    reg = ReleaseRegistry()
    prior = bring_up(reg, prior_release())
    reg.activate(prior)
    cand = bring_up(reg, spec_release())
    reg.transition(cand, S.SHADOW, "shadow")
    reg.begin_canary(cand, 0.1)  # blocked canary: prior is still ACTIVE
    refs = iter([2, 1, 0, 0, 0])
    freed: list[str] = []
    report = rollback(reg, cand, prior, refcount=lambda r: next(refs), release_graphs=freed.append)
    assert report.ok and report.refcount_trace == (2, 1, 0)
    assert freed == [cand]
    assert reg.active() == prior and reg.get(cand).state is S.RETIRED
    # the prior never stopped serving: activation was a no-op, not a second ACTIVE event
    assert reg.get(prior).path().count(S.ACTIVE) == 1
    assert reg.get(cand).path()[-3:] == (S.CANARY, S.DRAINING, S.RETIRED)


def test_composite_port_is_a_rollback_port():
    port = CompositeRollbackPort(ReleaseRegistry(), refcount=lambda r: 0, release_graphs=lambda r: None)
    assert isinstance(port, RollbackPort)


def test_retire_first_is_refused():
    port = RecordingPort(3)
    ex = RollbackExecution(RollbackPlan(V19, V18), port)
    with pytest.raises(RollbackOrderError, match="RETIRE_CANDIDATE refused in state PLANNED.*retiring first is use-after-free"):
        ex.retire_candidate()
    assert port.calls == [] and ex.state is RollbackStep.PLANNED
    ex.stop_new_dispatch()
    ex.activate_prior()
    with pytest.raises(RollbackOrderError, match="use-after-free"):
        ex.retire_candidate()  # still not drained
    with pytest.raises(RollbackOrderError, match="RELEASE_GRAPHS refused in state ACTIVATE_PRIOR"):
        ex.release_graphs()
    assert ("retire", V19.release_id) not in port.calls


def test_drain_before_activating_the_fallback_is_refused():
    port = RecordingPort(3)
    ex = RollbackExecution(RollbackPlan(V19, V18), port)
    ex.stop_new_dispatch()
    with pytest.raises(RollbackOrderError, match="availability outage"):
        ex.drain_candidate()
    assert port.calls == [("stop_new_dispatch", V19.release_id)]


def test_missing_fallback_is_refused():
    unloaded = RollbackTarget(V18.release_id, "placement-v18", "checkpoint-0042", loaded=False)
    with pytest.raises(ValueError, match="prior.loaded=False .*no live fallback"):
        RollbackPlan(V19, unloaded)
    reg = ReleaseRegistry()
    retired = bring_up(reg, prior_release())
    reg.retire(retired)  # LOADED -> RETIRED: unloaded
    cand = bring_up(reg, spec_release())
    with pytest.raises(ValueError, match="prior.loaded=False"):
        RollbackPlan.from_registry(reg, cand, retired)


def test_checkpoint_mismatch_is_refused():
    other = RollbackTarget(V18.release_id, "placement-v18", "checkpoint-0041", loaded=True)
    with pytest.raises(ValueError, match="prior.checkpoint_version='checkpoint-0041' differs"):
        RollbackPlan(V19, other)
    with pytest.raises(ValueError, match="is the candidate itself"):
        RollbackPlan(V19, V19)


def test_work_after_the_stop_fence_is_refused():
    port = RecordingPort(1, late_acquire=True)
    ex = RollbackExecution(RollbackPlan(V19, V18), port)
    ex.stop_new_dispatch()
    ex.activate_prior()
    ex.drain_candidate()  # sees 1 then 0
    assert ex.report().refcount_trace == (1, 0)
    with pytest.raises(RollbackOrderError, match="RELEASE_GRAPHS refused at refcount 1"):
        ex.release_graphs()
    assert ("release_graphs", V19.release_id) not in port.calls


def test_refcount_rising_during_drain_is_refused():
    class Rising(RecordingPort):
        seq = iter([2, 3])

        def refcount(self, release_id):
            return next(self.seq)

    ex = RollbackExecution(RollbackPlan(V19, V18), Rising())
    ex.stop_new_dispatch()
    ex.activate_prior()
    with pytest.raises(RollbackOrderError, match="refcount rose 2 -> 3 after the stop fence"):
        ex.drain_candidate()


def test_stalled_drain_raises_after_the_poll_budget():
    class Stuck(RecordingPort):
        def refcount(self, release_id):
            return 1

    waits = []
    ex = RollbackExecution(RollbackPlan(V19, V18), Stuck(), max_drain_polls=5, wait=lambda: waits.append(1))
    with pytest.raises(RollbackStalledError, match="refcount still 1 after 5 polls"):
        ex.run()
    assert len(waits) == 5 and ex.state is RollbackStep.ACTIVATE_PRIOR
    assert not ex.report().completed and not ex.report().ok


def test_bad_inputs():
    with pytest.raises(ValueError, match="port=object"):
        RollbackExecution(RollbackPlan(V19, V18), object())
    with pytest.raises(ValueError, match="max_drain_polls=0"):
        RollbackExecution(RollbackPlan(V19, V18), RecordingPort(), max_drain_polls=0)

    class Negative(RecordingPort):
        def refcount(self, release_id):
            return -1

    ex = RollbackExecution(RollbackPlan(V19, V18), Negative())
    ex.stop_new_dispatch()
    ex.activate_prior()
    with pytest.raises(ValueError, match="refcount\\(m66-placement-v19-canary-01\\)=-1"):
        ex.drain_candidate()


def test_step_table_is_a_single_chain():
    chain, s = [], RollbackStep.PLANNED
    while s in NEXT_STEP:
        s = NEXT_STEP[s]
        chain.append(s)
    assert tuple(chain) == STEP_ORDER


@settings(deadline=None, max_examples=60)
@given(st.lists(st.sampled_from(STEP_ORDER), min_size=1, max_size=8), st.integers(0, 5))
def test_any_call_order_either_follows_the_chain_or_changes_nothing(order, handles):
    port = RecordingPort(handles)
    ex = RollbackExecution(RollbackPlan(V19, V18), port)
    methods = {
        RollbackStep.STOP_NEW_DISPATCH: ex.stop_new_dispatch, RollbackStep.ACTIVATE_PRIOR: ex.activate_prior,
        RollbackStep.DRAIN_CANDIDATE: ex.drain_candidate, RollbackStep.RELEASE_GRAPHS: ex.release_graphs,
        RollbackStep.RETIRE_CANDIDATE: ex.retire_candidate, RollbackStep.COMPLETE: ex.complete,
    }
    for step in order:
        before, ncalls = ex.state, len(port.calls)
        try:
            methods[step]()
        except RollbackOrderError:
            assert ex.state is before and len(port.calls) == ncalls
        else:
            assert NEXT_STEP[before] is step and ex.state is step
    steps = ex.report().steps
    assert steps == STEP_ORDER[: len(steps)]
    if ("retire", V19.release_id) in port.calls:
        assert ex.report().refcount_trace[-1] == 0
