# ======================================================================================================
#  THE ONE-RANK DATA PATH (a group of one: every slot is local; no exchange, no host sync)
#
#   PLANNED (no replicated expert; on CUDA every step a Triton plan takes, on CPU always):
#   routes [T, k] ──> route plan (one launch up to ROUTE_PLAN_MAX routes, three above: local slot, stable
#                     expert-major order, slot row ends, gates)
#        ──> expert runner reads each token's row through the order (no gathered copy; EXPERT_MAJOR_INDEXED)
#        ──> gated FP32 combine that checks the handle as it reads it (one launch)
#
#   GENERAL (replicas, or CUDA steps no Triton plan takes):
#   routes [T, k] (id -1: a padding route) ──> replica selection ──> local slot of every route
#        ──> stable order by slot (counting sort up to COUNTING_ORDER_MAX) = the expert-major order
#        ──> rows gathered ──> expert runner on device-side offsets (grouped launches; empty slots read no
#        weights) ──> gated FP32 combine: each route reads its row back (padding routes read nothing)
#
#  Used for prefill and decode when the process group has one member (one GPU holding every expert): fixed
#  shapes for a fixed T, so a decode step captures as one CUDA graph (4 launches a layer on the planned path).
# ======================================================================================================
"""Dispatch/combine of a one-rank group (the dispatcher contract without an exchange)."""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass

import torch

from ray_moe.moe.dispatch.bucket import BucketShape, bucket_for
from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.dispatch.kernels import gated_combine
from ray_moe.moe.dispatch.plan import expert_major_order
from ray_moe.moe.dispatch.protocol import ControlStatus, DeferredChecks, Dispatcher, fence
from ray_moe.moe.dispatch.records import DispatchOutputFormat, DispatchOutput, Handle
from ray_moe.moe.dispatch.route_plan import (RoutePlan, RouteTables, combine_planned, kernel_available, plan_routes,
                                             route_tables)
from ray_moe.core.routes import RouteBatch, SemanticRoutes
from ray_moe.core.errors import RouteValidationError, StaleGenerationError
from ray_moe.placement.selector import ReplicaSelector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.core.types import DispatchMode


@dataclass(frozen=True, eq=False)
class LocalHandle(Handle):
    """gates: [T*k] float32 (0 for padding routes); dest: [T*k] int64 expert-major row of each route;
    route_valid: [T*k] bool; sent_slots: [Q] int64 routes per physical slot; overflow: 0-d bool (never)."""

    num_tokens: int
    top_k: int
    gates: torch.Tensor
    dest: torch.Tensor
    route_valid: torch.Tensor
    sent_slots: torch.Tensor
    overflow: torch.Tensor


@dataclass(frozen=True, eq=False)
class LocalDispatchOutput(DispatchOutput):
    """rows: [T*k, d] expert-major (rows past ``offsets[-1]`` are padding, never computed);
    offsets: [Q_local] int32 device-side inclusive prefix of the rows per local slot; valid: [Q_local] int64."""

    format = DispatchOutputFormat.EXPERT_MAJOR_DEVICE_OFFSETS

    offsets: torch.Tensor | None = None
    valid: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class PlannedHandle(Handle):
    """The planned path's handle: the route plan (``route_plan.RoutePlan``) and the step's T and k."""

    num_tokens: int
    top_k: int
    plan: RoutePlan


@dataclass(frozen=True, eq=False)
class PlannedDispatchOutput(DispatchOutput):
    """rows: [T, d] the token-major input (not gathered); order: [T*k] int32 route of each expert-major row;
    offsets: [Q_local] int32 device-side inclusive row ends per local slot; valid: [Q_local] int64 rows per
    slot; top_k: k (row r reads rows[order[r] // k])."""

    format = DispatchOutputFormat.EXPERT_MAJOR_INDEXED

    order: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    top_k: int = 1


class LocalDispatcher(Dispatcher):
    """The contract for a group of one. ``validate``: check the routes on the host (one sync; the decode path
    checks a step's routes once instead). ``token_cap``: the decode token bucket (``for_tokens``).
    ``planned``: take the planned path where it applies (False: always the general path, an ablation)."""

    mode = DispatchMode.LOCAL
    masks_rows = True  # takes a RouteBatch's row_valid (the planned path folds it into the plan)

    def __init__(self, exchange: Exchange, selector: ReplicaSelector, *, validate: bool = True,
                 token_cap: int | None = None, top_k: int = 1, hidden_size: int = 0, planned: bool = True) -> None:
        if exchange.size != 1:
            raise ValueError(f"exchange: a group of {exchange.size}; the local path serves a group of one")
        self.exchange = exchange
        self.selector = selector
        self.validate = validate
        self.token_cap = self.max_token_cap = token_cap or 0
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.planned = planned

    def for_tokens(self, tokens: int) -> "LocalDispatcher":
        d = copy.copy(self)
        d.token_cap = bucket_for(max(int(tokens), 1), self.max_token_cap)
        return d

    def shape(self, snapshot: PlacementSnapshot) -> BucketShape:
        """The bucket geometry this path stands for: a slot can take every token of the bucket once."""
        return BucketShape(1, self.token_cap, self.top_k, self.token_cap * self.top_k,
                           int(snapshot.rank_num_slots[self.exchange.rank]), self.token_cap, self.hidden_size)

    def dispatch(self, batch: RouteBatch, snapshot: PlacementSnapshot, *, tag: str,
                 status: ControlStatus = ControlStatus.OK) -> LocalDispatchOutput:
        """batch.hidden [T, d], topk_ids [T, k] int64 (-1: padding), topk_weights [T, k] -> expert-major rows."""
        if status == ControlStatus.STALE_GENERATION:
            raise StaleGenerationError(f"{tag}: rank {self.exchange.rank} refused generation {snapshot.generation} "
                                       f"for new dispatch; step aborted before any expert ran",
                                       requested=snapshot.generation)
        if status != ControlStatus.OK:
            raise RouteValidationError(f"{tag}: the step was refused ({status.name}) before dispatch")
        if self.validate:
            batch.validate(snapshot.num_experts)
        h, ids, w = batch.hidden, batch.topk_ids, batch.topk_weights
        t, k = int(ids.shape[0]), int(ids.shape[1])
        dev = h.device
        rank = self.exchange.rank
        q_local = int(snapshot.rank_num_slots[rank])
        planned = self.planned and (not ids.is_cuda or kernel_available(ids, q_local))
        tables = self._tables(snapshot, dev) if planned else None
        if tables is not None:
            return self._dispatch_planned(batch, snapshot, tables)
        if batch.row_valid is not None:
            ids = torch.where(batch.row_valid[:, None], ids, torch.full_like(ids, -1))
        maps = snapshot.on(dev)
        e = ids.reshape(-1).to(torch.int64)
        valid = e >= 0
        routes = SemanticRoutes(origin_rank=rank, num_tokens=t, top_k=k,
                                origin_token=torch.arange(t * k, device=dev) // max(k, 1),
                                route_slot=torch.arange(t * k, device=dev) % max(k, 1),
                                logical_expert=e.clamp_min(0), gate=w.reshape(-1).to(torch.float32), dense=True)
        phys = self.selector.select(routes, snapshot).to(dev)
        local = torch.where(valid, maps.slot_local[phys], torch.full_like(phys, q_local))
        # 1. expert-major order: stable by local slot (padding routes last); a counting sort at decode sizes
        order, dest, counts = expert_major_order(local, q_local + 1)
        counts = counts[:q_local]
        rows = h.index_select(0, order // max(k, 1))
        handle = LocalHandle(
            handle_id=f"local-h{snapshot.generation}-r{rank}-{uuid.uuid4().hex[:10]}", generation=snapshot.generation,
            layer=snapshot.layer, pg_epoch=snapshot.pg_epoch, rank=rank, num_tokens=t, top_k=k,
            gates=routes.gate * valid, dest=dest, route_valid=valid,
            sent_slots=torch.zeros(snapshot.num_slots, dtype=torch.int64, device=dev).scatter_add_(
                0, phys.clamp_min(0), valid.to(torch.int64)),
            overflow=torch.zeros((), dtype=torch.bool, device=dev))
        return LocalDispatchOutput(rows=rows, counts_list=(), handle=handle,
                                   offsets=torch.cumsum(counts, 0).to(torch.int32), valid=counts)

    def _tables(self, snapshot: PlacementSnapshot, dev: torch.device) -> RouteTables | None:
        """The snapshot's one-rank route tables on ``dev`` (built once from its host maps, then cached; None
        when an expert is replicated: the selector chooses among replicas on the general path)."""
        rank = self.exchange.rank

        def build() -> RouteTables | None:
            tables = route_tables(snapshot.slot_local, snapshot.slot_rank, snapshot.log2phy, rank,
                                  int(snapshot.rank_num_slots[rank]))
            return None if tables is None else RouteTables(tables.expert_slot.to(dev), tables.phys_local.to(dev),
                                                           tables.num_local)

        return snapshot.cached(("route_tables", rank, str(dev)), build)

    def _dispatch_planned(self, batch: RouteBatch, snapshot: PlacementSnapshot,
                          tables: RouteTables) -> PlannedDispatchOutput:
        """The planned path: one route-plan launch; the rows stay where they are."""
        t, k = int(batch.topk_ids.shape[0]), int(batch.topk_ids.shape[1])
        rank = self.exchange.rank
        plan = plan_routes(batch.topk_ids, batch.topk_weights, batch.row_valid, tables)
        handle = PlannedHandle(
            handle_id=f"local-h{snapshot.generation}-r{rank}-{uuid.uuid4().hex[:10]}", generation=snapshot.generation,
            layer=snapshot.layer, pg_epoch=snapshot.pg_epoch, rank=rank, num_tokens=t, top_k=k, plan=plan)
        return PlannedDispatchOutput(rows=batch.hidden, counts_list=(), handle=handle, order=plan.order,
                                     offsets=plan.ends, valid=plan.slot_rows, top_k=k)

    def combine(self, expert_rows: torch.Tensor, handle: LocalHandle | PlannedHandle, snapshot: PlacementSnapshot,
                *, tag: str, out_dtype: torch.dtype, checks: DeferredChecks | None = None) -> torch.Tensor:
        """expert_rows [T*k, d] (expert-major, no gate) -> [T, d]: each route reads its row back, gated, FP32."""
        fence(handle, snapshot)
        t, k = handle.num_tokens, handle.top_k
        if expert_rows.dim() != 2 or expert_rows.shape[0] != t * k:
            raise RouteValidationError(f"expert_rows: shape {tuple(expert_rows.shape)} but the handle dispatched "
                                       f"{t * k} routes")
        if isinstance(handle, PlannedHandle):  # the combine checks the plan as it reads it
            out = combine_planned(expert_rows, handle.plan, k, out_dtype)
            self._check(handle, checks)
            return out
        self._check(handle, checks)
        # padding routes read a zero row (rows past offsets[-1] were never computed); one pass on CUDA (Triton)
        src = torch.where(handle.route_valid, handle.dest, torch.full_like(handle.dest, -1)).view(t, k)
        zero = expert_rows.new_zeros(1, expert_rows.shape[1])
        return gated_combine(expert_rows, zero, src, handle.gates.view(t, k), out_dtype)

    def handle_ok(self, handle: LocalHandle | PlannedHandle) -> torch.Tensor:
        """``dest`` maps the routes one-to-one onto the dispatched rows (a planned handle: its combine found
        every route's row to be its own, ``plan.ok``)."""
        if isinstance(handle, PlannedHandle):
            return handle.plan.ok
        n = handle.dest.numel()
        hits = torch.zeros(n + 1, dtype=torch.int64, device=handle.dest.device).scatter_add_(
            0, handle.dest.clamp(0, n), torch.ones_like(handle.dest))
        return (hits[:n] == 1).all() & ((handle.dest >= 0) & (handle.dest < n)).all()

    def sent_slot_counts(self, handle: LocalHandle | PlannedHandle) -> torch.Tensor:
        return handle.plan.sent if isinstance(handle, PlannedHandle) else handle.sent_slots

    def slot_rows(self, out: LocalDispatchOutput | PlannedDispatchOutput) -> torch.Tensor:
        return out.valid


__all__ = ["LocalDispatcher", "LocalHandle", "LocalDispatchOutput", "PlannedDispatchOutput", "PlannedHandle"]
