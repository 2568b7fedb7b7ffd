"""What a coordinator needs to survive a restart, and how it rebuilds itself. Pure: no Ray here.

The coordinator keeps two kinds of state:

* **derivable** state that the shards already hold, exactly: every prepared generation's manifest and
  state (PENDING / ACTIVE / DRAINING), candidate flags and per-step refcounts (each ShardCore mirrors
  the registry). The digests follow from the manifests. A rebuilt coordinator reads these back
  (``ShardCore.registry_snapshot``) instead of trusting any copy of its own.
* **own** state that nothing else holds: the shard handles and the members (each rank's state and
  placement-group bundle, the placement groups), the deployment's target, topology and process group, the expert
  size, the next generation id (ids are never reused, and the newest ids may have been retired or
  abandoned everywhere), replica floors set by ``scale`` (in set order), ranks known dead, NCCL unique
  ids, generations a change means to retire once drained, the release registry and the load window
  (summed, at most every few seconds). This is the :class:`DurableRecord`; the coordinator actor
  writes it (Ray's GCS KV) on every change, and the in-flight control operation (``PendingOp``: a
  publish, stop fence or retire that touches several shards) before the shards are touched.
  Timeline events, telemetry snapshots and ``retired_with_refcount`` are not kept (a restart starts
  them afresh with a ``rebuild`` event).

:func:`plan_rebuild` turns the shards' snapshots and the record into a :class:`RebuildPlan`; the
control plane applies it (``restore.restore_plane``):

* a generation PENDING on every shard that holds it and never made a candidate was being staged:
  it is abandoned on those shards and every staged weight no generation uses is dropped;
* an interrupted publish (or stop fence) is completed on the shards that missed it, so that every
  live shard agrees on the ACTIVE generation;
* a generation that served (ACTIVE / DRAINING somewhere) and is not the active one is DRAINING; one
  whose retire was in flight (some shards may have retired it already), or that an interrupted change
  was to retire once drained (``retire_pending``), is retired through the usual drain check, which
  re-reads every shard's refcount first (never retired at a non-zero refcount). A DRAINING generation
  kept on purpose (a rollback fallback) stays loaded.
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

RECORD_VERSION = 1
RETIRED_KEPT = 1024  # retired generation ids remembered across restarts (status only)


class PendingOp(BaseModel):
    """A control operation that changes several shards; written before the first shard is touched."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = Field(description="deploy | stage | publish | stop_dispatch | retire")
    generation: int | None = None
    detail: str = ""


class PlaneState(BaseModel):
    """The control plane's own durable fields."""

    model_config = ConfigDict(extra="forbid")

    next_generation: int = Field(default=0, ge=0)
    retired: list[int] = Field(default_factory=list, description="retired generation ids (newest last)")
    floors: list[tuple[int, int, int]] = Field(default_factory=list,
                                               description="(layer, expert, min replicas), in set order (newest last)")
    dead_ranks: list[int] = Field(default_factory=list)
    expert_bytes: int = 0
    op: PendingOp | None = None
    retire_pending: list[int] = Field(default_factory=list,
                                      description="superseded generations an operation was to retire once drained")


class DurableRecord(BaseModel):
    """One deployment's coordinator record (JSON). Shard handles, the release registry and the load
    window travel beside it under their own keys (they are Ray handles / pickles / larger arrays)."""

    model_config = ConfigDict(extra="forbid")

    version: int = RECORD_VERSION
    deployment: str
    actor_id: str = Field(description="the coordinator actor this record belongs to (kept across restarts)")
    restarts: int = 0
    topology_json: str | None = None
    group_json: str | None = None
    nccl_ids: dict[int, str] = Field(default_factory=dict, description="group epoch -> unique id (hex)")
    plane: PlaneState | None = None
    target_json: str | None = Field(default=None, description="the deployment's target (``control/target.py``)")
    updated_at: float = 0.0


class GenerationOnShard(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: str
    refcount: int = 0
    candidate: bool = False
    digest: str = ""


class ShardRegistrySnapshot(BaseModel):
    """What one shard reports about its registry mirror (``ShardCore.registry_snapshot``)."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    active: int | None = None
    generations: dict[int, GenerationOnShard] = Field(default_factory=dict)
    held: list[tuple[int, int]] = Field(default_factory=list)


@dataclass
class RebuildPlan:
    """What a rebuilt coordinator restores and which shard calls finish or undo interrupted work."""

    live: list[int]
    states: dict[int, str] = field(default_factory=dict)  # kept generation -> registry state
    active: int | None = None
    publish_on: list[int] = field(default_factory=list)  # ranks that missed the publish of ``active``
    stop: dict[int, list[int]] = field(default_factory=dict)  # generation -> ranks that missed its stop fence
    candidates_on: dict[int, list[int]] = field(default_factory=dict)  # candidate -> ranks to allow it on
    abandon: dict[int, list[int]] = field(default_factory=dict)  # never-published generation -> its holders
    finish_retire: list[int] = field(default_factory=list)
    holder: dict[int, int] = field(default_factory=dict)  # a rank to read each kept manifest from
    max_seen: int = -1
    notes: list[str] = field(default_factory=list)


_SERVED = ("ACTIVE", "DRAINING")


def plan_rebuild(live: Sequence[int], snapshots: Mapping[int, ShardRegistrySnapshot],
                 op: PendingOp | None, retire_pending: Sequence[int] = ()) -> RebuildPlan:
    """Decide the rebuilt registry from the live shards' snapshots, the interrupted operation and the
    generations an interrupted operation was to retire once drained."""
    live = [r for r in live if r in snapshots]
    plan = RebuildPlan(live=list(live))
    holders: dict[int, dict[int, GenerationOnShard]] = {}
    for r in live:
        for g, info in snapshots[r].generations.items():
            holders.setdefault(int(g), {})[r] = info
    if not holders:
        return plan
    plan.max_seen = max(holders)
    everywhere = {g: set(live) <= set(h) for g, h in holders.items()}
    for g, h in holders.items():
        digests = {i.digest for i in h.values() if i.digest}
        if len(digests) > 1:
            plan.notes.append(f"generation {g}: shards disagree on the manifest digest ({sorted(digests)}); "
                              f"read from rank {min(h)}")
    # 1. the ACTIVE generation: an interrupted publish rolls forward (the candidate was verified on every
    #    live shard before any publish); an interrupted stop fence completes; else the shards' agreement.
    stopped = op.generation if op is not None and op.kind == "stop_dispatch" else None
    if op is not None and op.kind == "publish" and op.generation in holders and everywhere[op.generation]:
        plan.active = op.generation
        plan.notes.append(f"publish of generation {op.generation} was in flight: completed")
    else:
        counts = {g: sum(i.state == "ACTIVE" for i in h.values()) for g, h in holders.items() if g != stopped}
        cands = [g for g, c in counts.items() if c and everywhere[g]]
        if cands:
            plan.active = max(cands, key=lambda g: (counts[g], g))
            if len([g for g, c in counts.items() if c]) > 1:
                plan.notes.append(f"shards disagreed on the ACTIVE generation {sorted(g for g, c in counts.items() if c)}; "
                                  f"generation {plan.active} kept")
        elif any(counts.values()):
            plan.notes.append("an ACTIVE generation is missing on some live shard; none is ACTIVE now")
    if plan.active is not None:
        plan.publish_on = [r for r in live if holders[plan.active][r].state != "ACTIVE"]
    if stopped is not None and stopped in holders:
        missed = [r for r, i in holders[stopped].items() if i.state == "ACTIVE" or i.candidate]
        if missed:
            plan.stop[stopped] = missed
        plan.notes.append(f"stop fence of generation {stopped} was in flight: completed")
    # 2. every other generation
    for g in sorted(holders):
        h = holders[g]
        plan.holder[g] = min(h)
        if g == plan.active:
            plan.states[g] = "ACTIVE"
            continue
        served = any(i.state in _SERVED for i in h.values())
        if served:
            plan.states[g] = "DRAINING"
            if op is not None and op.kind == "retire" and op.generation == g:
                plan.finish_retire.append(g)
                plan.notes.append(f"retire of generation {g} was in flight: retried after a refcount check")
            elif g in set(retire_pending):
                plan.finish_retire.append(g)
                plan.notes.append(f"generation {g} was superseded by an interrupted operation: retired once drained")
            continue
        candidate = any(i.candidate for i in h.values()) and g != stopped
        if candidate and everywhere[g]:
            plan.states[g] = "PENDING"
            missing = [r for r in live if not h[r].candidate]
            if missing:
                plan.candidates_on[g] = missing
            continue
        plan.abandon[g] = sorted(h)
        why = "staging was in flight" if op is not None and op.generation == g else "never published"
        plan.notes.append(f"generation {g} PENDING on ranks {sorted(h)} ({why}): abandoned")
    for g in plan.abandon:
        plan.holder.pop(g, None)
    return plan


def next_generation_id(record_next: int, plan: RebuildPlan, retired: Sequence[int]) -> int:
    """Never reuse an id: past every id the record allocated, any shard holds, or was retired."""
    return max(int(record_next), plan.max_seen + 1, max(retired, default=-1) + 1)


# ---------------------------------------------------------------- small pickled records
def registry_state_bytes(registry: Any) -> bytes:
    """A thread-safe registry object's fields (its locks left out), pickled."""
    lock_types = (type(threading.Lock()), type(threading.RLock()))
    return pickle.dumps({k: v for k, v in vars(registry).items() if not isinstance(v, lock_types)})


def registry_from_bytes(cls: type, data: bytes) -> Any:
    """Rebuild an object written by :func:`registry_state_bytes`: a fresh instance (with fresh locks)
    whose fields are replaced by the stored ones."""
    obj = cls()
    vars(obj).update(pickle.loads(data))
    return obj


def load_summary(observations: Sequence[Any]) -> list[dict[str, Any]]:
    """The load window as ONE JSON-able observation: the sum of the windowed counts ([L, E]; with the
    window's default ``sum`` aggregation the EPLB input is unchanged), labelled with the newest
    observation's step, phase, generation and checkpoint. L x E integers whatever the window length."""
    if not observations:
        return []
    last = observations[-1]
    total = sum(o.counts.astype("int64") for o in observations)
    return [{"step": int(last.step), "counts": total.tolist(), "phase": getattr(last.phase, "value", last.phase),
             "generation": int(last.generation), "checkpoint": last.checkpoint, "steps": len(observations)}]


__all__ = ["DurableRecord", "GenerationOnShard", "PendingOp", "PlaneState", "RebuildPlan", "ShardRegistrySnapshot",
           "load_summary", "next_generation_id", "plan_rebuild", "registry_from_bytes", "registry_state_bytes"]
