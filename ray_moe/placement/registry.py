"""Placement generations, their states and their refcounted leases (spec 0x01D2, 0x02B3, 0x08G, 0x0EA).

Pure control-plane code: no Ray. The coordinator actor is a thin, concurrent shell over one
``GenerationRegistry``; every public method takes the registry's single ``RLock``.

State machine (``GenerationState``, spec 0x02B3), applied only through ``TRANSITIONS``::

    PENDING  --publish-->     ACTIVE      a candidate becomes eligible for new dispatches
    PENDING  --retire-->      RETIRED     abandon a candidate that never served
    ACTIVE   --drain-->       DRAINING    a newer publish, or an explicit stop of new dispatch
    DRAINING --reactivate-->  ACTIVE      rollback re-activates a still-live prior generation
    DRAINING --retire-->      RETIRED     only when its refcount is 0

Rules the registry enforces (each refusal happens before any state changes):

1. Manifests are immutable content; ``register`` stores a PENDING generation, a generation id is
   never reused (a RETIRED one never comes back).
2. At most one generation is ACTIVE. ``publish``/``reactivate`` drain the previous ACTIVE one.
3. New dispatch pins only the ACTIVE generation (``acquire``/``acquire_generation``); a DRAINING
   generation serves only the leases it already has.
4. Combine resolves the handle's own generation through ``require_live`` (ACTIVE or DRAINING), never
   ``active()``. A RETIRED generation serves nothing.
5. ``retire`` is refused from ACTIVE (drain first) and while the refcount is above 0. Refcounts
   never go negative: a lease releases once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Callable, Final, Mapping

from ray_moe.core.errors import GenerationError, StaleGenerationError
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.core.types import GenerationId, GenerationState, placement_version

__all__ = [
    "GenerationAction",
    "GenerationRegistry",
    "GenerationStatus",
    "Lease",
    "RegistryEvent",
    "RegistryEventKind",
    "TRANSITIONS",
]


class GenerationAction(str, Enum):
    """A state-changing verb of the registry (the edge labels of ``TRANSITIONS``)."""

    PUBLISH = "publish"
    DRAIN = "drain"
    REACTIVATE = "reactivate"
    RETIRE = "retire"


_S = GenerationState
_A = GenerationAction

#: (state, action) -> next state. Any pair missing here is an illegal transition.
TRANSITIONS: Final[Mapping[tuple[GenerationState, GenerationAction], GenerationState]] = MappingProxyType(
    {
        (_S.PENDING, _A.PUBLISH): _S.ACTIVE,
        (_S.PENDING, _A.RETIRE): _S.RETIRED,  # abandon a candidate
        (_S.ACTIVE, _A.DRAIN): _S.DRAINING,
        (_S.DRAINING, _A.REACTIVATE): _S.ACTIVE,  # rollback
        (_S.DRAINING, _A.RETIRE): _S.RETIRED,  # guarded: refcount == 0
    }
)


class RegistryEventKind(str, Enum):
    """Kinds of timeline events."""

    REGISTER = "register"
    PUBLISH = "publish"
    DRAIN = "drain"
    REACTIVATE = "reactivate"
    RETIRE = "retire"
    RETIRE_DENIED = "retire_denied"
    ACQUIRE = "acquire"
    RELEASE = "release"


@dataclass(frozen=True)
class Lease:
    """One generation reference held by a dispatch handle (spec 0x01D2).

    ``acquired_at`` is the registry clock's reading (seconds) when the lease was issued.
    """

    lease_id: str
    generation: GenerationId
    holder: str
    acquired_at: float


@dataclass(frozen=True)
class RegistryEvent:
    """One timeline entry. ``seq`` increases by one per event over the registry's life."""

    seq: int
    event: RegistryEventKind
    generation: GenerationId
    detail: str


@dataclass(frozen=True)
class GenerationStatus:
    """Report row of one generation (what ``ray-moe status`` prints)."""

    generation: GenerationId
    placement_version: str
    state: GenerationState
    refcount: int
    checkpoint_version: str
    content_digest: str


class _Entry:
    """Mutable per-generation bookkeeping; only ever touched under the registry lock."""

    __slots__ = ("manifest", "state", "leases", "digest")

    def __init__(self, manifest: PlacementManifest) -> None:
        self.manifest = manifest
        self.state = GenerationState.PENDING
        self.leases: dict[str, Lease] = {}
        self.digest = manifest.content_digest()


class GenerationRegistry:
    """Thread-safe registry of placement generations and their leases.

    Args:
        clock: returns seconds for ``Lease.acquired_at`` (injectable for tests; default ``time.time``).
        timeline_limit: how many most-recent events ``timeline()`` keeps (>= 1).
        record_leases: also log ACQUIRE/RELEASE events (turn off on a per-step hot path; the state
            transitions are always logged).
    """

    def __init__(
        self, *, clock: Callable[[], float] = time.time, timeline_limit: int = 10_000, record_leases: bool = True
    ) -> None:
        if isinstance(timeline_limit, bool) or not isinstance(timeline_limit, int) or timeline_limit < 1:
            raise ValueError(f"timeline_limit={timeline_limit!r} must be an int >= 1")
        self._lock = threading.RLock()
        self._clock = clock
        self._entries: dict[GenerationId, _Entry] = {}
        self._active: GenerationId | None = None
        self._lease_index: dict[str, GenerationId] = {}
        self._next_lease = 0
        self._next_seq = 0
        self._timeline: deque[RegistryEvent] = deque(maxlen=timeline_limit)
        self._record_leases = bool(record_leases)

    # ------------------------------------------------------------------ internals
    def _log(self, kind: RegistryEventKind, generation: GenerationId, detail: str) -> None:
        self._timeline.append(RegistryEvent(self._next_seq, kind, generation, detail))
        self._next_seq += 1

    def _entry(self, generation: GenerationId) -> _Entry:
        entry = self._entries.get(generation)
        if entry is None:
            raise GenerationError(f"generation={generation!r} is not registered ({placement_version(generation)})")
        return entry

    def _next_state(self, generation: GenerationId, action: GenerationAction) -> GenerationState:
        """Look ``action`` up in ``TRANSITIONS`` for ``generation``'s state; raise if illegal."""
        entry = self._entry(generation)
        nxt = TRANSITIONS.get((entry.state, action))
        if nxt is None:
            legal = sorted(a.value for (s, a) in TRANSITIONS if s == entry.state)
            raise GenerationError(
                f"{placement_version(generation)}: cannot {action.value} from state={entry.state.value} "
                f"(legal from {entry.state.value}: {legal or 'none'})"
            )
        return nxt

    def _active_error(self, message: str, requested: GenerationId | None) -> StaleGenerationError:
        return StaleGenerationError(message, requested=requested, active=self._active)

    def _issue(self, entry: _Entry, holder: str) -> Lease:
        if not isinstance(holder, str) or not holder:
            raise ValueError(f"holder={holder!r} must be a non-empty string")
        generation = entry.manifest.generation
        lease = Lease(
            lease_id=f"lease-{self._next_lease:08d}",
            generation=generation,
            holder=holder,
            acquired_at=float(self._clock()),
        )
        self._next_lease += 1
        entry.leases[lease.lease_id] = lease
        self._lease_index[lease.lease_id] = generation
        if self._record_leases:
            self._log(RegistryEventKind.ACQUIRE, generation, f"{lease.lease_id} holder={holder} refcount={len(entry.leases)}")
        return lease

    # ------------------------------------------------------------------ transitions
    def register(self, manifest: PlacementManifest) -> GenerationId:
        """Store ``manifest`` as a PENDING generation and return its id.

        Raises ``ValueError`` for a non-manifest, ``GenerationError`` for a generation id already
        registered (in any state, RETIRED included: ids are never reused).
        """
        if not isinstance(manifest, PlacementManifest):
            raise ValueError(f"manifest={type(manifest).__name__} is not a PlacementManifest")
        with self._lock:
            g = manifest.generation
            if g in self._entries:
                raise GenerationError(
                    f"generation={g} ({manifest.placement_version}) is already registered "
                    f"(state={self._entries[g].state.value}); generation ids are never reused"
                )
            # Store the content only: state and refcount are the registry's, not the manifest's.
            content = manifest.with_state(GenerationState.PENDING, 0)
            self._entries[g] = _Entry(content)
            self._log(RegistryEventKind.REGISTER, g, f"{manifest.placement_version} digest={self._entries[g].digest[:12]}")
            return g

    def publish(self, generation: GenerationId) -> GenerationId | None:
        """PENDING -> ACTIVE for new dispatches; the previous ACTIVE generation -> DRAINING.

        Returns the generation that was drained (or ``None``).
        """
        with self._lock:
            nxt = self._next_state(generation, GenerationAction.PUBLISH)
            previous = self._active
            if previous is not None:
                self._next_state(previous, GenerationAction.DRAIN)  # validated before any change
            # All checks passed: apply.
            if previous is not None:
                self._drain(previous, reason=f"superseded by {placement_version(generation)}")
            self._entries[generation].state = nxt
            self._active = generation
            self._log(RegistryEventKind.PUBLISH, generation, f"{placement_version(generation)} ACTIVE for new dispatch")
            return previous

    def _drain(self, generation: GenerationId, *, reason: str) -> None:
        entry = self._entries[generation]
        entry.state = self._next_state(generation, GenerationAction.DRAIN)
        if self._active == generation:
            self._active = None
        self._log(RegistryEventKind.DRAIN, generation, f"{reason}; refcount={len(entry.leases)}")

    def mark_draining(self, generation: GenerationId) -> None:
        """Stop new dispatch on an ACTIVE generation (ACTIVE -> DRAINING), leaving none ACTIVE.

        This is the rollback stop fence of spec 0x0EA. A generation that is already DRAINING is left
        as it is (the spec's ``publish`` then ``mark_draining`` sequence is idempotent here).
        """
        with self._lock:
            if self._entry(generation).state is GenerationState.DRAINING:
                return
            self._next_state(generation, GenerationAction.DRAIN)
            self._drain(generation, reason="stop new dispatch")

    stop_new_dispatch = mark_draining

    def reactivate(self, generation: GenerationId) -> GenerationId | None:
        """Rollback: DRAINING -> ACTIVE; the current ACTIVE generation (if any) -> DRAINING.

        Returns the generation that was drained (or ``None``).
        """
        with self._lock:
            nxt = self._next_state(generation, GenerationAction.REACTIVATE)
            previous = self._active
            if previous is not None:
                self._next_state(previous, GenerationAction.DRAIN)
                self._drain(previous, reason=f"rollback to {placement_version(generation)}")
            self._entries[generation].state = nxt
            self._active = generation
            self._log(RegistryEventKind.REACTIVATE, generation, f"{placement_version(generation)} ACTIVE again")
            return previous

    def can_retire(self, generation: GenerationId) -> bool:
        """True iff ``retire(generation)`` would succeed now (PENDING, or DRAINING at refcount 0)."""
        with self._lock:
            entry = self._entry(generation)
            return (entry.state, GenerationAction.RETIRE) in TRANSITIONS and not entry.leases

    def retire(self, generation: GenerationId) -> None:
        """DRAINING (refcount 0) or PENDING -> RETIRED.

        Raises ``GenerationError`` naming the state (from ACTIVE: drain first; RETIRED: already) or the
        refcount and its holders (while leases are live). Nothing changes on refusal.
        """
        with self._lock:
            entry = self._entry(generation)
            nxt = self._next_state(generation, GenerationAction.RETIRE)
            if entry.leases:
                holders = sorted(lease.holder for lease in entry.leases.values())
                self._log(RegistryEventKind.RETIRE_DENIED, generation, f"refcount={len(entry.leases)}")
                raise GenerationError(
                    f"{placement_version(generation)}: retire refused, refcount={len(entry.leases)} "
                    f"(live holders {holders})"
                )
            entry.state = nxt
            self._log(RegistryEventKind.RETIRE, generation, f"{placement_version(generation)} RETIRED")

    def abandon(self, generation: GenerationId) -> None:
        """Retire a PENDING candidate that never served (PENDING -> RETIRED)."""
        with self._lock:
            state = self._entry(generation).state
            if state is not GenerationState.PENDING:
                raise GenerationError(f"{placement_version(generation)}: abandon needs PENDING, state={state.value}")
            self.retire(generation)

    def retire_when_drained(self) -> tuple[GenerationId, ...]:
        """Retire every DRAINING generation whose refcount is 0; return their ids (ascending)."""
        with self._lock:
            done = tuple(
                g
                for g in sorted(self._entries)
                if self._entries[g].state is GenerationState.DRAINING and not self._entries[g].leases
            )
            for g in done:
                self.retire(g)
            return done

    # ------------------------------------------------------------------ leases
    def acquire(self, holder: str) -> Lease:
        """Pin the ACTIVE generation for a new dispatch; raise ``StaleGenerationError`` if none."""
        with self._lock:
            if self._active is None:
                raise self._active_error(f"acquire by holder={holder!r}: no generation is ACTIVE", None)
            return self._issue(self._entries[self._active], holder)

    # The spec's spelling (0x01D2).
    acquire_active_generation = acquire

    def acquire_generation(self, generation: GenerationId, holder: str) -> Lease:
        """Pin ``generation`` for a new dispatch, only if it is the ACTIVE one.

        A DRAINING, PENDING, RETIRED or unknown generation raises ``StaleGenerationError`` carrying
        the active generation so the caller can replan.
        """
        with self._lock:
            entry = self._entries.get(generation)
            if entry is None:
                raise self._active_error(
                    f"acquire {placement_version(generation)} by holder={holder!r}: generation is unknown", generation
                )
            if entry.state is not GenerationState.ACTIVE:
                raise self._active_error(
                    f"acquire {placement_version(generation)} by holder={holder!r}: state={entry.state.value} is "
                    f"not eligible for new dispatch (active={self._active})",
                    generation,
                )
            return self._issue(entry, holder)

    def release(self, lease: Lease | str) -> int:
        """Drop one generation reference; return the generation's refcount after the release.

        Raises ``GenerationError`` naming the lease when it is unknown, released already, or does not
        match the lease the registry issued under that id.
        """
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        if not isinstance(lease_id, str):
            raise ValueError(f"lease={lease!r} is neither a Lease nor a lease id")
        with self._lock:
            g = self._lease_index.get(lease_id)
            if g is None:
                issued = lease_id.startswith("lease-") and lease_id[6:].isdigit() and int(lease_id[6:]) < self._next_lease
                why = "was already released" if issued else "is unknown to this registry"
                raise GenerationError(f"release: lease {lease_id!r} {why}")
            entry = self._entries[g]
            held = entry.leases[lease_id]
            if isinstance(lease, Lease) and lease != held:
                raise GenerationError(f"release: lease {lease!r} does not match the issued lease {held!r}")
            del entry.leases[lease_id]
            del self._lease_index[lease_id]
            if self._record_leases:
                self._log(RegistryEventKind.RELEASE, g, f"{lease_id} holder={held.holder} refcount={len(entry.leases)}")
            return len(entry.leases)

    # ------------------------------------------------------------------ reads
    def require_live(self, generation: GenerationId, lease: Lease | None = None) -> PlacementManifest:
        """Resolve a handle's generation for combine: the manifest view if ACTIVE or DRAINING.

        PENDING, RETIRED or unknown raise ``StaleGenerationError`` (a RETIRED generation serves
        nothing). With ``lease``, it must be a live lease of this very generation.
        """
        with self._lock:
            entry = self._entries.get(generation)
            if entry is None:
                raise self._active_error(f"require_live: {placement_version(generation)} is unknown", generation)
            if entry.state not in (GenerationState.ACTIVE, GenerationState.DRAINING):
                why = "a RETIRED generation serves nothing" if entry.state is GenerationState.RETIRED else "it never served"
                raise self._active_error(
                    f"require_live: {placement_version(generation)} is {entry.state.value}: {why}", generation
                )
            if lease is not None:
                if lease.generation != generation:
                    raise GenerationError(
                        f"require_live: lease {lease.lease_id!r} pins generation={lease.generation}, not {generation}"
                    )
                if entry.leases.get(lease.lease_id) != lease:
                    raise GenerationError(f"require_live: lease {lease.lease_id!r} is not live on {placement_version(generation)}")
            return entry.manifest.with_state(entry.state, len(entry.leases))

    def state(self, generation: GenerationId) -> GenerationState:
        with self._lock:
            return self._entry(generation).state

    def refcount(self, generation: GenerationId) -> int:
        with self._lock:
            return len(self._entry(generation).leases)

    def active(self) -> GenerationId | None:
        """The generation new dispatches pin, or ``None``. Never use this for combine."""
        with self._lock:
            return self._active

    def manifest(self, generation: GenerationId) -> PlacementManifest:
        """The stored content with the registry's current state and refcount filled in."""
        with self._lock:
            entry = self._entry(generation)
            return entry.manifest.with_state(entry.state, len(entry.leases))

    def generations(self) -> tuple[GenerationId, ...]:
        """Every registered generation id, ascending (RETIRED included)."""
        with self._lock:
            return tuple(sorted(self._entries))

    def leases(self, generation: GenerationId) -> tuple[Lease, ...]:
        """Live leases of ``generation`` in issue order."""
        with self._lock:
            return tuple(self._entry(generation).leases.values())

    def status(self) -> tuple[GenerationStatus, ...]:
        """One report row per registered generation, ascending."""
        with self._lock:
            return tuple(
                GenerationStatus(
                    generation=g,
                    placement_version=e.manifest.placement_version,
                    state=e.state,
                    refcount=len(e.leases),
                    checkpoint_version=e.manifest.checkpoint_version,
                    content_digest=e.digest,
                )
                for g, e in sorted(self._entries.items())
            )

    def timeline(self) -> tuple[RegistryEvent, ...]:
        """The most recent events (at most ``timeline_limit``), oldest first."""
        with self._lock:
            return tuple(self._timeline)
