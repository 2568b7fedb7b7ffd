"""Decode-graph admission: an exact predicate, evaluated in a fixed order (spec 0x05D, 0x05F). Pure: no Ray.

    1. phase_not_decode                 the unit is not a decode unit
    2. graph_key_mismatch               any field of K differs (placement generation included)
    3. rank_token_capacity_exceeded     some T_u > C_T[u]
    4. expert_route_capacity_exceeded   some n_q > C_q
    5. stable_buffer_unavailable        a stable buffer is missing or was re-addressed
    otherwise Replay(graph_id)

The predicate is a performance-path decision, never permission to alter semantics: a refused step runs
the uncaptured variable path with every input row and every route unchanged (its analytical model is
``ray_moe_dev.analysis.execution_ledger.FallbackPlan``).
Every rank must evaluate it on the same agreed counts, so all ranks take the same path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction

from ray_moe.moe.decode.shapes import DecodeBucket, GraphKey, RowCounts, StableBuffers, check_counts, check_row_counts
from ray_moe.core.types import Phase


class FallbackReason(str, Enum):
    """Why a step may not replay a captured decode graph, in predicate order (spec 0x05D)."""

    PHASE_NOT_DECODE = "phase_not_decode"
    GRAPH_KEY_MISMATCH = "graph_key_mismatch"
    RANK_TOKEN_CAPACITY_EXCEEDED = "rank_token_capacity_exceeded"
    EXPERT_ROUTE_CAPACITY_EXCEEDED = "expert_route_capacity_exceeded"
    STABLE_BUFFER_UNAVAILABLE = "stable_buffer_unavailable"


@dataclass(frozen=True)
class AdmissionStep(RowCounts):
    """What admission inspects about one execution unit.

    phase:       the unit's phase
    key:         the immutable key the step was planned under (current G+epoch, v, c, dtypes, backends, caps)
    rank_tokens: [P] current rows per rank (T_u, *not* cached context length)
    slot_routes: [Q] accepted routes per physical slot (n_q); sum n_q = k * sum T_u
    """

    phase: Phase
    key: GraphKey
    rank_tokens: tuple[int, ...]
    slot_routes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))
        t = check_counts("rank_tokens", self.rank_tokens)
        n = check_counts("slot_routes", self.slot_routes)
        if len(t) != self.key.num_ranks:
            raise ValueError(f"rank_tokens: {len(t)} entries, key has P={self.key.num_ranks} ranks")
        if len(n) != self.key.num_slots:
            raise ValueError(f"slot_routes: {len(n)} entries, key has Q={self.key.num_slots} slots")
        t, n = check_row_counts(t, n, self.key.top_k, "conservation, spec 0x05A")
        object.__setattr__(self, "rank_tokens", t)
        object.__setattr__(self, "slot_routes", n)


@dataclass(frozen=True)
class Replay:
    """Admitted: replay the captured graph ``graph_id`` after updating its valid state."""

    graph_id: str


@dataclass(frozen=True)
class Fallback:
    """Refused: run the uncaptured variable path with the current immutable plan."""

    reason: FallbackReason
    detail: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", FallbackReason(self.reason))


Admission = Replay | Fallback


def admit_decode_graph(step: AdmissionStep, graph: DecodeBucket, buffers: StableBuffers | None) -> Admission:
    """The exact predicate of spec 0x05D, in its order. ``buffers`` None means never allocated."""
    # 1. phase
    if step.phase != Phase.DECODE:
        return Fallback(FallbackReason.PHASE_NOT_DECODE, f"phase={step.phase.value}")
    # 2. immutable key
    if step.key != graph.key:
        return Fallback(FallbackReason.GRAPH_KEY_MISMATCH, f"fields differ: {list(step.key.diff(graph.key))}")
    # 3. rank token capacities
    for u, (t, cap) in enumerate(zip(step.rank_tokens, graph.key.rank_token_capacities)):
        if t > cap:
            return Fallback(FallbackReason.RANK_TOKEN_CAPACITY_EXCEEDED, f"rank {u}: {t} tokens > capacity {cap}")
    # 4. physical-slot route capacities
    for q, (n, cap) in enumerate(zip(step.slot_routes, graph.key.slot_route_capacities)):
        if n > cap:
            return Fallback(FallbackReason.EXPERT_ROUTE_CAPACITY_EXCEEDED, f"slot {q}: {n} routes > capacity {cap}")
    # 5. stable buffers at their captured addresses
    if buffers is None or not buffers.ready(graph):
        return Fallback(FallbackReason.STABLE_BUFFER_UNAVAILABLE, f"graph {graph.graph_id!r}")
    return Replay(graph.graph_id)


@dataclass
class AdmissionCounters:
    """Replay / fallback counts by reason, with numerators and denominators (one instance per graph
    owner; no module state)."""

    replays: int = 0
    fallbacks: dict[FallbackReason, int] = field(default_factory=lambda: {r: 0 for r in FallbackReason})

    def record(self, outcome: Admission) -> None:
        if isinstance(outcome, Replay):
            self.replays += 1
        elif isinstance(outcome, Fallback):
            self.fallbacks[outcome.reason] += 1
        else:
            raise ValueError(f"outcome={outcome!r}: expected Replay or Fallback")

    @property
    def steps(self) -> int:
        return self.replays + sum(self.fallbacks.values())

    def fallback_count(self, reason: FallbackReason | str | None = None) -> int:
        if reason is None:
            return sum(self.fallbacks.values())
        return self.fallbacks[FallbackReason(reason)]

    def fallback_ratio(self) -> tuple[int, int]:
        """(fallback steps, admission decisions): numerator and denominator, never a bare float."""
        return self.fallback_count(), self.steps

    def fallback_fraction(self) -> Fraction | None:
        num, den = self.fallback_ratio()
        return Fraction(num, den) if den else None

    def as_dict(self) -> dict[str, int]:
        out = {"replay": self.replays}
        out.update({r.value: c for r, c in self.fallbacks.items()})
        return out

