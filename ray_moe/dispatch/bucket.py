# ======================================================================================================
#  THE DECODE BUCKET PATH (one rank, one layer, fixed shapes: CUDA-graph capturable)
#
#   padded tokens [C_T] ──> route rows [C_T*k] (padding: slot -1, gate 0: no expert identity)
#        ──> pack into fixed peer blocks [G, C_pair]   (position = rank within the peer block)
#        ──> equal-split all-to-all (static) ──> repack into expert-major capacity [Q_local, C_q]
#        ──> padded experts (masked by valid counts) ──> gather back ──> equal-split return
#        ──> gated scatter-add into [C_T, d]
#
#  Every shape depends only on the bucket (G, C_T, k, C_pair, Q_local, C_q, d), never on the step's
#  counts: the same code replays as a captured CUDA graph on GPUs and runs eagerly on CPU. Admission
#  (spec 0x05D) guarantees no position exceeds its capacity; the eager fallback never clips.
# ======================================================================================================
"""Fixed-capacity decode dispatch/combine (spec 0x05C, 0x05D; the low-latency mode)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ray_moe.dispatch.exchange.base import Exchange


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
    """C_q: ``headroom`` x the even share of the bucket's routes per slot (skew beyond it falls back)."""
    return max(4, math.ceil(headroom * group_size * token_cap * top_k / max(1, num_slots)))


@dataclass(frozen=True, eq=False)
class BucketDispatchOutput:
    """Low-latency (bucket) dispatch result on one rank: expert-major capacity layout.

    rows:       [Q_local, C_q, d] activation dtype; rows past ``valid[q]`` are zero padding
    valid:      [Q_local] int64 device-side valid route rows per local slot (``masked_m``)
    recv_index: [G * C_pair] int64 flat position of each received row in ``rows`` (trash slot for padding)
    recv_valid: [G * C_pair] bool
    send_index: [C_T * k] int64 flat position of each route in the peer blocks (trash for padding)
    route_valid:[C_T * k] bool
    """

    rows: torch.Tensor
    valid: torch.Tensor
    recv_index: torch.Tensor
    recv_valid: torch.Tensor
    send_index: torch.Tensor
    route_valid: torch.Tensor


def bucket_dispatch(
    hidden: torch.Tensor,
    slots: torch.Tensor,
    *,
    shape: BucketShape,
    slot_rank: torch.Tensor,
    rank_to_peer: torch.Tensor,
    slot_local: torch.Tensor,
    exchange: Exchange,
    tag: str,
) -> BucketDispatchOutput:
    """Pack, exchange and repack with fixed shapes.

    hidden: [C_T, d] (padding rows zero); slots: [C_T * k] int64 physical slot per route, -1 for padding.
    slot_rank / rank_to_peer / slot_local: the placement snapshot's tensors on this device.
    """
    dev = hidden.device
    g, cp, rc = shape.group_size, shape.pair_cap, shape.route_cap
    k = shape.top_k
    # 1. destination peer of every route; padding goes to the dump peer G
    valid = slots >= 0
    safe = slots.clamp_min(0)
    peer = torch.where(valid, rank_to_peer[slot_rank[safe]], torch.full_like(slots, g))
    # 2. position inside the peer block: stable order by (peer, slot, route)
    key = peer * (slot_rank.numel() + 1) + torch.where(valid, slots, torch.full_like(slots, slot_rank.numel()))
    order = torch.sort(key, stable=True).indices
    peer_sorted = peer[order]
    counts = torch.zeros(g + 1, dtype=torch.int64, device=dev).scatter_add_(0, peer, torch.ones_like(peer))
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(rc, device=dev) - starts[peer_sorted]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    trash = g * cp
    send_index = torch.where(valid & (pos < cp), peer * cp + pos, torch.full_like(pos, trash))
    # 3. fill the fixed send blocks (row = its token's hidden state)
    token = torch.arange(rc, device=dev) // k
    send = torch.zeros(trash + 1, shape.hidden_size, dtype=hidden.dtype, device=dev)
    send[send_index] = hidden[token]
    send_slot = torch.full((trash + 1,), -1, dtype=torch.int32, device=dev)
    send_slot[send_index] = slots.to(torch.int32)
    send_slot[trash:].fill_(-1)  # a fill kernel: no host-to-device copy (CUDA-graph capturable)
    # 4. equal-split exchange: every (source, destination) block has C_pair rows
    splits = [cp] * g
    got = exchange.all_to_all_v(f"{tag}/bucket-dispatch", {"x": send[:trash], "slot": send_slot[:trash]}, splits, splits)
    recv_slot = got["slot"].to(torch.int64)
    # 5. repack into [Q_local, C_q]: position within slot by a running count per local slot
    rvalid = recv_slot >= 0
    local = torch.where(rvalid, slot_local[recv_slot.clamp_min(0)], torch.full_like(recv_slot, shape.q_local))
    onehot = (local[:, None] == torch.arange(shape.q_local + 1, device=dev)[None, :]).to(torch.int64)
    running = torch.cumsum(onehot, 0)
    pos_in_slot = running.gather(1, local[:, None]).squeeze(1) - 1
    rtrash = shape.q_local * shape.slot_cap
    recv_index = torch.where(rvalid & (pos_in_slot < shape.slot_cap), local * shape.slot_cap + pos_in_slot,
                             torch.full_like(local, rtrash))
    rows = torch.zeros(rtrash + 1, shape.hidden_size, dtype=got["x"].dtype, device=dev)
    rows[recv_index] = got["x"]
    valid_counts = onehot[:, : shape.q_local].sum(0)
    return BucketDispatchOutput(
        rows=rows[:rtrash].view(shape.q_local, shape.slot_cap, shape.hidden_size),
        valid=valid_counts, recv_index=recv_index, recv_valid=rvalid, send_index=send_index, route_valid=valid,
    )


def bucket_combine(
    expert_rows: torch.Tensor,
    out: BucketDispatchOutput,
    gates: torch.Tensor,
    *,
    shape: BucketShape,
    exchange: Exchange,
    tag: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Return path: gather expert rows back to receive order, equal-split return, gated scatter-add.

    expert_rows: [Q_local, C_q, d]; gates: [C_T * k] float32 (0 for padding). Returns [C_T, d].
    """
    dev = expert_rows.device
    g, cp = shape.group_size, shape.pair_cap
    flat = torch.cat([expert_rows.reshape(-1, shape.hidden_size),
                      expert_rows.new_zeros(1, shape.hidden_size)], 0)
    back = flat[out.recv_index]  # padding rows read the zero trash row
    splits = [cp] * g
    got = exchange.all_to_all_v(f"{tag}/bucket-combine", {"y": back}, splits, splits)
    ret = torch.cat([got["y"], got["y"].new_zeros(1, shape.hidden_size)], 0)
    per_route = ret[out.send_index].to(torch.float32) * (gates.to(torch.float32) * out.route_valid)[:, None]
    token = torch.arange(shape.route_cap, device=dev) // shape.top_k
    acc = torch.zeros(shape.token_cap, shape.hidden_size, dtype=torch.float32, device=dev)
    acc.index_add_(0, token, per_route)
    return acc.to(out_dtype)


def padded_swiglu(rows: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Batched SwiGLU over the capacity layout: [Q, C, d] with [Q, f, d], [Q, f, d], [Q, d, f] -> [Q, C, d].
    Padding rows are zero and stay zero (SwiGLU(0) = 0), and the combine never reads them anyway."""
    gate = torch.bmm(rows, w_gate.transpose(1, 2))
    up = torch.bmm(rows, w_up.transpose(1, 2))
    return torch.bmm(torch.nn.functional.silu(gate) * up, w_down.transpose(1, 2))


def run_bucket_layer(
    hidden: torch.Tensor,
    slots: torch.Tensor,
    gates: torch.Tensor,
    *,
    shape: BucketShape,
    maps: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    experts: Callable[[torch.Tensor], torch.Tensor],
    exchange: Exchange,
    tag: str,
) -> torch.Tensor:
    """One decode layer with fixed shapes: [C_T, d] -> [C_T, d]. ``experts`` maps [Q_local, C_q, d] rows
    to outputs of the same shape (the rank's padded runner)."""
    slot_rank, rank_to_peer, slot_local = maps
    out = bucket_dispatch(hidden, slots, shape=shape, slot_rank=slot_rank, rank_to_peer=rank_to_peer,
                          slot_local=slot_local, exchange=exchange, tag=tag)
    y_rows = experts(out.rows) if shape.q_local else out.rows
    return bucket_combine(y_rows, out, gates, shape=shape, exchange=exchange, tag=tag, out_dtype=hidden.dtype)
