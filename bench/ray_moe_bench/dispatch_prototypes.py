"""Prototype data-path pieces the dispatch + combine benchmark compares against the runtime's paths
(``ours_fast`` / ``ours_fastcombine`` / ``raw_selfgroup`` in ``dispatch_combine.py``): the engine protocol
with device-resident snapshots and no per-step host syncs, a gather-based combine, and an all-to-all-v with
the self segment inside the NCCL group. Each gives the same results as ``dispatch.engine`` (checked by the
benchmark on every case). Benchmark code, not used by the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ray_moe.moe.dispatch.combine import combine_routes
from ray_moe.moe.dispatch.engine import dispatch
from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.dispatch.plan import exclusive_offsets, inverse_permutation, semantic_from_send
from ray_moe.moe.dispatch.protocol import DTYPE_CODES, ControlRecord, ControlStatus, agree
from ray_moe.core.routes import RouteBatch, SemanticRoutes
from ray_moe.moe.dispatch.records import (
    DispatchHandle,
    NormalDispatchOutput,
    ReceivePlan,
    SourcePlan,
)
from ray_moe.placement.selector import ReplicaSelector
from ray_moe.placement.snapshot import PlacementSnapshot


def host_splits(handle: DispatchHandle, exchange: Exchange) -> tuple[list[int], list[int]]:
    """(send, recv) split vectors in peer-slot order from the handle's host count matrix C[p, u]."""
    c = handle.count_matrix.tolist()
    peers = exchange.group.peer_order
    me = handle.rank
    return [int(c[me][u]) for u in peers], [int(c[u][me]) for u in peers]


def combine_fast(expert_rows: torch.Tensor, handle: DispatchHandle, exchange: Exchange, *, tag: str,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """The combine proposed in the report, built from public pieces (same result as ``engine.combine``).

    expert_rows: [N, d] expert-major rows (no gate) -> [T, d] ``out_dtype``.
      1. inverse repack as a gather with inverse(expert_order) (an index_put scatter today)
      2. return all-to-all-v with split vectors read from the host count matrix (no device->host copy)
      3. dense routes (R = T*k, semantic order r = t*k + j): y_t = sum_j g_tj * row(t, j) as k FP32
         addcmul passes over [T, d], reading each returned bf16 row once: no [R, d] FP32 temporary, no
         atomics; other route sets fall back to ``combine_routes``.
    """
    receive, source, routes = handle.receive, handle.source, handle.routes
    # 1. source-major return buffer
    back = expert_rows.index_select(0, inverse_permutation(receive.expert_order))
    # 2. return exchange
    send, recv = host_splits(handle, exchange)
    got = exchange.all_to_all_v(f"{tag}/combine", {"y": back}, recv, send)["y"]
    # 3. gated sum in route-slot passes
    t, k = routes.num_tokens, routes.top_k
    if t * k != routes.num_routes:
        return combine_routes(semantic_from_send(got, source), routes, out_dtype)
    pos = source.inverse_send.view(t, k)
    gate = routes.gate.to(got.device).view(t, k)
    acc = torch.zeros(t, got.shape[1], dtype=torch.float32, device=got.device)
    for j in range(k):
        acc.addcmul_(got.index_select(0, pos[:, j]), gate[:, j:j + 1])
    return acc.to(out_dtype)


@dataclass(frozen=True, eq=False)
class DeviceSnapshot:
    """Device-resident copies of the snapshot tensors the data path reads every step (built once per
    generation and device; today every step copies them from pageable host memory, one stream sync each).

    phy2log [Q], slot_rank [Q], slot_local [Q], rank_to_peer [P], logcnt [E]: int64; log2phy [E, M] int64;
    local_slot_ids [Q_local] int64: this rank's slots in local order.
    """

    phy2log: torch.Tensor
    slot_rank: torch.Tensor
    slot_local: torch.Tensor
    rank_to_peer: torch.Tensor
    logcnt: torch.Tensor
    log2phy: torch.Tensor
    local_slot_ids: torch.Tensor

    @staticmethod
    def build(snap: PlacementSnapshot, rank: int, device: torch.device) -> "DeviceSnapshot":
        return DeviceSnapshot(*(t.to(device) for t in (snap.phy2log, snap.slot_rank, snap.slot_local,
                                                        snap.rank_to_peer, snap.logcnt, snap.log2phy,
                                                        snap.rank_slot_ids(rank))))


def _count(index: torch.Tensor, n: int) -> torch.Tensor:
    """bincount(index, minlength=n) without the host sync CUDA bincount takes to size its output: [n] int64."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).scatter_add_(0, index, torch.ones_like(index))


def fast_dispatch(batch: RouteBatch, snap: PlacementSnapshot, dsnap: DeviceSnapshot, exchange: Exchange, *,
                  tag: str, selector: ReplicaSelector) -> NormalDispatchOutput:
    """The dispatch proposed in the report: ``engine.dispatch``'s protocol and results (round-robin
    replicas, same control record, same payload and handle) with one device->host copy before the control
    round instead of ~20 stream syncs.

      1. semantic routes; round-robin replica choice on device (no bincount sync, device snapshot)
      2. source plan on device: send order, split vector, per-rank counts (scatter_add counts)
      3. value checks of the engine's validation as device flags, copied to the host together with the
         split vector (ONE sync); any flag set -> ``engine.dispatch`` (which raises the exact error on
         this rank and aborts every peer in the control round)
      4. control round and agreement (unchanged)
      5. payload (rows + int32 slot ids, unchanged)
      6. receive plan on device: local slot of each row, stable sort, per-slot counts (scatter_add)
    Shape checks (host-only) stay ``RouteBatch.validate``'s; the receive side's "slot hosted here" check
    becomes a device flag read at the next sync (``counts_list``).
    """
    rank, p, dev = exchange.rank, exchange.size, batch.hidden.device
    q, num_e = snap.num_slots, snap.num_experts
    h, ids, w = batch.hidden, batch.topk_ids, batch.topk_weights
    if h.dim() != 2 or ids.dim() != 2 or ids.shape[0] != h.shape[0] or w.shape != ids.shape:
        return dispatch(batch, snap, exchange, selector=selector, tag=tag)
    # 1. routes and replica choice (RoundRobinSelector: replica (i + origin) mod logcnt[e])
    routes = SemanticRoutes.from_batch(batch)
    e = routes.logical_expert
    r = e.numel()
    ec = e.clamp(0, num_e - 1)
    order = torch.sort(ec, stable=True).indices
    per_e = _count(ec, num_e)
    starts = torch.cumsum(per_e, 0) - per_e
    pos = torch.empty_like(ec)
    pos[order] = torch.arange(r, device=dev) - starts[ec[order]]
    slots = dsnap.log2phy[ec, (pos + rank) % dsnap.logcnt[ec]]
    # 2. source plan
    dest_rank = dsnap.slot_rank[slots]
    dest_peer = dsnap.rank_to_peer[dest_rank]
    send_order = torch.sort(dest_peer * q + slots, stable=True).indices
    send_counts = _count(dest_peer, p)
    # 3. validation flags + split vector: one device->host copy
    flags = torch.stack([
        ((e < 0) | (e >= num_e)).any(),
        (~torch.isfinite(w)).any() | (w < 0).any(),
        (~torch.isfinite(h)).any(),
        (dsnap.phy2log[slots] != e).any(),
    ]).to(torch.int64)
    host = torch.cat([flags, send_counts]).cpu().numpy()
    if host[:4].any():
        return dispatch(batch, snap, exchange, selector=selector, tag=tag)
    declared = host[4:]
    # 4. control round
    record = ControlRecord(generation=snap.generation, pg_epoch=snap.pg_epoch, layer=snap.layer,
                           status=ControlStatus.OK, num_routes=r, map_digest=snap.map_digest,
                           hidden_width=int(h.shape[1]), dtype_code=DTYPE_CODES.get(h.dtype, 0), scale_cols=0,
                           send_counts=tuple(int(c) for c in declared))
    gathered = exchange.all_gather(f"{tag}/ctl", record.to_array())
    c_peer = agree([ControlRecord.from_array(row) for row in gathered], exchange.group.peer_order, tag)
    recv_counts = c_peer[:, exchange.peer]
    # 5. payload
    send_slot = slots[send_order]
    got = exchange.all_to_all_v(f"{tag}/dispatch",
                                {"x": h.index_select(0, routes.origin_token[send_order]),
                                 "slot": send_slot.to(torch.int32)},
                                declared.tolist(), recv_counts.tolist())
    recv_slot = got["slot"].to(torch.int64)
    # 6. receive plan
    local = dsnap.slot_local[recv_slot]
    expert_order = torch.sort(local, stable=True).indices
    expert_counts = _count(local, int(dsnap.local_slot_ids.numel()))
    host_counts = torch.cat([expert_counts, (dsnap.slot_rank[recv_slot] != rank).any().to(torch.int64)[None]]).tolist()
    if host_counts[-1]:
        raise RuntimeError(f"{tag}: rank {rank} received a row for a slot it does not host")
    source = SourcePlan(origin_rank=rank, physical_slot=slots, dest_rank=dest_rank, dest_peer=dest_peer,
                        send_order=send_order, inverse_send=inverse_permutation(send_order), send_slot=send_slot,
                        send_counts=send_counts, send_offsets=exclusive_offsets(send_counts),
                        counts_by_rank=_count(dest_rank, snap.num_ranks))
    recv_t = torch.as_tensor(np.ascontiguousarray(recv_counts), dtype=torch.int64)
    receive = ReceivePlan(rank=rank, recv_counts=recv_t, recv_offsets=exclusive_offsets(recv_t), recv_slot=recv_slot,
                          expert_order=expert_order, slot_ids=dsnap.local_slot_ids, expert_counts=expert_counts,
                          expert_offsets=exclusive_offsets(expert_counts))
    c_global = np.zeros((snap.num_ranks, snap.num_ranks), dtype=np.int64)
    peers = np.asarray(exchange.group.peer_order)
    c_global[np.ix_(peers, peers)] = c_peer
    handle = DispatchHandle.build(snapshot=snap, rank=rank, routes=routes, source=source, receive=receive,
                                  count_matrix=torch.from_numpy(c_global))
    return NormalDispatchOutput(rows=got["x"].index_select(0, expert_order), scales=None,
                                expert_counts=expert_counts, handle=handle, counts_list=tuple(host_counts[:-1]))


def all_to_all_v_in_group(exchange: Exchange, tensors: dict[str, torch.Tensor], send: list[int],
                          recv: list[int]) -> dict[str, torch.Tensor]:
    """``NcclExchange.all_to_all_v`` with the self segment as a send/recv to self inside the NCCL group
    (NCCL copies it concurrently with the peer transfers) instead of a device copy queued before the group.
    Prototype of the patch in the report; uses the exchange's communicator."""
    nccl = exchange._nccl  # noqa: SLF001 - prototype of a patch to NcclExchange
    so = np.concatenate([[0], np.cumsum(send)])
    ro = np.concatenate([[0], np.cumsum(recv)])
    stream = torch.cuda.current_stream(exchange.device).cuda_stream
    out: dict[str, torch.Tensor] = {}
    nccl.groupStart()
    for key, t in tensors.items():
        o = torch.empty((int(ro[-1]), *t.shape[1:]), dtype=t.dtype, device=exchange.device)
        out[key] = o
        row = t.element_size() * int(np.prod(t.shape[1:], dtype=np.int64))
        for peer in range(exchange.size):
            if send[peer]:
                exchange.comm.send(t.data_ptr() + int(so[peer]) * row, int(send[peer]) * row, nccl.NCCL_UINT8, peer,
                                   stream)
            if recv[peer]:
                exchange.comm.recv(o.data_ptr() + int(ro[peer]) * row, int(recv[peer]) * row, nccl.NCCL_UINT8, peer,
                                   stream)
    nccl.groupEnd()
    return out


__all__ = ["DeviceSnapshot", "all_to_all_v_in_group", "combine_fast", "fast_dispatch", "host_splits"]
