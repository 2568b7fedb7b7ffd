"""Topology ledgers and the node-relay plan (spec 0x07B-0x07E, 0x07G). Pure: no Ray.

Coordinates: a count matrix ``C`` is indexed by *global* rank (``C[s, t]`` rows from source rank s to
destination rank t). Split vectors are indexed by *peer slot* of a process group (0x07B). Every ledger
here is analytical: logical activation rows and bytes, never fabric counters or time.

The teaching relay schedule (0x07E) moves each different-node row in up to three stages:

    stage 1  source rank -> source-node relay       (skipped when the source is the relay)
    stage 2  source relay -> destination-node relay (always, crosses nodes)
    stage 3  destination relay -> final rank        (skipped when the destination is the relay)

Same-GPU and same-node rows move directly (no relay). Staging never changes a row's final rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Sequence

import torch

from ray_moe.moe.dispatch.plan import peer_split_vectors
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.core.types import RouteClass

CLASS_ORDER: tuple[RouteClass, ...] = (RouteClass.SAME_GPU, RouteClass.SAME_NODE, RouteClass.CROSS_NODE)


# ---------------------------------------------------------------------------------------------------------
# Coordinates
# ---------------------------------------------------------------------------------------------------------


def check_count_matrix(count: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Validate a global-rank count matrix: [P, P] integer, non-negative. Returns it as int64 CPU."""
    c = torch.as_tensor(count)
    if c.dim() != 2 or tuple(c.shape) != (num_ranks, num_ranks):
        raise ValueError(f"count_matrix: shape {tuple(c.shape)}, expected [{num_ranks}, {num_ranks}]")
    if c.is_floating_point() or c.dtype == torch.bool:
        raise ValueError(f"count_matrix: dtype {c.dtype}, expected an integer dtype")
    c = c.to(torch.int64).cpu()
    if c.numel() and int(c.min()) < 0:
        raise ValueError(f"count_matrix: negative count {int(c.min())}")
    return c


def count_matrix_from_routes(source: torch.Tensor, destination: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """C[s, t] over global ranks from per-route source and destination ranks ([R] int each) -> [P, P] int64."""
    s, d = _check_endpoints(source, destination, num_ranks)
    c = torch.zeros(num_ranks * num_ranks, dtype=torch.int64)
    c.index_add_(0, s * num_ranks + d, torch.ones_like(s))
    return c.view(num_ranks, num_ranks)


def _check_endpoints(source: torch.Tensor, destination: torch.Tensor, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.as_tensor(source).to(torch.int64).cpu().reshape(-1)
    d = torch.as_tensor(destination).to(torch.int64).cpu().reshape(-1)
    if s.shape != d.shape:
        raise ValueError(f"destination: {d.numel()} routes but source has {s.numel()}")
    for name, t in (("source", s), ("destination", d)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_ranks):
            bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
            raise ValueError(f"{name}: rank {bad} is out of range [0, {num_ranks})")
    return s, d


@dataclass(frozen=True)
class PeerSplits:
    """Split vectors of every global rank in one group's peer-slot order (spec 0x07B).

    send[u][i] = C[u, pi(i)]  (what global rank u sends to the rank at peer slot i)
    recv[v][i] = C[pi(i), v]  (what global rank v receives from the rank at peer slot i)
    Zero-count peers stay in every vector.
    """

    group_id: str
    peer_order: tuple[int, ...]
    send: tuple[tuple[int, ...], ...]
    recv: tuple[tuple[int, ...], ...]


def peer_splits(count: torch.Tensor, group: ProcessGroupSpec) -> PeerSplits:
    """Peer-slot split vectors from a global-rank count matrix ``count`` [P, P]."""
    c = check_count_matrix(count, group.size)
    if sorted(group.peer_order) != list(range(group.size)):
        raise ValueError(f"group.peer_order={list(group.peer_order)}: must be a permutation of 0..{group.size - 1}")
    send, recv = peer_split_vectors(c, torch.tensor(group.peer_order, dtype=torch.int64))
    return PeerSplits(
        group_id=group.group_id,
        peer_order=tuple(group.peer_order),
        send=tuple(tuple(int(x) for x in row) for row in send.tolist()),
        recv=tuple(tuple(int(x) for x in row) for row in recv.tolist()),
    )


# ---------------------------------------------------------------------------------------------------------
# Route classes and the flat ledger (0x07C)
# ---------------------------------------------------------------------------------------------------------


def _node_tensor(topology: Topology) -> torch.Tensor:
    return torch.tensor(topology.node_index(), dtype=torch.int64)


def relay_ranks(topology: Topology) -> torch.Tensor:
    """[P] int64: the relay rank of each global rank's node. Raises if a node has no relay."""
    relay_of_node = []
    for n in topology.nodes:
        if n.relay_rank is None:
            raise ValueError(f"topology.nodes[{n.node_id!r}].relay_rank=None: hierarchical exchange needs one relay per node")
        relay_of_node.append(n.relay_rank)
    return torch.tensor(relay_of_node, dtype=torch.int64)[_node_tensor(topology)]


def class_codes(source: torch.Tensor, destination: torch.Tensor, topology: Topology) -> torch.Tensor:
    """kappa(r) of every route as an index into ``CLASS_ORDER``: [R] int64 (0 same GPU, 1 same node, 2 cross)."""
    s, d = _check_endpoints(source, destination, topology.num_ranks)
    node = _node_tensor(topology)
    return torch.where(s == d, 0, torch.where(node[s] == node[d], 1, 2)).to(torch.int64)


@dataclass(frozen=True)
class RouteClassLedger:
    """Rows and route ids per physical class (spec 0x07C). Fractions are exact."""

    total: int
    rows: tuple[int, int, int]  # in CLASS_ORDER
    route_ids: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]
    evidence: str = "analytical"

    def count(self, cls: RouteClass | str) -> int:
        return self.rows[CLASS_ORDER.index(RouteClass(cls))]

    def ids(self, cls: RouteClass | str) -> tuple[str, ...]:
        return self.route_ids[CLASS_ORDER.index(RouteClass(cls))]

    def fraction(self, cls: RouteClass | str) -> Fraction:
        if self.total == 0:
            return Fraction(0)
        return Fraction(self.count(cls), self.total)


def classify_routes(
    source: torch.Tensor, destination: torch.Tensor, topology: Topology, route_ids: Sequence[str] | None = None
) -> RouteClassLedger:
    """Classify every route by (source rank, destination rank) into the three physical classes."""
    codes = class_codes(source, destination, topology)
    r = int(codes.numel())
    names = tuple(route_ids) if route_ids is not None else tuple(f"r{i:02d}" for i in range(r))
    if len(names) != r:
        raise ValueError(f"route_ids: {len(names)} ids for {r} routes")
    counts = torch.bincount(codes, minlength=3).tolist()
    by_class = tuple(tuple(names[i] for i in torch.nonzero(codes == c).flatten().tolist()) for c in range(3))
    return RouteClassLedger(total=r, rows=(counts[0], counts[1], counts[2]), route_ids=by_class)  # type: ignore[arg-type]


@dataclass(frozen=True)
class FlatClassLedger:
    """Flat-path logical activation ledger of one remote class (spec 0x07C).

    directed_pairs: distinct (source, destination) rank pairs with rows, per direction.
    """

    route_class: RouteClass
    dispatch_rows: int
    dispatch_bytes: int
    round_trip_bytes: int
    directed_pairs: int
    evidence: str = "analytical"


def _class_matrix(count: torch.Tensor, topology: Topology) -> torch.Tensor:
    """[P, P] class code of every (source, destination) pair."""
    p = topology.num_ranks
    s = torch.arange(p).repeat_interleave(p)
    d = torch.arange(p).repeat(p)
    return class_codes(s, d, topology).view(p, p)


def flat_ledger(count: torch.Tensor, topology: Topology, row_bytes: int) -> dict[RouteClass, FlatClassLedger]:
    """Flat all-to-all-v ledger of the two remote classes. ``row_bytes`` = d * activation itemsize."""
    if row_bytes < 1:
        raise ValueError(f"row_bytes={row_bytes}: must be >= 1")
    c = check_count_matrix(count, topology.num_ranks)
    cls = _class_matrix(c, topology)
    out = {}
    for code in (1, 2):
        sel = cls == code
        rows = int(c[sel].sum())
        out[CLASS_ORDER[code]] = FlatClassLedger(
            route_class=CLASS_ORDER[code],
            dispatch_rows=rows,
            dispatch_bytes=rows * row_bytes,
            round_trip_bytes=2 * rows * row_bytes,
            directed_pairs=int(((c > 0) & sel).sum()),
        )
    return out


# ---------------------------------------------------------------------------------------------------------
# The node-relay plan (0x07E)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RelayRounds:
    """Row matrices of the three relay rounds, over global ranks (row = sender, column = receiver).

    direct: [P, P] int64  same-GPU (diagonal) and same-node rows delivered in round 1
    stage1: [P, P] int64  different-node rows staged to the source relay in round 1 (a relay's own rows sit
                          on the diagonal: they stay put)
    stage2: [P, P] int64  relay -> relay rows of round 2
    stage3: [P, P] int64  relay -> final rank rows of round 3 (rows whose final rank is the relay end in round 2)

    The split matrix of round 1 is ``direct + stage1``; of round 2 ``stage2``; of round 3 ``stage3``.
    """

    direct: torch.Tensor
    stage1: torch.Tensor
    stage2: torch.Tensor
    stage3: torch.Tensor

    def round_matrix(self, round_index: int) -> torch.Tensor:
        if round_index == 1:
            return self.direct + self.stage1
        if round_index == 2:
            return self.stage2
        if round_index == 3:
            return self.stage3
        raise ValueError(f"round_index={round_index}: rounds are 1, 2, 3")

    def ledger(self) -> "RelayStageLedger":
        """Rows that change rank in each stage (off-diagonal sums)."""

        def off(m: torch.Tensor) -> int:
            return int(m.sum() - m.diagonal().sum())

        return RelayStageLedger(
            source_to_source_relay=off(self.stage1),
            relay_to_relay=off(self.stage2),
            relay_to_final=off(self.stage3),
            direct_same_node=off(self.direct),
            same_gpu=int(self.direct.diagonal().sum()),
        )


@dataclass(frozen=True)
class RelayStageLedger:
    """Rows per relay stage of one direction (dispatch or combine), analytical (spec 0x07E)."""

    source_to_source_relay: int
    relay_to_relay: int
    relay_to_final: int
    direct_same_node: int
    same_gpu: int
    evidence: str = "analytical"

    @property
    def stages(self) -> tuple[int, int, int]:
        return (self.source_to_source_relay, self.relay_to_relay, self.relay_to_final)

    @property
    def added_relay_rows(self) -> int:
        """Intra-node relay-row movements the flat path would not make (stages 1 and 3)."""
        return self.source_to_source_relay + self.relay_to_final

    def __add__(self, other: "RelayStageLedger") -> "RelayStageLedger":
        if not isinstance(other, RelayStageLedger):
            return NotImplemented
        return RelayStageLedger(
            self.source_to_source_relay + other.source_to_source_relay,
            self.relay_to_relay + other.relay_to_relay,
            self.relay_to_final + other.relay_to_final,
            self.direct_same_node + other.direct_same_node,
            self.same_gpu + other.same_gpu,
        )


def relay_rounds(count: torch.Tensor, topology: Topology) -> RelayRounds:
    """The three-round relay plan of a global-rank count matrix (vectorised over rank pairs).

    1. class of every (s, t) pair; relay r(s) of every rank
    2. direct: same-GPU and same-node counts stay at (s, t)
    3. stage 1: different-node counts move to (s, r(s))
    4. stage 2: different-node counts move to (r(s), r(t))
    5. stage 3: different-node counts with t != r(t) move to (r(t), t)
    """
    p = topology.num_ranks
    c = check_count_matrix(count, p)
    # 1.
    relay = relay_ranks(topology)
    cls = _class_matrix(c, topology)
    s = torch.arange(p).repeat_interleave(p)
    t = torch.arange(p).repeat(p)
    flat = c.reshape(-1)
    cross = cls.reshape(-1) == 2

    def scatter(rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(p * p, dtype=torch.int64)
        m.index_add_(0, rows * p + cols, vals)
        return m.view(p, p)

    zero = torch.zeros_like(flat)
    # 2.
    direct = torch.where(cross, zero, flat).view(p, p).clone()
    crossed = torch.where(cross, flat, zero)
    # 3.-5.
    stage1 = scatter(s, relay[s], crossed)
    stage2 = scatter(relay[s], relay[t], crossed)
    stage3 = scatter(relay[t], t, torch.where(t != relay[t], crossed, zero))
    return RelayRounds(direct=direct, stage1=stage1, stage2=stage2, stage3=stage3)


def relay_stage_ledger(count: torch.Tensor, topology: Topology) -> RelayStageLedger:
    return relay_rounds(count, topology).ledger()


@dataclass(frozen=True)
class HierarchicalLedger:
    """Round-trip (dispatch + combine) flat vs hierarchical ledger of different-node payload (spec 0x07E).

    Combine reverses source and destination, so its stage ledger is the dispatch plan of C^T.
    Fewer inter-node pairs can enable coalescing; it proves neither fewer bytes nor lower latency.
    """

    dispatch: RelayStageLedger
    combine: RelayStageLedger
    row_bytes: int
    flat_inter_roundtrip_bytes: int
    hier_inter_roundtrip_bytes: int
    added_relay_bytes: int
    flat_inter_directed_pairs: int
    hier_inter_directed_pairs: int
    evidence: str = "analytical"


def _inter_pairs(c: torch.Tensor, topology: Topology, relay: torch.Tensor) -> tuple[int, int]:
    """(flat, hierarchical) directed inter-node pairs of one direction."""
    cls = _class_matrix(c, topology)
    live = (c > 0) & (cls == 2)
    flat = int(live.sum())
    src, dst = torch.nonzero(live, as_tuple=True)
    hier = len(set(zip(relay[src].tolist(), relay[dst].tolist())))
    return flat, hier


def hierarchical_ledger(count: torch.Tensor, topology: Topology, row_bytes: int) -> HierarchicalLedger:
    """Flat-vs-relay round-trip ledger of a global-rank count matrix."""
    if row_bytes < 1:
        raise ValueError(f"row_bytes={row_bytes}: must be >= 1")
    c = check_count_matrix(count, topology.num_ranks)
    relay = relay_ranks(topology)
    disp = relay_stage_ledger(c, topology)
    comb = relay_stage_ledger(c.T.contiguous(), topology)
    cross_rows = int(flat_ledger(c, topology, row_bytes)[RouteClass.CROSS_NODE].dispatch_rows)
    f_d, h_d = _inter_pairs(c, topology, relay)
    f_c, h_c = _inter_pairs(c.T.contiguous(), topology, relay)
    return HierarchicalLedger(
        dispatch=disp,
        combine=comb,
        row_bytes=row_bytes,
        flat_inter_roundtrip_bytes=2 * cross_rows * row_bytes,
        hier_inter_roundtrip_bytes=(disp.relay_to_relay + comb.relay_to_relay) * row_bytes,
        added_relay_bytes=(disp.added_relay_rows + comb.added_relay_rows) * row_bytes,
        flat_inter_directed_pairs=f_d + f_c,
        hier_inter_directed_pairs=h_d + h_c,
    )


# ---------------------------------------------------------------------------------------------------------
# Process-group construction (0x07G)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupBinding:
    """The checked groups of one topology plan: full EP group, one node-local group per node, relays."""

    epoch: int
    ep: ProcessGroupSpec
    node_groups: tuple[tuple[str, ProcessGroupSpec], ...]  # (node_id, group) in topology node order
    relays: ProcessGroupSpec


def require_group(groups: Mapping[str, ProcessGroupSpec], group_id: str, epoch: int) -> ProcessGroupSpec:
    """The named group at the given collective epoch, else ``ValueError``."""
    g = groups.get(group_id)
    if g is None:
        raise ValueError(f"process_groups: group {group_id!r} is missing (have {sorted(groups)})")
    if g.group_id != group_id:
        raise ValueError(f"process_groups[{group_id!r}].group_id={g.group_id!r}: key and group id disagree")
    if g.epoch != epoch:
        raise ValueError(f"process_groups[{group_id!r}].epoch={g.epoch}: expected collective epoch {epoch}")
    return g


def check_process_groups(
    topology: Topology,
    groups: Mapping[str, ProcessGroupSpec],
    *,
    epoch: int,
    ep_group_id: str = "ep-group-0",
    relay_group_id: str = "ep-relays",
    node_group_ids: Mapping[str, str] | None = None,
) -> GroupBinding:
    """The construction checks of spec 0x07G; any mismatch raises ``ValueError`` naming group and field.

    1. the EP group exists at ``epoch`` and its members are exactly the topology ranks
    2. each node's local group (default id ``ep-{node_id}``) exists at ``epoch``, its members are exactly
       the node's ranks, and the node relay is among them
    3. the relay group exists at ``epoch`` and its members are exactly the set of node relays
    """
    # 1.
    ep = require_group(groups, ep_group_id, epoch)
    ranks = {r.rank for r in topology.ranks}
    if set(ep.peer_order) != ranks:
        raise ValueError(
            f"process_groups[{ep_group_id!r}].peer_order={list(ep.peer_order)}: members must be the topology ranks {sorted(ranks)}"
        )
    # 2.
    bound = []
    for node in topology.nodes:
        gid = (node_group_ids or {}).get(node.node_id, f"ep-{node.node_id}")
        local = require_group(groups, gid, epoch)
        if set(local.peer_order) != set(node.ranks):
            raise ValueError(
                f"process_groups[{gid!r}].peer_order={list(local.peer_order)}: members must be node "
                f"{node.node_id!r} ranks {sorted(node.ranks)}"
            )
        if node.relay_rank is None:
            raise ValueError(f"topology.nodes[{node.node_id!r}].relay_rank=None: every node needs a relay")
        if node.relay_rank not in local.peer_order:
            raise ValueError(f"process_groups[{gid!r}]: relay rank {node.relay_rank} is not a member")
        bound.append((node.node_id, local))
    # 3.
    relays = require_group(groups, relay_group_id, epoch)
    want = {n.relay_rank for n in topology.nodes}
    if set(relays.peer_order) != want or len(relays.peer_order) != len(topology.nodes):
        raise ValueError(
            f"process_groups[{relay_group_id!r}].peer_order={list(relays.peer_order)}: members must be the node "
            f"relays {sorted(want)}"
        )
    return GroupBinding(epoch=epoch, ep=ep, node_groups=tuple(bound), relays=relays)


@dataclass(frozen=True)
class TopologyPlan:
    """Everything spec 0x07G's ``build_topology_plan`` produces for one set of immutable routes."""

    groups: GroupBinding
    count_matrix: tuple[tuple[int, ...], ...]
    splits: PeerSplits
    classes: RouteClassLedger
    flat: dict[RouteClass, FlatClassLedger]
    hierarchical: HierarchicalLedger


def build_topology_plan(
    source: torch.Tensor,
    destination: torch.Tensor,
    topology: Topology,
    groups: Mapping[str, ProcessGroupSpec],
    *,
    epoch: int,
    row_bytes: int,
    route_ids: Sequence[str] | None = None,
    ep_group_id: str = "ep-group-0",
    relay_group_id: str = "ep-relays",
    node_group_ids: Mapping[str, str] | None = None,
) -> TopologyPlan:
    """Check the groups, then derive split vectors, classes and flat/relay ledgers from the routes.

    source / destination: [R] int global ranks of each immutable route (never rewritten here).
    """
    binding = check_process_groups(topology, groups, epoch=epoch, ep_group_id=ep_group_id,
                                   relay_group_id=relay_group_id, node_group_ids=node_group_ids)
    c = count_matrix_from_routes(source, destination, topology.num_ranks)
    return TopologyPlan(
        groups=binding,
        count_matrix=tuple(tuple(int(x) for x in row) for row in c.tolist()),
        splits=peer_splits(c, binding.ep),
        classes=classify_routes(source, destination, topology, route_ids),
        flat=flat_ledger(c, topology, row_bytes),
        hierarchical=hierarchical_ledger(c, topology, row_bytes),
    )
