"""Launched generation steps of one rank, not completed yet: ``PendingStep`` (one step; a graph step of a
group of one completes behind the next step's launch), ``MultiPending`` (the sub-steps of a multi-step decode
request) and ``GraphPending`` (the device-side outputs of a graph step). Pure: no Ray."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_moe.moe.layer import MoEStep
from ray_moe.moe.stats import merge_layer_stats
from ray_moe.model.sampling import LogprobsPending, TokenLogprobs
from ray_moe.shard.records import GenerationOutput, StepRequest, StepResult, WorkItem


@dataclass(eq=False)
class GraphPending:
    """A graph step whose replay and sampling were queued on the device: ``finish`` waits for them.
    want: the sampled items in ``picked`` order; picked: [S] int64 on the device (None: nothing sampled);
    host_picked / host_summary: their copies queued to (pinned) host memory right behind the step, so reading
    them never waits for steps launched after this one. ``done``: an event recorded after those copies.
    logprobs: the raw logprobs of the ``want`` items that asked, on the device (None: none asked). counts: (the
    sequence ids of the items marked ``expert_stats``, their [S, layers, experts] int32 expert counts queued
    to (pinned) host memory behind the step), None when no item is marked."""

    ctx: MoEStep
    want: tuple[WorkItem, ...]
    picked: torch.Tensor | None
    host_summary: torch.Tensor | None
    device: torch.device
    host_picked: torch.Tensor | None = None
    done: Any = None
    logprobs: LogprobsPending | None = None
    counts: tuple[tuple[str, ...], torch.Tensor] | None = None
    substeps: Any = None  # a multi-step request's first sub-step: the later ones' ``SubstepRun``

    def finish(self, stats: bool = True) -> tuple[dict[str, int], tuple, bool, dict[str, TokenLogprobs],
                                                  dict[str, np.ndarray] | None]:
        """(tokens, layer statistics, overflowed, logprobs, expert counts) once the device is done. ``stats``
        False: no statistics read (the caller sums ``host_summary`` over sub-steps: ``MoEStep.finish_summed``)."""
        tokens, lps = {}, {}
        if self.done is not None:
            self.done.synchronize()
        if self.picked is not None:
            src = self.host_picked if self.host_picked is not None else self.picked
            tokens = {it.seq_id: int(t) for it, t in zip(self.want, src.tolist())}
            if self.logprobs is not None:
                lps = {self.want[i].seq_id: lp for i, lp in self.logprobs.read().items()}
        elif self.device.type == "cuda" and self.done is None:
            torch.cuda.current_stream(self.device).synchronize()
        stats, overflow = ((), False) if not stats else self.ctx.finish(
            None if self.host_summary is None else self.host_summary.numpy())
        counts = None if self.counts is None else dict(zip(self.counts[0], self.counts[1].numpy()))
        return tokens, stats, overflow, lps, counts


class PendingStep:
    """A launched step of one rank: ``complete`` returns its result (reads a still-running captured step's
    tokens and statistics). ``wait`` blocks, without the GIL, until the device finished it."""

    def __init__(self, executor: Any, req: StepRequest, generation: int,
                 items: tuple[WorkItem, ...], t0: float, path: str | None, reason: str | None, *,
                 graph: GraphPending | None = None,
                 result: tuple[dict[str, int], tuple, dict[str, TokenLogprobs], dict | None] | None = None,
                 decision: Any = None, prefix: tuple[dict[str, int], int] = ({}, 0), shift: int = 0) -> None:
        self.executor, self.req, self.generation, self.items = executor, req, generation, items
        self.shift = shift  # a sub-step launched on its first sub-step's items: their positions this many on
        self.remember = True  # keep its samples for deferred items (a multi-step request's last two sub-steps)
        # the statistics left to the caller (``MultiPending``): the step context and its summary on the host
        self.summed: tuple[MoEStep, np.ndarray] | None = None
        self.prefix = prefix  # (cached tokens per sequence, prefill tokens looked up): ``shard/prefix.py``
        self.decision = decision  # the decode unit's agreed decision (None: no decode round)
        self.t0, self.path, self.reason = t0, path, reason
        self.graph, self.result = graph, result
        self.launch_s = time.perf_counter() - t0  # the launch's host work (made at the launch's end)
        self.launch_cpu_s = time.thread_time() - executor.cpu_mark  # its CPU time on the launching thread
        # of which inside graph replays (input copies and the graph launch, which blocks while the device's
        # queue is full: waiting, not work)
        self.replay_s = executor.pipeline.replay_s - executor.replay_mark
        self.start, self.event = executor.take_start(), None
        if self.start is not None:  # on CUDA: the step's device span, [start, event]
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()

    @property
    def ready(self) -> bool:
        """Complete on launch (its tokens are already this rank's ``sampled``)."""
        return self.graph is None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def abandon(self) -> None:
        """A step that will not be completed: later steps no longer read its tokens."""
        self.executor.batcher.drop_picks(self.req.step_id)

    def complete(self, stats: bool = True) -> StepResult:
        """The step's result. ``stats`` False (a captured step): its layer statistics are not read; the step
        context and its device summary on the host are left in ``summed`` (``MultiPending`` sums them)."""
        ex = self.executor
        self.wait()  # the device's part done: what follows is the completion's host work
        t, c = time.perf_counter(), time.thread_time()
        if self.graph is not None:
            g = self.graph
            try:
                tokens, stats_, _, lps, counts = g.finish(stats)  # a group of one: nothing overflows
            finally:
                ex.batcher.drop_picks(self.req.step_id)
            ex.finished(self.items, tokens, self.shift, remember=self.remember)
            self.result, self.graph = (tokens, stats_, lps, counts), None
            if not stats:
                self.summed = (g.ctx, g.host_summary.numpy())
        tokens, stats, lps, counts = self.result
        device_s, idle_s = ex.device_span(self.start, self.event)
        out = GenerationOutput({k: (v,) for k, v in tokens.items()}, self.path, self.reason,
                               logprobs={k: (v,) for k, v in lps.items()}, expert_counts=counts or {},
                               cached_tokens=dict(self.prefix[0]), prefix_lookup_tokens=self.prefix[1])
        end = time.perf_counter()
        return StepResult(ex.rank, self.req.step_id, self.generation, out, stats, end - self.t0,
                          device_s=device_s, idle_s=idle_s, host_s=self.launch_s + (end - t),
                          replay_s=self.replay_s, host_cpu_s=self.launch_cpu_s + (time.thread_time() - c))


class MultiPending:
    """A multi-step decode request's sub-steps (``PendingStep`` each, launched back to back): the same
    interface; ``complete`` returns one result with every sequence's tokens in position order."""

    def __init__(self, req: StepRequest, parts: list[PendingStep]) -> None:
        self.req, self.parts = req, parts
        for p in parts[:-2]:  # a rank keeps the last two samples of a sequence (``TokenStepExecutor.sampled``)
            p.remember = False

    @property
    def ready(self) -> bool:
        return all(p.ready for p in self.parts)

    def wait(self) -> None:
        for p in self.parts:
            p.wait()

    def abandon(self) -> None:
        for p in self.parts:
            p.abandon()

    def complete(self) -> StepResult:
        """One result: every sequence's tokens in position order, the layer statistics summed over the
        sub-steps (sub-steps replaying one captured layout: their device summaries summed, one LayerStats per
        layer, ``MoEStep.finish_summed``; else each sub-step's, merged)."""
        results = []
        gs = [p.graph for p in self.parts]
        layout = gs[0].ctx.summary_layout() if all(g is not None and g.host_summary is not None for g in gs) else None
        summed = layout is not None and all(g.ctx.summary_layout() == layout for g in gs[1:])
        try:
            for p in self.parts:
                results.append(p.complete(stats=not summed))
        except BaseException:
            for p in self.parts[len(results):]:
                p.abandon()
            raise
        first, outs = results[0], [r.output for r in results]
        seqs = list(outs[0].tokens)
        if all(list(o.tokens) == seqs for o in outs[1:]):  # (every sub-step's sequences in one order: columns)
            tokens = dict(zip(seqs, zip(*[[t[0] for t in o.tokens.values()] for o in outs])))
        else:
            tokens = {k: tuple(o.tokens[k][0] for o in outs) for k in seqs}
        lps = {k: tuple(o.logprobs[k][0] for o in outs) for k in outs[0].logprobs}
        counts: dict[str, np.ndarray] = {}
        for o in outs:  # every sub-step's expert counts, summed per sequence
            for k, c in o.expert_counts.items():
                counts[k] = c + counts[k] if k in counts else c.copy()
        out = GenerationOutput(tokens, outs[0].decode_path, outs[0].fallback_reason, logprobs=lps,
                               expert_counts=counts)
        if summed:
            layers = self.parts[0].summed[0].finish_summed([p.summed[1] for p in self.parts])[0]
        else:
            layers = merge_layer_stats([ls for r in results for ls in r.layers])
        return StepResult(first.rank, self.req.step_id, first.generation, out, layers,
                          time.perf_counter() - self.parts[0].t0,
                          device_s=sum(r.device_s for r in results), idle_s=sum(r.idle_s for r in results),
                          host_s=sum(r.host_s for r in results), replay_s=sum(r.replay_s for r in results),
                          host_cpu_s=sum(r.host_cpu_s for r in results))


__all__ = ["PendingStep", "MultiPending", "GraphPending"]
