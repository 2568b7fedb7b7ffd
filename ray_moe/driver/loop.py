# ======================================================================================================
#  THE GENERATION LOOP ON THE DRIVER
#
#   submit(prompt) ──> Scheduler queue ──> loop thread, between steps: admit / free / plan
#     ──> ONE actor call per rank per step: StepRequest (GENERATION: token ids + positions) ──> StepResult (ids)
#         (a step of decode items only, nothing waiting: up to decode_steps sub-steps in that one call)
#     ──> commit: tokens to each request's stream; finished requests release their KV blocks
#   a stale generation replans the same step on the active one; a dead rank is regrouped away and its
#   sequences are re-prefilled on the survivors; membership changes (add / remove rank) are picked up
#   between steps.
# ======================================================================================================
"""Continuous-batching generation over a running deployment (``Runtime.generate`` / ``generate_stream``)."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ray_moe.core.gc_pauses import GcPauses
from ray_moe.core.errors import RayMoEError, StepMemoryError, root_cause
from ray_moe.shard.records import GenerationInput, StepKind, StepRequest, StepResult
from ray_moe.model.sampling import SamplingParams, TokenLogprobs
from ray_moe.driver.defaults import serving_sizes
from ray_moe.driver.scheduler import KvCapacity, Scheduler, SeqState, StepPlan
from ray_moe.driver.transport import StepTransport
from ray_moe.core.types import Phase

_DONE = object()

log = logging.getLogger("ray_moe")


@dataclass(frozen=True)
class LoopSignals:
    """``GenerationLoop.signals()``: requests waiting / running, how long the oldest waiting one has waited
    (seconds, 0 when none waits), steps run so far, seconds since the last step with work (None: none yet)."""

    waiting: int
    running: int
    oldest_wait_s: float
    steps: int
    since_work_s: float | None


@dataclass
class ExpertTally:
    """One request's routed experts so far (``SamplingParams.expert_stats``): prompt / generated: [layers,
    experts] int64 counts of (token, expert) routes of its prompt rows and of its generated tokens' rows (a
    row at a position before the prompt's end counts as prompt; rows recomputed after a preemption or a lost
    rank count again, as does a multi-step decode's sub-step past the request's end within that step; prompt
    rows served from the prefix cache are not computed and not counted);
    generations: the placement generations its steps ran on."""

    prompt: np.ndarray | None = None
    generated: np.ndarray | None = None
    generations: set[int] = field(default_factory=set)

    def add(self, counts: np.ndarray, generation: int, *, prompt: bool) -> None:
        """counts: [layers, experts] int of one step's rows of the request."""
        self.generations.add(int(generation))
        c = np.asarray(counts, dtype=np.int64)
        if self.prompt is None:
            self.prompt, self.generated = np.zeros_like(c), np.zeros_like(c)
        if c.shape != self.prompt.shape:
            raise RayMoEError(f"expert counts of shape {list(c.shape)} after {list(self.prompt.shape)}")
        if prompt:
            self.prompt += c
        else:
            self.generated += c

    def as_dict(self) -> dict[str, list]:
        empty: list = []
        return {"generations": sorted(self.generations),
                "prompt": empty if self.prompt is None else self.prompt.tolist(),
                "generated": empty if self.generated is None else self.generated.tolist()}


@dataclass
class RequestHandle:
    """One submitted request: its new tokens arrive on ``events`` (a token int, then ``_DONE`` or an error);
    ``on_event`` (optional) is called from the loop thread with each token, then None (end) or the error.
    ``logprobs``: when the request asked (``SamplingParams.logprobs``), one ``TokenLogprobs`` per token in
    ``tokens``, appended before the token is emitted (so ``logprobs[i]`` exists once token i is seen).
    ``tally``: the request's expert counts when it asked (``SamplingParams.expert_stats``; ``expert_stats``),
    updated before the tokens of each step are emitted."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    on_event: Callable[[Any], None] | None = None
    events: "queue.Queue" = field(default_factory=queue.Queue)
    tokens: list[int] = field(default_factory=list)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    tally: ExpertTally | None = None

    def expert_stats(self) -> dict[str, list] | None:
        """{"generations": [placement generation ids, ascending], "prompt": [[count per expert] per MoE layer],
        "generated": [[...] per layer]} (counts of routed (token, expert) pairs); None when the request did not
        ask. Complete once the request is done."""
        return None if self.tally is None else self.tally.as_dict()

    def emit(self, item: Any, logprobs: TokenLogprobs | None = None) -> None:
        if isinstance(item, int):
            if logprobs is not None:
                self.logprobs.append(logprobs)
            self.tokens.append(item)
        elif item is not _DONE:
            self.error = item
        self.events.put(item)
        if self.on_event is not None:
            self.on_event(None if item is _DONE else item)
        if not isinstance(item, int):
            self.done.set()

    def stream(self, timeout_s: float | None = None) -> Iterator[int]:
        while True:
            item = self.events.get(timeout=timeout_s)
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def result(self, timeout_s: float | None = None) -> list[int]:
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"request {self.request_id!r}: no result within {timeout_s} s")
        if self.error is not None:
            raise self.error
        return list(self.tokens)


class GenerationLoop:
    """The driver's generation loop over a deployment's ranks, reached through a ``StepTransport`` (one
    thread; requests join between steps). ``device``: where the shards run ("cpu" | "cuda").

    kv_tokens: KV cache tokens per rank (None: each rank's cache takes what ``memory_fraction``, default 0.9,
    of its GPU leaves after the weights; 8192 on CPU); attention: an ``AttentionBackend`` value (auto:
    FlashAttention varlen where it runs, else the masked SDPA path); block_size: tokens per cache block; step_tokens: prefill tokens per
    rank per step; max_running: sequences in flight over all ranks (None: 1,024 on CUDA, 256 on CPU:
    ``driver/defaults.py``, as step_tokens and decode_steps); max_queued: waiting requests before
    ``submit`` refuses new ones (overload); decode_steps: decode sub-steps one step may run when every
    sequence is decoding and none waits (multi-step decode: one actor call per rank for that many tokens
    per sequence; 1 turns it off). Default: 4 on CUDA, where it keeps the device fed while the host round
    trip runs; 1 on CPU (no device to keep fed: every step's load reaches the rebalancer's window and
    requests join at every step; the CPU demo takes about the same time either way). fused_kernels: the model's
    RMSNorm layers and rotary embedding take fused kernels on CUDA (``models.norms``, ``models.rotary``; False
    keeps transformers' own). prefix_caching: KV blocks of identical prompt prefixes are shared within a rank
    and new requests routed to the rank holding their prefix (``shard/prefix.py``, ``Scheduler``); the prompt
    tokens served from those blocks over every prefill token are ``prefix_hit_tokens / prefix_lookup_tokens``
    (committed steps: a recovered step counts once; ``prefix_stats``).

    The step shapes are fixed at start (``shard/lattice.py``): each rank runs at most ``rank_running`` =
    ceil(max_running / ranks) sequences, and every decode size up to it and every token size up to ``step_tokens
    + rank_running`` is captured as a CUDA graph before the loop serves (``steps``: each rank's report; a step
    kind that runs eagerly there is warned about, with the reason, in ``warnings``; so is a GPU-sized cache the
    running limit outruns: ``capacity``)."""

    def __init__(self, transport: StepTransport, *, device: str = "cpu", kv_tokens: int | None = 8192, block_size: int = 16, step_tokens: int | None = None,
                 max_running: int | None = None, max_queued: int = 4096, random_model: dict | None = None,
                 decode_steps: int | None = None, fused_kernels: bool = True, attention: str = "auto",
                 memory_fraction: float | None = None, prefix_caching: bool = True) -> None:
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching={prefix_caching!r}: must be a bool")
        self.prefix_caching = prefix_caching
        self.prefix_hit_tokens = self.prefix_lookup_tokens = 0  # counted from committed steps' results
        step_tokens, max_running, decode_steps = serving_sizes(device, step_tokens=step_tokens, max_running=max_running,
                                                               decode_steps=decode_steps)
        if not 1 <= int(decode_steps) <= 64:  # before any shard loads the model
            raise ValueError(f"decode_steps={decode_steps}: must be in [1, 64]")
        self.transport = transport
        self.random_model = random_model
        self.fused_kernels = bool(fused_kernels)
        self.attention, self.memory_fraction = str(getattr(attention, "value", attention)), memory_fraction
        self.block_size = int(block_size)
        self.kv_tokens = None if kv_tokens is None else int(kv_tokens)
        self.max_queued = int(max_queued)
        self.device = device
        self.step_tokens = int(step_tokens)
        # the step lattice's per-rank running limit (the scheduler keeps every rank within it)
        self.rank_running = max(1, math.ceil(int(max_running) / max(1, len(transport.members()))))
        self._loaded: set[int] = set()
        self.warnings: list[str] = []
        # this process's collector pauses (``gc_counters``); on CUDA the heap alive after the model loaded is
        # frozen: a full collection between two steps' launches would leave the GPUs idle for it
        self.gc = GcPauses().install()
        try:
            info = self._load(transport.members())
            self._fp8_layers = int(info.get("fp8_expert_layers", 0))
            self._fp8_reason = info.get("fp8_dequantized_reason")
            self._fp8_untuned = info.get("fp8_untuned_reason")
            t0 = time.perf_counter()
            self.steps_report = transport.prepare_steps(transport.members())  # the lattice captured: before serving
            self.capture_s = time.perf_counter() - t0
        except BaseException:
            self.gc.close()
            raise
        # a rank whose start capture ran out of memory made its (empty) cache smaller and captured again
        # (``TokenStepExecutor.refit_kv``): the scheduler plans the smallest cache any rank holds now
        refit = [int(r["kv_blocks"]) for r in self.steps_report if r.get("kv_blocks") is not None]
        if info and refit and min(refit) < int(info["kv_blocks"]):
            info = {**info, "kv_blocks": min(refit)}
        self._warn_slow_paths(info)
        if device == "cuda":  # the start's heap frozen; young collections between a launch and the wait after it
            self.gc.freeze()
            self.gc.defer_to_safe_points()
        if self.kv_tokens is None:  # sized from memory on each rank: the cache tokens the first rank holds
            self.kv_tokens = int(info["kv_blocks"]) * int(info["block_size"])
        self.attention_backend = info.get("attention")
        self.vocab_size = int(info["vocab_size"])
        self.max_context = int(info["max_context"])
        self.scheduler = Scheduler(transport.members(), kv_blocks=int(info["kv_blocks"]), block_size=block_size,
                                   max_context=self.max_context, step_tokens=step_tokens, max_running=max_running,
                                   eos_token_ids=info.get("eos_token_ids", ()), decode_steps=decode_steps,
                                   prefix_caching=prefix_caching, rank_running=self.rank_running)
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self.steps = 0
        self.overlapped = 0  # steps launched while the previous one was still in flight
        # steps that ran out of device memory (contained: preempted, budgets halved), the last ones
        self.memory_events: deque = deque(maxlen=64)
        self._last_done = 0.0  # when the last step's results were collected (perf_counter)
        self.failed: BaseException | None = None
        # where a step's time goes, last steps only (ms): plan, launch (the actor calls sent), wait (blocked
        # for the results; with pipelining the next step is already on its way), shard (the slowest shard's
        # own step), queued (its wait on the shard before the step began: launch order, step thread, pin),
        # account (statistics), commit (tokens out), device (the slowest rank's device time of the step) and
        # idle (the longest a rank's device sat idle before the step started: the host did not keep it fed),
        # transport (the step's round trip from its actor calls sent to its results here, minus the slowest
        # actor call on its shard: Ray's dispatch, (de)serialisation and transfer both ways), host (the
        # busiest rank's host wall time in the step's launch and completion: ``StepResult.host_s``, an upper
        # bound of its host work), replay (that rank's part of it inside graph replays: ``StepResult.replay_s``),
        # host_cpu (that rank's thread CPU time over the same spans: ``StepResult.host_cpu_s``)
        self.timings: dict[str, deque] = {k: deque(maxlen=1024) for k in (
            "plan", "launch", "wait", "shard", "queued", "account", "commit", "device", "idle", "transport",
            "host", "replay", "host_cpu")}
        # each collected step's shape, in the order of ``timings``' per-step entries: (prompt tokens, decode
        # rows, decode sub-steps) summed over its ranks
        self.step_shapes: deque[tuple[int, int, int]] = deque(maxlen=1024)
        self._thread = threading.Thread(target=self._loop, name="ray-moe-generate", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
               on_event: Callable[[Any], None] | None = None) -> RequestHandle:
        """Queue one request (validated now: a request that can never fit raises here, the others run on)."""
        self.scheduler.check(prompt, params, self.vocab_size)
        return self._queue([(list(prompt), params, on_event)], request_id)[0]

    def submit_many(self, requests: Sequence[tuple[Sequence[int], SamplingParams, Callable[[Any], None] | None]]
                    ) -> list[RequestHandle]:
        """Queue a batch at once: (prompt, params, on_event) each, all or none (every request validated before
        any is queued; the batch as a whole against ``max_queued``), under one hold of the loop's lock, so the
        next step is planned with the whole batch in view (as an offline engine adds every request before
        it steps) rather than with the first few that arrived."""
        reqs = [(list(p), sp, cb) for p, sp, cb in requests]
        for i, (p, sp, _) in enumerate(reqs):
            try:
                self.scheduler.check(p, sp, self.vocab_size)
            except ValueError as exc:  # its own type and message; which request of the batch, as a note
                exc.add_note(f"requests[{i}] of a batch of {len(reqs)}: nothing was queued")
                raise
        return self._queue(reqs, None)

    def _queue(self, reqs: list[tuple[list[int], SamplingParams, Callable[[Any], None] | None]],
               request_id: str | None) -> list[RequestHandle]:
        """Queue checked requests under one hold of the lock (``request_id``: the one request's own id)."""
        with self._lock:
            if self.failed is not None:
                raise RayMoEError(f"the generation loop stopped: {self.failed}")
            pending = self.scheduler.pending()
            if pending + len(reqs) > self.max_queued:
                more = f" and {len(reqs)} more" if len(reqs) > 1 else ""
                raise OverloadedError(f"{pending} requests in flight{more} (max_queued={self.max_queued})")
            handles = []
            for p, sp, cb in reqs:
                rid = self.scheduler.enqueue(p, sp, request_id=request_id)
                handle = RequestHandle(rid, len(p), sp.max_new_tokens, cb,
                                       tally=ExpertTally() if sp.expert_stats else None)
                self._handles[rid] = handle
                handles.append(handle)
            self._wake.notify()
        return handles

    def signals(self) -> "LoopSignals":
        """The load the loop sees now (read-only; the scaler samples it, ``ray_moe.ray.scaler``)."""
        now, t = time.monotonic(), time.perf_counter()
        with self._lock:
            seqs = list(self.scheduler.seqs.values())
            steps = self.steps
        waiting = [s for s in seqs if s.state is SeqState.WAITING]
        running = sum(s.state is SeqState.RUNNING for s in seqs)
        oldest = max((now - s.submitted for s in waiting), default=0.0)
        return LoopSignals(waiting=len(waiting), running=running, oldest_wait_s=max(0.0, oldest), steps=steps,
                           since_work_s=None if not self._last_done else max(0.0, t - self._last_done))

    @property
    def rank_kv_tokens(self) -> int:
        """The tokens one rank's KV cache holds (blocks x block size): the most one sequence can ever use."""
        return self.scheduler.kv_blocks * self.scheduler.block_size

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.scheduler.cancel(request_id)
            h = self._handles.pop(request_id, None)
        if h is not None:
            h.emit(_DONE)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=60)
        self.gc.close()

    # ------------------------------------------------------------------ the loop
    def _load(self, ranks: list[int]) -> dict:
        todo = [r for r in ranks if r not in self._loaded]
        infos = self.transport.load_model(todo, kv_tokens=self.kv_tokens, block_size=self.block_size,
                                          random_model=self.random_model, fused_kernels=self.fused_kernels,
                                          attention=self.attention, memory_fraction=self.memory_fraction,
                                          prefix_caching=self.prefix_caching, rank_running=self.rank_running,
                                          step_tokens=self.step_tokens)
        self._loaded.update(todo)
        # the scheduler plans one cache size for every rank: the smallest (memory-sized caches may differ)
        return min(infos, key=lambda i: int(i["kv_blocks"])) if infos else {}

    def _warn_slow_paths(self, info: dict) -> None:
        """Say at start which step kinds leave the captured graphs on the GPU, and why, which rank made its
        cache smaller to capture them, and a GPU-sized cache the running limit outruns (``warnings``, logged)."""
        self.capacity = KvCapacity(int(info["kv_blocks"]) * self.block_size, self.rank_running, int(info["max_context"]))
        log.info("ray-moe: %s", self.capacity.note())
        if self.kv_tokens is None and self.device == "cuda" and (thin := self.capacity.warning()):
            self.warnings.append(thin)
        for rep in self.steps_report:
            refit = (rep.get("capture") or {}).get("kv_refit")
            if refit:
                kinds = ", ".join(refit["errors"])
                self.warnings.append(
                    f"rank {rep.get('rank')}: the start capture ran out of device memory ({kinds}): the KV cache was "
                    f"made smaller, {refit['from_tokens']} -> {refit['to_tokens']} tokens (keeping "
                    f"{refit['workspace_bytes'] / 2**30:.1f} GiB for activations and graphs), and the lattice "
                    f"captured again")
        if self.device != "cuda":
            for w in self.warnings:
                log.warning("ray-moe: %s", w)
            return
        if self._fp8_layers and self._fp8_reason:
            self.warnings.append(f"{self._fp8_layers} MoE layers hold FP8 experts: they compute on their dequantized "
                                 f"values every step (correct, slower than bf16 weights): {self._fp8_reason}")
        if self._fp8_untuned:
            self.warnings.append(f"the FP8 kernels take heuristic launch settings: {self._fp8_untuned} (on an H100 the "
                                 f"tuned table served 4.5-5.8% more tokens/s); `ray-moe bench fp8_tune` on this GPU, "
                                 f"from a checkout of the repository, measures one in about a minute")
        seen = set()
        for rep in self.steps_report:
            for kind, path in (rep.get("paths") or {}).items():
                if kind != "beyond_lattice" and path.startswith("eager") and (kind, path) not in seen:
                    seen.add((kind, path))
                    self.warnings.append(f"rank {rep.get('rank')}: {kind} steps run {path}: every kernel launched "
                                         f"from Python, several times a graph's host work per step")
        for w in self.warnings:
            log.warning("ray-moe: %s", w)

    def graph_counters(self) -> dict[str, int]:
        """Graph captures summed over the ranks: at start (``graphs_captured_start``) and since
        (``graphs_captured_serving``: a generation published later, or an expert-only step's shape), and the steps
        by path (``decode_graph_steps``, ``token_graph_steps``, ``piecewise_steps``, ``eager_steps``), from each
        rank's status."""
        out: dict[str, int] = {}
        for st in self.transport.status_of(self.transport.members()):
            for k, v in (st.get("counters") or {}).items():
                if k.startswith("graphs_captured") or k in ("decode_graph_steps", "token_graph_steps",
                                                            "piecewise_steps", "eager_steps", "graph_replays"):
                    out[k] = out.get(k, 0) + int(v)
        return out

    def _loop(self) -> None:
        while True:
            self.gc.safe_point()  # nothing in flight (idle, or the pipeline drained): collect now, if due
            with self._lock:
                if not self._stop and self.scheduler.pending() == 0:
                    self._wake.wait(timeout=1.0)
                    continue  # (work came, or a second passed: look again after the safe point)
                if self._stop:
                    return
            try:
                self._run()
            except BaseException as exc:  # noqa: BLE001 - every waiting request learns why
                cause = root_cause(exc)
                with self._lock:
                    self.failed = cause
                    handles = list(self._handles.values())
                    self._handles.clear()
                for h in handles:
                    h.emit(cause)
                return

    def _run(self) -> None:
        """Steps back to back while there is work, pipelined: step n+1 is planned and launched before step n's
        tokens are collected (a decode item that needs one of them is deferred: its rank feeds the token it
        sampled), so the Ray round trip and the driver's own work overlap the shards' step. Nothing is left in
        flight when this returns: it drains when another thread waits for the step lock (elastic operations
        quiesce between steps), when the loop stops, and on a failure (the failed step is recovered alone)."""
        tr = self.transport
        with tr.gate:
            members = tr.members()
            if members != self.scheduler.ranks:
                self._load(members)
                with self._lock:
                    self.scheduler.set_ranks(members)
            flying: _Launched | None = None
            while True:
                nxt = None
                if not (self._stop or tr.gate.contended or tr.members() != members):
                    nxt = self._launch(flying)
                    if nxt is not None and flying is not None:  # two steps on the devices: collect now, if due
                        self.gc.safe_point()
                if flying is None:
                    if nxt is None:
                        time.sleep(0.001)  # nothing runnable yet (requests wait for KV blocks)
                        return
                    flying = nxt
                    continue
                if not self._collect(flying, nxt):
                    return  # recovered alone: the next step is planned from the committed state
                flying = nxt
                if flying is None:
                    return

    def _launch(self, flying: "_Launched | None") -> "_Launched | None":
        """Plan the next step (after ``flying``, if any) and send every rank its share; None: nothing to run."""
        t0 = time.perf_counter()
        with self._lock:
            plan = self.scheduler.plan(ahead=None if flying is None else flying.plan)
        if plan.empty:
            return None  # frees ride along with the next step that runs
        ranks, gen, step_id = self.transport.next_step()
        reqs = _requests(plan, ranks, step_id, gen, None if flying is None else flying.step_id)
        t1 = time.perf_counter()
        refs = self.transport.launch(reqs)
        sent = time.perf_counter()
        self.overlapped += flying is not None
        self.timings["plan"].append((t1 - t0) * 1e3)
        self.timings["launch"].append((sent - t1) * 1e3)
        return _Launched(plan, ranks, step_id, reqs, refs, t0, sent)

    def _collect(self, step: "_Launched", nxt: "_Launched | None") -> bool:
        """Wait for ``step``'s results and commit them. On a failure the next step (already launched) is
        drained and its outcome dropped, then ``step`` is recovered and re-run alone (stale generation:
        replanned on the active one; dead rank: regrouped, its sequences re-prefilled on survivors).
        Returns False when that happened (``nxt`` must not be collected)."""
        tr = self.transport
        t0 = time.perf_counter()
        ranks, recovered = step.ranks, False
        try:
            results = tr.gather(step.step_id, step.reqs, step.refs)
        except BaseException as exc:  # noqa: BLE001 - classified by the runtime (re-raised when fatal)
            if nxt is not None:
                try:
                    tr.gather(nxt.step_id, nxt.reqs, nxt.refs)
                except BaseException:  # noqa: BLE001 - its outcome is dropped either way
                    pass
            cause = root_cause(exc)
            if isinstance(cause, (StepMemoryError, torch.OutOfMemoryError)):
                # contained: the step's sequences are recomputed later, steps get smaller, nothing else fails
                with self._lock:
                    back = self.scheduler.preempt(step.plan)
                    budgets = self.scheduler.memory_backoff()
                self.memory_events.append({"step": step.step_id, "preempted": len(back),
                                           "step_tokens": budgets[0], "max_running": budgets[1],
                                           "error": str(cause)[:300]})
                return False
            tr.recover(cause)
            ranks, results = tr.submit(lambda rs, sid, gen: _requests(step.plan, rs, sid, gen))
            recovered = True
        t1 = time.perf_counter()
        if ranks != step.ranks:  # a rank died: the step ran on the survivors; the dead rank's sequences go
            with self._lock:  # back to the queue and are re-prefilled on a survivor
                self.scheduler.set_ranks(ranks)
        plan = step.plan
        tokens = sum(it.num_tokens for items in plan.items.values() for it in items) * plan.steps
        # the step's wall time: from its launch, or from the previous step's results when it was launched
        # behind that one (its queueing there is the previous step's time)
        tr.account(results, ranks, Phase.DECODE if not plan.has_prefill else Phase.PREFILL, tokens,
                    (t1 - max(step.t0, self._last_done)) * 1e3)
        self._last_done = t1
        t2 = time.perf_counter()
        sampled = {k: v for res in results.values() for k, v in res.output.tokens.items()}
        logprobs = {k: v for res in results.values() for k, v in res.output.logprobs.items()}
        with self._lock:
            if any(res.output.expert_counts for res in results.values()):
                self._tally(plan, results)
            events = self.scheduler.commit(plan, sampled, logprobs)
            self.scheduler.step_succeeded()
            self.steps += 1
            for res in results.values():
                self.prefix_hit_tokens += sum(res.output.cached_tokens.values())
                self.prefix_lookup_tokens += res.output.prefix_lookup_tokens
            for ev in events:
                h = self._handles.get(ev.request_id)
                if h is None:
                    continue
                h.emit(ev.token, ev.logprobs)
                if ev.finished:
                    del self._handles[ev.request_id]
                    h.emit(_DONE)
        t3 = time.perf_counter()
        busiest = max(results.values(), key=lambda r: r.host_s, default=None)  # the rank with the most host time
        for key, ms in (("wait", t1 - t0), ("account", t2 - t1), ("commit", t3 - t2),
                        ("shard", max((r.elapsed_s for r in results.values()), default=0.0)),
                        ("queued", max((r.queued_s for r in results.values()), default=0.0)),
                        ("device", max((r.device_s for r in results.values()), default=0.0)),
                        ("idle", max((r.idle_s for r in results.values()), default=0.0)),
                        ("host", busiest.host_s if busiest else 0.0), ("replay", busiest.replay_s if busiest else 0.0),
                        ("host_cpu", busiest.host_cpu_s if busiest else 0.0),
                        ("transport", None if recovered else
                         t1 - step.sent - max((r.actor_s for r in results.values()), default=0.0))):
            if ms is not None:  # (a recovered step's round trip includes its failure and re-run)
                self.timings[key].append(ms * 1e3)
        items = [it for its in plan.items.values() for it in its]
        self.step_shapes.append((sum(it.num_tokens for it in items if not it.decode),
                                 sum(1 for it in items if it.decode), plan.steps))
        return not recovered

    def _tally(self, plan: StepPlan, results: dict[int, StepResult]) -> None:
        """The step's expert counts into the handles that asked (under the lock; finished requests' dropped)."""
        items = {it.seq_id: it for its in plan.items.values() for it in its if it.expert_stats}
        for res in results.values():
            for sid, counts in res.output.expert_counts.items():
                h, it = self._handles.get(sid), items.get(sid)
                if h is not None and h.tally is not None and it is not None:
                    h.tally.add(counts, res.generation, prompt=it.start < h.prompt_len)

    def prefix_stats(self) -> dict[str, float | int | None]:
        """Prefix caching so far: prompt tokens served from cached KV blocks (``hit_tokens``) over the prefill
        tokens of every committed step (``lookup_tokens``), their ratio (None before any prefill), and the
        requests routed to a rank for their prefix rather than the least-loaded one."""
        hit, looked = self.prefix_hit_tokens, self.prefix_lookup_tokens
        return {"enabled": self.prefix_caching, "hit_tokens": hit, "lookup_tokens": looked,
                "hit_ratio": hit / looked if looked else None, "routed": self.scheduler.prefix_routed}

    def gc_counters(self) -> dict[str, int]:
        """This (driver) process's garbage-collector pauses since the loop started (``GcPauses``)."""
        return self.gc.counters()

    def timing_summary(self, last: int | None = None) -> dict[str, float]:
        """Median milliseconds per step of each part (the last ``last`` steps)."""
        out = {}
        for k, xs in self.timings.items():
            v = sorted(list(xs)[-last:] if last else xs)
            if v:
                out[k] = v[len(v) // 2]
        return out


def _requests(plan: StepPlan, ranks: list[int], step_id: str, generation: int,
              after: str | None = None) -> dict[int, StepRequest]:
    """Every rank's share of ``plan`` (a rank without work joins with an empty batch)."""
    units = (plan.has_prefill or not plan.has_decode, plan.has_decode)
    return {r: StepRequest(step_id, generation, StepKind.GENERATION,
                           GenerationInput(plan.items.get(r, ()), plan.free.get(r, ()), units, plan.steps), after)
            for r in ranks}


@dataclass(frozen=True, eq=False)
class _Launched:
    """A step sent to the ranks and not collected yet."""

    plan: StepPlan
    ranks: list[int]
    step_id: str
    reqs: dict[int, StepRequest]
    refs: dict[int, Any]
    t0: float
    sent: float = 0.0


class OverloadedError(RayMoEError):
    """Too many requests in flight: retry later (HTTP 503)."""


__all__ = ["GenerationLoop", "LoopSignals", "RequestHandle", "ExpertTally", "OverloadedError"]
