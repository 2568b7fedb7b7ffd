"""Variable grouped GEMM runner (spec 0x04C), plus the segment helpers every runner shares.

The grouped runner keeps the exact row count ``m_q = n_q`` of every local slot and runs all slots
through grouped launches (``torch._grouped_mm``), one per projection, all sharing one offsets vector:

  1. offs = inclusive prefix of counts, int32 on the rows' device (zero-row slots repeat an offset,
     so problem index q is always local slot q, 0x04G)
  2. g = grouped_mm(x [N, d], Wg^T [Q, d, f], offs); u = grouped_mm(x, Wu^T [Q, d, f], offs)
  3. a = silu(g) * u, in place in g (one pass on CUDA: swiglu.py) -> [N, f]
  4. y = grouped_mm(a [N, f], Wd^T [Q, f, d], offs)            -> [N, d]

The weight operands are K-major views of the stored ``[Q, f, d]`` / ``[Q, d, f]`` stacks: no derived
copy is kept, ``weights.cache`` stays untouched. Fusing gate and up into one ``[Q, d, 2f]`` operand
was measured and rejected on an H200 (bf16, Mixtral-like Q=8, N=8192, d=4096, f=14336): the fused
output's gate/up halves are strided views and the activation over them took 0.63 ms against
0.29 ms on contiguous tensors; gate-and-up as 2Q problems of one launch over ``[x; x]`` took
4.57 ms end to end against 4.17 ms for the separate launches here, which also need no weight copy.

Where the kernel cannot take the operands (dtype, device or 16-byte stride rules below), the same
views run through a per-slot loop with identical semantics. At decode sizes on CUDA (at most
``SKINNY_ROWS_PER_SLOT`` rows per slot on average) ``run_offsets`` takes the skinny Triton kernels
instead (``skinny.py``: the layer is a weight read there, which grouped_mm streams at about half of HBM
bandwidth).

``torch._grouped_mm`` rules honoured here (torch 2.8-2.13, ``GroupedMMUtils.h``):
  - dtypes float32 / bfloat16 / float16, offsets int32, output dtype = input dtype;
  - every non-unit stride of both operands a multiple of 16 bytes: ``d * elem`` and ``f * elem``
    (the operands are row-major rows and K-major weight views);
  - on CUDA the data pointers 16-byte aligned; the CUTLASS fast path needs bf16 on compute
    capability 9.x (Hopper) or 10.x, elsewhere torch falls back to a host-synchronising mm loop, so
    the runner takes its own loop there instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch

import ray_moe.moe.experts.runners.skinny as skinny
import ray_moe.moe.experts.runners.tiled as tiled
from ray_moe.moe.experts.runners.base import ExpertRunner, RunnerLedger, down_operand, gate_up_operands, swiglu_act
from ray_moe.moe.experts.weights import SlotWeights
from ray_moe.core.types import RunnerKind

DESCRIPTOR_FIELDS = (
    "m", "n", "k", "input_offset", "gate_weight_offset", "up_weight_offset", "down_weight_offset", "output_offset",
)
DESCRIPTOR_BYTES = 8 * len(DESCRIPTOR_FIELDS)  # eight INT64 fields per active problem (0x04C teaching ABI)
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# rows per slot (on average) up to which ``run_offsets`` takes the skinny Triton kernels on CUDA (decode
# sizes: one 16- or 32-row block per active slot); above it grouped_mm. Measured (``bench/results/
# skinny-h100x1-76a48a1``, H100, Qwen3-30B-A3B experts): the kernels lead at 16 rows a slot (1.07x; 1.36x on an
# H200, skinny-h200x1-qwen3-s11), tie at 32 and lose from 64 (0.80x; 0.60x at 128 with 128-row blocks): the
# row loop inside one program per (expert, column block) does not keep the tensor cores busy once the rows
# outgrow one block, so mixed steps (~80-130 rows a slot) keep grouped_mm
SKINNY_ROWS_PER_SLOT = 16


def as_counts(counts: Sequence[int] | torch.Tensor) -> list[int]:
    """Per-slot row counts as a list of non-negative Python ints; raises ValueError naming ``counts``."""
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1:
            raise ValueError(f"counts: expected a 1-D sequence, got shape {tuple(counts.shape)}")
        counts = counts.tolist()
    out = [int(c) for c in counts]
    if any(c < 0 for c in out):
        raise ValueError(f"counts={out}: row counts must be >= 0")
    return out


def check_rows(x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> list[int]:
    """Validate one runner call (shape, counts, dtype and device of ``x`` against ``weights``)."""
    counts = as_counts(counts)
    ExpertRunner._check(x, counts, weights)
    if x.dtype != weights.w_gate.dtype:
        raise ValueError(f"x: dtype {x.dtype} differs from the weights' dtype {weights.w_gate.dtype}")
    if x.device != weights.w_gate.device:
        raise ValueError(f"x: device {x.device} differs from the weights' device {weights.w_gate.device}")
    return counts


def device_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Small host-known index vector on ``device``; on CUDA through pinned memory and a non-blocking
    copy, so building per-call offsets never waits for the work already queued on the stream."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.tensor(list(values), dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(list(values), dtype=dtype, device=device)


def segment_positions(counts: Sequence[int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, position) of every expert-major row, vectorised.

    counts: len Q -> slot: [N] int64 (local slot of row i), position: [N] int64 (row index inside its
    slot's segment). ``output_size`` is passed so CUDA needs no host synchronisation.
    """
    n = sum(counts)
    counts_t = device_tensor(counts, torch.int64, device)
    slot = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t, output_size=n)
    starts = device_tensor([0, *accumulate(counts)][:-1], torch.int64, device)
    position = torch.arange(n, device=device) - starts[slot]
    return slot, position


def grouped_mm_available(device: torch.device, dtype: torch.dtype, d: int, f: int) -> bool:
    """Whether ``torch._grouped_mm`` takes rows of width ``d`` / ``f`` of ``dtype`` on ``device``
    without a host-synchronising fallback (see the module docstring for the rules)."""
    if not hasattr(torch, "_grouped_mm") or dtype not in GROUPED_MM_DTYPES:
        return False
    elem = torch.empty((), dtype=dtype).element_size()
    if (d * elem) % 16 or (f * elem) % 16:
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return dtype == torch.bfloat16 and major in (9, 10)
    return False


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, 16-byte aligned copy of ``t`` where ``t`` is not already both."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def grouped_swiglu(x: torch.Tensor, bounds: Sequence[int], weights: SlotWeights, *,
                   use_grouped_mm: bool) -> torch.Tensor:
    """SwiGLU of every slot on its segment of ``x``.

    x: [R, d]; bounds: len Q inclusive end row of each slot's segment (non-decreasing, last == R)
    -> [R, d] in the dtype of ``x``.
    """
    if len(bounds) != weights.num_slots or bounds[-1] != x.shape[0]:
        raise ValueError(
            f"bounds={list(bounds)}: expected {weights.num_slots} segment ends finishing at row {x.shape[0]}"
        )
    wg, wu = gate_up_operands(weights)
    wd = down_operand(weights)
    if use_grouped_mm:
        # 1-2. one grouped launch per projection; empty slots repeat their offset.
        offs = device_tensor(bounds, torch.int32, x.device)
        xa = _aligned(x)
        g = torch._grouped_mm(xa, wg, offs=offs)
        u = torch._grouped_mm(xa, wu, offs=offs)
        # 3-4. activation in place, then the down projection.
        return torch._grouped_mm(swiglu_act(g, u), wd, offs=offs)
    # fallback: the same operands, one slot at a time.
    y = torch.empty_like(x)
    start = 0
    for q, end in enumerate(bounds):
        if end > start:
            seg = x[start:end]
            y[start:end] = swiglu_act(seg @ wg[q], seg @ wu[q]) @ wd[q]
        start = end
    return y


def grouped_mm_swiglu(x: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                      w_down: torch.Tensor) -> torch.Tensor:
    """Expert-major rows x [N, d] with device-side offsets [Q] int32 (inclusive row ends) through three grouped
    launches over K-major views of w_gate / w_up [Q, f, d] and w_down [Q, d, f] -> [N, d] (rows past offsets[-1]
    left uncomputed). The device-offset path above the Triton kernels' sizes, and their start check's reference."""
    xa = _aligned(x)
    wg, wu = w_gate.transpose(1, 2), w_up.transpose(1, 2)
    a = swiglu_act(torch._grouped_mm(xa, wg, offs=offsets), torch._grouped_mm(xa, wu, offs=offsets))
    return torch._grouped_mm(a, w_down.transpose(1, 2), offs=offsets)


def mid_choice(device: torch.device, dtype: torch.dtype, hidden_size: int, ffn_size: int,
               slots: int, top_k: int) -> tiled.TiledChoice:
    """The tiled kernels' start check for a deployment's expert shape and routes a token (``tiled.check_tiled``
    against ``grouped_mm_swiglu``; once a process): OFF where grouped_mm does not take the operands."""
    if not grouped_mm_available(device, dtype, hidden_size, ffn_size):
        return tiled.TiledChoice((), f"grouped_mm does not take dtype {dtype} on {device.type}: no reference")
    return tiled.check_tiled(torch.device(device), dtype, int(hidden_size), int(ffn_size), int(slots),
                             grouped_mm_swiglu, int(top_k))


def capacity_swiglu(x: torch.Tensor, valid: torch.Tensor, weights: SlotWeights) -> torch.Tensor:
    """SwiGLU of a capacity layout with grouped launches whose offsets stay on the device (no host sync,
    CUDA-graph capturable): x [Q, C, d] (rows past ``valid[q]`` are padding), valid [Q] int64 -> [Q, C, d].

    1. compact: row (q, c < valid[q]) moves to ``start[q] + c`` (exclusive prefix of valid); padding goes to
       one trash row
    2. one grouped launch per projection over the compacted rows with ``offs = cumsum(valid)`` on the device:
       an empty slot is an empty group (its weights are never read), rows past ``offs[-1]`` are not computed
    3. gather back to the capacity positions (padding positions read a zero row; the combine never reads them)
    """
    q, c, d = x.shape
    vq = valid.to(torch.int64).clamp(0, c)
    offs = torch.cumsum(vq, 0)
    start = offs - vq
    col = torch.arange(c, device=x.device)
    trash = q * c
    dest = torch.where(col[None, :] < vq[:, None], start[:, None] + col[None, :], torch.full_like(start[:, None], trash))
    compact = x.new_zeros(trash + 1, d)
    compact[dest.reshape(-1)] = x.reshape(q * c, d)
    offs32 = offs.to(torch.int32)
    wg, wu = gate_up_operands(weights)
    rows = compact[:trash]
    a = swiglu_act(torch._grouped_mm(rows, wg, offs=offs32), torch._grouped_mm(rows, wu, offs=offs32))
    y = torch._grouped_mm(a, down_operand(weights), offs=offs32)
    # rows past offs[-1] were not computed (only padding positions map there): zero them, plus the trash row
    live = torch.arange(trash, device=x.device) < offs[-1]
    y = torch.cat([torch.where(live[:, None], y, torch.zeros_like(y)), y.new_zeros(1, d)])
    return y[dest.reshape(-1)].view(q, c, d)


@dataclass(frozen=True)
class GroupedDescriptors:
    """The 0x04C teaching descriptor table of one call: one row of eight INT64 fields per ACTIVE slot.

    table: [active, 8] int64 with columns ``DESCRIPTOR_FIELDS``; offsets are element offsets into the
    flattened rows (input/output) and the flattened weight stacks (gate/up ``[Q, f, d]``, down
    ``[Q, d, f]``), so a descriptor binds to its own slot's weights even after empty slots.
    slots: local slot index of each row of ``table``.
    """

    table: torch.Tensor
    slots: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()


class GroupedRunner(ExpertRunner):
    """Variable grouped GEMM: every useful row executes exactly once, no padding (spec 0x04C).

    use_grouped_mm: None chooses per call (below), True forces ``torch._grouped_mm``, False forces the
    per-slot loop over the same weight views.

    Kernel choice when ``use_grouped_mm`` is None (measured on H200, bf16; bench/runners.py): one
    grouped launch wins when there are many small segments (DeepSeek-like, 32 slots: 2-3.6x the loop),
    but cuBLAS per-slot GEMMs win when there are few active slots or every active segment is large
    (Mixtral-like prefill, ~1k rows x 8 experts: the loop runs at 86% of dense peak and grouped_mm
    loses 10-14% on tile-misaligned groups). So the runner takes the loop when
    ``active <= loop_max_active`` or ``min active rows >= loop_min_rows``, else grouped_mm.
    """

    kind = RunnerKind.GROUPED

    def __init__(self, use_grouped_mm: bool | None = None, *, loop_max_active: int = 8,
                 loop_min_rows: int = 512, mid: tiled.TiledChoice = tiled.OFF) -> None:
        """``mid``: up to how many rows a slot the tiled kernels serve device-offset steps above the skinny
        kernels' sizes (``tiled.check_tiled``'s measured choice for this device and expert shape; OFF: none)."""
        if use_grouped_mm not in (None, True, False):
            raise ValueError(f"use_grouped_mm={use_grouped_mm!r} must be None, True or False")
        if loop_max_active < 0 or loop_min_rows < 1:
            raise ValueError(f"loop_max_active={loop_max_active}, loop_min_rows={loop_min_rows}: must be >= 0, >= 1")
        self.use_grouped_mm = use_grouped_mm
        self.loop_max_active = loop_max_active
        self.loop_min_rows = loop_min_rows
        self.mid = mid

    def _kernel(self, x: torch.Tensor, rows: int, weights: SlotWeights) -> str | tiled.TileConfig | None:
        """The Triton kernels a device-offset call of ``rows`` expert-major rows takes: "skinny" (decode sizes),
        a tiled config (mid-size, where the start check measured it faster), or None (grouped_mm / the loop)."""
        if self.use_grouped_mm is not None:
            return None
        slots = max(weights.num_slots, 1)
        if rows <= SKINNY_ROWS_PER_SLOT * slots:
            return "skinny" if skinny.available(x, weights.w_gate, weights.w_down) else None
        cfg = self.mid.config(rows, slots)
        return cfg if cfg is not None and tiled.available(x, weights.w_gate, weights.w_down, cfg) else None

    def kernels(self) -> str:
        """How device-offset calls run here, by rows a slot, in words (``status``'s paths)."""
        mid = (f"the tiled Triton kernels to {self.mid.bands[-1][0]} rows a slot ({self.mid.reason}), "
               if self.mid.bands else f"no tiled kernels ({self.mid.reason}), ")
        return (f"the skinny Triton kernels (CUDA) to {SKINNY_ROWS_PER_SLOT} rows a slot, {mid}grouped_mm above (or "
                f"the per-slot loop where it does not take the operands)")

    def run_capacity(self, x: torch.Tensor, weights: SlotWeights, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The decode bucket's capacity layout: grouped launches with device-side offsets where
        ``torch._grouped_mm`` takes the operands (empty slots read no weights), else batched matmuls."""
        if valid is None or self.use_grouped_mm is False or not grouped_mm_available(
                x.device, x.dtype, weights.hidden_size, weights.ffn_size):
            return super().run_capacity(x, weights, valid)
        return capacity_swiglu(x, valid, weights)

    def run_offsets(self, x: torch.Tensor, offsets: torch.Tensor, weights: SlotWeights) -> torch.Tensor:
        """Expert-major rows with device-side offsets: three grouped launches, no host sync (rows past
        ``offsets[-1]`` are left uncomputed: the combine never reads them)."""
        kernel = self._kernel(x, int(x.shape[0]), weights)
        if kernel == "skinny":
            # decode sizes: a few rows per slot, the layer is a weight read (the skinny kernels stream the
            # active slots' weights at ~4.2 TB/s on H200, grouped_mm at ~2.7)
            return skinny.skinny_swiglu(x, offsets, weights.w_gate, weights.w_up, weights.w_down)
        if kernel is not None:  # mid-size: the tiled kernels, where the start check measured them faster
            return tiled.tiled_swiglu(x, offsets, weights.w_gate, weights.w_up, weights.w_down, config=kernel)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        few = weights.num_slots <= self.loop_max_active and self.use_grouped_mm is None
        if self.use_grouped_mm is False or not grouped_mm_available(x.device, x.dtype, weights.hidden_size,
                                                                    weights.ffn_size) or (few and not capturing):
            # a few large segments run fastest as per-slot GEMMs: one host read of the offsets (not in a graph)
            return super().run_offsets(x, offsets, weights)
        return grouped_mm_swiglu(x, offsets, weights.w_gate, weights.w_up, weights.w_down)

    def takes_indexed(self, hidden: torch.Tensor, rows: int, weights: SlotWeights) -> bool:
        """Where the Triton kernels serve (decode sizes, and mid sizes where measured faster on CUDA): they read
        each row through the order (no gathered copy)."""
        return self._kernel(hidden, rows, weights) is not None

    def run_indexed(self, hidden: torch.Tensor, order: torch.Tensor, top_k: int, offsets: torch.Tensor,
                    weights: SlotWeights, *, weight_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The Triton kernels, reading rows through ``order`` (callers asked ``takes_indexed`` first)."""
        kernel = self._kernel(hidden, int(order.numel()), weights)
        if kernel == "skinny":
            return skinny.skinny_swiglu(hidden, offsets, weights.w_gate, weights.w_up, weights.w_down, order=order,
                                        top_k=top_k, weight_rows=weight_rows)
        return tiled.tiled_swiglu(hidden, offsets, weights.w_gate, weights.w_up, weights.w_down, config=kernel,
                                  order=order, top_k=top_k, weight_rows=weight_rows)

    def backend(self, x: torch.Tensor, weights: SlotWeights, counts: Sequence[int] | None = None) -> str:
        """``"grouped_mm"`` or ``"loop"``: what ``run`` uses for these rows, counts and weights."""
        ok = grouped_mm_available(x.device, x.dtype, weights.hidden_size, weights.ffn_size)
        if self.use_grouped_mm is True and not ok:
            raise ValueError(
                f"use_grouped_mm=True but torch._grouped_mm cannot take dtype {x.dtype} on {x.device} "
                f"with d={weights.hidden_size}, f={weights.ffn_size}"
            )
        if not ok or self.use_grouped_mm is False:
            return "loop"
        if self.use_grouped_mm is None and counts is not None:
            active = [int(c) for c in counts if c]
            if len(active) <= self.loop_max_active or (active and min(active) >= self.loop_min_rows):
                return "loop"
        return "grouped_mm"

    def run(self, x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> torch.Tensor:
        """x: [N, d] expert-major rows; counts: len Q_local -> [N, d]."""
        counts = check_rows(x, counts, weights)
        if x.shape[0] == 0:
            return torch.empty_like(x)
        bounds = list(accumulate(counts))
        return grouped_swiglu(x, bounds, weights, use_grouped_mm=self.backend(x, weights, counts) == "grouped_mm")

    def descriptors(self, counts: Sequence[int], d: int, f: int) -> GroupedDescriptors:
        """The teaching descriptor table for ``counts`` (zero-row slots get no descriptor)."""
        counts = as_counts(counts)
        rows, slots = [], []
        start = 0
        for q, c in enumerate(counts):
            if c:
                rows.append([c, f, d, start * d, q * f * d, q * f * d, q * d * f, start * d])
                slots.append(q)
            start += c
        table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), len(DESCRIPTOR_FIELDS))
        return GroupedDescriptors(table=table, slots=tuple(slots))

    def ledger(self, counts: Sequence[int], d: int, f: int) -> RunnerLedger:
        counts = as_counts(counts)
        n = sum(counts)
        active = sum(1 for c in counts if c)
        return RunnerLedger(self.kind, n, n, n * d, n * f, 6 * n * d * f, 6 * n * d * f, DESCRIPTOR_BYTES * active)
