# ======================================================================================================
#  THE ONE-RANK ROUTE PLAN (one launch at decode sizes; pure torch + Triton: no Ray)
#
#   routes [T, k] (id -1 / a padding row: no route) + the snapshot's expert -> local slot table
#     1. local slot of every route (padding routes: slot Q, sorted last)
#     2. key = slot * N' + route, sorted   ──> order [N]: the route of each expert-major row
#                                          ──> src [N]:   each route's expert-major row (-1: padding)
#     3. histogram of the slots, prefix sum ──> ends [Q] int32 inclusive row ends per local slot,
#                                              slot_rows [Q], sent [S] (rows per physical slot)
#     4. gates [N] float32 (0 for padding routes); ok [1] set (the combine clears it on a bad handle)
#
#  On CUDA one Triton program does all of it up to ROUTE_PLAN_MAX routes (decode sizes): a torch version of
#  twenty-odd small kernels was most of a decode step's non-expert time. Larger steps (prefill chunks, steps of
#  more than ROUTE_PLAN_MAX / k tokens) take the same plan in three launches (a stable counting sort by blocks):
#     A. per block of B routes: local slots, gates, the block's slot histogram          [P, QB] int32
#     B. one program: slot totals, ends / slot_rows / sent, and each (block, slot)'s first expert-major row
#        minus the slot's first position in the block's own sorted order             [P, QB] int32
#     C. per block: sort its keys (slot * B + route), row = that offset + sorted position; order / src
#  The torch version below is the CPU path and both kernels' test oracle; all give the same tensors (the order
#  is the stable sort by local slot).
# ======================================================================================================
"""The route plan of a group of one: where each route's row goes in expert-major order (one launch; three above
ROUTE_PLAN_MAX routes)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

ROUTE_PLAN_MAX = 1024  # routes (T * k) one program plans (measured on an H100: at 2,048 and 4,096 routes the blocked
#   plan takes 16 / 17 us against 21 / 70; `ray_moe_bench.route_plan`); larger steps take the blocked plan
# routes per block at least. Measured on an H100 (bench/results/serving-h100x1-b994b30/route_plan-h100x1.json): a decode
# step's 2,048 routes plan in 8.9 us at 256 a block against 16.3 at 1,024, 8,192 in 10.5 against 17.7, 16,384 in 12.9
# against 18.0 (512: 12.5); from 32,768 routes the 64-block cap sets the block (512: 14.5 us against 19.4)
BLOCKED_MIN_BLOCK = 256
BLOCKED_MAX_BLOCKS = 64  # blocks of the blocked plan (its step B holds [blocks, slot bins] in one program)
BLOCKED_MAX_BLOCK = 4096  # routes per block at most (its step C sorts one block in one program)
BLOCKED_MAX_BINS = 512  # slot bins (local slots + 2, a power of two) the blocked plan takes; more: the torch plan


@dataclass(frozen=True, eq=False)
class RouteTables:
    """One snapshot's one-rank tables on one device (no replicated expert: each expert has one slot).

    expert_slot: [E] int32 local slot of each logical expert (Q where it has none: its routes are dropped)
    phys_local:  [S] int32 local slot of each physical slot (-1: another rank's slot)
    num_local:   Q, the rank's local slots
    """

    expert_slot: torch.Tensor
    phys_local: torch.Tensor
    num_local: int


@dataclass(frozen=True, eq=False)
class RoutePlan:
    """src: [N] int64 expert-major row of each route (-1: padding route); gates: [N] float32 (0 for padding);
    order: [N] int32 route of each expert-major row (rows past ends[-1] hold padding routes); ends: [Q] int32
    inclusive row ends per local slot; slot_rows: [Q] int64 rows per local slot; sent: [S] int64 rows per
    physical slot; ok: [1] bool, True until a combine finds ``src`` no longer inverts ``order``."""

    src: torch.Tensor
    gates: torch.Tensor
    order: torch.Tensor
    ends: torch.Tensor
    slot_rows: torch.Tensor
    sent: torch.Tensor
    ok: torch.Tensor


def route_tables(slot_local: torch.Tensor, slot_rank: torch.Tensor, log2phy: torch.Tensor, rank: int,
                 num_local: int) -> RouteTables | None:
    """The tables of one snapshot's maps (device tensors) for ``rank``, or None when an expert is
    replicated (the replica choice is the selector's: the general path runs). slot_local / slot_rank: [S],
    log2phy: [E, M]."""
    if log2phy.shape[1] != 1:
        return None
    phys = log2phy[:, 0]
    own = (phys >= 0) & (slot_rank[phys.clamp_min(0)] == rank)
    expert_slot = torch.where(own, slot_local[phys.clamp_min(0)], torch.full_like(phys, num_local))
    phys_local = torch.where(slot_rank == rank, slot_local, torch.full_like(slot_local, -1))
    return RouteTables(expert_slot.to(torch.int32).contiguous(), phys_local.to(torch.int32).contiguous(),
                       int(num_local))


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _slots_of(ids_ptr, rv_ptr, expert_slot_ptr, i, N, E, Q, K: tl.constexpr, HAS_RV: tl.constexpr):
        """Routes i -> their local slot: Q for a padding route, Q + 1 past the N routes (sorted after them)."""
        live = i < N
        e = tl.load(ids_ptr + i, mask=live, other=-1)
        valid = live & (e >= 0) & (e < E)
        if HAS_RV:
            valid = valid & (tl.load(rv_ptr + i // K, mask=live, other=0) != 0)
        slot = tl.load(expert_slot_ptr + e, mask=valid, other=Q)
        slot = tl.where(valid, slot, Q)
        return tl.where(live, slot, Q + 1)

    @triton.jit
    def _write_counts(counts, ends_ptr, slot_rows_ptr, sent_ptr, phys_local_ptr, ok_ptr, Q, S,
                      BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr):
        """counts [BLOCK_Q] routes per local slot -> ends (inclusive), slot_rows, sent per physical slot; ok set
        (the handle is whole until a combine says otherwise)."""
        q = tl.arange(0, BLOCK_Q)
        tl.store(ends_ptr + q, tl.cumsum(counts, 0), mask=q < Q)
        tl.store(slot_rows_ptr + q, counts.to(tl.int64), mask=q < Q)
        tl.debug_barrier()  # slot_rows is read back below by other threads of the program
        p = tl.arange(0, BLOCK_S)
        pl = tl.load(phys_local_ptr + p, mask=p < S, other=-1)
        tl.store(sent_ptr + p, tl.load(slot_rows_ptr + pl, mask=(p < S) & (pl >= 0), other=0), mask=p < S)
        tl.store(ok_ptr, 1)

    globals().update(_slots_of=_slots_of, _write_counts=_write_counts)  # (called jit functions: module globals)

    @triton.jit
    def _route_plan(ids_ptr, w_ptr, rv_ptr, expert_slot_ptr, phys_local_ptr,
                    src_ptr, gates_ptr, order_ptr, ends_ptr, slot_rows_ptr, sent_ptr, ok_ptr,
                    N, E, Q, S, K: tl.constexpr, HAS_RV: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr):
        # 1. each route's local slot: Q for a padding route, Q + 1 past the N routes (sorted after them)
        i = tl.arange(0, BLOCK_N)
        live = i < N
        slot = _slots_of(ids_ptr, rv_ptr, expert_slot_ptr, i, N, E, Q, K, HAS_RV)
        w = tl.load(w_ptr + i, mask=live, other=0.0).to(tl.float32)
        tl.store(gates_ptr + i, tl.where(slot < Q, w, 0.0), mask=live)
        # 2. the stable order by slot: keys are unique (route index in the low bits)
        key = tl.sort(slot * BLOCK_N + i)
        route = key % BLOCK_N
        kslot = key // BLOCK_N
        tl.store(order_ptr + i, route, mask=live)
        tl.store(src_ptr + route, tl.where(kslot < Q, i, -1).to(tl.int64), mask=live)
        # 3. rows per local slot and their inclusive ends, rows per physical slot; 4. the handle is whole
        _write_counts(tl.histogram(slot, BLOCK_Q), ends_ptr, slot_rows_ptr, sent_ptr, phys_local_ptr, ok_ptr, Q, S,
                      BLOCK_Q, BLOCK_S)

    @triton.jit
    def _combine(y_ptr, src_ptr, gate_ptr, order_ptr, ok_ptr, out_ptr, width, K: tl.constexpr, BLOCK: tl.constexpr):
        # out[t] = sum_j gate[t, j] * y[src[t, j]] (FP32), padding routes add nothing; column block 0 checks
        # that each route's row is its own (order[src] == route): a corrupted handle clears ok
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            s = tl.load(src_ptr + t * K + j)
            g = tl.load(gate_ptr + t * K + j)
            own = s >= 0
            row = tl.load(y_ptr + tl.where(own, s, 0) * width + cols, mask=mask & own, other=0.0)
            acc += g * row.to(tl.float32)
            if tl.program_id(1) == 0:
                back = tl.load(order_ptr + tl.where(own, s, 0))
                if own & (back != t * K + j):
                    tl.store(ok_ptr, 0)
        tl.store(out_ptr + t * width + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _blocked_hist(ids_ptr, w_ptr, rv_ptr, expert_slot_ptr, gates_ptr, hist_ptr, N, E, Q,
                      K: tl.constexpr, HAS_RV: tl.constexpr, B: tl.constexpr, QB: tl.constexpr):
        # A. one block of B routes: slots, gates, the block's histogram over QB bins (bin Q + 1: past N)
        p = tl.program_id(0)
        i = p * B + tl.arange(0, B)
        slot = _slots_of(ids_ptr, rv_ptr, expert_slot_ptr, i, N, E, Q, K, HAS_RV)
        w = tl.load(w_ptr + i, mask=i < N, other=0.0).to(tl.float32)
        tl.store(gates_ptr + i, tl.where(slot < Q, w, 0.0), mask=i < N)
        tl.store(hist_ptr + p * QB + tl.arange(0, QB), tl.histogram(slot, QB))

    @triton.jit
    def _blocked_offsets(hist_ptr, adj_ptr, ends_ptr, slot_rows_ptr, sent_ptr, phys_local_ptr, ok_ptr, P, Q, S,
                         PP: tl.constexpr, QB: tl.constexpr, BLOCK_S: tl.constexpr):
        # B. every block's histogram at once -> the slots' totals and row ends, and per (block, slot) the first
        #    expert-major row of the block's routes of that slot, minus where they start in the block's sorted keys
        pr = tl.arange(0, PP)
        q = tl.arange(0, QB)
        h = tl.load(hist_ptr + pr[:, None] * QB + q[None, :], mask=(pr[:, None] < P) & (q[None, :] <= Q), other=0)
        tot = tl.sum(h, axis=0)  # [QB] routes per slot (bin Q: padding routes)
        base = tl.cumsum(tot, 0) - tot  # first expert-major row of each slot (padding routes after every slot)
        before = tl.cumsum(h, 0) - h  # the slot's routes in earlier blocks
        start = tl.cumsum(h, 1) - h  # where the slot's keys start in the block's sorted keys (past-N keys: last)
        tl.store(adj_ptr + pr[:, None] * QB + q[None, :], base[None, :] + before - start, mask=pr[:, None] < P)
        _write_counts(tot, ends_ptr, slot_rows_ptr, sent_ptr, phys_local_ptr, ok_ptr, Q, S, QB, BLOCK_S)

    @triton.jit
    def _blocked_scatter(ids_ptr, rv_ptr, expert_slot_ptr, adj_ptr, order_ptr, src_ptr, N, E, Q,
                         K: tl.constexpr, HAS_RV: tl.constexpr, B: tl.constexpr, QB: tl.constexpr):
        # C. the block's keys sorted (stable: the route index in the low bits); row = adj[block, slot] + position
        p = tl.program_id(0)
        j = tl.arange(0, B)
        slot = _slots_of(ids_ptr, rv_ptr, expert_slot_ptr, p * B + j, N, E, Q, K, HAS_RV)
        key = tl.sort(slot * B + j)
        kslot = key // B
        route = p * B + key % B
        live = kslot <= Q
        row = tl.load(adj_ptr + p * QB + kslot, mask=live, other=0) + j
        tl.store(order_ptr + row, route, mask=live)
        tl.store(src_ptr + route, tl.where(kslot < Q, row, -1).to(tl.int64), mask=live)

    return _route_plan, _combine, _blocked_hist, _blocked_offsets, _blocked_scatter


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def blocked_shape(routes: int, num_local: int) -> tuple[int, int, int] | None:
    """(routes per block B, blocks P, slot bins QB) of the blocked plan for ``routes`` routes over ``num_local``
    local slots, or None when it does not take them (more than ``BLOCKED_MAX_BLOCKS`` blocks of
    ``BLOCKED_MAX_BLOCK`` routes, or more than ``BLOCKED_MAX_BINS`` bins). B: ``BLOCKED_MIN_BLOCK`` routes,
    doubled until at most ``BLOCKED_MAX_BLOCKS`` blocks cover the step."""
    bins = _pow2(int(num_local) + 2)
    b = max(BLOCKED_MIN_BLOCK, _pow2(-(-int(routes) // BLOCKED_MAX_BLOCKS)))
    if routes < 1 or b > BLOCKED_MAX_BLOCK or bins > BLOCKED_MAX_BINS:
        return None
    return b, -(-int(routes) // b), bins


def kernel_available(ids: torch.Tensor, num_local: int) -> bool:
    """Whether a Triton plan takes these routes over ``num_local`` local slots (CUDA, Triton importable): the
    one-launch plan up to ``ROUTE_PLAN_MAX`` routes, the blocked plan above (``blocked_shape``)."""
    n = ids.numel()
    if not ids.is_cuda or n < 1 or _kernel() is None:
        return False
    return n <= ROUTE_PLAN_MAX or blocked_shape(n, num_local) is not None


def _empty_plan(n: int, q: int, s: int, dev: torch.device) -> RoutePlan:
    return RoutePlan(src=torch.empty(n, dtype=torch.int64, device=dev),
                     gates=torch.empty(n, dtype=torch.float32, device=dev),
                     order=torch.empty(n, dtype=torch.int32, device=dev),
                     ends=torch.empty(q, dtype=torch.int32, device=dev),
                     slot_rows=torch.empty(q, dtype=torch.int64, device=dev),
                     sent=torch.empty(s, dtype=torch.int64, device=dev),
                     ok=torch.empty(1, dtype=torch.bool, device=dev))


def plan_routes_blocked(ids: torch.Tensor, weights: torch.Tensor, row_valid: torch.Tensor | None,
                        tables: RouteTables, *, block: int | None = None) -> RoutePlan:
    """The route plan in three launches (module banner, A-C) for steps of any size ``blocked_shape`` takes: ids
    [T, k], weights [T, k], row_valid [T] bool or None -> the RoutePlan ``plan_routes_torch`` gives (CUDA, or
    CPU tensors under Triton's interpreter in tests). ``block``: routes per block (a power of two >= 16, at most
    ``BLOCKED_MAX_BLOCKS`` blocks; None: ``blocked_shape``'s). Raises ValueError naming ``ids`` / ``block``."""
    t, k = int(ids.shape[0]), int(ids.shape[1])
    n, q, s = t * k, tables.num_local, int(tables.phys_local.numel())
    if block is not None and (block < 16 or block & (block - 1) or -(-n // block) > BLOCKED_MAX_BLOCKS):
        raise ValueError(f"block={block}: a power of two >= 16 making at most {BLOCKED_MAX_BLOCKS} blocks of {n} "
                         f"routes")
    shape = blocked_shape(n, q)
    if shape is None or _kernel() is None:
        raise ValueError(f"ids: {n} routes over {q} local slots: the blocked route plan does not take them here")
    b, p, qb = shape if block is None else (int(block), -(-n // int(block)), shape[2])
    dev = ids.device
    _, _, hist_k, offsets_k, scatter_k = _kernel()
    ids = ids.reshape(-1).contiguous()
    rv = row_valid.contiguous().view(torch.uint8) if row_valid is not None else ids
    plan = _empty_plan(n, q, s, dev)
    hist = torch.empty(p, qb, dtype=torch.int32, device=dev)
    adj = torch.empty(p, qb, dtype=torch.int32, device=dev)
    common = dict(K=k, HAS_RV=row_valid is not None, B=b, QB=qb)
    e = int(tables.expert_slot.numel())
    warps = 8 if b >= 2048 else 4
    # A. slots, gates and each block's histogram
    hist_k[(p,)](ids, weights.reshape(-1).contiguous(), rv, tables.expert_slot, plan.gates, hist, n, e, q, **common,
                 num_warps=warps)
    # B. totals, ends, sent, and each (block, slot)'s row offset
    offsets_k[(1,)](hist, adj, plan.ends, plan.slot_rows, plan.sent, tables.phys_local, plan.ok.view(torch.uint8), p,
                    q, s, PP=max(_pow2(p), 2), QB=qb, BLOCK_S=_pow2(s), num_warps=8)
    # C. each block's sorted keys -> order and src
    scatter_k[(p,)](ids, rv, tables.expert_slot, adj, plan.order, plan.src, n, e, q, **common, num_warps=warps)
    return plan


def plan_routes(ids: torch.Tensor, weights: torch.Tensor, row_valid: torch.Tensor | None,
                tables: RouteTables) -> RoutePlan:
    """ids [T, k] int (-1: padding route), weights [T, k] float, row_valid [T] bool or None (rows marked
    False route nowhere) -> the RoutePlan (on CUDA one Triton launch up to ``ROUTE_PLAN_MAX`` routes, the blocked
    plan's three above; else, and where neither takes the step, ``plan_routes_torch``)."""
    if not kernel_available(ids, tables.num_local):
        return plan_routes_torch(ids, weights, row_valid, tables)
    if ids.numel() > ROUTE_PLAN_MAX:
        return plan_routes_blocked(ids, weights, row_valid, tables)
    t, k = int(ids.shape[0]), int(ids.shape[1])
    n, q, s = t * k, tables.num_local, int(tables.phys_local.numel())
    dev = ids.device
    ids = ids.reshape(-1).contiguous()
    weights = weights.reshape(-1).contiguous()
    rv = row_valid.contiguous().view(torch.uint8) if row_valid is not None else ids
    plan = _empty_plan(n, q, s, dev)
    block_n = max(_pow2(n), 16)  # tl.sort wants a few lanes; the extra ones sort last
    _kernel()[0][(1,)](ids, weights, rv, tables.expert_slot, tables.phys_local, plan.src, plan.gates, plan.order,
                    plan.ends, plan.slot_rows, plan.sent, plan.ok.view(torch.uint8), n,
                    int(tables.expert_slot.numel()), q, s, K=k, HAS_RV=row_valid is not None, BLOCK_N=block_n,
                    BLOCK_Q=_pow2(q + 2), BLOCK_S=_pow2(s), num_warps=8 if block_n >= 2048 else 4)
    return plan


def plan_routes_torch(ids: torch.Tensor, weights: torch.Tensor, row_valid: torch.Tensor | None,
                      tables: RouteTables) -> RoutePlan:
    """The torch version of ``plan_routes`` (CPU, steps past ``ROUTE_PLAN_MAX``, and the kernel's oracle)."""
    t, k = int(ids.shape[0]), int(ids.shape[1])
    q = tables.num_local
    dev = ids.device
    e = ids.reshape(-1).to(torch.int64)
    num_e = int(tables.expert_slot.numel())
    valid = (e >= 0) & (e < num_e)
    if row_valid is not None:
        valid &= row_valid.repeat_interleave(k)
    slot = torch.where(valid, tables.expert_slot.to(torch.int64)[e.clamp(0, max(num_e - 1, 0))],
                       torch.full_like(e, q))
    valid = slot < q
    order = torch.sort(slot, stable=True).indices
    src = torch.empty_like(order)
    src[order] = torch.arange(order.numel(), device=dev)
    counts = torch.zeros(q + 1, dtype=torch.int64, device=dev).scatter_add_(0, slot, torch.ones_like(slot))[:q]
    pl = tables.phys_local.to(torch.int64)
    sent = torch.cat([counts, counts.new_zeros(1)])[torch.where(pl >= 0, pl, q)]
    return RoutePlan(src=torch.where(valid, src, torch.full_like(src, -1)),
                     gates=torch.where(valid, weights.reshape(-1).to(torch.float32), 0.0),
                     order=order.to(torch.int32), ends=torch.cumsum(counts, 0).to(torch.int32),
                     slot_rows=counts, sent=sent, ok=torch.ones(1, dtype=torch.bool, device=dev))


COMBINE_BLOCK = 1024


def combine_planned(y: torch.Tensor, plan: RoutePlan, top_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """y [R, d] expert outputs in expert-major order (rows past ends[-1] never read) -> [T, d] ``out_dtype``:
    out[t] = sum_j gates[t, j] * y[src[t, j]], accumulated in FP32; padding routes add nothing. Checks the
    handle as it reads it: a route whose row is not its own (``order[src] != route``) clears ``plan.ok``."""
    n = int(plan.src.numel())
    k = max(int(top_k), 1)
    t, d = n // k, int(y.shape[1])
    out = torch.empty(t, d, dtype=out_dtype, device=y.device)
    if t == 0 or d == 0:
        return out.zero_()
    if y.is_cuda and y.is_contiguous() and _kernel() is not None:
        _kernel()[1][(t, -(-d // COMBINE_BLOCK))](y, plan.src, plan.gates, plan.order, plan.ok.view(torch.uint8),
                                                  out, d, K=k, BLOCK=COMBINE_BLOCK)
        return out
    own = plan.src >= 0
    at = plan.src.clamp_min(0)
    if int(plan.order.numel()):
        back = plan.order.to(torch.int64)[at.clamp_max(int(plan.order.numel()) - 1)]
        plan.ok.logical_and_(~(own & (back != torch.arange(n, device=y.device))).any())
    acc = torch.zeros(t, d, dtype=torch.float32, device=y.device)
    src, own, gates = at.view(t, k), own.view(t, k), plan.gates.view(t, k)
    for j in range(k):  # the order of the FP32 adds of ``kernels.gated_combine_torch``
        rows = y.index_select(0, src[:, j]).to(torch.float32) if y.shape[0] else acc.new_zeros(t, d)
        acc.addcmul_(torch.where(own[:, j:j + 1], rows, 0.0), gates[:, j:j + 1])
    return acc.to(out_dtype)


__all__ = ["BLOCKED_MAX_BINS", "BLOCKED_MAX_BLOCK", "BLOCKED_MAX_BLOCKS", "BLOCKED_MIN_BLOCK", "COMBINE_BLOCK",
           "ROUTE_PLAN_MAX", "RoutePlan", "RouteTables", "blocked_shape", "combine_planned", "kernel_available",
           "plan_routes", "plan_routes_blocked", "plan_routes_torch", "route_tables"]
