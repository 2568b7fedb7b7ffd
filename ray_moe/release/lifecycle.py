"""Release lifecycle as a transition table (spec 0x0EA, 0x0DC). Pure: no Ray.

A candidate release moves ``BUILT -> VERIFIED -> LOADED -> SHADOW -> CANARY -> ACTIVE -> DRAINING ->
RETIRED``. Rollback and standby need a few more edges, every one listed in ``TRANSITIONS`` with its
meaning and its guard:

* SHADOW / CANARY / ACTIVE -> DRAINING: the stop fence (rollback, blocked canary, or superseded);
* DRAINING -> LOADED: a superseded release drained to zero and kept resident as the rollback fallback;
* LOADED / DRAINING -> ACTIVE: re-activation of a prior release (it must have been ACTIVE before), or
  the bootstrap of the very first release when no release has ever been ACTIVE;
* BUILT / VERIFIED / LOADED -> RETIRED: reject build, reject load, unload a standby.

Invariants the registry keeps: at most one ACTIVE release, at most one candidate (SHADOW or CANARY),
CANARY -> ACTIVE only through ``promote`` with a passing gate verdict for that release.

The registry does not know dispatch refcounts (the placement registry owns them): the caller must only
retire a DRAINING release at refcount 0, which ``release/rollback.py`` enforces for rollbacks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from enum import Enum
from types import MappingProxyType
from typing import Mapping, Protocol

from ray_moe.release.bundle import ReleaseBundle
from ray_moe.core.types import ReleaseState


class Verdict(Protocol):
    """What promotion reads of a gate verdict (``release.gate.GateVerdict`` is one): the release it judged
    and whether every clause held."""

    release_id: str
    passed: bool


S = ReleaseState


class EdgeGuard(str, Enum):
    """Extra condition on one edge, beyond the source state."""

    NONE = "none"
    GATE_VERDICT = "gate-verdict"  # only promote(release_id, verdict) with verdict.passed
    REACTIVATION = "reactivation"  # was ACTIVE before, or bootstrap (no release ever ACTIVE)


@dataclass(frozen=True)
class Edge:
    meaning: str
    guard: EdgeGuard = EdgeGuard.NONE


TRANSITIONS: Mapping[ReleaseState, Mapping[ReleaseState, Edge]] = MappingProxyType(
    {
        S.BUILT: MappingProxyType({
            S.VERIFIED: Edge("digests recomputed and matched"),
            S.RETIRED: Edge("reject build"),
        }),
        S.VERIFIED: MappingProxyType({
            S.LOADED: Edge("weights, maps, process group and graphs resident"),
            S.RETIRED: Edge("reject load"),
        }),
        S.LOADED: MappingProxyType({
            S.SHADOW: Edge("serve mirrored traffic, outputs compared, never returned"),
            S.ACTIVE: Edge("re-activate a prior release, or bootstrap the first one", EdgeGuard.REACTIVATION),
            S.RETIRED: Edge("unload a standby release"),
        }),
        S.SHADOW: MappingProxyType({
            S.CANARY: Edge("serve a fraction of new dispatches"),
            S.DRAINING: Edge("stop fence: candidate aborted in shadow"),
        }),
        S.CANARY: MappingProxyType({
            S.ACTIVE: Edge("promotion gate passed", EdgeGuard.GATE_VERDICT),
            S.DRAINING: Edge("stop fence: canary blocked or rolled back"),
        }),
        S.ACTIVE: MappingProxyType({
            S.DRAINING: Edge("stop fence: superseded or rolled back"),
        }),
        S.DRAINING: MappingProxyType({
            S.RETIRED: Edge("refcount reached 0; resources released"),
            S.LOADED: Edge("refcount reached 0; kept resident as rollback fallback"),
            S.ACTIVE: Edge("re-activate a prior release that is still draining", EdgeGuard.REACTIVATION),
        }),
        S.RETIRED: MappingProxyType({}),
    }
)

RESIDENT_STATES: frozenset[ReleaseState] = frozenset({S.LOADED, S.SHADOW, S.CANARY, S.ACTIVE, S.DRAINING})
CANDIDATE_STATES: frozenset[ReleaseState] = frozenset({S.SHADOW, S.CANARY})


class IllegalTransitionError(ValueError):
    """A transition outside the table or against a guard; the message names both states."""

    def __init__(self, release_id: str, src: ReleaseState, dst: ReleaseState, why: str):
        super().__init__(f"release {release_id}: illegal transition {src.value} -> {dst.value}: {why}")
        self.release_id = release_id
        self.src = src
        self.dst = dst


@dataclass(frozen=True)
class TransitionEvent:
    """One lifecycle step. ``seq`` is registry-wide, so events of different releases interleave in order."""

    seq: int
    release_id: str
    from_state: ReleaseState | None
    to_state: ReleaseState
    reason: str


@dataclass(frozen=True)
class ReleaseRecord:
    """A release's bundle, current state and ordered timeline (a new record per transition)."""

    bundle: ReleaseBundle
    state: ReleaseState
    timeline: tuple[TransitionEvent, ...]

    @property
    def release_id(self) -> str:
        return self.bundle.release_id

    @property
    def checkpoint_version(self) -> str:
        return self.bundle.checkpoint_version

    @property
    def placement_generation(self) -> str:
        return self.bundle.placement_generation

    @property
    def loaded(self) -> bool:
        """Weights, maps and process group are resident (usable as a rollback fallback)."""
        return self.state in RESIDENT_STATES

    @property
    def was_active(self) -> bool:
        return any(e.to_state is S.ACTIVE for e in self.timeline)

    def path(self) -> tuple[ReleaseState, ...]:
        return tuple(e.to_state for e in self.timeline)


def check_edge(release_id: str, src: ReleaseState, dst: ReleaseState) -> Edge:
    """The table lookup: the edge, or ``IllegalTransitionError`` naming both states."""
    src, dst = ReleaseState(src), ReleaseState(dst)
    edge = TRANSITIONS[src].get(dst)
    if edge is None:
        allowed = ", ".join(s.value for s in TRANSITIONS[src]) or "none (terminal)"
        raise IllegalTransitionError(release_id, src, dst, f"not in the lifecycle table (from {src.value}: {allowed})")
    return edge


class ReleaseRegistry:
    """Thread-safe owner of release records, the active release, the candidate and its canary fraction."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._records: dict[str, ReleaseRecord] = {}
        self._seq = 0
        self._canary_fraction = 0.0
        self._ever_active = False

    # ------------------------------------------------------------------------------ views
    def get(self, release_id: str) -> ReleaseRecord:
        with self._lock:
            rec = self._records.get(release_id)
        if rec is None:
            raise ValueError(f"release_id={release_id!r} is not registered")
        return rec

    def records(self) -> tuple[ReleaseRecord, ...]:
        with self._lock:
            return tuple(self._records.values())

    def timeline(self) -> tuple[TransitionEvent, ...]:
        """Every event of every release in registry order."""
        with self._lock:
            return tuple(sorted((e for r in self._records.values() for e in r.timeline), key=lambda e: e.seq))

    def active(self) -> str | None:
        with self._lock:
            return next((r.release_id for r in self._records.values() if r.state is S.ACTIVE), None)

    def candidate(self) -> str | None:
        with self._lock:
            return next((r.release_id for r in self._records.values() if r.state in CANDIDATE_STATES), None)

    @property
    def canary_fraction(self) -> float:
        with self._lock:
            return self._canary_fraction

    def select_for_new_dispatch(self, u: float) -> str:
        """Which release serves a new dispatch, given a uniform draw ``u`` in [0, 1).

        The CANARY candidate when ``u < canary_fraction``, else the ACTIVE release. SHADOW never serves.
        """
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not (0.0 <= u < 1.0):
            raise ValueError(f"u={u!r} must be a number in [0, 1)")
        with self._lock:
            cand = self.candidate()
            if cand is not None and self._records[cand].state is S.CANARY and u < self._canary_fraction:
                return cand
            act = self.active()
        if act is None:
            raise ValueError("active release: none is ACTIVE, no release can take a new dispatch")
        return act

    # ------------------------------------------------------------------------------ transitions
    def register(self, bundle: ReleaseBundle, reason: str = "built") -> ReleaseRecord:
        if not isinstance(bundle, ReleaseBundle):
            raise ValueError(f"bundle={type(bundle).__name__} is not a ReleaseBundle")
        with self._lock:
            if bundle.release_id in self._records:
                raise ValueError(f"release_id={bundle.release_id!r} is already registered")
            self._seq += 1
            ev = TransitionEvent(self._seq, bundle.release_id, None, S.BUILT, reason)
            rec = ReleaseRecord(bundle, S.BUILT, (ev,))
            self._records[bundle.release_id] = rec
            return rec

    def _apply(self, release_id: str, dst: ReleaseState, reason: str, *, verdict: "Verdict | None" = None) -> ReleaseRecord:
        """One guarded step, caller holds the lock.

        1. Look the edge up in the table (illegal -> error naming both states).
        2. Check the edge guard and the single-ACTIVE / single-candidate invariants.
        3. Append the event with the next registry-wide seq.
        """
        rec = self.get(release_id)
        dst = ReleaseState(dst)
        edge = check_edge(release_id, rec.state, dst)
        if edge.guard is EdgeGuard.GATE_VERDICT:
            if verdict is None:
                raise IllegalTransitionError(release_id, rec.state, dst, "needs promote() with a gate verdict")
            if verdict.release_id != release_id or not verdict.passed:
                raise IllegalTransitionError(
                    release_id, rec.state, dst,
                    f"gate verdict for {verdict.release_id} passed={verdict.passed} does not promote it",
                )
        if edge.guard is EdgeGuard.REACTIVATION and not rec.was_active and self._ever_active:
            raise IllegalTransitionError(
                release_id, rec.state, dst, "only a release that was ACTIVE before may be re-activated"
            )
        if dst is S.ACTIVE:
            other = self.active()
            if other is not None and other != release_id:
                raise IllegalTransitionError(release_id, rec.state, dst, f"{other} is ACTIVE; stop it first")
        if dst in CANDIDATE_STATES:
            other = self.candidate()
            if other is not None and other != release_id:
                raise IllegalTransitionError(release_id, rec.state, dst, f"{other} is already the candidate")
        self._seq += 1
        ev = TransitionEvent(self._seq, release_id, rec.state, dst, reason)
        new = replace(rec, state=dst, timeline=rec.timeline + (ev,))
        self._records[release_id] = new
        if dst is S.ACTIVE:
            self._ever_active = True
        if rec.state in CANDIDATE_STATES and dst not in CANDIDATE_STATES:
            self._canary_fraction = 0.0
        return new

    def transition(self, release_id: str, dst: ReleaseState, reason: str) -> ReleaseRecord:
        """A table-checked transition (CANARY -> ACTIVE needs ``promote``)."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason={reason!r} must be a non-empty string")
        with self._lock:
            return self._apply(release_id, dst, reason)

    def begin_canary(self, release_id: str, fraction: float, reason: str = "shadow gate passed") -> ReleaseRecord:
        """SHADOW -> CANARY with ``0 < fraction <= 1`` of new dispatches."""
        _check_fraction(fraction)
        with self._lock:
            rec = self._apply(release_id, S.CANARY, reason)
            self._canary_fraction = float(fraction)
            return rec

    def set_canary_fraction(self, release_id: str, fraction: float) -> None:
        _check_fraction(fraction)
        with self._lock:
            rec = self.get(release_id)
            if rec.state is not S.CANARY:
                raise ValueError(f"release {release_id}: canary fraction needs state CANARY, got {rec.state.value}")
            self._canary_fraction = float(fraction)

    def promote(self, release_id: str, verdict: Verdict) -> str | None:
        """CANARY -> ACTIVE under a passing verdict; the previous ACTIVE release goes DRAINING.

        Returns the superseded release id (the caller drains it, then moves it to LOADED or RETIRED).
        """
        with self._lock:
            rec = self.get(release_id)
            check_edge(release_id, rec.state, S.ACTIVE)
            if verdict is None or verdict.release_id != release_id or not verdict.passed:
                raise IllegalTransitionError(
                    release_id, rec.state, S.ACTIVE,
                    "gate verdict missing or not passed for this release"
                    if verdict is None else
                    f"gate verdict for {verdict.release_id} passed={verdict.passed} does not promote it",
                )
            prior = self.active()
            if prior is not None:
                self._apply(prior, S.DRAINING, f"superseded by {release_id}")
            self._apply(release_id, S.ACTIVE, "promotion gate passed", verdict=verdict)
            return prior

    # ---------------------------------------------- the rollback interface (release/rollback.py)
    def stop_new_dispatch(self, release_id: str) -> None:
        """Stop fence: SHADOW / CANARY / ACTIVE -> DRAINING; no new dispatch selects it afterwards."""
        self.transition(release_id, S.DRAINING, "stop new dispatch")

    def activate(self, release_id: str) -> None:
        """Make a prior release take new dispatch (LOADED / DRAINING -> ACTIVE).

        Already ACTIVE (a blocked canary rolls back while its prior never stopped serving): no-op.
        """
        with self._lock:
            if self.get(release_id).state is S.ACTIVE:
                return
            self._apply(release_id, S.ACTIVE, "activate for new dispatch")

    def retire(self, release_id: str) -> None:
        """-> RETIRED. The caller guarantees refcount 0 for a DRAINING release."""
        self.transition(release_id, S.RETIRED, "retire")


def _check_fraction(fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (0.0 < fraction <= 1.0):
        raise ValueError(f"fraction={fraction!r} must be in (0, 1]")
