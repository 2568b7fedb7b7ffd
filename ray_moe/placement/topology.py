"""Topology and process-group records (spec 0x07A, 0x07B, 0x07G). Pure: no Ray.

A ``Topology`` names where each global rank physically lives (node, GPU-local rank, intra-node fabric
domain, NIC, relay). A ``ProcessGroupSpec`` names one communicator: its member ranks in *peer-slot
order* and its collective epoch. Global rank is not peer slot: split vectors are indexed by peer slot.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_moe.core.types import RouteClass


class RankInfo(BaseModel):
    """Where one global rank lives."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0, description="global rank")
    node_id: str = Field(min_length=1)
    local_rank: int = Field(ge=0, description="GPU-local rank inside its node")
    intra_domain: str = Field(default="", description="intra-node fabric domain (e.g. nvlink-domain-0)")
    nic: str = Field(default="", description="NIC identity")
    nic_via_rank: int | None = Field(default=None, description="rank that owns the NIC, None if direct")
    ray_node_id: str | None = Field(default=None, description="Ray node id where the rank's actor runs")


class NodeInfo(BaseModel):
    """One node: its member ranks and (optionally) its relay rank for hierarchical exchange."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node_id: str = Field(min_length=1)
    ranks: tuple[int, ...]
    relay_rank: int | None = None

    @model_validator(mode="after")
    def _relay_inside(self) -> "NodeInfo":
        if self.relay_rank is not None and self.relay_rank not in self.ranks:
            raise ValueError(
                f"relay_rank={self.relay_rank} of node {self.node_id!r} is outside its node ranks {list(self.ranks)}"
            )
        return self


class Topology(BaseModel):
    """Ranks and nodes of one topology version. Validation rejects a rank in two nodes, a relay outside
    its node, duplicate ranks, and a node membership that disagrees with ``RankInfo.node_id``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str = Field(default="topology-v0", min_length=1)
    ranks: tuple[RankInfo, ...]
    nodes: tuple[NodeInfo, ...]

    @model_validator(mode="after")
    def _check(self) -> "Topology":
        ids = [r.rank for r in self.ranks]
        dup = [r for r, c in Counter(ids).items() if c > 1]
        if dup:
            raise ValueError(f"ranks: duplicate rank {dup[0]}")
        if sorted(ids) != list(range(len(ids))):
            raise ValueError(f"ranks: global ranks must be 0..{len(ids) - 1}, got {sorted(ids)}")
        owner: dict[int, str] = {}
        for node in self.nodes:
            for r in node.ranks:
                if r in owner:
                    raise ValueError(f"nodes: rank {r} is in two nodes ({owner[r]!r} and {node.node_id!r})")
                owner[r] = node.node_id
        node_ids = [n.node_id for n in self.nodes]
        if len(set(node_ids)) != len(node_ids):
            raise ValueError(f"nodes: duplicate node_id in {node_ids}")
        for info in self.ranks:
            if info.rank not in owner:
                raise ValueError(f"nodes: rank {info.rank} belongs to no node")
            if owner[info.rank] != info.node_id:
                raise ValueError(
                    f"ranks[{info.rank}].node_id={info.node_id!r} but nodes list it under {owner[info.rank]!r}"
                )
        extra = set(owner) - set(ids)
        if extra:
            raise ValueError(f"nodes: rank {sorted(extra)[0]} is not a declared rank")
        seen: set[tuple[str, int]] = set()
        for info in self.ranks:
            key = (info.node_id, info.local_rank)
            if key in seen:
                raise ValueError(f"ranks[{info.rank}].local_rank={info.local_rank} repeats inside node {info.node_id!r}")
            seen.add(key)
        return self

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def rank_info(self, rank: int) -> RankInfo:
        for info in self.ranks:
            if info.rank == rank:
                return info
        raise ValueError(f"rank={rank} is not in topology {self.version!r}")

    def node_of(self, rank: int) -> str:
        return self.rank_info(rank).node_id

    def node_index(self) -> list[int]:
        """Node index per global rank (index into ``nodes``)."""
        idx = {n.node_id: i for i, n in enumerate(self.nodes)}
        return [idx[self.rank_info(r).node_id] for r in range(self.num_ranks)]

    def route_class(self, source: int, destination: int) -> RouteClass:
        """Physical class of a route from ``source`` to ``destination`` rank (spec 0x07C)."""
        if source == destination:
            return RouteClass.SAME_GPU
        if self.node_of(source) == self.node_of(destination):
            return RouteClass.SAME_NODE
        return RouteClass.CROSS_NODE

    @staticmethod
    def single_node(num_ranks: int, version: str = "topology-v0") -> "Topology":
        """All ranks on one node (a laptop, or one GPU host); rank 0 is the relay."""
        return Topology.uniform(num_ranks, 1, version=version)

    @staticmethod
    def uniform(num_ranks: int, num_nodes: int, version: str = "topology-v0") -> "Topology":
        """``num_ranks`` split over ``num_nodes`` equal nodes in rank order; the first rank of each node
        is its relay and owns the node NIC."""
        if num_nodes < 1 or num_ranks % num_nodes != 0:
            raise ValueError(f"num_ranks={num_ranks} is not divisible by num_nodes={num_nodes}")
        per = num_ranks // num_nodes
        ranks = []
        nodes = []
        for n in range(num_nodes):
            members = tuple(range(n * per, (n + 1) * per))
            nodes.append(NodeInfo(node_id=f"node-{n}", ranks=members, relay_rank=members[0]))
            for lr, r in enumerate(members):
                ranks.append(
                    RankInfo(
                        rank=r,
                        node_id=f"node-{n}",
                        local_rank=lr,
                        intra_domain=f"nvlink-domain-{n}",
                        nic=f"nic-{n}",
                        nic_via_rank=None if lr == 0 else members[0],
                    )
                )
        return Topology(version=version, ranks=tuple(ranks), nodes=tuple(nodes))


class ProcessGroupSpec(BaseModel):
    """One communicator: members in peer-slot order and its collective epoch (spec 0x07B, 0x07G)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_id: str = Field(min_length=1)
    peer_order: tuple[int, ...] = Field(min_length=1, description="global rank stored at each peer slot")
    epoch: int = Field(default=0, ge=0)
    kind: str = Field(default="ep", description="ep | node-local | relays")

    @model_validator(mode="after")
    def _unique(self) -> "ProcessGroupSpec":
        dup = [r for r, c in Counter(self.peer_order).items() if c > 1]
        if dup:
            raise ValueError(f"peer_order: rank {dup[0]} appears twice in group {self.group_id!r}")
        if any(r < 0 for r in self.peer_order):
            raise ValueError(f"peer_order: negative rank in {list(self.peer_order)}")
        return self

    @property
    def size(self) -> int:
        return len(self.peer_order)

    @property
    def members(self) -> frozenset[int]:
        return frozenset(self.peer_order)

    def peer_of(self, rank: int) -> int:
        """Peer slot of a global rank."""
        try:
            return self.peer_order.index(rank)
        except ValueError:
            raise ValueError(f"rank={rank} is not a member of process group {self.group_id!r}") from None

    def rank_at(self, peer: int) -> int:
        return self.peer_order[peer]

    @staticmethod
    def identity(num_ranks: int, group_id: str = "ep-group-0", epoch: int = 0) -> "ProcessGroupSpec":
        return ProcessGroupSpec(group_id=group_id, peer_order=tuple(range(num_ranks)), epoch=epoch)


def check_group_in_topology(group: ProcessGroupSpec, topology: Topology, members: Iterable[int] | None = None) -> None:
    """Every member of ``group`` must be a topology rank (and, if given, exactly ``members``)."""
    known = {r.rank for r in topology.ranks}
    for r in group.peer_order:
        if r not in known:
            raise ValueError(f"process group {group.group_id!r}: rank {r} is outside topology {topology.version!r}")
    if members is not None and set(members) != set(group.peer_order):
        raise ValueError(
            f"process group {group.group_id!r}: members {sorted(group.peer_order)} != expected {sorted(set(members))}"
        )
