# ======================================================================================================
#  ONE STEP ON ONE SHARD (the data path; pure: no Ray)
#
#   ShardCore.step(StepRequest): the declared StepKind checked ──> its turn (the step it follows launched)
#   ──> pin the generation (exact refcount) ──> faults armed? wrap the step's components
#   ──> the front the kind names: EXPERT_ONLY: StepExecutor (hidden + routes in, hidden out) or
#       GENERATION: TokenStepExecutor (token ids in, sampled token ids out, the model host around the MoE layers)
#   ──> StepPipeline, the one sequence both fronts take for a step with a decode unit:
#       1. ONE agreed decode round (generation, epoch, digest, status, tokens, bucket key, graphs ready)
#          ──> the bucket path (agreed token cap) or a named fallback to the normal dispatcher
#       2. the static-shape step: replay its captured CUDA graph, else run it eagerly and capture it
#       3. overflow agreed at the end ──> on overflow every rank reruns on the normal dispatcher (counted)
#   ──> deferred handle checks + device statistics read with the output (one host copy) ──> one StepResult
#       (the common fields and the kind's output)
# ======================================================================================================
"""The step pipeline of one shard and its expert-only front (``StepExecutor``)."""

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
from ray_moe.moe.experts.runners.grouped import mid_choice
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
from ray_moe.moe.layer import PlacementView, MoEStep
from ray_moe.moe.stats import LayerStats
from ray_moe.shard.records import StepRequest
from ray_moe.core.types import DispatchPath, Phase, RunnerKind

if TYPE_CHECKING:
    from ray_moe.model.config import RuntimeConfig
from ray_moe.core.wire import as_tensor, tensor_to_wire


# the decode bucket of a deployment that serves no generation (expert-only steps, ``rt.forward``) unless the config
# names one: generation steps size it to the running sequences of a rank (``ShardCore.load_model``)
EXPERT_DECODE_CAP = 32


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
             device: torch.device, decode_cap: int | None = None) -> "DataPaths":
        """The paths of a deployment (every rank picks alike: they speak one protocol). A group of one has
        nothing to exchange (local); otherwise the direct or engine normal path and the bucket decode path.
        ``decode_cap``: the decode bucket's largest token capacity (None: ``cfg.decode_token_capacity``, or
        ``EXPERT_DECODE_CAP`` when that is None too: generation steps size it to the running sequences)."""
        # the grouped runner's mid-size kernels: measured here, once a process, before any capture
        runner = (make_runner(cfg.runner, mid=mid_choice(device, dtype, cfg.hidden_size, cfg.ffn_size,
                                                         cfg.slots_per_rank, cfg.top_k))
                  if cfg.runner is RunnerKind.GROUPED else make_runner(cfg.runner))
        cap = decode_cap or cfg.decode_token_capacity or EXPERT_DECODE_CAP
        capture = device.type == "cuda" and cfg.cuda_graphs and exchange.graph_capturable
        bucket = None
        if exchange.size == 1 and cfg.dispatch_path is DispatchPath.AUTO:
            normal = LocalDispatcher(exchange, selector, validate=True)
            if cfg.decode_buckets:
                bucket = LocalDispatcher(exchange, selector, validate=False, token_cap=cap,
                                         top_k=cfg.top_k, hidden_size=cfg.hidden_size)
        else:
            if cfg.resolved_dispatch_path is DispatchPath.DIRECT:
                normal = DirectDispatcher(exchange, selector, capture_plans=device.type == "cuda" and cfg.cuda_graphs)
            else:
                normal = EngineDispatcher(exchange, selector, payload_format=cfg.payload_format, compute_dtype=dtype)
            if cfg.decode_buckets:
                bucket = BucketDispatcher(exchange, selector, token_cap=cap, top_k=cfg.top_k,
                                          hidden_size=cfg.hidden_size, slot_cap=cfg.decode_slot_capacity,
                                          payload_format=cfg.payload_format, compute_dtype=dtype)
        return cls(exchange, normal, bucket, runner, capture)


class DecodeKeys:
    """The graph-key digest of each generation's decode bucket (spec 0x05C), computed once per generation."""

    def __init__(self, cfg: "RuntimeConfig", dtype: torch.dtype) -> None:
        self.cfg, self.dtype = cfg, dtype
        self._keys: dict[int, int] = {}

    def __call__(self, view: PlacementView, bucket: BucketDispatcher) -> int:
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


class StepPipeline:
    """The decode sequence every shard step takes, whatever its front (one instance per shard, shared by the
    expert-only and the generation front): ``agree_decode`` -> ``run_static`` -> ``overflowed``. Captured
    graphs live here, keyed by (generation, the front's shape key); ``capture_errors`` per unit ("decode",
    "prefill", "experts"): a failed capture keeps that unit eager, the reason reported in status."""

    def __init__(self) -> None:
        self.graphs = StepGraphs()
        self.capture_errors: dict[str, str] = {}
        self.counters: dict[str, int] = {}
        self.pool: Any = None  # one graph memory pool for every captured step of this shard (made at first capture)
        self.replay_s = 0.0  # host seconds inside graph replays (input copies + the launch), since the start

    def note_replay(self, seconds: float) -> None:
        """A captured step was replayed (its input copies and launch took ``seconds`` on the host)."""
        self.count("graph_replays")
        self.replay_s += seconds

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def capture_pool(self) -> Any:
        """The memory pool a new capture records into: the shard's one pool while a captured graph holds it, else
        None (the capture makes a new one). Once every graph of a pool is released PyTorch frees the pool, and a
        capture into its old handle fails the caching allocator's ``use_count > 0`` assert (met on an H100 when a
        lattice was released and captured again: every graph of it then stayed eager)."""
        return self.pool if len(self.graphs) else None

    @property
    def capture_error(self) -> str | None:
        """The failed captures, one line (None: every capture so far succeeded)."""
        return "; ".join(f"{u}: {e}" for u, e in sorted(self.capture_errors.items())) or None

    # 1. ------------------------------------------------------------ the decode round
    def agree_decode(self, exchange: Exchange, view: PlacementView, status: ControlStatus, tokens: int, key: int,
                     token_cap: int, tag: str, *, ready: int = 0, local_error: Exception | None = None):
        """This rank's decode record against every peer's (one all-gather) -> the agreed ``DecodeDecision``:
        the bucket's token cap, whether every rank holds the graph (``ready``: this rank's mask of captured
        caps), or the fallback reason. A rank whose own input was refused re-raises ``local_error`` there."""
        rec = DecodeRecord(view.generation, view.snapshots[0].pg_epoch, generation_digest(view.snapshots), status,
                           tokens, key, ready)
        return decode_round(exchange, rec, token_cap, tag, local_error=local_error)

    # 2. ------------------------------------------------------------ the static-shape step
    def run_static(self, generation: int, key: Any, staged: dict[str, torch.Tensor], body: Callable, *, unit: str,
                   replay: bool | None = None, capture: bool = True, limit: int | None = None) -> tuple[Any, bool]:
        """``body(inputs) -> (outputs, MoEStep)`` at static shapes. Replays the graph of (generation, key) when
        there is one (``replay`` None: this rank's own decision; a bool: the group's agreed one), else runs
        ``body`` eagerly (this step's answer and the warm-up) and, with ``capture``, records it over stable
        copies of ``staged`` (at most ``limit`` graphs of ``unit`` per generation). Returns ((outputs, ctx),
        replayed)."""
        captured = self.graphs.get(generation, key)
        if captured is not None and (replay is None or replay):
            self.count("graph_replays")
            t = time.perf_counter()
            out = captured.replay(staged)
            self.replay_s += time.perf_counter() - t  # (the launch blocks while the device's queue is full)
            return out, True
        out = body(staged)
        full = limit is not None and self.graphs.count(generation, unit) >= limit
        if capture and captured is None and unit not in self.capture_errors and not full:
            step = CapturedStep({k: v.clone() for k, v in staged.items()})
            try:
                # records only (no collective runs while capturing), into the shard's one graph memory pool
                pool = self.capture_pool()
                self.pool = step.capture(body, pool) or pool
            except Exception as exc:  # noqa: BLE001 - keep serving eagerly; say why in status
                self.capture_errors[unit] = capture_failure(exc)
            else:
                self.graphs.put(generation, key, step)
                self.count("graphs_captured")
                self.count("graphs_captured_serving")  # (on demand: an expert-only step's first of its shape)
        return out, False

    # 3. ------------------------------------------------------------ the overflow agreement
    def overflowed(self, exchange: Exchange, overflow: bool, tag: str) -> bool:
        """Whether any rank's bucket overflowed (every rank then reruns the step on the normal path; counted)."""
        if agree_overflow(exchange, overflow, tag):
            self.count(f"fallback_{FallbackReason.EXPERT_ROUTE_CAPACITY_EXCEEDED.value}")
            return True
        return False


class StepExecutor:
    """Runs steps for one shard. ``router(layer, hidden) -> (ids [T, k], gates [T, k])`` routes when the
    request carries no routes."""

    def __init__(self, rank: int, *, dtype: torch.dtype, hidden_size: int, num_layers: int, residual: bool,
                 device: torch.device, router: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                 decode_key: Callable[[PlacementView], int], pipeline: StepPipeline | None = None) -> None:
        self.rank = rank
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.residual = residual
        self.device = device
        self.router = router
        self.decode_key = decode_key
        self.pipeline = pipeline or StepPipeline()
        self.counters: dict[str, int] = {}

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ------------------------------------------------------------------ entry
    def run(self, req: StepRequest, view: PlacementView, paths: DataPaths, status: ControlStatus,
            marks: Marks) -> tuple[torch.Tensor, tuple[LayerStats, ...], list]:
        """(output [T, d] on the device, layer statistics, routes used when asked) of an expert-only request."""
        inp = req.input
        h = as_tensor(inp.hidden, self.device).to(self.dtype)
        layers = tuple(range(self.num_layers)) if inp.layers is None else tuple(inp.layers)
        given = None
        if inp.topk_ids is not None:
            given = (as_tensor(inp.topk_ids, self.device).to(torch.int64),
                     as_tensor(inp.topk_weights, self.device).to(torch.float32))
        routes_out: list = []
        marks("hidden_in")
        tag = req.step_id
        if inp.phase is Phase.DECODE and paths.bucket is not None:
            y, stats = self._decode(h, given, layers, view, paths, status, tag, marks, routes_out, inp.return_routes)
        else:
            reason = "bucket_disabled" if inp.phase is Phase.DECODE else None
            y, stats = self._variable(h, given, layers, view, paths, status, tag, reason, routes_out,
                                      inp.return_routes)
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
        pipe, bucket = self.pipeline, paths.bucket
        t = int(h.shape[0])
        local_error = None
        if given is not None and status == ControlStatus.OK:
            local_error = _check_routes(given, view.snapshots[0].num_experts, tag)
            if local_error is not None:
                status = ControlStatus.BAD_INPUT
        base = ("experts", self.decode_key(view), len(layers), given is None)
        ready = pipe.graphs.ready_mask(view.generation, base, token_buckets(bucket.max_token_cap)) if paths.capture else 0
        # 1. the decode round
        decision = pipe.agree_decode(paths.exchange, view, status, t, base[1], bucket.token_cap, tag, ready=ready,
                                     local_error=local_error)
        marks("decode_round")
        if decision.reason is not None:
            return self._variable(h, given, layers, view, paths, ControlStatus.OK, tag, decision.reason.value,
                                  routes_out, keep_routes)
        paths = dataclasses.replace(paths, bucket=bucket.for_tokens(decision.cap))
        staged = self._stage(h, given, len(layers), paths.bucket.token_cap)
        seen: list | None = [] if keep_routes else None
        # 2. the static-shape step: routes chosen inside a replayed graph are not kept, so a step that must return
        # them runs eagerly (the flag and the routing source are the same on every rank: they decide alike)
        replay = decision.replay and not (keep_routes and given is None)
        body = self._bucket_body(view, paths, tag, given is None, layers, seen)
        (out, ctx), replayed = pipe.run_static(view.generation, (*base, paths.bucket.token_cap), staged, body,
                                               unit="experts", replay=replay, capture=paths.capture)
        marks("replayed" if replayed else "bucket")  # device clock: where the step's work ends
        y = out[:t]
        summary = ctx.device_summary()
        if paths.exchange.device_async:
            paths.exchange.wait(f"decode step {tag!r}")  # type: ignore[attr-defined]
        host = None if summary is None else summary.cpu().numpy()
        ctx.path = "bucket-graph" if replayed else "bucket"
        stats, overflow = ctx.finish(host)
        # 3. the overflow agreement
        if pipe.overflowed(paths.exchange, overflow, tag):
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
    """Steps launch in the order the driver sent them, although the actor is threaded: a request names the
    step it follows (``StepRequest.after``) and waits until that one was launched here (a generation step may
    still be completing: a group of one overlaps them), successfully or not."""

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


class StepCompletions:
    """Completions of launched steps whose device work is done, each run exactly once by whichever thread reaches it
    first: the generation thread's queue (``run_queued``, in turn), or the launching thread between the pieces of
    the piecewise step it is launching (``run_ready``; the caller holds the step lock). A piecewise step of 16k
    prompt tokens issues more work than the device's command buffer holds, so its launch blocks until the device is
    deep into it; the step before it, complete on the device long before, was read only after that launch returned,
    and the driver's next request came too late to keep the device busy (on an H100 at 24 layers, long prompts:
    ~13 ms of device idle per prompt step, 289 ms of a 7.1 s pass, b994b30's lease). Pure: no CUDA, no Ray."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: deque[_Completion] = deque()

    def add(self, fn: Callable[[], Any]) -> "_Completion":
        """A completion ``fn`` (runs under the step lock) of a step whose device work is done: queued for the
        launching thread; the caller also submits ``run_queued`` to the generation thread."""
        job = _Completion(fn)
        with self._lock:
            self._ready.append(job)
        return job

    def run_ready(self) -> int:
        """Run every queued completion now, in order (the launching thread, holding the step lock); returns how
        many ran here. A completion's error goes to its waiter, never to the launch around it."""
        ran = 0
        while True:
            with self._lock:
                if not self._ready:
                    return ran
                job = self._ready.popleft()
            ran += job.run()

    def run_queued(self, job: "_Completion") -> None:
        """``job`` on the generation thread's queue (the caller holds the step lock): run unless already run."""
        with self._lock:
            try:
                self._ready.remove(job)
            except ValueError:
                pass
        job.run()


class _Completion:
    """One completion: ``run`` executes ``fn`` at most once; ``result`` waits for it (re-raises its error)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn: Callable[[], Any] | None = fn
        self._claim = threading.Lock()
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> int:
        """1 if this call ran it, 0 if another had."""
        with self._claim:
            fn, self._fn = self._fn, None
        if fn is None:
            return 0
        try:
            self._value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            self._error = exc
        finally:
            self._done.set()
        return 1

    def result(self, timeout_s: float | None = None) -> Any:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"a step's completion did not run within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._value


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


__all__ = ["StepCompletions", "DataPaths", "StepExecutor", "Marks", "PinnedStaging", "LayerStats", "StepOrder"]
