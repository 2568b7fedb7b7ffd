"""Rollback as ordered state transfer (spec 0x0EA). Pure: no Ray.

The only safe order is::

    PLANNED -> STOP_NEW_DISPATCH   (candidate takes no new dispatch after the fence)
            -> ACTIVATE_PRIOR      (the loaded prior takes new dispatch: no outage)
            -> DRAIN_CANDIDATE     (candidate refcount falls to 0; its handles finish on its snapshot)
            -> RELEASE_GRAPHS      (graph resources freed only at refcount 0)
            -> RETIRE_CANDIDATE    (retire only at refcount 0)
            -> COMPLETE

``RollbackExecution`` runs it against an injected ``RollbackPort`` (the coordinator composes one from
the release registry, the placement registry's refcounts and the graph pool; ``CompositeRollbackPort``
does that for callables). Every step checks the table, so retiring first ("use-after-free") or draining
before the fallback is active ("availability outage") is refused before the port is called. A plan
needs a loaded prior on the candidate's checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Callable, Mapping, Protocol, runtime_checkable

from ray_moe.release.lifecycle import ReleaseRecord, ReleaseRegistry


class RollbackStep(str, Enum):
    PLANNED = "PLANNED"
    STOP_NEW_DISPATCH = "STOP_NEW_DISPATCH"
    ACTIVATE_PRIOR = "ACTIVATE_PRIOR"
    DRAIN_CANDIDATE = "DRAIN_CANDIDATE"
    RELEASE_GRAPHS = "RELEASE_GRAPHS"
    RETIRE_CANDIDATE = "RETIRE_CANDIDATE"
    COMPLETE = "COMPLETE"


R = RollbackStep

NEXT_STEP: Mapping[RollbackStep, RollbackStep] = MappingProxyType(
    {
        R.PLANNED: R.STOP_NEW_DISPATCH,
        R.STOP_NEW_DISPATCH: R.ACTIVATE_PRIOR,
        R.ACTIVATE_PRIOR: R.DRAIN_CANDIDATE,
        R.DRAIN_CANDIDATE: R.RELEASE_GRAPHS,
        R.RELEASE_GRAPHS: R.RETIRE_CANDIDATE,
        R.RETIRE_CANDIDATE: R.COMPLETE,
    }
)
"""The one legal successor of each step."""

STEP_ORDER: tuple[RollbackStep, ...] = (
    R.STOP_NEW_DISPATCH, R.ACTIVATE_PRIOR, R.DRAIN_CANDIDATE, R.RELEASE_GRAPHS, R.RETIRE_CANDIDATE, R.COMPLETE,
)

WHY_NOT_EARLIER: Mapping[RollbackStep, str] = MappingProxyType(
    {
        R.STOP_NEW_DISPATCH: "a rollback stops the candidate once, first",
        R.ACTIVATE_PRIOR: "activate the prior only after the candidate's stop fence",
        R.DRAIN_CANDIDATE: "draining first without activating fallback is an availability outage",
        R.RELEASE_GRAPHS: "releasing graphs before the drain reaches refcount 0 is in-flight use-after-free",
        R.RETIRE_CANDIDATE: "retiring first is use-after-free",
        R.COMPLETE: "a rollback completes only after the candidate is retired",
    }
)
"""What goes wrong if a step runs out of order (0x0EA, 0x0EB)."""


class RollbackOrderError(ValueError):
    """A step requested out of order, or its precondition does not hold; nothing was called."""


class RollbackStalledError(RuntimeError):
    """The candidate's refcount did not reach 0 within the poll budget."""


@runtime_checkable
class RollbackPort(Protocol):
    """What a rollback needs from the runtime (the coordinator implements it against the real registries)."""

    def stop_new_dispatch(self, release_id: str) -> None: ...

    def activate(self, release_id: str) -> None: ...

    def refcount(self, release_id: str) -> int: ...

    def release_graphs(self, release_id: str) -> None: ...

    def retire(self, release_id: str) -> None: ...


@dataclass(frozen=True)
class RollbackTarget:
    """The coordinates of one side of a rollback."""

    release_id: str
    placement_generation: str
    checkpoint_version: str
    loaded: bool

    @classmethod
    def from_record(cls, record: ReleaseRecord) -> "RollbackTarget":
        return cls(record.release_id, record.placement_generation, record.checkpoint_version, record.loaded)


@dataclass(frozen=True)
class RollbackPlan:
    """Candidate to roll back and the prior to restore. Refused when the prior is no live fallback."""

    candidate: RollbackTarget
    prior: RollbackTarget

    def __post_init__(self) -> None:
        c, p = self.candidate, self.prior
        if c.release_id == p.release_id:
            raise ValueError(f"prior.release_id={p.release_id!r} is the candidate itself")
        if not p.loaded:
            raise ValueError(
                f"prior.loaded=False for {p.release_id} ({p.placement_generation}): no live fallback; "
                "draining the candidate without it is an availability outage"
            )
        if p.checkpoint_version != c.checkpoint_version:
            raise ValueError(
                f"prior.checkpoint_version={p.checkpoint_version!r} differs from "
                f"candidate.checkpoint_version={c.checkpoint_version!r}"
            )

    @classmethod
    def from_registry(cls, registry: ReleaseRegistry, candidate_id: str, prior_id: str) -> "RollbackPlan":
        return cls(RollbackTarget.from_record(registry.get(candidate_id)),
                   RollbackTarget.from_record(registry.get(prior_id)))


@dataclass(frozen=True)
class RollbackEvent:
    seq: int
    step: RollbackStep
    release_id: str
    detail: str


@dataclass(frozen=True)
class RollbackReport:
    """The ordered timeline of one rollback. RollbackOK of the gate is ``ok``."""

    candidate: str
    prior: str
    events: tuple[RollbackEvent, ...]
    refcount_trace: tuple[int, ...]

    @property
    def steps(self) -> tuple[RollbackStep, ...]:
        return tuple(e.step for e in self.events)

    @property
    def completed(self) -> bool:
        return bool(self.events) and self.events[-1].step is R.COMPLETE

    @property
    def ok(self) -> bool:
        """Completed, in exactly the 0x0EA order, with the drain ending at refcount 0."""
        return self.completed and self.steps == STEP_ORDER and bool(self.refcount_trace) \
            and self.refcount_trace[-1] == 0


class RollbackExecution:
    """One rollback run: a state machine over ``NEXT_STEP`` that calls the port in order.

    ``wait`` is called between refcount polls while draining (inject a sleep or an event wait; the
    default does nothing, for ports whose refcount moves when polled). ``max_drain_polls`` bounds the drain.
    """

    def __init__(self, plan: RollbackPlan, port: RollbackPort, *, max_drain_polls: int = 100_000,
                 wait: Callable[[], None] | None = None):
        if not isinstance(plan, RollbackPlan):
            raise ValueError(f"plan={type(plan).__name__} is not a RollbackPlan")
        if not isinstance(port, RollbackPort):
            raise ValueError(f"port={type(port).__name__} does not implement RollbackPort")
        if isinstance(max_drain_polls, bool) or not isinstance(max_drain_polls, int) or max_drain_polls < 1:
            raise ValueError(f"max_drain_polls={max_drain_polls!r} must be an int >= 1")
        self._plan = plan
        self._port = port
        self._max_polls = max_drain_polls
        self._wait = wait or (lambda: None)
        self._state = R.PLANNED
        self._events: list[RollbackEvent] = []
        self._trace: list[int] = []

    @property
    def state(self) -> RollbackStep:
        return self._state

    def report(self) -> RollbackReport:
        return RollbackReport(self._plan.candidate.release_id, self._plan.prior.release_id,
                              tuple(self._events), tuple(self._trace))

    # ----------------------------------------------------------------------------- steps
    def _enter(self, step: RollbackStep) -> None:
        want = NEXT_STEP.get(self._state)
        if want is not step:
            raise RollbackOrderError(
                f"rollback of {self._plan.candidate.release_id}: step {step.value} refused in state "
                f"{self._state.value} (next is {want.value if want else 'nothing'}): {WHY_NOT_EARLIER[step]}"
            )

    def _done(self, step: RollbackStep, release_id: str, detail: str) -> None:
        self._state = step
        self._events.append(RollbackEvent(len(self._events) + 1, step, release_id, detail))

    def _refcount(self) -> int:
        n = self._port.refcount(self._plan.candidate.release_id)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"refcount({self._plan.candidate.release_id})={n!r} must be an int >= 0")
        return n

    def _require_drained(self, step: RollbackStep) -> None:
        n = self._refcount()
        if n != 0:
            raise RollbackOrderError(
                f"rollback of {self._plan.candidate.release_id}: step {step.value} refused at refcount {n} "
                "(candidate accepted work after the stop fence?): "
                f"{WHY_NOT_EARLIER[step]}"
            )

    def stop_new_dispatch(self) -> None:
        self._enter(R.STOP_NEW_DISPATCH)
        c = self._plan.candidate
        self._port.stop_new_dispatch(c.release_id)
        self._done(R.STOP_NEW_DISPATCH, c.release_id, f"stop new {c.placement_generation} dispatch")

    def activate_prior(self) -> None:
        self._enter(R.ACTIVATE_PRIOR)
        p = self._plan.prior
        self._port.activate(p.release_id)
        self._done(R.ACTIVATE_PRIOR, p.release_id, f"activate loaded {p.placement_generation} for new dispatch")

    def drain_candidate(self) -> None:
        """Poll the candidate's refcount until 0 (each observation goes into the trace)."""
        self._enter(R.DRAIN_CANDIDATE)
        c = self._plan.candidate
        for _ in range(self._max_polls):
            n = self._refcount()
            if self._trace and n > self._trace[-1]:
                raise RollbackOrderError(
                    f"rollback of {c.release_id}: refcount rose {self._trace[-1]} -> {n} after the stop fence "
                    "(candidate accepts work after stop fence: acquisition fence violated)"
                )
            self._trace.append(n)
            if n == 0:
                start = self._trace[0]
                self._done(R.DRAIN_CANDIDATE, c.release_id,
                           f"drain {start} {c.placement_generation} handles to zero")
                return
            self._wait()
        raise RollbackStalledError(
            f"rollback of {c.release_id}: refcount still {self._trace[-1]} after {self._max_polls} polls"
        )

    def release_graphs(self) -> None:
        self._enter(R.RELEASE_GRAPHS)
        self._require_drained(R.RELEASE_GRAPHS)
        c = self._plan.candidate
        self._port.release_graphs(c.release_id)
        self._done(R.RELEASE_GRAPHS, c.release_id, f"release {c.placement_generation} graph resources")

    def retire_candidate(self) -> None:
        self._enter(R.RETIRE_CANDIDATE)
        self._require_drained(R.RETIRE_CANDIDATE)
        c = self._plan.candidate
        self._port.retire(c.release_id)
        self._done(R.RETIRE_CANDIDATE, c.release_id, f"retire {c.placement_generation}")

    def complete(self) -> None:
        self._enter(R.COMPLETE)
        self._done(R.COMPLETE, self._plan.candidate.release_id, "rollback complete")

    def run(self) -> RollbackReport:
        """Run the remaining steps in order and return the report."""
        steps: Mapping[RollbackStep, Callable[[], None]] = {
            R.STOP_NEW_DISPATCH: self.stop_new_dispatch,
            R.ACTIVATE_PRIOR: self.activate_prior,
            R.DRAIN_CANDIDATE: self.drain_candidate,
            R.RELEASE_GRAPHS: self.release_graphs,
            R.RETIRE_CANDIDATE: self.retire_candidate,
            R.COMPLETE: self.complete,
        }
        while self._state in NEXT_STEP:
            steps[NEXT_STEP[self._state]]()
        return self.report()


class CompositeRollbackPort:
    """A ``RollbackPort`` from the release registry plus the two things it does not own.

    ``refcount(release_id)`` comes from the placement registry (dispatch handles of the release's
    generation); ``release_graphs(release_id)`` frees the release's graph pool.
    """

    def __init__(self, releases: ReleaseRegistry, refcount: Callable[[str], int],
                 release_graphs: Callable[[str], None]):
        self._releases = releases
        self._refcount = refcount
        self._release_graphs = release_graphs

    def stop_new_dispatch(self, release_id: str) -> None:
        self._releases.stop_new_dispatch(release_id)

    def activate(self, release_id: str) -> None:
        self._releases.activate(release_id)

    def refcount(self, release_id: str) -> int:
        return self._refcount(release_id)

    def release_graphs(self, release_id: str) -> None:
        self._release_graphs(release_id)

    def retire(self, release_id: str) -> None:
        self._releases.retire(release_id)


def rollback(registry: ReleaseRegistry, candidate_id: str, prior_id: str, *, refcount: Callable[[str], int],
             release_graphs: Callable[[str], None], wait: Callable[[], None] | None = None,
             max_drain_polls: int = 100_000) -> RollbackReport:
    """0x0EA ``rollback(candidate, prior, registry)`` over a ``ReleaseRegistry``."""
    plan = RollbackPlan.from_registry(registry, candidate_id, prior_id)
    port = CompositeRollbackPort(registry, refcount, release_graphs)
    return RollbackExecution(plan, port, wait=wait, max_drain_polls=max_drain_polls).run()
