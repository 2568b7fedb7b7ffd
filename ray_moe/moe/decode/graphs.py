# ======================================================================================================
#  A DECODE STEP (one rank, every MoE layer; pure: no Ray)
#
#   step start: ONE control round ── (generation, epoch, generation digest, status, tokens, bucket key,
#               graph state) from every rank ── every rank decides alike (spec 0x05D order):
#                 stale / bad input / other generation  -> abort every rank before any payload
#                 graph key differs                      -> the variable path for the whole step
#                 tokens > C_T on some rank              -> the variable path for the whole step
#                 otherwise                              -> the bucket path for every layer
#   layers:     bucket dispatch/experts/combine with fixed shapes; the slot-capacity clause is evaluated
#               on the device (an overflow flag per layer, no host sync); on CUDA the whole step is one
#               graph per (generation, bucket), captured once and replayed
#   step end:   the overflow flags are agreed with the output's host copy; any overflow -> the step is
#               rerun on the variable path (``expert_route_capacity_exceeded``): a route is never clipped
# ======================================================================================================
"""Step-level decode admission and CUDA-graph capture of whole decode steps."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ray_moe.moe.dispatch.bucket import bucket_for, token_buckets
from ray_moe.moe.dispatch.protocol import ControlStatus
from ray_moe.core.errors import CountAgreementError, StaleGenerationError
from ray_moe.moe.decode.admission import FallbackReason
from ray_moe.moe.decode.shapes import GraphKey
from ray_moe.placement.snapshot import PlacementSnapshot

DECODE_FIELDS = ("generation", "pg_epoch", "gen_digest", "status", "tokens", "key_digest", "graph_ready")
KEY_FIELD = DECODE_FIELDS.index("key_digest")
DECODE_TAG = "decode-ctl"


@dataclass(frozen=True)
class DecodeRecord:
    """One rank's contribution to a decode step's control round (int64 vector in ``DECODE_FIELDS`` order).

    gen_digest: digest of every layer's map digest of the pinned generation
    key_digest: digest of the bucket's graph keys (every layer); a rank with another key refuses replay
    graph_ready: bit i set when this rank holds a captured graph of the step for token bucket i
    """

    generation: int
    pg_epoch: int
    gen_digest: int
    status: ControlStatus
    tokens: int
    key_digest: int
    graph_ready: int

    def to_array(self) -> np.ndarray:
        return np.asarray([int(getattr(self, f)) for f in DECODE_FIELDS], dtype=np.int64)

    @staticmethod
    def from_array(a: np.ndarray) -> "DecodeRecord":
        v = {f: int(x) for f, x in zip(DECODE_FIELDS, a)}
        v["status"] = ControlStatus(v["status"])
        return DecodeRecord(**v)


@dataclass(frozen=True)
class DecodeDecision:
    """The agreed outcome of a decode step's control round (identical on every rank).

    reason: None -> the bucket path; else why the step takes the variable path
    cap:    the token bucket of the step (the smallest that holds the largest rank's tokens)
    replay: every rank holds the step's captured graph for ``cap`` (else the bucket step runs eagerly and
            ranks without a graph capture one afterwards)
    """

    reason: FallbackReason | None
    replay: bool
    rank_tokens: tuple[int, ...]
    cap: int = 0


def decide(records: list[DecodeRecord], group_ranks: tuple[int, ...], token_cap: int, tag: str) -> DecodeDecision:
    """Protocol checks first (every rank aborts together), then the admission clauses in 0x05D order."""
    stale = [group_ranks[i] for i, r in enumerate(records) if r.status == ControlStatus.STALE_GENERATION]
    if stale:
        raise StaleGenerationError(
            f"{tag}: rank(s) {stale} refused generation(s) {sorted({r.generation for r in records})} for new "
            f"dispatch; decode step aborted on every rank before payload exchange", requested=records[0].generation)
    bad = [(group_ranks[i], r.status.name) for i, r in enumerate(records) if r.status != ControlStatus.OK]
    if bad:
        raise CountAgreementError(f"{tag}: rank(s) {bad} aborted the decode step before payload exchange")
    first = records[0]
    for i, r in enumerate(records):
        for name in ("generation", "pg_epoch", "gen_digest"):
            if getattr(r, name) != getattr(first, name):
                raise CountAgreementError(f"{tag}: rank {group_ranks[i]} planned decode with {name}="
                                          f"{getattr(r, name)} but rank {group_ranks[0]} with {getattr(first, name)}; "
                                          f"aborted before payload exchange")
    tokens = tuple(r.tokens for r in records)
    reason = None
    if any(r.key_digest != first.key_digest for r in records):
        reason = FallbackReason.GRAPH_KEY_MISMATCH
    elif max(tokens) > token_cap:
        reason = FallbackReason.RANK_TOKEN_CAPACITY_EXCEEDED
    if reason is not None:
        return DecodeDecision(reason, False, tokens, 0)
    caps = token_buckets(token_cap)
    cap = bucket_for(max(max(tokens), 1), token_cap)
    bit = 1 << caps.index(cap)
    return DecodeDecision(None, all(r.graph_ready & bit for r in records), tokens, cap)


def decode_round(exchange, record: DecodeRecord, token_cap: int, tag: str, *,
                 local_error: Exception | None = None) -> DecodeDecision:
    """All-gather the decode records and decide (a rank that refused its own input re-raises its error)."""
    rows = exchange.all_gather(f"{tag}/{DECODE_TAG}", record.to_array())
    try:
        return decide([DecodeRecord.from_array(r) for r in rows], tuple(exchange.group.peer_order), token_cap, tag)
    except (StaleGenerationError, CountAgreementError):
        if local_error is not None:
            raise local_error from None
        raise


def agree_overflow(exchange, overflow: bool, tag: str) -> bool:
    """Step end: whether any rank's bucket overflowed (every rank then reruns the step)."""
    if exchange.size == 1:
        return overflow
    rows = exchange.all_gather(f"{tag}/decode-end", np.asarray([int(overflow)], dtype=np.int64))
    return bool(np.asarray(rows).any())


def digest64(*parts: Any) -> int:
    """A 56-bit digest of ``repr(parts)`` (fits an int64 control field)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


def generation_digest(snapshots: tuple[PlacementSnapshot, ...]) -> int:
    return digest64(tuple(s.map_digest for s in snapshots))


def bucket_key_digest(snapshots: tuple[PlacementSnapshot, ...], *, hidden_size: int, top_k: int,
                      dtype: torch.dtype, dispatch_backend: Any, runner_backend: Any, token_cap: int,
                      slot_cap_of: Callable[[PlacementSnapshot], int]) -> int:
    """Digest of the immutable graph keys (spec 0x05C) of every layer of one decode bucket."""
    keys = [GraphKey.for_snapshot(s, hidden_size=hidden_size, top_k=top_k, activation_dtype=dtype,
                                  gate_dtype=torch.float32, dispatch_backend=dispatch_backend,
                                  runner_backend=runner_backend, rank_token_capacities=[token_cap] * s.num_ranks,
                                  slot_route_capacities=[slot_cap_of(s)] * s.num_slots) for s in snapshots]
    return digest64(tuple(keys))


def weak(t: Any) -> Any:
    """A tensor over ``t``'s memory that does not own it (the allocator may hand that memory to a later
    capture of the same pool); other values as they are; tuples and lists element-wise. For a captured step's
    outputs that are consumed on the stream before any other graph replays."""
    if isinstance(t, (tuple, list)):
        return type(t)(weak(x) for x in t)
    if not isinstance(t, torch.Tensor):
        return t
    st = t.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


def copy_inputs(inputs: dict[str, torch.Tensor], staged: dict[str, torch.Tensor]) -> None:
    """A step's tensors into a captured step's static inputs of the same names: equal shapes, or a shorter 1-D
    tensor into the prefix of its input (a slot vector whose tail no kernel reads)."""
    for name, t in staged.items():
        dst = inputs[name]
        if t.shape == dst.shape:
            dst.copy_(t)
        elif t.dim() == 1 and dst.dim() == 1 and t.shape[0] <= dst.shape[0]:
            dst[: t.shape[0]].copy_(t)
        else:
            raise ValueError(f"{name}: a step's {tuple(t.shape)} does not fit the captured {tuple(dst.shape)}")


class CapturedStep:
    """One step captured as a CUDA graph: stable input buffers, the graph, its outputs, and the step context
    whose device-side statistics the graph overwrites on every replay. ``weak_outputs``: the outputs do not
    hold their memory (every replay's outputs are consumed on the stream before any other graph of the pool
    replays: the generation steps sample right behind their replay), so the pool's memory is shared."""

    def __init__(self, inputs: dict[str, torch.Tensor], weak_outputs: bool = False) -> None:
        self.inputs = inputs
        self.weak_outputs = weak_outputs
        self.graph: Any = None
        self.output: Any = None
        self.context: Any = None

    def capture(self, body: Callable[[dict[str, torch.Tensor]], tuple[Any, Any]], pool: Any = None) -> Any:
        """``body(inputs) -> (output, context)``; recorded (nothing executes, no collective runs) after the
        caller ran the same step eagerly on every rank (the warm-up). ``pool``: a graph memory pool shared with
        the other captured steps (None: a new one): steps replay one at a time on one stream and each step's
        outputs are consumed (sampled, copied out) before the next replay, so their intermediates can share
        memory. Returns the pool this capture used (pass it to the next capture)."""
        g = torch.cuda.CUDAGraph()
        # thread_local: control-path threads of the actor (digests, weight copies) may touch CUDA meanwhile
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            self.output, self.context = body(self.inputs)
        if self.weak_outputs:
            self.output = weak(self.output)
        self.graph = g
        return g.pool()

    def replay(self, staged: dict[str, torch.Tensor]) -> tuple[Any, Any]:
        """``staged``: this step's inputs, padded to the captured shapes (a shorter 1-D one fills a prefix)."""
        copy_inputs(self.inputs, staged)
        self.graph.replay()
        return self.output, self.context


def capture_failure(exc: BaseException) -> str:
    """A failed capture in one line with where it happened (the innermost frames), for a shard's status."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(exc).__name__}: {exc} [at {where}]"


class StepGraphs:
    """Captured decode steps by (generation, bucket key); a generation's graphs go at its retirement."""

    def __init__(self) -> None:
        self._graphs: dict[tuple[int, Any], CapturedStep] = {}

    def get(self, generation: int, key: Any) -> CapturedStep | None:
        return self._graphs.get((generation, key))

    def ready_mask(self, generation: int, key: Any, caps: tuple[int, ...]) -> int:
        """Bit i set when a step of ``key + (caps[i],)`` is captured for ``generation``."""
        return sum(1 << i for i, c in enumerate(caps) if (generation, (*key, c)) in self._graphs)

    def put(self, generation: int, key: Any, step: CapturedStep) -> None:
        self._graphs[(generation, key)] = step

    def count(self, generation: int, kind: Any) -> int:
        """Captured steps of ``generation`` whose key starts with ``kind``."""
        return sum(1 for g, k in self._graphs if g == generation and isinstance(k, tuple) and k and k[0] == kind)

    def release(self, generation: int) -> int:
        keys = [k for k in self._graphs if k[0] == generation]
        for k in keys:
            del self._graphs[k]
        return len(keys)

    def __len__(self) -> int:
        return len(self._graphs)


__all__ = ["weak", "copy_inputs", "DecodeRecord", "DecodeDecision", "decide", "decode_round", "agree_overflow", "generation_digest",
           "bucket_key_digest", "CapturedStep", "StepGraphs", "DECODE_FIELDS", "KEY_FIELD", "DECODE_TAG"]
