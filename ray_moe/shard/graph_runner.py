# ======================================================================================================
#  HOW A GENERATION STEP RUNS ON ONE SHARD (SGLang's CudaGraphRunner; pure: no Ray)
#
#   start: the deployment's StepLattice (shard/lattice.py) ──> capture, for the active generation:
#     1. every decode size: a warm-up step over the trash slot, then ONE whole-step CUDA graph (attention read
#        in place, every MoE layer, the LM head); its slot vector is one buffer every whole-step graph shares
#     2. every token size (a group of one) up to the lattice's ``whole_rows``: a warm-up, then ONE whole-step
#        graph whose attention reads every row in place (model/paged_varlen.py: static grids over work tables)
#     3. every larger token size: a warm-up, then a PIECEWISE graph (model/piecewise.py): the pieces between the
#        attention calls, attention run between them with each step's own plan
#   each step: choose ──> DECODE_GRAPH (a decode-only step the agreed bucket holds)
#                     ──> TOKEN_GRAPH  (any other step of a group of one within the whole-step token sizes)
#                     ──> PIECEWISE    (any other step of a group of one within the token sizes)
#                     ──> EAGER        (the reason named and counted: beyond the lattice, expert statistics,
#                                       an expert-parallel mixed step, graphs off)
#   never a capture on the request path, except the lattice of a generation published later (counted apart)
# ======================================================================================================
"""The captured step shapes of one shard: ``StepGraphRunner`` (capture at start, choose per step, replay)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import numpy as np
import torch

from ray_moe.core.types import AttentionBackend
from ray_moe.model.attention import AttentionPlan, InlineAttention
from ray_moe.model.host import ModelHost
from ray_moe.model.kv import StepRows
from ray_moe.model.kv_host import HostChunks
from ray_moe.model.paged_varlen import block_rows, table_sizes
from ray_moe.model.piecewise import OutputArena, PiecewiseGraph
from ray_moe.moe.decode.graphs import CapturedStep, capture_failure
from ray_moe.moe.layer import RouteRecorder
from ray_moe.moe.dispatch.bucket import token_buckets
from ray_moe.shard.lattice import StepLattice


class RunKind(str, Enum):
    """How one step runs on a rank."""

    DECODE_GRAPH = "decode-graph"  # a whole-step CUDA graph of a decode size (attention inside)
    TOKEN_GRAPH = "token-graph"  # a whole-step CUDA graph of a token size (attention inside, read in place)
    PIECEWISE = "piecewise-graph"  # the pieces of a token size's graph, attention between them
    EAGER = "eager"  # every kernel launched from Python (CPU; whatever no captured size holds)


@dataclass(frozen=True)
class RunChoice:
    """A step's way to run: ``rows`` its padded rows (EAGER: the real ones); ``reason``: why EAGER."""

    kind: RunKind
    rows: int
    reason: str | None = None


class CudaGraphs:
    """The capture backend: real CUDA graphs (tests on CPU pass an emulation with the same two methods).
    ``warmup``: each size runs once eagerly before its capture (kernels compiled for its shapes outside it)."""

    warmup = True

    def full(self, inputs: dict[str, torch.Tensor]) -> CapturedStep:
        return CapturedStep(inputs, weak_outputs=True)

    def piecewise(self, inputs: dict[str, torch.Tensor]) -> PiecewiseGraph:
        return PiecewiseGraph(inputs)


@dataclass
class CaptureReport:
    """What one generation's capture took: graphs by kind, seconds, and the device memory it kept (the graph
    pool, the shared slot vector and attention-output arena: the allocator's reserved bytes after over before,
    the KV cache's tensors (allocated by the first warm-up) left out; CUDA)."""

    generation: int
    at_start: bool
    decode_graphs: int = 0
    token_graphs: int = 0
    piecewise_graphs: int = 0
    seconds: float = 0.0
    reserved_bytes: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    # a first capture that ran out of memory, the KV cache then made smaller and the lattice captured again
    # (``TokenStepExecutor.capture``): its errors, the cache's tokens before and after, the workspace kept
    kv_refit: dict[str, Any] | None = None


# a step's MoE context for captured rows: (row_valid [R] bool, the dispatcher, the step's tag) -> MoEStep
ContextFactory = Callable[[torch.Tensor, Any, str], Any]


class StepGraphRunner:
    """The lattice of one shard's generation steps and their captured graphs (one pool, one store with the
    shard's other captured steps: ``pipeline.graphs``). ``configure`` once the deployment's sizes are known;
    ``capture`` a generation's lattice; ``choose`` per step; ``decode`` / ``piecewise`` replay."""

    def __init__(self, host: ModelHost, pipeline: Any) -> None:
        self.host, self.pipeline = host, pipeline
        self.backend: Any = CudaGraphs()
        self.lattice: StepLattice | None = None
        self.counters: dict[str, int] = {}
        # why no graph of a kind is captured here (None: it is): set by ``configure``
        self.decode_off: str | None = "no lattice configured"
        self.tokens_off: str | None = "no lattice configured"
        self.whole_off: str | None = "no lattice configured"  # whole-step graphs of token sizes
        self.reports: dict[int, CaptureReport] = {}
        self.slots: torch.Tensor | None = None  # the whole-step graphs' shared slot vector
        self.arena: OutputArena | None = None  # the holes' shared attention output
        self.max_k = 1  # the decode graphs' context bound (the decode kernel's split count is a static shape)
        self.decode_sizes: tuple[int, ...] = ()  # the lattice's, up to the decode bucket's capacity
        self.experts = ""  # how the expert runner computes, in words (configure)
        self.configured = (self.decode_off, self.tokens_off, self.whole_off)  # (``configure``'s, for ``drop``)
        # work the launching thread does between a piecewise step's pieces (the shard's due completions: core.py)
        self.between_pieces: Callable[[], None] | None = None

    # ------------------------------------------------------------------ configuration
    def configure(self, lattice: StepLattice, *, capture: bool, one_rank: bool, local: bool, why_not: str,
                  decode_cap: int, experts: str) -> None:
        """The deployment's lattice, and which kinds this shard can capture: ``capture`` (CUDA graphs on, a
        capturable exchange; else ``why_not``), ``one_rank`` / ``local`` (a group of one on the local path:
        piecewise steps; an expert-parallel group exchanges counts on the host in those); ``decode_cap``: the
        decode bucket's capacity (its sizes stop there: a named ``decode_token_capacity`` below the running
        sequences sends larger decode steps to the other paths); ``experts``: how the expert runner computes, in
        words (``ExpertRunner.kernels``: ``status``'s ``experts`` path)."""
        if self.arena is not None and self.arena.rows < lattice.max_tokens:  # captures of a smaller lattice hold it
            raise ValueError(f"lattice max_tokens={lattice.max_tokens}: the attention output arena of the captures "
                             f"still held holds {self.arena.rows} rows; release them first")
        host = self.host
        self.lattice = lattice
        self.experts = experts
        self.decode_sizes = token_buckets(min(lattice.rank_running, int(decode_cap)))
        off = None if capture else why_not
        # a latent cache (MLA) whose modules attend the latent (``model/mla.py``) is read like any cache: decode
        # steps in place, prefill and mixed steps as piecewise graphs whose holes gather and expand what they need;
        # one whose modules expand it (fused kernels off) hands every step gathered contexts: eager
        latent = ("the model's attention expands a latent cache (MLA): its steps gather their contexts eagerly"
                  if host.cache_gathers else None)
        self.decode_off = off or (None if host.paged_decode else
                                  f"decode attention gathers its contexts ({host.decode_reason})")
        self.tokens_off = off or latent or (None if one_rank and local else
                                            "an expert-parallel group's prefill and mixed steps agree their counts on "
                                            "the host")
        self.whole_off = self.tokens_off or (None if host.paged_varlen else
                                             f"the in-place varlen kernel is unavailable ({host.paged_reason})")
        if self.whole_off is None and lattice.whole_rows < lattice.token_sizes[0]:
            self.whole_off = "whole_rows=0"
        self.max_k = int(getattr(host.config, "max_position_embeddings", 1 << 15))
        self.configured = (self.decode_off, self.tokens_off, self.whole_off)

    def drop(self, generation: int) -> None:
        """Forget ``generation``'s capture so that it can be captured again (the caller released its graphs
        from the store): the shared buffers re-made at the next capture (the slot vector names the cache's
        trash slot), each kind's path back to what ``configure`` chose."""
        self.reports.pop(generation, None)
        self.slots = self.arena = None
        self.decode_off, self.tokens_off, self.whole_off = self.configured

    def paths(self) -> dict[str, str]:
        """The path each step kind takes here, in words (``status``)."""
        lat = self.lattice
        out = {}
        if lat is None:
            return {"decode": "eager (no lattice)", "prefill_mixed": "eager (no lattice)"}  # (not configured)
        sizes = self.decode_sizes
        dec = (f"decode graph, {len(sizes)} sizes {sizes[0]}..{sizes[-1]}" if self.decode_off is None else None)
        tok = None
        if self.tokens_off is None:
            whole = [r for r in lat.token_sizes if lat.whole(r)] if self.whole_off is None else []
            pieces = [r for r in lat.token_sizes if r not in whole]
            parts = [f"{name} graph, {len(x)} sizes {x[0]}..{x[-1]}"
                     for name, x in (("whole-step token", whole), ("piecewise", pieces)) if x]
            tok = "; ".join(parts) + (f" (whole-step token graphs off: {self.whole_off})" if self.whole_off else "")
        out["decode"] = dec or (tok and f"{tok} ({self.decode_off})") or f"eager ({self.decode_off})"
        out["prefill_mixed"] = tok or f"eager ({self.tokens_off})"
        if dec and sizes[-1] < lat.rank_running:
            out["decode"] += (f"; {sizes[-1] + 1}..{lat.rank_running} sequences (decode_token_capacity={sizes[-1]}): "
                              + (tok or f"eager ({self.tokens_off})"))
        out["beyond_lattice"] = "eager"
        host = self.host
        out["long_prompt_attention"] = (
            f"cuDNN dense for chunks of >= {host.dense_rows} rows ({host.dense_reason})" if host.kernels.dense
            is not None else f"FlashAttention-2 varlen ({host.dense_reason})") if host.varlen else "masked"
        out["experts"] = self.experts
        return out

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ------------------------------------------------------------------ capture
    def captured(self, generation: int) -> bool:
        return generation in self.reports

    def capture(self, generation: int, paths: Any, make_ctx: ContextFactory, *, at_start: bool) -> CaptureReport:
        """Every lattice size of ``generation`` (token sizes, then decode sizes, largest first), each a warm-up
        step then a capture; the graphs go into the shard's store under ``generation`` (released at its
        retirement). A failed capture of a kind leaves that kind eager, its reason in the report (and the step
        path)."""
        rep = CaptureReport(generation, at_start)
        self.reports[generation] = rep
        lat = self.lattice
        if lat is None or (self.decode_off and self.tokens_off):
            return rep
        dev = self.host.device
        t0 = time.perf_counter()
        # (the KV cache's tensors are allocated at the first warm-up's layers: not the graphs' memory)
        before = torch.cuda.memory_reserved(dev) - self.host.kv.allocated_bytes() if dev.type == "cuda" else 0
        self._buffers()
        if at_start:
            self._warm_hole_kernels(rep)
        key = "graphs_captured_start" if at_start else "graphs_captured_serving"
        # largest first (token sizes, then decode sizes, each descending), as vLLM and SGLang capture: every
        # graph allocates from the one pool, and a smaller graph's activations fit the segments a larger one
        # left; ascending, each larger size adds segments the smaller ones cannot merge, and the pool grows
        # with the lattice (82474f4's DeepSeek slice on an H100: 8.7 GiB by its 26th piecewise size, then an
        # out-of-memory capture that left every prompt step eager)
        if self.tokens_off is None:
            for rows in reversed(lat.token_sizes):
                if self.whole_off is None and lat.whole(rows):
                    try:
                        self._capture_token_graph(generation, rows, paths, make_ctx)
                        rep.token_graphs += 1
                        self.count(key)
                        continue
                    except Exception as exc:  # noqa: BLE001 - this size and the rest piecewise; say why
                        rep.errors["token_graph"] = capture_failure(exc)
                        self.whole_off = f"whole-step token capture failed: {rep.errors['token_graph']}"
                try:
                    self._capture_tokens(generation, rows, paths, make_ctx)
                except Exception as exc:  # noqa: BLE001 - keep serving eagerly; say why
                    rep.errors["tokens"] = capture_failure(exc)
                    self.tokens_off = f"piecewise capture failed: {rep.errors['tokens']}"
                    break
                rep.piecewise_graphs += 1
                self.count(key)
        if self.decode_off is None:
            for rows in reversed(self.decode_sizes):
                try:
                    self._capture_decode(generation, rows, paths, make_ctx)
                except Exception as exc:  # noqa: BLE001 - decode steps then take the other paths; say why
                    rep.errors["decode"] = capture_failure(exc)
                    self.decode_off = f"decode capture failed: {rep.errors['decode']}"
                    break
                rep.decode_graphs += 1
                self.count(key)
        if dev.type == "cuda":  # (the warm-ups' eager activations go back to the device; the graphs keep theirs)
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            rep.reserved_bytes = torch.cuda.memory_reserved(dev) - self.host.kv.allocated_bytes() - before
        rep.seconds = time.perf_counter() - t0
        return rep

    def _buffers(self) -> None:
        """The buffers every captured step shares, allocated once before the first capture (addresses are
        captured): the whole-step graphs' slot vector (every sequence's context slots: a decode size's sequences,
        or a whole token size's, each up to the model's context, at most four times the cache's slots) and the
        holes' attention-output arena."""
        lat, host = self.lattice, self.host
        whole = [r for r in lat.token_sizes if lat.whole(r)] if self.whole_off is None else []
        if (self.decode_off is None or whole) and self.slots is None:
            rows = max(self.decode_sizes[-1] if self.decode_off is None else 0, whole[-1] if whole else 0)
            seqs = max(self.decode_sizes[-1] if self.decode_off is None else 0,
                       lat.sampled_rows(whole[-1]) if whole else 0)
            n = min(seqs * self.max_k, 4 * host.kv.capacity_tokens) + rows
            self.slots = torch.full((n,), host.kv.trash_slot, dtype=torch.int64, device=host.device)
        if self.tokens_off is None and self.arena is None:
            c = host.config
            heads = int(c.num_attention_heads)
            dv = int(getattr(c, "v_head_dim", None) or getattr(c, "head_dim", None) or c.hidden_size // heads)
            self.arena = OutputArena(lat.max_tokens, heads, dv, host.dtype, host.device)

    def _warm_hole_kernels(self, rep: CaptureReport) -> None:
        """The in-place decode kernel at every split count it can take (1, 2, 4, 8, 16: a static shape of each
        call, ``paged_decode.decode_splits``), launched once on one trash row: a piecewise step's holes call it
        eagerly with their own decode rows, and a split count first met there would compile the kernel on the
        request path (on the H200 a mixed step once took 484 ms instead of ~140 ms: the host compiling it while
        the device waited). Nothing to do without the kernel (the masked backend, MLA, a CPU)."""
        host = self.host
        if self.tokens_off is not None or host.kernels.decode is None or host.device.type != "cuda":
            return  # (MLA's decode kernel: every variant compiled by its check at install)
        from ray_moe.model.paged_decode import BLOCK_N, MAX_SPLITS

        c = host.config
        heads = int(c.num_attention_heads)
        kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
        d = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        dev, dt = host.device, host.dtype
        q = torch.zeros(1, heads, d, dtype=dt, device=dev)
        k, v = torch.zeros(1, kv_heads, d, dtype=dt, device=dev), torch.zeros(1, kv_heads, d, dtype=dt, device=dev)
        slots = torch.zeros(1, dtype=torch.int64, device=dev)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        splits = 1
        try:
            while splits <= MAX_SPLITS:  # one row: the split count is the context bound's key blocks (2 x BLOCK_N)
                host.kernels.decode(q, k, v, slots, cu, 2 * BLOCK_N * splits, d ** -0.5)
                splits *= 2
        except Exception as exc:  # noqa: BLE001 - the kernel then compiles where it is first met; say so
            rep.errors["hole_kernels"] = capture_failure(exc)

    def _trash_chunks(self, lens: list[int]) -> HostChunks:
        """Warm-up chunks from position 0 whose every context slot is the trash slot (no sequence's KV)."""
        trash = self.host.kv.trash_slot
        arr = np.asarray(lens, dtype=np.int64)
        return HostChunks(np.zeros_like(arr), arr, arr.copy(), [np.full(n, trash, dtype=np.int64) for n in lens])

    def decode_body(self, rows: int, dispatcher: Any, make_ctx: ContextFactory, tag: str) -> Callable:
        """The whole-step decode graph's body over its static inputs: attention in place through the shared
        slot vector, with the static context bound (the decode kernel's split count). Every body records each
        MoE layer's routes [layers, rows, k] (a copy per layer): a step with items that asked for their expert
        statistics replays the same graph. Returns ((logits, device summary, routes), the step's MoEStep)."""
        host = self.host

        def body(inp: dict[str, torch.Tensor]):
            ctx = make_ctx(inp["row_valid"], dispatcher, tag)
            rec = RouteRecorder(ctx, len(ctx.view.snapshots), inp["row_valid"])
            plan = AttentionPlan(rows, AttentionBackend.VARLEN, cu_k=inp["cu_k"], max_k=self.max_k,
                                 single_rows=rows, slots=inp["read_index"], k_end=inp["k_end"])
            logits = host.forward_rows(StepRows.of(inp, rows), InlineAttention(plan, host.kernels), rec)
            return (logits, ctx.device_summary(), rec.ids), ctx
        return body

    def tables(self, rows: int) -> tuple[int, int, int]:
        """(one-row entries, blocks, rows a block) of a whole-step token graph of ``rows`` (``paged_varlen``)."""
        heads, kv_heads, _, _ = self.host.attention_heads()
        bq = block_rows(heads, kv_heads)
        return (*table_sizes(rows, self.lattice.sampled_rows(rows), bq), bq)

    def token_body(self, rows: int, dispatcher: Any, make_ctx: ContextFactory, tag: str) -> Callable:
        """The whole-step graph of a token size over its static inputs: every row's attention read in place by
        the paged varlen kernel over the shared slot vector and the step's work tables; routes recorded as in
        ``decode_body``. Returns ((logits [L, V], device summary, routes), the step's MoEStep)."""
        host = self.host

        def body(inp: dict[str, torch.Tensor]):
            ctx = make_ctx(inp["row_valid"], dispatcher, tag)
            rec = RouteRecorder(ctx, len(ctx.view.snapshots), inp["row_valid"])
            plan = AttentionPlan(rows, AttentionBackend.VARLEN, cu_q=inp["cu_q"], cu_k=inp["cu_k"],
                                 slots=inp["read_index"], tables=(inp["one"], inp["seq"], inp["first"]))
            logits = host.forward_rows(StepRows.of(inp, rows), InlineAttention(plan, host.kernels), rec)
            return (logits, ctx.device_summary(), rec.ids), ctx
        return body

    def piecewise_body(self, rows: int, dispatcher: Any, make_ctx: ContextFactory, tag: str) -> Callable:
        """The piecewise graph's body: the model over the static rows, attention through the capture's cutter
        (or, eagerly, any ``StepAttention``)."""
        host = self.host

        def body(inp: dict[str, torch.Tensor], attention: Any):
            ctx = make_ctx(inp["row_valid"], dispatcher, tag)
            rec = RouteRecorder(ctx, len(ctx.view.snapshots), inp["row_valid"])
            logits = host.forward_rows(StepRows.of(inp, rows), attention, rec)
            return (logits, ctx.device_summary(), rec.ids), ctx
        return body

    def _release_warmup(self) -> None:
        """A warm-up's eager activations back to the device before its capture: the graphs allocate from their
        own pool, which cannot take blocks cached in the allocator's default one, so without this the largest
        size's warm-up and its capture hold their activations twice (memory the KV budget keeps for one)."""
        dev = self.host.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()

    def _capture_decode(self, generation: int, rows: int, paths: Any, make_ctx: ContextFactory) -> None:
        host = self.host
        staged = host.kv.plan_decode_graph(self._trash_chunks([1] * rows), rows, 1, np.zeros(rows, dtype=np.int64))[0]
        body = self.decode_body(rows, paths.bucket.for_tokens(rows), make_ctx, f"warm-decode-{rows}")
        if self.backend.warmup:
            body(staged)  # 1. the warm-up (kernels compiled and tuned for this size outside the capture)
            self._release_warmup()
        inputs = {k: v.clone() for k, v in staged.items() if k != "read_index"}
        inputs["read_index"] = self.slots
        step = self.backend.full(inputs)
        pool = self.pipeline.capture_pool()
        self.pipeline.pool = step.capture(body, pool) or pool  # 2. the capture
        self.pipeline.graphs.put(generation, ("decode", rows), step)

    def _capture_token_graph(self, generation: int, rows: int, paths: Any, make_ctx: ContextFactory) -> None:
        """A token size's whole-step graph: its static inputs (offsets and tables int32, the shared slot vector)
        filled with a warm-up step of one sequence of ``rows`` tokens over the trash slot, the warm-up run on
        those very inputs (the kernels compiled for the captured dtypes and grids), then the capture."""
        host, lat = self.host, self.lattice
        staged = host.kv.plan_token_graph(self._trash_chunks([rows]), np.zeros(rows, dtype=np.int64), rows,
                                          lat.sampled_rows(rows), self.tables(rows))
        small = ("cu_q", "cu_k", "one", "seq", "first")
        inputs = {k: (v.to(torch.int32) if k in small else v.clone()) for k, v in staged.items() if k != "read_index"}
        inputs["read_index"] = self.slots
        inputs["read_index"][: staged["read_index"].numel()].copy_(staged["read_index"])
        body = self.token_body(rows, paths.bucket, make_ctx, f"warm-token-graph-{rows}")
        if self.backend.warmup:
            body(inputs)  # 1. the warm-up, on the static inputs themselves
            self._release_warmup()
        step = self.backend.full(inputs)
        pool = self.pipeline.capture_pool()
        self.pipeline.pool = step.capture(body, pool) or pool  # 2. the capture
        self.pipeline.graphs.put(generation, ("token-graph", rows), step)

    def _capture_tokens(self, generation: int, rows: int, paths: Any, make_ctx: ContextFactory) -> None:
        host, lat = self.host, self.lattice
        # one sequence of ``rows`` tokens over the trash slot: the pieces do not depend on the step's sequences
        step_rows, plan = host.kv.plan_step(self._trash_chunks([rows]), np.zeros(rows, dtype=np.int64),
                                            host.attention, rows=rows, last_rows=lat.sampled_rows(rows),
                                            mask_dtype=host.dtype)
        body = self.piecewise_body(rows, paths.bucket, make_ctx, f"warm-tokens-{rows}")
        if self.backend.warmup:
            body(step_rows.tensors(), InlineAttention(plan, host.kernels))  # 1. the warm-up
            self._release_warmup()
        graph = self.backend.piecewise({k: v.clone() for k, v in step_rows.tensors().items()})
        pool = self.pipeline.capture_pool()
        self.pipeline.pool = graph.capture(body, pool, self.arena) or pool  # 2. the capture
        self.pipeline.graphs.put(generation, ("tokens", rows), graph)

    # ------------------------------------------------------------------ each step
    def choose(self, generation: int, *, decode_only: bool, bucket_rows: int | None, rows: int, sequences: int,
               eager_status: bool, slot_keys: int = 0, context_keys: int = 0) -> RunChoice:
        """How a step runs: ``decode_only`` (one-row sequences only), ``bucket_rows`` (the agreed decode bucket,
        None: not on the bucket path), ``rows`` / ``sequences`` (real), ``eager_status`` (a refused or faulted
        step, graphs off for it: its first dispatch raises the refusal), ``slot_keys`` (a decode graph's slot
        vector length), ``context_keys`` (a whole-step token graph's: the sequences' contexts)."""
        lat = self.lattice
        have = generation in self.reports
        if eager_status:
            return self._eager(rows, "a refused step")
        if lat is None or not have:
            return self._eager(rows, self.decode_off or self.tokens_off or "no graphs for the generation")
        if (decode_only and bucket_rows is not None and self.decode_off is None
                and self.pipeline.graphs.get(generation, ("decode", bucket_rows)) is not None
                and slot_keys <= self.slots.numel()):
            return RunChoice(RunKind.DECODE_GRAPH, bucket_rows)
        if self.tokens_off is not None:
            return self._eager(rows, self.tokens_off if not decode_only else (self.decode_off or self.tokens_off))
        size = lat.token_rows(rows)
        if size is None or sequences > lat.sampled_rows(size):
            return self._eager(rows, f"beyond the lattice ({rows} rows, {sequences} sequences; the largest size "
                                     f"{lat.max_tokens} rows)")
        if self.whole_off is None and lat.whole(size):
            if context_keys > self.slots.numel():
                return self._eager(rows, f"contexts of {context_keys} keys beyond the slot vector's "
                                         f"{self.slots.numel()}")
            if self.pipeline.graphs.get(generation, ("token-graph", size)) is not None:
                return RunChoice(RunKind.TOKEN_GRAPH, size)
        if self.pipeline.graphs.get(generation, ("tokens", size)) is None:
            return self._eager(rows, "no graphs for the generation")
        return RunChoice(RunKind.PIECEWISE, size)

    def _eager(self, rows: int, reason: str) -> RunChoice:
        self.count("eager_steps")
        return RunChoice(RunKind.EAGER, rows, reason)

    def decode(self, generation: int, rows: int, staged: dict[str, torch.Tensor]) -> Any:
        """Replay the decode graph of ``rows``: ((logits [rows, V], summary, routes), ctx)."""
        self.count("decode_graph_steps")
        return self._replay(lambda: self.pipeline.graphs.get(generation, ("decode", rows)).replay(staged))

    def tokens(self, generation: int, rows: int, staged: dict[str, torch.Tensor]) -> Any:
        """Replay the whole-step graph of token size ``rows``: ((logits [L, V], summary, routes), ctx)."""
        self.count("token_graph_steps")
        return self._replay(lambda: self.pipeline.graphs.get(generation, ("token-graph", rows)).replay(staged))

    def piecewise(self, generation: int, rows: int, staged: dict[str, torch.Tensor], plan: AttentionPlan) -> Any:
        """Replay the piecewise graph of ``rows`` with the step's attention plan: ((logits [L, V], summary, routes),
        ctx)."""
        self.count("piecewise_steps")
        graph = self.pipeline.graphs.get(generation, ("tokens", rows))
        return self._replay(lambda: graph.replay(staged, plan, self.host.kernels, self.between_pieces))

    def _replay(self, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        out = fn()
        self.pipeline.note_replay(time.perf_counter() - t)
        return out

    def status(self) -> dict[str, Any]:
        """The lattice, the path each step kind takes, and what each generation's capture took."""
        return {"lattice": None if self.lattice is None else self.lattice.describe(), "paths": self.paths(),
                "captures": {g: vars(r) for g, r in self.reports.items()},
                "shared_bytes": (0 if self.slots is None else self.slots.numel() * 8)
                + (0 if self.arena is None else self.arena.nbytes)}

    def release(self, generation: int) -> None:
        """Forget ``generation``'s capture (the caller freed its graphs from the store). Once no capture is left,
        the shared buffers go too: the next capture makes them to its own lattice's sizes (a larger one's
        largest token size would not fit the old arena)."""
        self.reports.pop(generation, None)
        if not self.reports:
            self.slots = self.arena = None


__all__ = ["StepGraphRunner", "RunKind", "RunChoice", "CaptureReport", "CudaGraphs", "ContextFactory"]
