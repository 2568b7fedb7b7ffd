"""GenerationRegistry: the 0x02B3 fence, the transition table, rollback, leases, threads."""

from __future__ import annotations

import re

import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ray_moe.core.errors import GenerationError, StaleGenerationError
from ray_moe.placement.registry import (
    TRANSITIONS,
    GenerationAction,
    GenerationRegistry,
    Lease,
    RegistryEventKind,
)
from ray_moe_dev.testing.fixtures import six_slot_manifest
from ray_moe.core.types import GenerationState as S

A = GenerationAction


def _clock():
    t = iter(range(1000, 10**6))
    return lambda: float(next(t))


def _registry(*gens: int) -> GenerationRegistry:
    reg = GenerationRegistry(clock=_clock())
    for g in gens:
        reg.register(six_slot_manifest(g))
    return reg


def test_transition_table_is_exactly_the_spec_edges():
    assert dict(TRANSITIONS) == {
        (S.PENDING, A.PUBLISH): S.ACTIVE,
        (S.PENDING, A.RETIRE): S.RETIRED,
        (S.ACTIVE, A.DRAIN): S.DRAINING,
        (S.DRAINING, A.REACTIVATE): S.ACTIVE,
        (S.DRAINING, A.RETIRE): S.RETIRED,
    }
    # RETIRED is terminal: no edge leaves it.
    assert not [k for k in TRANSITIONS if k[0] is S.RETIRED]


def test_spec_0x02B3_fence_sequence_golden():
    reg = _registry(17, 18)
    # 1. placement-v17 is active
    assert reg.publish(17) is None
    assert (reg.active(), reg.state(17), reg.refcount(17)) == (17, S.ACTIVE, 0)
    # 2. dispatch-h17 acquires one v17 generation reference
    h17 = reg.acquire("dispatch-h17")
    assert h17 == Lease("lease-00000000", 17, "dispatch-h17", 1000.0)
    assert reg.refcount(17) == 1
    # 3. placement-v18 becomes active for new dispatches
    assert reg.publish(18) == 17
    assert (reg.active(), reg.state(18), reg.refcount(18)) == (18, S.ACTIVE, 0)
    # 4. v17 enters DRAINING (its lease survives)
    assert (reg.state(17), reg.refcount(17)) == (S.DRAINING, 1)
    assert reg.leases(17) == (h17,)
    view = reg.manifest(17)
    assert (view.state, view.in_flight_refcount, view.placement_version) == (S.DRAINING, 1, "placement-v17")
    # 5. retirement of v17 is denied: refcount = 1
    assert not reg.can_retire(17)
    with pytest.raises(GenerationError, match=r"refcount=1.*dispatch-h17"):
        reg.retire(17)
    assert (reg.state(17), reg.refcount(17)) == (S.DRAINING, 1)
    # new dispatch never pins the DRAINING generation
    with pytest.raises(StaleGenerationError) as ei:
        reg.acquire_generation(17, "late-dispatch")
    assert (ei.value.requested, ei.value.active) == (17, 18)
    assert reg.refcount(17) == 1
    # 6. combine uses dispatch-h17 and v17 metadata (not the active v18)
    placement = reg.require_live(h17.generation, h17)
    assert placement.generation == 17 and placement.checkpoint_version == "checkpoint-0042"
    assert (placement.state, placement.in_flight_refcount) == (S.DRAINING, 1)
    # 7. the handle releases its generation reference
    assert reg.release(h17) == 0
    assert reg.refcount(17) == 0
    # 8. retirement of v17 is now allowed
    assert reg.can_retire(17)
    reg.retire(17)
    assert (reg.state(17), reg.refcount(17), reg.active()) == (S.RETIRED, 0, 18)
    with pytest.raises(StaleGenerationError, match="RETIRED generation serves nothing"):
        reg.require_live(17)
    kinds = [(e.event, e.generation) for e in reg.timeline()]
    assert kinds == [
        (RegistryEventKind.REGISTER, 17), (RegistryEventKind.REGISTER, 18),
        (RegistryEventKind.PUBLISH, 17), (RegistryEventKind.ACQUIRE, 17),
        (RegistryEventKind.DRAIN, 17), (RegistryEventKind.PUBLISH, 18),
        (RegistryEventKind.RETIRE_DENIED, 17), (RegistryEventKind.RELEASE, 17),
        (RegistryEventKind.RETIRE, 17),
    ]
    assert [e.seq for e in reg.timeline()] == list(range(9))


def test_spec_0x08G_publication_sequence_with_mark_draining():
    reg = _registry(18, 19)
    reg.publish(18)
    h = reg.acquire("dispatch-h18-0099")
    reg.publish(19)
    reg.mark_draining(18)  # already DRAINING by the publish: a no-op
    assert not reg.can_retire(18)
    assert reg.require_live(18, h).generation == 18
    reg.release(h)
    assert reg.can_retire(18)
    reg.retire(18)
    assert reg.state(18) is S.RETIRED


def test_register_duplicate_and_bad_input():
    reg = _registry(17)
    with pytest.raises(GenerationError, match="generation=17.*already registered"):
        reg.register(six_slot_manifest(17))
    with pytest.raises(ValueError, match="manifest=dict"):
        reg.register({"generation": 3})  # type: ignore[arg-type]
    # register stores content only: a manifest carrying a state/refcount is reset to PENDING / 0
    m = six_slot_manifest(30).with_state(S.ACTIVE, 5)
    reg.register(m)
    assert (reg.state(30), reg.refcount(30), reg.manifest(30).state) == (S.PENDING, 0, S.PENDING)
    assert reg.generations() == (17, 30)


def test_acquire_rules():
    reg = _registry(1, 2)
    with pytest.raises(StaleGenerationError, match="no generation is ACTIVE") as ei:
        reg.acquire("d")
    assert ei.value.active is None
    with pytest.raises(StaleGenerationError, match="PENDING"):
        reg.acquire_generation(1, "d")
    with pytest.raises(StaleGenerationError, match="unknown"):
        reg.acquire_generation(99, "d")
    reg.publish(1)
    with pytest.raises(ValueError, match="holder=''"):
        reg.acquire("")
    assert reg.refcount(1) == 0
    a = reg.acquire_generation(1, "d1")
    b = reg.acquire("d2")
    assert (a.generation, b.generation, reg.refcount(1)) == (1, 1, 2)
    assert a.lease_id != b.lease_id


def test_release_twice_unknown_and_forged():
    reg = _registry(1)
    reg.publish(1)
    lease = reg.acquire("d")
    other = reg.acquire("e")
    forged = Lease(other.lease_id, 1, "mallory", other.acquired_at)
    with pytest.raises(GenerationError, match="does not match"):
        reg.release(forged)
    assert reg.release(lease) == 1
    with pytest.raises(GenerationError, match=f"{lease.lease_id}.*already released"):
        reg.release(lease)
    with pytest.raises(GenerationError, match="'lease-xyz' is unknown"):
        reg.release("lease-xyz")
    assert reg.refcount(1) == 1  # failed releases changed nothing; never negative
    assert reg.release(other.lease_id) == 0


def test_retire_refused_from_active_pending_allowed_and_retired_terminal():
    reg = _registry(1, 2, 3)
    reg.publish(1)
    with pytest.raises(GenerationError, match="cannot retire from state=ACTIVE.*drain"):
        reg.retire(1)
    assert not reg.can_retire(1)
    # abandon a candidate that never served
    assert reg.can_retire(3)
    reg.abandon(3)
    assert reg.state(3) is S.RETIRED
    with pytest.raises(GenerationError, match="cannot publish from state=RETIRED"):
        reg.publish(3)
    with pytest.raises(GenerationError, match="cannot reactivate from state=RETIRED"):
        reg.reactivate(3)
    with pytest.raises(GenerationError, match="already registered"):
        reg.register(six_slot_manifest(3))
    with pytest.raises(GenerationError, match="abandon needs PENDING"):
        reg.abandon(1)
    with pytest.raises(StaleGenerationError, match="PENDING"):
        reg.require_live(2)
    with pytest.raises(GenerationError, match="not registered"):
        reg.state(42)


def test_require_live_checks_the_lease_belongs_to_the_generation():
    reg = _registry(1, 2)
    reg.publish(1)
    l1 = reg.acquire("h1")
    reg.publish(2)
    l2 = reg.acquire("h2")
    with pytest.raises(GenerationError, match="pins generation=1, not 2"):
        reg.require_live(2, l1)
    reg.release(l1)
    with pytest.raises(GenerationError, match="not live"):
        reg.require_live(1, l1)
    assert reg.require_live(2, l2).state is S.ACTIVE


def test_rollback_reactivate_and_retire_when_drained():
    # spec 0x0EA: stop candidate dispatch -> activate v18 -> drain v19 handles -> retire v19
    reg = _registry(18, 19)
    reg.publish(18)
    reg.publish(19)
    handles = [reg.acquire(f"h19-{i}") for i in range(3)]
    reg.stop_new_dispatch(19)
    assert reg.active() is None and reg.state(19) is S.DRAINING
    with pytest.raises(StaleGenerationError):
        reg.acquire("new")
    assert reg.reactivate(18) is None
    assert (reg.active(), reg.state(18), reg.state(19), reg.refcount(19)) == (18, S.ACTIVE, S.DRAINING, 3)
    assert reg.retire_when_drained() == ()
    for h in handles:
        reg.release(h)
    assert reg.retire_when_drained() == (19,)
    assert reg.state(19) is S.RETIRED and reg.state(18) is S.ACTIVE


def test_reactivate_drains_current_active():
    reg = _registry(1, 2)
    reg.publish(1)
    reg.publish(2)
    assert reg.reactivate(1) == 2
    assert (reg.state(1), reg.state(2), reg.active()) == (S.ACTIVE, S.DRAINING, 1)
    with pytest.raises(GenerationError, match="cannot reactivate from state=ACTIVE"):
        reg.reactivate(1)
    assert (reg.state(1), reg.state(2)) == (S.ACTIVE, S.DRAINING)


def test_publish_refusal_changes_nothing():
    reg = _registry(1, 2)
    reg.publish(1)
    n = len(reg.timeline())
    with pytest.raises(GenerationError, match="cannot publish from state=ACTIVE"):
        reg.publish(1)
    assert (reg.active(), reg.state(1), reg.state(2), len(reg.timeline())) == (1, S.ACTIVE, S.PENDING, n)


def test_timeline_is_bounded_and_status_rows():
    reg = GenerationRegistry(clock=_clock(), timeline_limit=3)
    reg.register(six_slot_manifest(5))
    reg.publish(5)
    for i in range(4):
        reg.release(reg.acquire(f"h{i}"))
    tl = reg.timeline()
    assert len(tl) == 3 and tl[-1].seq == 9 and tl[-1].event is RegistryEventKind.RELEASE
    (row,) = reg.status()
    assert (row.generation, row.placement_version, row.state, row.refcount) == (5, "placement-v5", S.ACTIVE, 0)
    assert row.content_digest == six_slot_manifest(5).content_digest()
    with pytest.raises(ValueError, match="timeline_limit=0"):
        GenerationRegistry(timeline_limit=0)
    quiet = GenerationRegistry(record_leases=False)
    quiet.register(six_slot_manifest(1))
    quiet.publish(1)
    quiet.release(quiet.acquire("h"))
    assert [e.event for e in quiet.timeline()] == [RegistryEventKind.REGISTER, RegistryEventKind.PUBLISH]


def test_threads_acquire_release_while_publishing_and_retiring():
    reg = GenerationRegistry()
    reg.register(six_slot_manifest(0))
    reg.publish(0)
    errors: list[BaseException] = []
    stop = threading.Event()

    def dispatcher(i: int) -> None:
        try:
            for n in range(300):
                try:
                    lease = reg.acquire(f"d{i}-{n}")
                except StaleGenerationError:
                    continue
                m = reg.require_live(lease.generation, lease)  # combine resolves the pinned generation
                assert m.generation == lease.generation
                assert m.state in (S.ACTIVE, S.DRAINING)
                reg.release(lease)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def controller() -> None:
        try:
            g = 1
            while not stop.is_set() and g < 60:
                reg.register(six_slot_manifest(g))
                reg.publish(g)
                for old in reg.generations():
                    if reg.state(old) is S.DRAINING:
                        try:
                            reg.retire(old)
                        except GenerationError as exc:
                            # refused only while leases were live: the refusal names the refcount it saw under
                            # the registry's lock (reading refcount() afterwards races the workers' releases)
                            m = re.search(r"refcount=(\d+)", str(exc))
                            assert m is not None and int(m.group(1)) > 0, str(exc)
                g += 1
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    workers = [threading.Thread(target=dispatcher, args=(i,)) for i in range(4)]
    ctl = threading.Thread(target=controller)
    for t in workers:
        t.start()
    ctl.start()
    for t in workers:
        t.join()
    stop.set()
    ctl.join()
    assert not errors, errors
    # every dispatcher released: all refcounts are zero, and every drained generation can now retire
    assert all(reg.refcount(g) == 0 for g in reg.generations())
    retired_now = reg.retire_when_drained()
    states = [reg.state(g) for g in reg.generations()]
    assert states.count(S.ACTIVE) == 1 and S.DRAINING not in states
    assert set(retired_now) <= set(reg.generations())
    acquires = sum(1 for e in reg.timeline() if e.event is RegistryEventKind.ACQUIRE)
    releases = sum(1 for e in reg.timeline() if e.event is RegistryEventKind.RELEASE)
    assert acquires == releases


class RegistryMachine(RuleBasedStateMachine):
    """Random interleavings of register/publish/acquire/release/retire/reactivate/stop-dispatch.

    Each verb has a *targeted* rule (enabled only when it must succeed, so the machine reaches deep
    states) and an *arbitrary* rule (any generation id, known or not, whose refusal must change nothing).
    A shadow model (states, refcounts) is checked after every step.
    """

    @initialize()
    def setup(self) -> None:
        self.reg = GenerationRegistry(clock=_clock())
        self.next_gen = 0
        self.model: dict[int, S] = {}
        self.refs: dict[int, int] = {}
        self.live: list[Lease] = []
        self.released: list[Lease] = []
        self.register()
        self.reg.publish(0)
        self._apply(A.PUBLISH, 0)

    # ------------------------------------------------------------------ helpers
    def _in(self, state: S) -> list[int]:
        return [g for g, s in self.model.items() if s is state]

    def _active(self) -> int | None:
        act = self._in(S.ACTIVE)
        return act[0] if act else None

    def _any_gen(self, data) -> int:
        return data.draw(st.integers(0, self.next_gen), label="generation")

    def _snapshot(self):
        return ({g: self.reg.state(g) for g in self.reg.generations()},
                {g: self.reg.refcount(g) for g in self.reg.generations()}, self.reg.active())

    def _apply(self, action: A, g: int) -> None:
        """Shadow the registry through the same transition table."""
        if action in (A.PUBLISH, A.REACTIVATE):
            act = self._active()
            if act is not None:
                self.model[act] = S.DRAINING
        self.model[g] = TRANSITIONS[(self.model[g], action)]

    # ------------------------------------------------------------------ targeted rules
    @rule()
    def register(self) -> None:
        assert self.reg.register(six_slot_manifest(self.next_gen)) == self.next_gen
        self.model[self.next_gen] = S.PENDING
        self.refs[self.next_gen] = 0
        self.next_gen += 1

    @precondition(lambda self: self._in(S.PENDING))
    @rule(data=st.data())
    def publish_pending(self, data) -> None:
        g = data.draw(st.sampled_from(self._in(S.PENDING)))
        assert self.reg.publish(g) == self._active()
        self._apply(A.PUBLISH, g)

    @precondition(lambda self: self._in(S.DRAINING))
    @rule(data=st.data())
    def reactivate_draining(self, data) -> None:
        g = data.draw(st.sampled_from(self._in(S.DRAINING)))
        assert self.reg.reactivate(g) == self._active()
        self._apply(A.REACTIVATE, g)

    @precondition(lambda self: self._active() is not None)
    @rule()
    def stop_dispatch(self) -> None:
        g = self._active()
        self.reg.mark_draining(g)
        self._apply(A.DRAIN, g)

    @precondition(lambda self: self._active() is not None)
    @rule(pinned=st.booleans())
    def acquire_active(self, pinned: bool) -> None:
        g = self._active()
        lease = self.reg.acquire_generation(g, "h") if pinned else self.reg.acquire("h")
        assert lease.generation == g
        self.live.append(lease)
        self.refs[g] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data) -> None:
        lease = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        # combine resolves the lease's own generation, which is still live
        assert self.reg.require_live(lease.generation, lease).generation == lease.generation
        self.refs[lease.generation] -= 1
        assert self.reg.release(lease) == self.refs[lease.generation]
        self.released.append(lease)

    @precondition(lambda self: [g for g in self._in(S.DRAINING) if self.refs[g] == 0])
    @rule(data=st.data())
    def retire_drained(self, data) -> None:
        g = data.draw(st.sampled_from([g for g in self._in(S.DRAINING) if self.refs[g] == 0]))
        assert self.reg.can_retire(g)
        self.reg.retire(g)
        self._apply(A.RETIRE, g)

    @precondition(lambda self: [g for g in self._in(S.DRAINING) if self.refs[g] > 0])
    @rule(data=st.data())
    def retire_with_leases_denied(self, data) -> None:
        g = data.draw(st.sampled_from([g for g in self._in(S.DRAINING) if self.refs[g] > 0]))
        assert not self.reg.can_retire(g)
        with pytest.raises(GenerationError, match=f"refcount={self.refs[g]}"):
            self.reg.retire(g)

    def sweep(self) -> None:
        expect = tuple(g for g in sorted(self.model) if self.model[g] is S.DRAINING and self.refs[g] == 0)
        assert self.reg.retire_when_drained() == expect
        for g in expect:
            self._apply(A.RETIRE, g)

    # ------------------------------------------------------------------ arbitrary rules (refusals change nothing)
    @rule(data=st.data(), verb=st.sampled_from(
        ["publish", "reactivate", "retire", "mark_draining", "abandon", "acquire", "require_live", "sweep"]))
    def arbitrary(self, data, verb: str) -> None:
        """One verb on an arbitrary generation id; a refusal must change nothing."""
        if verb == "sweep":
            return self.sweep()
        if verb == "acquire":
            return self.arbitrary_acquire(data, data.draw(st.booleans()))
        if verb == "require_live":
            return self.require_live_any(data)
        g = self._any_gen(data)
        before = self._snapshot()
        try:
            getattr(self.reg, verb)(g)
        except GenerationError:
            assert self._snapshot()[:2] == before[:2] and self.reg.active() == before[2]
            state = self.model.get(g)
            action = {"publish": A.PUBLISH, "reactivate": A.REACTIVATE, "retire": A.RETIRE,
                      "mark_draining": A.DRAIN, "abandon": A.RETIRE}[verb]
            legal = state is not None and (state, action) in TRANSITIONS
            if verb == "abandon":
                legal = state is S.PENDING
            if verb == "mark_draining":
                legal = legal or state is S.DRAINING
            # refused only when illegal, or a retire with live leases
            assert not legal or (action is A.RETIRE and self.refs[g] > 0)
            return
        state = self.model[g]
        if verb == "mark_draining" and state is S.DRAINING:
            return
        action = {"publish": A.PUBLISH, "reactivate": A.REACTIVATE, "retire": A.RETIRE,
                  "mark_draining": A.DRAIN, "abandon": A.RETIRE}[verb]
        if action is A.RETIRE:
            assert self.refs[g] == 0  # retire never succeeds with live leases
        self._apply(action, g)

    def arbitrary_acquire(self, data, pinned: bool) -> None:
        g = self._any_gen(data)
        act = self._active()
        try:
            lease = self.reg.acquire_generation(g, "x") if pinned else self.reg.acquire("x")
        except StaleGenerationError as exc:
            assert exc.active == act
            assert act is None or (pinned and g != act)
            return
        assert lease.generation == act and (not pinned or g == act)
        self.live.append(lease)
        self.refs[act] += 1

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def release_twice(self, data) -> None:
        lease = data.draw(st.sampled_from(self.released))
        with pytest.raises(GenerationError, match="already released"):
            self.reg.release(lease)

    def require_live_any(self, data) -> None:
        g = self._any_gen(data)
        state = self.model.get(g)
        if state in (S.ACTIVE, S.DRAINING):
            view = self.reg.require_live(g)
            assert (view.generation, view.state, view.in_flight_refcount) == (g, state, self.refs[g])
        else:
            with pytest.raises(StaleGenerationError):
                self.reg.require_live(g)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "reg"):
            return
        states, refs, active = self._snapshot()
        assert states == self.model
        assert refs == self.refs and all(r >= 0 for r in refs.values())
        assert list(states.values()).count(S.ACTIVE) <= 1
        assert active == self._active()
        for g, s in states.items():
            if s in (S.PENDING, S.RETIRED):
                assert refs[g] == 0
            view = self.reg.manifest(g)
            assert (view.state, view.in_flight_refcount) == (s, refs[g])
            assert min(view.replica_counts()) >= 1  # every logical expert keeps >= 1 slot
        assert sorted(l.lease_id for g in states for l in self.reg.leases(g)) == sorted(l.lease_id for l in self.live)

    @invariant()
    def retired_never_returns(self) -> None:
        if not hasattr(self, "reg"):
            return
        if not hasattr(self, "ever_retired"):
            self.ever_retired: set[int] = set()
        now = {g for g, s in self.model.items() if s is S.RETIRED}
        assert self.ever_retired <= now
        self.ever_retired = now


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
