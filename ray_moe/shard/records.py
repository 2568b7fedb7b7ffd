"""The records that cross the actor boundary between the driver and one shard (one per rank per step), with
their compact wire forms. Light on purpose: numpy, the sampling spec and the layer statistics, no torch
kernels, no dispatchers (the driver imports this module).

    StepRequest / StepResult        one expert-only model step (``rt.forward``): hidden states in, out
    GenStepRequest / GenStepResult  one generation step: token ids and positions in, sampled ids out
    WorkItem                        one sequence's share of a generation step on its rank
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_moe.core.types import Phase
from ray_moe.model.sampling import SampleSpec, TokenLogprobs
from ray_moe.moe.stats import LayerStats


@dataclass(frozen=True)
class WorkItem:
    """One sequence's share of one step on its rank: ``tokens`` at positions ``start..``; the next token is
    sampled when ``sample`` (the chunk reaches the end of what is known). ``decode``: a one-token step of a
    sequence that already has a cache (the decode phase, spec 0x05E). ``deferred``: a decode step planned
    while the step that samples its input token is still in flight; ``tokens`` is empty and the rank feeds
    the token it sampled for this sequence at position ``start`` (the driver never waits for it).
    ``keep_tokens``: the rank keeps this sequence's token ids by position (its penalties read them); set on
    every item of a penalized sequence, so the rank holds all of them. ``expert_stats``: the rank counts the
    experts this item's rows were routed to, per MoE layer (``GenStepResult.expert_counts``)."""

    seq_id: str
    tokens: tuple[int, ...]
    start: int
    sample: SampleSpec | None
    decode: bool
    deferred: bool = False
    keep_tokens: bool = False
    expert_stats: bool = False

    @property
    def num_tokens(self) -> int:
        return 1 if self.deferred else len(self.tokens)


@dataclass(frozen=True)
class StepRequest:
    """One rank's share of one model step (all layers).

    hidden:       [T, d] float (NumPy wire pair on the wire, any float dtype)
    topk_ids:     [L, T, k] int64 or None (None: the rank routes with its own router)
    topk_weights: [L, T, k] float32 or None
    layers:       the MoE layers to run, in order (None: every layer)
    """

    step_id: str
    generation: int
    hidden: Any
    topk_ids: Any = None
    topk_weights: Any = None
    phase: Phase = Phase.PREFILL
    return_routes: bool = False
    marks: bool = False  # record host timestamps of the step's stages (StepResult.marks)
    layers: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StepResult:
    """One rank's output of one step. ``hidden``: [T, d] NumPy in the configured dtype's wire form."""

    rank: int
    step_id: str
    generation: int
    hidden: Any
    hidden_dtype: str
    layers: tuple[LayerStats, ...]
    routes: tuple[tuple[np.ndarray, np.ndarray], ...] | None
    active_generation: int | None
    elapsed_s: float
    # (stage, host seconds, device seconds) since the step started, when the request asked for marks: the
    # host clock where the host got to; on CUDA the device clock (events) where the device got to (-1 on CPU)
    marks: tuple[tuple[str, float, float], ...] = ()


@dataclass(frozen=True)
class GenStepRequest:
    """One rank's share of one generation step. ``units``: (prefill, decode) units this step runs on every
    rank (the same on all ranks: a rank without rows of a unit joins it with an empty batch). ``after``: the
    step the driver launched just before this one (pipelined steps run in launch order on every rank).
    ``steps``: decode sub-steps (multi-step decode, every item a decode item): sub-step j feeds each
    sequence the token it sampled in sub-step j - 1; every rank runs the same number (SPMD)."""

    step_id: str
    generation: int
    items: tuple[WorkItem, ...]
    free: tuple[str, ...] = ()
    units: tuple[bool, bool] = (True, False)
    after: str | None = None
    steps: int = 1

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: a step runs at least one decode sub-step")

    def __reduce__(self):
        """A columnar wire form: every step sends one of these per rank, and pickling its work items one
        dataclass at a time cost ~10 us each (1.2 ms for a batch of 128 decode items; ~0.3 ms this way)."""
        items = self.items
        n = len(items)
        # start, token count, flags, seed, sample position, prompt length, suppress_until, logprobs (-1: none),
        # suppressed id count
        ints = np.zeros((9, n), dtype=np.int64)
        floats = np.zeros((5, n), dtype=np.float64)  # temperature, top_p, presence, frequency, repetition
        suppress: list[int] = []
        nbias = np.zeros(n, dtype=np.int64)  # logit bias pairs per item, then every item's ids and biases
        bias_ids: list[int] = []
        bias: list[float] = []
        for i, it in enumerate(items):
            sp = it.sample
            ints[0, i], ints[1, i] = it.start, len(it.tokens)
            ints[2, i] = (it.decode | (it.deferred << 1) | ((sp is not None) << 2) | (it.keep_tokens << 3)
                          | (it.expert_stats << 4))
            if sp is not None:
                ints[3, i], ints[4, i], ints[5, i], ints[6, i] = sp.seed, sp.position, sp.prompt_len, sp.suppress_until
                ints[7, i] = -1 if sp.logprobs is None else sp.logprobs
                ints[8, i] = len(sp.suppress)
                suppress.extend(sp.suppress)
                if sp.logit_bias:
                    nbias[i] = len(sp.logit_bias)
                    bias_ids.extend(t for t, _ in sp.logit_bias)
                    bias.extend(b for _, b in sp.logit_bias)
                floats[:, i] = (sp.temperature, sp.top_p, sp.presence_penalty, sp.frequency_penalty,
                                sp.repetition_penalty)
        tokens = np.fromiter(itertools.chain.from_iterable(it.tokens for it in items), dtype=np.int64,
                             count=int(ints[1].sum()))
        return (_request_from_wire, (self.step_id, self.generation, self.free, self.units, self.after, self.steps,
                                     [it.seq_id for it in items], ints.tobytes(), floats.tobytes(), tokens.tobytes(),
                                     np.asarray(suppress, dtype=np.int64).tobytes(), nbias.tobytes(),
                                     np.asarray(bias_ids, dtype=np.int64).tobytes(),
                                     np.asarray(bias, dtype=np.float64).tobytes()))


def _request_from_wire(step_id, generation, free, units, after, steps, ids, ints, floats, tokens,
                       suppress=b"", nbias=b"", bias_ids=b"", bias=b"") -> GenStepRequest:
    n = len(ids)
    start, count, flags, seed, pos, plen, until, lps, nsup = np.frombuffer(ints, dtype=np.int64).reshape(9, n).tolist()
    temp, top_p, pres, freq, rep = np.frombuffer(floats, dtype=np.float64).reshape(5, n).tolist()
    flat = np.frombuffer(tokens, dtype=np.int64).tolist()
    sup = np.frombuffer(suppress, dtype=np.int64).tolist()
    nb = np.frombuffer(nbias, dtype=np.int64).tolist() or [0] * n
    bid, bval = np.frombuffer(bias_ids, dtype=np.int64).tolist(), np.frombuffer(bias, dtype=np.float64).tolist()
    items, o, so, bo = [], 0, 0, 0
    for i, sid in enumerate(ids):
        f, c = flags[i], count[i]
        sample = None
        if f & 4:
            sample = SampleSpec(temp[i], top_p[i], seed[i], pos[i], pres[i], freq[i], rep[i], plen[i],
                                tuple(sup[so:so + nsup[i]]), until[i], None if lps[i] < 0 else lps[i],
                                tuple(zip(bid[bo:bo + nb[i]], bval[bo:bo + nb[i]])))
            so += nsup[i]
            bo += nb[i]
        items.append(WorkItem(sid, tuple(flat[o:o + c]), start[i], sample, bool(f & 1), bool(f & 2), bool(f & 8),
                              bool(f & 16)))
        o += c
    return GenStepRequest(step_id, generation, tuple(items), free, units, after, steps)


@dataclass(frozen=True)
class GenStepResult:
    """tokens: {sequence id: its sampled tokens in position order} for the chunks that asked for a sample (one
    token; ``steps`` of them for a multi-step decode request). logprobs: {sequence id: one ``TokenLogprobs`` per
    token in ``tokens``} for the sequences whose spec asked (raw logprobs: ``model.sampling``). layers: every
    layer's statistics, summed over the sub-steps. elapsed_s: the step on the
    shard; queued_s: from the actor call's arrival to the step's start (launch order, the step thread, the
    generation pin), so a driver's wait minus both is the Ray transport and (de)serialisation. device_s: the
    step's time on the device (CUDA events around its work; 0 on CPU); idle_s: how long the device sat idle
    between the previous step's end and this step's start (the host did not keep it fed). actor_s: the actor
    call on the shard, arrival to return (a driver's round trip minus it is Ray's transport)."""

    rank: int
    step_id: str
    generation: int
    tokens: dict[str, tuple[int, ...]]
    layers: tuple[LayerStats, ...]
    elapsed_s: float
    decode_path: str | None = None
    fallback_reason: str | None = None
    queued_s: float = 0.0
    device_s: float = 0.0
    idle_s: float = 0.0
    actor_s: float = 0.0
    logprobs: dict[str, tuple[TokenLogprobs, ...]] = dataclasses.field(default_factory=dict)
    expert_counts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # prefix caching (``shard/prefix.py``): {sequence id: its prefill chunk's tokens served from cached KV
    # blocks} (sequences with a hit only), and the step's prefill tokens on this rank (0 with it off)
    cached_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    prefix_lookup_tokens: int = 0

    def __reduce__(self):
        """The tokens as one int64 block when every sequence has as many (they do: one per sub-step)."""
        widths = {len(v) for v in self.tokens.values()}
        fields = [getattr(self, f.name) for f in dataclasses.fields(self)]
        if len(widths) == 1:
            ids = list(self.tokens)
            block = np.asarray(list(self.tokens.values()), dtype=np.int64)
            return (_result_from_wire, (ids, block.tobytes(), widths.pop(), *fields[:3], *fields[4:]))
        return (GenStepResult, tuple(fields))


def _result_from_wire(ids, block, width, *fields) -> GenStepResult:
    rows = np.frombuffer(block, dtype=np.int64).reshape(len(ids), width).tolist()
    return GenStepResult(*fields[:3], dict(zip(ids, map(tuple, rows))), *fields[3:])


__all__ = ["WorkItem", "StepRequest", "StepResult", "GenStepRequest", "GenStepResult"]
