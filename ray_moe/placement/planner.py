"""PlacementPlanner: the arithmetic that turns a live placement into a candidate one. Pure: no Ray, no control plane.

The control plane gathers its state (the ACTIVE manifest, the live ranks, the load window, the replica floors,
the memory budget) and asks the planner for an :class:`Assignment`; it then spends a generation id on it and
builds the manifest (``manifest_from_assignment``), so a refused proposal spends nothing.

    initial     spread placement over the live ranks (generation 0)
    scale       one logical expert to n copies, every other slot kept
    rebalance   EPLB over the load window, replica floors kept
    without     the slots of lost ranks removed, orphaned experts given one copy
    survivors   refuse a rank loss that leaves an expert with no copy and no checkpoint
    admit       the migration plan old -> new under the per-rank memory budget
    transfers   the plan's copies grouped by (target, source) rank, checkpoint loads by target rank
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ray_moe.core.errors import ExpertUnavailableError
from ray_moe.placement.floors import ReplicaFloors
from ray_moe.placement.initial import spread_assignment
from ray_moe.placement.load import LoadWindow
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.placement.migration import MigrationActionKind, MigrationPlan, plan_migration
from ray_moe.placement.topology import Topology

Key = tuple[int, int]  # (layer, logical expert)


@dataclass(frozen=True)
class Assignment:
    """A placement before it has a generation id.

    phy2log: [L][Q_l] logical expert of each physical slot of layer l (Q_l may differ by layer).
    slot_rank: [L][Q_l] rank that holds each of those slots.
    notes: what the planner had to give up to fit (replica floors lowered for lack of slots).
    """

    phy2log: list[list[int]]
    slot_rank: list[list[int]]
    notes: tuple[str, ...] = ()

    def keys_by_rank(self) -> dict[int, set[Key]]:
        """The (layer, expert) copies each rank holds."""
        out: dict[int, set[Key]] = defaultdict(set)
        for l, (p2l, rk) in enumerate(zip(self.phy2log, self.slot_rank)):
            for e, u in zip(p2l, rk):
                out[u].add((l, e))
        return dict(out)


@dataclass(frozen=True)
class Transfers:
    """How a migration plan's new copies arrive: ``copies[(target, source)]`` are sent rank to rank,
    ``loads[target]`` are read from the checkpoint (no source, or the source is gone)."""

    copies: dict[tuple[int, int], set[Key]]
    loads: dict[int, set[Key]]


def _layer(current: PlacementManifest, layer: int) -> tuple[list[int], list[int]]:
    """(phy2log, slot_rank) of one layer of ``current``, in slot order."""
    slots = current.layer_slots(layer)
    return [s.logical_expert_id for s in slots], [s.destination_rank for s in slots]


class PlacementPlanner:
    """Candidate placements for a deployment of ``num_layers`` x ``num_experts`` logical experts with
    ``slots_per_rank`` slots per rank on ``topology``. Holds no state between calls."""

    def __init__(self, num_layers: int, num_experts: int, slots_per_rank: int, topology: Topology, *,
                 num_groups: int = 1) -> None:
        for name, v in (("num_layers", num_layers), ("num_experts", num_experts),
                        ("slots_per_rank", slots_per_rank), ("num_groups", num_groups)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.slots_per_rank = slots_per_rank
        self.topology = topology
        self.num_groups = num_groups

    # ---------------------------------------------------------------- generation 0
    def initial(self, live: Sequence[int]) -> Assignment:
        """Spread placement (``spread_assignment``): slot q holds expert ``q mod E`` on ``live[q // slots_per_rank]``."""
        phy2log, slot_rank = spread_assignment(self.num_layers, self.num_experts, len(live), self.slots_per_rank,
                                               list(live))
        return Assignment(phy2log, slot_rank)

    # ---------------------------------------------------------------- manual scale
    def scale(self, current: PlacementManifest, live: Sequence[int], expert: int, replicas: int,
              layer: int | None = None) -> Assignment:
        """``current`` with ``expert`` at exactly ``replicas`` copies in ``layer`` (None: every layer).

        1. Check the request: ``expert`` and ``layer`` in range, ``1 <= replicas <= len(live)`` (one copy per rank).
        2. Every layer starts as ``current``'s slots, in slot order; layers not named are kept as they are.
        3. Too few copies: append a slot on the live rank that hosts no copy yet and has the fewest slots
           (ties: lowest rank), until there are ``replicas``.
        4. Too many: drop the last slot of the expert on the host with the most slots (ties: highest rank),
           until there are ``replicas``. Every other slot keeps its rank.
        """
        # 1. the request
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert={expert} is out of range [0, {self.num_experts})")
        if replicas < 1:
            raise ValueError(f"replicas={replicas} must be >= 1 (every logical expert keeps a slot)")
        if layer is not None and not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range [0, {self.num_layers})")
        if replicas > len(live):
            raise ValueError(f"replicas={replicas} exceeds the {len(live)} live ranks (one copy per rank)")
        phy2log, slot_rank = [], []
        for l in range(self.num_layers):
            # 2. the current slots
            p2l, rk = _layer(current, l)
            if layer is None or l == layer:
                hosts = [rk[i] for i, e in enumerate(p2l) if e == expert]
                per_rank = Counter(rk)
                # 3. add copies on new ranks
                while len(hosts) < replicas:
                    u = min((r for r in live if r not in hosts), key=lambda r: (per_rank[r], r))
                    p2l.append(expert)
                    rk.append(u)
                    hosts.append(u)
                    per_rank[u] += 1
                # 4. drop copies from the fullest ranks
                while len(hosts) > replicas:
                    u = max(hosts, key=lambda r: (per_rank[r], r))
                    i = max(i for i, (e, r) in enumerate(zip(p2l, rk)) if e == expert and r == u)
                    del p2l[i], rk[i]
                    hosts.remove(u)
                    per_rank[u] -= 1
            phy2log.append(p2l)
            slot_rank.append(rk)
        return Assignment(phy2log, slot_rank)

    # ---------------------------------------------------------------- EPLB
    def rebalance(self, current: PlacementManifest, live: Sequence[int], load: LoadWindow,
                  floors: ReplicaFloors | None = None, *, migration_aware: bool = True, tolerance: float = 0.05,
                  avoid_same_gpu_duplicates: bool = True) -> Assignment:
        """EPLB on ``load``'s window over the ``live`` ranks; every rank keeps ``slots_per_rank`` slots.

        1. Refuse an empty load window (EPLB would place on no evidence).
        2. The domain: the live ranks are the GPUs; their nodes count only when every node has as many live
           ranks (else one node: EPLB's global policy). Q = ``slots_per_rank`` x live ranks slots per layer.
        3. Migration-aware: ``current`` as [L, Q] rows in live-rank order when every layer has Q slots, each on
           a live rank and ``slots_per_rank`` per rank; otherwise EPLB starts from nothing (tolerance 0).
        4. Replica floors as EPLB's ``min_replicas``, lowered (newest kept whole) to fit Q; ``notes`` name
           each floor lowered.
        5. EPLB (``rebalance_experts``); slot q goes to ``live[q // slots_per_rank]``.
        """
        from ray_moe.placement.eplb import rebalance_experts

        # 1. evidence
        if len(load) == 0:
            raise ValueError("load window: no observation yet; serve some steps before rebalancing")
        weight = load.snapshot().weight.astype(np.float64)
        # 2. domain
        live = list(live)
        gpus = len(live)
        per_node = Counter(self.topology.node_of(r) for r in live)
        nodes = len(per_node) if len(set(per_node.values())) == 1 else 1
        q = self.slots_per_rank * gpus
        # 3. the current placement, when it has the target's shape
        current_rows = None
        if migration_aware and all(current.num_slots(l) == q for l in range(self.num_layers)):
            current_rows = self._rows_by_live_rank(current, live)
        # 4. floors
        min_replicas, notes = (None, []) if floors is None else floors.matrix(q)
        # 5. solve and lay the slots on the live ranks
        res = rebalance_experts(weight, q, self.num_groups, nodes, gpus,
                                avoid_same_gpu_duplicates=avoid_same_gpu_duplicates, current_phy2log=current_rows,
                                migration_tolerance=tolerance if current_rows is not None else 0.0,
                                min_replicas=min_replicas)
        slot_rank = [[live[i // self.slots_per_rank] for i in range(q)] for _ in range(self.num_layers)]
        return Assignment(res.phy2log.tolist(), slot_rank, tuple(notes))

    def _rows_by_live_rank(self, current: PlacementManifest, live: list[int]) -> np.ndarray | None:
        """[L, Q] int64: each layer's experts grouped by rank in ``live`` order; None when a slot is on a rank
        outside ``live`` or a live rank does not hold exactly ``slots_per_rank`` slots."""
        order = set(live)
        rows = []
        for l in range(self.num_layers):
            by_rank: dict[int, list[int]] = defaultdict(list)
            for s in current.layer_slots(l):
                if s.destination_rank not in order:
                    return None
                by_rank[s.destination_rank].append(s.logical_expert_id)
            if any(len(by_rank.get(r, [])) != self.slots_per_rank for r in live):
                return None
            rows.append([e for r in live for e in by_rank.get(r, [])])
        return np.asarray(rows, dtype=np.int64)

    # ---------------------------------------------------------------- lost ranks
    def without(self, current: PlacementManifest, live: Sequence[int], dead: Sequence[int]) -> Assignment:
        """``current`` minus the slots of ``dead`` ranks.

        1. The survivors: ``live`` minus ``dead``; none left raises ``ExpertUnavailableError``.
        2. Every layer keeps its slots on survivors, in slot order.
        3. An expert left with no copy gets one (in expert order) on the survivor with the fewest slots
           (ties: lowest rank); it is rebuilt from a survivor's copy or the checkpoint.
        """
        # 1. survivors
        gone = set(dead)
        alive = [r for r in live if r not in gone]
        if not alive:
            raise ExpertUnavailableError("no live rank left", expert=0)
        phy2log, slot_rank = [], []
        for l in range(self.num_layers):
            # 2. surviving slots
            p2l, rk = [], []
            for e, u in zip(*_layer(current, l)):
                if u in alive:
                    p2l.append(e)
                    rk.append(u)
            # 3. orphans
            per_rank = Counter(rk)
            for e in range(self.num_experts):
                if e not in p2l:
                    u = min(alive, key=lambda r: (per_rank[r], r))
                    p2l.append(e)
                    rk.append(u)
                    per_rank[u] += 1
            phy2log.append(p2l)
            slot_rank.append(rk)
        return Assignment(phy2log, slot_rank)

    def require_survivors(self, current: PlacementManifest, members: Sequence[int], *, can_rebuild: bool) -> None:
        """Refuse a rank loss that leaves a (layer, expert) with no copy on ``members`` when the checkpoint may
        not rebuild it (``can_rebuild`` False): ``ExpertUnavailableError`` names the first such expert and the
        ranks its copies were on."""
        if can_rebuild:
            return
        keep = set(members)
        for l in range(self.num_layers):
            for e in range(self.num_experts):
                held = sorted(s.destination_rank for s in current.replicas(e, l))
                if not keep.intersection(held):
                    raise ExpertUnavailableError(
                        f"logical expert {e} of layer {l} has no surviving replica (its copies were on ranks "
                        f"{held}) and no checkpoint to rebuild from",
                        expert=e, layer=l,
                    )

    # ---------------------------------------------------------------- admission
    def admit(self, old: PlacementManifest, new: PlacementManifest, live: Sequence[int], *, expert_bytes: int,
              memory_budget_bytes: int | None = None) -> MigrationPlan:
        """The migration plan ``old`` -> ``new`` (``plan_migration``; one copy counts ``max(1, expert_bytes)``).

        With ``memory_budget_bytes`` every live rank gets that budget and a plan whose peak exceeds it on any
        rank is refused (``AdmissionError`` naming each such rank, its peak and budget) before anything moves.
        """
        budget = None if memory_budget_bytes is None else {r: memory_budget_bytes for r in live}
        return plan_migration(old, new, self.topology, expert_bytes=max(1, expert_bytes), rank_budget_bytes=budget)

    @staticmethod
    def transfers(plan: MigrationPlan, source_alive: Callable[[int], bool]) -> Transfers:
        """The plan's copy and load actions by the way they arrive.

        1. A same-node or cross-node copy whose source rank is alive travels from it (grouped by
           (target, source)); one whose source is not alive is loaded from the checkpoint instead.
        2. A checkpoint load stays a load. Retained slots and retires move nothing.
        """
        copies: dict[tuple[int, int], set[Key]] = defaultdict(set)
        loads: dict[int, set[Key]] = defaultdict(set)
        for a in plan.target_actions():
            key = (a.layer, a.expert)
            if a.action in (MigrationActionKind.SAME_NODE_COPY, MigrationActionKind.CROSS_NODE_COPY):
                if source_alive(a.source_rank):
                    copies[(a.target_rank, a.source_rank)].add(key)
                else:
                    loads[a.target_rank].add(key)
            elif a.action == MigrationActionKind.CHECKPOINT_LOAD:
                loads[a.target_rank].add(key)
        return Transfers(dict(copies), dict(loads))


__all__ = ["Assignment", "PlacementPlanner", "Transfers"]
