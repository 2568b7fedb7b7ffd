# ======================================================================================================
#  THE DECODE BUCKET PATH (one rank, one layer, fixed shapes: CUDA-graph capturable, no host sync)
#
#   tokens padded to [C_T] (padding: topk id -1 -> slot -1, gate 0: no expert identity)
#        ──> replica selection on the device ──> pack into fixed peer blocks [G, C_pair]
#        ──> equal-split all-to-all (static; an FP8 payload format: e4m3 rows + their scales, quantized
#            once per token, dequantized on arrival) ──> repack into expert-major capacity [Q_local, C_q]
#        ──> runner (capacity layout) ──> gather back ──> equal-split return
#        ──> gated FP32 scatter-add into [C_T, d]
#
#  Every shape depends only on the bucket (G, C_T, k, C_pair, Q_local, C_q, d), never on the step's
#  counts. Admission of the step (tokens per rank, graph key, buffers) is agreed once per step before
#  the first layer (``phases/decode.py``); the per-slot capacity clause is evaluated HERE, on the device:
#  a route that does not fit raises the handle's ``overflow`` flag and the step is rerun on the variable
#  path (never clipped). With ``C_q = G * C_T`` (worst case) no route can overflow.
# ======================================================================================================
"""Fixed-capacity decode dispatch/combine (spec 0x05C, 0x05D; the low-latency mode)."""

from __future__ import annotations

import copy
import math
import uuid
from dataclasses import dataclass

import torch

from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.dispatch.plan import count_by
from ray_moe.moe.dispatch.precision import dequantize, quantize
from ray_moe.moe.dispatch.protocol import ControlStatus, DeferredChecks, Dispatcher, fence
from ray_moe.moe.dispatch.records import DispatchOutputFormat, DispatchOutput, Handle
from ray_moe.core.routes import RouteBatch, SemanticRoutes
from ray_moe.core.errors import RouteValidationError
from ray_moe.placement.selector import ReplicaSelector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.core.types import DispatchMode, PayloadFormat


@dataclass(frozen=True)
class BucketShape:
    """Static geometry of one rank's decode bucket.

    token_cap:  C_T rows reserved for this rank's tokens
    pair_cap:   C_pair rows reserved per (this rank, peer) block, each direction
    q_local:    physical slots on this rank; slot_cap: C_q route rows reserved per local slot
    """

    group_size: int
    token_cap: int
    top_k: int
    pair_cap: int
    q_local: int
    slot_cap: int
    hidden_size: int

    @property
    def route_cap(self) -> int:
        return self.token_cap * self.top_k

    @property
    def recv_rows(self) -> int:
        return self.group_size * self.pair_cap


def pair_capacity(token_cap: int, top_k: int, slot_caps_by_rank: list[int]) -> int:
    """Rows one source can ever send one destination: min(C_T k, max over ranks of their slot capacity)."""
    return max(1, min(token_cap * top_k, max(slot_caps_by_rank) if slot_caps_by_rank else 1))


def default_slot_capacity(token_cap: int, top_k: int, group_size: int, num_slots: int, headroom: float = 2.0) -> int:
    """C_q: ``headroom`` x the even share of the bucket's routes per slot (skew beyond it reruns eagerly)."""
    return max(4, math.ceil(headroom * group_size * token_cap * top_k / max(1, num_slots)))


def worst_case_slot_capacity(token_cap: int, group_size: int) -> int:
    """C_q that no routing can exceed: a token routes to one expert (so one slot) at most once."""
    return token_cap * group_size


def token_buckets(token_cap: int) -> tuple[int, ...]:
    """The decode token capacities a deployment keeps buckets (and captured decode graphs) for, up to
    ``token_cap``: powers of two to 8, steps of 8 to 64, steps of 32 to 256, then steps of 64, and ``token_cap``
    itself (a step takes the smallest bucket its largest rank fits).

    Why this spacing: a decode step reads the weights of every expert its routes touch. Below ~64 rows per rank
    (top-8 of 128 experts) the experts touched grow with the rows, so a padding row costs weight reads and the
    sizes are fine; from 64 rows on nearly every expert is read whatever the rows, a padding row costs one row of
    dense work, and coarse sizes keep the graph count (start time, memory) low: 17 sizes up to 256."""
    caps: list[int] = []
    c = 1
    while c < token_cap:
        caps.append(c)
        c = c * 2 if c < 8 else c + (8 if c < 64 else 32 if c < 256 else 64)
    return (*caps, int(token_cap))


def bucket_for(tokens: int, token_cap: int) -> int:
    """The smallest bucket of ``token_buckets(token_cap)`` that holds ``tokens`` (``tokens <= token_cap``)."""
    return next(c for c in token_buckets(token_cap) if c >= tokens)


def bucket_shape(snapshot: PlacementSnapshot, rank: int, group_size: int, *, token_cap: int, top_k: int,
                 hidden_size: int, slot_cap: int | None) -> BucketShape:
    """The bucket geometry of ``rank`` under one snapshot (``slot_cap`` None: the default share rule)."""
    c_q = slot_cap or default_slot_capacity(token_cap, top_k, group_size, snapshot.num_slots)
    members = [int(r) for r in snapshot.peer_order.tolist()]
    caps = [c_q * int(snapshot.rank_num_slots[r]) for r in members]
    return BucketShape(group_size, token_cap, top_k, pair_capacity(token_cap, top_k, caps),
                       int(snapshot.rank_num_slots[rank]), c_q, hidden_size)


@dataclass(frozen=True, eq=False)
class BucketHandle(Handle):
    """The bucket path's handle (all tensors stay on the device; nothing here needs a host sync).

    num_tokens:  T valid tokens of this call (rows of the combined output)
    gates:       [C_T * k] float32, 0 for padding routes
    send_index:  [C_T * k] int64 flat position of each route in the peer blocks (trash row for padding)
    recv_index:  [G * C_pair] int64 flat position of each received row in the capacity layout (trash row)
    sent_slots:  [Q] int64 routes this rank sent to each physical slot (layer statistics)
    overflow:    0-d bool: some route did not fit its block or slot capacity (the step must rerun)
    """

    num_tokens: int
    shape: BucketShape
    gates: torch.Tensor
    send_index: torch.Tensor
    recv_index: torch.Tensor
    sent_slots: torch.Tensor
    overflow: torch.Tensor


@dataclass(frozen=True, eq=False)
class BucketDispatchOutput(DispatchOutput):
    """Low-latency (bucket) dispatch result: expert-major capacity layout.

    rows:  [Q_local, C_q, d] activation dtype; rows past ``valid[q]`` are zero padding
    valid: [Q_local] int64 device-side valid route rows per local slot (``masked_m``)
    """

    format = DispatchOutputFormat.SLOT_CAPACITY

    valid: torch.Tensor | None = None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 codes viewed as uint8 (indexed copies of float8 tensors are not implemented everywhere), else ``t``."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


class BucketDispatcher(Dispatcher):
    """The fixed-capacity decode mode behind the dispatcher contract.

    token_cap: C_T tokens per rank; slot_cap: C_q rows per local slot (None: 2x the even share; use
    ``worst_case_slot_capacity`` for a bucket no routing can overflow). payload_format: the rows' form on the
    wire, as the engine path's (an FP8 format: each token quantized once, every route of it carries its codes and
    scales, dequantized into ``compute_dtype`` (None: the batch's) on arrival).
    """

    mode = DispatchMode.BUCKET

    def __init__(self, exchange: Exchange, selector: ReplicaSelector, *, token_cap: int, top_k: int,
                 hidden_size: int, slot_cap: int | None = None, payload_format: PayloadFormat = PayloadFormat.NATIVE,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.exchange = exchange
        self.payload_format = PayloadFormat(payload_format)
        self.compute_dtype = compute_dtype
        self.selector = selector
        self.token_cap = int(token_cap)
        self.max_token_cap = int(token_cap)
        self.top_k = int(top_k)
        self.hidden_size = int(hidden_size)
        self.slot_cap = slot_cap
        self._shapes: dict[tuple, BucketShape] = {}

    def for_tokens(self, tokens: int) -> "BucketDispatcher":
        """This dispatcher at the smallest token bucket that holds ``tokens`` per rank (shares the shape cache)."""
        cap = bucket_for(max(int(tokens), 1), self.max_token_cap)
        if cap == self.token_cap:
            return self
        d = copy.copy(self)
        d.token_cap = cap
        return d

    def shape(self, snapshot: PlacementSnapshot) -> BucketShape:
        key = (snapshot.generation, snapshot.layer, snapshot.map_digest, self.token_cap)
        s = self._shapes.get(key)
        if s is None:
            if len(self._shapes) > 256:
                self._shapes.clear()
            s = bucket_shape(snapshot, self.exchange.rank, self.exchange.size, token_cap=self.token_cap,
                             top_k=self.top_k, hidden_size=self.hidden_size, slot_cap=self.slot_cap)
            self._shapes[key] = s
        return s

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, batch: RouteBatch, snapshot: PlacementSnapshot, *, tag: str,
                 status: ControlStatus = ControlStatus.OK) -> BucketDispatchOutput:
        """batch.hidden [T, d] with T <= C_T (padded here), topk_ids [T, k] int64 (-1 marks a padding
        route), topk_weights [T, k] float32. ``status`` is agreed once per step before the first layer
        (``phases/decode.py``), so a refusing rank never reaches this call."""
        shape = self.shape(snapshot)
        h, ids, w = batch.hidden, batch.topk_ids, batch.topk_weights
        t, k = int(h.shape[0]), shape.top_k
        if t > shape.token_cap or ids.shape != (t, k):
            raise RouteValidationError(f"{tag}: bucket dispatch of {t} tokens x {tuple(ids.shape)} routes does not "
                                       f"fit C_T={shape.token_cap}, k={k} (admission runs before dispatch)")
        dev = h.device
        c_t = shape.token_cap
        if t < c_t:  # pad (eager calls); a captured step stages its inputs padded already
            h = torch.cat([h, h.new_zeros(c_t - t, h.shape[1])])
            ids = torch.cat([ids, ids.new_full((c_t - t, k), -1)])
            w = torch.cat([w, w.new_zeros(c_t - t, k)])
        ids = ids.reshape(-1).to(torch.int64)
        gates = w.reshape(-1).to(torch.float32)
        maps = snapshot.on(dev)
        g, cp, rc, q_count = shape.group_size, shape.pair_cap, shape.route_cap, snapshot.num_slots
        # 1. replica selection on the device; padding routes get slot -1 and gate 0 (no expert identity)
        valid = ids >= 0
        routes = SemanticRoutes(origin_rank=batch.origin_rank, num_tokens=c_t, top_k=k,
                                origin_token=torch.arange(rc, device=dev) // k,
                                route_slot=torch.arange(rc, device=dev) % k,
                                logical_expert=ids.clamp_min(0), gate=gates, dense=True)
        phys = self.selector.select(routes, snapshot).to(dev)
        slots = torch.where(valid, phys, torch.full_like(phys, -1))
        gates = gates * valid
        safe = slots.clamp_min(0)
        # 2. destination peer of every route; padding goes to the dump peer G
        peer = torch.where(valid, maps.rank_to_peer[maps.slot_rank[safe]], torch.full_like(slots, g))
        # 3. position inside the peer block: stable order by (peer, slot, route)
        key = peer * (q_count + 1) + torch.where(valid, slots, torch.full_like(slots, q_count))
        order = torch.sort(key, stable=True).indices
        counts = count_by(peer, g + 1)
        starts = torch.cumsum(counts, 0) - counts
        pos_sorted = torch.arange(rc, device=dev) - starts[peer[order]]
        pos = torch.empty_like(pos_sorted)
        pos[order] = pos_sorted
        trash = g * cp
        send_ok = valid & (pos < cp)
        send_index = torch.where(send_ok, peer * cp + pos, torch.full_like(pos, trash))
        # 4. fill the fixed send blocks (row = its token's hidden state, or its FP8 codes and scales) and exchange
        #    them (equal splits)
        token = torch.arange(rc, device=dev) // k
        src, src_scales = quantize(h, self.payload_format)
        send = torch.zeros(trash + 1, shape.hidden_size, dtype=src.dtype, device=dev)
        _as_bytes(send)[send_index] = _as_bytes(src)[token]
        send_slot = torch.full((trash + 1,), -1, dtype=torch.int32, device=dev)
        send_slot[send_index] = slots.to(torch.int32)
        send_slot[trash:].fill_(-1)  # a fill kernel: no host-to-device copy (CUDA-graph capturable)
        payload = {"x": send[:trash], "slot": send_slot[:trash]}
        if src_scales is not None:
            send_scales = torch.zeros(trash + 1, src_scales.shape[1], dtype=src_scales.dtype, device=dev)
            send_scales[send_index] = src_scales[token]
            payload["scale"] = send_scales[:trash]
        splits = [cp] * g
        got = self.exchange.all_to_all_v(f"{tag}/bucket-dispatch", payload, splits, splits)
        recv_slot = got["slot"].to(torch.int64)
        arrived = got["x"] if src_scales is None else dequantize(got["x"], got["scale"], self.payload_format,
                                                                 self.compute_dtype or h.dtype)
        # 5. repack into [Q_local, C_q]: position within slot by a running count per local slot
        rvalid = recv_slot >= 0
        local = torch.where(rvalid, maps.slot_local[recv_slot.clamp_min(0)],
                            torch.full_like(recv_slot, shape.q_local))
        onehot = (local[:, None] == torch.arange(shape.q_local + 1, device=dev)[None, :]).to(torch.int64)
        pos_in_slot = torch.cumsum(onehot, 0).gather(1, local[:, None]).squeeze(1) - 1
        rtrash = shape.q_local * shape.slot_cap
        recv_ok = rvalid & (pos_in_slot < shape.slot_cap)
        recv_index = torch.where(recv_ok, local * shape.slot_cap + pos_in_slot, torch.full_like(local, rtrash))
        rows = torch.zeros(rtrash + 1, shape.hidden_size, dtype=arrived.dtype, device=dev)
        rows[recv_index] = arrived
        overflow = (valid & ~send_ok).any() | (rvalid & ~recv_ok).any()
        handle = BucketHandle(
            handle_id=f"bucket-h{snapshot.generation}-r{self.exchange.rank}-{uuid.uuid4().hex[:10]}",
            generation=snapshot.generation, layer=snapshot.layer, pg_epoch=snapshot.pg_epoch,
            rank=self.exchange.rank, num_tokens=t, shape=shape, gates=gates, send_index=send_index,
            recv_index=recv_index,
            sent_slots=torch.zeros(q_count, dtype=torch.int64, device=dev).scatter_add_(0, safe, valid.long()),
            overflow=overflow)
        valid_counts = onehot[:, : shape.q_local].sum(0).clamp_max(shape.slot_cap)
        return BucketDispatchOutput(rows=rows[:rtrash].view(shape.q_local, shape.slot_cap, shape.hidden_size),
                                    counts_list=(), handle=handle, valid=valid_counts)

    # ------------------------------------------------------------------ combine
    def combine(self, expert_rows: torch.Tensor, handle: BucketHandle, snapshot: PlacementSnapshot, *, tag: str,
                out_dtype: torch.dtype, checks: DeferredChecks | None = None) -> torch.Tensor:
        """expert_rows [Q_local, C_q, d] -> [T, d]: gather back to receive order, equal-split return, gated
        FP32 scatter-add. Padding rows read the zero trash row and carry gate 0."""
        fence(handle, snapshot)
        shape = handle.shape
        if expert_rows.shape != (shape.q_local, shape.slot_cap, shape.hidden_size):
            raise RouteValidationError(f"expert_rows: shape {tuple(expert_rows.shape)} but the bucket holds "
                                       f"{(shape.q_local, shape.slot_cap, shape.hidden_size)}")
        self._check(handle, checks)
        dev = expert_rows.device
        g, cp, d = shape.group_size, shape.pair_cap, shape.hidden_size
        flat = torch.cat([expert_rows.reshape(-1, d), expert_rows.new_zeros(1, d)], 0)
        back = flat[handle.recv_index]
        splits = [cp] * g
        got = self.exchange.all_to_all_v(f"{tag}/bucket-combine", {"y": back}, splits, splits)
        ret = torch.cat([got["y"], got["y"].new_zeros(1, d)], 0)
        per_route = ret[handle.send_index].to(torch.float32) * handle.gates[:, None]
        acc = torch.zeros(shape.token_cap, d, dtype=torch.float32, device=dev)
        acc.index_add_(0, torch.arange(shape.route_cap, device=dev) // shape.top_k, per_route)
        return acc[: handle.num_tokens].to(out_dtype)

    def handle_ok(self, handle: BucketHandle) -> torch.Tensor:
        """Every valid route lands in a distinct block row (the inverse map is one-to-one)."""
        idx = handle.send_index
        trash = handle.shape.group_size * handle.shape.pair_cap
        hits = torch.zeros(trash + 1, dtype=torch.int64, device=idx.device).scatter_add_(
            0, idx.clamp(0, trash), torch.ones_like(idx))
        return (hits[:trash] <= 1).all()

    def sent_slot_counts(self, handle: BucketHandle) -> torch.Tensor:
        return handle.sent_slots

    def slot_rows(self, out: BucketDispatchOutput) -> torch.Tensor:
        return out.valid


__all__ = ["BucketShape", "BucketHandle", "BucketDispatchOutput", "BucketDispatcher", "bucket_shape", "token_buckets",
           "bucket_for",
           "pair_capacity", "default_slot_capacity", "worst_case_slot_capacity"]
