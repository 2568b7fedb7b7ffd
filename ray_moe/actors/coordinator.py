"""CoordinatorActor: named, one per deployment (``get_if_exists``). A thin shell over ``ControlPlane``.

It owns placement generations, refcount fences, digests, the load window, NCCL unique ids and the
control timeline. It is never on the per-token path: drivers ask it for the active generation only
when a shard tells them theirs went stale.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import ray
from pydantic import BaseModel

from ray_moe.actors.control import ControlPlane, Fleet
from ray_moe.config import RuntimeConfig
from ray_moe.errors import RankDeadError
from ray_moe.types import ExchangeKind
from ray_moe.placement.topology import ProcessGroupSpec, Topology


def coordinator_name(deployment: str) -> str:
    return f"ray-moe-coordinator-{deployment}"


class RayFleet(Fleet):
    """Shard actors behind Ray handles; pydantic arguments travel as JSON. With ``nccl`` set, expert copies
    go GPU to GPU over the shards' migration communicator; otherwise through the object store."""

    def __init__(self, handles: Mapping[int, Any], *, nccl: bool = False) -> None:
        self.handles = dict(handles)
        self.nccl = nccl
        self.bytes_copied = 0  # measured bytes that crossed between shards for expert copies

    def ranks(self) -> list[int]:
        return sorted(self.handles)

    def call(self, method: str, args: Mapping[int, tuple]) -> dict[int, Any]:
        refs = {r: getattr(self.handles[r], method).remote(*[_wire(a) for a in a_]) for r, a_ in args.items()}
        out: dict[int, Any] = {}
        dead: list[int] = []
        first: BaseException | None = None
        for r, ref in refs.items():
            try:
                out[r] = ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(r)
            except BaseException as exc:  # noqa: BLE001 - re-raised after every rank answered
                first = first or exc
        if dead:
            raise RankDeadError(f"{method}: shard actor(s) of rank(s) {dead} are dead", ranks=tuple(dead))
        if first is not None:
            raise first
        return out

    def copy_experts(self, dst: int, src: int, keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], str]:
        try:
            if self.nccl:
                send = self.handles[src].send_experts.remote(list(keys), dst)
                recv = self.handles[dst].recv_experts.remote(list(keys), src)
                self.bytes_copied += int(ray.get(send))
                return ray.get(recv)
            digests, nbytes = ray.get(self.handles[dst].fetch_experts.remote(self.handles[src], list(keys)))
            self.bytes_copied += int(nbytes)
            return digests
        except ray.exceptions.RayActorError as exc:
            raise RankDeadError(f"copy rank {src} -> rank {dst}: {exc}", ranks=(src, dst)) from None


def _wire(x: Any) -> Any:
    return x.model_dump_json() if isinstance(x, BaseModel) else x


class CoordinatorActor:
    def __init__(self, cfg_json: str) -> None:
        self.cfg = RuntimeConfig.model_validate_json(cfg_json)
        self.plane: ControlPlane | None = None
        self.handles: dict[int, Any] = {}
        self.nccl_ids: dict[int, bytes] = {}
        self.topology_json: str | None = None
        self.extra: dict[str, Any] = {}

    # ---------------------------------------------------------------- setup
    def attach(self, handles: Mapping[int, Any], topology_json: str, group_json: str, expert_bytes: int) -> None:
        if self.plane is not None:
            raise RuntimeError(f"deployment {self.cfg.name!r} already has shards attached")
        self.handles = dict(handles)
        self.topology_json = topology_json
        self.plane = ControlPlane(self.cfg, RayFleet(self.handles, nccl=self.cfg.exchange_kind is ExchangeKind.NCCL), Topology.model_validate_json(topology_json),
                                  ProcessGroupSpec.model_validate_json(group_json))
        self.plane.set_expert_bytes(expert_bytes)

    def deploy(self) -> int:
        return self._plane().deploy_initial()

    def _plane(self) -> ControlPlane:
        if self.plane is None:
            raise RuntimeError(f"deployment {self.cfg.name!r} has no shards attached")
        return self.plane

    def config_json(self) -> str:
        return self.cfg.model_dump_json()

    def shard_handles(self) -> dict[int, Any]:
        return dict(self.handles)

    def group_json(self) -> str:
        return self._plane().group.model_dump_json()

    def topology(self) -> str | None:
        return self.topology_json

    def put_nccl_id(self, epoch: int, uid: bytes) -> None:
        self.nccl_ids[epoch] = uid

    def nccl_id(self, epoch: int) -> bytes | None:
        return self.nccl_ids.get(epoch)

    def is_deployed(self) -> bool:
        return self.plane is not None and self.plane.active_generation() is not None

    # ---------------------------------------------------------------- queries
    def active_generation(self) -> int | None:
        return self._plane().active_generation()

    def manifest_json(self, generation: int | None = None) -> str:
        return self._plane().manifest(generation).model_dump_json()

    def refcounts(self) -> dict[int, int]:
        return self._plane().refcounts()

    def generations(self) -> dict[int, str]:
        reg = self._plane().registry
        return {g: reg.state(g).value for g in reg.generations()}

    def timeline(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(e) for e in self._plane().timeline()]

    def retired_with_refcount(self) -> list[tuple[int, int]]:
        return list(self._plane().retired_with_refcount)

    def record_load(self, counts: Any, phase: str, generation: int) -> None:
        self._plane().record_load(counts, phase=phase, generation=generation)

    def load_matrix(self) -> Any:
        lm = self._plane().load.snapshot()
        return {"weight": lm.weight, "provenance": lm.provenance.model_dump(mode="json")}

    def put(self, key: str, value: Any) -> None:
        """Small shared records (telemetry snapshots from drivers, release records)."""
        self.extra[key] = value

    def get(self, key: str) -> Any:
        return self.extra.get(key)

    def telemetry_snapshots(self) -> list[str]:
        return [v for k, v in sorted(self.extra.items()) if k.startswith("telemetry/")]

    # ---------------------------------------------------------------- elastic operations
    def scale(self, expert: int, replicas: int, layer: int | None = None) -> dict[str, Any]:
        plane = self._plane()
        new = plane.propose_scale(expert, replicas, layer)
        b0 = plane.fleet.bytes_copied
        out = _report(plane.apply(new, reason=f"scale expert {expert} to {replicas} replicas"))
        out["copied_bytes"] = plane.fleet.bytes_copied - b0
        return out

    def rebalance(self, migration_aware: bool = True) -> dict[str, Any]:
        plane = self._plane()
        new = plane.propose_rebalance(migration_aware=migration_aware)
        b0 = plane.fleet.bytes_copied
        out = _report(plane.apply(new, reason="EPLB rebalance"))
        out["copied_bytes"] = plane.fleet.bytes_copied - b0
        return out

    def apply_manifest(self, manifest_json: str, reason: str) -> dict[str, Any]:
        from ray_moe.placement.manifest import PlacementManifest

        return _report(self._plane().apply(PlacementManifest.model_validate_json(manifest_json), reason=reason))

    def remove_ranks(self, dead: Sequence[int], group_json: str) -> dict[str, Any]:
        """A rank died: publish a generation on the rebuilt group without it (survivors already regrouped)."""
        plane = self._plane()
        for r in dead:
            self.handles.pop(int(r), None)
        plane.fleet = RayFleet(self.handles, nccl=self.cfg.exchange_kind is ExchangeKind.NCCL)
        return _report(plane.remove_ranks(dead, ProcessGroupSpec.model_validate_json(group_json)))

    def evacuate_rank(self, rank: int) -> dict[str, Any]:
        """Scale in, step 1: publish a generation with no slot on ``rank`` (it still takes part, with zero rows)."""
        plane = self._plane()
        return _report(plane.apply(plane.propose_without([rank]), reason=f"evacuate rank {rank}"))

    def regroup(self, handles: Mapping[int, Any], topology_json: str, group_json: str, rebalance: bool) -> dict[str, Any]:
        """Switch to a new process group (scale in or out) at a quiescent point: publish the active slots (or an
        EPLB placement over the new members when ``rebalance``) as a new generation under the new group."""
        plane = self._plane()
        self.handles = dict(handles)
        self.topology_json = topology_json
        plane.fleet = RayFleet(self.handles, nccl=self.cfg.exchange_kind is ExchangeKind.NCCL)
        plane.topology = Topology.model_validate_json(topology_json)
        plane.group = ProcessGroupSpec.model_validate_json(group_json)
        if rebalance and len(plane.load):
            new = plane.propose_rebalance(migration_aware=True)
            reason = f"regroup to ranks {list(plane.group.peer_order)} + EPLB"
        else:
            new = plane.propose_without([r for r in plane.manifest().slots_ranks() if r not in plane.group.members])
            reason = f"regroup to ranks {list(plane.group.peer_order)}"
        return _report(plane.apply(new, reason=reason))

    def drain_and_retire(self, generation: int, timeout_s: float = 60.0) -> bool:
        return self._plane().drain_and_retire(generation, timeout_s=timeout_s)

    # ---------------------------------------------------------------- candidates (releases in flight)
    def stage(self, kind: str, expert: int | None = None, replicas: int | None = None,
              manifest_json: str | None = None) -> dict[str, Any]:
        """Plan, materialise and verify a candidate generation without publishing it; it may then serve
        steps that name it (shadow / canary). ``kind``: scale | rebalance | manifest."""
        plane = self._plane()
        if kind == "scale":
            new = plane.propose_scale(int(expert), int(replicas))
        elif kind == "rebalance":
            new = plane.propose_rebalance(migration_aware=True)
        elif kind == "manifest":
            from ray_moe.placement.manifest import PlacementManifest

            new = PlacementManifest.model_validate_json(manifest_json)
        else:
            raise ValueError(f"kind={kind!r} is not one of scale, rebalance, manifest")
        rep = plane.stage(new, reason=f"candidate ({kind})", serve_candidate=True)
        out = _report(rep)
        out["manifest_json"] = new.model_dump_json()
        return out

    def promote(self, generation: int, retire_prior: bool = False) -> int | None:
        return self._plane().promote(generation, retire_prior=retire_prior)

    def stop_dispatch(self, generation: int) -> None:
        self._plane().stop_dispatch(generation)

    def activate(self, generation: int) -> None:
        self._plane().activate(generation)

    def release_graphs(self, generation: int) -> int:
        return self._plane().release_graphs(generation)

    def shard_refcount(self, generation: int) -> int:
        return self._plane().shard_refcount(generation)

    def inject_fault(self, rank: int, kind: str, count: int = 1, generation: int | None = None) -> None:
        ray.get(self.handles[rank].inject_fault.remote(kind, count, generation))
        self._plane().log("fault-armed", generation, f"{kind} x{count} on rank {rank}")

    def log(self, event: str, generation: int | None, detail: str) -> None:
        self._plane().log(event, generation, detail)

    # ---------------------------------------------------------------- release lifecycle (owned here)
    def release(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call one ``ReleaseRegistry`` method (register, transition, begin_canary, promote, stop_new_dispatch,
        activate, retire, get, records, timeline, active, candidate); pydantic results travel as JSON."""
        if method not in _RELEASE_METHODS:
            raise ValueError(f"method={method!r} is not one of {sorted(_RELEASE_METHODS)}")
        from ray_moe.release.lifecycle import ReleaseRegistry

        if "releases" not in self.extra:
            self.extra["releases"] = ReleaseRegistry()
        out = getattr(self.extra["releases"], method)(*args, **kwargs)
        return out


_RELEASE_METHODS = frozenset({"register", "transition", "begin_canary", "set_canary_fraction", "promote",
                              "stop_new_dispatch", "activate", "retire", "get", "records", "timeline", "active",
                              "candidate", "canary_fraction"})


def _report(rep) -> dict[str, Any]:
    out = {
        "old_generation": rep.old_generation,
        "new_generation": rep.new_generation,
        "reason": rep.reason,
        "copies": rep.copies,
        "loads": rep.loads,
        "drained_s": rep.drained_s,
        "retired": rep.retired,
        "timings_s": rep.timings_s,
    }
    if rep.plan is not None:
        out["ledger"] = rep.plan.ledger.model_dump(mode="json")
    return out


def coordinator_class():
    return ray.remote(max_concurrency=32)(CoordinatorActor)
