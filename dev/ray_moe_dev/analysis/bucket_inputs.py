"""Padded decode-bucket inputs and the per-step valid state (spec 0x05C, 0x05D, 0x05F). Pure: no Ray.

The model of one decode step staged into a bucket: real rows written at their rank region, padding rows
with route id ``-1`` and gate ``0`` masked before they can acquire an expert identity, the valid-token
and runner-row masks, compact rank offsets, and the in-place staging into the bucket's stable buffers.
Never clips: a step over a capacity raises (admission must have refused it first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ray_moe.moe.decode.shapes import (
    METADATA_DTYPE,
    PADDING_ROUTE_ID,
    ROUTE_ID_DTYPE,
    BufferName,
    DecodeBucket,
    StableBuffers,
)


@dataclass(frozen=True, eq=False)
class MaskState:
    """The mutable valid state of one decode step (spec 0x05C). Device tensors, rewritten every step.

    real_tokens_by_rank:  [P] int32     T_u real rows of rank u
    valid_tokens:         [S] bool      token-slot mask over the bucket (S = sum C_T); padding False
    rank_token_offsets:   [P+1] int32   exclusive prefix of T_u (compact offset of rank u's first real row;
                                         sentinel = number of valid rows)
    valid_routes_by_slot: [Q] int32     n_q valid route rows of physical slot q
    valid_runner_rows:    [sum C_q] bool runner-row mask: row j of slot q is valid iff j < n_q
    """

    real_tokens_by_rank: torch.Tensor
    valid_tokens: torch.Tensor
    rank_token_offsets: torch.Tensor
    valid_routes_by_slot: torch.Tensor
    valid_runner_rows: torch.Tensor

    @property
    def num_valid_tokens(self) -> int:
        return int(self.valid_tokens.sum())

    @property
    def num_valid_routes(self) -> int:
        return int(self.valid_routes_by_slot.sum())


@dataclass(frozen=True, eq=False)
class BucketInputs:
    """One step's padded bucket tensors (S = sum C_T token slots).

    hidden:        [S, d]   activation dtype; padding rows zero
    route_ids:     [S, k]   int32 physical slot per route; padding rows -1 (no expert identity)
    gates:         [S, k]   gate dtype; padding rows 0
    step_metadata: [P, 3]   int32 (real tokens, compact token offset, routes originated) per rank
    mask:          the step's ``MaskState``
    """

    hidden: torch.Tensor
    route_ids: torch.Tensor
    gates: torch.Tensor
    step_metadata: torch.Tensor
    mask: MaskState


def runner_row_mask(valid_routes_by_slot: torch.Tensor, slot_caps: Sequence[int]) -> torch.Tensor:
    """[Q] counts n_q, capacities C_q -> [sum C_q] bool: row j of slot q is valid iff j < n_q."""
    caps = torch.as_tensor([int(c) for c in slot_caps], dtype=torch.int64, device=valid_routes_by_slot.device)
    slot_of_row = torch.repeat_interleave(torch.arange(caps.numel(), device=caps.device), caps)
    starts = torch.cumsum(caps, 0) - caps
    j = torch.arange(int(caps.sum()), device=caps.device) - starts[slot_of_row]
    return j < valid_routes_by_slot.to(torch.int64)[slot_of_row]


def slot_route_counts(slot_ids: Sequence[torch.Tensor], num_slots: int) -> tuple[int, ...]:
    """n_q over every rank's routes: ``slot_ids[u]`` is [T_u, k] physical slots -> (n_0 .. n_{Q-1})."""
    flat = [s.reshape(-1).to(torch.int64).cpu() for s in slot_ids]
    allr = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int64)
    if allr.numel() and (int(allr.min()) < 0 or int(allr.max()) >= num_slots):
        bad = int(allr.min()) if int(allr.min()) < 0 else int(allr.max())
        raise ValueError(f"slot_ids: physical slot {bad} is out of range [0, {num_slots})")
    return tuple(int(c) for c in torch.bincount(allr, minlength=num_slots).tolist())


def build_bucket_inputs(
    bucket: DecodeBucket,
    hidden: Sequence[torch.Tensor],
    slot_ids: Sequence[torch.Tensor],
    gates: Sequence[torch.Tensor],
) -> BucketInputs:
    """Pad one decode step's per-rank inputs into the bucket layout; padding never gets an expert identity.

    hidden[u]:   [T_u, d] float   rank u's current rows
    slot_ids[u]: [T_u, k] int     physical slot of each route (after replica selection)
    gates[u]:    [T_u, k] float   combine gates

    Never clips: a rank over C_T[u] or a slot over C_q raises ``ValueError`` (admission must have
    refused such a step first, spec 0x05F).

    1. validate shapes, rank count and capacities
    2. concatenate the real rows and compute their bucket positions (rank region start + local index)
    3. build the valid-token mask and the compact offsets (the mutable valid state)
    4. write real rows into padding-initialised tensors: route ids -1, gates 0, hidden 0
    5. mask padding route ids again by the valid-token mask (padding masked before identity)
    6. count valid routes per slot from the masked ids; check slot capacities
    7. step metadata [P, 3] = (real tokens, compact offset, routes originated)
    """
    key = bucket.key
    p, k, d, q = key.num_ranks, key.top_k, key.hidden_size, key.num_slots
    # 1. validation
    for name, seq in (("hidden", hidden), ("slot_ids", slot_ids), ("gates", gates)):
        if len(seq) != p:
            raise ValueError(f"{name}: {len(seq)} ranks given, bucket {bucket.graph_id!r} has P={p}")
    real = []
    for u in range(p):
        h, s, g = hidden[u], slot_ids[u], gates[u]
        if h.dim() != 2 or h.shape[1] != d:
            raise ValueError(f"hidden[{u}]: shape {tuple(h.shape)}, expected [T, {d}]")
        t = int(h.shape[0])
        if tuple(s.shape) != (t, k):
            raise ValueError(f"slot_ids[{u}]: shape {tuple(s.shape)}, expected [{t}, {k}]")
        if tuple(g.shape) != (t, k):
            raise ValueError(f"gates[{u}]: shape {tuple(g.shape)}, expected [{t}, {k}]")
        if t > key.rank_token_capacities[u]:
            raise ValueError(
                f"hidden[{u}]: {t} rows exceed rank token capacity {key.rank_token_capacities[u]} of "
                f"{bucket.graph_id!r}; the step must fall back, never be clipped"
            )
        real.append(t)
    device = hidden[0].device
    s_total = key.token_slots
    # 2. positions of the real rows on the bucket token axis
    real_t = torch.tensor(real, dtype=torch.int64, device=device)
    caps = torch.tensor(key.rank_token_capacities, dtype=torch.int64, device=device)
    cap_start = torch.cumsum(caps, 0) - caps
    compact_start = torch.cumsum(real_t, 0) - real_t
    rank_of_row = torch.repeat_interleave(torch.arange(p, device=device), real_t)
    n_real = int(real_t.sum())
    local = torch.arange(n_real, device=device) - compact_start[rank_of_row]
    pos = cap_start[rank_of_row] + local
    # 3. mutable valid state
    slot_rank_of = torch.repeat_interleave(torch.arange(p, device=device), caps)
    slot_local = torch.arange(s_total, device=device) - cap_start[slot_rank_of]
    valid_tokens = slot_local < real_t[slot_rank_of]
    offsets = torch.zeros(p + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(real_t, 0)
    # 4. padding-initialised tensors, real rows written
    h_out = torch.zeros(s_total, d, dtype=key.activation_dtype, device=device)
    ids_out = torch.full((s_total, k), PADDING_ROUTE_ID, dtype=ROUTE_ID_DTYPE, device=device)
    g_out = torch.zeros(s_total, k, dtype=key.gate_dtype, device=device)
    if n_real:
        h_out[pos] = torch.cat([h.to(key.activation_dtype) for h in hidden])
        ids_cat = torch.cat([s.to(torch.int64) for s in slot_ids])
        lo, hi = int(ids_cat.min()), int(ids_cat.max())
        if lo < 0 or hi >= q:
            raise ValueError(f"slot_ids: physical slot {lo if lo < 0 else hi} is out of range [0, {q})")
        ids_out[pos] = ids_cat.to(ROUTE_ID_DTYPE)
        g_out[pos] = torch.cat([g.to(key.gate_dtype) for g in gates])
    # 5. mask padding before it can acquire an expert identity
    ids_out = torch.where(valid_tokens[:, None], ids_out, torch.full_like(ids_out, PADDING_ROUTE_ID))
    g_out = torch.where(valid_tokens[:, None], g_out, torch.zeros_like(g_out))
    # 6. valid routes per slot, from masked ids only
    valid_ids = ids_out[ids_out >= 0].to(torch.int64)
    by_slot = torch.bincount(valid_ids, minlength=q)
    slot_caps = torch.tensor(key.slot_route_capacities, dtype=torch.int64, device=device)
    over = by_slot > slot_caps
    if bool(over.any()):
        j = int(torch.nonzero(over)[0])
        raise ValueError(
            f"slot_ids: slot {j} has {int(by_slot[j])} routes, over its capacity {int(slot_caps[j])} of "
            f"{bucket.graph_id!r}; the step must fall back, never be clipped"
        )
    # 7. step metadata
    meta = torch.stack([real_t, offsets[:-1], real_t * k], dim=1).to(METADATA_DTYPE)
    mask = MaskState(
        real_tokens_by_rank=real_t.to(METADATA_DTYPE),
        valid_tokens=valid_tokens,
        rank_token_offsets=offsets.to(METADATA_DTYPE),
        valid_routes_by_slot=by_slot.to(METADATA_DTYPE),
        valid_runner_rows=runner_row_mask(by_slot, key.slot_route_capacities),
    )
    return BucketInputs(hidden=h_out, route_ids=ids_out, gates=g_out, step_metadata=meta, mask=mask)


def stage_step(buffers: StableBuffers, bucket: DecodeBucket, inputs: BucketInputs) -> None:
    """Write one admitted step into the stable buffers in place (addresses unchanged; spec 0x05D's
    ``update_device_validity_state`` + ``mask_graph_padding_routes``). The expert output buffer is
    zeroed so no previous step's rows survive replay.

    Raises ``ValueError`` if the buffers are not ready for ``bucket``.
    """
    if not buffers.ready(bucket):
        raise ValueError(f"buffers: stable buffers of {bucket.graph_id!r} are missing or were re-addressed")
    t = buffers.tensors
    t[BufferName.HIDDEN].copy_(inputs.hidden)
    t[BufferName.ROUTE_IDS].copy_(inputs.route_ids)
    t[BufferName.GATES].copy_(inputs.gates)
    t[BufferName.STEP_METADATA].copy_(inputs.step_metadata)
    t[BufferName.EXPERT_OUTPUT].zero_()
