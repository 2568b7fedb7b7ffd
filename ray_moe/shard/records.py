"""The records that cross the actor boundary between the driver and one shard (one per rank per step), with
their compact wire forms. Light on purpose: numpy, the sampling spec and the layer statistics, no torch
kernels, no dispatchers (the driver imports this module).

    StepRequest / StepResult   one step of either kind: the fields every step has, and the payload of its kind
                               (``input`` / ``output``); the request declares its ``StepKind`` and the rank
                               runs the front the kind names (never the payload's type or shape)
    StepKind                   EXPERT_ONLY: hidden states in, out (``rt.forward``); GENERATION: token ids and
                               positions in, sampled ids out
    ExpertOnlyInput / ExpertOnlyOutput   the expert-only payloads (hidden states as NumPy wire pairs)
    GenerationInput / GenerationOutput   the generation payloads (a columnar wire form / tokens in one block)
    WorkItem                   one sequence's share of a generation step on its rank
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import numpy as np

from ray_moe.core.errors import RequestError
from ray_moe.core.types import Phase
from ray_moe.core.wire import IntColumn, pack_ints, unpack_ints
from ray_moe.model.sampling import SampleSpec, TokenLogprobs
from ray_moe.moe.stats import LayerStats, pack_layers, unpack_layers


class StepKind(str, Enum):
    """What a step runs (SGLang's ``ForwardMode``): a request declares it, its payload's class declares it too,
    and the rank runs the front it names (``ShardCore.step``).

    EXPERT_ONLY: hidden states through the MoE layers, with given routes or the rank's router (``rt.forward``)
    GENERATION:  the hosted model's step over work items: token ids and positions in, sampled token ids out
    """

    EXPERT_ONLY = "expert_only"
    GENERATION = "generation"


@dataclass(frozen=True)
class WorkItem:
    """One sequence's share of one step on its rank: ``tokens`` at positions ``start..``; the next token is
    sampled when ``sample`` (the chunk reaches the end of what is known). ``decode``: a one-token step of a
    sequence that already has a cache (the decode phase, spec 0x05E). ``deferred``: a decode step planned
    while the step that samples its input token is still in flight; ``tokens`` is empty and the rank feeds
    the token it sampled for this sequence at position ``start`` (the driver never waits for it).
    ``keep_tokens``: the rank keeps this sequence's token ids by position (its penalties read them); set on
    every item of a penalized sequence, so the rank holds all of them. ``expert_stats``: the rank counts the
    experts this item's rows were routed to, per MoE layer (``GenerationOutput.expert_counts``)."""

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

    # built directly (``dataclasses.replace`` costs twice as much, and these run per item per (sub-)step)
    def resolved(self, token: int) -> "WorkItem":
        """This deferred item fed ``token`` (its input token, no longer deferred)."""
        return WorkItem(self.seq_id, (token,), self.start, self.sample, self.decode, False, self.keep_tokens,
                        self.expert_stats)

    def substep(self, j: int) -> "WorkItem":
        """Sub-step ``j`` >= 1 of this sampled decode item in a multi-step request: deferred on the token sampled
        at ``start + j`` (no tokens), its sample ``j`` positions on."""
        return WorkItem(self.seq_id, (), self.start + j, self.sample.at(self.sample.position + j), True, True,
                        self.keep_tokens, self.expert_stats)


@dataclass(frozen=True)
class StepRequest:
    """One rank's share of one step (all layers), of the declared ``kind``: ``input`` is that kind's payload.
    ``after``: the step the driver launched just before this one (steps run in launch order on every rank).
    A request whose kind is not a ``StepKind``, or whose input declares another kind, is refused when it is
    built, when it arrives (its wire form is rebuilt through the constructor) and by the rank before anything
    runs (``check``)."""

    step_id: str
    generation: int
    kind: StepKind
    input: ExpertOnlyInput | GenerationInput
    after: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", self.check())

    def check(self) -> StepKind:
        """The declared kind; ``RequestError`` (a ``ValueError``) naming ``kind`` or ``input`` otherwise."""
        try:
            kind = StepKind(self.kind)
        except ValueError:
            raise RequestError(f"step {self.step_id!r}: kind={self.kind!r} is not a step kind (one of "
                               f"{[k.value for k in StepKind]})") from None
        declared = getattr(type(self.input), "kind", None)
        if declared is not kind:
            raise RequestError(f"step {self.step_id!r}: kind={kind.value!r} but input is a "
                               f"{type(self.input).__name__} (kind {getattr(declared, 'value', declared)!r})")
        return kind

    def revised(self, *, step_id: str | None = None, **changes: Any) -> StepRequest:
        """This request with another step id and / or ``changes`` to its input's fields."""
        return dataclasses.replace(self, step_id=self.step_id if step_id is None else step_id,
                                   input=dataclasses.replace(self.input, **changes) if changes else self.input)

    def __reduce__(self):
        return (StepRequest, (self.step_id, self.generation, self.kind, self.input, self.after))


@dataclass(frozen=True)
class StepResult:
    """One rank's output of one step: the fields every step has and ``output``, the payload of the request's
    kind. layers: every MoE layer's statistics (a multi-step request's summed over its sub-steps).
    elapsed_s: the step on the shard; queued_s: from the actor call's arrival to the step's start (launch
    order, the step thread or lock, the generation pin), so a driver's wait minus both is the Ray transport
    and (de)serialisation. device_s: the step's time on the device (CUDA events around its work; 0 on CPU);
    idle_s: how long the device sat idle between the previous step's end and this step's start (the host did
    not keep it fed). host_s: the shard's host wall time in the step's launch (planning, staging, issuing or
    replaying the kernels, a capture) and in its completion once the device finished it (reading tokens and
    statistics); the wait between is not in it, but blocking inside the launch is (a full kernel queue, an
    eager step reading its tokens), so it bounds the host work from above (0 where not measured). replay_s: the
    part of ``host_s`` inside captured-graph replays (copying the inputs into the graph's buffers and launching
    it; the launch blocks while the device's kernel queue is full, so this is mostly waiting for the device):
    ``host_s - replay_s`` is the step's host work outside them (planning, staging, sampling, completion).
    host_cpu_s: the launching thread's CPU time over the same spans as ``host_s`` (``time.thread_time``: neither a
    wait on the GIL nor a blocking wait that sleeps is in it; a spinning CUDA wait is).
    actor_s: the call on the shard, arrival to return (a driver's round trip minus it is Ray's transport).
    active_generation: the rank's ACTIVE generation when the step ended."""

    rank: int
    step_id: str
    generation: int
    output: ExpertOnlyOutput | GenerationOutput
    layers: tuple[LayerStats, ...]
    elapsed_s: float
    active_generation: int | None = None
    queued_s: float = 0.0
    device_s: float = 0.0
    idle_s: float = 0.0
    actor_s: float = 0.0
    host_s: float = 0.0
    replay_s: float = 0.0
    host_cpu_s: float = 0.0

    @property
    def kind(self) -> StepKind:
        return self.output.kind

    def __reduce__(self):
        """The layers as one columnar block (``moe.stats.pack_layers``): every step returns one result per rank."""
        fields = list(_values(self))
        fields[4] = pack_layers(fields[4])
        return (_result_from_wire, tuple(fields))


@dataclass(frozen=True)
class ExpertOnlyInput:
    """The payload of an expert-only step (``StepKind.EXPERT_ONLY``).

    hidden:       [T, d] float (NumPy wire pair on the wire, any float dtype)
    topk_ids:     [L, T, k] int64 or None (None: the rank routes with its own router)
    topk_weights: [L, T, k] float32 or None
    layers:       the MoE layers to run, in order (None: every layer)
    """

    kind: ClassVar[StepKind] = StepKind.EXPERT_ONLY

    hidden: Any
    topk_ids: Any = None
    topk_weights: Any = None
    phase: Phase = Phase.PREFILL
    return_routes: bool = False
    marks: bool = False  # record host timestamps of the step's stages (ExpertOnlyOutput.marks)
    layers: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ExpertOnlyOutput:
    """The payload of an expert-only step's result. ``hidden``: [T, d] NumPy in the configured dtype's wire form
    (a CUDA shard hands it over as an object-store ref); ``routes``: per layer (ids, weights) when asked."""

    kind: ClassVar[StepKind] = StepKind.EXPERT_ONLY

    hidden: Any
    hidden_dtype: str
    routes: tuple[tuple[np.ndarray, np.ndarray], ...] | None
    # (stage, host seconds, device seconds) since the step started, when the request asked for marks: the
    # host clock where the host got to; on CUDA the device clock (events) where the device got to (-1 on CPU)
    marks: tuple[tuple[str, float, float], ...] = ()


def _result_from_wire(rank, step_id, generation, output, layers, *rest) -> "StepResult":
    return StepResult(rank, step_id, generation, output, unpack_layers(layers), *rest)


def _values(record: Any) -> tuple:
    return tuple(getattr(record, f.name) for f in dataclasses.fields(record))


@dataclass(frozen=True)
class GenerationInput:
    """The payload of one rank's share of one generation step (``StepKind.GENERATION``): its work items and the
    sequences it frees first. ``units``: (prefill, decode) units this step runs on every rank (the same on all
    ranks: a rank without rows of a unit joins it with an empty batch). ``steps``: decode sub-steps
    (multi-step decode, every item a decode item): sub-step j feeds each sequence the token it sampled in
    sub-step j - 1; every rank runs the same number (SPMD)."""

    kind: ClassVar[StepKind] = StepKind.GENERATION

    items: tuple[WorkItem, ...]
    free: tuple[str, ...] = ()
    units: tuple[bool, bool] = (True, False)
    steps: int = 1

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: a step runs at least one decode sub-step")

    def __reduce__(self):
        """A columnar wire form: every step sends one of these per rank, and pickling its work items one
        dataclass at a time cost ~10 us each (1.2 ms for a batch of 128 decode items; ~0.3 ms this way). Integer
        columns travel in the narrowest type that holds them (``core.wire.pack_ints``), the float columns as a
        table of their distinct rows (bit for bit) with an index per item: 1,000 decode items take ~47 KB, under
        Ray's 100 KB limit for arguments passed inline (a larger one goes through the object store: ~1 ms more per
        call, measured)."""
        items = self.items
        n = len(items)
        # start, token count, flags, seed, sample position, prompt length, suppress_until, logprobs (-1: none),
        # suppressed id count
        ints = np.zeros((9, n), dtype=np.int64)
        floats = np.zeros((n, 5), dtype=np.float64)  # temperature, top_p, presence, frequency, repetition
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
                floats[i] = (sp.temperature, sp.top_p, sp.presence_penalty, sp.frequency_penalty,
                             sp.repetition_penalty)
        tokens = np.fromiter(itertools.chain.from_iterable(it.tokens for it in items), dtype=np.int64,
                             count=int(ints[1].sum()))
        return (_input_from_wire, (self.free, self.units, self.steps, [it.seq_id for it in items],
                                   tuple(pack_ints(row) for row in ints), _pack_rows(floats), pack_ints(tokens),
                                   pack_ints(np.asarray(suppress, dtype=np.int64)), pack_ints(nbias),
                                   pack_ints(np.asarray(bias_ids, dtype=np.int64)),
                                   np.asarray(bias, dtype=np.float64).tobytes()))


def _unpack_ints(col: IntColumn) -> list[int]:
    """``unpack_ints`` as Python ints, read straight from the bytes (no int64 copy first)."""
    return np.frombuffer(col[1], dtype=col[0]).tolist()


def _pack_rows(a: np.ndarray) -> tuple[bytes, IntColumn, int]:
    """[n, k] float64 -> (its distinct rows [u, k] as bytes, each row's index in them, k): rows compared bit for bit
    (a void view: -0.0 stays -0.0)."""
    n, k = a.shape
    if n == 0:
        return b"", pack_ints(np.zeros(0, dtype=np.int64)), k
    keys = np.ascontiguousarray(a).view(np.dtype((np.void, 8 * k))).reshape(n)
    table, index = np.unique(keys, return_inverse=True)
    return table.tobytes(), pack_ints(index.reshape(n).astype(np.int64)), k


def _unpack_rows(packed: tuple[bytes, IntColumn, int]) -> list[list[float]]:
    """``_pack_rows``' inverse: the columns [k][n] as lists."""
    table, index, k = packed
    idx = unpack_ints(index)
    if idx.size == 0:
        return [[] for _ in range(k)]
    return np.frombuffer(table, dtype=np.float64).reshape(-1, k)[idx].T.tolist()


def _input_from_wire(free, units, steps, ids, ints, floats, tokens, suppress, nbias, bias_ids,
                     bias) -> GenerationInput:
    n = len(ids)
    start, count, flags, seed, pos, plen, until, lps, nsup = (_unpack_ints(row) for row in ints)
    temp, top_p, pres, freq, rep = _unpack_rows(floats)
    flat = _unpack_ints(tokens)
    sup = _unpack_ints(suppress)
    nb = _unpack_ints(nbias) or [0] * n
    bid, bval = _unpack_ints(bias_ids), np.frombuffer(bias, dtype=np.float64).tolist()
    items, o, so, bo = [], 0, 0, 0
    for i, sid in enumerate(ids):
        f, c = flags[i], count[i]
        sample = None
        if f & 4:
            k, m = nsup[i], nb[i]  # (most items suppress nothing and bias nothing: no slices built for them)
            sample = SampleSpec(temp[i], top_p[i], seed[i], pos[i], pres[i], freq[i], rep[i], plen[i],
                                tuple(sup[so:so + k]) if k else (), until[i], None if lps[i] < 0 else lps[i],
                                tuple(zip(bid[bo:bo + m], bval[bo:bo + m])) if m else ())
            so += k
            bo += m
        items.append(WorkItem(sid, tuple(flat[o:o + c]) if c else (), start[i], sample, f & 1 == 1, f & 2 == 2,
                              f & 8 == 8, f & 16 == 16))
        o += c
    return GenerationInput(tuple(items), free, units, steps)


@dataclass(frozen=True)
class GenerationOutput:
    """The payload of a generation step's result. tokens: {sequence id: its sampled tokens in position order}
    for the chunks that asked for a sample (one token; ``steps`` of them for a multi-step decode request).
    decode_path / fallback_reason: the decode unit's path ("bucket" / "variable"; None without one) and why it
    fell back. logprobs: {sequence id: one ``TokenLogprobs`` per token in ``tokens``} for the sequences whose
    spec asked (raw logprobs: ``model.sampling``). expert_counts: {sequence id: [layers, experts] int32} for
    the items marked ``expert_stats``."""

    kind: ClassVar[StepKind] = StepKind.GENERATION

    tokens: dict[str, tuple[int, ...]]
    decode_path: str | None = None
    fallback_reason: str | None = None
    logprobs: dict[str, tuple[TokenLogprobs, ...]] = dataclasses.field(default_factory=dict)
    expert_counts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # prefix caching (``shard/prefix.py``): {sequence id: its prefill chunk's tokens served from cached KV
    # blocks} (sequences with a hit only), and the step's prefill tokens on this rank (0 with it off)
    cached_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    prefix_lookup_tokens: int = 0

    def __reduce__(self):
        """The tokens as one int64 block when every sequence has as many (they do: one per sub-step)."""
        widths = {len(v) for v in self.tokens.values()}
        fields = _values(self)
        if len(widths) == 1:
            ids = list(self.tokens)
            block = np.asarray(list(self.tokens.values()), dtype=np.int64)
            return (_output_from_wire, (ids, block.tobytes(), widths.pop(), *fields[1:]))
        return (GenerationOutput, fields)


def _output_from_wire(ids, block, width, *fields) -> GenerationOutput:
    rows = np.frombuffer(block, dtype=np.int64).reshape(len(ids), width).tolist()
    return GenerationOutput(dict(zip(ids, map(tuple, rows))), *fields)


__all__ = ["StepKind", "StepRequest", "StepResult", "ExpertOnlyInput", "ExpertOnlyOutput", "GenerationInput",
           "GenerationOutput", "WorkItem"]
