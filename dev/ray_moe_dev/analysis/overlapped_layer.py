# ======================================================================================================
#  THE OVERLAPPED DATA PATH (one rank, one MoE layer, SPMD over the process group; spec 0x03D4, 0x09B)
#
#   caller stream ──entry event──┬──────────────────────────────────────────────────────────────┐
#                                │                                                              │
#   shared   ─────────────── shared_path: SwiGLU(h) over all T tokens ─────────────────────────┐ │
#   compute  ── route_plan (validate, select, ONE sort, counts of all chunks) ── pack_0 .. pack_{n-1}
#   comm     ─────── count_agreement (ONE all-gather: split vectors of ALL chunks) ──
#                    dispatch_0 .. dispatch_{n-1} ── combine_0 .. combine_{n-1}   (chunk order, every rank)
#   expert   ──────────── expert_c: repack + grouped experts + inverse repack (after dispatch_c)
#   output   ──────────── scatter_c: gated scatter-add into the FP32 accumulator (after combine_c)
#                          reduce: accumulator + shared output (after every scatter and the shared path)
#                                                                                               │
#   caller stream waits for reduce's completion event ◄────────────────────────────────────────┘
#
#  Readiness is a completion event, never a launch (0x09F). Every tensor read by a stream other than the
#  one that allocated it is handed to the caching allocator with ``record_stream`` and referenced until
#  the final event (0x03D5, 0x09D). On CPU every stream is ``None``: waits and records are no-ops and the
#  same code runs serially, in issue order.
#  Pure: no Ray. The exchange backend (local threads, Ray object store, NCCL) is passed in.
# ======================================================================================================
"""The MoE layer step as a dependency DAG of streams and events (spec 0x03D4, 0x03D5, 0x09-0x09F).

``overlapped_layer`` splits one rank's tokens into ``chunks`` contiguous token ranges and pipelines them:
chunk c+1's dispatch overlaps chunk c's experts, returns overlap later experts, and an optional shared
expert (always-on SwiGLU over every token) runs on its own stream from the start. The numbers equal the
unchunked ``engine.dispatch`` -> runner -> ``engine.combine`` path with the same routes, replicas and
weights (the shared output, if any, is added in FP32 before the final cast).

Control protocol (0x0E "peers agree on counts before any payload moves"): ONE all-gather carries the
engine's ``ControlRecord`` (generation, epoch, layer, status, digest, width, dtype, split vector) followed by
``[chunks]`` and the per-chunk, per-physical-slot route counts ``[chunks, Q]`` of the rank. Every rank
checks the same matrix (``engine.agree`` plus the chunk extension) and aborts together before any payload.
From it each rank knows every chunk's send split, receive split and local expert counts on the host.
The host waits only before the control round (the input validation the engine also performs, and the
route plan's count vector, copied without waiting for the packs queued behind it) and in the control
round itself; after it nothing blocks the host, so every chunk's payload rounds, experts and scatter-adds
are queued at once and the streams overlap on the device.

NCCL calls are issued in the same order on every rank, all on the communication stream: the control
round, then the dispatches in chunk order and the returns in chunk order, merged by ``comm_order``:

* ``"dispatch_first"``: d_0 .. d_{n-1}, r_0 .. r_{n-1} (the issue order of
  ``overlap_schedule.moe_step_tasks``)
* ``"interleaved"``:    d_0, d_1, r_0, d_2, r_1, .., d_{n-1}, r_{n-2}, r_{n-1} (return c queued behind
  dispatch c+1 only)

A chunk whose global route count is zero (known to every rank from the control round) skips both of its
exchanges on every rank; its tasks stay in the DAG with zero rows.

The executed DAG (task, stream, dependencies; on CUDA start/end events of every task when ``timed``, on
CPU host timestamps) comes back in ``OverlapResult`` (``overlapped_streams``); ``OverlapResult.timeline()``
turns it into an ``overlap_schedule.Schedule`` in MEASURED milliseconds, which validates that no task
started before its dependencies completed and that tasks of one stream did not overlap, and checks buffer
release against the last reader (``lifetime_ledger.check_release``). Timeline overlap is not a speedup
(0x09F): a speedup is the ratio of two measured step times, which ``bench/overlap.py`` reports separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ray_moe_dev.analysis.overlapped_streams import OverlapResult, Recorder, StreamSet, resolve_streams
from ray_moe.moe.dispatch.protocol import DTYPE_CODES, ControlRecord, ControlStatus, agree
from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.dispatch.plan import check_assignment
from ray_moe.core.routes import RouteBatch, SemanticRoutes
from ray_moe.core.errors import CountAgreementError, RouteValidationError
from ray_moe.moe.experts.runners.base import ExpertRunner
from ray_moe.moe.experts.weights import ExpertWeights, SlotWeights, swiglu
from ray_moe.placement.selector import ReplicaSelector
from ray_moe.placement.snapshot import PlacementSnapshot

COMM_ORDERS = ("dispatch_first", "interleaved")


def chunk_bounds(num_tokens: int, chunks: int) -> tuple[int, ...]:
    """Token bounds of ``chunks`` contiguous chunks: b_c = floor(c T / n); chunks may be empty (n > T)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r}: expected an integer >= 1")
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens}: expected >= 0")
    return tuple((c * num_tokens) // chunks for c in range(chunks + 1))


# ------------------------------------------------------------------------------------------------------
#  the step
# ------------------------------------------------------------------------------------------------------


def overlapped_layer(batch: RouteBatch, snapshot: PlacementSnapshot, exchange: Exchange, **kwargs) -> OverlapResult:
    """``_overlapped_layer`` (below, documented there) with the exchange's per-round host wait turned off:
    the host must keep enqueueing the next chunks while a round is in flight. One watchdog wait at the
    end still turns a dead peer into an error instead of a hang."""
    prev = getattr(exchange, "sync_payload", None)
    if prev is not None:
        exchange.sync_payload = False
    try:
        result = _overlapped_layer(batch, snapshot, exchange, **kwargs)
        if prev is not None and hasattr(exchange, "wait"):
            exchange.wait(f"{kwargs.get('tag', 'overlap')}: overlapped step")
        return result
    finally:
        if prev is not None:
            exchange.sync_payload = prev


def _overlapped_layer(
    batch: RouteBatch,
    snapshot: PlacementSnapshot,
    exchange: Exchange,
    *,
    selector: ReplicaSelector,
    runner: ExpertRunner,
    weights: SlotWeights | None,
    tag: str,
    chunks: int,
    shared_expert: ExpertWeights | None = None,
    streams: StreamSet | None = None,
    serialized: bool = False,
    comm_order: str = "dispatch_first",
    timed: bool = False,
    out_dtype: torch.dtype | None = None,
) -> OverlapResult:
    """One MoE layer of one rank as a chunked DAG of streams and events (spec 0x09B).

    batch:         hidden [T, d], topk_ids [T, k] int64, topk_weights [T, k] float32 of this rank
    weights:       the stacked weights of this rank's slots in local slot order (None if it hosts none)
    chunks:        number of contiguous token chunks (same on every rank; may exceed T: empty chunks)
    shared_expert: an always-on SwiGLU over every token (w_gate/w_up [f_s, d], w_down [d, f_s]), or None
    streams:       reusable ``StreamSet`` (default: fresh streams on CUDA, none on CPU)
    serialized:    every task on the caller's current stream (the baseline); ``streams`` must then be
                   None or a serial set
    comm_order:    ``"dispatch_first"`` or ``"interleaved"`` (module docstring)
    timed:         on CUDA, record timing events for ``OverlapResult.timeline()`` (CPU always records)
    out_dtype:     dtype of the output (default: the hidden dtype)
    returns        ``OverlapResult`` whose ``hidden`` is [T, d] ``out_dtype``, ready on the caller's stream

    Argument errors (chunks, comm_order, weights, shared expert, streams) raise ValueError on this rank
    before any exchange: they are static configuration, identical on every rank. Bad routes
    (``RouteValidationError``) take part in the control round with status BAD_INPUT so every rank aborts
    before payload, like ``engine.dispatch``. Only the native payload format is supported.
    """
    # 0. arguments (static configuration: raised on this rank before any exchange)
    hidden = batch.hidden
    dev = hidden.device
    well_formed = hidden.dim() == 2
    width = int(hidden.shape[1]) if well_formed else -1
    num_tokens = int(hidden.shape[0]) if hidden.dim() >= 1 else 0
    bounds = chunk_bounds(num_tokens, chunks)
    if comm_order not in COMM_ORDERS:
        raise ValueError(f"comm_order={comm_order!r}: expected one of {COMM_ORDERS}")
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tag={tag!r}: expected a non-empty string")
    if not isinstance(serialized, bool) or not isinstance(timed, bool):
        raise ValueError(f"serialized={serialized!r}, timed={timed!r}: expected bools")
    rank = exchange.rank
    my_slots = snapshot.rank_slot_ids(rank)
    _check_weights(weights, int(my_slots.numel()), width)
    if shared_expert is not None and well_formed:
        _check_shared(shared_expert, width, hidden)
    streams = resolve_streams(streams, dev, serialized)
    out_dtype = hidden.dtype if out_dtype is None else out_dtype
    n, q, g, me = chunks, snapshot.num_slots, exchange.size, exchange.peer
    k = int(batch.topk_ids.shape[1]) if batch.topk_ids.dim() == 2 else 0
    rb = [b * k for b in bounds]  # chunk c = send positions [rb[c], rb[c+1]) of the (chunk, peer, slot) order
    rec = Recorder(streams, dev, timed)
    keep: list[torch.Tensor] = []  # every cross-stream buffer, referenced until the final event

    def hand_over(t: torch.Tensor | None, consumer_role: str, producer: Any) -> None:
        """``t`` (allocated on stream ``producer``) is read on ``consumer_role``'s stream: reference it until
        the final event and tell the caching allocator (0x03D5: release only after the last reader)."""
        if t is None:
            return
        keep.append(t)
        consumer = streams.stream(consumer_role)
        if consumer is not None and t.is_cuda and consumer != producer:
            t.record_stream(consumer)

    hand_over(hidden, "compute", rec.caller)
    shared_out: list[torch.Tensor] = []

    # 1. shared path: starts at once on its own stream (issued just before the reduce when serialized)
    def issue_shared() -> None:
        assert shared_expert is not None
        hand_over(hidden, "shared", rec.caller)
        with rec.task("shared_path", "shared", (), rows=num_tokens):
            shared_out.append(swiglu(hidden, shared_expert.w_gate, shared_expert.w_up, shared_expert.w_down))
        hand_over(shared_out[0], "output", streams.shared)

    run_shared = shared_expert is not None and well_formed
    if run_shared and not serialized:
        issue_shared()

    # 2. route plan (compute stream): validation, replica selection, ONE stable sort by (chunk, peer, slot),
    #    per-(chunk, slot) counts + the invalid-route count in one vector whose host copy is queued here
    error: RouteValidationError | None = None
    status = ControlStatus.OK
    plan: _ChunkPlan | None = None
    routes: SemanticRoutes | None = None
    physical: torch.Tensor | None = None
    host_counts: torch.Tensor | None = None
    with rec.task("route_plan", "compute", (), rows=num_tokens * k):
        try:
            batch.validate(snapshot.num_experts)
            if batch.origin_rank != rank:
                raise RouteValidationError(f"origin_rank={batch.origin_rank} but this endpoint is rank {rank}")
            routes = SemanticRoutes.from_batch(batch)
            physical = selector.select(routes, snapshot).to(routes.logical_expert.device)
            if tuple(physical.shape) != (routes.num_routes,):
                raise RouteValidationError(
                    f"physical_slot: expected shape [{routes.num_routes}], got {tuple(physical.shape)}")
            plan = _plan_chunks(routes, physical, snapshot, bounds, g)
            host_counts = rec.start_copy(plan.counts)
        except RouteValidationError as exc:
            error, status = exc, ControlStatus.BAD_INPUT
    if plan is not None:
        hand_over(plan.send_slot, "communication", streams.compute)
        hand_over(plan.slot_local, "expert", streams.compute)
        hand_over(plan.send_tokens, "output", streams.compute)
        hand_over(plan.send_gate, "output", streams.compute)

    # 3. packs (compute stream), issued before the control round: local gathers, no payload moves yet
    payloads: list[dict[str, torch.Tensor]] = []
    if plan is not None:
        for c in range(n):
            with rec.task(f"pack_{c}", "compute", ("route_plan",), rows=rb[c + 1] - rb[c]):
                rows = hidden.index_select(0, plan.send_tokens[rb[c]:rb[c + 1]])
            hand_over(rows, "communication", streams.compute)
            payloads.append({"x": rows, "slot": plan.send_slot[rb[c]:rb[c + 1]]})

    # 4. host: wait for the route plan only (the packs keep running), then judge the routes
    local_counts = np.zeros((n, q), dtype=np.int64)
    if plan is not None and host_counts is not None:
        counts = rec.finish_copy(host_counts, "route_plan")
        bad = int(counts[-1])
        try:
            if bad:
                assert routes is not None and physical is not None
                check_assignment(routes, physical, snapshot)  # names the first offending route
                raise RouteValidationError(
                    f"physical_slot: {bad} route(s) go to a slot whose rank is outside process group "
                    f"{exchange.group.group_id!r}")
            local_counts = counts[:-1].reshape(n, q)
        except RouteValidationError as exc:
            error, status = exc, ControlStatus.BAD_INPUT
        if error is None and local_counts.sum(axis=1).tolist() != np.diff(rb).tolist():
            raise RuntimeError(f"chunk plan: per-chunk routes {local_counts.sum(axis=1).tolist()} != "
                               f"{np.diff(rb).tolist()} (chunk map and send order disagree)")

    # 5. control round (communication stream): ONE all-gather of the split vectors of ALL chunks
    slot_peer = snapshot.rank_to_peer[snapshot.slot_rank].numpy().astype(np.int64)  # [Q] peer of each slot
    declared = _per_peer(local_counts.sum(axis=0), slot_peer, g)
    record = ControlRecord(snapshot.generation, snapshot.pg_epoch, snapshot.layer, status,
                           int(declared.sum()), snapshot.map_digest, width, DTYPE_CODES.get(hidden.dtype, 0), 0,
                           tuple(int(x) for x in declared))
    head = record.to_array()
    vec = np.concatenate([head, np.asarray([n], dtype=np.int64), local_counts.reshape(-1)])
    with rec.task("count_agreement", "communication", ("route_plan",), rows=g):
        gathered = exchange.all_gather(f"{tag}/ctl", vec)
    try:
        records = [ControlRecord.from_array(row[:head.size]) for row in gathered]
        agree(records, exchange.group.peer_order, tag)
        m = _agree_chunks(gathered, head.size, n, q, slot_peer, records, exchange.group.peer_order, tag)
    except Exception:
        if error is not None:
            raise error
        raise
    if error is not None:  # unreachable: a BAD_INPUT record fails agree() on every rank
        raise error
    assert plan is not None

    # 6. host: every chunk's splits and local expert counts, from the agreed m [G, n, Q]
    mine = my_slots.numpy()
    send_counts = [_per_peer(m[me, c], slot_peer, g).tolist() for c in range(n)]  # [n][G] peer order
    recv_counts = m[:, :, mine].sum(axis=2).T.tolist()  # [n][G]
    expert_counts = [tuple(int(x) for x in row) for row in m[:, :, mine].sum(axis=0)]  # [n][Q_local]
    totals = m.sum(axis=(0, 2)).tolist()  # [n] routes of chunk c over the whole group
    received: list[dict[str, torch.Tensor] | None] = [None] * n
    expert_out: list[torch.Tensor | None] = [None] * n
    returned: list[torch.Tensor | None] = [None] * n
    acc: list[torch.Tensor] = []  # the FP32 accumulator, allocated on the output stream by scatter_0

    def dispatch_chunk(c: int) -> None:
        with rec.task(f"dispatch_{c}", "communication", (f"pack_{c}", "count_agreement"),
                      rows=sum(send_counts[c])):
            if totals[c]:
                received[c] = exchange.all_to_all_v(f"{tag}/dispatch{c}", payloads[c], send_counts[c],
                                                    recv_counts[c])
        for t in (received[c] or {}).values():
            hand_over(t, "expert", streams.comm)

    def expert_chunk(c: int) -> None:
        rows_in = sum(expert_counts[c])
        with rec.task(f"expert_{c}", "expert", (f"dispatch_{c}",), rows=rows_in):
            got = received[c]
            if rows_in:
                assert got is not None and weights is not None
                local = plan.slot_local[got["slot"].to(torch.int64)]
                order = torch.sort(local, stable=True).indices  # (slot, source, send position), as the engine
                y = runner.run(got["x"].index_select(0, order), expert_counts[c], weights)
                back = torch.empty_like(y)
                back.index_copy_(0, order, y)  # pi_e^-1: expert-major -> source-major receive order
                expert_out[c] = back
        hand_over(expert_out[c], "communication", streams.expert)

    def combine_chunk(c: int) -> None:
        with rec.task(f"combine_{c}", "communication", (f"expert_{c}",), rows=sum(recv_counts[c])):
            if totals[c]:
                back = expert_out[c]
                if back is None:  # nothing received in chunk c: this rank still takes part in the round
                    back = hidden.new_empty((0, width))
                returned[c] = exchange.all_to_all_v(f"{tag}/combine{c}", {"y": back}, recv_counts[c],
                                                    send_counts[c])["y"]
        hand_over(returned[c], "output", streams.comm)

    def scatter_chunk(c: int) -> None:
        lo, hi = rb[c], rb[c + 1]
        with rec.task(f"scatter_{c}", "output", (f"combine_{c}",), rows=hi - lo):
            if not acc:
                acc.append(torch.zeros(num_tokens, width, dtype=torch.float32, device=dev))
            if hi > lo:
                ret = returned[c]
                assert ret is not None
                weighted = ret.to(torch.float32) * plan.send_gate[lo:hi, None]  # the gate, once (0x0AE)
                acc[0].index_add_(0, plan.send_tokens[lo:hi], weighted)

    # 7. payload rounds in chunk order on the communication stream; each consumer issued behind its producer
    for kind, c in comm_sequence(n, comm_order):
        if kind == "dispatch":
            dispatch_chunk(c)
            expert_chunk(c)
        else:
            combine_chunk(c)
            scatter_chunk(c)

    # 8. reduce (output stream): routed accumulator + shared output in FP32, one cast
    if run_shared and serialized:
        issue_shared()
    reduce_deps = tuple(f"scatter_{c}" for c in range(n)) + (("shared_path",) if run_shared else ())
    with rec.task("reduce", "output", reduce_deps, rows=num_tokens):
        if shared_out:
            acc[0].add_(shared_out[0])
        out = acc[0].to(out_dtype)
    # 9. the caller's stream waits for the final event; the step's buffers are released after it
    final = rec.finish(out)
    keep.clear()
    return OverlapResult(
        hidden=out, tasks=tuple(rec.tasks), chunk_bounds=bounds,
        count_matrices=torch.from_numpy(_global_counts(m, snapshot, exchange.group.peer_order)),
        expert_counts=tuple(expert_counts), serialized=streams.serial, comm_order=comm_order,
        timed=timed or not streams.on_cuda, marks=dict(rec.marks), origin=rec.origin, final=final,
    )


def comm_sequence(chunks: int, comm_order: str) -> tuple[tuple[str, int], ...]:
    """Issue order of the payload rounds on the communication stream (identical on every rank)."""
    if comm_order == "dispatch_first":
        return tuple(("dispatch", c) for c in range(chunks)) + tuple(("combine", c) for c in range(chunks))
    if comm_order == "interleaved":
        seq: list[tuple[str, int]] = [("dispatch", 0)]
        for c in range(1, chunks):
            seq += [("dispatch", c), ("combine", c - 1)]
        return tuple(seq + [("combine", chunks - 1)])
    raise ValueError(f"comm_order={comm_order!r}: expected one of {COMM_ORDERS}")


# ------------------------------------------------------------------------------------------------------
#  planning (device side, no host synchronisation)
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _ChunkPlan:
    """Send layout of all chunks of one rank, in (chunk, destination peer, physical slot, route) order.

    send_tokens: [R] int64 origin token at each send position;  send_slot: [R] int32 physical slot;
    send_gate:   [R] float32 gate;  slot_local: [Q] int64 local slot index of every slot (device copy);
    counts:      [n*Q + 1] int64 routes per (chunk, slot), then the number of invalid routes
    Chunk c occupies send positions [b_c k, b_{c+1} k) because chunks are contiguous token ranges.
    """

    send_tokens: torch.Tensor
    send_slot: torch.Tensor
    send_gate: torch.Tensor
    slot_local: torch.Tensor
    counts: torch.Tensor


def _plan_chunks(routes: SemanticRoutes, physical: torch.Tensor, snapshot: PlacementSnapshot,
                 bounds: Sequence[int], g: int) -> _ChunkPlan:
    """Steps: 1. validity of every route's slot (computed, not branched on: no host sync); 2. chunk of
    every route (c = floor(((t+1) n - 1) / T) inverts b_c = floor(c T / n)); 3. one stable sort by
    (chunk, peer, slot); 4. counts per (chunk, slot) and the invalid-route count in one vector."""
    dev = physical.device
    n = len(bounds) - 1
    q = snapshot.num_slots
    t = routes.num_tokens
    # 1. invalid slots are counted and clamped so no lookup can index out of range
    phy2log = snapshot.phy2log.to(dev)
    slot_peer = snapshot.rank_to_peer[snapshot.slot_rank].to(dev)
    slot_local = snapshot.slot_local.to(dev)
    bad = (physical < 0) | (physical >= q)
    safe = physical.clamp(0, max(q - 1, 0))
    peer = slot_peer[safe]
    bad = bad | (phy2log[safe] != routes.logical_expert) | (peer < 0)
    # 2. chunk of every route
    if t:
        tok = torch.arange(t, device=dev, dtype=torch.int64)
        chunk = (((tok + 1) * n - 1) // t)[routes.origin_token]
    else:
        chunk = torch.zeros(0, dtype=torch.int64, device=dev)
    # 3. one sort; stability keeps the semantic position as the last key
    key = (chunk * g + peer.clamp(min=0)) * q + safe
    order = torch.sort(key, stable=True).indices
    # 4. counts per (chunk, slot) + invalid routes
    counts = torch.zeros(n * q + 1, dtype=torch.int64, device=dev)
    counts[: n * q].index_add_(0, chunk * q + safe, torch.ones_like(safe))
    counts[n * q] = bad.sum()
    return _ChunkPlan(
        send_tokens=routes.origin_token[order],
        send_slot=safe[order].to(torch.int32),
        send_gate=routes.gate.to(dev)[order],
        slot_local=slot_local,
        counts=counts,
    )


def _per_peer(slot_counts: np.ndarray, slot_peer: np.ndarray, g: int) -> np.ndarray:
    """[Q] counts per physical slot -> [G] counts per destination peer (slots outside the group dropped)."""
    out = np.zeros(g, dtype=np.int64)
    ok = slot_peer >= 0
    np.add.at(out, slot_peer[ok], np.asarray(slot_counts, dtype=np.int64)[ok])
    return out


def _agree_chunks(gathered: np.ndarray, base: int, n: int, q: int, slot_peer: np.ndarray,
                  records: Sequence[ControlRecord], group_ranks: Sequence[int], tag: str) -> np.ndarray:
    """The chunk extension of the control round, checked identically on every rank -> m [G, n, Q].

    Each rank declares n and its per-(chunk, slot) counts; they must be non-negative, stay inside the
    group and add up, per destination peer, to the split vector the engine record declared."""
    g = gathered.shape[0]
    if gathered.shape[1] != base + 1 + n * q:
        raise CountAgreementError(f"{tag}: control vectors of {gathered.shape[1]} entries, expected "
                                  f"{base + 1 + n * q} for chunks={n} over {q} slots")
    for i in range(g):
        if int(gathered[i, base]) != n:
            raise CountAgreementError(f"{tag}: rank {group_ranks[i]} declares chunks={int(gathered[i, base])} but "
                                      f"this rank runs chunks={n}; aborted before payload exchange")
    m = gathered[:, base + 1:].reshape(g, n, q).astype(np.int64)
    for i in range(g):
        if (m[i] < 0).any():
            raise CountAgreementError(f"{tag}: rank {group_ranks[i]} declares a negative chunk count; aborted "
                                      f"before payload exchange")
        if m[i][:, slot_peer < 0].any():
            raise CountAgreementError(f"{tag}: rank {group_ranks[i]} routes to a slot outside the group")
        per_peer = _per_peer(m[i].sum(axis=0), slot_peer, g)
        if per_peer.tolist() != list(records[i].send_counts):
            raise CountAgreementError(
                f"{tag}: rank {group_ranks[i]} declares chunk counts summing to {per_peer.tolist()} per peer but "
                f"split vector {list(records[i].send_counts)}; aborted before payload exchange")
    return m


def _global_counts(m: np.ndarray, snapshot: PlacementSnapshot, peer_order: Sequence[int]) -> np.ndarray:
    """m [G, n, Q] -> [n, P, P] count matrices C_c[p, u] over global ranks."""
    g, n, q = m.shape
    p = snapshot.num_ranks
    onehot = np.zeros((q, p), dtype=np.int64)
    onehot[np.arange(q), snapshot.slot_rank.numpy()] = 1
    out = np.zeros((n, p, p), dtype=np.int64)
    out[:, np.asarray(peer_order, dtype=np.int64), :] = np.einsum("scq,qr->csr", m, onehot)
    return out


def _check_weights(weights: SlotWeights | None, q_local: int, width: int) -> None:
    if weights is None:
        if q_local:
            raise ValueError(f"weights=None but this rank hosts {q_local} slot(s)")
        return
    if weights.num_slots != q_local:
        raise ValueError(f"weights: {weights.num_slots} slots but this rank hosts {q_local}")
    if width >= 0 and weights.hidden_size != width:
        raise ValueError(f"weights: hidden size {weights.hidden_size} != hidden width {width}")


def _check_shared(w: ExpertWeights, width: int, hidden: torch.Tensor) -> None:
    f = int(w.w_gate.shape[0])
    want = {"w_gate": (f, width), "w_up": (f, width), "w_down": (width, f)}
    for name, shape in want.items():
        t = getattr(w, name)
        if tuple(t.shape) != shape:
            raise ValueError(f"shared_expert.{name}: shape {tuple(t.shape)}, expected {shape} for hidden width {width}")
        if t.dtype != hidden.dtype or t.device != hidden.device:
            raise ValueError(f"shared_expert.{name}: {t.dtype} on {t.device}, hidden is {hidden.dtype} on "
                             f"{hidden.device}")
