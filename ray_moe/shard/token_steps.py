# ======================================================================================================
#  ONE GENERATION STEP ON ONE SHARD (pure: no Ray)
#
#   StepRequest, kind GENERATION (token ids + positions only; a deferred decode item names the position whose
#   token this rank sampled)
#     1. batch (shard/step_batch.py): free, resolve deferred tokens (host, or on the device while the step that
#        sampled them still runs), cut prefill chunks past cached blocks, reserve KV          ──> StepBatch
#     2. the decode unit's path, agreed once per step (the bucket: a decode size of the lattice, or a fallback)
#     3. run (shard/graph_runner.py): DECODE_GRAPH | PIECEWISE | EAGER                         ──> RunChoice
#     4. layout (model/kv.py): the step's rows (padded to the size) and its exact attention plan
#     5. the model's forward over the rows (data-parallel attention, paged KV cache); every MoE block:
#        transformers' experts seam ──> MoEStep (moe/layer.py) ──> dispatch ──> experts ──> combine;
#        a rank with no tokens joins every MoE layer with empty batches
#     6. sample on the device; the tokens' and statistics' host copies queued behind the step
#   ──> PendingStep (shard/pending.py): a graph step of a group of one completes behind the next step's launch
#       (between its pieces when that one is piecewise: shard/core.py, StepCompletions);
#       others complete on return (an expert-parallel group agrees the bucket's overflow: rerun on the normal path)
#   multi-step decode: sub-steps launched back to back, each fed the last one's samples on the device (substeps.py)
# ======================================================================================================
"""The shard side of serving: one model step per actor call, token ids in, sampled token ids out."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from ray_moe.core.errors import StepMemoryError
from ray_moe.core.types import AttentionBackend, DispatchMode
from ray_moe.model.attention import InlineAttention
from ray_moe.model.host import ModelHost
from ray_moe.model.kv import KVBudgetError
from ray_moe.model.sampling import logprobs_tensor, sample_tensor
from ray_moe.moe.decode.admission import FallbackReason
from ray_moe.moe.dispatch.bucket import token_buckets
from ray_moe.moe.dispatch.protocol import ControlStatus
from ray_moe.moe.experts.runners.fp8_configs import table_file
from ray_moe.moe.layer import PlacementView, MoEStep, RouteRecorder, SplitMoE, expert_counts
from ray_moe.shard.graph_runner import RunKind, StepGraphRunner
from ray_moe.shard.lattice import StepLattice
from ray_moe.shard.pending import GraphPending, MultiPending, PendingStep
from ray_moe.shard.pipeline import StepPipeline
from ray_moe.shard.records import StepRequest, WorkItem
from ray_moe.shard.step_batch import DeferredTokenError, StepBatch, StepBatcher
from ray_moe.shard.step_rows import fill_rows, marked_rows, packed_ids, phase_rows
from ray_moe.shard.substeps import SubstepRun, runs_on_arrays

# a cache sized from memory (``kv_tokens=None``): the GPU's share, and what is kept for activations and graphs
DEFAULT_MEMORY_FRACTION = 0.9
WORKSPACE_MIN_BYTES = 2 << 30
WORKSPACE_SHARE = 0.05
CPU_KV_TOKENS = 8192  # kv_tokens=None on a CPU: no device memory to size from
REFIT_MIN_BYTES = 2 << 30  # what a refit keeps at least beyond the workspace (a capture out of memory at start)


class TokenStepExecutor:
    """Runs generation steps for one shard over its ModelHost: the batch stage (``batcher``), the captured
    step shapes (``graph_runner``), the forward, sampling and the pending step."""

    def __init__(self, rank: int, host: ModelHost, *, hidden_size: int, top_k: int, dtype: torch.dtype,
                 pipeline: StepPipeline | None = None, prefix_caching: bool = True) -> None:
        self.rank = rank
        self.host = host
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.dtype = dtype
        self.counters: dict[str, int] = {}
        # the shard's step pipeline (decode round, captured graphs, overflow agreement), shared with the
        # expert-only front; the generation steps' captured sizes and how each step runs
        self.pipeline = pipeline or StepPipeline()
        self.graph_runner = StepGraphRunner(host, self.pipeline)
        self.batcher = StepBatcher(lambda: self.host.kv, prefix_caching, self.count)
        # a cache sized from memory: (memory_fraction, workspace bytes) it was sized with (None: a given size)
        self.kv_sizing: tuple[float, int] | None = None
        # device timing (CUDA): the launching step's start event, the last completed step's end event
        self._start: torch.cuda.Event | None = None
        self._last_end: torch.cuda.Event | None = None
        # the pipeline's replay clock and the launching thread's CPU clock when the launching step began
        self.replay_mark = self.cpu_mark = 0.0  # (``PendingStep.replay_s``, ``launch_cpu_s``)

    @classmethod
    def load(cls, rank: int, *, checkpoint: str | None, random_model: dict | None, num_layers: int, hidden_size: int,
             top_k: int, seed: int, device: torch.device, dtype: torch.dtype, kv_tokens: int | None,
             block_size: int, fused_kernels: bool = True, attention: AttentionBackend = AttentionBackend.AUTO,
             memory_fraction: float = DEFAULT_MEMORY_FRACTION, pipeline: StepPipeline | None = None,
             prefix_caching: bool = True) -> "TokenStepExecutor":
        """A shard's model: the non-expert modules (transformers classes) from ``checkpoint``, or seeded random
        ones of the transformers config dict ``random_model`` (benchmarks). Routed experts stay the shard's
        slots. ``num_layers`` must equal the model's MoE layer count. ``fused_kernels``: the model's RMSNorm layers
        and rotary embedding take fused kernels where they reproduce transformers' own (CUDA; ``models.norms``,
        ``models.rotary``). ``attention``: the attention backend (``model/attention.py``; AUTO: FlashAttention
        varlen where its check passes on this device and dtype). ``kv_tokens`` None: on CUDA the cache takes
        what ``memory_fraction`` of the GPU leaves after the weights (``ModelHost.size_kv``), else
        ``CPU_KV_TOKENS``. ``prefix_caching``: full KV blocks of identical prompt prefixes shared (``shard/prefix.py``)."""
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching={prefix_caching!r}: must be a bool")
        sized = kv_tokens is None
        if sized and not 0.0 < float(memory_fraction) <= 1.0:
            raise ValueError(f"memory_fraction={memory_fraction}: must be in (0, 1]")
        if sized:
            kv_tokens = block_size if device.type == "cuda" else CPU_KV_TOKENS
        if random_model is not None:
            from transformers import AutoConfig

            conf = dict(random_model)
            host = ModelHost.random(AutoConfig.for_model(conf.pop("model_type"), **conf), seed=seed, device=device,
                                    dtype=dtype, kv_tokens=kv_tokens, block_size=block_size, attention=attention)
        else:
            host = ModelHost.from_checkpoint(checkpoint, device=device, dtype=dtype, kv_tokens=kv_tokens,
                                             block_size=block_size, attention=attention)
        if host.moe_layers != num_layers:
            raise ValueError(f"num_layers={num_layers} but the model has {host.moe_layers} MoE layers")
        if fused_kernels:
            host.fuse_kernels()
        workspace = None
        if sized and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            workspace = max(WORKSPACE_MIN_BYTES, int(WORKSPACE_SHARE * total)) + host.expansion_bytes()
            host.size_kv(float(memory_fraction), workspace)
        executor = cls(rank, host, hidden_size=hidden_size, top_k=top_k, dtype=dtype, pipeline=pipeline,
                       prefix_caching=prefix_caching)
        if workspace is not None:
            executor.kv_sizing = (float(memory_fraction), workspace)
        for key, n in (("fused_norm_layers", host.norms.modules), ("fused_rotary_modules", len(host.rotary.modules)),
                       ("fused_router_layers", host.routers.modules), ("fused_qkv_modules", host.qkv.modules),
                       ("fp8_dense_modules", host.fp8_dense["modules"]), ("absorbed_mla_modules", host.mla.modules)):
            if n:
                executor.count(key, n)
        return executor

    def fused_kernels(self) -> dict[str, Any]:
        """Which of the model's layers take the fused kernels: norm layers (count), modeling modules whose
        rotary embedding does, routers (count), attention modules with one Q/K/V GEMM (count), and what kept
        transformers' own forward and why (class or module -> reason); an FP8 checkpoint's dense projections
        kept in FP8 (module paths), why a shape [out x in] was dequantized instead, how many attention modules run
        one FP8 Q/K/V GEMM, and the tuned table driving the FP8 launches here (its file; None: the heuristics); MLA
        modules attending on their latent (``model/mla.py``) and which decode attention serves them."""
        host = self.host
        reasons = host.fp8_dense.get("reasons", {})
        return {"norm_layers": host.norms.modules, "rotary_modules": list(host.rotary.modules),
                "router_layers": host.routers.modules, "qkv_modules": host.qkv.modules,
                "skipped": {**host.norms.skipped, **host.rotary.skipped, **host.routers.skipped},
                "fp8_dense_modules": list(host.fp8_dense.get("paths", ())),
                "fp8_dense_dequantized": {f"{o}x{i}": why for (o, i), why in reasons.items() if why},
                "fp8_qkv_modules": host.qkv.fp8_modules, "fp8_launch_table": table_file(host.device),
                "mla": {"absorbed_modules": host.mla.modules, "decode_kernel": host.mla.kernel,
                        "decode_reason": host.mla.reason, "dequantized_bytes": host.mla.dequantized_bytes}}

    def info(self) -> dict[str, Any]:
        """What the driver's scheduler needs: KV blocks, vocabulary, context limit, end-of-sequence ids; and
        how each step kind runs here (``steps``)."""
        host = self.host
        return {"rank": self.rank, "kv_blocks": host.kv.num_blocks, "block_size": host.kv.block_size,
                "kv_bytes_per_token": host.kv_bytes_per_token(),
                "vocab_size": host.vocab_size,
                "max_context": int(getattr(host.config, "max_position_embeddings", 1 << 20)),
                "eos_token_ids": host.eos_token_ids(), "fused_norm_layers": host.norms.modules,
                "fused_rotary_modules": len(host.rotary.modules), "attention": host.attention.value,
                "attention_reason": host.attention_reason, "paged_decode": host.paged_decode,
                "paged_decode_reason": host.decode_reason, "prefix_caching": self.batcher.prefixes.enabled,
                "steps": self.graph_runner.status()}

    # ------------------------------------------------------------------ the step shapes
    def configure(self, lattice: StepLattice, paths: Any) -> None:
        """The deployment's step lattice over this rank's data paths (``StepGraphRunner.configure``)."""
        bucket = paths.bucket
        why = ("CUDA graphs are off: " + ("the device is a CPU" if self.host.device.type != "cuda" else
                                          "cuda_graphs=False, or the exchange records into no graph")
               if not paths.capture else "no decode bucket (decode_buckets=False)")
        self.graph_runner.configure(lattice, capture=paths.capture and bucket is not None,
                                    one_rank=paths.exchange.size == 1,
                                    local=bucket is not None and bucket.mode is DispatchMode.LOCAL, why_not=why,
                                    decode_cap=bucket.max_token_cap if bucket is not None else 1,
                                    experts=paths.runner.kernels())

    def capture(self, view: PlacementView, paths: Any, *, at_start: bool) -> dict[str, Any]:
        """Capture the lattice of ``view``'s generation (every rank of the group at once: a decode warm-up of
        an expert-parallel group exchanges); returns what it took. At start, a capture that ran out of memory
        over a cache sized from memory refits the cache (``refit_kv``) and captures the lattice once more."""
        make = self._context_factory(view, paths)
        rep = self.graph_runner.capture(view.generation, paths, make, at_start=at_start)
        refit = self.refit_kv(rep, view.generation, paths) if at_start else None
        if refit is not None:
            rep = self.graph_runner.capture(view.generation, paths, make, at_start=at_start)
            rep.kv_refit = refit
        return vars(rep)

    def refit_kv(self, rep: Any, generation: int, paths: Any) -> dict[str, Any] | None:
        """After a start capture some of whose kinds ran out of device memory: the cache (sized from memory,
        still empty) made smaller by twice what the graphs held when it failed (at least ``REFIT_MIN_BYTES``),
        the generation's graphs released, so that the lattice can be captured again (the caller does). A
        group of one only (an expert-parallel group's ranks capture together: one rank alone cannot start
        over). Returns what changed, or None where nothing did.
          1. the graphs released and forgotten
          2. the cache re-made (``ModelHost.size_kv``: the old cache and the allocator's cached blocks freed, then
             the device's free memory read) with the larger workspace"""
        host = self.host
        oom = [k for k, e in rep.errors.items() if "OutOfMemoryError" in e]
        if not oom or self.kv_sizing is None or paths.exchange.size != 1 or host.kv.sequences():
            return None
        fraction, workspace = self.kv_sizing
        before = host.kv.capacity_tokens
        grow = max(2 * int(rep.reserved_bytes), REFIT_MIN_BYTES)
        self.pipeline.graphs.release(generation)  # 1.
        self.graph_runner.drop(generation)
        host.size_kv(fraction, workspace + grow)  # 2. (it returns the allocator's cached blocks before measuring)
        self.kv_sizing = (fraction, workspace + grow)
        self.count("kv_refits")
        return {"errors": {k: rep.errors[k] for k in oom}, "from_tokens": before,
                "to_tokens": host.kv.capacity_tokens, "workspace_bytes": workspace + grow}

    def _context_factory(self, view: PlacementView, paths: Any):
        def make(row_valid: torch.Tensor, dispatcher: Any, tag: str) -> MoEStep:
            label = "local-graph" if dispatcher.mode is DispatchMode.LOCAL and row_valid.numel() else "bucket-graph"
            return MoEStep(rank=self.rank, view=view, dispatcher=dispatcher, runner=paths.runner, dtype=self.dtype,
                           hidden_size=self.hidden_size, tag=tag, row_valid=row_valid, path=label)
        return make

    @property
    def graphs(self):
        """The captured steps (the shard pipeline's store)."""
        return self.pipeline.graphs

    # ------------------------------------------------------------------ launch
    def launch(self, req: StepRequest, view: PlacementView, paths: Any, status: ControlStatus,
               decode_key: int) -> "PendingStep | MultiPending":
        """Run a step up to its sampled tokens. A graph step of a group of one returns with its graph (and
        sampling) still running on the device: the next step can be launched before this one is completed
        (its deferred tokens are read on the device). Every other step is complete on return.
        A multi-step decode request (``steps`` > 1) launches its sub-steps back to back: sub-step j's items
        are deferred on sub-step j - 1's samples (on the device while those are still running)."""
        try:
            return self._launch(req, view, paths, status, decode_key)
        except torch.OutOfMemoryError as exc:
            raise self._out_of_memory(req, exc) from None

    def _out_of_memory(self, req: StepRequest, exc: BaseException) -> StepMemoryError:
        """The step's device memory error, contained: the allocator's cached blocks go back to the device
        (captured graphs keep their pools), the event is counted, and the step fails alone."""
        self.count("oom_steps")
        held = 0.0
        if self.host.device.type == "cuda":
            torch.cuda.empty_cache()
            held = torch.cuda.memory_allocated(self.host.device) / 2**30
        tokens = sum(len(it.tokens) or 1 for it in req.input.items) * req.input.steps
        return StepMemoryError(f"rank {self.rank}: step {req.step_id!r} ({tokens} tokens) ran out of device memory "
                               f"({held:.1f} GiB still allocated): {str(exc).splitlines()[0][:200]}",
                               rank=self.rank, step_id=req.step_id)

    def _launch(self, req: StepRequest, view: PlacementView, paths: Any, status: ControlStatus,
                decode_key: int) -> "PendingStep | MultiPending":
        work = req.input
        if work.steps == 1:
            return self._launch_one(req, view, paths, status, decode_key)
        if work.units != (False, True) or any(not it.decode or it.sample is None for it in work.items):
            raise ValueError(f"steps={work.steps}: a multi-step request carries sampled decode items only")
        self.count("multi_step_requests")
        self.count("multi_step_substeps", work.steps - 1)  # (after the first; ``array_substeps``: on arrays)
        # a group of one plans every sub-step at its first and launches the later ones on arrays (``substeps``)
        ahead = work.steps if paths.exchange.size == 1 and runs_on_arrays(work.items) else 1
        parts: list[PendingStep] = []
        try:
            parts.append(self._launch_one(req.revised(steps=1), view, paths, status, decode_key, None, ahead))
            run = parts[0].graph.substeps if parts[0].graph is not None else None
            for j in range(1, work.steps):
                if run is not None:
                    parts.append(run.substep(self, req, j, parts, last=j == work.steps - 1))
                    continue
                sub = req.revised(step_id=f"{req.step_id}/{j}", free=(), steps=1,
                                  items=tuple([it.substep(j) for it in work.items]))
                parts.append(self._launch_one(sub, view, paths, status, decode_key, parts[0].decision))
        except BaseException:
            for p in parts:
                p.abandon()
            raise
        return MultiPending(req, parts)

    def begin_step(self) -> float:
        """A (sub-)step's launch begins: replay clock marked, CUDA start event queued; returns the host clock."""
        self.replay_mark, self.cpu_mark = self.pipeline.replay_s, time.thread_time()
        self._start = None
        if self.host.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        return time.perf_counter()

    def take_start(self) -> "torch.cuda.Event | None":
        """The launching step's start event, handed to its ``PendingStep`` (the next step records its own)."""
        start, self._start = self._start, None
        return start

    def _launch_one(self, req: StepRequest, view: PlacementView, paths: Any, status: ControlStatus,
                    decode_key: int, agreed: Any = None, ahead: int = 1) -> "PendingStep":
        """One step (or sub-step). ``agreed``: the decode decision of the request's first sub-step (the
        generation, the path and the token bucket hold for every sub-step: no control round of its own).
        ``ahead`` > 1: the first sub-step of a multi-step request whose later sub-steps run on arrays: its
        decode items reserve ``ahead - 1`` more positions and a decode graph step plans them all."""
        t0 = self.begin_step()
        # 1. the batch
        req, batch = self.batcher.build(req, ahead)
        if batch.error is not None:
            status = ControlStatus.BAD_INPUT if status == ControlStatus.OK else status
        if (paths.capture and status == ControlStatus.OK and self.graph_runner.lattice is not None
                and not self.graph_runner.captured(view.generation)):  # a generation published after start
            self.capture(view, paths, at_start=False)
        want_prefill, want_decode = req.input.units
        # 2. the decode unit's path, agreed once per step
        reason, bucket, decision = None, False, None
        if want_decode:
            if paths.bucket is None:
                reason = "bucket_disabled"
            else:
                if agreed is not None:  # a later sub-step of a multi-step request: agreed at its first one
                    if batch.error is not None:
                        raise batch.error
                    decision = agreed
                else:
                    ready = self.graphs.ready_mask(view.generation, ("decode",), token_buckets(paths.bucket.max_token_cap))
                    decision = self.pipeline.agree_decode(paths.exchange, view, status, batch.decode_rows, decode_key,
                                                          paths.bucket.token_cap, req.step_id, ready=ready,
                                                          local_error=batch.error)
                status = ControlStatus.OK  # the decode round carried it (a refusal raised there)
                reason = None if decision.reason is None else decision.reason.value
                bucket = decision.reason is None
                if bucket:
                    paths = dataclasses.replace(paths, bucket=paths.bucket.for_tokens(decision.cap))
        out = self._run(req, batch, view, paths, status, want_prefill, want_decode, bucket, reason, decision, ahead)
        if batch.error is not None:
            raise batch.error
        self.batcher.commit(batch)
        items = batch.items
        path = ("bucket" if bucket else "variable") if want_decode else None
        if isinstance(out, GraphPending):
            if paths.exchange.size == 1:  # no overflow to agree on: complete it later
                if out.substeps is None:  # (else the last sub-step's samples are the ones read on)
                    self.batcher.keep_picks(req.step_id, out.picked, out.want)
                return PendingStep(self, req, view.generation, items, t0, path, reason, graph=out, decision=decision,
                                   prefix=batch.prefix)
            out = out.finish()
        tokens, stats, overflow, lps, counts = out
        if bucket and self.pipeline.overflowed(paths.exchange, overflow, req.step_id):
            reason, bucket = FallbackReason.EXPERT_ROUTE_CAPACITY_EXCEEDED.value, False
            rerun = dataclasses.replace(batch, fills=[])  # (an expert-parallel step's tokens are on the host)
            out = self._run(req, rerun, view, paths, ControlStatus.OK, want_prefill, want_decode, False, reason, None,
                            tag="/rerun")
            tokens, stats, _, lps, counts = out.finish() if isinstance(out, GraphPending) else out
            path = "variable"
        self.finished(items, tokens)
        return PendingStep(self, req, view.generation, items, t0, path, reason, result=(tokens, stats, lps, counts),
                           decision=decision, prefix=batch.prefix)

    def finished(self, items: tuple[WorkItem, ...], tokens: dict[str, int], shift: int = 0, *,
                 remember: bool = True) -> None:
        """A step's tokens are known on the host: count it and keep its samples for deferred items (``shift``:
        a multi-step request's sub-step on its first sub-step's items, positions that many on)."""
        self.count("generate_steps")
        if remember:
            self.batcher.remember(items, tokens, shift)

    # ------------------------------------------------------------------ run
    def _run(self, req, batch: StepBatch, view, paths, status, want_prefill, want_decode, bucket, reason, decision,
             ahead: int = 1, tag: str = ""):
        """3-6 (banner): the step as a graph (``GraphPending``) or eagerly ((tokens, stats, overflow, logprobs,
        expert counts: {sequence id: [layers, experts] int32} of the marked items, None when none is))."""
        items = batch.items
        if items:
            decode_only = bucket and not want_prefill
            slots = sum(it.start + ahead for it in items) + (paths.bucket.token_cap if bucket else 0)
            choice = self.graph_runner.choose(
                view.generation, decode_only=decode_only, bucket_rows=paths.bucket.token_cap if bucket else None,
                rows=batch.rows, sequences=len(items), eager_status=status != ControlStatus.OK or not paths.capture
                or (decision is not None and paths.exchange.size > 1 and not decision.replay), slot_keys=slots,
                context_keys=sum(it.start + it.num_tokens for it in items))
            if choice.kind is RunKind.DECODE_GRAPH:
                return self._decode_graph(req, batch, view, choice.rows, ahead)
            if choice.kind is RunKind.TOKEN_GRAPH:
                return self._token_graph(batch, view, choice.rows)
            if choice.kind is RunKind.PIECEWISE:
                return self._piecewise(req, batch, view, choice.rows)
        return self._eager(req, batch, view, paths, status, want_prefill, want_decode, bucket, reason, tag)

    def _decode_graph(self, req, batch: StepBatch, view, rows: int, ahead: int) -> GraphPending:
        """A decode size's whole-step graph; with ``ahead`` > 1 the plan covers every sub-step (``SubstepRun``)."""
        plans = self.host.kv.plan_decode_graph(batch.items, rows, ahead, packed_ids(batch.items))
        fill_rows(plans[0]["token_ids"], batch.items, batch.fills)
        launch = self._sampler(batch.items, view, lambda inp: self.graph_runner.decode(view.generation, rows, inp))
        specs = [it.sample for it in sampled_items(batch.items)]
        out = launch(plans[0], specs)
        if len(plans) > 1:
            out.substeps = SubstepRun(plans, launch, out.want, specs)
        return out

    def _token_graph(self, batch: StepBatch, view, rows: int) -> GraphPending:
        """A token size's whole-step graph: the step's rows, contexts and work tables into its static inputs."""
        runner = self.graph_runner
        staged = self.host.kv.plan_token_graph(batch.items, packed_ids(batch.items), rows,
                                               runner.lattice.sampled_rows(rows), runner.tables(rows))
        fill_rows(staged["token_ids"], batch.items, batch.fills)
        launch = self._sampler(batch.items, view, lambda inp: runner.tokens(view.generation, rows, inp))
        return launch(staged, [it.sample for it in sampled_items(batch.items)])

    def _piecewise(self, req, batch: StepBatch, view, rows: int) -> GraphPending:
        """A token size's piecewise graph, its holes attending with the step's exact plan."""
        step_rows, plan = self.host.plan(batch.items, packed_ids(batch.items), rows=rows,
                                         last_rows=self.graph_runner.lattice.sampled_rows(rows))
        staged = step_rows.tensors()
        fill_rows(staged["token_ids"], batch.items, batch.fills)
        launch = self._sampler(batch.items, view,
                               lambda inp: self.graph_runner.piecewise(view.generation, rows, inp, plan))
        return launch(staged, [it.sample for it in sampled_items(batch.items)])

    def _sampler(self, items: tuple[WorkItem, ...], view: PlacementView, run):
        """``launch(inputs, specs, greedy=False) -> GraphPending``: ``run(inputs)`` (a replay: ((logits, device
        summary, routes), MoEStep)), then sampling on the device and the outputs' host copies queued right behind
        (the marked items' expert counts, reduced from the routes on the device, too)."""
        want_rows = [i for i, it in enumerate(items) if it.sample is not None]
        want = tuple(items[i] for i in want_rows)
        contexts = self.batcher.contexts(list(want))
        dev = self.host.device
        marked, segments = marked_rows(items)

        def launch(inputs: dict[str, torch.Tensor], specs: list, greedy: bool = False) -> GraphPending:
            (logits, summary, routes), ctx = run(inputs)
            host_summary = counts = None
            if summary is not None:  # queued behind the step: read with the sampled tokens, one wait for both
                host_summary = torch.empty(summary.shape, dtype=summary.dtype, pin_memory=dev.type == "cuda")
                host_summary.copy_(summary, non_blocking=True)
            if marked:  # reduced on the device behind the step; read with the sampled tokens
                self.count("expert_stats_steps")
                dev_counts = expert_counts(routes, segments, view.snapshots[0].num_experts)
                counts = (marked, torch.empty(dev_counts.shape, dtype=dev_counts.dtype, pin_memory=dev.type == "cuda"))
                counts[1].copy_(dev_counts, non_blocking=True)
            picked = lps = None
            if want:
                scores = logits[: len(want_rows)] if want_rows[-1] == len(want_rows) - 1 else logits.index_select(
                    0, torch.tensor(want_rows, dtype=torch.int64).to(logits.device))
                picked = torch.argmax(scores, dim=-1) if greedy else sample_tensor(scores, specs, contexts)  # (plain)
                lps = None if greedy else logprobs_tensor(scores, picked, specs)
            host_picked = done = None
            if dev.type == "cuda":  # copied right behind the step: completing it never waits for later steps
                if picked is not None:
                    host_picked = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
                    host_picked.copy_(picked, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            return GraphPending(ctx, want, picked, host_summary, dev, host_picked, done, lps, counts)
        return launch

    def _eager(self, req, batch: StepBatch, view, paths, status, want_prefill, want_decode, bucket, reason, tag):
        """Every kernel launched from Python: the phase split (prefill rows on the normal path, decode rows on the
        decode unit's), the routes recorded for marked items; complete on return."""
        def ctx(unit, dispatcher, st, r=None):
            return MoEStep(rank=self.rank, view=view, dispatcher=dispatcher, runner=paths.runner, dtype=self.dtype,
                           hidden_size=self.hidden_size, tag=f"{req.step_id}{tag}/{unit}", status=st, fallback_reason=r)

        # the first unit to run carries this rank's status into its first control round
        pre = ctx("prefill", paths.normal, status) if want_prefill else None
        dec = None
        if want_decode:
            dec = ctx("decode", paths.bucket if bucket else paths.normal, status if pre is None else ControlStatus.OK,
                      reason)
        items, host = batch.items, self.host
        split = SplitMoE(pre, dec, *phase_rows(items, host.device))
        tokens: dict[str, int] = {}
        lps: dict[str, Any] = {}
        counts = None
        if items:
            marked, segments = marked_rows(items)
            rec = RouteRecorder(split, len(view.snapshots)) if marked else None
            rows, plan = host.plan(items, packed_ids(items))
            fill_rows(rows.token_ids, items, batch.fills)
            logits = host.forward_rows(rows, InlineAttention(plan, host.kernels, host.cache_gathers),
                                       split if rec is None else rec, gather=plan.gather if host.cache_gathers else None)
            want = [(i, it) for i, it in enumerate(items) if it.sample is not None]
            if want:
                idx = torch.tensor([i for i, _ in want], dtype=torch.int64, device=logits.device)
                scores, specs = logits.index_select(0, idx), [it.sample for _, it in want]
                picked = sample_tensor(scores, specs, self.batcher.contexts([it for _, it in want]))
                pending = logprobs_tensor(scores, picked, specs)
                tokens = {it.seq_id: int(tok) for (_, it), tok in zip(want, picked.tolist())}
                if pending is not None:
                    lps = {want[i][1].seq_id: lp for i, lp in pending.read().items()}
            if rec is not None:
                self.count("expert_stats_steps")
                counts = dict(zip(marked, expert_counts(rec.ids, segments, view.snapshots[0].num_experts).cpu().numpy()))
        else:
            host.idle(split, self.hidden_size, self.top_k)
        stats, overflow = [], False
        for unit in (pre, dec):
            if unit is not None:
                s, o = unit.finish()
                stats.extend(s)
                overflow = overflow or o
        return tokens, tuple(stats), overflow, lps, counts

    # ------------------------------------------------------------------ completion
    def device_span(self, start: "torch.cuda.Event | None", end: "torch.cuda.Event | None") -> tuple[float, float]:
        """(busy, idle) seconds of a completed step: its device time, and the device's idle gap since the step
        completed before it (steps complete in launch order on a rank). (0, 0) on CPU."""
        if start is None or end is None:
            return 0.0, 0.0
        end.synchronize()
        busy = start.elapsed_time(end) / 1e3
        idle = 0.0 if self._last_end is None else max(0.0, self._last_end.elapsed_time(start) / 1e3)
        self._last_end = end
        self.count("device_busy_us", int(busy * 1e6))
        return busy, idle

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def status(self) -> dict[str, Any]:
        """The step shapes (lattice, paths, captures), the graph runner's counts, and the cache's blocks (fewer
        than at load after a refit)."""
        return {**self.graph_runner.status(), "counters": dict(self.graph_runner.counters),
                "kv_blocks": self.host.kv.num_blocks}


def sampled_items(items: tuple[WorkItem, ...]) -> tuple[WorkItem, ...]:
    """The items a step samples, in row order."""
    return tuple(it for it in items if it.sample is not None)


__all__ = ["TokenStepExecutor", "DeferredTokenError", "KVBudgetError"]
