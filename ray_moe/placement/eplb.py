"""Vectorised EPLB: expert replication and placement (spec 0x08B-0x08E, 0x08I-0x08K). Pure: no Ray.

:func:`rebalance_experts` reproduces the pinned public solver (deepseek-ai/EPLB ``eplb.py`` at
d52c72d5b2f2fb4c41afbf8eb21366820239913d) exactly, with every layer solved at once:

* ``balanced_packing`` is inherently sequential in the items (each choice depends on the pack loads
  so far), so it runs one numpy step per item *rank*, and each step serves all rows (layers, or
  layers x nodes) together: the k-th heaviest item of every row goes to its row's lightest pack that
  still has room. Full packs carry an ``inf`` load so one ``argmin`` (first index on ties) decides.
* ``replicate_experts`` runs one ``argmax`` step per redundant slot over all rows.

The arithmetic contract (float32 loads, left-to-right group sums, stable descending sort, first
index on ties) is written out in :mod:`ray_moe.testing.eplb_reference`, the loop-form oracle that
this module must match bit for bit. Against the public torch code itself, phy2log and logcnt agree
on tie-free loads; log2phy can differ in the *order* of one expert's copies when a node has more than
about 16 copies, because ``torch.sort`` is not stable there and copies of one expert always tie.

Two options go beyond the source; both are OFF by default and change nothing when off:

* ``avoid_same_gpu_duplicates``: while packing a node's physical copies to its GPUs, a copy never
  joins a GPU that already holds a copy of the same logical expert if another GPU with room does
  not; leftover clashes are repaired by load-aware swaps (and, as a last resort, a round-robin deal
  that is clash-free by construction) whenever ``logcnt[e] <= GPUs per placement domain``.
* migration-aware (``current_phy2log`` given): bound = ``(1 + migration_tolerance)`` x the plain
  solution's ideal max GPU load, per layer. A layer keeps its whole current placement if that is
  valid (every expert present, groups node-local) and in bound. Otherwise, in order: (hierarchical)
  re-solve under the current group-to-node map if that stays in bound; build two candidates with
  those replica counts, a load-neutral relabelling (permute nodes, GPUs inside a node, slots inside
  a GPU toward current) and a swap repair (start from current, fix the counts, swap copies between
  GPUs of a node until in bound); keep the one that changes fewer slots, never more than plain;
  finally revert single slots to their current expert while in bound. One vectorised step per slot
  or per swap over all layers. Replica ranks are then numbered in slot order. Tens of milliseconds on
  the target shape: a control-plane cost paid once per rebalance, to save weight transfers.

Loads here are the ideal coordinate of spec 0x08D: a copy of expert ``e`` carries ``W_e / m_e``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch

_F32 = np.float32
_MAX_ROW_SUM = 1e38  # pack loads are float32 sums; keep them finite
_BOUND_SLACK = 1e-12  # relative slack for float64 load comparisons in the migration pass


class EPLBResult(NamedTuple):
    """Output of :func:`rebalance_experts` (CPU torch tensors, int64).

    phy2log: [L, Q] logical expert of each physical slot; slot q lives on GPU q // (Q / num_gpus).
    log2phy: [L, E, M] physical slots of each logical expert, padded with -1 (M = max logcnt over
        all layers). Only the first ``logcnt[l, e]`` entries of a row are slots (spec 0x08C3).
    logcnt: [L, E] number of physical copies of each logical expert (>= 1, sums to Q per layer).
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor


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


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy replication of every row at once (source ``replicate_experts``, spec 0x08B).

    weight: [R, n_log] float32. Each redundant slot goes to ``argmax_e weight / count`` (float32,
    first index on ties). Returns (phy2log [R, num_phy], rank [R, num_phy], logcnt [R, n_log]), int64.
    """
    w = np.asarray(weight, dtype=_F32)
    if w.ndim != 2:
        raise ValueError(f"weight must be [R, n_log], got shape {tuple(w.shape)}")
    rows, n_log = w.shape
    if num_phy < n_log:
        raise ValueError(f"num_phy={num_phy} is smaller than the expert count {n_log}")
    phy2log = np.empty((rows, num_phy), dtype=np.int64)
    phy2log[:, :n_log] = np.arange(n_log)
    rank = np.zeros((rows, num_phy), dtype=np.int64)
    logcnt = np.ones((rows, n_log), dtype=np.int64)
    ratio = w.copy()  # w / 1, exactly
    row_ids = np.arange(rows)
    # Step 1: one argmax per redundant slot over all rows; only the chosen column's ratio changes.
    for slot in range(n_log, num_phy):
        e = ratio.argmax(axis=1)
        c = logcnt[row_ids, e]
        phy2log[:, slot] = e
        rank[:, slot] = c
        logcnt[row_ids, e] = c + 1
        ratio[row_ids, e] = w[row_ids, e] / (c + 1).astype(_F32)
    return phy2log, rank, logcnt


def _solve(
    w: np.ndarray,
    shape: EPLBShape,
    avoid_duplicates: bool,
    groups_to_nodes: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Source ``rebalance_experts_hierarchical`` for all layers at once (global = one group, one node).

    w: [L, E] float32. groups_to_nodes: optional (group_node, group_rank) [L, G] int64 replacing
    stage 1 (used by the migration option to keep the current group-to-node map).
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
    phy2mlog, phyrank, mlogcnt = replicate_experts(w_mlog, phy_per_node)
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


def _padded_inverse(phy2log: np.ndarray, phyrank: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """log2phy [L, E, M] int64 padded with -1, M = max logcnt (source lines 157-161)."""
    L, Q = phy2log.shape
    E = logcnt.shape[1]
    width = int(logcnt.max())
    log2phy = np.full((L, E * width), -1, dtype=np.int64)
    slot_ids = np.broadcast_to(np.arange(Q, dtype=np.int64), (L, Q))
    np.put_along_axis(log2phy, phy2log * width + phyrank, slot_ids, axis=1)
    return log2phy.reshape(L, E, width)


def _ranks_in_slot_order(phy2log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica rank of each slot numbered in slot order, and the counts.

    phy2log: [L, Q] int64. Returns (phyrank [L, Q], logcnt [L, E]) int64.
    """
    L, Q = phy2log.shape
    order = np.argsort(phy2log, axis=1, kind="stable")
    sorted_e = np.take_along_axis(phy2log, order, axis=1)
    logcnt = _counts(phy2log, num_experts)
    starts = np.cumsum(logcnt, axis=1) - logcnt
    pos = np.arange(Q, dtype=np.int64)[None, :] - np.take_along_axis(starts, sorted_e, axis=1)
    phyrank = np.empty_like(pos)
    np.put_along_axis(phyrank, order, pos, axis=1)
    return phyrank, logcnt


def _counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """Copies per expert: phy2log [L, Q] -> [L, E] int64."""
    L = phy2log.shape[0]
    flat = (np.arange(L, dtype=np.int64)[:, None] * num_experts + phy2log).ravel()
    return np.bincount(flat, minlength=L * num_experts).reshape(L, num_experts)


def _gpu_expert_counts(phy2log: np.ndarray, num_gpus: int, num_experts: int) -> np.ndarray:
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
    counts = _counts(p2l, w.shape[1])
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


# -------------------------------------------------------------------------------- migration awareness
def _greedy_assignment(score: np.ndarray) -> np.ndarray:
    """Greedy max-score perfect matching per row: score [R, k, k] -> perm [R, k] (new i -> old perm[i]).

    Takes the largest remaining score (first index on ties) k times; then keeps the identity in rows
    where that scores at least as much.
    """
    R, k, _ = score.shape
    s = score.astype(np.float64)
    perm = np.empty((R, k), dtype=np.int64)
    row_ids = np.arange(R)
    for _ in range(k):
        flat = s.reshape(R, k * k).argmax(axis=1)
        i, j = flat // k, flat % k
        perm[row_ids, i] = j
        s[row_ids, i, :] = -np.inf
        s[row_ids, :, j] = -np.inf
    greedy_total = np.take_along_axis(score, perm[:, :, None], axis=2)[:, :, 0].sum(axis=1)
    ident_total = np.trace(score, axis1=1, axis2=2)
    perm[ident_total >= greedy_total] = np.arange(k)
    return perm


def _node_matching(cnt_new: np.ndarray, cnt_old: np.ndarray) -> np.ndarray:
    """Which current node each new node takes over, by node-level multiset overlap.

    cnt_new, cnt_old: [L, N, gpn, E] copies per GPU. Returns node_perm [L, N] int64.
    """
    L, N = cnt_new.shape[:2]
    if N == 1:
        return np.zeros((L, 1), dtype=np.int64)
    node_new, node_old = cnt_new.sum(axis=2), cnt_old.sum(axis=2)
    return _greedy_assignment(np.minimum(node_new[:, :, None, :], node_old[:, None, :, :]).sum(axis=3))


def _align_slots(items: np.ndarray, current: np.ndarray, num_experts: int) -> np.ndarray:
    """Order each GPU's slots so that every current slot whose expert the GPU still holds keeps it.

    items: [L, P, spg] experts per GPU (order irrelevant); current: [L, P, spg]. Returns [L, P, spg]
    with the same per-GPU multisets as ``items`` and the largest possible number of slots equal to
    ``current`` (sum over experts of min(new count, current count)).
    """
    L, P, spg = items.shape
    E = num_experts
    # Step 1: mark the current slots that can stay.
    total = _gpu_expert_counts(items.reshape(L, P * spg), P, E).reshape(L * P * E)
    remaining = total.copy()
    lp = (np.arange(L * P, dtype=np.int64) * E).reshape(L, P)
    kept = np.zeros((L, P, spg), dtype=bool)
    for s in range(spg):
        idx = lp + current[:, :, s]
        k = remaining[idx] > 0
        remaining[idx] -= k
        kept[:, :, s] = k
    # Step 2: mark the items those kept slots use up.
    budget = total - remaining
    used = np.zeros((L, P, spg), dtype=bool)
    for s in range(spg):
        idx = lp + items[:, :, s]
        u = budget[idx] > 0
        budget[idx] -= u
        used[:, :, s] = u
    # Step 3: the unused items fill the other slots in order (both lists have the same length).
    free_pos = np.argsort(kept, axis=2, kind="stable")
    unused = np.argsort(used, axis=2, kind="stable")
    out = current.copy()
    np.put_along_axis(out, free_pos, np.take_along_axis(items, unused, axis=2), axis=2)
    return np.where(kept, current, out)


def _relabel_to_current(plain: np.ndarray, current: np.ndarray, shape: EPLBShape) -> np.ndarray:
    """Load-neutral: permute nodes, GPUs inside a node and slots inside a GPU toward current.

    plain, current: [L, Q] int64. Returns [L, Q] int64 whose GPU loads are a permutation of plain's.
    """
    L, Q, E = shape.num_layers, shape.num_replicas, shape.num_experts
    P, N, spg = shape.num_gpus, shape.nodes, shape.slots_per_gpu
    gpn = P // N
    cnt_new = _gpu_expert_counts(plain, P, E).astype(np.int16).reshape(L, N, gpn, E)
    cnt_old = _gpu_expert_counts(current, P, E).astype(np.int16).reshape(L, N, gpn, E)
    # Step 1: nodes (blocks of GPUs).
    node_perm = _node_matching(cnt_new, cnt_old)
    old_by_target = np.take_along_axis(cnt_old, node_perm[:, :, None, None], axis=1)  # [L, N, gpn, E]
    # Step 2: GPUs inside each matched node pair, by GPU-level multiset overlap.
    gpu_score = np.zeros((L, N, gpn, gpn), dtype=np.int64)
    for i in range(gpn):  # bounded memory: one new GPU at a time
        gpu_score[:, :, i, :] = np.minimum(cnt_new[:, :, i, None, :], old_by_target).sum(axis=3)
    gpu_perm = _greedy_assignment(gpu_score.reshape(L * N, gpn, gpn)).reshape(L, N, gpn)
    target_gpu = (node_perm[:, :, None] * gpn + gpu_perm).reshape(L, P)  # new GPU -> current GPU
    # Step 3: move each new GPU's slots to its target GPU, then align slots inside GPUs.
    items = np.empty((L, P, spg), dtype=np.int64)
    np.put_along_axis(items, target_gpu[:, :, None], plain.reshape(L, P, spg), axis=1)
    return _align_slots(items, current.reshape(L, P, spg), E).reshape(L, Q)


def _swap_repair(plain: np.ndarray, current: np.ndarray, W: np.ndarray, bound: np.ndarray, shape: EPLBShape,
                 avoid: bool) -> np.ndarray:
    """Start from the current placement, repair it to plain's replica counts and node
    contents, then swap copies between GPUs of a node until every GPU load is within ``bound``.

    plain, current: [L, Q] int64; W: [L, E] float64; bound: [L] float64. Rows below are (layer, node).
    Returns [L, Q] int64; rows whose local search gets stuck may stay above ``bound`` (the caller
    checks). Swaps stay inside a node, so group locality holds.
    """
    L, Q, E = shape.num_layers, shape.num_replicas, shape.num_experts
    P, N, spg = shape.num_gpus, shape.nodes, shape.slots_per_gpu
    gpn, qpn = P // N, Q // N
    R = L * N
    rows = np.arange(R)
    layer_of_row = np.repeat(np.arange(L), N)
    node_perm = _node_matching(_gpu_expert_counts(plain, P, E).reshape(L, N, gpn, E),
                               _gpu_expert_counts(current, P, E).reshape(L, N, gpn, E))
    # Step 1: row (l, a) works in the slots of current node node_perm[l, a] and must end up holding
    # plain node a's multiset of copies.
    cur = np.take_along_axis(current.reshape(L, N, qpn), node_perm[:, :, None], axis=1).reshape(R, qpn)
    need = _counts(plain.reshape(R, qpn), E)  # [R, E]
    occurrence, _ = _ranks_in_slot_order(cur, E)
    kept = occurrence < np.take_along_axis(need, cur, axis=1)
    leftover = need - _counts(np.where(kept, cur, E), E + 1)[:, :E]  # [R, E] copies still to place
    copy_w = (W / _counts(plain, E))[layer_of_row]  # [R, E] per-copy load with plain's counts
    items = np.where(kept, cur, -1)
    load = np.where(kept, np.take_along_axis(copy_w, cur, axis=1), 0.0).reshape(R, gpn, spg).sum(axis=2)
    # Step 2: place the leftover copies heaviest first, each into the lightest GPU with a free slot.
    n_left = leftover.sum(axis=1)
    if n_left.max() > 0:
        flat_e = np.repeat(np.tile(np.arange(E), R), leftover.ravel())
        flat_r = np.repeat(rows, n_left)
        order = np.lexsort((-copy_w[flat_r, flat_e], flat_r))
        flat_e, flat_r = flat_e[order], flat_r[order]
        start = np.cumsum(n_left) - n_left
        col = np.arange(flat_e.size) - start[flat_r]
        queue = np.full((R, int(n_left.max())), -1, dtype=np.int64)
        queue[flat_r, col] = flat_e
        free_list = np.argsort(kept.reshape(R, gpn, spg), axis=2, kind="stable")  # free positions first
        free_cnt = (~kept).reshape(R, gpn, spg).sum(axis=2)
        fill = np.zeros((R, gpn), dtype=np.int64)
        holds = _gpu_expert_counts(np.where(items >= 0, items, E), gpn, E + 1) if avoid else None
        for j in range(queue.shape[1]):
            e = queue[:, j]
            live = e >= 0
            open_load = np.where(fill < free_cnt, load, np.inf)
            if avoid:
                clash = holds[rows, :, np.maximum(e, 0)] > 0
                clash &= (np.isfinite(open_load) & ~clash).any(axis=1, keepdims=True)
                open_load = np.where(clash, np.inf, open_load)
                holds[rows[live], open_load[live].argmin(axis=1), e[live]] += 1
            p = open_load.argmin(axis=1)
            slot = p * spg + free_list[rows, p, np.minimum(fill[rows, p], spg - 1)]
            r = rows[live]
            items[r, slot[live]] = e[live]
            load[r, p[live]] += copy_w[r, e[live]]
            fill[r, p[live]] += 1
    # Step 3: local search; each step swaps two copies between the heaviest GPU and another GPU.
    item_w = np.take_along_axis(copy_w, items, axis=1)
    gpu_of = np.arange(qpn) // spg
    row_bound = np.repeat(bound, N)
    gpu_cnt = _gpu_expert_counts(items, gpn, E) if avoid else None
    stuck = np.zeros(R, dtype=bool)
    for _ in range(4 * qpn):
        live = ~stuck & (load.max(axis=1) > row_bound)
        if not live.any():
            break
        r = rows[live]
        h = load[r].argmax(axis=1)
        xs = h[:, None] * spg + np.arange(spg)  # [r, spg] slots on the heaviest GPU
        wx = item_w[r[:, None], xs]
        wy = item_w[r]  # [r, qpn]
        lh = load[r, h][:, None, None]
        lg = load[r][:, gpu_of][:, None, :]
        d = wx[:, :, None] - wy[:, None, :]  # load the heaviest GPU sheds
        score = np.maximum(lh - d, lg + d)
        ok = (gpu_of[None, None, :] != h[:, None, None]) & (score < lh)
        ex, ey = items[r[:, None], xs], items[r]
        if avoid:
            on_g = gpu_cnt[r[:, None, None], gpu_of[None, None, :], ex[:, :, None]] > 0
            on_h = gpu_cnt[r[:, None, None], h[:, None, None], ey[:, None, :]] > 0
            ok &= (ex[:, :, None] == ey[:, None, :]) | (~on_g & ~on_h)
        cx, cy = cur[r[:, None], xs], cur[r]
        lost = (ex == cx)[:, :, None].astype(np.int64) + (ey == cy)[:, None, :]
        gained = (ey[:, None, :] == cx[:, :, None]).astype(np.int64) + (ex[:, :, None] == cy[:, None, :])
        extra_moves = lost - gained
        fixes = ok & (score <= row_bound[r][:, None, None])
        rank_fix = np.where(fixes, extra_moves + score / (2.0 * lh), np.inf).reshape(len(r), -1)
        rank_any = np.where(ok, score, np.inf).reshape(len(r), -1)
        any_fix = np.isfinite(rank_fix).any(axis=1)
        best = np.where(any_fix, rank_fix.argmin(axis=1), rank_any.argmin(axis=1))
        found = any_fix | np.isfinite(rank_any).any(axis=1)
        stuck[r[~found]] = True
        r, h, best = r[found], h[found], best[found]
        x = h * spg + best // qpn
        y = best % qpn
        g = gpu_of[y]
        dx = item_w[r, x] - item_w[r, y]
        load[r, h] -= dx
        load[r, g] += dx
        if avoid:
            gpu_cnt[r, h, items[r, x]] -= 1
            gpu_cnt[r, g, items[r, y]] -= 1
            gpu_cnt[r, h, items[r, y]] += 1
            gpu_cnt[r, g, items[r, x]] += 1
        items[r, x], items[r, y] = items[r, y], items[r, x].copy()
        item_w[r, x], item_w[r, y] = item_w[r, y], item_w[r, x].copy()
    # Step 4: write each row back into its current node's slots.
    out = np.empty((L, N, qpn), dtype=np.int64)
    np.put_along_axis(out, node_perm[:, :, None], items.reshape(L, N, qpn), axis=1)
    return out.reshape(L, Q)


def _group_local(phy2log: np.ndarray, shape: EPLBShape) -> np.ndarray:
    """Per layer: every expert group sits on one node (hierarchical contract). [L, Q] -> [L] bool."""
    if not shape.hierarchical:
        return np.ones(shape.num_layers, dtype=bool)
    L, Q, G = shape.num_layers, shape.num_replicas, shape.num_groups
    node = np.broadcast_to((np.arange(Q) // shape.slots_per_gpu) // shape.gpus_per_node, (L, Q))
    grp = phy2log // shape.group_size
    rows = np.broadcast_to(np.arange(L)[:, None], (L, Q))
    lo = np.full((L, G), shape.num_nodes, dtype=np.int64)
    hi = np.full((L, G), -1, dtype=np.int64)
    np.minimum.at(lo, (rows, grp), node)
    np.maximum.at(hi, (rows, grp), node)
    return ((lo == hi) | (hi < 0)).all(axis=1)


def _revert_slots(
    out: np.ndarray, current: np.ndarray, W: np.ndarray, bound: np.ndarray, shape: EPLBShape, avoid: bool
) -> np.ndarray:
    """Give single slots back to their current expert while the max GPU load stays within ``bound``.

    out, current: [L, Q] int64; W: [L, E] float64; bound: [L]. One vectorised step per slot over all
    layers. Changes replica counts (never below one copy), keeps group locality and, with ``avoid``,
    never puts a second copy of an expert on a GPU.
    """
    L, Q, E = shape.num_layers, shape.num_replicas, shape.num_experts
    P, spg, gpn = shape.num_gpus, shape.slots_per_gpu, shape.gpus_per_node
    out = out.copy()
    counts = _counts(out, E)
    gpu_cnt = _gpu_expert_counts(out, P, E)
    loads = ideal_rank_loads(W, out, P)
    rows = np.arange(L)
    group_node = None
    if shape.hierarchical:
        group_node = np.empty((L, shape.num_groups), dtype=np.int64)
        slot_node = (np.arange(Q) // spg) // gpn
        group_node[rows[:, None], out // shape.group_size] = slot_node[None, :]
    for q in range(Q):
        a, b, g = out[:, q].copy(), current[:, q], q // spg
        ma, mb = counts[rows, a], counts[rows, b]
        cand = (a != b) & (ma >= 2)
        if group_node is not None:
            cand &= group_node[rows, b // shape.group_size] == g // gpn
        if avoid:
            cand &= gpu_cnt[rows, g, b] == 0
        if not cand.any():
            continue
        ca = gpu_cnt[rows, :, a].astype(np.float64)
        cb = gpu_cnt[rows, :, b].astype(np.float64)
        here = np.zeros(P)
        here[g] = 1.0
        wa, wb = W[rows, a][:, None], W[rows, b][:, None]
        fa, fb = ma[:, None].astype(np.float64), mb[:, None].astype(np.float64)
        new = (loads - ca * wa / fa + (ca - here) * wa / np.maximum(fa - 1.0, 1.0)
               - cb * wb / fb + (cb + here) * wb / (fb + 1.0))
        ok = cand & (new.max(axis=1) <= bound)
        if not ok.any():
            continue
        r = rows[ok]
        out[r, q] = b[ok]
        counts[r, a[ok]] -= 1
        counts[r, b[ok]] += 1
        gpu_cnt[r, g, a[ok]] -= 1
        gpu_cnt[r, g, b[ok]] += 1
        loads[r] = new[ok]
    return out


def _current_group_map(current: np.ndarray, shape: EPLBShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The current group-to-node map in stage-1 form, where current is group-local with equal groups
    per node. current: [L, Q]. Returns (usable [L] bool, group_node [L, G], group_rank [L, G]) int64."""
    L, Q, G, N = shape.num_layers, shape.num_replicas, shape.num_groups, shape.num_nodes
    node_of_slot = (np.arange(Q) // shape.slots_per_gpu) // shape.gpus_per_node
    group_node = np.zeros((L, G), dtype=np.int64)
    group_node[np.arange(L)[:, None], current // shape.group_size] = node_of_slot[None, :]
    per_node = np.stack([(group_node == n).sum(axis=1) for n in range(N)], axis=1)
    usable = (_counts(current, shape.num_experts) >= 1).all(axis=1) & _group_local(current, shape)
    usable &= (per_node == G // N).all(axis=1)
    group_node[~usable] = np.arange(G) // (G // N)
    order = np.argsort(group_node, axis=1, kind="stable")
    group_rank = np.empty_like(order)
    np.put_along_axis(group_rank, order, np.broadcast_to(np.arange(G) % (G // N), (L, G)), axis=1)
    return usable, group_node, group_rank


def _migration_aware(
    w: np.ndarray, plain: np.ndarray, current: np.ndarray, shape: EPLBShape, tolerance: float, avoid: bool
) -> np.ndarray:
    """Plain solution adjusted to keep copies where ``current`` has them (option (b)).

    w: [L, E] float32; plain, current: [L, Q] int64. Returns phy2log [L, Q] int64 whose ideal max GPU
    load is <= (1 + tolerance) x plain's (up to float64 rounding) and which changes no more slots of
    ``current`` than ``plain`` does; it keeps group locality on the hierarchical path and, with
    ``avoid``, adds no same-GPU duplicate where plain has none.
    """
    E, P = shape.num_experts, shape.num_gpus
    W = w.astype(np.float64)
    plain_max = ideal_rank_loads(W, plain, P).max(axis=1)
    bound = (1.0 + tolerance) * plain_max * (1.0 + _BOUND_SLACK)
    check = (1.0 + tolerance) * plain_max * (1.0 + 1e-9)
    plain_clean = _gpu_expert_counts(plain, P, E).max(axis=(1, 2)) <= 1

    def acceptable(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """In bound, and (with ``avoid``) duplicate-free where plain is; x: [L', Q] for layers ``rows``."""
        ok = ideal_rank_loads(W[rows], x, P).max(axis=1) <= check[rows]
        if avoid:
            ok &= (_gpu_expert_counts(x, P, E).max(axis=(1, 2)) <= 1) | ~plain_clean[rows]
        return ok

    def moved(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return (x != current[rows]).sum(axis=1)

    # Step 1: keep the whole current placement where it is valid (every expert present, group-local)
    # and in bound.
    out = current.copy()
    whole = (_counts(current, E) >= 1).all(axis=1) & _group_local(current, shape)
    if whole.any():
        whole[whole] = acceptable(current[whole], np.flatnonzero(whole))
    rest = np.flatnonzero(~whole)
    if rest.size == 0:
        return out
    sub = replace(shape, num_layers=int(rest.size))
    w_r, W_r, cur_r, plain_r, bound_r = w[rest], W[rest], current[rest], plain[rest], bound[rest]
    # Step 2 (hierarchical): solve under the current group-to-node map where that stays in bound.
    base_plain = plain_r
    if shape.hierarchical and shape.num_nodes > 1:
        usable, group_node, group_rank = _current_group_map(cur_r, sub)
        if usable.any():
            pinned, _, _ = _solve(w_r, sub, avoid, (group_node, group_rank))
            usable &= acceptable(pinned, rest)
            base_plain = np.where(usable[:, None], pinned, plain_r)
    # Step 3: two bases with those replica counts: load-neutral relabelling toward current, and swap
    # repair of the current placement; take the one that moves fewer slots, never more than plain.
    base = _relabel_to_current(base_plain, cur_r, sub)
    repaired = _swap_repair(base_plain, cur_r, W_r, bound_r, sub, avoid)
    take = acceptable(repaired, rest) & (moved(repaired, rest) < moved(base, rest))
    base = np.where(take[:, None], repaired, base)
    base = np.where((moved(base, rest) <= moved(plain_r, rest))[:, None], base, plain_r)
    # Step 4: single-slot reverts; a float-drift guard falls back to the base.
    reverted = _revert_slots(base, cur_r, W_r, bound_r, sub, avoid)
    drifted = ideal_rank_loads(W_r, reverted, P).max(axis=1) > check[rest]
    reverted[drifted] = base[drifted]
    out[rest] = reverted
    return out


def _as_current(current_phy2log: Any, shape: EPLBShape) -> np.ndarray:
    if isinstance(current_phy2log, torch.Tensor):
        cur = current_phy2log.detach().cpu().numpy()
    else:
        cur = np.asarray(current_phy2log)
    if cur.shape != (shape.num_layers, shape.num_replicas):
        raise ValueError(
            f"current_phy2log has shape {tuple(cur.shape)}, expected [L, Q] = "
            f"[{shape.num_layers}, {shape.num_replicas}]"
        )
    if not np.issubdtype(cur.dtype, np.integer):
        raise ValueError(f"current_phy2log must hold integer expert ids, got dtype {cur.dtype}")
    if cur.size and (cur.min() < 0 or cur.max() >= shape.num_experts):
        bad = cur.min() if cur.min() < 0 else cur.max()
        raise ValueError(f"current_phy2log holds expert id {bad} outside 0..{shape.num_experts - 1}")
    return cur.astype(np.int64)


# ------------------------------------------------------------------------------------------ entry point
def rebalance_experts(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    avoid_same_gpu_duplicates: bool = False,
    current_phy2log: Any = None,
    migration_tolerance: float = 0.0,
) -> EPLBResult:
    """EPLB entry point (source ``rebalance_experts``), vectorised over layers.

    weight: [L, E] load per layer and logical expert (torch tensor or array-like, >= 0, finite).
    num_replicas: Q physical slots per layer, a multiple of ``num_gpus`` and >= E.
    num_groups: expert groups (contiguous, E / num_groups experts each); hierarchical policy iff
        ``num_groups % num_nodes == 0`` (then it must divide E), else global (one group, one node;
        ``num_groups`` is then ignored and need not divide E).
    num_nodes, num_gpus: topology; ``num_gpus`` a multiple of ``num_nodes``.
    avoid_same_gpu_duplicates: option (a), see the module docstring. Off: the source's semantics.
    current_phy2log: [L, Q] int, the live placement; turns on option (b). None: the source's semantics.
    migration_tolerance: >= 0; allowed relative increase of the ideal max GPU load for keeping slots
        (used only with ``current_phy2log``).
    Returns EPLBResult(phy2log [L, Q], log2phy [L, E, M], logcnt [L, E]), int64 CPU tensors.
    """
    # Step 1: validate.
    w = as_load_matrix(weight)
    shape = validate_shape(w.shape[0], w.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    if not isinstance(avoid_same_gpu_duplicates, bool):
        raise ValueError(f"avoid_same_gpu_duplicates={avoid_same_gpu_duplicates!r} must be a bool")
    if isinstance(migration_tolerance, bool) or not isinstance(migration_tolerance, (int, float)):
        raise ValueError(f"migration_tolerance={migration_tolerance!r} must be a real number")
    if not math.isfinite(migration_tolerance) or migration_tolerance < 0:
        raise ValueError(f"migration_tolerance={migration_tolerance} must be finite and >= 0")
    current = None if current_phy2log is None else _as_current(current_phy2log, shape)
    # Step 2: the source's solve, all layers at once.
    phy2log, phyrank, logcnt = _solve(w, shape, avoid_same_gpu_duplicates)
    # Step 3: optional migration awareness; replica ranks are then numbered in slot order.
    if current is not None:
        phy2log = _migration_aware(w, phy2log, current, shape, float(migration_tolerance), avoid_same_gpu_duplicates)
        phyrank, logcnt = _ranks_in_slot_order(phy2log, shape.num_experts)
    # Step 4: padded inverse map.
    log2phy = _padded_inverse(phy2log, phyrank, logcnt)
    return EPLBResult(torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt))


def validate_result(result: EPLBResult) -> None:
    """Check that phy2log, log2phy and logcnt describe one placement (spec 0x08C3, 0x08K).

    phy2log [L, Q] ids in 0..E-1; logcnt [L, E] equals the copies counted in phy2log and is >= 1;
    log2phy [L, E, M] with M = max logcnt lists exactly the slots of each expert in its first
    logcnt entries and -1 after them. Raises ValueError naming the field.
    """
    phy2log, log2phy, logcnt = (np.asarray(t.cpu() if isinstance(t, torch.Tensor) else t) for t in result)
    if phy2log.ndim != 2 or logcnt.ndim != 2 or log2phy.ndim != 3:
        raise ValueError(
            f"result shapes phy2log {phy2log.shape}, log2phy {log2phy.shape}, logcnt {logcnt.shape} are not "
            "[L, Q], [L, E, M], [L, E]"
        )
    L, Q = phy2log.shape
    E = logcnt.shape[1]
    if logcnt.shape[0] != L or log2phy.shape[:2] != (L, E):
        raise ValueError(f"result: layer/expert dims disagree: phy2log {phy2log.shape}, log2phy {log2phy.shape}, "
                         f"logcnt {logcnt.shape}")
    if phy2log.min() < 0 or phy2log.max() >= E:
        raise ValueError(f"phy2log holds an expert id outside 0..{E - 1}")
    counts = _counts(phy2log.astype(np.int64), E)
    if not np.array_equal(counts, logcnt):
        l, e = np.argwhere(counts != logcnt)[0]
        raise ValueError(f"logcnt[{l}, {e}]={logcnt[l, e]} but phy2log has {counts[l, e]} copies")
    if (logcnt < 1).any():
        l, e = np.argwhere(logcnt < 1)[0]
        raise ValueError(f"logcnt[{l}, {e}]=0: every logical expert needs a physical copy")
    if log2phy.shape[2] != logcnt.max():
        raise ValueError(f"log2phy width {log2phy.shape[2]} != max logcnt {logcnt.max()}")
    valid = np.arange(log2phy.shape[2])[None, None, :] < logcnt[:, :, None]
    if (log2phy[~valid] != -1).any():
        raise ValueError("log2phy: padding past logcnt must be -1")
    slots = np.where(valid, log2phy, 0)
    if (slots < 0).any() or (slots >= Q).any():
        raise ValueError(f"log2phy holds a slot outside 0..{Q - 1} within logcnt")
    owner = np.take_along_axis(phy2log, slots.reshape(L, -1), axis=1).reshape(slots.shape)
    if (valid & (owner != np.arange(E)[None, :, None])).any():
        raise ValueError("log2phy lists a slot whose phy2log expert differs")
    seen = np.zeros((L, Q), dtype=np.int64)
    np.add.at(seen, (np.broadcast_to(np.arange(L)[:, None, None], slots.shape)[valid], slots[valid]), 1)
    if (seen != 1).any():
        raise ValueError("log2phy must list every physical slot exactly once")
