"""Migration-aware EPLB, option (b) of :func:`ray_moe.placement.eplb.rebalance_experts`. Pure: no Ray.

Given the live placement (``current_phy2log``), adjust the plain solution of
:mod:`ray_moe.placement.eplb_solver` so that fewer physical slots change expert, i.e. fewer expert
weights have to move. (Planning *how* the remaining moves happen is :mod:`ray_moe.placement.migration`.)

Bound = ``(1 + migration_tolerance)`` x the plain solution's ideal max GPU load, per layer. A layer
keeps its whole current placement if that is valid (every expert present, groups node-local) and in
bound. Otherwise, in order: (hierarchical) re-solve under the current group-to-node map if that stays
in bound; build two candidates with those replica counts, a load-neutral relabelling (permute nodes,
GPUs inside a node, slots inside a GPU toward current) and a swap repair (start from current, fix the
counts, swap copies between GPUs of a node until in bound); keep the one that changes fewer slots,
never more than plain; finally revert single slots to their current expert while in bound. One
vectorised step per slot or per swap over all layers. The entry point then numbers replica ranks in
slot order. Tens of milliseconds on the target shape: a control-plane cost paid once per rebalance,
to save weight transfers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ray_moe.placement.eplb_solver import (
    EPLBShape,
    expert_counts,
    gpu_expert_counts,
    ideal_rank_loads,
    ranks_in_slot_order,
    solve_layers,
)

_BOUND_SLACK = 1e-12  # relative slack for float64 load comparisons


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
    total = gpu_expert_counts(items.reshape(L, P * spg), P, E).reshape(L * P * E)
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
    cnt_new = gpu_expert_counts(plain, P, E).astype(np.int16).reshape(L, N, gpn, E)
    cnt_old = gpu_expert_counts(current, P, E).astype(np.int16).reshape(L, N, gpn, E)
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
                 avoid: np.ndarray) -> np.ndarray:
    """Start from the current placement, repair it to plain's replica counts and node
    contents, then swap copies between GPUs of a node until every GPU load is within ``bound``.

    plain, current: [L, Q] int64; W: [L, E] float64; bound: [L] float64; avoid: [L] bool, the layers
    where no copy may join another of its expert on a GPU. Rows below are (layer, node).
    Returns [L, Q] int64; rows whose local search gets stuck may stay above ``bound`` (the caller
    checks). Swaps stay inside a node, so group locality holds.
    """
    L, Q, E = shape.num_layers, shape.num_replicas, shape.num_experts
    P, N, spg = shape.num_gpus, shape.nodes, shape.slots_per_gpu
    gpn, qpn = P // N, Q // N
    R = L * N
    rows = np.arange(R)
    layer_of_row = np.repeat(np.arange(L), N)
    row_avoid = np.asarray(avoid, dtype=bool)[layer_of_row]  # [R]
    any_avoid = bool(row_avoid.any())
    node_perm = _node_matching(gpu_expert_counts(plain, P, E).reshape(L, N, gpn, E),
                               gpu_expert_counts(current, P, E).reshape(L, N, gpn, E))
    # Step 1: row (l, a) works in the slots of current node node_perm[l, a] and must end up holding
    # plain node a's multiset of copies.
    cur = np.take_along_axis(current.reshape(L, N, qpn), node_perm[:, :, None], axis=1).reshape(R, qpn)
    need = expert_counts(plain.reshape(R, qpn), E)  # [R, E]
    occurrence, _ = ranks_in_slot_order(cur, E)
    kept = occurrence < np.take_along_axis(need, cur, axis=1)
    leftover = need - expert_counts(np.where(kept, cur, E), E + 1)[:, :E]  # [R, E] copies still to place
    copy_w = (W / expert_counts(plain, E))[layer_of_row]  # [R, E] per-copy load with plain's counts
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
        holds = gpu_expert_counts(np.where(items >= 0, items, E), gpn, E + 1) if any_avoid else None
        for j in range(queue.shape[1]):
            e = queue[:, j]
            live = e >= 0
            open_load = np.where(fill < free_cnt, load, np.inf)
            if any_avoid:
                clash = (holds[rows, :, np.maximum(e, 0)] > 0) & row_avoid[:, None]
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
    gpu_cnt = gpu_expert_counts(items, gpn, E) if any_avoid else None
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
        if any_avoid:
            on_g = gpu_cnt[r[:, None, None], gpu_of[None, None, :], ex[:, :, None]] > 0
            on_h = gpu_cnt[r[:, None, None], h[:, None, None], ey[:, None, :]] > 0
            ok &= (ex[:, :, None] == ey[:, None, :]) | (~on_g & ~on_h) | ~row_avoid[r][:, None, None]
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
        if any_avoid:
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
    out: np.ndarray, current: np.ndarray, W: np.ndarray, bound: np.ndarray, shape: EPLBShape, avoid: np.ndarray,
    floor: np.ndarray | None = None,
) -> np.ndarray:
    """Give single slots back to their current expert while the max GPU load stays within ``bound``.

    out, current: [L, Q] int64; W: [L, E] float64; bound: [L]; floor: optional [L, E] replica floors.
    One vectorised step per slot over all layers. Changes replica counts (never below one copy, nor below
    an expert's floor), keeps group locality and, in the layers ``avoid`` ([L] bool) marks, never puts a
    second copy of an expert on a GPU.
    """
    L, Q, E = shape.num_layers, shape.num_replicas, shape.num_experts
    P, spg, gpn = shape.num_gpus, shape.slots_per_gpu, shape.gpus_per_node
    out = out.copy()
    counts = expert_counts(out, E)
    gpu_cnt = gpu_expert_counts(out, P, E)
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
        if floor is not None:
            cand &= ma > floor[rows, a]
        if group_node is not None:
            cand &= group_node[rows, b // shape.group_size] == g // gpn
        cand &= ~avoid | (gpu_cnt[rows, g, b] == 0)
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
    usable = (expert_counts(current, shape.num_experts) >= 1).all(axis=1) & _group_local(current, shape)
    usable &= (per_node == G // N).all(axis=1)
    group_node[~usable] = np.arange(G) // (G // N)
    order = np.argsort(group_node, axis=1, kind="stable")
    group_rank = np.empty_like(order)
    np.put_along_axis(group_rank, order, np.broadcast_to(np.arange(G) % (G // N), (L, G)), axis=1)
    return usable, group_node, group_rank


def migration_aware_phy2log(
    w: np.ndarray, plain: np.ndarray, current: np.ndarray, shape: EPLBShape, tolerance: float, avoid: bool,
    min_replicas: np.ndarray | None = None,
) -> np.ndarray:
    """Plain solution adjusted to keep copies where ``current`` has them (option (b)).

    w: [L, E] float32; plain, current: [L, Q] int64. Returns phy2log [L, Q] int64 whose ideal max GPU
    load is <= (1 + tolerance) x plain's (up to float64 rounding) and which changes no more slots of
    ``current`` than ``plain`` does; it keeps group locality on the hierarchical path and, with
    ``avoid``, adds no same-GPU duplicate where plain has none. With ``min_replicas`` ([L, E] floors,
    which ``plain`` meets) every candidate must keep each expert at or above its floor too.
    """
    floor = None
    if min_replicas is not None and (np.asarray(min_replicas) > 1).any():
        floor = np.asarray(min_replicas, dtype=np.int64)
    E, P = shape.num_experts, shape.num_gpus
    W = w.astype(np.float64)
    plain_max = ideal_rank_loads(W, plain, P).max(axis=1)
    bound = (1.0 + tolerance) * plain_max * (1.0 + _BOUND_SLACK)
    check = (1.0 + tolerance) * plain_max * (1.0 + 1e-9)
    plain_clean = gpu_expert_counts(plain, P, E).max(axis=(1, 2)) <= 1

    def acceptable(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """In bound, and (with ``avoid``) duplicate-free where plain is; x: [L', Q] for layers ``rows``."""
        ok = ideal_rank_loads(W[rows], x, P).max(axis=1) <= check[rows]
        if avoid:
            ok &= (gpu_expert_counts(x, P, E).max(axis=(1, 2)) <= 1) | ~plain_clean[rows]
        if floor is not None:
            ok &= (expert_counts(x, E) >= floor[rows]).all(axis=1)
        return ok

    def moved(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return (x != current[rows]).sum(axis=1)

    # Step 1: keep the whole current placement where it is valid (every expert present, group-local)
    # and in bound.
    out = current.copy()
    whole = (expert_counts(current, E) >= 1).all(axis=1) & _group_local(current, shape)
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
            pinned, _, _ = solve_layers(w_r, sub, avoid, (group_node, group_rank),
                                        None if floor is None else floor[rest])
            usable &= acceptable(pinned, rest)
            base_plain = np.where(usable[:, None], pinned, plain_r)
    # Step 3: two bases with those replica counts: load-neutral relabelling toward current, and swap
    # repair of the current placement; take the one that moves fewer slots, never more than plain.
    base = _relabel_to_current(base_plain, cur_r, sub)
    # The no-duplicate rule binds where plain is duplicate-free (``acceptable``'s test). Where plain itself needs
    # duplicates (an expert with more copies than GPUs) the repair runs both with the rule (it often balances
    # better) and without it (with it, the swaps can stall, which handed the layer to the relabelled plain:
    # most slots moved); per layer the acceptable one moving fewer slots wins, then the lower max GPU load.
    avoid_r = (avoid & plain_clean)[rest]
    strict = np.full(rest.size, bool(avoid))
    repaired = _swap_repair(base_plain, cur_r, W_r, bound_r, sub, strict)
    if (strict & ~avoid_r).any():
        relaxed = _swap_repair(base_plain, cur_r, W_r, bound_r, sub, avoid_r)
        ok_s, ok_r = acceptable(repaired, rest), acceptable(relaxed, rest)
        m_s, m_r = moved(repaired, rest), moved(relaxed, rest)
        l_s, l_r = (ideal_rank_loads(W_r, x, P).max(axis=1) for x in (repaired, relaxed))
        better = ok_r & (~ok_s | (m_r < m_s) | ((m_r == m_s) & (l_r < l_s)))
        repaired = np.where(better[:, None], relaxed, repaired)
    take = acceptable(repaired, rest) & (moved(repaired, rest) < moved(base, rest))
    base = np.where(take[:, None], repaired, base)
    base = np.where((moved(base, rest) <= moved(plain_r, rest))[:, None], base, plain_r)
    # Step 4: single-slot reverts; a float-drift guard falls back to the base.
    reverted = _revert_slots(base, cur_r, W_r, bound_r, sub, avoid_r, None if floor is None else floor[rest])
    drifted = ideal_rank_loads(W_r, reverted, P).max(axis=1) > check[rest]
    reverted[drifted] = base[drifted]
    out[rest] = reverted
    return out


def as_current_placement(current_phy2log: Any, shape: EPLBShape) -> np.ndarray:
    """The live placement as [L, Q] int64 numpy; raises ValueError naming ``current_phy2log`` for a wrong
    shape, a non-integer dtype or an expert id outside ``0..E-1``."""
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
