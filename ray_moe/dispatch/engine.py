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

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from ray_moe.dispatch.combine import combine_from_send
from ray_moe.dispatch.exchange.base import Exchange
from ray_moe.dispatch.plan import (
    check_assignment,
    plan_receive,
    plan_source,
    semantic_from_send,
    source_major_from_expert,
)
from ray_moe.dispatch.precision import quantize, scales_per_row
from ray_moe.dispatch.records import (
    DispatchHandle,
    NormalDispatchOutput,
    RouteBatch,
    SemanticRoutes,
)
from ray_moe.errors import CountAgreementError, RouteValidationError, StaleGenerationError
from ray_moe.placement.selector import ReplicaSelector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.types import PayloadFormat


class ControlStatus(IntEnum):
    """What a rank reports in the control round before any payload moves."""

    OK = 0
    STALE_GENERATION = 1
    BAD_INPUT = 2
    FAULT = 3


_HEADER = 9  # generation, pg_epoch, layer, status, num_routes, map_digest, hidden_width, dtype_code, scale_cols
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}


@dataclass(frozen=True)
class ControlRecord:
    """One rank's contribution to the control round (an int64 vector on the wire)."""

    generation: int
    pg_epoch: int
    layer: int
    status: ControlStatus
    num_routes: int
    map_digest: int
    hidden_width: int
    dtype_code: int
    scale_cols: int  # FP32 scales per payload row (0 for a native payload)
    send_counts: tuple[int, ...]  # peer-slot order

    def to_array(self) -> np.ndarray:
        head = [self.generation, self.pg_epoch, self.layer, int(self.status), self.num_routes, self.map_digest,
                self.hidden_width, self.dtype_code, self.scale_cols]
        return np.asarray(head + list(self.send_counts), dtype=np.int64)

    @staticmethod
    def from_array(a: np.ndarray) -> "ControlRecord":
        return ControlRecord(int(a[0]), int(a[1]), int(a[2]), ControlStatus(int(a[3])), int(a[4]), int(a[5]),
                             int(a[6]), int(a[7]), int(a[8]), tuple(int(x) for x in a[_HEADER:]))


def agree(records: list[ControlRecord], group_ranks: tuple[int, ...], tag: str) -> np.ndarray:
    """Check the all-gathered control records (identical on every rank, so every rank decides alike).

    Returns the peer-ordered count matrix [P, P] (row = source peer, column = destination peer).
    Raises ``StaleGenerationError`` or ``CountAgreementError`` naming the offending ranks.
    """
    stale = [group_ranks[i] for i, r in enumerate(records) if r.status == ControlStatus.STALE_GENERATION]
    if stale:
        gens = sorted({r.generation for r in records})
        raise StaleGenerationError(
            f"{tag}: rank(s) {stale} refused generation(s) {gens} for new dispatch; step aborted on every rank "
            f"before payload exchange",
            requested=records[0].generation,
        )
    bad = [(group_ranks[i], r.status.name) for i, r in enumerate(records) if r.status != ControlStatus.OK]
    if bad:
        raise CountAgreementError(f"{tag}: rank(s) {bad} aborted the step before payload exchange")
    first = records[0]
    for i, r in enumerate(records):
        if r.scale_cols != first.scale_cols:
            raise CountAgreementError(
                f"{tag}: rank {group_ranks[i]} declares {r.scale_cols} FP8 scales per row but rank {group_ranks[0]} "
                f"declares {first.scale_cols}: scale count mismatch, payload rejected before expert compute "
                f"(before it moved)"
            )
        for name in ("generation", "pg_epoch", "layer", "map_digest", "hidden_width", "dtype_code"):
            if getattr(r, name) != getattr(first, name):
                raise CountAgreementError(
                    f"{tag}: rank {group_ranks[i]} reports {name}={getattr(r, name)} but rank {group_ranks[0]} "
                    f"reports {getattr(first, name)}; aborted before payload exchange"
                )
        if len(r.send_counts) != len(records):
            raise CountAgreementError(
                f"{tag}: rank {group_ranks[i]} sent a split vector of {len(r.send_counts)} peers for a group of "
                f"{len(records)}"
            )
        if sum(r.send_counts) != r.num_routes or min(r.send_counts, default=0) < 0:
            raise CountAgreementError(
                f"{tag}: rank {group_ranks[i]} declares split vector {list(r.send_counts)} (sum "
                f"{sum(r.send_counts)}) for {r.num_routes} accepted routes; aborted before payload exchange"
            )
    return np.asarray([r.send_counts for r in records], dtype=np.int64)


def dispatch(
    batch: RouteBatch,
    snapshot: PlacementSnapshot,
    exchange: Exchange,
    *,
    selector: ReplicaSelector,
    tag: str,
    payload_format: PayloadFormat = PayloadFormat.NATIVE,
    status: ControlStatus = ControlStatus.OK,
    count_fault: int = 0,
    scale_fault: bool = False,
) -> NormalDispatchOutput:
    """Variable dispatch of one rank's routes (the normal / prefill mode).

    ``status`` lets the caller refuse the step (e.g. a stale generation) while still taking part in the
    control round, so every peer aborts together. ``count_fault`` perturbs the declared split vector
    (fault injection: peers then disagree and all abort before payload). ``scale_fault`` declares one FP8
    scale column too many (fault injection: the payload is rejected on every rank before expert compute,
    in fact before it moves).
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
        declared = source.send_counts.cpu().numpy().astype(np.int64)
    else:
        source = None
        declared = np.zeros(p, dtype=np.int64)
    if count_fault:
        declared = declared.copy()
        declared[(exchange.peer + 1) % p] += count_fault
    # 4. control round: every rank sees the same records and makes the same decision
    width = int(batch.hidden.shape[1]) if batch.hidden.dim() == 2 else -1
    scale_cols = scales_per_row(payload_format, max(width, 0)) + (1 if scale_fault else 0)
    record = ControlRecord(snapshot.generation, snapshot.pg_epoch, snapshot.layer, status,
                           routes.num_routes if error is None else 0, snapshot.map_digest, width,
                           DTYPE_CODES.get(batch.hidden.dtype, 0), scale_cols, tuple(declared.tolist()))
    gathered = exchange.all_gather(f"{tag}/ctl", record.to_array())
    records = [ControlRecord.from_array(row) for row in gathered]
    try:
        c_peer = agree(records, exchange.group.peer_order, tag)
    except Exception:
        if error is not None:
            raise error
        raise
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
    # global-rank count matrix C[p, u]
    peer_order = np.asarray(exchange.group.peer_order)
    c_global = np.zeros((snapshot.num_ranks, snapshot.num_ranks), dtype=np.int64)
    c_global[np.ix_(peer_order, peer_order)] = c_peer
    handle = DispatchHandle.build(
        snapshot=snapshot, rank=rank, routes=routes, source=source, receive=receive,
        count_matrix=torch.from_numpy(c_global), send_splits=tuple(declared.tolist()),
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


def reject_corrupt(handle_id: str, ok: bool) -> None:
    if not ok:
        raise RouteValidationError(f"handle {handle_id}: inverse_send is not the inverse of send_order; "
                                   f"output rejected before publish")


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
    deferred_check: list | None = None,
) -> torch.Tensor:
    """Return path of one rank: inverse repack, return all-to-all-v, inverse send, gated combine.

    expert_rows: [N, d] expert outputs in expert-major order (no gate applied)
    returns:     [T, d] ``out_dtype`` combined output of this rank's origin tokens
    deferred_check: if a list, the handle check is appended as (handle id, device flag) for the caller
    to read with the output before publishing it; otherwise it is checked now.
    """
    if snapshot.generation != handle.generation or snapshot.layer != handle.layer:
        raise StaleGenerationError(
            f"combine of {handle.handle_id}: handle generation {handle.generation} layer {handle.layer} but the "
            f"snapshot given is generation {snapshot.generation} layer {snapshot.layer}",
            requested=handle.generation,
        )
    if expert_rows.shape[0] != handle.receive.num_rows:
        raise RouteValidationError(
            f"expert_rows: {expert_rows.shape[0]} rows but the handle received {handle.receive.num_rows}"
        )
    if deferred_check is None:
        check_handle(handle)
    else:
        deferred_check.append((handle.handle_id, handle_ok(handle)))
    back = source_major_from_expert(expert_rows, handle.receive)
    recv_counts = list(handle.recv_splits) or handle.receive.recv_counts.tolist()
    send_counts = list(handle.send_splits) or handle.source.send_counts.tolist()
    got = exchange.all_to_all_v(f"{tag}/combine", {"y": back}, recv_counts, send_counts)
    return combine_from_send(got["y"], handle.source, handle.routes, out_dtype)
