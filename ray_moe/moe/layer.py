# ======================================================================================================
#  ONE STEP'S MOE LAYERS ON ONE RANK (pure: no Ray)
#
#   for each MoE layer l (called by the expert-only loop, or by a transformers model through the
#   ``ray_moe`` experts seam):
#       dispatch (the step's dispatcher) ──> expert runner (the only SwiGLU) ──> combine ──> [T, d]
#   statistics and handle checks stay on the device until ``finish`` reads them all with one host copy.
# ======================================================================================================
"""The per-step MoE executor: ``moe_forward(layer, hidden, topk_ids, topk_weights)`` for every layer of one
step on one rank, under one pinned generation and one dispatcher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_moe.moe.dispatch.protocol import ControlStatus, DeferredChecks, Dispatcher
from ray_moe.moe.dispatch.records import DispatchOutput, DispatchOutputFormat
from ray_moe.core.routes import RouteBatch
from ray_moe.moe.experts import slab
from ray_moe.moe.experts.runners.base import ExpertRunner
from ray_moe.moe.experts.runners.fp8 import Fp8Runner
from ray_moe.moe.experts.runners.grouped import device_tensor
from ray_moe.moe.experts.weights import SlotWeights
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.moe.stats import LayerStats, layer_stats, merge_layer_stats


def run_experts(runner: ExpertRunner, out: DispatchOutput, weights: SlotWeights | None, hidden_size: int) -> torch.Tensor:
    """The expert runner boundary: the runner entry the dispatch output's declared format names. Row-mapped
    slot weights (a generation over a shard's slot buffers, ``SlotWeights.rows``) go through the buffer-order
    translation of ``moe.experts.slab``; plain ones straight to the runner. FP8 slot weights (codes with block
    scales) run through ``runners.fp8.Fp8Runner``: the block-FP8 kernels where their start check passed on this
    device (``fast_path_reason`` None), else the runner on their dequantized values."""
    fmt = out.format
    rows = out.rows
    if weights is None:  # this rank hosts no slot of the layer: nothing was received
        return rows if fmt is DispatchOutputFormat.SLOT_CAPACITY else rows.new_zeros((0, hidden_size))
    if weights.scales is not None:
        runner = Fp8Runner(runner)  # type: ignore[assignment]
    mapped = weights.row_mapped
    if fmt is DispatchOutputFormat.EXPERT_MAJOR_INDEXED:  # the one-rank route plan: rows not gathered yet
        if runner.takes_indexed(rows, int(out.order.numel()), weights):
            return runner.run_indexed(rows, out.order, out.top_k, out.offsets, weights,
                                      weight_rows=slab.slab_index(weights).rows if mapped else None)
        rows = rows.index_select(0, out.order.to(torch.int64) // max(out.top_k, 1))
        fmt = DispatchOutputFormat.EXPERT_MAJOR_DEVICE_OFFSETS
    if fmt is DispatchOutputFormat.EXPERT_MAJOR_DEVICE_OFFSETS:  # device-side offsets (the one-rank path)
        return slab.run_offsets(runner, rows, out.offsets, weights) if mapped else \
            runner.run_offsets(rows, out.offsets, weights)
    if fmt is DispatchOutputFormat.SLOT_CAPACITY:
        return slab.run_capacity(runner, rows, out.valid, weights) if mapped else \
            runner.run_capacity(rows, weights, out.valid)
    if rows.shape[0] == 0:
        return rows.new_zeros((0, hidden_size))
    return slab.run_counts(runner, rows, out.counts_list, weights) if mapped else \
        runner.run(rows, out.counts_list, weights)


@dataclass(frozen=True)
class PlacementView:
    """What a step needs of one pinned generation: a snapshot and this rank's stacked weights per layer."""

    generation: int
    snapshots: tuple[PlacementSnapshot, ...]
    weights: tuple[SlotWeights | None, ...]


class MoEStep:
    """Every MoE layer of one step on one rank (implements the ``MoEExecutor`` seam protocol).

    status:   what this rank reports in the step's first control round (a refused generation still takes
              part, so every peer aborts together)
    path:     the label recorded in the layer statistics
    row_valid: [T] bool or None; rows marked False are padding of a static-shape step (route id -1)
    """

    def __init__(self, *, rank: int, view: PlacementView, dispatcher: Dispatcher, runner: ExpertRunner,
                 dtype: torch.dtype, hidden_size: int, tag: str, status: ControlStatus = ControlStatus.OK,
                 path: str | None = None, fallback_reason: str | None = None,
                 row_valid: torch.Tensor | None = None) -> None:
        self.rank = rank
        self.view = view
        self.dispatcher = dispatcher
        self.runner = runner
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.tag = tag
        self.status = status
        self.path = path or dispatcher.mode.value
        self.fallback_reason = fallback_reason
        self.row_valid = row_valid  # [T] bool: padding rows of a static-shape step route nowhere
        self.checks = DeferredChecks()
        self._pending: list[tuple[int, Any, Any, Any]] = []  # (layer, sent slots, slot rows, overflow flag)

    @property
    def layer_entry(self):
        """What a MoE block calls (the model host binds its experts modules to it for the step)."""
        return self.moe_forward

    def moe_forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, d], topk_ids [T, k] int64, topk_weights [T, k] -> routed experts' combined output [T, d]."""
        snap = self.view.snapshots[layer]
        tag = f"{self.tag}/L{layer}"
        status = self.status if not self._pending else ControlStatus.OK
        row_valid = self.row_valid
        if row_valid is not None and not self.dispatcher.masks_rows:
            topk_ids, row_valid = torch.where(row_valid[:, None], topk_ids, topk_ids.new_full((), -1)), None
        out = self.dispatcher.dispatch(RouteBatch(self.rank, hidden, topk_ids, topk_weights, row_valid), snap,
                                       tag=tag, status=status)
        y_rows = run_experts(self.runner, out, self.view.weights[layer], self.hidden_size)
        y = self.dispatcher.combine(y_rows, out.handle, snap, tag=tag, out_dtype=self.dtype, checks=self.checks)
        self._pending.append((layer, self.dispatcher.sent_slot_counts(out.handle), self.dispatcher.slot_rows(out),
                              getattr(out.handle, "overflow", None)))
        return y

    def device_summary(self) -> torch.Tensor | None:
        """[sum over layers of (Q + Q_local + 1), then one per handle check] int64 on the device: every
        layer's device-side counts, overflow flags and handle checks, for ONE host copy (None when there is
        nothing on the device)."""
        parts = []
        for _, sent, rows, flag in self._pending:
            for x in (sent, rows, flag):
                if isinstance(x, torch.Tensor):
                    parts.append(x.reshape(-1).to(torch.int64))
        flags = self.checks.flags()
        if flags is not None:
            parts.append(flags.to(torch.int64))
        if not parts:
            return None
        dev = parts[0].device
        return torch.cat([p.to(dev) for p in parts])

    def finish(self, host_summary: np.ndarray | None = None, verify: bool = True) -> tuple[tuple[LayerStats, ...], bool]:
        """(layer statistics, overflowed): reads the device-side counts and handle checks with one copy
        (``host_summary``: ``device_summary()`` already on the host), then verifies the checks (``verify``)."""
        if host_summary is None:
            dev = self.device_summary()
            host_summary = None if dev is None else dev.cpu().numpy()
        if verify and len(self.checks):
            self.checks.verify(host_summary[len(host_summary) - len(self.checks):].tolist())
        pos = 0

        def take(x: Any) -> Any:
            nonlocal pos
            if not isinstance(x, torch.Tensor):
                return x
            n = x.numel()
            v = host_summary[pos:pos + n]
            pos += n
            return v

        stats, overflow = [], False
        for layer, sent, rows, flag in self._pending:
            sent_h, rows_h, flag_h = take(sent), take(rows), take(flag)
            overflow = overflow or bool(flag_h is not None and np.asarray(flag_h).any())
            stats.append(layer_stats(layer, sent_h, rows_h, self.view.snapshots[layer], self.rank, self.path,
                                     self.fallback_reason))
        return tuple(stats), overflow

    def summary_layout(self) -> tuple | None:
        """What ``device_summary`` packs, per layer the element counts of its sent / rows / flag tensors (0: no
        flag) and the handle checks' count: steps of one layout sum elementwise (``finish_summed``). None when
        a layer's counts are host values (nothing to sum). Computed once per step context."""
        if not hasattr(self, "_layout"):
            def n(x: Any) -> int:
                return x.numel() if isinstance(x, torch.Tensor) else 0 if x is None else -1
            per = tuple((layer, n(s), n(r), n(f)) for layer, s, r, f in self._pending)
            self._layout = None if any(min(p[1:]) < 0 for p in per) else (per, len(self.checks))
        return self._layout

    def finish_summed(self, summaries: list[np.ndarray]) -> tuple[tuple[LayerStats, ...], bool]:
        """``finish`` over several steps of this context's ``summary_layout`` (the sub-steps of a multi-step
        request replaying one graph), ``device_summary`` of each on the host: every step's handle checks
        verified, their counts summed, then one LayerStats per layer (as ``merge_layer_stats`` of each step's
        would give) and whether any step overflowed."""
        k = len(self.checks)
        if k:
            for h in summaries:
                self.checks.verify(h[len(h) - k:].tolist())
        return self.finish(np.sum(summaries, axis=0), verify=False)


__all__ = ["LayerStats", "MoEStep", "PlacementView", "RouteRecorder", "SplitMoE", "expert_counts", "layer_stats",
           "merge_layer_stats", "run_experts"]


class SplitMoE:
    """Spec 0x05E inside a model step: each MoE layer's decode rows go through the decode unit, the other
    rows through the prefill unit, outputs back in packed order. Units run in a fixed order on every rank."""

    def __init__(self, prefill: MoEStep | None, decode: MoEStep | None, decode_rows: torch.Tensor,
                 prefill_rows: torch.Tensor) -> None:
        self.prefill, self.decode = prefill, decode
        self.decode_rows, self.prefill_rows = decode_rows, prefill_rows

    @property
    def layer_entry(self):
        """What a MoE block calls: the one unit's own entry when the step has one unit, else the split."""
        if self.decode is None:
            return self.prefill.moe_forward
        if self.prefill is None:
            return self.decode.moe_forward
        return self.moe_forward

    def moe_forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        if self.decode is None:
            return self.prefill.moe_forward(layer, hidden, topk_ids, topk_weights)
        if self.prefill is None:
            return self.decode.moe_forward(layer, hidden, topk_ids, topk_weights)
        out = torch.empty_like(hidden)
        for unit, rows in ((self.prefill, self.prefill_rows), (self.decode, self.decode_rows)):
            out[rows] = unit.moe_forward(layer, hidden[rows], topk_ids[rows], topk_weights[rows]).to(out.dtype)
        return out


class RouteRecorder:
    """Every MoE layer's routes of one step, in front of the step's executor (``MoEStep`` or ``SplitMoE``), for
    requests that asked for their expert statistics. ids: [layers, T, k] int64 on the device, allocated at the
    first layer it sees (T, k: that layer's routes), each layer's routes copied in as the model reaches it; in
    a captured step the buffer is allocated inside the graph and is an output of its body (every replay
    overwrites it). row_valid: [T] bool or None; rows marked False (padding of a static-shape step) hold -1."""

    def __init__(self, inner: MoEStep | SplitMoE, num_layers: int, row_valid: torch.Tensor | None = None) -> None:
        self.inner = inner
        self.num_layers = num_layers
        self.row_valid = row_valid
        self.ids: torch.Tensor | None = None
        self._none: torch.Tensor | None = None
        self._entry = inner.layer_entry

    @property
    def layer_entry(self):
        return self.moe_forward

    def moe_forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        if self.ids is None:
            self.ids = torch.full((self.num_layers, *topk_ids.shape), -1, dtype=torch.int64, device=topk_ids.device)
            self._none = self.ids.new_full((), -1)  # (0-d: the padding rows' -1, broadcast)
        ids = topk_ids.to(torch.int64)
        if self.row_valid is not None:  # one kernel a layer, written in place (no -1 tensor, no copy)
            torch.where(self.row_valid[:, None], ids, self._none, out=self.ids[layer])
        else:
            self.ids[layer].copy_(ids)
        return self._entry(layer, hidden, topk_ids, topk_weights)


def expert_counts(ids: torch.Tensor, segments: list[tuple[int, int]], num_experts: int) -> torch.Tensor:
    """ids [L, T, k] int64 (-1: no route), segments: (first row, rows) of each counted sequence
    -> [S, L, E] int32 on ids' device: how many of each sequence's (row, expert) routes went to each expert in
    each layer. One scatter-add over the counted rows (no host wait: queued behind the step)."""
    n_layers, t, _ = ids.shape
    s = len(segments)
    dev = ids.device
    seg = np.full(t, -1, dtype=np.int64)
    for i, (a, n) in enumerate(segments):
        seg[a:a + n] = i
    rows = np.flatnonzero(seg >= 0)
    size = s * n_layers * num_experts
    if rows.size == 0:
        return torch.zeros((s, n_layers, num_experts), dtype=torch.int32, device=dev)
    rows_t = device_tensor(rows.tolist(), torch.int64, dev)  # (uploaded without a host wait)
    seg_t = device_tensor(seg[rows].tolist(), torch.int64, dev)
    sel = ids.index_select(1, rows_t)  # [L, R, k]
    layer = torch.arange(n_layers, device=dev)[:, None, None]
    key = (seg_t[None, :, None] * n_layers + layer) * num_experts + sel
    key = torch.where((sel >= 0) & (sel < num_experts), key, torch.full_like(key, size))  # unrouted: dropped
    out = torch.zeros(size + 1, dtype=torch.int32, device=dev)
    out.scatter_add_(0, key.reshape(-1), torch.ones(key.numel(), dtype=torch.int32, device=dev))
    return out[:size].reshape(s, n_layers, num_experts)
