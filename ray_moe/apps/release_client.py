"""Typed calls to a deployment's coordinator for releases in flight (spec 0x0C-0x0EA).

    client = ReleaseClient.for_runtime(rt)                 # or ReleaseClient(ray.get_actor(coordinator_name(n)))
    rep = client.stage(StageKind.SCALE, expert=3, replicas=2)    # a candidate generation, loaded, not published
    client.inject_fault(ShardFault.CRASH, rank=1, generation=rep.new_generation)
    rec = client.register(bundle)                                 # the release registry: ReleaseRecord back

Each method is one ``call`` (``ray.get`` raising ray-moe's own errors, ``ray/remote.py``) on one remote method of
``CoordinatorActor``: the placement side (``stage``, ``promote``, ``stop_dispatch``, ``activate``,
``release_graphs``, ``shard_refcount``, ``drain_and_retire``, ``inject_fault``) and the release registry, whose
coordinator methods carry the word "release" (``register_release``, ``transition_release``,
``stop_release_dispatch``, ``release_record``, ...; ``begin_canary`` and ``set_canary_fraction`` need none) so
that they stay apart from the placement ones. Arguments are checked here, before anything reaches the actor.

The driver's cached active generation is not touched: after ``promote`` or ``activate`` a ``Runtime`` learns
the new active generation the way every driver does, when a shard refuses its next step as stale.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ray_moe.ray.remote import call
from ray_moe.shard.fault_wrappers import ShardFault  # the one definition (re-exported: the drill names it here)
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.release.bundle import ReleaseBundle
from ray_moe.release.gate import GateVerdict
from ray_moe.release.lifecycle import ReleaseRecord, TransitionEvent
from ray_moe.core.types import ReleaseState


class StageKind(str, Enum):
    """How ``stage`` plans a candidate generation."""

    SCALE = "scale"  # one logical expert to ``replicas`` copies
    REBALANCE = "rebalance"  # EPLB over the coordinator's load window
    MANIFEST = "manifest"  # a given placement manifest


class StageReport(BaseModel):
    """A staged candidate: planned, materialised and verified on every shard, not published."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    old_generation: int | None
    new_generation: int
    reason: str
    copies: int = Field(ge=0)
    loads: int = Field(ge=0)
    drained_s: float
    retired: bool
    timings_s: dict[str, float]
    ledger: dict[str, Any] | None = None
    manifest: PlacementManifest


def _int(name: str, value: Any, lo: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
        raise ValueError(f"{name}={value!r} must be an int" + ("" if lo is None else f" >= {lo}"))
    return value


def _generation(value: Any) -> int:
    return _int("generation", value)


class ReleaseClient:
    """The coordinator's candidate, fault and release-registry calls, typed."""

    def __init__(self, coordinator: Any) -> None:
        if coordinator is None:
            raise ValueError("coordinator=None: pass the deployment's CoordinatorActor handle")
        self._coord = coordinator

    @classmethod
    def for_runtime(cls, rt: Any) -> "ReleaseClient":
        """The client of ``rt``'s deployment (``rt.coordinator``)."""
        return cls(rt.coordinator)

    @property
    def coordinator(self) -> Any:
        return self._coord

    # ================================================================ candidates (placement generations)
    def stage(self, kind: StageKind | str, expert: int | None = None, replicas: int | None = None,
              manifest: PlacementManifest | None = None) -> StageReport:
        """Plan, materialise and verify a candidate generation without publishing it; steps may then pin it
        (``Runtime.forward(..., generation=g)``). Flush the driver's load counts first (``rt.flush_load()``)
        when the plan should see them (``rebalance``)."""
        kind = _enum(StageKind, kind, "kind")
        if kind is StageKind.SCALE:
            _int("expert", expert)
            _int("replicas", replicas, 1)
        if kind is StageKind.MANIFEST and not isinstance(manifest, PlacementManifest):
            raise ValueError(f"manifest={type(manifest).__name__}: kind='manifest' needs a PlacementManifest")
        rep = dict(call(self._coord.stage.remote(kind.value, expert, replicas,
                                                    None if manifest is None else manifest.model_dump_json())))
        rep["manifest"] = PlacementManifest.model_validate_json(rep.pop("manifest_json"))
        return StageReport.model_validate(rep)

    def promote(self, generation: int, *, retire_prior: bool = False) -> int | None:
        """Publish a staged candidate; the prior goes DRAINING (kept loaded unless ``retire_prior``).
        Returns the prior generation."""
        g = _generation(generation)
        prior = call(self._coord.promote.remote(g, bool(retire_prior)))
        return None if prior is None else int(prior)

    def stop_dispatch(self, generation: int) -> None:
        """The stop fence on every shard: no new step may pin ``generation`` (an ACTIVE one goes DRAINING)."""
        g = _generation(generation)
        call(self._coord.stop_dispatch.remote(g))

    def activate(self, generation: int) -> None:
        """A loaded generation (ACTIVE or DRAINING) takes new dispatch again (rollback's second step)."""
        g = _generation(generation)
        call(self._coord.activate.remote(g))

    def release_graphs(self, generation: int) -> int:
        """Free the captured decode graphs keyed to ``generation`` on every shard; returns how many."""
        g = _generation(generation)
        return int(call(self._coord.release_graphs.remote(g)))

    def shard_refcount(self, generation: int) -> int:
        """In-flight pins of ``generation``: the coordinator's leases plus every shard's."""
        g = _generation(generation)
        return int(call(self._coord.shard_refcount.remote(g)))

    def drain_and_retire(self, generation: int, timeout_s: float = 60.0) -> bool:
        """Wait (at most ``timeout_s``) for refcount 0, then retire ``generation``; False if still pinned."""
        g = _generation(generation)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a number > 0")
        return bool(call(self._coord.drain_and_retire.remote(g, float(timeout_s))))

    def inject_fault(self, kind: ShardFault | str, *, rank: int, count: int = 1,
                     generation: int | None = None) -> None:
        """Arm ``kind`` on shard ``rank`` for its next ``count`` steps (of ``generation`` only, if given);
        ``count=0`` disarms it. The coordinator logs it on the control timeline (``fault-armed``)."""
        kind = _enum(ShardFault, kind, "kind")
        rank, count = _int("rank", rank), _int("count", count)
        g = None if generation is None else _generation(generation)
        call(self._coord.inject_fault.remote(rank, kind.value, count, g))

    def load_provenance(self) -> dict[str, Any]:
        """Provenance of the coordinator's load window (what EPLB reads; a release binds it as a report)."""
        return dict(call(self._coord.load_matrix.remote())["provenance"])

    # ================================================================ the release registry (0x0EA)
    def _write(self, ref: Any) -> Any:
        """The result of one registry write; ``_written`` runs after it succeeded."""
        out = call(ref)
        self._written()
        return out

    def _written(self) -> None:
        """Hook after every successful registry write (a subclass may read the new events there)."""

    def register(self, bundle: ReleaseBundle, reason: str = "built") -> ReleaseRecord:
        """A new release in BUILT."""
        if not isinstance(bundle, ReleaseBundle):
            raise ValueError(f"bundle={type(bundle).__name__} is not a ReleaseBundle")
        return self._write(self._coord.register_release.remote(bundle, reason))

    def transition(self, release_id: str, to: ReleaseState | str, reason: str) -> ReleaseRecord:
        """One table-checked lifecycle step (CANARY -> ACTIVE needs ``promote_release``)."""
        to = _enum(ReleaseState, to, "to")
        return self._write(self._coord.transition_release.remote(release_id, to, reason))

    def begin_canary(self, release_id: str, fraction: float, reason: str = "shadow gate passed") -> ReleaseRecord:
        """SHADOW -> CANARY with ``0 < fraction <= 1`` of new dispatches."""
        return self._write(self._coord.begin_canary.remote(release_id, float(fraction), reason))

    def set_canary_fraction(self, release_id: str, fraction: float) -> None:
        self._write(self._coord.set_canary_fraction.remote(release_id, float(fraction)))

    def promote_release(self, release_id: str, verdict: GateVerdict) -> str | None:
        """CANARY -> ACTIVE under a passing gate verdict for this release; returns the superseded release."""
        if not isinstance(verdict, GateVerdict):
            raise ValueError(f"verdict={type(verdict).__name__} is not a GateVerdict")
        return self._write(self._coord.promote_release.remote(release_id, verdict))

    def stop_new_dispatch(self, release_id: str) -> None:
        """The release's stop fence in the registry: SHADOW / CANARY / ACTIVE -> DRAINING."""
        self._write(self._coord.stop_release_dispatch.remote(release_id))

    def activate_release(self, release_id: str) -> None:
        """A prior release takes new dispatch (LOADED / DRAINING -> ACTIVE; no-op when already ACTIVE)."""
        self._write(self._coord.activate_release.remote(release_id))

    def retire_release(self, release_id: str) -> None:
        """-> RETIRED (the caller guarantees refcount 0 for a DRAINING release)."""
        self._write(self._coord.retire_release.remote(release_id))

    def record(self, release_id: str) -> ReleaseRecord:
        """The release's bundle, state and ordered timeline."""
        return call(self._coord.release_record.remote(release_id))

    def state(self, release_id: str) -> ReleaseState:
        return self.record(release_id).state

    def records(self) -> tuple[ReleaseRecord, ...]:
        return tuple(call(self._coord.release_records.remote()))

    def release_timeline(self) -> tuple[TransitionEvent, ...]:
        """Every lifecycle event of every release, in registry order (``seq``)."""
        return tuple(call(self._coord.release_timeline.remote()))

    def active_release(self) -> str | None:
        return call(self._coord.active_release.remote())

    def candidate_release(self) -> str | None:
        """The release in SHADOW or CANARY, if any."""
        return call(self._coord.candidate_release.remote())


def _enum(cls: type[Enum], value: Any, name: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not one of {[m.value for m in cls]}") from None


__all__ = ["ReleaseClient", "ShardFault", "StageKind", "StageReport"]
