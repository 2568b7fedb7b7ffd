# ======================================================================================================
#  ONE GENERATION STEP ON ONE SHARD (pure: no Ray)
#
#   StepRequest, kind GENERATION (token ids + positions only; a deferred decode item names the position whose
#   token this rank sampled) ──> free finished sequences, resolve deferred tokens (host, or on the device
#   while the step that sampled them is still running), reserve KV for the new tokens
#     ──> [decode unit on the bucket path? one agreed admission round]
#     ──> the model's forward over the rank's tokens (data-parallel attention, paged KV cache);
#         every MoE block: prefill rows -> normal dispatcher, decode rows -> decode dispatcher (spec 0x05E),
#         expert-parallel across ranks; a rank with no tokens joins every MoE layer with empty batches.
#         Static shapes (decode buckets; every step of a group of one) replay one captured CUDA graph.
#     ──> overflow agreed at the end (rerun with the decode unit on the normal path) ──> sample on the device
#   launch ends here for a captured step of a group of one (completed behind the next step's launch);
#   complete: tokens and statistics read with one wait ──> StepResult (one token id per sampled chunk)
#   multi-step decode: sub-steps launched back to back, each fed the last one's samples on the device (substeps.py)
# ======================================================================================================
"""The shard side of serving: one model step per actor call, token ids in, sampled token ids out."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from ray_moe.core.types import AttentionBackend, DispatchMode
from ray_moe.moe.dispatch.protocol import ControlStatus
from ray_moe.moe.experts.runners.grouped import device_tensor
from ray_moe.core.errors import RayMoEError, StepMemoryError
from ray_moe.moe.decode.admission import FallbackReason
from ray_moe.moe.layer import GenerationView, MoEStep, RouteRecorder, SplitMoE, expert_counts
from ray_moe.model.kv import KVBudgetError, SeqChunk, StepLayout, leading_single_rows
from ray_moe.model.host import ModelHost
from ray_moe.model.sampling import logprobs_tensor, sample_tensor
from ray_moe.shard.pending import MultiPending, PendingStep, _GraphPending
from ray_moe.shard.pipeline import StepPipeline
from ray_moe.shard.prefix import ShardPrefixes
from ray_moe.shard.records import StepRequest, WorkItem
from ray_moe.shard.substeps import SubstepRun, runs_on_arrays
from ray_moe.shard.step_rows import (MIXED_DECODE_FLOOR, MIXED_SLOTS_FLOOR, QUERY_BOUND_AT, QUERY_BOUND_FLOOR,
                                     SAMPLED_ROWS_FLOOR,
                                     DecodeLayout, shape_bucket, marked_rows, packed_ids, phase_rows, pow2, pow4,
                                     prefill_query_bound, read_fills, single_rows_first)


# a cache sized from memory (``kv_tokens=None``): the GPU's share, and what is kept for activations and graphs
DEFAULT_MEMORY_FRACTION = 0.9
WORKSPACE_MIN_BYTES = 2 << 30
WORKSPACE_SHARE = 0.05
CPU_KV_TOKENS = 8192  # kv_tokens=None on a CPU: no device memory to size from


class DeferredTokenError(RayMoEError, ValueError):
    """A deferred decode item names a position this rank never sampled (the step is refused on every rank)."""


class GenerationExecutor:
    """Runs generation steps for one shard over its ModelHost (``step_ctx`` builds MoEStep contexts)."""

    def __init__(self, rank: int, host: ModelHost, *, hidden_size: int, top_k: int, dtype: torch.dtype,
                 pipeline: StepPipeline | None = None, prefix_caching: bool = True) -> None:
        self.rank = rank
        self.host = host
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.dtype = dtype
        self.counters: dict[str, int] = {}
        # the shard's step pipeline (decode round, captured graphs by (generation, (unit, rows, keys, sampled
        # rows, layout)), overflow agreement), shared with the expert-only front
        self.pipeline = pipeline or StepPipeline()
        # prefill shapes captured per generation (others run eagerly; every graph shares the shard's one pool)
        self.max_prefill_graphs = 48
        self.decode_layout = DecodeLayout.AUTO  # how a captured decode step lays out its sequences
        self._runner: Any = None
        # the tokens this rank sampled, by sequence and position (the last two): a deferred decode item feeds
        # the one at its start position; a rerun step finds its input again
        self.sampled: dict[str, dict[int, int]] = {}
        # the token ids of sequences whose penalties read them (``WorkItem.keep_tokens``), index = position
        self.history: dict[str, list[int]] = {}
        # prefix caching: prefill chunks skip the cached blocks of their prompt (``shard/prefix.py``)
        self.prefixes = ShardPrefixes(prefix_caching)
        # launched steps not completed yet: step id -> (sampled tokens [S] on the device, {(seq, position): i})
        self._picks: dict[str, tuple[torch.Tensor, dict[tuple[str, int], int]]] = {}
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
             prefix_caching: bool = True) -> "GenerationExecutor":
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
        if sized and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            host.size_kv(float(memory_fraction), max(WORKSPACE_MIN_BYTES, int(WORKSPACE_SHARE * total)))
        executor = cls(rank, host, hidden_size=hidden_size, top_k=top_k, dtype=dtype, pipeline=pipeline,
                       prefix_caching=prefix_caching)
        if host.norms.modules:
            executor.count("fused_norm_layers", host.norms.modules)
        if host.rotary.modules:
            executor.count("fused_rotary_modules", len(host.rotary.modules))
        if host.routers.modules:
            executor.count("fused_router_layers", host.routers.modules)
        if host.qkv.modules:
            executor.count("fused_qkv_modules", host.qkv.modules)
        return executor

    def fused_kernels(self) -> dict[str, Any]:
        """Which of the model's layers take the fused kernels: norm layers (count), modeling modules whose
        rotary embedding does, routers (count), attention modules with one Q/K/V GEMM (count), and what kept
        transformers' own forward and why (class or module -> reason)."""
        host = self.host
        return {"norm_layers": host.norms.modules, "rotary_modules": list(host.rotary.modules),
                "router_layers": host.routers.modules, "qkv_modules": host.qkv.modules,
                "skipped": {**host.norms.skipped, **host.rotary.skipped, **host.routers.skipped}}

    def info(self) -> dict[str, Any]:
        """What the driver's scheduler needs: KV blocks, vocabulary, context limit, end-of-sequence ids."""
        host = self.host
        return {"rank": self.rank, "kv_blocks": host.kv.num_blocks, "block_size": host.kv.block_size,
                "kv_bytes_per_token": host.kv_bytes_per_token(),
                "vocab_size": host.vocab_size,
                "max_context": int(getattr(host.config, "max_position_embeddings", 1 << 20)),
                "eos_token_ids": host.eos_token_ids(), "fused_norm_layers": host.norms.modules,
                "fused_rotary_modules": len(host.rotary.modules), "attention": host.attention.value,
                "attention_reason": host.attention_reason, "paged_decode": host.paged_decode,
                "paged_decode_reason": host.decode_reason, "prefix_caching": self.prefixes.enabled}

    def launch(self, req: StepRequest, view: GenerationView, paths: Any, status: ControlStatus,
               decode_key: int) -> "PendingStep | MultiPending":
        """Run a step up to its sampled tokens. A captured step of a group of one returns with its graph (and
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

    def _launch(self, req: StepRequest, view: GenerationView, paths: Any, status: ControlStatus,
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

    def keep_picks(self, step_id: str, graph: _GraphPending, shift: int = 0) -> None:
        """A launched step's device samples by (sequence, position + ``shift``) for later steps' ``_resolve``."""
        if graph.picked is not None:
            self._picks[step_id] = (graph.picked, {(it.seq_id, it.sample.position + shift): i
                                                   for i, it in enumerate(graph.want)})

    def _launch_one(self, req: StepRequest, view: GenerationView, paths: Any, status: ControlStatus,
                    decode_key: int, agreed: Any = None, ahead: int = 1) -> "PendingStep":
        """One step (or sub-step). ``agreed``: the decode decision of the request's first sub-step (the
        generation, the path and the token bucket hold for every sub-step: no control round of its own).
        ``ahead`` > 1: the first sub-step of a multi-step request whose later sub-steps run on arrays: its
        decode items reserve ``ahead - 1`` more positions and a captured decode step plans them all."""
        t0 = self.begin_step()
        kv = self.host.kv
        for sid in req.input.free:
            kv.free(sid)
            self.sampled.pop(sid, None)
            self.history.pop(sid, None)
            self.prefixes.forget(sid)
        local_error: Exception | None = None
        fills: list[tuple[int, torch.Tensor, int]] = []
        whole, prefix, hashed = (), ({}, 0), {}
        ordered = single_rows_first(req.input.items)
        if ordered is not req.input.items:
            req = req.revised(items=ordered)
        try:
            resolved, fills = self._resolve(req.input.items)
            resolved, fills = self._keep_tokens(resolved, fills)
            whole = resolved  # (uncut: the prompt blocks it writes are named after the launch)
            cut = self.prefixes.trim(kv, resolved, fills)
            resolved, fills, prefix, hashed = cut.items, cut.fills, (cut.cached, cut.looked_up), cut.hashed
            self.count("prefix_lookup_tokens", cut.looked_up)
            self.count("prefix_hit_tokens", sum(cut.cached.values()))
            for it in resolved:
                kv.reserve(it.seq_id, it.start + len(it.tokens) + (ahead - 1 if it.decode else 0))
        except (KVBudgetError, DeferredTokenError) as exc:
            local_error = exc
            status = ControlStatus.BAD_INPUT if status == ControlStatus.OK else status
        items = () if local_error is not None else resolved
        want_prefill, want_decode = req.input.units
        # 1. the decode unit's path, agreed once per step
        reason, bucket, decision = None, False, None
        if want_decode:
            if paths.bucket is None:
                reason = "bucket_disabled"
            else:
                if agreed is not None:  # a later sub-step of a multi-step request: agreed at its first one
                    if local_error is not None:
                        raise local_error
                    decision = agreed
                else:  # shapes differ per rank here: each rank decides its own replay (ready = 0)
                    decision = self.pipeline.agree_decode(paths.exchange, view, status, sum(it.decode for it in items),
                                                          decode_key, paths.bucket.token_cap, req.step_id,
                                                          local_error=local_error)
                status = ControlStatus.OK  # the decode round carried it (a refusal raised there)
                reason = None if decision.reason is None else decision.reason.value
                bucket = decision.reason is None
                if bucket:
                    paths = dataclasses.replace(paths, bucket=paths.bucket.for_tokens(decision.cap))
        out = self._forward(req, items, view, paths, status, want_prefill, want_decode, bucket, reason, fills,
                            ahead=ahead)
        if local_error is not None:
            raise local_error
        self.prefixes.commit(kv, whole, hashed)
        path = ("bucket" if bucket else "variable") if want_decode else None
        if isinstance(out, _GraphPending):
            if paths.exchange.size == 1:  # no overflow to agree on: complete it later
                if out.substeps is None:  # (else the last sub-step's samples are the ones read on)
                    self.keep_picks(req.step_id, out)
                return PendingStep(self, req, view.generation, items, t0, path, reason, graph=out, decision=decision,
                                   prefix=prefix)
            out = out.finish()
        tokens, stats, overflow, lps, counts = out
        if bucket and self.pipeline.overflowed(paths.exchange, overflow, req.step_id):
            reason, bucket = FallbackReason.EXPERT_ROUTE_CAPACITY_EXCEEDED.value, False
            out = self._forward(req, items, view, paths, ControlStatus.OK, want_prefill, want_decode, False, reason,
                                [], tag="/rerun")
            tokens, stats, _, lps, counts = out.finish() if isinstance(out, _GraphPending) else out
            path = "variable"
        self.finished(items, tokens)
        return PendingStep(self, req, view.generation, items, t0, path, reason, result=(tokens, stats, lps, counts),
                           decision=decision, prefix=prefix)

    def _resolve(self, items: tuple[WorkItem, ...]) -> tuple[tuple[WorkItem, ...], list[tuple[int, torch.Tensor, int]]]:
        """Deferred decode items get the token this rank sampled for them (at their start position): from the
        host when that step is complete, else ``fills`` (item index, the step's sampled-token tensor, index
        in it) to copy on the device, the item holding a placeholder token meanwhile."""
        deferred = [k for k, it in enumerate(items) if it.deferred]
        if not deferred:
            return items, []
        out, fills = list(items), []
        self.count("deferred_tokens", len(deferred))
        sampled, picks = self.sampled, list(self._picks.values())
        for k in deferred:
            it = items[k]
            tok = sampled.get(it.seq_id, {}).get(it.start)
            if tok is None:
                key = (it.seq_id, it.start)
                for t, ix in picks:
                    if key in ix:
                        fills.append((k, t, ix[key]))
                        break
                else:
                    raise DeferredTokenError(f"sequence {it.seq_id!r}: rank {self.rank} sampled no token for "
                                             f"position {it.start} (a deferred decode item needs one)")
                self.count("deferred_on_device")
                tok = 0
            out[k] = it.resolved(tok)
        return tuple(out), fills

    def _keep_tokens(self, items: tuple[WorkItem, ...], fills: list[tuple[int, torch.Tensor, int]]
                     ) -> tuple[tuple[WorkItem, ...], list[tuple[int, torch.Tensor, int]]]:
        """Sequences whose penalties read their tokens (``keep_tokens``): a deferred token of theirs still on
        the device is read to the host (waits for the step that sampled it: such steps do not overlap), and every
        item's tokens are written into ``history`` at their positions (a rerun or a re-prefill overwrites)."""
        held = [k for k, it in enumerate(items) if it.keep_tokens]
        if not held:
            return items, fills
        mine = {k for k, _, _ in fills} & set(held)
        if mine:
            items = read_fills(items, [f for f in fills if f[0] in mine])
            fills = [f for f in fills if f[0] not in mine]
            self.count("penalty_token_reads", len(mine))
        for k in held:
            it = items[k]
            h = self.history.setdefault(it.seq_id, [])
            if len(h) < it.start:
                raise DeferredTokenError(f"sequence {it.seq_id!r}: rank {self.rank} holds {len(h)} of its tokens, "
                                         f"not the {it.start} before position {it.start} (its penalties read them)")
            del h[it.start:]
            h.extend(it.tokens)
        return items, fills

    def _contexts(self, items: list[WorkItem]) -> list[list[int] | None]:
        """Each sampled item's tokens before its sample position (penalized sequences; None for the others)."""
        return [self.history.get(it.seq_id, [])[:it.sample.position] if it.sample.penalized else None
                for it in items]

    def finished(self, items: tuple[WorkItem, ...], tokens: dict[str, int], shift: int = 0, *,
                 remember: bool = True) -> None:
        """A step's tokens are known on the host: count it and keep its samples for deferred items (``shift``:
        a multi-step request's sub-step on its first sub-step's items, positions that many on)."""
        self.count("generate_steps")
        if remember:
            self._remember(items, tokens, shift)

    def _remember(self, items: tuple[WorkItem, ...], tokens: dict[str, int], shift: int = 0) -> None:
        for it in items:
            if it.sample is not None and it.seq_id in tokens:
                seen, pos = self.sampled.setdefault(it.seq_id, {}), it.sample.position + shift
                seen[pos] = tokens[it.seq_id]
                if min(seen) < pos - 1:  # (the last two positions kept: usually all there is)
                    for p in [p for p in seen if p < pos - 1]:
                        del seen[p]

    def _graph_step(self, req, items, view, dispatcher, reason, tag: str, rows: int, *, prefill: bool,
                    fills: list[tuple[int, torch.Tensor, int]], ahead: int = 1) -> "_GraphPending":
        """A step with static shapes, captured as ONE CUDA graph (attention, routers, every MoE layer's
        dispatch/experts/combine, LM head) per (generation, shape): the first step of a shape runs eagerly
        (the warm-up) and is then captured; later steps copy their inputs into the graph's buffers and replay.
        decode (``prefill`` False): one token per sequence, rows = the agreed token bucket, every row sampled.
        prefill (one-rank groups): rows = the next quarter octave of the step's tokens (>= 16), one sampled row
        per sequence (padded to a power of two); one sequence from position 0 keeps the plain causal mask. On
        the varlen backend a mixed step's decode rows come first as a group of their own (padded to a power of
        two, ``MIXED_DECODE_FLOOR``) and the chunks' padding rows are one sequence with no key (no attention work).
        keys = the next half octave of the rank's context (>= 64). Sampling runs on the logits. ``ahead`` > 1 (paged
        decode): the plan covers that many sub-steps and the step returns their ``SubstepRun``."""
        kv, dev = self.host.kv, self.host.device
        varlen = self.host.varlen
        chunks = items  # (resolved: each item is its chunk, ``kv.Chunk``; its num_tokens = len(tokens))
        n = sum(c.num_tokens for c in chunks)
        context = sum(c.start + c.num_tokens for c in chunks)
        plain = prefill and len(chunks) == 1 and chunks[0].start == 0
        # varlen decode: each padding row reads one padding key of its own
        single, nd, paged_keys = 0, leading_single_rows(chunks), 0
        if plain:
            keys = rows
        elif prefill:
            if varlen and 0 < nd < len(chunks):  # decode rows first, as a group of their own (``plan_padded``)
                single = max(MIXED_DECODE_FLOOR, pow2(nd))  # (a padding row's routes compute nothing)
                rows = single + shape_bucket(n - nd, 16, 3)
            if single and self.host.paged_decode:  # the one-row group reads the cache in place (octaves of its
                kd = sum(c.start + c.num_tokens for c in chunks[:nd])  # slot vector: an upload only), the
                paged_keys = pow4(max(MIXED_SLOTS_FLOOR, kd + single - nd))  # chunks' contexts alone are gathered
                keys = shape_bucket(context - kd, 64, 2)
            else:
                keys = shape_bucket(context + (single - nd if single else 0), 64, 2)  # (+ the group's padding)
        elif varlen and self.host.paged_decode:  # read in place: the slot vector's length costs an upload only,
            keys = pow2(max(1024, context + n * (ahead - 1) + rows - n))  # so octaves keep the shapes few
        else:
            keys = shape_bucket(context + (rows - n if varlen else 0), 64, 2)
        last_rows = ((single + max(SAMPLED_ROWS_FLOOR, pow2(len(chunks) - nd)) if single else max(1, pow2(len(chunks))))
                     if prefill else None)
        shift = single - nd if single else 0  # rows of the items after the one-row group move past its padding
        token_ids = packed_ids(items, rows)
        if single:  # the chunks' tokens move past the one-row group's padding rows
            token_ids[single:single + n - nd] = token_ids[nd:n].copy()
            token_ids[nd:single] = 0
        extra = {"token_ids": token_ids}
        layout = DecodeLayout.PACKED
        if not prefill and not varlen:  # (varlen attends per sequence over the packed contexts already)
            longest = max(64, pow2(max(c.start + 1 for c in chunks)))
            layout = self.decode_layout.pick(rows, longest, keys)
        # a decode step reads the cache in place, a mixed step's one-row group too
        paged = varlen and self.host.paged_decode and (not prefill or paged_keys > 0)
        plans = None
        if layout is DecodeLayout.BATCHED:
            keys = longest
            staged = kv.plan_batched(chunks, rows, keys, self.dtype, extra=extra)
        elif paged and not prefill:  # (every sub-step of a multi-step request at once, ``ahead`` > 1)
            plans = kv.plan_decode_steps(chunks, rows, keys, ahead, extra=extra)
            staged = plans[0]
        else:
            staged = kv.plan_padded(chunks, rows, keys, self.dtype, last_rows=last_rows, plain=plain, varlen=varlen,
                                    single_rows=single, paged_keys=paged_keys, extra=extra)
        # the longest query run bounds the kernel's grid (``prefill_query_bound``); one row per decode sequence
        max_q = prefill_query_bound(chunks[nd:] if single else chunks, rows - single, QUERY_BOUND_FLOOR) if prefill else 1
        if self._start is not None:  # the step's device work starts here (its host planning came first)
            self._start.record()  # re-recorded: the later record is the one that counts
        if fills:  # deferred tokens still on the device: copied behind the step that sampled them, with
            # one gather per source step and index vectors uploaded without a host wait
            starts = np.cumsum([0] + [len(it.tokens) for it in items])
            by_source: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
            for k, t, i in fills:
                _, dst, idx = by_source.setdefault(id(t), (t, [], []))
                dst.append(int(starts[k]) + (shift if k >= nd else 0))
                idx.append(i)
            for t, dst, idx in by_source.values():
                staged["token_ids"].index_copy_(0, device_tensor(dst, torch.int64, dev),
                                                t.index_select(0, device_tensor(idx, torch.int64, dev)).to(torch.int64))
        unit = "prefill" if prefill else "decode"
        label = "local-graph" if prefill else None
        if paged_keys:
            self.count("paged_mixed_steps")

        marked, segments = marked_rows(items, nd, shift)

        def body(inp: dict[str, torch.Tensor]):
            ctx = MoEStep(rank=self.rank, view=view, dispatcher=dispatcher, runner=self._runner, dtype=self.dtype,
                          hidden_size=self.hidden_size, tag=f"{req.step_id}{tag}/{unit}", fallback_reason=reason,
                          row_valid=inp["row_valid"], path=label)
            layout = StepLayout(inp["write_index"], inp["read_index"], inp["positions"], inp.get("mask"),
                                inp.get("last"), inp.get("cu_q"), inp.get("cu_k"), max_q, keys, single,
                                paged=paged, paged_keys=paged_keys, k_end=inp.get("k_end"))
            rec = RouteRecorder(ctx, len(view.snapshots), inp["row_valid"]) if marked else None
            logits = self.host.forward_layout(layout, inp["token_ids"], ctx if rec is None else rec)
            # every layer's counts, overflow flags and handle checks in one device vector (in the graph); with
            # a marked item, every layer's routes [L, rows, k] too (a graph of its own: unmarked steps keep theirs)
            return (logits, ctx.device_summary(), None if rec is None else rec.ids), ctx

        key = (unit, rows, keys, last_rows, single, paged_keys, max_q, bool(marked), layout.value)  # (layout last)
        if prefill and self.pipeline.graphs.get(view.generation, key) is None:  # a graph of a larger query bound
            key = self.pipeline.graphs.covering(view.generation, key, QUERY_BOUND_AT) or key  # serves it unchanged
            max_q = key[QUERY_BOUND_AT]
        want_rows = [i for i, it in enumerate(items) if it.sample is not None]
        want = tuple(items[i] for i in want_rows)
        contexts = self._contexts(list(want))

        def launch(inputs: dict[str, torch.Tensor], specs: list, greedy: bool = False) -> _GraphPending:
            # replay (or run and capture), then sample; the outputs' host copies queued right behind
            ((logits, summary, routes), ctx), replayed = self.pipeline.run_static(
                view.generation, key, inputs, body, unit=unit, limit=self.max_prefill_graphs if prefill else None)
            ctx.path = ("local" if prefill else "bucket") + ("-graph" if replayed else "")
            host_summary = None
            if summary is not None:  # queued behind the step: read with the sampled tokens, one wait for both
                host_summary = torch.empty(summary.shape, dtype=summary.dtype, pin_memory=dev.type == "cuda")
                host_summary.copy_(summary, non_blocking=True)
            counts = None
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
            return _GraphPending(ctx, want, picked, host_summary, dev, host_picked, done, lps, counts)

        specs = [it.sample for it in want]
        out = launch(staged, specs)
        if plans is not None and len(plans) > 1:
            out.substeps = SubstepRun(plans, launch, want, specs)
        return out

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

    @property
    def graphs(self):
        """The captured steps (the shard pipeline's)."""
        return self.pipeline.graphs

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def _forward(self, req, items, view, paths, status, want_prefill, want_decode, bucket, reason, fills,
                 tag: str = "", ahead: int = 1):
        """The step's model forward: a captured-shape step (``_GraphPending``) or eagerly ((tokens, stats,
        overflow, logprobs, expert counts: {sequence id: [layers, experts] int32} of the items marked
        ``expert_stats``, None when none is)). ``fills``: deferred tokens still on the device (``_resolve``)."""
        def ctx(unit, dispatcher, st, r=None):
            return MoEStep(rank=self.rank, view=view, dispatcher=dispatcher, runner=paths.runner, dtype=self.dtype,
                           hidden_size=self.hidden_size, tag=f"{req.step_id}{tag}/{unit}", status=st, fallback_reason=r)

        # the first unit to run carries this rank's status into its first control round
        pre = ctx("prefill", paths.normal, status) if want_prefill else None
        dec = None
        if want_decode:
            dec = ctx("decode", paths.bucket if bucket else paths.normal,
                      status if pre is None else ControlStatus.OK, reason)
        tokens: dict[str, int] = {}
        lps: dict[str, Any] = {}
        self._runner = paths.runner
        if items and paths.capture:
            if bucket and pre is None and "decode" not in self.pipeline.capture_errors:
                return self._graph_step(req, items, view, paths.bucket, reason, tag, paths.bucket.token_cap,
                                        prefill=False, fills=fills, ahead=ahead)
            if (pre is not None and status == ControlStatus.OK and paths.exchange.size == 1
                    and paths.bucket.mode is DispatchMode.LOCAL and "prefill" not in self.pipeline.capture_errors):
                # (a refused step takes the eager path, whose first dispatch raises the refusal)
                # a group of one: every step (prefill, mixed) runs the local path; routes come from the
                # model's own router, so the unchecked (capturable) local dispatcher serves the whole step
                n = sum(len(it.tokens) for it in items)
                return self._graph_step(req, items, view, paths.bucket, reason, tag, shape_bucket(n, 16, 3),
                                        prefill=True, fills=fills)
        items = read_fills(items, fills)
        split = SplitMoE(pre, dec, *phase_rows(items, self.host.device))
        marked, segments = marked_rows(items)
        rec = RouteRecorder(split, len(view.snapshots)) if marked else None
        counts = None
        if items:
            chunks = [SeqChunk(it.seq_id, it.start, len(it.tokens)) for it in items]
            logits = self.host.forward(chunks, torch.from_numpy(packed_ids(items)), split if rec is None else rec)
            want = [(i, it) for i, it in enumerate(items) if it.sample is not None]
            if want:
                rows = torch.tensor([i for i, _ in want], dtype=torch.int64, device=logits.device)
                scores, specs = logits.index_select(0, rows), [it.sample for _, it in want]
                picked = sample_tensor(scores, specs, self._contexts([it for _, it in want]))
                pending = logprobs_tensor(scores, picked, specs)
                tokens = {it.seq_id: int(tok) for (_, it), tok in zip(want, picked.tolist())}
                if pending is not None:
                    lps = {want[i][1].seq_id: lp for i, lp in pending.read().items()}
            if rec is not None:
                self.count("expert_stats_steps")
                host = expert_counts(rec.ids, segments, view.snapshots[0].num_experts).cpu().numpy()
                counts = dict(zip(marked, host))
        else:
            self.host.idle(split, self.hidden_size, self.top_k)
        stats, overflow = [], False
        for unit in (pre, dec):
            if unit is not None:
                s, o = unit.finish()
                stats.extend(s)
                overflow = overflow or o
        return tokens, tuple(stats), overflow, lps, counts


__all__ = ["GenerationExecutor", "DeferredTokenError", "DecodeLayout"]
