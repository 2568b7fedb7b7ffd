"""Phase-aware execution units (spec 0x05A, 0x05B, 0x05E, 0x05F). Pure: no Ray.

A ``PhaseProfile`` is the row shape of one workload: current rows per rank (T_u) and accepted routes per
physical slot (n_q), with sum_q n_q = k * sum_u T_u. A mixed outer batch is *split before dispatch* into a
prefill unit and a decode unit that keep each row's phase provenance and original row index, so outputs
scatter back to the outer batch exactly (0x05E). Each unit is then planned:

    prefill unit  -> variable dispatch + grouped runner (no padding)
    decode unit   -> admission predicate (0x05D) -> graph replay (bucket ledger) or variable fallback

Ledgers here are analytical (rows and logical units, never time).

Control items (spec 0x05B/0x05C: 34 for the prefill fixture, 12 for decode) are a *declared* teaching
schema: the spec names its ingredients (count cells, slot coordinates, prefix/dispatch decisions) but not
a rule that yields 34 and 12, so a profile carries them as a declared input (``control_items``), never a
derived value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ray_moe_dev.analysis.execution_ledger import (
    ExecutionLedger,
    ExecutionPath,
    fallback_plan,
    replay_ledger,
    variable_path_ledger,
)
from ray_moe.moe.decode.admission import Admission, AdmissionStep, Fallback, admit_decode_graph
from ray_moe.moe.decode.shapes import DecodeBucket, GraphKey, RowCounts, StableBuffers, check_row_counts
from ray_moe.core.types import Phase


@dataclass(frozen=True)
class PhaseProfile(RowCounts):
    """Row shape of one workload (spec 0x05A).

    phase:         PREFILL or DECODE; None for a mixed outer batch (must be split before execution)
    rank_tokens:   [P] current input rows per rank (T_u)
    slot_routes:   [Q] accepted routes per physical slot (n_q)
    top_k:         k
    control_items: declared teaching control-ledger value, or None
    """

    name: str
    phase: Phase | None
    rank_tokens: tuple[int, ...]
    slot_routes: tuple[int, ...]
    top_k: int = 2
    control_items: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError(f"name={self.name!r}: must be non-empty")
        if self.phase is not None:
            object.__setattr__(self, "phase", Phase(self.phase))
        if self.top_k < 1:
            raise ValueError(f"top_k={self.top_k}: must be >= 1")
        if self.control_items is not None and self.control_items < 0:
            raise ValueError(f"control_items={self.control_items}: must be >= 0")
        t, n = check_row_counts(self.rank_tokens, self.slot_routes, self.top_k, f"profile {self.name!r}")
        object.__setattr__(self, "rank_tokens", t)
        object.__setattr__(self, "slot_routes", n)


def variable_ledger(profile: PhaseProfile) -> ExecutionLedger:
    """Variable dispatch + grouped runner: executed = useful, one submission per SPMD stage (0x05B)."""
    return variable_path_ledger(profile, profile.control_items)


@dataclass(frozen=True)
class UnitPlan:
    """How one execution unit runs and what it executes. ``admission`` is None for a prefill unit."""

    profile: PhaseProfile
    path: ExecutionPath
    admission: Admission | None
    ledger: ExecutionLedger


def plan_unit(
    profile: PhaseProfile,
    bucket: DecodeBucket | None = None,
    step_key: GraphKey | None = None,
    buffers: StableBuffers | None = None,
) -> UnitPlan:
    """Plan one single-phase unit.

    1. a mixed profile is refused (split it first: ``split_mixed``)
    2. prefill -> variable path
    3. decode without a bucket -> variable path (no graph to admit against)
    4. decode -> admission predicate with ``step_key`` (defaults to the bucket's key); Replay -> the
       bucket's replay ledger; Fallback -> the variable path with rows and routes unchanged
    """
    # 1.
    if profile.phase is None:
        raise ValueError(f"profile={profile.name!r}: a mixed batch must be split into phase units before planning")
    # 2.
    if profile.phase == Phase.PREFILL:
        return UnitPlan(profile, ExecutionPath.VARIABLE, None, variable_ledger(profile))
    # 3.
    if bucket is None:
        return UnitPlan(profile, ExecutionPath.VARIABLE, None, variable_ledger(profile))
    # 4.
    key = step_key if step_key is not None else bucket.key
    if profile.top_k != key.top_k:
        raise ValueError(f"profile.top_k={profile.top_k} but step key top_k={key.top_k}")
    step = AdmissionStep(phase=profile.phase, key=key, rank_tokens=profile.rank_tokens, slot_routes=profile.slot_routes)
    outcome = admit_decode_graph(step, bucket, buffers)
    if isinstance(outcome, Fallback):
        ledger = fallback_plan(step, outcome).ledger(profile.control_items)
        return UnitPlan(profile, ExecutionPath.VARIABLE, outcome, ledger)
    ledger = replay_ledger(bucket, profile.rank_tokens, profile.slot_routes, profile.control_items)
    return UnitPlan(profile, ExecutionPath.GRAPH, outcome, ledger)


def aggregate_ledger(plans: Sequence[UnitPlan]) -> ExecutionLedger:
    """Sum of the unit ledgers (spec 0x05E aggregate accounting)."""
    if not plans:
        raise ValueError("plans: empty, expected at least one unit plan")
    total = plans[0].ledger
    for p in plans[1:]:
        total = total + p.ledger
    return total


# ---------------------------------------------------------------------------------------------------------
# Mixed batches: split with provenance, scatter back by original index (spec 0x05E)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LabeledRows:
    """One rank's rows of an outer batch with per-row phase provenance.

    hidden:       [T, d] float
    topk_ids:     [T, k] int64 logical experts
    topk_weights: [T, k] float32 gates
    decode_mask:  [T] bool  True for a decode row, False for a prefill row
    """

    rank: int
    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    decode_mask: torch.Tensor

    def __post_init__(self) -> None:
        t = self.hidden.shape[0] if self.hidden.dim() == 2 else -1
        if t < 0:
            raise ValueError(f"hidden: expected [T, d], got shape {tuple(self.hidden.shape)} (rank {self.rank})")
        if self.topk_ids.dim() != 2 or self.topk_ids.shape[0] != t:
            raise ValueError(f"topk_ids: shape {tuple(self.topk_ids.shape)}, expected [{t}, k] (rank {self.rank})")
        if tuple(self.topk_weights.shape) != tuple(self.topk_ids.shape):
            raise ValueError(
                f"topk_weights: shape {tuple(self.topk_weights.shape)} != topk_ids shape {tuple(self.topk_ids.shape)}"
            )
        if self.decode_mask.dtype != torch.bool or tuple(self.decode_mask.shape) != (t,):
            raise ValueError(
                f"decode_mask: expected [{t}] bool, got {tuple(self.decode_mask.shape)} {self.decode_mask.dtype}"
            )

    @staticmethod
    def from_labels(
        rank: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, labels: Sequence[Phase | str]
    ) -> "LabeledRows":
        """Build from per-row phase labels ('prefill' / 'decode')."""
        phases = [Phase(x) for x in labels]
        mask = torch.tensor([p == Phase.DECODE for p in phases], dtype=torch.bool, device=hidden.device)
        return LabeledRows(rank, hidden, topk_ids, topk_weights, mask.reshape(len(phases)))


@dataclass(frozen=True, eq=False)
class UnitRows:
    """One rank's share of a phase unit.

    hidden:         [T', d]
    topk_ids:       [T', k]
    topk_weights:   [T', k]
    original_index: [T'] int64 row index of each unit row in the rank's outer batch (increasing)
    """

    rank: int
    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    original_index: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.hidden.shape[0])


@dataclass(frozen=True, eq=False)
class PhaseUnit:
    """The rows of one phase from every rank, with provenance."""

    phase: Phase
    ranks: tuple[UnitRows, ...]

    @property
    def rank_tokens(self) -> tuple[int, ...]:
        return tuple(r.num_tokens for r in self.ranks)

    def profile(self, slot_routes: Sequence[int], *, name: str | None = None,
                control_items: int | None = None) -> PhaseProfile:
        """The unit's profile once replica selection fixed its slot counts n_q."""
        k = int(self.ranks[0].topk_ids.shape[1]) if self.ranks else 1
        return PhaseProfile(name=name or f"{self.phase.value}-unit", phase=self.phase,
                            rank_tokens=self.rank_tokens, slot_routes=tuple(slot_routes), top_k=k,
                            control_items=control_items)


@dataclass(frozen=True, eq=False)
class MixedSplit:
    """A mixed outer batch split into a prefill unit and a decode unit (spec 0x05E)."""

    prefill: PhaseUnit
    decode: PhaseUnit
    outer_rank_tokens: tuple[int, ...]

    @property
    def units(self) -> tuple[PhaseUnit, PhaseUnit]:
        return (self.prefill, self.decode)

    def scatter_back(self, prefill_out: Sequence[torch.Tensor], decode_out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-rank unit outputs ([T'_u, d] each) -> per-rank outer-batch outputs [T_u, d] in original order.

        1. check both units' outputs cover every rank with the unit's row count
        2. allocate [T_u, d] and write each unit's rows at their original indices
        """
        p = len(self.outer_rank_tokens)
        for name, outs, unit in (("prefill_out", prefill_out, self.prefill), ("decode_out", decode_out, self.decode)):
            if len(outs) != p:
                raise ValueError(f"{name}: {len(outs)} ranks given, the batch has {p}")
            for u, (o, rows) in enumerate(zip(outs, unit.ranks)):
                if o.dim() != 2 or o.shape[0] != rows.num_tokens:
                    raise ValueError(f"{name}[{u}]: shape {tuple(o.shape)}, expected [{rows.num_tokens}, d]")
        result = []
        for u in range(p):
            a, b = prefill_out[u], decode_out[u]
            d = int(a.shape[1])
            if int(b.shape[1]) != d:
                raise ValueError(f"decode_out[{u}]: width {b.shape[1]} != prefill_out[{u}] width {d}")
            out = torch.empty(self.outer_rank_tokens[u], d, dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
            out[self.prefill.ranks[u].original_index] = a.to(out.dtype)
            out[self.decode.ranks[u].original_index] = b.to(out.dtype)
            result.append(out)
        return result


def split_mixed(rows: Sequence[LabeledRows]) -> MixedSplit:
    """Partition a mixed outer batch into a prefill unit and a decode unit before dispatch.

    1. check ranks are given in order 0..P-1
    2. per rank, select prefill rows (mask False) and decode rows (mask True), stable, with their indices
    3. both units keep every rank (zero-row ranks included) so the process-group shape is unchanged
    """
    # 1.
    for i, r in enumerate(rows):
        if r.rank != i:
            raise ValueError(f"rows[{i}].rank={r.rank}: ranks must be given in order 0..{len(rows) - 1}")
    if not rows:
        raise ValueError("rows: empty, expected one LabeledRows per rank")
    pre, dec = [], []
    # 2.
    for r in rows:
        for sel, bucket in ((~r.decode_mask, pre), (r.decode_mask, dec)):
            idx = torch.nonzero(sel, as_tuple=False).flatten().to(torch.int64)
            bucket.append(UnitRows(rank=r.rank, hidden=r.hidden.index_select(0, idx),
                                   topk_ids=r.topk_ids.index_select(0, idx),
                                   topk_weights=r.topk_weights.index_select(0, idx), original_index=idx))
    # 3.
    return MixedSplit(prefill=PhaseUnit(Phase.PREFILL, tuple(pre)), decode=PhaseUnit(Phase.DECODE, tuple(dec)),
                      outer_rank_tokens=tuple(int(r.hidden.shape[0]) for r in rows))
