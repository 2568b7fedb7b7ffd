# ======================================================================================================
#  ROW-MAPPED SLOT WEIGHTS AT THE RUNNER BOUNDARY (pure torch: no Ray)
#
#   a shard holds each expert once, in one row of a per-layer slot buffer [C, f, d] / [C, d, f];
#   a generation is a slot map over it (local slot i -> buffer row rows[i]), never a copy.
#   rows == (0, ..., Q_local - 1): the SlotWeights are plain views and nothing here runs. Otherwise:
#
#       dispatch rows in LOCAL slot order ──> permute into BUFFER row order ──> runner over all C rows
#       (identity SlotWeights; rows no slot uses get no input rows) ──> permute back to local slot order
#
#   EXPERT_MAJOR (host counts):         a host-built permutation, one gather and one scatter on the device
#   EXPERT_MAJOR_DEVICE_OFFSETS:        destinations from searchsorted / cumsum on the device (no host read:
#                                       CUDA-graph capturable), index_copy in, run_offsets, gather out
#   SLOT_CAPACITY:                      scatter [Q_local, cap, d] into [C, cap, d] zeros at rows, run_capacity,
#                                       gather rows back (one pass per repeat where two slots share a row)
#   the device indices are built once per SlotWeights (``slab_index``, at stack time), never under capture.
# ======================================================================================================
"""Running a row-mapped ``SlotWeights`` (``SlotWeights.rows`` set) through any expert runner, by translating
the dispatch output into buffer row order and back. ``moe.layer.run_experts`` calls these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ray_moe.moe.experts.runners.base import ExpertRunner
from ray_moe.moe.experts.weights import SlotWeights

_CACHE_KEY = "slab"


@dataclass(frozen=True, eq=False)
class SlabIndex:
    """The device-side index of one row-mapped SlotWeights (on the weights' device).

    full:    SlotWeights over all C buffer rows in buffer order (plain, num_slots = C; rows no local slot
             uses carry expert -1 and never receive an input row; an FP8 buffer's scales with them)
    rows:    [Q_local] int64 buffer row of each local slot
    before:  [Q_local, Q_local] int64, before[i, j] = 1 where j < i and rows[j] == rows[i] (slots sharing a row)
    passes:  (local slots [n_k] int64, their rows [n_k] int64) per pass: pass k holds every slot that is the
             k-th local slot of its row, so each pass's rows are distinct (the capacity layout's scatter)
    rows_host: ``SlotWeights.rows`` as an int64 NumPy array [Q_local]
    """

    full: SlotWeights
    rows: torch.Tensor
    before: torch.Tensor
    passes: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    rows_host: np.ndarray

    @property
    def buffer_rows(self) -> int:
        return self.full.num_slots


def slab_index(weights: SlotWeights) -> SlabIndex:
    """The SlabIndex of a row-mapped ``weights``, built on first use and kept in ``weights.cache`` (build it
    before any CUDA graph capture: it copies host indices to the device)."""
    if weights.rows is None:
        raise ValueError(f"weights: layer {weights.layer} slot weights are plain (rows=None); nothing to translate")
    got = weights.cache.get(_CACHE_KEY)
    if got is not None:
        return got
    dev = weights.w_gate.device
    rows = np.asarray(weights.rows, dtype=np.int64)
    q, c = len(rows), int(weights.w_gate.shape[0])
    experts = [-1] * c
    for local, r in enumerate(rows.tolist()):
        experts[r] = weights.experts[local]
    full = SlotWeights(layer=weights.layer, slot_ids=tuple(range(c)), experts=tuple(experts), w_gate=weights.w_gate,
                       w_up=weights.w_up, w_down=weights.w_down, scales=weights.scales, block=weights.block)
    j, i = np.meshgrid(np.arange(q), np.arange(q))
    before = ((rows[None, :] == rows[:, None]) & (j < i)).astype(np.int64)
    occurrence = before.sum(1)
    passes = []
    for k in range(int(occurrence.max()) + 1):
        slots = np.nonzero(occurrence == k)[0]
        passes.append((torch.from_numpy(slots).to(dev), torch.from_numpy(rows[slots]).to(dev)))
    idx = SlabIndex(full=full, rows=torch.from_numpy(rows).to(dev), before=torch.from_numpy(before).to(dev),
                    passes=tuple(passes), rows_host=rows)
    weights.cache[_CACHE_KEY] = idx
    return idx


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host int64 index -> ``device`` (pinned, non-blocking on CUDA: queued work is not waited on)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def run_counts(runner: ExpertRunner, x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> torch.Tensor:
    """EXPERT_MAJOR: x [N, d] rows grouped by local slot, counts len Q_local on the host -> [N, d] in x's order.

    1. on the host: the local slot of every row, then a stable sort by its buffer row (perm [N])
    2. xb = x[perm] (buffer order), counts per buffer row (len C; rows no slot uses get 0)
    3. yb = runner.run(xb, buffer counts, full); y[perm] = yb
    """
    idx = slab_index(weights)
    counts = [int(v) for v in counts]
    if len(counts) != weights.num_slots:
        raise ValueError(f"counts: {len(counts)} entries but the rank hosts {weights.num_slots} slots")
    if any(v < 0 for v in counts) or sum(counts) != x.shape[0]:
        raise ValueError(f"counts={counts}: must be >= 0 and sum to the {x.shape[0]} rows")
    cnt = np.asarray(counts, dtype=np.int64)
    perm = np.argsort(np.repeat(idx.rows_host, cnt), kind="stable")
    buf_counts = np.bincount(idx.rows_host, weights=cnt, minlength=idx.buffer_rows).astype(np.int64)
    perm_t = _to_device(perm, x.device)
    yb = runner.run(x.index_select(0, perm_t), buf_counts.tolist(), idx.full)
    return torch.empty_like(yb).index_copy_(0, perm_t, yb)


def run_offsets(runner: ExpertRunner, x: torch.Tensor, offsets: torch.Tensor, weights: SlotWeights) -> torch.Tensor:
    """EXPERT_MAJOR_DEVICE_OFFSETS: x [R, d] rows grouped by local slot, offsets [Q_local] int32 device-side
    inclusive row ends per local slot (rows past offsets[-1] are padding) -> [R, d] in x's order. No host read.

    1. counts [Q_local] = diff(offsets); per buffer row: counts summed (index_add), inclusive ends (cumsum)
    2. start of local slot s in buffer order = start of its row + rows of earlier slots sharing the row
    3. row i: its slot by searchsorted, dest = slot start + position in the slot; padding rows stay in place
    4. xb.index_copy_(dest, x); yb = runner.run_offsets(xb, buffer ends [C] int32, full); y = yb[dest]
    """
    idx = slab_index(weights)
    q, r_count = weights.num_slots, int(x.shape[0])
    if offsets.dim() != 1 or offsets.shape[0] != q:
        raise ValueError(f"offsets: expected [{q}] (one inclusive end per local slot), got {tuple(offsets.shape)}")
    ends = offsets.to(torch.int64)
    counts = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    buf_counts = torch.zeros(idx.buffer_rows, dtype=torch.int64, device=x.device).index_add_(0, idx.rows, counts)
    buf_ends = torch.cumsum(buf_counts, 0)
    slot_start = (buf_ends - buf_counts)[idx.rows] + (idx.before * counts[None, :]).sum(1)
    pos = torch.arange(r_count, device=x.device)
    slot = torch.searchsorted(ends, pos, right=True)
    live = slot < q
    slot = slot.clamp_max(q - 1)
    dest = torch.where(live, slot_start[slot] + pos - (ends[slot] - counts[slot]), pos)
    xb = torch.empty_like(x).index_copy_(0, dest, x)
    yb = runner.run_offsets(xb, buf_ends.to(torch.int32), idx.full)
    return yb.index_select(0, dest)


def run_capacity(runner: ExpertRunner, x: torch.Tensor, valid: torch.Tensor | None,
                 weights: SlotWeights) -> torch.Tensor:
    """SLOT_CAPACITY: x [Q_local, cap, d] (padding rows zero), valid [Q_local] int64 device-side rows per slot
    (or None) -> [Q_local, cap, d]. Per pass (one unless two slots share a buffer row): scatter the pass's
    slots into [C, cap, d] zeros at their rows (valid likewise into [C] zeros), ``run_capacity`` over all C
    rows, gather the rows back. Fixed shapes, no host read."""
    idx = slab_index(weights)
    q = weights.num_slots
    if x.dim() != 3 or x.shape[0] != q:
        raise ValueError(f"x: expected [{q}, cap, d] (one capacity block per local slot), got {tuple(x.shape)}")
    c, cap, d = idx.buffer_rows, int(x.shape[1]), int(x.shape[2])
    y = None if len(idx.passes) == 1 else torch.empty_like(x)
    for slots, rows in idx.passes:
        xb = x.new_zeros(c, cap, d).index_copy_(0, rows, x.index_select(0, slots))
        vb = None if valid is None else valid.new_zeros(c).index_copy_(0, rows, valid.index_select(0, slots))
        yb = runner.run_capacity(xb, idx.full, vb).index_select(0, rows)
        if y is None:
            return yb  # one pass: its slots are every local slot, in order
        y.index_copy_(0, slots, yb)
    return y


__all__ = ["SlabIndex", "slab_index", "run_counts", "run_offsets", "run_capacity"]
