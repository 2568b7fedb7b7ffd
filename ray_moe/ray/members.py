"""The Ray side of a deployment's members, for the coordinator's loop (``ray/reconciler.py``): shard actors started
in a placement-group bundle, bundles and the nodes they sit on, liveness, the exchange of a process group, and
``MembershipView``: the record drivers follow (shard handles, the process group, the topology, the ACTIVE
generation)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_moe.control.target import BundleRef
from ray_moe.core.types import ExchangeKind
from ray_moe.model.config import RuntimeConfig
from ray_moe.placement.topology import NodeInfo, ProcessGroupSpec, RankInfo, Topology
from ray_moe.ray.remote import call
from ray_moe.ray.shard_actor import shard_actor_class


@dataclass(frozen=True)
class MembershipView:
    """What a driver steps with: the live shards' handles, the process group (its epoch is the view's), the
    topology, the ACTIVE generation, and the ranks lost so far (dead and regrouped away)."""

    epoch: int
    handles: dict[int, Any]
    group_json: str
    topology_json: str
    generation: int | None
    lost: tuple[int, ...] = ()
    fence: int | None = None  # set when a membership change is under way (the driver must quiesce first)

    @property
    def group(self) -> ProcessGroupSpec:
        return ProcessGroupSpec.model_validate_json(self.group_json)

    @property
    def topology(self) -> Topology:
        return Topology.model_validate_json(self.topology_json)


PG_PREFIX = "ray-moe-pg-"


def pg_name(deployment: str) -> str:
    """The start's placement group of ``deployment``; the loop's one-bundle groups add ``-rank<r>``."""
    return f"{PG_PREFIX}{deployment}"


def shard_bundle(cfg: RuntimeConfig) -> dict[str, float]:
    return {"CPU": cfg.actor_cpus, **({"GPU": 1} if cfg.device == "cuda" else {})}


@dataclass
class Bundles:
    """The placement groups a deployment holds: the start's (one bundle per initial rank) and the one-bundle groups
    the loop created since, by id (hex)."""

    groups: dict[str, Any] = field(default_factory=dict)
    extra: set[str] = field(default_factory=set)  # ids of one-bundle groups created after the start

    def add(self, pg: Any, *, extra: bool) -> str:
        key = pg.id.hex()
        self.groups[key] = pg
        if extra:
            self.extra.add(key)
        return key

    def node_of(self, ref: BundleRef) -> str | None:
        """The Ray node the bundle is reserved on now (None: not placed, e.g. its node died and Ray has not placed
        it again)."""
        pg = self.groups.get(ref.group)
        if pg is None:
            return None
        try:
            table = placement_group_table(pg)
        except Exception:  # noqa: BLE001 - the GCS did not answer: unknown
            return None
        node = (table.get("bundles_to_node_id") or {}).get(ref.index)
        return node if node and node_alive(node) else None

    def fresh(self, cfg: RuntimeConfig, name: str, *, detached: bool, timeout_s: float) -> BundleRef:
        """A new one-bundle placement group (waited for ``timeout_s``; ``TimeoutError`` naming what it needs)."""
        pg = placement_group([shard_bundle(cfg)], name=name, **({"lifetime": "detached"} if detached else {}))
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)
            raise TimeoutError(f"a fresh bundle {shard_bundle(cfg)} was not placed within {timeout_s:g}s "
                               f"(available: {ray.available_resources()})") from None
        return BundleRef(self.add(pg, extra=True), 0)

    def release(self, ref: BundleRef | None) -> None:
        """A one-bundle group created after the start is removed with its rank (the start's stay reserved)."""
        if ref is None or ref.group not in self.extra:
            return
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.groups.pop(ref.group))
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.extra.discard(ref.group)


def node_alive(node_id: str) -> bool:
    for n in ray.nodes():
        if n.get("NodeID") == node_id:
            return bool(n.get("Alive"))
    return False


def start_shard(cfg: RuntimeConfig, rank: int, pg: Any, index: int, *, detached: bool, timeout_s: float,
                source: Any = None) -> tuple[Any, dict[str, Any]]:
    """One shard actor in bundle ``index`` of ``pg`` (it waits there until the bundle's resources are free: a dead
    actor's device is released when its process is gone); (its handle, its ``node_info``)."""
    from ray_moe.model.source import weight_source

    gpus = 1 if cfg.device == "cuda" else 0
    actor = shard_actor_class(cfg).options(
        num_cpus=cfg.actor_cpus, num_gpus=gpus, **({"lifetime": "detached"} if detached else {}),
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
    ).remote(rank, cfg.model_dump_json(), source if source is not None else weight_source(cfg))
    try:
        return actor, call(actor.node_info.remote(), timeout=timeout_s)
    except BaseException:
        kill(actor)
        raise


def kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead
        pass


def dead_among(handles: Mapping[int, Any], timeout_s: float = 5.0) -> list[int]:
    """Ranks whose actor is dead (an actor error on a ping; one that only does not answer in time is not)."""
    refs = {r: h.ping.remote() for r, h in handles.items()}
    if not refs:
        return []
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    dead = []
    for r, ref in refs.items():
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead.append(r)
        except Exception:  # noqa: BLE001 - slow or busy, not dead
            pass
    return dead


def connect_exchange(cfg: RuntimeConfig, handles: Mapping[int, Any], group: ProcessGroupSpec,
                     put_nccl_id: Callable[[int, bytes], None]) -> None:
    """Build every member's exchange endpoint for ``group`` (NCCL: the unique id of its epoch via ``put_nccl_id``)."""
    members = {r: handles[r] for r in group.peer_order}
    if cfg.exchange_kind is ExchangeKind.NCCL:
        first = members[group.peer_order[0]]
        uid, mid = call([first.nccl_unique_id.remote(), first.nccl_unique_id.remote()])
        put_nccl_id(group.epoch, uid)
        call([h.init_nccl.remote(uid, group.model_dump_json(), mid) for h in members.values()])
    elif cfg.exchange_kind is ExchangeKind.GLOO:
        endpoint = call(members[group.peer_order[0]].gloo_endpoint.remote())
        call([h.init_gloo.remote(endpoint, group.model_dump_json()) for h in members.values()])
    else:
        call([h.set_peers.remote(members, group.model_dump_json()) for h in members.values()])


def set_topology(handles: Mapping[int, Any], topology: Topology) -> None:
    call([h.set_topology.remote(topology.model_dump_json()) for h in handles.values()])


def topology_from_nodes(infos: Sequence[Mapping[str, Any]], version: str = "topology-v0") -> Topology:
    """Ranks grouped by the Ray node their actor runs (or last ran) on; local rank in rank order; the first rank of
    a node relays. Every rank the deployment ever had is there (global ranks are never reused)."""
    order: list[str] = []
    for info in sorted(infos, key=lambda i: i["rank"]):
        if info["node_id"] not in order:
            order.append(info["node_id"])
    names = {nid: f"node-{i}" for i, nid in enumerate(order)}
    members: dict[str, list[int]] = {names[n]: [] for n in order}
    ranks = []
    for info in sorted(infos, key=lambda i: i["rank"]):
        name = names[info["node_id"]]
        local = len(members[name])
        members[name].append(info["rank"])
        ranks.append(RankInfo(rank=info["rank"], node_id=name, local_rank=local, intra_domain=f"{name}-fabric",
                              nic=f"{name}-nic", nic_via_rank=None if local == 0 else members[name][0],
                              ray_node_id=info["node_id"]))
    nodes = tuple(NodeInfo(node_id=n, ranks=tuple(rs), relay_rank=rs[0]) for n, rs in members.items())
    return Topology(version=version, ranks=tuple(ranks), nodes=nodes)


def infos_of(topology: Topology) -> dict[int, dict[str, Any]]:
    """The node infos a topology was built from (a restarted coordinator rebuilds its own from the record)."""
    return {ri.rank: {"rank": ri.rank, "node_id": ri.ray_node_id or ri.node_id} for ri in topology.ranks}


def wait_for(pred: Callable[[], bool], timeout_s: float, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


__all__ = ["PG_PREFIX", "pg_name", "Bundles", "MembershipView", "connect_exchange", "dead_among", "infos_of", "kill", "node_alive",
           "set_topology", "shard_bundle", "start_shard", "topology_from_nodes"]
