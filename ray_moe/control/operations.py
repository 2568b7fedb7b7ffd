"""Elastic operations that cannot stall: a deadline per stage, progress while in flight (no Ray here).

Every elastic operation (rebalance, scale, add / remove a rank) runs the same stages
(``OperationStage``): plan -> reserve -> copy -> verify -> publish -> drain -> retire. The control plane
enters each stage on an ``OperationTracker``; every fleet call of the stage gets the seconds the stage has
left (``remaining``), and a call that does not answer in them raises ``RankTimeoutError`` (the Ray fleet
waits with ``ray.wait(refs, timeout=...)``). The plane turns that into ``StageDeadlineError`` naming the
stage and the ranks that did not answer (``expired``), and aborts:

* before publish (plan, reserve, copy, verify): the prior generation keeps serving, the candidate is
  abandoned and every staged copy is freed on every shard;
* publish: ranks that already published go back to the prior generation;
* drain / retire: the new generation already serves; the prior one stays DRAINING and a later change
  retires it (``ControlPlane.retire_pending``).

``status()`` is what the coordinator's ``status()["operation"]`` shows: the operation in flight (stage,
elapsed, stage deadline, bytes copied of the planned bytes), and ``recent()`` the last ones that ended.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any, Callable, Iterator, Mapping, Sequence

from ray_moe.core.errors import RankDeadError, RayMoEError
from ray_moe.model.config import OperationStage, StageDeadlines

__all__ = ["OperationOutcome", "OperationProgress", "OperationStage", "OperationTracker", "RankTimeoutError",
           "StageDeadlineError", "StageDeadlines", "StageTiming", "abort_stage", "roll_back_publish"]

#: stages after which the new generation serves: a deadline there does not bring the prior one back
PAST_PUBLISH = frozenset({OperationStage.DRAIN, OperationStage.RETIRE})


class RankTimeoutError(RayMoEError):
    """Shard calls that did not answer within the seconds they were given; ``ranks`` names the ranks."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(int(r) for r in ranks)

    def __reduce__(self):
        return (_rebuild_timeout, (str(self), self.ranks))


class StageDeadlineError(RayMoEError):
    """A stage of an elastic operation passed its deadline; the operation was aborted.

    ``stage``: the stage; ``ranks``: the ranks that did not answer (empty when the coordinator's own work
    ran long, e.g. the solve); ``generation``: the candidate; ``deadline_s``: the stage's deadline."""

    def __init__(self, message: str, *, stage: OperationStage, ranks: tuple[int, ...] = (),
                 generation: int | None = None, deadline_s: float = 0.0):
        super().__init__(message)
        self.stage = OperationStage(stage)
        self.ranks = tuple(int(r) for r in ranks)
        self.generation = generation
        self.deadline_s = float(deadline_s)

    def __reduce__(self):
        return (_rebuild_deadline, (str(self), self.stage.value, self.ranks, self.generation, self.deadline_s))


def _rebuild_timeout(message: str, ranks: tuple[int, ...]) -> RankTimeoutError:
    return RankTimeoutError(message, ranks=ranks)


def _rebuild_deadline(message: str, stage: str, ranks: tuple[int, ...], generation: int | None,
                      deadline_s: float) -> StageDeadlineError:
    return StageDeadlineError(message, stage=OperationStage(stage), ranks=ranks, generation=generation,
                              deadline_s=deadline_s)


class OperationOutcome(str, Enum):
    RUNNING = "running"
    DONE = "done"
    ABORTED = "aborted"  # a stage passed its deadline (``StageDeadlineError``)
    FAILED = "failed"  # any other error (refused plan, digest mismatch, dead rank, ...)


@dataclass(frozen=True)
class StageTiming:
    """One stage of one operation: seconds from its start (relative to the operation's start)."""

    stage: OperationStage
    started_s: float
    seconds: float | None = None  # None while the stage runs


@dataclass(frozen=True)
class OperationProgress:
    """An elastic operation, in flight or ended (times: seconds; bytes: measured where the fleet measures them).

    started_at: wall time; elapsed_s / stage_elapsed_s: monotonic seconds since the operation / stage began;
    bytes_planned: the plan's analytical bytes to write (copies + loads); bytes_copied: bytes that crossed
    between shards so far; copies_done / copies_planned: (layer, expert) copies and checkpoint loads."""

    reason: str
    generation: int | None
    started_at: float
    outcome: OperationOutcome = OperationOutcome.RUNNING
    stage: OperationStage | None = None
    stage_deadline_s: float | None = None
    elapsed_s: float = 0.0
    stage_elapsed_s: float = 0.0
    bytes_planned: int | None = None
    bytes_copied: int = 0
    copies_planned: int | None = None
    copies_done: int = 0
    stages: tuple[StageTiming, ...] = ()
    error: str | None = None
    late_ranks: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(outcome=self.outcome.value, stage=None if self.stage is None else self.stage.value,
                   stages=[{**asdict(s), "stage": s.stage.value} for s in self.stages], late_ranks=list(self.late_ranks))
        return out


class OperationTracker:
    """The elastic operation in flight on one control plane and the last ones that ended. Thread-safe: the
    coordinator's ``status()`` reads it while the operation runs on another thread.

    ``clock``: monotonic seconds (deadlines, elapsed); ``wall``: wall seconds (``started_at``).
    """

    def __init__(self, deadlines: StageDeadlines, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, keep: int = 8) -> None:
        if not isinstance(deadlines, StageDeadlines):
            raise ValueError(f"deadlines={type(deadlines).__name__} is not a StageDeadlines")
        self.deadlines = deadlines
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._op: OperationProgress | None = None
        self._t0 = 0.0
        self._stage_t0 = 0.0
        self._depth = 0
        self._done: deque[OperationProgress] = deque(maxlen=keep)

    # ---------------------------------------------------------------- lifecycle
    @contextmanager
    def operation(self, reason: str, generation: int | None) -> Iterator[None]:
        """One operation (nested calls, e.g. ``scale`` -> ``apply`` -> ``stage``, join the outermost). Ends DONE,
        ABORTED (``StageDeadlineError``) or FAILED (any other exception, re-raised)."""
        with self._lock:
            self._depth += 1
            outer = self._depth == 1
            if outer:
                self._t0 = self._stage_t0 = self._clock()
                self._op = OperationProgress(reason=reason, generation=generation, started_at=self._wall())
        try:
            yield
        except BaseException as exc:
            if outer:
                late = exc.ranks if isinstance(exc, StageDeadlineError) else ()
                kind = OperationOutcome.ABORTED if isinstance(exc, StageDeadlineError) else OperationOutcome.FAILED
                self._finish(kind, f"{type(exc).__name__}: {exc}", late)
            raise
        else:
            if outer:
                self._finish(OperationOutcome.DONE, None, ())
        finally:
            with self._lock:
                self._depth -= 1

    def _finish(self, outcome: OperationOutcome, error: str | None, late: Sequence[int]) -> None:
        with self._lock:
            op = self._snapshot()
            if op is None:
                return
            stages = tuple(s if s.seconds is not None else replace(s, seconds=op.stage_elapsed_s) for s in op.stages)
            self._done.append(replace(op, outcome=outcome, error=error, late_ranks=tuple(late), stages=stages))
            self._op = None

    def enter(self, stage: OperationStage, *, bytes_planned: int | None = None, copies_planned: int | None = None,
              deadline_s: float | None = None) -> None:
        """The operation moves on to ``stage``; its deadline (``deadlines``, or ``deadline_s``) starts now."""
        stage = OperationStage(stage)
        with self._lock:
            if self._op is None:
                return
            now = self._clock()
            stages = list(self._op.stages)
            if stages and stages[-1].seconds is None:
                stages[-1] = replace(stages[-1], seconds=now - self._stage_t0)
            stages.append(StageTiming(stage, now - self._t0))
            self._stage_t0 = now
            deadline = self.deadlines.of(stage) if deadline_s is None else float(deadline_s)
            self._op = replace(self._op, stage=stage, stage_deadline_s=deadline, stages=tuple(stages),
                               bytes_planned=self._op.bytes_planned if bytes_planned is None else int(bytes_planned),
                               copies_planned=self._op.copies_planned if copies_planned is None else int(copies_planned))

    def set_generation(self, generation: int) -> None:
        with self._lock:
            if self._op is not None:
                self._op = replace(self._op, generation=int(generation))

    def copied(self, nbytes: int, copies: int) -> None:
        """``copies`` (layer, expert) weights (``nbytes`` bytes) arrived on their target rank."""
        with self._lock:
            if self._op is not None:
                self._op = replace(self._op, bytes_copied=self._op.bytes_copied + int(nbytes),
                                   copies_done=self._op.copies_done + int(copies))

    # ---------------------------------------------------------------- deadlines
    def remaining(self) -> float | None:
        """Seconds the current stage has left (0 when past); None when no operation runs (no deadline)."""
        with self._lock:
            if self._op is None or self._op.stage is None:
                return None
            return max(0.0, self._op.stage_deadline_s - (self._clock() - self._stage_t0))

    def check(self, what: str = "") -> None:
        """Raise ``StageDeadlineError`` (no rank named) when the current stage is past its deadline."""
        left = self.remaining()
        if left is not None and left <= 0.0:
            raise self.expired((), what or "the coordinator's own work ran past it")

    def expired(self, ranks: Sequence[int], what: str) -> StageDeadlineError:
        """The error for the current stage passing its deadline because ``ranks`` did not answer ``what``."""
        with self._lock:
            op = self._op
        stage = OperationStage.PLAN if op is None or op.stage is None else op.stage
        deadline = self.deadlines.of(stage) if op is None or op.stage_deadline_s is None else op.stage_deadline_s
        who = f"rank(s) {sorted(set(ranks))} did not answer" if ranks else "no rank named"
        gen = None if op is None else op.generation
        return StageDeadlineError(f"stage {stage.value} of generation {gen} passed its {deadline:g}s deadline: {who} "
                                  f"({what})", stage=stage, ranks=tuple(sorted(set(ranks))), generation=gen,
                                  deadline_s=deadline)

    def call(self, fleet: Any, method: str, args: Mapping[int, tuple]) -> dict[int, Any]:
        """``fleet.call_within`` with the current stage's seconds left; a timeout becomes ``StageDeadlineError``."""
        try:
            return fleet.call_within(method, args, self.remaining())
        except RankTimeoutError as exc:
            raise self.expired(exc.ranks, str(exc)) from None

    # ---------------------------------------------------------------- views
    def _snapshot(self) -> OperationProgress | None:
        op = self._op
        if op is None:
            return None
        now = self._clock()
        return replace(op, elapsed_s=now - self._t0, stage_elapsed_s=now - self._stage_t0)

    def current(self) -> OperationProgress | None:
        with self._lock:
            return self._snapshot()

    def status(self, last: int = 4) -> dict[str, Any]:
        """JSON-able: ``in_flight`` (the operation running, or None), ``recent`` (the last ``last`` that ended,
        oldest first) and the deadlines."""
        with self._lock:
            cur = self._snapshot()
            done = list(self._done)[-last:] if last else list(self._done)
        return {"in_flight": None if cur is None else cur.as_dict(), "recent": [d.as_dict() for d in done],
                "deadlines": self.deadlines.model_dump(mode="json")}

    def recent(self) -> tuple[OperationProgress, ...]:
        with self._lock:
            return tuple(self._done)


# ---------------------------------------------------------------- aborts (over a ControlPlane)
def abort_stage(plane: Any, generation: int, staged: Mapping[int, set[tuple[int, int]]], exc: BaseException) -> None:
    """An operation on ``plane`` (a ``ControlPlane``) failed before publish: the prior generation keeps serving;
    the candidate is abandoned and its staged copies freed on every shard (within the retire deadline: a hung
    rank does not hang the abort; a copy that lands after it is freed by the fleet when it does)."""
    if isinstance(exc, StageDeadlineError):
        plane.log("deadline", generation, str(exc))
    within = plane.cfg.deadlines.retire_s
    live = plane.live_ranks()
    for method, args in (("drop_experts", {u: (sorted(k),) for u, k in staged.items() if u in live}),
                         ("retire", {r: (generation,) for r in live})):  # a prepared PENDING candidate
        try:
            if args:
                plane.fleet.call_within(method, args, within)
        except RankDeadError as dead:
            plane.dead_ranks.update(dead.ranks)
        except Exception as err:  # noqa: BLE001 - the abort itself must end
            plane.log("abort-cleanup", generation, f"{method}: {type(err).__name__}: {err}")
    _abandon(plane, generation, f"{type(exc).__name__}: {exc}")


def roll_back_publish(plane: Any, generation: int, prior: int, exc: StageDeadlineError) -> None:
    """Publish passed its deadline: ranks that answered go back to ``prior`` (a DRAINING prior is
    reactivated), the candidate is retired on every rank and abandoned here."""
    plane.log("deadline", generation, str(exc))
    for method, g in (("publish", prior), ("retire", generation)):
        try:
            plane.fleet.call_within(method, {r: (g,) for r in plane.live_ranks()}, plane.cfg.deadlines.publish_s)
        except Exception as err:  # noqa: BLE001 - the roll-back itself must end
            plane.log("abort-cleanup", generation, f"{method} {g}: {type(err).__name__}: {err}")
    _abandon(plane, generation, f"publish rolled back; generation {prior} keeps serving")


def _abandon(plane: Any, generation: int, why: str) -> None:
    """The last steps of every abort: the candidate abandoned in the registry (best effort), logged, the
    operation ended."""
    try:
        plane.registry.abandon(generation)
    except Exception:  # noqa: BLE001 - the abort itself must end
        pass
    plane.log("abort", generation, why)
    plane.end_op()
