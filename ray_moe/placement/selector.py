"""Replica selection (spec 0x01D1, 0x08H). Pure and vectorised.

EPLB returns replica sets; a selector assigns each accepted route exactly one compatible physical
slot of its logical expert. It never changes the logical expert or the gate.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ray_moe.core.routes import SemanticRoutes
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.core.types import ReplicaPolicy


def _rank_within_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Position of each route among the routes of its logical expert, in semantic order: [R] int64."""
    order = torch.sort(experts, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts))  # not bincount: no device-to-host sync on CUDA
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(experts.numel(), device=experts.device) - starts[experts[order]]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    return pos


class ReplicaSelector(ABC):
    """Chooses one physical slot per route: ``select(routes, snapshot) -> [R] int64``."""

    policy: ReplicaPolicy
    # True when ``select`` is a pure function of (routes, snapshot) made of device ops only (no host
    # sync, no state): the direct path may then capture it in a CUDA graph
    graph_safe: bool = False

    @abstractmethod
    def select(self, routes: SemanticRoutes, snapshot: PlacementSnapshot) -> torch.Tensor:
        """Physical slot of every route, in semantic order."""

    def observe(self, rank_rows: torch.Tensor) -> None:
        """Feed back the rows each rank received in the last step ([P] int64); stateless by default."""


class RoundRobinSelector(ReplicaSelector):
    """The i-th route of expert e from origin p uses replica ``(i + p) mod logcnt[e]``: deterministic, and
    each origin's routes to a replicated expert split evenly over its replicas."""

    policy = ReplicaPolicy.ROUND_ROBIN
    graph_safe = True

    def select(self, routes: SemanticRoutes, snapshot: PlacementSnapshot) -> torch.Tensor:
        e = routes.logical_expert
        if e.numel() == 0:
            return e.clone()
        maps = snapshot.on(e.device)
        if snapshot.log2phy.shape[1] == 1:  # no replicated expert: replica 0 is the only choice
            return maps.log2phy[e, 0]
        pos = _rank_within_expert(e, snapshot.num_experts)
        j = (pos + routes.origin_rank) % maps.logcnt[e]
        return maps.log2phy[e, j]


class HashSelector(ReplicaSelector):
    """Replica chosen by a hash of (origin rank, token, route slot): stateless and reproducible."""

    policy = ReplicaPolicy.HASH
    graph_safe = True

    def select(self, routes: SemanticRoutes, snapshot: PlacementSnapshot) -> torch.Tensor:
        e = routes.logical_expert
        if e.numel() == 0:
            return e.clone()
        dev = e.device
        key = (routes.origin_token * 0x9E3779B1 + routes.route_slot * 0x85EBCA77 + routes.origin_rank * 0xC2B2AE3D)
        key = (key ^ (key >> 15)) & 0x7FFFFFFF
        j = key % snapshot.on(dev).logcnt[e]
        return snapshot.on(dev).log2phy[e, j]


class LeastLoadSelector(ReplicaSelector):
    """Water-filling: each replicated expert's routes are split over its replicas so the predicted rank
    loads after this step are as even as possible. Predicted loads start from ``observe`` feedback
    (rows per rank in the previous step, decayed) or zero."""

    policy = ReplicaPolicy.LEAST_LOAD

    def __init__(self, decay: float = 0.5) -> None:
        self.decay = decay
        self._load: torch.Tensor | None = None

    def observe(self, rank_rows: torch.Tensor) -> None:
        rows = rank_rows.to(torch.float64).cpu()
        self._load = rows if self._load is None or self._load.numel() != rows.numel() else self.decay * self._load + rows

    def select(self, routes: SemanticRoutes, snapshot: PlacementSnapshot) -> torch.Tensor:
        e = routes.logical_expert
        if e.numel() == 0:
            return e.clone()
        dev = e.device
        log2phy = snapshot.log2phy.to(dev)
        logcnt = snapshot.logcnt.cpu()
        slot = log2phy[e, 0].clone()
        load = torch.zeros(snapshot.num_ranks, dtype=torch.float64) if self._load is None else self._load.clone()
        slot_rank = snapshot.slot_rank.cpu()
        counts = torch.bincount(e.cpu(), minlength=snapshot.num_experts)
        # single-replica experts are forced; add their rows first
        single = logcnt == 1
        load.index_add_(0, slot_rank[snapshot.log2phy[:, 0][single]], counts[single].to(torch.float64))
        replicated = torch.nonzero((~single) & (counts > 0)).flatten()
        if replicated.numel() == 0:
            return slot
        pos = _rank_within_expert(e, snapshot.num_experts)
        # hottest replicated experts first; a short loop over replicated experts only (not over routes)
        for ex in replicated[torch.argsort(counts[replicated], descending=True, stable=True)].tolist():
            m = int(logcnt[ex])
            cand = snapshot.log2phy[ex, :m]
            ranks = slot_rank[cand]
            quota = _water_fill(load[ranks], int(counts[ex]))
            load.index_add_(0, ranks, quota.to(torch.float64))
            bounds = torch.cumsum(quota, 0)
            mask = e == ex
            j = torch.searchsorted(bounds.to(dev), pos[mask], right=True)
            slot[mask] = log2phy[ex, j]
        return slot


def _water_fill(base: torch.Tensor, n: int) -> torch.Tensor:
    """Split ``n`` rows over bins with current loads ``base`` so the resulting max load is minimal:
    [m] int64 quotas summing to ``n`` (ties to the lower bin index)."""
    m = base.numel()
    quota = torch.zeros(m, dtype=torch.int64)
    if n == 0:
        return quota
    lo, hi = float(base.min()), float(base.max()) + n
    for _ in range(60):  # bisection on the water level
        mid = (lo + hi) / 2
        if float(torch.clamp(mid - base, min=0).floor().sum()) >= n:
            hi = mid
        else:
            lo = mid
    quota = torch.clamp(hi - base, min=0).floor().to(torch.int64)
    excess = int(quota.sum()) - n
    order = torch.argsort(base + quota.to(base.dtype), descending=True, stable=True)
    i = 0
    while excess > 0:
        b = int(order[i % m])
        if quota[b] > 0:
            quota[b] -= 1
            excess -= 1
        i += 1
    return quota


class LocalityFirstSelector(ReplicaSelector):
    """Prefer a replica on the origin rank, then on the origin node, then the least predicted load, then the
    lowest slot id (spec 0x08H's key)."""

    policy = ReplicaPolicy.LOCALITY

    def __init__(self) -> None:
        self._load: torch.Tensor | None = None

    def observe(self, rank_rows: torch.Tensor) -> None:
        self._load = rank_rows.to(torch.float64).cpu()

    def select(self, routes: SemanticRoutes, snapshot: PlacementSnapshot) -> torch.Tensor:
        e = routes.logical_expert
        if e.numel() == 0:
            return e.clone()
        dev = e.device
        cand = snapshot.log2phy.to(dev)[e]  # [R, M]
        valid = cand >= 0
        safe = cand.clamp_min(0)
        rank = snapshot.slot_rank.to(dev)[safe]
        node = snapshot.rank_node.to(dev)
        origin = routes.origin_rank
        cls = torch.where(rank == origin, 0, torch.where(node[rank] == node[origin], 1, 2)).to(torch.float64)
        load = torch.zeros(snapshot.num_ranks, dtype=torch.float64, device=dev) if self._load is None else self._load.to(dev)
        lmax = float(load.max()) + 1.0
        q = float(snapshot.num_slots) + 1.0
        score = cls * (lmax * q) + load[rank] * q + safe.to(torch.float64)
        score = torch.where(valid, score, torch.full_like(score, float("inf")))
        j = torch.argmin(score, dim=1)
        return cand.gather(1, j[:, None]).squeeze(1)


class ExplicitSelector(ReplicaSelector):
    """A frozen assignment handed over from upstream (the spec's Loop 2 fixture): slots given per origin."""

    policy = ReplicaPolicy.EXPLICIT

    def __init__(self, slots_by_origin: dict[int, torch.Tensor]) -> None:
        self._slots = slots_by_origin

    def select(self, routes: SemanticRoutes, snapshot: PlacementSnapshot) -> torch.Tensor:
        s = self._slots.get(routes.origin_rank)
        if s is None:
            return torch.zeros(0, dtype=torch.int64)
        return s.to(torch.int64).reshape(-1)


def make_selector(policy: ReplicaPolicy | str) -> ReplicaSelector:
    policy = ReplicaPolicy(policy)
    if policy is ReplicaPolicy.EXPLICIT:
        raise ValueError("policy='explicit' needs the assignment: construct ExplicitSelector(slots_by_origin)")
    return {
        ReplicaPolicy.ROUND_ROBIN: RoundRobinSelector,
        ReplicaPolicy.HASH: HashSelector,
        ReplicaPolicy.LEAST_LOAD: LeastLoadSelector,
        ReplicaPolicy.LOCALITY: LocalityFirstSelector,
    }[policy]()
