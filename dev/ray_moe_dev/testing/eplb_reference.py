"""Loop-form oracle of the pinned public EPLB solver (spec 0x08C-0x08E, 0x08J). Pure: no Ray, no torch.

This is the spec's "loop version" (0x08E): one layer at a time, one item at a time, plain Python
control flow over ``numpy.float32`` scalars. It is slow on purpose and exists to be read and to
check :mod:`ray_moe.placement.eplb`, which must agree with it exactly.

Semantics transcribed (deepseek-ai/EPLB ``eplb.py`` at d52c72d5b2f2fb4c41afbf8eb21366820239913d):

* ``balanced_packing``: items are visited in descending weight order; each goes to the lightest pack
  that still has room (every pack takes exactly ``n / num_packs`` items); among equally light packs
  the lowest pack index wins (Python ``min`` keeps the first minimum). With one item per pack the
  source short-cuts to ``pack = item index`` (no sorting), and so does this oracle.
* ``replicate_experts``: each redundant slot goes to ``argmax_e weight[e] / count[e]``, first index
  on ties (``torch.max`` along a dim returns the first maximal index); its replica rank is the
  expert's count before the increment.
* ``rebalance_experts_hierarchical``: pack contiguous expert groups to nodes, replicate inside each
  node, pack the node's physical copies (weight ``W_e / m_e``) to that node's GPUs.
* ``rebalance_experts``: hierarchical when ``num_groups % num_nodes == 0``, otherwise the same routine
  with one group and one node (global replication followed by GPU packing); ``log2phy`` is padded
  with ``-1`` to the largest replica count over all layers.

Arithmetic contract (shared with the vectorised solver, so both are bit-identical):

1. The load matrix is converted to float32 first, like the source's ``weight.float()``.
2. Group loads are summed left to right in float32. (The source uses ``torch.sum``, whose reduction
   order is implementation-defined; results differ only in the last bits, i.e. only on near-ties.)
3. Ratios ``w / count`` and copy weights ``W_e / m_e`` are float32 divisions; pack loads are float32
   sums in the order items arrive.
4. The descending sort is *stable*: equal weights keep ascending index order. ``torch.sort`` without
   ``stable=True`` is stable on CPU only for short rows (about 16 items); on longer rows its tie order
   is implementation-defined. On tie-free loads the two agree. Note that copies of one replicated
   expert always tie in stage 3; the tie order only permutes which copy's replica rank sits in which
   slot (``log2phy`` row order), never ``phy2log`` or ``logcnt``.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

F32 = np.float32


class ReferenceResult(NamedTuple):
    """Output of :func:`rebalance_experts_reference` (numpy, int64).

    phy2log: [L, Q] logical expert of each physical slot.
    log2phy: [L, E, M] physical slots of each logical expert, padded with -1 (M = max logcnt).
    logcnt: [L, E] number of physical copies of each logical expert.
    phyrank: [L, Q] replica rank of each physical slot among its expert's copies.
    """

    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    phyrank: np.ndarray


def _argsort_descending_stable(values: Sequence[np.float32]) -> list[int]:
    """Indices of ``values`` in descending order, equal values in ascending index order."""
    return sorted(range(len(values)), key=lambda i: -values[i])  # Python's sort is stable


def balanced_packing_row(weights: Sequence[np.float32], num_packs: int) -> tuple[list[int], list[int]]:
    """One row of the source's ``balanced_packing``.

    weights: [n] float32 item weights. Returns (pack_index [n], rank_in_pack [n]).
    """
    n = len(weights)
    if num_packs < 1 or n % num_packs != 0:
        raise ValueError(f"num_packs={num_packs} must divide the item count {n}")
    per_pack = n // num_packs
    # Step 1: one item per pack is the source's identity short-cut.
    if per_pack == 1:
        return list(range(n)), [0] * n
    pack_index = [-1] * n
    rank_in_pack = [-1] * n
    pack_load = [F32(0.0)] * num_packs
    pack_items = [0] * num_packs
    # Step 2: visit items heaviest first; each goes to the lightest pack with room (lowest index on ties).
    for item in _argsort_descending_stable(weights):
        best = -1
        for p in range(num_packs):
            if pack_items[p] >= per_pack:
                continue
            if best < 0 or pack_load[p] < pack_load[best]:
                best = p
        pack_index[item] = best
        rank_in_pack[item] = pack_items[best]
        pack_load[best] = F32(pack_load[best] + weights[item])
        pack_items[best] += 1
    return pack_index, rank_in_pack


def replicate_experts_row(weights: Sequence[np.float32], num_phy: int) -> tuple[list[int], list[int], list[int]]:
    """One row of the source's ``replicate_experts``.

    weights: [n_log] float32. Returns (phy2log [num_phy], rank [num_phy], logcnt [n_log]).
    """
    n_log = len(weights)
    if num_phy < n_log:
        raise ValueError(f"num_phy={num_phy} is smaller than the expert count {n_log}")
    phy2log = list(range(n_log)) + [-1] * (num_phy - n_log)
    rank = [0] * num_phy
    logcnt = [1] * n_log
    # Step 1: every redundant slot goes to the expert with the largest per-copy load (first index on ties).
    for slot in range(n_log, num_phy):
        best = 0
        best_ratio = F32(weights[0] / F32(logcnt[0]))
        for e in range(1, n_log):
            ratio = F32(weights[e] / F32(logcnt[e]))
            if ratio > best_ratio:
                best, best_ratio = e, ratio
        phy2log[slot] = best
        rank[slot] = logcnt[best]
        logcnt[best] += 1
    return phy2log, rank, logcnt


def _sum_f32(values: Sequence[np.float32]) -> np.float32:
    total = F32(0.0)
    for v in values:
        total = F32(total + v)
    return total


def rebalance_layer_hierarchical(
    weights: Sequence[np.float32], num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[list[int], list[int], list[int]]:
    """One layer of the source's ``rebalance_experts_hierarchical``.

    weights: [E] float32. Returns (phy2log [Q], phyrank [Q], logcnt [E]).
    """
    num_experts = len(weights)
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    phy_per_node = num_phy // num_nodes
    phy_per_gpu = num_phy // num_gpus
    gpus_per_node = num_gpus // num_nodes

    # Step 1: pack contiguous expert groups to nodes; "mlog" numbers experts node by node.
    group_load = [_sum_f32(weights[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    group_node, group_rank = balanced_packing_row(group_load, num_nodes)
    log2mlog = [0] * num_experts
    for e in range(num_experts):
        g, offset = divmod(e, group_size)
        log2mlog[e] = (group_node[g] * groups_per_node + group_rank[g]) * group_size + offset
    mlog2log = [0] * num_experts
    for e, m in enumerate(log2mlog):
        mlog2log[m] = e

    phy2log = [0] * num_phy
    phyrank = [0] * num_phy
    mlogcnt = [0] * num_experts
    for node in range(num_nodes):
        # Step 2: replicate the node's experts into the node's physical slots.
        local = [weights[mlog2log[node * experts_per_node + j]] for j in range(experts_per_node)]
        phy2local, rank, local_cnt = replicate_experts_row(local, phy_per_node)
        for j in range(experts_per_node):
            mlogcnt[node * experts_per_node + j] = local_cnt[j]
        # Step 3: pack the node's physical copies (weight W_e / m_e) to the node's GPUs.
        copy_weight = [F32(local[j] / F32(local_cnt[j])) for j in phy2local]
        pack, pack_rank = balanced_packing_row(copy_weight, gpus_per_node)
        for i in range(phy_per_node):
            slot = node * phy_per_node + pack[i] * phy_per_gpu + pack_rank[i]
            phy2log[slot] = mlog2log[node * experts_per_node + phy2local[i]]
            phyrank[slot] = rank[i]
    logcnt = [mlogcnt[log2mlog[e]] for e in range(num_experts)]
    return phy2log, phyrank, logcnt


def rebalance_experts_reference(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> ReferenceResult:
    """The source's ``rebalance_experts``, one layer at a time.

    weight: [L, E] load (any real dtype; converted to float32). The oracle checks only the source's
    own assertions, on the policy the source picks (ValueError where the source asserts): on the
    global path that is ``num_replicas % num_gpus == 0`` alone, so ``num_groups`` need not divide E
    there. :func:`ray_moe.placement.eplb.rebalance_experts` owns full validation.
    """
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be [L, E], got shape {tuple(w.shape)}")
    num_layers, num_experts = w.shape
    # Step 1: policy choice (source lines 150-156): the global policy is the hierarchical routine with
    # one group on one node, whatever num_groups was.
    if num_groups % num_nodes == 0:
        groups, nodes = num_groups, num_nodes
    else:
        groups, nodes = 1, 1
    # Step 2: the source's assertions in rebalance_experts_hierarchical (lines 90-95), as ValueErrors.
    if num_experts % groups != 0:
        raise ValueError(f"num_groups={groups} must divide the number of logical experts E={num_experts}")
    if num_gpus % nodes != 0:
        raise ValueError(f"num_gpus={num_gpus} must be a multiple of num_nodes={nodes}")
    if num_replicas % num_gpus != 0:
        raise ValueError(f"num_replicas={num_replicas} must be a multiple of num_gpus={num_gpus}")
    rows = [
        rebalance_layer_hierarchical(list(w[l]), num_replicas, groups, nodes, num_gpus) for l in range(num_layers)
    ]
    phy2log = np.array([r[0] for r in rows], dtype=np.int64).reshape(num_layers, num_replicas)
    phyrank = np.array([r[1] for r in rows], dtype=np.int64).reshape(num_layers, num_replicas)
    logcnt = np.array([r[2] for r in rows], dtype=np.int64).reshape(num_layers, num_experts)
    # Step 3: padded inverse map, width = the largest replica count over all layers.
    width = int(logcnt.max()) if logcnt.size else 0
    log2phy = np.full((num_layers, num_experts, width), -1, dtype=np.int64)
    for l in range(num_layers):
        for q in range(num_replicas):
            log2phy[l, phy2log[l, q], phyrank[l, q]] = q
    return ReferenceResult(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt, phyrank=phyrank)
