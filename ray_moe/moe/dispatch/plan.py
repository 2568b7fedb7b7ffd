"""Dispatch planning: counts, offsets, permutations and their inverses (spec 0x03B-0x03C3, 0x07B).

Pure and vectorised (torch ops only, no per-route Python loops). Works on CPU and CUDA tensors.

Source side (rank p):
  1. destination rank / peer slot of every route from its physical slot
  2. stable sort by (destination peer, physical slot, semantic position)  -> send order
  3. split vector = per-peer counts (zero-count peers kept), offsets = exclusive prefix + sentinel
Destination side (rank u), after the count agreement:
  4. stable sort received rows by (local slot index) -> (slot, source, send position) order
  5. local expert counts and offsets in the manifest's local slot order
Return path: the inverse composition pi_s^-1 . pi_x^-1 . pi_e^-1 (spec 0x03C3).
"""

from __future__ import annotations

import torch

from ray_moe.moe.dispatch.records import ReceivePlan, SourcePlan
from ray_moe.core.routes import SemanticRoutes
from ray_moe.core.errors import RouteValidationError
from ray_moe.placement.snapshot import PlacementSnapshot


def count_by(index: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64 histogram of ``index`` (values in [0, n)); a scatter-add, so CUDA never syncs to size it."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).scatter_add_(0, index, torch.ones_like(index))


# routes up to which ``expert_major_order`` ranks by a one-hot prefix count instead of sorting (decode sizes)
COUNTING_ORDER_MAX = 4096


def expert_major_order(index: torch.Tensor, n: int, *,
                       counting: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stable order of ``index`` [N] int64 (values in [0, n)): (order [N] int64: positions sorted by
    (value, position); dest [N] int64: each position's place in that order, ``order``'s inverse; counts
    [n] int64). Up to ``COUNTING_ORDER_MAX`` entries it is a counting sort: the one-hot [n, N] int32 is
    prefix-summed along each value's row, so entry i's place among its value's entries is read off, plus its
    value's start (a handful of small elementwise / scan kernels; torch's sort of a few thousand keys runs
    in one thread block, ~27 us a call on an H200 in a decode profile); above it a stable sort. Both give
    the same three tensors, with device ops only (no host sync: graph capturable). ``counting``: take the
    counting sort (True) or the sort (False); None: the counting sort on CUDA up to ``COUNTING_ORDER_MAX``
    entries (on the CPU the sort is the cheaper one)."""
    m = index.numel()
    dev = index.device
    if m == 0:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return empty, empty.clone(), torch.zeros(n, dtype=torch.int64, device=dev)
    if counting is None:
        counting = index.is_cuda and m <= COUNTING_ORDER_MAX
    if counting:
        # [n, N]: value-major, so the prefix sum runs along the contiguous dimension (a parallel scan per row;
        # along dim 0 of [N, n] torch scans each column with one sequential thread)
        onehot = (torch.arange(n, device=dev)[:, None] == index[None, :]).to(torch.int32)
        upto = onehot.cumsum(1, dtype=torch.int32)  # entries of each value up to position i
        counts = upto[:, -1].to(torch.int64)
        starts = torch.cumsum(counts, 0) - counts
        dest = starts[index] + upto.gather(0, index[None, :]).squeeze(0).to(torch.int64) - 1
        return inverse_permutation(dest), dest, counts
    order = torch.sort(index, stable=True).indices
    return order, inverse_permutation(order), count_by(index, n)


def exclusive_offsets(counts: torch.Tensor) -> torch.Tensor:
    """[n] int64 -> [n+1] int64 exclusive prefix sum with the total as sentinel."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv[perm[i]] = i."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=perm.dtype, device=perm.device)
    return inv


def check_assignment(routes: SemanticRoutes, physical_slot: torch.Tensor, snapshot: PlacementSnapshot) -> None:
    """The compatibility predicate of spec 0x01D1 and the cardinality contract, vectorised.

    physical_slot: [R] int64. Rejects -1 (log2phy padding), out-of-range slots and a slot that
    stores another logical expert, naming the first offending route.
    """
    r = routes.num_routes
    if physical_slot.shape != (r,):
        raise RouteValidationError(f"physical_slot: expected shape [{r}], got {tuple(physical_slot.shape)}")
    if r == 0:
        return
    q = snapshot.num_slots
    bad = (physical_slot < 0) | (physical_slot >= q)
    stored = snapshot.on(physical_slot.device).phy2log[physical_slot.clamp(0, q - 1)]
    wrong = (stored != routes.logical_expert) & ~bad
    flags = torch.stack([bad.any(), wrong.any()]).tolist()  # one host sync for both checks
    if flags[0]:
        i = int(torch.nonzero(bad)[0])
        v = int(physical_slot[i])
        what = "log2phy padding -1 used as a slot" if v == -1 else f"out of range [0, {q})"
        raise RouteValidationError(f"physical_slot[{i}]={v}: {what} (route of token {int(routes.origin_token[i])})")
    if flags[1]:
        i = int(torch.nonzero(wrong)[0])
        raise RouteValidationError(
            f"physical_slot[{i}]=q{int(physical_slot[i])} stores logical expert {int(stored[i])}, "
            f"but the route selected logical expert {int(routes.logical_expert[i])}"
        )


def plan_source(routes: SemanticRoutes, physical_slot: torch.Tensor, snapshot: PlacementSnapshot) -> SourcePlan:
    """Steps 1-3: send layout of one origin rank. ``physical_slot`` must already pass ``check_assignment``."""
    dev = physical_slot.device
    p = snapshot.num_ranks
    g = int(snapshot.peer_order.numel())
    q = snapshot.num_slots
    maps = snapshot.on(dev)
    slot_rank = maps.slot_rank
    rank_to_peer = maps.rank_to_peer
    # 1. destination coordinates
    dest_rank = slot_rank[physical_slot]
    dest_peer = rank_to_peer[dest_rank]
    # 2. stable sort by (peer, slot); stability keeps semantic position as the last key
    key = dest_peer * q + physical_slot
    send_order = torch.sort(key, stable=True).indices
    inverse_send = inverse_permutation(send_order)
    # 3. split vector in peer-slot order and its offsets
    send_counts = count_by(dest_peer, g)
    counts_by_rank = count_by(dest_rank, p)
    return SourcePlan(
        origin_rank=routes.origin_rank,
        physical_slot=physical_slot,
        dest_rank=dest_rank,
        dest_peer=dest_peer,
        send_order=send_order,
        inverse_send=inverse_send,
        send_slot=physical_slot[send_order],
        send_counts=send_counts,
        send_offsets=exclusive_offsets(send_counts),
        counts_by_rank=counts_by_rank,
    )


def plan_receive(
    rank: int, recv_counts: torch.Tensor, recv_slot: torch.Tensor, snapshot: PlacementSnapshot
) -> ReceivePlan:
    """Steps 4-5: repack source-major received rows into expert-major order.

    recv_counts: [P] int64 source split vector (peer order; host-known); recv_slot: [N] int64 slot per
    received row. Rejects a received row whose slot is not hosted on ``rank`` (a wrong-destination route).
    """
    dev = recv_slot.device
    n = int(recv_slot.numel())
    total = int(recv_counts.sum())  # recv_counts come from the control round (host), no device sync
    if total != n:
        raise RouteValidationError(f"recv_counts sum {total} != received rows {n}")
    maps = snapshot.on(dev)
    slot_ids = maps.rank_slots[rank]
    q_local = int(snapshot.rank_num_slots[rank])
    local = maps.slot_local[recv_slot]
    # 4. stable sort by local slot: receive order is (source, send position), so ties keep it
    expert_order = torch.sort(local, stable=True).indices
    # 5. local expert counts and offsets (zero-row slots kept); the "hosted here" check rides on the same
    #    host copy of the counts that the runner needs anyway
    off_rank = (maps.slot_rank[recv_slot] != rank).sum() if n else torch.zeros((), dtype=torch.int64, device=dev)
    counts_and_flag = torch.cat([count_by(local, q_local), off_rank.view(1)]).tolist() if q_local or n else [0]
    if counts_and_flag[-1]:
        on_rank = maps.slot_rank[recv_slot] == rank
        i = int(torch.nonzero(~on_rank)[0])
        raise RouteValidationError(
            f"recv_slot[{i}]=q{int(recv_slot[i])} is hosted on rank {int(snapshot.slot_rank[recv_slot[i]])}, "
            f"not on receiving rank {rank}"
        )
    counts_list = tuple(int(c) for c in counts_and_flag[:-1])
    expert_counts = torch.tensor(counts_list, dtype=torch.int64, device=dev)
    rc = recv_counts.to(torch.int64).cpu()
    return ReceivePlan(
        rank=rank,
        recv_counts=rc,
        recv_offsets=exclusive_offsets(rc),
        recv_slot=recv_slot,
        expert_order=expert_order,
        slot_ids=slot_ids,
        expert_counts=expert_counts,
        expert_offsets=exclusive_offsets(expert_counts),
        inverse_expert=inverse_permutation(expert_order),
        counts_list=counts_list,
    )


def source_major_from_expert(expert_rows: torch.Tensor, receive: ReceivePlan) -> torch.Tensor:
    """pi_e^-1: expert-major rows [N, ...] back to source-major receive order (a gather, not a scatter)."""
    return expert_rows.index_select(0, receive.inverse_expert)


def semantic_from_send(returned_rows: torch.Tensor, source: SourcePlan) -> torch.Tensor:
    """pi_s^-1: rows returned in send order [R, ...] back to semantic route order."""
    return returned_rows[source.inverse_send]


def count_matrix(source_plans: list[SourcePlan], num_ranks: int) -> torch.Tensor:
    """C[p, u] over global ranks from every rank's source plan (ranks without a plan stay zero)."""
    c = torch.zeros(num_ranks, num_ranks, dtype=torch.int64)
    for sp in source_plans:
        c[sp.origin_rank] = sp.counts_by_rank.cpu()
    return c


def peer_split_vectors(c: torch.Tensor, peer_order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split vectors in peer-slot order from a global-rank count matrix (spec 0x07B).

    Returns (send, recv), both [P, P]: send[u, i] = C[u, pi(i)] and recv[v, i] = C[pi(i), v].
    """
    send = c[:, peer_order]
    recv = c[peer_order, :].T.contiguous()
    return send, recv
