# ======================================================================================================
#  ONE STEP ON ONE SHARD (the data path; pure: no Ray)
#
#   StepRequest ──> pin the generation (exact refcount) ──> faults armed? wrap the step's components
#     prefill:  every layer through the normal dispatcher (engine | direct), control round per layer
#     decode:   ONE agreed admission round ──> bucket path for every layer (one CUDA graph on GPUs)
#               ──> overflow agreed at the end ──> else / on overflow: the normal dispatcher, reason kept
#   ──> deferred handle checks + device statistics read with the output (one host copy) ──> StepResult
# ======================================================================================================
"""Step records on the wire and the step executor of one shard."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from ray_moe.moe.dispatch.bucket import BucketDispatcher, token_buckets
from ray_moe.moe.dispatch.direct import DirectDispatcher
from ray_moe.moe.dispatch.engine import EngineDispatcher
from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.dispatch.local import LocalDispatcher
from ray_moe.moe.dispatch.protocol import ControlStatus, Dispatcher
from ray_moe.core.errors import ExchangeTimeoutError, RouteValidationError
from ray_moe.moe.experts.runners import make_runner
from ray_moe.moe.experts.runners.base import ExpertRunner
from ray_moe.moe.decode.admission import FallbackReason
from ray_moe.moe.decode.graphs import (
    CapturedStep,
    DecodeRecord,
    capture_failure,
    StepGraphs,
    agree_overflow,
    bucket_key_digest,
    decode_round,
    generation_digest,
)
from ray_moe.moe.layer import GenerationView, MoEStep
from ray_moe.moe.stats import LayerStats
from ray_moe.shard.records import StepRequest, StepResult
from ray_moe.core.types import DispatchPath, Phase

if TYPE_CHECKING:
    from ray_moe.model.config import RuntimeConfig
from ray_moe.core.wire import as_tensor, tensor_to_wire


@dataclass(frozen=True)
class DataPaths:
    """The components a shard picked when its exchange was set (one per phase, never per step).

    normal: engine or direct dispatcher (prefill, and the decode fallback); bucket: decode dispatcher or None
    """

    exchange: Exchange
    normal: Dispatcher
    bucket: BucketDispatcher | None
    runner: ExpertRunner
    capture: bool  # decode steps are captured as CUDA graphs (NCCL on CUDA)

    @classmethod
    def pick(cls, cfg: "RuntimeConfig", exchange: Exchange, selector: Any, *, dtype: torch.dtype,
             device: torch.device) -> "DataPaths":
        """The paths of a deployment (every rank picks alike: they speak one protocol). A group of one has
        nothing to exchange (local); otherwise the direct or engine normal path and the bucket decode path."""
        runner = make_runner(cfg.runner)
        bucket = None
        if exchange.size == 1 and cfg.dispatch_path is DispatchPath.AUTO:
            normal = LocalDispatcher(exchange, selector, validate=True)
            if cfg.decode_buckets:
                bucket = LocalDispatcher(exchange, selector, validate=False, token_cap=cfg.decode_token_capacity,
                                         top_k=cfg.top_k, hidden_size=cfg.hidden_size)
        else:
            if cfg.resolved_dispatch_path is DispatchPath.DIRECT:
                normal = DirectDispatcher(exchange, selector)
            else:
                normal = EngineDispatcher(exchange, selector, payload_format=cfg.payload_format, compute_dtype=dtype)
            if cfg.decode_buckets:
                bucket = BucketDispatcher(exchange, selector, token_cap=cfg.decode_token_capacity, top_k=cfg.top_k,
                                          hidden_size=cfg.hidden_size, slot_cap=cfg.decode_slot_capacity)
        capture = device.type == "cuda" and cfg.cuda_graphs and exchange.graph_capturable
        return cls(exchange, normal, bucket, runner, capture)


class DecodeKeys:
    """The graph-key digest of each generation's decode bucket (spec 0x05C), computed once per generation."""

    def __init__(self, cfg: "RuntimeConfig", dtype: torch.dtype) -> None:
        self.cfg, self.dtype = cfg, dtype
        self._keys: dict[int, int] = {}

    def __call__(self, view: GenerationView, bucket: BucketDispatcher) -> int:
        key = self._keys.get(view.generation)
        if key is None:
            cfg = self.cfg
            key = bucket_key_digest(view.snapshots, hidden_size=cfg.hidden_size, top_k=cfg.top_k, dtype=self.dtype,
                                    dispatch_backend=cfg.exchange_kind, runner_backend=cfg.runner,
                                    token_cap=bucket.token_cap, slot_cap_of=lambda s: bucket.shape(s).slot_cap)
            self._keys[view.generation] = key
        return key

    def forget(self, generation: int | None = None) -> None:
        """Drop one generation's key (retired), or all (new data paths)."""
        if generation is None:
            self._keys.clear()
        else:
            self._keys.pop(generation, None)


class Marks:
    """Host (and on CUDA device) timestamps of a step's stages, when asked for."""

    def __init__(self, enabled: bool, cuda: bool, t0: float) -> None:
        self.enabled, self.cuda, self.t0 = enabled, cuda, t0
        self._items: list[tuple[str, float, Any]] = []
        self._origin = None
        if enabled and cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()

    def __call__(self, label: str) -> None:
        if self.enabled:
            ev = None
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
            self._items.append((label, time.perf_counter() - self.t0, ev))

    def done(self) -> tuple[tuple[str, float, float], ...]:
        """Call after the step's host copy (which waited for every event)."""
        return tuple((lab, host, -1.0 if ev is None else float(self._origin.elapsed_time(ev)) * 1e-3)
                     for lab, host, ev in self._items)


class StepExecutor:
    """Runs steps for one shard. ``router(layer, hidden) -> (ids [T, k], gates [T, k])`` routes when the
    request carries no routes."""

    def __init__(self, rank: int, *, dtype: torch.dtype, hidden_size: int, num_layers: int, residual: bool,
                 device: torch.device, router: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                 decode_key: Callable[[GenerationView], int]) -> None:
        self.rank = rank
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.residual = residual
        self.device = device
        self.router = router
        self.decode_key = decode_key
        self.graphs = StepGraphs()
        self.counters: dict[str, int] = {}
        self.capture_error: str | None = None  # a failed capture: decode steps stay eager (reported in status)

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ------------------------------------------------------------------ entry
    def run(self, req: StepRequest, view: GenerationView, paths: DataPaths, status: ControlStatus,
            marks: Marks) -> tuple[torch.Tensor, tuple[LayerStats, ...], list]:
        """(output [T, d] on the device, layer statistics, routes used when asked)."""
        h = as_tensor(req.hidden, self.device).to(self.dtype)
        layers = tuple(range(self.num_layers)) if req.layers is None else tuple(req.layers)
        given = None
        if req.topk_ids is not None:
            given = (as_tensor(req.topk_ids, self.device).to(torch.int64),
                     as_tensor(req.topk_weights, self.device).to(torch.float32))
        routes_out: list = []
        marks("hidden_in")
        tag = req.step_id
        if req.phase is Phase.DECODE and paths.bucket is not None:
            y, stats = self._decode(h, given, layers, view, paths, status, tag, marks, routes_out, req.return_routes)
        else:
            reason = "bucket_disabled" if req.phase is Phase.DECODE else None
            y, stats = self._variable(h, given, layers, view, paths, status, tag, reason, routes_out,
                                      req.return_routes)
        marks("layers")
        return y, stats, routes_out

    # ------------------------------------------------------------------ the layer loop
    def _routes(self, i: int, layer: int, h: torch.Tensor, given) -> tuple[torch.Tensor, torch.Tensor]:
        if given is not None:
            return given[0][i], given[1][i]
        return self.router(layer, h)

    def _loop(self, ctx: MoEStep, h: torch.Tensor, given, layers, valid: torch.Tensor | None,
              routes_out: list | None) -> torch.Tensor:
        for i, layer in enumerate(layers):
            ids, gates = self._routes(i, layer, h, given)
            if routes_out is not None:
                routes_out.append((ids, gates))
            if valid is not None:  # padding tokens of a bucket route nowhere
                ids = torch.where(valid[:, None], ids, torch.full_like(ids, -1))
            y = ctx.moe_forward(layer, h, ids, gates)
            h = h + y if self.residual else y
        return h

    def _context(self, view, dispatcher, paths, status, tag, path=None, reason=None) -> MoEStep:
        return MoEStep(rank=self.rank, view=view, dispatcher=dispatcher, runner=paths.runner, dtype=self.dtype,
                       hidden_size=self.hidden_size, tag=tag, status=status, path=path, fallback_reason=reason)

    def _variable(self, h, given, layers, view, paths, status, tag, reason, routes_out, keep_routes):
        ctx = self._context(view, paths.normal, paths, status, tag, reason=reason)
        y = self._loop(ctx, h, given, layers, None, routes_out if keep_routes else None)
        stats, _ = ctx.finish()
        if reason is not None:
            self.count(f"fallback_{reason}", len(layers))
        return y, stats

    # ------------------------------------------------------------------ decode
    def _decode(self, h, given, layers, view, paths, status, tag, marks, routes_out, keep_routes):
        bucket = paths.bucket
        t = int(h.shape[0])
        local_error = None
        if given is not None and status == ControlStatus.OK:
            local_error = _check_routes(given, view.snapshots[0].num_experts, tag)
            if local_error is not None:
                status = ControlStatus.BAD_INPUT
        key = self.decode_key(view)
        base = (key, len(layers), given is None)
        ready = self.graphs.ready_mask(view.generation, base, token_buckets(bucket.max_token_cap)) if paths.capture else 0
        rec = DecodeRecord(view.generation, view.snapshots[0].pg_epoch, generation_digest(view.snapshots), status,
                           t, key, ready)
        decision = decode_round(paths.exchange, rec, bucket.token_cap, tag, local_error=local_error)
        marks("decode_round")
        if decision.reason is not None:
            return self._variable(h, given, layers, view, paths, ControlStatus.OK, tag, decision.reason.value,
                                  routes_out, keep_routes)
        bucket = bucket.for_tokens(decision.cap)
        paths = dataclasses.replace(paths, bucket=bucket)
        graph_key = (*base, bucket.token_cap)
        captured = self.graphs.get(view.generation, graph_key)
        staged = self._stage(h, given, len(layers), bucket.token_cap)
        seen: list | None = [] if keep_routes else None
        # routes chosen inside a replayed graph are not kept: a step that must return them runs eagerly
        # (the flag and the routing source are the same on every rank, so they decide alike)
        if decision.replay and not (keep_routes and given is None):
            out, ctx = captured.replay(staged)
            marks("replayed")  # device clock: where the graph's work ends (before any host read)
            path = "bucket-graph"
        else:
            out, ctx = self._bucket_body(view, paths, tag, given is None, layers, seen)(staged)
            path = "bucket"
            if paths.capture:  # every rank ran this step eagerly (the warm-up); ranks without a graph record one
                self._capture(view, paths, tag, given is None, layers, graph_key, staged)
        y = out[:t]
        summary = ctx.device_summary()
        if paths.exchange.device_async:
            paths.exchange.wait(f"decode step {tag!r}")  # type: ignore[attr-defined]
        host = None if summary is None else summary.cpu().numpy()
        ctx.path = path
        stats, overflow = ctx.finish(host)
        if agree_overflow(paths.exchange, overflow, tag):
            reason = FallbackReason.EXPERT_ROUTE_CAPACITY_EXCEEDED.value
            return self._variable(h, given, layers, view, paths, ControlStatus.OK, f"{tag}/rerun", reason,
                                  routes_out, keep_routes)
        self.count("bucket_steps")
        self.count("bucket_layers", len(layers))
        if keep_routes:
            routes_out.extend([(given[0][i], given[1][i]) for i in range(len(layers))] if given is not None
                              else [(ids[:t], gates[:t]) for ids, gates in seen])
        return y, stats

    def _stage(self, h, given, num_layers: int, cap: int) -> dict[str, torch.Tensor]:
        """The step's inputs padded to the bucket (padding: zero rows, route id -1, gate 0, invalid)."""
        t, dev = int(h.shape[0]), h.device
        pad = cap - t
        staged = {"hidden": torch.cat([h, h.new_zeros(pad, h.shape[1])]) if pad else h,
                  "valid": torch.arange(cap, device=dev) < t}
        if given is not None:
            ids, gates = given
            k = ids.shape[-1]
            staged["ids"] = torch.cat([ids, ids.new_full((num_layers, pad, k), -1)], 1) if pad else ids
            staged["gates"] = torch.cat([gates, gates.new_zeros((num_layers, pad, k))], 1) if pad else gates
        return staged

    def _bucket_body(self, view, paths, tag, routed_here: bool, layers, seen: list | None = None):
        def body(inp: dict[str, torch.Tensor]):
            ctx = self._context(view, paths.bucket, paths, ControlStatus.OK, tag, path="bucket")
            given = None if routed_here else (inp["ids"], inp["gates"])
            return self._loop(ctx, inp["hidden"], given, layers, inp["valid"], seen), ctx
        return body

    def _capture(self, view, paths, tag, routed_here, layers, graph_key, staged) -> None:
        """Record the whole decode step as one CUDA graph over stable copies of this step's inputs."""
        if self.graphs.get(view.generation, graph_key) is not None or self.capture_error is not None:
            return
        inputs = {k: v.clone() for k, v in staged.items()}
        step = CapturedStep(inputs)
        try:
            step.capture(self._bucket_body(view, paths, f"{tag}/graph", routed_here, layers))
        except Exception as exc:  # noqa: BLE001 - keep serving the bucket eagerly; say why in status
            self.capture_error = capture_failure(exc)
            return
        self.graphs.put(view.generation, graph_key, step)
        self.count("graphs_captured")


def _check_routes(given, num_experts: int, tag: str) -> Exception | None:
    """Bad routes in a decode step (one host sync for every layer): the rank's own, exact error."""
    ids, gates = given
    if ids.numel() == 0:
        return None
    lo, hi, ok = torch.stack([ids.min().double(), ids.max().double(),
                              (torch.isfinite(gates) & (gates >= 0)).all().double()]).tolist()
    if lo < 0 or hi >= num_experts:
        return RouteValidationError(f"topk_ids: expert id {int(lo) if lo < 0 else int(hi)} is out of range "
                                    f"[0, {num_experts})")
    if not ok:
        return RouteValidationError("topk_weights: NaN, infinite or negative gate")
    return None


class StepOrder:
    """Generation steps launch in the order the driver sent them, although the actor is threaded: a request
    names the step it follows (``after``) and waits until that one was launched here (it may still be
    completing: a group of one overlaps them), successfully or not."""

    def __init__(self, remember: int = 64) -> None:
        self._cv = threading.Condition()
        self._done: deque[str] = deque(maxlen=remember)

    def wait_turn(self, step_id: str, after: str | None, timeout_s: float) -> None:
        if after is None:
            return
        with self._cv:
            if not self._cv.wait_for(lambda: after in self._done, timeout=timeout_s):
                raise ExchangeTimeoutError(f"step {step_id!r}: the step it follows ({after!r}) did not run on this "
                                           f"rank within {timeout_s:.0f}s")

    def launched(self, step_id: str) -> None:
        with self._cv:
            self._done.append(step_id)
            self._cv.notify_all()


class PinnedStaging:
    """A grow-only pinned host buffer for step outputs (a DMA at link speed, no page faults). The output
    array is a view of it until the next step: the caller moves it somewhere durable under the step lock."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def to_host(self, h: torch.Tensor) -> tuple[np.ndarray, str]:
        if h.device.type != "cuda" or h.numel() == 0:
            return tensor_to_wire(h)
        h = h.contiguous()
        nbytes = h.numel() * h.element_size()
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        host = self._buf[:nbytes].view(h.dtype).view(h.shape)
        host.copy_(h)
        return tensor_to_wire(host)

    def holds(self, arr: Any) -> bool:
        """Whether ``arr`` is a view of the staging buffer (bounds only: O(1))."""
        return (self._buf is not None and isinstance(arr, np.ndarray) and arr.size > 0
                and np.may_share_memory(arr, self._buf.numpy()))


__all__ = ["StepRequest", "StepResult", "DataPaths", "StepExecutor", "Marks", "PinnedStaging", "LayerStats",
           "StepOrder"]
