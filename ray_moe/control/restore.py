"""Rebuilding a ControlPlane after a coordinator restart (the plan is ``recovery.plan_rebuild``; this
applies it to a fresh plane over the live shards). No Ray here: the fleet may be Ray actors or local cores.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ray_moe.control.fleet import Fleet
from ray_moe.control.plane import ControlPlane
from ray_moe.control.recovery import PlaneState, ShardRegistrySnapshot, next_generation_id, plan_rebuild
from ray_moe.model.config import RuntimeConfig
from ray_moe.placement.floors import ReplicaFloors
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.placement.topology import ProcessGroupSpec, Topology


def restore_plane(cfg: RuntimeConfig, fleet: Fleet, topology: Topology, group: ProcessGroupSpec,
                  state: PlaneState, *, load_rows: Sequence[Mapping[str, Any]] = (),
                  clock: Callable[[], float] = time.time, retire_timeout_s: float = 5.0) -> ControlPlane:
    """A control plane rebuilt after a coordinator restart (see recovery.py): generations, states and
    manifests from the live shards' registry mirrors, digests from the manifests, the rest from
    ``state``. Interrupted work is finished or undone on the shards before it returns."""
    t0 = time.perf_counter()
    plane = ControlPlane(cfg, fleet, topology, group, clock=clock)
    plane.expert_bytes = int(state.expert_bytes)
    plane.dead_ranks = set(state.dead_ranks)
    plane.floors = ReplicaFloors(cfg.num_layers, cfg.num_experts, state.floors)
    plane.retired_before = list(state.retired)
    for row in load_rows:
        try:
            plane.load.record(np.asarray(row["counts"], dtype=np.int64), phase=row["phase"],
                              generation=int(row["generation"]), checkpoint=row["checkpoint"], step=int(row["step"]))
        except (KeyError, ValueError, TypeError):  # a malformed row loses load history, not the restart
            continue
    with plane.lock:
        raw = plane.call_live("registry_snapshot", lambda r: ())
        snaps = {r: ShardRegistrySnapshot.model_validate(v) for r, v in raw.items()}
        plan = plan_rebuild(plane.live_ranks(), snaps, state.op, state.retire_pending)
        # 1. undo: never-published generations and the weights staged for them
        for g, ranks in sorted(plan.abandon.items()):
            done = plane.fleet.call("retire", {r: (g,) for r in ranks if r in plan.live})
            if not all(done.values()):
                plan.notes.append(f"generation {g}: abandon refused on ranks {[r for r, ok in done.items() if not ok]}")
        dropped = plane.call_live("drop_unreferenced", lambda r: ())
        # 2. the registry: manifests from one holder each, states as planned
        by_holder: dict[int, list[int]] = defaultdict(list)
        for g, r in plan.holder.items():
            by_holder[r].append(g)
        got = plane.fleet.call("generation_manifests", {r: (sorted(gs),) for r, gs in by_holder.items()})
        manifests = {int(g): (m if isinstance(m, PlacementManifest) else PlacementManifest.model_validate_json(m))
                     for per in got.values() for g, m in per.items()}
        for g in sorted(plan.states):
            plane.registry.register(manifests[g])
        for g in sorted(plan.states):
            if plan.states[g] == "DRAINING":
                plane.registry.publish(g)
                plane.registry.mark_draining(g)
        if plan.active is not None:
            plane.registry.publish(plan.active)
        for man in manifests.values():
            for sl in man.slots:
                plane.digests.setdefault((sl.layer, sl.logical_expert_id), sl.parameter_digest)
        if state.op is not None and state.op.kind == "retire" and state.op.generation not in plan.states:
            plane.retired_before.append(int(state.op.generation))  # its retire had reached every live shard
        plane.retired_before = sorted(set(plane.retired_before) | set(plan.abandon))
        plane.next_generation = next_generation_id(state.next_generation, plan, plane.retired_before)
        # 3. finish interrupted work so that every live shard agrees with the registry
        if plan.publish_on:
            plane.fleet.call("publish", {r: (plan.active,) for r in plan.publish_on})
        for g, ranks in plan.stop.items():
            plane.fleet.call("stop_dispatch", {r: (g,) for r in ranks})
        for g, ranks in plan.candidates_on.items():
            plane.fleet.call("allow_candidate", {r: (g,) for r in ranks})
        plane.retire_pending = set(plan.finish_retire)  # a drain that times out here is retried by later changes
        retired_now = [g for g in plan.finish_retire if plane.drain_and_retire(g, timeout_s=retire_timeout_s)]
        plane.op = None
        plane.rebuild_report = {
            "active": plan.active, "generations": dict(plan.states), "abandoned": sorted(plan.abandon),
            "published_on": plan.publish_on, "retired": retired_now, "dropped_weights": int(sum(dropped.values())),
            "interrupted_op": None if state.op is None else state.op.model_dump(), "notes": list(plan.notes),
            "next_generation": plane.next_generation, "live_ranks": plan.live,
            "dead_ranks": sorted(plane.dead_ranks), "rebuild_s": time.perf_counter() - t0,
        }
        plane.log("rebuild", plan.active, f"coordinator restarted: {len(plan.states)} generations from "
                  f"{len(plan.live)} shards, active {plan.active}, abandoned {sorted(plan.abandon)}; "
                  + "; ".join(plan.notes))
    return plane


__all__ = ["restore_plane"]
