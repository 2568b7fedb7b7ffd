"""The public EPLB solver, vectorised across layers (spec 0x08B-0x08E). Pure: no Ray.

:func:`solve_layers` reproduces the pinned public solver (deepseek-ai/EPLB ``eplb.py`` at
d52c72d5b2f2fb4c41afbf8eb21366820239913d, ``rebalance_experts_hierarchical``) exactly, with every layer
solved at once; :func:`ray_moe.placement.eplb.rebalance_experts` is the entry point built on it.

* ``balanced_packing`` is inherently sequential in the items (each choice depends on the pack loads
  so far), so it runs one numpy step per item *rank*, and each step serves all rows (layers, or
  layers x nodes) together: the k-th heaviest item of every row goes to its row's lightest pack that
  still has room. Full packs carry an ``inf`` load so one ``argmin`` (first index on ties) decides.
* ``replicate_experts`` runs one ``argmax`` step per redundant slot over all rows.

The arithmetic contract (float32 loads, left-to-right group sums, stable descending sort, first
index on ties) is written out in :mod:`ray_moe_dev.testing.eplb_reference`, the loop-form oracle that
this module must match bit for bit. Against the public torch code itself, phy2log and logcnt agree
on tie-free loads; log2phy can differ in the *order* of one expert's copies when a node has more than
about 16 copies, because ``torch.sort`` is not stable there and copies of one expert always tie.

Option (a) of the entry point, ``avoid_same_gpu_duplicates``, lives here because it is a variant of
the GPU packing itself (``balanced_packing`` with ``item_key``): while packing a node's physical copies
to its GPUs, a copy never joins a GPU that already holds a copy of the same logical expert if another
GPU with room does not; leftover clashes are repaired by load-aware swaps (and, as a last resort, a
round-robin deal that is clash-free by construction) whenever ``logcnt[e] <= GPUs per placement
domain``. Off by default; off, it changes nothing.

Also here: the placement measures shared by the entry point, the migration option and benchmarks
(copies per expert and per GPU, ideal per-GPU loads of spec 0x08D: a copy of expert ``e`` carries
``W_e / m_e``, and slots changed between two placements).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_F32 = np.float32
_MAX_ROW_SUM = 1e38  # pack loads are float32 sums; keep them finite


@dataclass(frozen=True)
class EPLBShape:
    """Validated solver shape. ``groups``/``nodes`` are the effective ones: the global policy runs the
    hierarchical routine with one group on one node (spec 0x08D)."""

    num_layers: int
    num_experts: int
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_gpus: int
    hierarchical: bool

    @property
    def groups(self) -> int:
        return self.num_groups if self.hierarchical else 1

    @property
    def nodes(self) -> int:
        return self.num_nodes if self.hierarchical else 1

    @property
    def slots_per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.nodes

    @property
    def group_size(self) -> int:
        return self.num_experts // self.groups


# ----------------------------------------------------------------------------------------- validation
def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an int")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return int(value)


def as_load_matrix(weight: Any) -> np.ndarray:
    """The load matrix as float32 numpy: [L, E] float32 (the source's ``weight.float().cpu()``).

    Raises ValueError for a wrong rank, an empty matrix, NaN/inf, negative loads, or a layer whose
    total would overflow float32 pack sums.
    """
    if isinstance(weight, torch.Tensor):
        w = weight.detach().to(device="cpu", dtype=torch.float32).numpy()
    else:
        try:
            w = np.asarray(weight, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"weight is not a numeric [L, E] array: {exc}") from None
    if w.ndim != 2:
        raise ValueError(f"weight must be [L, E], got shape {tuple(w.shape)}")
    if w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"weight must have at least one layer and one expert, got shape {tuple(w.shape)}")
    if not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"weight[{bad[0]}, {bad[1]}]={w[tuple(bad)]} is not finite")
    if (w < 0).any():
        bad = np.argwhere(w < 0)[0]
        raise ValueError(f"weight[{bad[0]}, {bad[1]}]={w[tuple(bad)]} is negative")
    sums = w.sum(axis=1, dtype=np.float64)
    if (sums > _MAX_ROW_SUM).any():
        l = int(np.argmax(sums))
        raise ValueError(f"weight: layer {l} sums to {sums[l]:.3e}, beyond the float32 range of pack loads")
    return np.ascontiguousarray(w)


def validate_shape(
    num_layers: int, num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> EPLBShape:
    """Check the solver's divisibility contract; errors name the argument and its value.

    The policy is hierarchical iff ``num_groups % num_nodes == 0`` (that is the source's switch, not an
    error). Like the source, ``num_groups`` must divide E only on the hierarchical path: the global
    policy runs with one group, so there any group count is accepted and ignored. Stricter than the
    source: ``num_nodes`` must divide ``num_gpus`` on both paths (the source documents it as a
    precondition but checks it only on the hierarchical path), because a node that does not tile the
    GPUs is a configuration error.
    """
    num_replicas = _check_int("num_replicas", num_replicas)
    num_groups = _check_int("num_groups", num_groups)
    num_nodes = _check_int("num_nodes", num_nodes)
    num_gpus = _check_int("num_gpus", num_gpus)
    hierarchical = num_groups % num_nodes == 0
    if hierarchical and num_experts % num_groups != 0:
        raise ValueError(
            f"num_groups={num_groups} must divide the number of logical experts E={num_experts} on the "
            f"hierarchical policy (chosen because num_groups is a multiple of num_nodes={num_nodes})"
        )
    if num_gpus % num_nodes != 0:
        raise ValueError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    if num_replicas % num_gpus != 0:
        raise ValueError(f"num_replicas={num_replicas} must be a multiple of num_gpus={num_gpus}")
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas={num_replicas} must be >= the number of logical experts E={num_experts}")
    return EPLBShape(
        num_layers=num_layers,
        num_experts=num_experts,
        num_replicas=num_replicas,
        num_groups=num_groups,
        num_nodes=num_nodes,
        num_gpus=num_gpus,
        hierarchical=hierarchical,
    )


# ------------------------------------------------------------------------------------ vectorised core
def _inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of permutations: perm [R, n] int64 -> inv [R, n] int64 with inv[r, perm[r, i]] = i."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1], dtype=np.int64), perm.shape), axis=1)
    return inv


def balanced_packing(
    weight: np.ndarray,
    num_packs: int,
    *,
    item_key: np.ndarray | None = None,
    num_keys: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Equal-cardinality greedy packing of every row at once (source ``balanced_packing``).

    weight: [R, n] float32, n divisible by ``num_packs``. Items go heaviest first (stable descending
    sort) to the lightest pack with room, lowest pack index on ties; one item per pack is the identity.
    item_key: optional [R, n] int64 in ``0..num_keys-1`` (the logical expert of each copy): when given,
    an item avoids packs that already hold its key while another pack with room does not (option (a)).
    Returns (pack_index [R, n] int64, rank_in_pack [R, n] int64).
    """
    w = np.asarray(weight, dtype=_F32)
    rows, n = w.shape
    if num_packs < 1 or n % num_packs != 0:
        raise ValueError(f"num_packs={num_packs} must divide the item count {n}")
    per_pack = n // num_packs
    # Step 1: the source's identity short-cut for one item per pack.
    if per_pack == 1:
        pack = np.broadcast_to(np.arange(n, dtype=np.int64), (rows, n)).copy()
        return pack, np.zeros((rows, n), dtype=np.int64)
    # Step 2: visit order, heaviest first, ties in index order; item weights laid out step-major.
    order = np.argsort(-w, axis=1, kind="stable")
    w_steps = np.ascontiguousarray(np.take_along_axis(w, order, axis=1).T)  # [n, R]
    load = np.zeros(rows * num_packs, dtype=_F32)  # flat [R * P]; inf marks a full pack
    load2d = load.reshape(rows, num_packs)
    filled = np.zeros(rows * num_packs, dtype=np.int64)
    base = np.arange(rows, dtype=np.int64) * num_packs
    pack_steps = np.empty((n, rows), dtype=np.int64)
    rank_steps = np.empty((n, rows), dtype=np.int64)
    avoid = item_key is not None
    if avoid:
        key_steps = np.ascontiguousarray(np.take_along_axis(np.asarray(item_key, dtype=np.int64), order, axis=1).T)
        holds = np.zeros((rows, num_packs, num_keys), dtype=bool)
        row_ids = np.arange(rows)
    # Step 3: one vectorised greedy step per item rank, all rows together.
    for j in range(n):
        if avoid:
            clash = holds[row_ids, :, key_steps[j]]  # [R, P]
            open_ok = np.isfinite(load2d) & ~clash
            clash &= open_ok.any(axis=1, keepdims=True)
            p = np.where(clash, np.inf, load2d).argmin(axis=1)
            holds[row_ids, p, key_steps[j]] = True
        else:
            p = load2d.argmin(axis=1)
        flat = base + p
        r = filled[flat]
        filled[flat] = r + 1
        load[flat] = np.where(r + 1 == per_pack, _F32(np.inf), load[flat] + w_steps[j])
        pack_steps[j] = p
        rank_steps[j] = r
    # Step 4: scatter back from visit order to item order.
    pack_index = np.empty((rows, n), dtype=np.int64)
    rank_in_pack = np.empty((rows, n), dtype=np.int64)
    np.put_along_axis(pack_index, order, pack_steps.T, axis=1)
    np.put_along_axis(rank_in_pack, order, rank_steps.T, axis=1)
    if avoid:
        _repair_duplicates(w, pack_index, rank_in_pack, np.asarray(item_key, dtype=np.int64), num_packs, num_keys)
    return pack_index, rank_in_pack


def _repair_duplicates(
    w: np.ndarray, pack: np.ndarray, rank: np.ndarray, key: np.ndarray, num_packs: int, num_keys: int
) -> None:
    """Remove same-pack duplicate keys left by the greedy pass, in place, where that is possible.

    w: [R, n] float32; pack, rank, key: [R, n] int64. A row can be made clash-free iff no key has more
    items than there are packs. Only rows that still clash are visited (rare: the greedy pass already
    avoids clashes whenever a clash-free pack has room).
    """
    rows, n = pack.shape
    # Step 1: rows with a clash that can be removed.
    flat = (np.arange(rows)[:, None] * num_packs + pack) * num_keys + key
    per_pack_key = np.bincount(flat.ravel(), minlength=rows * num_packs * num_keys).reshape(rows, num_packs, num_keys)
    clashing = (per_pack_key > 1).any(axis=(1, 2))
    feasible = per_pack_key.sum(axis=1).max(axis=1) <= num_packs
    for r in np.flatnonzero(clashing & feasible):
        _repair_row(w[r].astype(np.float64), pack[r], rank[r], key[r], num_packs)


def _repair_row(w: np.ndarray, pack: np.ndarray, rank: np.ndarray, key: np.ndarray, num_packs: int) -> None:
    """One row of :func:`_repair_duplicates`: swap a clashing copy with an item of another pack (the swap
    with the lowest resulting max of the two pack loads); fall back to a round-robin deal."""
    n = pack.shape[0]
    while True:
        # Step 1: find the first (pack, key) holding two items.
        members = [np.flatnonzero(pack == p) for p in range(num_packs)]
        keys_in = [set(key[m].tolist()) for m in members]
        clash = None
        for p in range(num_packs):
            ks = key[members[p]]
            if len(set(ks.tolist())) < len(ks):
                vals, counts = np.unique(ks, return_counts=True)
                clash = (p, int(vals[np.argmax(counts > 1)]))
                break
        if clash is None:
            return
        p, e = clash
        mover = int(members[p][key[members[p]] == e][-1])
        loads = np.array([w[m].sum() for m in members])
        # Step 2: best swap partner in a pack without key e whose key is absent from pack p.
        best, best_score = None, math.inf
        for p2 in range(num_packs):
            if p2 == p or e in keys_in[p2]:
                continue
            for x in members[p2]:
                if int(key[x]) in keys_in[p]:
                    continue
                score = max(loads[p] - w[mover] + w[x], loads[p2] - w[x] + w[mover])
                if score < best_score:
                    best, best_score = int(x), score
        if best is None:
            break
        # Step 3: swap pack and in-pack rank.
        pack[mover], pack[best] = pack[best], pack[mover]
        rank[mover], rank[best] = rank[best], rank[mover]
    # Step 4: last resort, clash-free by construction: deal round-robin with the copies of each key
    # adjacent (keys by heaviest copy first), so the <= num_packs copies of a key land in distinct packs.
    key_max = np.zeros(int(key.max()) + 1)
    np.maximum.at(key_max, key, w)
    order = np.lexsort((np.arange(n), -w, key, -key_max[key]))
    slots = np.arange(n)
    pack[order] = slots % num_packs
    rank[order] = slots // num_packs


def replicate_experts(weight: np.ndarray, num_phy: int,
                      min_count: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy replication of every row at once (source ``replicate_experts``, spec 0x08B).

    weight: [R, n_log] float32. Each redundant slot goes to ``argmax_e weight / count`` (float32,
    first index on ties). Returns (phy2log [R, num_phy], rank [R, num_phy], logcnt [R, n_log]), int64.

    min_count: optional [R, n_log] int replica floors (values <= 1 mean none). The first redundant slots
    of a row then bring every floored expert up to its floor (experts in index order), and the greedy
    step hands out the rest starting from those counts. With no floor above 1 the result is the
    source's, bit for bit. Raises ValueError naming the row, the experts and their floors when the
    floors need more than ``num_phy`` slots.
    """
    w = np.asarray(weight, dtype=_F32)
    if w.ndim != 2:
        raise ValueError(f"weight must be [R, n_log], got shape {tuple(w.shape)}")
    rows, n_log = w.shape
    if num_phy < n_log:
        raise ValueError(f"num_phy={num_phy} is smaller than the expert count {n_log}")
    forced, n_forced = _floor_copies(min_count, rows, n_log, num_phy)
    phy2log = np.empty((rows, num_phy), dtype=np.int64)
    phy2log[:, :n_log] = np.arange(n_log)
    rank = np.zeros((rows, num_phy), dtype=np.int64)
    logcnt = np.ones((rows, n_log), dtype=np.int64)
    ratio = w.copy()  # w / 1, exactly
    row_ids = np.arange(rows)
    # Step 1: one argmax per redundant slot over all rows; only the chosen column's ratio changes.
    # Rows with floors first take their forced copies (the argmax is ignored there).
    for slot in range(n_log, num_phy):
        e = ratio.argmax(axis=1)
        j = slot - n_log
        if j < forced.shape[1]:
            e = np.where(j < n_forced, forced[:, j], e)
        c = logcnt[row_ids, e]
        phy2log[:, slot] = e
        rank[:, slot] = c
        logcnt[row_ids, e] = c + 1
        ratio[row_ids, e] = w[row_ids, e] / (c + 1).astype(_F32)
    return phy2log, rank, logcnt


def _floor_copies(min_count: np.ndarray | None, rows: int, n_log: int,
                  num_phy: int) -> tuple[np.ndarray, np.ndarray]:
    """The copies replica floors force, per row: (expert ids [R, width] padded with -1, count [R])."""
    if min_count is None:
        return np.zeros((rows, 0), dtype=np.int64), np.zeros(rows, dtype=np.int64)
    floor = np.asarray(min_count)
    if floor.shape != (rows, n_log):
        raise ValueError(f"min_count must be [R={rows}, n_log={n_log}], got shape {tuple(floor.shape)}")
    extra = np.maximum(floor.astype(np.int64), 1) - 1
    total = extra.sum(axis=1)
    over = np.flatnonzero(n_log + total > num_phy)
    if over.size:
        r = int(over[0])
        named = ", ".join(f"expert {e} >= {int(floor[r, e])}" for e in np.flatnonzero(extra[r]))
        raise ValueError(f"min_count: replica floors of row {r} ({named}) need {n_log + int(total[r])} slots for "
                         f"{n_log} experts, but only {num_phy} physical slots exist")
    width = int(total.max()) if rows else 0
    forced = np.full((rows, width), -1, dtype=np.int64)
    for r in np.flatnonzero(total):
        forced[r, : total[r]] = np.repeat(np.arange(n_log, dtype=np.int64), extra[r])
    return forced, total


def solve_layers(
    w: np.ndarray,
    shape: EPLBShape,
    avoid_duplicates: bool,
    groups_to_nodes: tuple[np.ndarray, np.ndarray] | None = None,
    min_replicas: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Source ``rebalance_experts_hierarchical`` for all layers at once (global = one group, one node).

    w: [L, E] float32. groups_to_nodes: optional (group_node, group_rank) [L, G] int64 replacing
    stage 1 (used by the migration option to keep the current group-to-node map).
    min_replicas: optional [L, E] int64 replica floors (see :func:`replicate_experts`); None or all <= 1
    is the source's solve. A floor that does not fit the slots of its node raises ValueError naming the
    layer, node, experts and floors.
    Returns (phy2log [L, Q], phyrank [L, Q], logcnt [L, E]), int64.
    """
    L, E, Q = shape.num_layers, shape.num_experts, shape.num_replicas
    groups, nodes, gsize = shape.groups, shape.nodes, shape.group_size
    experts_per_node, phy_per_node = E // nodes, Q // nodes
    # Step 1: pack contiguous groups to nodes (group loads summed left to right in float32);
    # "mlog" numbers the experts node by node, groups in pack-rank order.
    if groups_to_nodes is None:
        group_load = np.cumsum(w.reshape(L, groups, gsize), axis=2, dtype=_F32)[:, :, -1]
        group_node, group_rank = balanced_packing(group_load, nodes)
    else:
        group_node, group_rank = groups_to_nodes
    log2mlog = (((group_node * (groups // nodes) + group_rank) * gsize)[:, :, None] + np.arange(gsize)).reshape(L, E)
    mlog2log = _inverse_permutation(log2mlog)
    # Step 2: replicate inside each node: rows are (layer, node).
    w_mlog = np.take_along_axis(w, mlog2log, axis=1).reshape(L * nodes, experts_per_node)
    floor_mlog = None
    if min_replicas is not None and (np.asarray(min_replicas) > 1).any():
        floor = np.asarray(min_replicas, dtype=np.int64)
        floor_mlog = np.take_along_axis(floor, mlog2log, axis=1).reshape(L * nodes, experts_per_node)
        need = experts_per_node + (np.maximum(floor_mlog, 1) - 1).sum(axis=1)
        over = np.flatnonzero(need > phy_per_node)
        if over.size:
            l, n = divmod(int(over[0]), nodes)
            experts = mlog2log[l].reshape(nodes, experts_per_node)[n]
            named = ", ".join(f"expert {int(e)} >= {int(floor[l, e])}" for e in experts if floor[l, e] > 1)
            raise ValueError(
                f"min_replicas: layer {l} cannot meet the replica floors {named}: node {n} holds "
                f"{experts_per_node} experts and {phy_per_node} physical slots, the floors need {int(need[over[0]])}")
    phy2mlog, phyrank, mlogcnt = replicate_experts(w_mlog, phy_per_node, floor_mlog)
    # Step 3: pack each node's copies (weight W_e / m_e, float32) to the node's GPUs.
    copy_w = np.take_along_axis(w_mlog / mlogcnt.astype(_F32), phy2mlog, axis=1)
    key = phy2mlog if avoid_duplicates else None
    pack, pack_rank = balanced_packing(copy_w, shape.gpus_per_node, item_key=key, num_keys=experts_per_node)
    pphy2phy = _inverse_permutation(pack * shape.slots_per_gpu + pack_rank)
    # Step 4: undo the copy and group permutations.
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(L, nodes, phy_per_node)
    pphy2mlog = (pphy2mlog + (np.arange(nodes, dtype=np.int64) * experts_per_node)[None, :, None]).reshape(L, Q)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(L, Q)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, E), log2mlog, axis=1)
    return phy2log, pphyrank, logcnt


# --------------------------------------------------------------------------- maps and placement measures
def padded_inverse(phy2log: np.ndarray, phyrank: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """log2phy [L, E, M] int64 padded with -1, M = max logcnt (source lines 157-161)."""
    L, Q = phy2log.shape
    E = logcnt.shape[1]
    width = int(logcnt.max())
    log2phy = np.full((L, E * width), -1, dtype=np.int64)
    slot_ids = np.broadcast_to(np.arange(Q, dtype=np.int64), (L, Q))
    np.put_along_axis(log2phy, phy2log * width + phyrank, slot_ids, axis=1)
    return log2phy.reshape(L, E, width)


def ranks_in_slot_order(phy2log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica rank of each slot numbered in slot order, and the counts.

    phy2log: [L, Q] int64. Returns (phyrank [L, Q], logcnt [L, E]) int64.
    """
    L, Q = phy2log.shape
    order = np.argsort(phy2log, axis=1, kind="stable")
    sorted_e = np.take_along_axis(phy2log, order, axis=1)
    logcnt = expert_counts(phy2log, num_experts)
    starts = np.cumsum(logcnt, axis=1) - logcnt
    pos = np.arange(Q, dtype=np.int64)[None, :] - np.take_along_axis(starts, sorted_e, axis=1)
    phyrank = np.empty_like(pos)
    np.put_along_axis(phyrank, order, pos, axis=1)
    return phyrank, logcnt


def expert_counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """Copies per expert: phy2log [L, Q] -> [L, E] int64."""
    L = phy2log.shape[0]
    flat = (np.arange(L, dtype=np.int64)[:, None] * num_experts + phy2log).ravel()
    return np.bincount(flat, minlength=L * num_experts).reshape(L, num_experts)


def gpu_expert_counts(phy2log: np.ndarray, num_gpus: int, num_experts: int) -> np.ndarray:
    """Copies of each expert on each GPU: phy2log [L, Q] -> [L, P, E] int64."""
    L, Q = phy2log.shape
    gpu = np.arange(Q, dtype=np.int64) // (Q // num_gpus)
    flat = ((np.arange(L, dtype=np.int64)[:, None] * num_gpus + gpu[None, :]) * num_experts + phy2log).ravel()
    return np.bincount(flat, minlength=L * num_gpus * num_experts).reshape(L, num_gpus, num_experts)


def ideal_rank_loads(weight: Any, phy2log: Any, num_gpus: int) -> np.ndarray:
    """Ideal per-GPU loads (spec 0x08D): a copy of expert e carries ``W_e / m_e``.

    weight: [L, E] real; phy2log: [L, Q] int (every expert needs >= 1 copy). Returns [L, P] float64.
    """
    w = np.asarray(weight.detach().cpu() if isinstance(weight, torch.Tensor) else weight, dtype=np.float64)
    p2l = np.asarray(phy2log.detach().cpu() if isinstance(phy2log, torch.Tensor) else phy2log, dtype=np.int64)
    if w.ndim != 2 or p2l.ndim != 2 or w.shape[0] != p2l.shape[0]:
        raise ValueError(f"weight {tuple(w.shape)} and phy2log {tuple(p2l.shape)} must be [L, E] and [L, Q]")
    L, Q = p2l.shape
    if num_gpus < 1 or Q % num_gpus != 0:
        raise ValueError(f"num_gpus={num_gpus} must divide the slot count Q={Q}")
    counts = expert_counts(p2l, w.shape[1])
    if (counts == 0).any():
        l, e = np.argwhere(counts == 0)[0]
        raise ValueError(f"phy2log: logical expert {e} has no copy in layer {l}")
    per_copy = np.take_along_axis(w / counts, p2l, axis=1)
    return per_copy.reshape(L, num_gpus, Q // num_gpus).sum(axis=2)


def slots_changed(before: Any, after: Any) -> np.ndarray:
    """Physical slots whose logical expert differs: [L, Q] x [L, Q] -> [L] int64 (weights to move)."""
    a = np.asarray(before.cpu() if isinstance(before, torch.Tensor) else before)
    b = np.asarray(after.cpu() if isinstance(after, torch.Tensor) else after)
    if a.shape != b.shape:
        raise ValueError(f"before {tuple(a.shape)} and after {tuple(b.shape)} must have the same shape")
    return (a != b).sum(axis=1).astype(np.int64)
