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


class CapturedStep:
    """One decode step captured as a CUDA graph: stable input buffers, the graph, its outputs, and the step
    context whose device-side statistics the graph overwrites on every replay."""

    def __init__(self, inputs: dict[str, torch.Tensor]) -> None:
        self.inputs = inputs
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
        self.graph = g
        return g.pool()

    def replay(self, staged: dict[str, torch.Tensor]) -> tuple[Any, Any]:
        """``staged``: this step's inputs, already padded to the bucket (same shapes as the stable ones)."""
        for name, t in staged.items():
            self.inputs[name].copy_(t)
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

    def covering(self, generation: int, key: tuple, slot: int) -> tuple | None:
        """The captured key of ``generation`` equal to ``key`` but at position ``slot``, where its value is the
        smallest one >= key's: an upper bound baked into a graph (a kernel's grid bound), so a step of ``key``
        runs in that graph unchanged. None: no such graph."""
        fits = [k for g, k in self._graphs if g == generation and isinstance(k, tuple) and len(k) == len(key)
                and k[slot] >= key[slot] and k[:slot] == key[:slot] and k[slot + 1:] == key[slot + 1:]]
        return min(fits, key=lambda k: k[slot]) if fits else None

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


__all__ = ["DecodeRecord", "DecodeDecision", "decide", "decode_round", "agree_overflow", "generation_digest",
           "bucket_key_digest", "CapturedStep", "StepGraphs", "DECODE_FIELDS", "KEY_FIELD", "DECODE_TAG"]
