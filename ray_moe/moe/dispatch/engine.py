# ======================================================================================================
#  THE DATA PATH (one rank, one MoE layer, SPMD over the process group)
#
#   route batch ──> semantic routes ──> replica selection ──> source plan (counts, offsets, send order)
#        │                                                          │
#        │                        control round: all-gather (generation, epoch, status, counts)
#        │                        every rank checks the same matrix; any disagreement aborts ALL ranks
#        │                        before a single payload byte moves
#        ▼                                                          ▼
#   payload all-to-all-v (rows + slot ids [+ fp8 scales]) ──> receive plan (expert-major repack)
#        ──> expert runner ──> inverse repack ──> return all-to-all-v ──> inverse send ──> gated combine
#
#  Pure: no Ray. The exchange backend (local threads, Ray object store, NCCL) is passed in.
# ======================================================================================================
"""SPMD dispatch and combine of one MoE layer on one rank (spec 0x03, 0x0CC, 0x0CD, 0x0E)."""

from __future__ import annotations

import numpy as np
import torch

from ray_moe.moe.dispatch.combine import combine_from_send
from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.dispatch.plan import (
    check_assignment,
    count_by,
    plan_receive,
    plan_source,
    semantic_from_send,
    source_major_from_expert,
)
from ray_moe.moe.dispatch.precision import dequantize, quantize, scales_per_row
from ray_moe.moe.dispatch.protocol import (
    DTYPE_CODES,
    ControlRecord,
    ControlStatus,
    DeferredChecks,
    Dispatcher,
    control_round,
    fence,
    global_counts,
    reject_corrupt,
)
from ray_moe.core.routes import RouteBatch, SemanticRoutes
from ray_moe.moe.dispatch.records import (
    DispatchHandle,
    NormalDispatchOutput,
)
from ray_moe.core.errors import CountAgreementError, RouteValidationError
from ray_moe.placement.selector import ReplicaSelector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.core.types import DispatchMode, PayloadFormat


def dispatch(
    batch: RouteBatch,
    snapshot: PlacementSnapshot,
    exchange: Exchange,
    *,
    selector: ReplicaSelector,
    tag: str,
    payload_format: PayloadFormat = PayloadFormat.NATIVE,
    status: ControlStatus = ControlStatus.OK,
) -> NormalDispatchOutput:
    """Variable dispatch of one rank's routes (the normal / prefill mode, the reference protocol).

    ``status`` lets the caller refuse the step (e.g. a stale generation) while still taking part in the
    control round, so every peer aborts together.
    """
    rank = exchange.rank
    # 1. semantic routes, validated before anything is exchanged
    error: Exception | None = None
    physical = torch.zeros(0, dtype=torch.int64)
    try:
        batch.validate(snapshot.num_experts)
        if batch.origin_rank != rank:
            raise RouteValidationError(f"origin_rank={batch.origin_rank} but this endpoint is rank {rank}")
        routes = SemanticRoutes.from_batch(batch)
        # 2. replica selection + compatibility predicate
        physical = selector.select(routes, snapshot).to(routes.logical_expert.device)
        check_assignment(routes, physical, snapshot)
    except RouteValidationError as exc:
        error = exc
        status = ControlStatus.BAD_INPUT if status == ControlStatus.OK else status
        routes = _empty_routes(rank, batch)
    # 3. source plan
    p = exchange.size
    if error is None:
        source = plan_source(routes, physical, snapshot)
        # one host copy: the split vector and the per-slot counts (layer statistics)
        host = torch.cat([source.send_counts, count_by(physical, snapshot.num_slots)]).cpu().numpy()
        declared, sent_slots = host[:p].astype(np.int64), host[p:]
    else:
        source = None
        declared, sent_slots = np.zeros(p, dtype=np.int64), np.zeros(snapshot.num_slots, dtype=np.int64)
    # 4. control round: every rank sees the same records and makes the same decision
    width = int(batch.hidden.shape[1]) if batch.hidden.dim() == 2 else -1
    record = ControlRecord(snapshot.generation, snapshot.pg_epoch, snapshot.layer, status,
                           routes.num_routes if error is None else 0, snapshot.map_digest, width,
                           DTYPE_CODES.get(batch.hidden.dtype, 0), scales_per_row(payload_format, max(width, 0)),
                           tuple(declared.tolist()))
    c_peer = control_round(exchange, record, tag, local_error=error)
    assert source is not None
    me = exchange.peer
    recv_counts = c_peer[:, me]
    # 5. payload exchange: rows gathered straight from hidden in send order, slot ids and scales alongside
    dev = batch.hidden.device
    send_tokens = routes.origin_token[source.send_order]
    rows = batch.hidden.index_select(0, send_tokens)
    data, scales = quantize(rows, payload_format)
    payload = {"x": data, "slot": source.send_slot.to(torch.int32)}
    if scales is not None:
        payload["scale"] = scales
    got = exchange.all_to_all_v(f"{tag}/dispatch", payload, declared.tolist(), recv_counts.tolist())
    recv_slot = got["slot"].to(torch.int64)
    # 6. receive plan: (slot, source, send position) order
    receive = plan_receive(rank, torch.as_tensor(recv_counts, dtype=torch.int64), recv_slot, snapshot)
    order = receive.expert_order
    x = got["x"].index_select(0, order)
    s = got["scale"].index_select(0, order) if "scale" in got else None
    if (s is None) != (payload_format is PayloadFormat.NATIVE) or (
            s is not None and s.shape[1] != scales_per_row(payload_format, x.shape[1])):
        got_s = 0 if s is None else s.shape[1]
        raise CountAgreementError(
            f"{tag}: received {got_s} scales per row, payload format {payload_format.value} needs "
            f"{scales_per_row(payload_format, x.shape[1])}; payload rejected before expert compute"
        )
    handle = DispatchHandle.build(
        snapshot=snapshot, rank=rank, routes=routes, source=source, receive=receive,
        count_matrix=global_counts(c_peer, exchange.group.peer_order, snapshot.num_ranks),
        send_splits=tuple(declared.tolist()), sent_slot_counts=tuple(sent_slots.tolist()),
        recv_splits=tuple(int(x) for x in recv_counts),
    )
    return NormalDispatchOutput(rows=x, scales=s, expert_counts=receive.expert_counts, handle=handle,
                                counts_list=receive.counts_list)


def _empty_routes(rank: int, batch: RouteBatch) -> SemanticRoutes:
    z = torch.zeros(0, dtype=torch.int64)
    return SemanticRoutes(origin_rank=rank, num_tokens=0, top_k=0, origin_token=z, route_slot=z,
                          logical_expert=z, gate=torch.zeros(0, dtype=torch.float32))


def handle_ok(handle: DispatchHandle) -> torch.Tensor:
    """Device-side check (no host sync) that the inverse send permutation inverts the send order:
    a 0-d bool tensor, read together with the output before it is published (fault 4 of spec 0x0E)."""
    src = handle.source
    r = src.send_order.numel()
    if src.inverse_send.numel() != r:
        return torch.zeros((), dtype=torch.bool, device=src.send_order.device)
    if r == 0:
        return torch.ones((), dtype=torch.bool, device=src.send_order.device)
    return (src.send_order[src.inverse_send] == torch.arange(r, device=src.send_order.device)).all()


def check_handle(handle: DispatchHandle) -> None:
    """Reject a corrupt inverse permutation now (one host sync)."""
    reject_corrupt(handle.handle_id, bool(handle_ok(handle)))


def combine(
    expert_rows: torch.Tensor,
    handle: DispatchHandle,
    snapshot: PlacementSnapshot,
    exchange: Exchange,
    *,
    tag: str,
    out_dtype: torch.dtype,
    checks: DeferredChecks | None = None,
) -> torch.Tensor:
    """Return path of one rank: inverse repack, return all-to-all-v, inverse send, gated combine.

    expert_rows: [N, d] expert outputs in expert-major order (no gate applied)
    returns:     [T, d] ``out_dtype`` combined output of this rank's origin tokens
    checks: the handle check is deferred into it (read with the output before it is published); without
    it the handle is checked now.
    """
    fence(handle, snapshot)
    if expert_rows.shape[0] != handle.receive.num_rows:
        raise RouteValidationError(
            f"expert_rows: {expert_rows.shape[0]} rows but the handle received {handle.receive.num_rows}"
        )
    if checks is None:
        check_handle(handle)
    else:
        checks.add(handle.handle_id, handle_ok(handle))
    back = source_major_from_expert(expert_rows, handle.receive)
    recv_counts = list(handle.recv_splits) or handle.receive.recv_counts.tolist()
    send_counts = list(handle.send_splits) or handle.source.send_counts.tolist()
    got = exchange.all_to_all_v(f"{tag}/combine", {"y": back}, recv_counts, send_counts)
    return combine_from_send(got["y"], handle.source, handle.routes, out_dtype)


class EngineDispatcher(Dispatcher):
    """The reference protocol behind the dispatcher contract: slot ids travel with the rows, every payload
    format (rows are dequantised before the runner), the flat or hierarchical schedule."""

    mode = DispatchMode.ENGINE

    def __init__(self, exchange: Exchange, selector: ReplicaSelector, *,
                 payload_format: PayloadFormat = PayloadFormat.NATIVE, compute_dtype: torch.dtype | None = None) -> None:
        self.exchange = exchange
        self.selector = selector
        self.payload_format = payload_format
        self.compute_dtype = compute_dtype

    def dispatch(self, batch: RouteBatch, snapshot: PlacementSnapshot, *, tag: str,
                 status: ControlStatus = ControlStatus.OK) -> NormalDispatchOutput:
        out = dispatch(batch, snapshot, self.exchange, selector=self.selector, tag=tag,
                       payload_format=self.payload_format, status=status)
        if out.scales is None and self.payload_format is PayloadFormat.NATIVE:
            return out
        x = dequantize(out.rows, out.scales, self.payload_format, self.compute_dtype or batch.hidden.dtype)
        return NormalDispatchOutput(rows=x, scales=None, expert_counts=out.expert_counts, handle=out.handle,
                                    counts_list=out.counts_list)

    def combine(self, expert_rows: torch.Tensor, handle: DispatchHandle, snapshot: PlacementSnapshot, *, tag: str,
                out_dtype: torch.dtype, checks: DeferredChecks | None = None) -> torch.Tensor:
        return combine(expert_rows, handle, snapshot, self.exchange, tag=tag, out_dtype=out_dtype, checks=checks)

    def handle_ok(self, handle: DispatchHandle) -> torch.Tensor:
        return handle_ok(handle)

    def sent_slot_counts(self, handle: DispatchHandle) -> np.ndarray:
        return np.asarray(handle.sent_slot_counts, dtype=np.int64)
