"""Typed records at the dispatch stage boundaries (spec 0x01A0, 0x03A, 0x0CB). Pure: no Ray.

route batch -> semantic routes -> source plan -> (count agreement) -> receive plan -> dispatch handle.
Every tensor field documents its shape and dtype. Records are frozen: a stage produces a new record,
it never edits one it was given.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import torch

from ray_moe.core.routes import SemanticRoutes

def _fresh_handle_id(rank: int, generation: int) -> str:
    return f"dispatch-h{generation}-r{rank}-{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True, eq=False)
class SourcePlan:
    """Origin-side dispatch layout of one rank (spec 0x03B, 0x07B).

    physical_slot: [R] int64  slot chosen for semantic route r
    dest_rank:     [R] int64  global destination rank of route r
    dest_peer:     [R] int64  peer slot of that rank in the process group
    send_order:    [R] int64  send position i holds semantic route send_order[i]
    inverse_send:  [R] int64  semantic route r sits at send position inverse_send[r]
    send_slot:     [R] int64  physical slot at each send position
    send_counts:   [G] int64  split vector in peer-slot order over the G group members (zero-count peers kept)
    send_offsets:  [G+1] int64 exclusive prefix sum with sentinel
    counts_by_rank:[P] int64  the row C[p, :] of the global-rank count matrix
    """

    origin_rank: int
    physical_slot: torch.Tensor
    dest_rank: torch.Tensor
    dest_peer: torch.Tensor
    send_order: torch.Tensor
    inverse_send: torch.Tensor
    send_slot: torch.Tensor
    send_counts: torch.Tensor
    send_offsets: torch.Tensor
    counts_by_rank: torch.Tensor


@dataclass(frozen=True, eq=False)
class ReceivePlan:
    """Destination-side layout of one rank (spec 0x03C1, 0x03C2).

    recv_counts:    [G] int64  source split vector in peer-slot order
    recv_offsets:   [G+1] int64
    recv_slot:      [N] int64  physical slot of each received row (source-major order)
    expert_order:   [N] int64  expert position i holds receive position expert_order[i]
    slot_ids:       [Q_local] int64 global slot ids of this rank in local slot order
    expert_counts:  [Q_local] int64 rows per local slot (zero-row slots kept)
    expert_offsets: [Q_local+1] int64
    inverse_expert: [N] int64 receive position -> expert position (the return gather)
    """

    rank: int
    recv_counts: torch.Tensor
    recv_offsets: torch.Tensor
    recv_slot: torch.Tensor
    expert_order: torch.Tensor
    slot_ids: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    inverse_expert: torch.Tensor | None = None  # [N] int64: receive position -> expert position
    counts_list: tuple[int, ...] = ()  # expert_counts on the host

    @property
    def num_rows(self) -> int:
        return int(self.recv_slot.numel())


@dataclass(frozen=True, eq=False)
class Handle:
    """The base of every dispatch handle: the paired dispatch/combine state of one rank for one layer
    invocation, named by the generation coordinates it was planned under (combine resolves exactly these,
    never the active generation; ``protocol.fence``)."""

    handle_id: str
    generation: int
    layer: int
    pg_epoch: int
    rank: int


class DispatchOutputFormat(str, Enum):
    """How a dispatch output lays out the rows it received (SGLang's ``DispatchOutputFormat``).

    EXPERT_MAJOR:                [N, d] rows grouped by local slot, the per-slot counts on the host
    EXPERT_MAJOR_DEVICE_OFFSETS: [N, d] rows grouped by local slot, [Q_local + 1] slot offsets on the device
                                 (nothing read back: CUDA-graph capturable)
    SLOT_CAPACITY:               [Q_local, C_q, d] fixed capacity per slot, [Q_local] valid rows per slot (device)
    EXPERT_MAJOR_INDEXED:        the token-major [T, d] rows NOT gathered, [N] int32 route of each expert-major
                                 row (row r is token order[r] // k) and [Q_local] slot row ends on the device:
                                 the runner reads each row where it lies (the gather happens in its loads)
    """

    EXPERT_MAJOR = "expert_major"
    EXPERT_MAJOR_DEVICE_OFFSETS = "expert_major_device_offsets"
    SLOT_CAPACITY = "slot_capacity"
    EXPERT_MAJOR_INDEXED = "expert_major_indexed"


@dataclass(frozen=True, eq=False)
class DispatchOutput:
    """What every dispatch mode returns (each mode has its own subclass with its extra fields); ``format``
    (a class attribute) declares the row layout, and the expert runner follows it (``moe.layer.run_experts``).

    rows:        expert-major rows: [N, d] (EXPERT_MAJOR, EXPERT_MAJOR_DEVICE_OFFSETS) or [Q_local, C_q, d]
                 (SLOT_CAPACITY); the token-major [T, d] input (EXPERT_MAJOR_INDEXED)
    counts_list: rows per local slot on the host (EXPERT_MAJOR); () when the counts stay on the device
    handle:      the paired state for ``combine``
    """

    format: ClassVar["DispatchOutputFormat"]
    rows: torch.Tensor
    counts_list: tuple[int, ...]
    handle: Handle


@dataclass(frozen=True, eq=False)
class DispatchHandle(Handle):
    """The engine's handle (spec 0x0CB): the full source and receive plans.

    ``count_matrix`` is C[p, u] over global ranks ([P, P] int64); ``sent_slot_counts`` [Q] routes this rank
    sent to each physical slot (host).
    """

    placement_version: str
    checkpoint_version: str
    process_group_id: str
    release_id: str
    routes: SemanticRoutes
    source: SourcePlan
    receive: ReceivePlan
    count_matrix: torch.Tensor
    semantic_digest: str = ""
    send_splits: tuple[int, ...] = ()  # host copies of the agreed split vectors (peer order)
    recv_splits: tuple[int, ...] = ()
    sent_slot_counts: tuple[int, ...] = ()

    @staticmethod
    def build(*, snapshot, rank: int, routes: SemanticRoutes, source: SourcePlan, receive: ReceivePlan,
              count_matrix: torch.Tensor, semantic_digest: str = "", send_splits: tuple[int, ...] = (),
              recv_splits: tuple[int, ...] = (), sent_slot_counts: tuple[int, ...] = ()) -> "DispatchHandle":
        return DispatchHandle(
            handle_id=_fresh_handle_id(rank, snapshot.generation),
            generation=snapshot.generation,
            layer=snapshot.layer,
            pg_epoch=snapshot.pg_epoch,
            rank=rank,
            placement_version=snapshot.placement_version,
            checkpoint_version=snapshot.checkpoint_version,
            process_group_id=snapshot.process_group_id,
            release_id=snapshot.release_id,
            routes=routes,
            source=source,
            receive=receive,
            count_matrix=count_matrix,
            semantic_digest=semantic_digest,
            send_splits=tuple(int(x) for x in send_splits),
            recv_splits=tuple(int(x) for x in recv_splits),
            sent_slot_counts=tuple(int(x) for x in sent_slot_counts),
        )


@dataclass(frozen=True, eq=False)
class NormalDispatchOutput(DispatchOutput):
    """Variable (all-to-all-v) dispatch result of the engine: the prefill / throughput mode.

    rows:          [N, d] payload rows in expert-major order (activation dtype, or fp8 e4m3)
    scales:        [N, S] float32 or None  per-row / per-block scales, permuted with their rows
    expert_counts: [Q_local] int64 rows per local slot
    counts_list:   the same counts on the host
    handle:        the paired DispatchHandle for combine
    """

    format = DispatchOutputFormat.EXPERT_MAJOR

    scales: torch.Tensor | None = None
    expert_counts: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class CombineOutput:
    """Combined output of one rank for one layer: ``hidden`` [T, d] in the input dtype."""

    hidden: torch.Tensor
    handle_id: str
    generation: int
