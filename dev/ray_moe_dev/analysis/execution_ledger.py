"""Analytical row / unit ledgers of the phase execution paths (spec 0x05B, 0x05C, 0x05E, 0x05F). Pure:
no Ray.

* the variable path (variable dispatch + grouped runner: executed rows = useful rows);
* a decode bucket's replay (every reserved token slot and runner row runs, valid or masked) and the
  reserved payload bytes of its five named buffers;
* the fallback of a refused step (``FallbackPlan``): its counts carried over unchanged, nothing clipped.

Rows are counted, not timed (``evidence = "analytical"``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from fractions import Fraction
from typing import Sequence

from ray_moe.moe.decode.admission import AdmissionStep, Fallback, FallbackReason
from ray_moe.moe.decode.shapes import BufferName, DecodeBucket, RowCounts, check_counts

# The execution paths' declared host-submission schema (spec 0x05B/0x05C count *logical* host
# submissions, never kernels or time). The variable path submits the seven SPMD stages of one step;
# a captured decode graph is one logical replay submission.
VARIABLE_PATH_STAGES: tuple[str, ...] = (
    "plan",
    "count_exchange",
    "payload_exchange",
    "repack",
    "grouped_experts",
    "return_exchange",
    "combine",
)
GRAPH_PATH_STAGES: tuple[str, ...] = ("graph_replay",)


class ExecutionPath(str, Enum):
    """How one execution unit runs: variable (uncaptured) dispatch + grouped runner, or graph replay."""

    VARIABLE = "variable"
    GRAPH = "graph"


@dataclass(frozen=True)
class ReservedBytesLedger:
    """Reserved payload bytes of the named stable buffers (spec 0x05C), analytical.

    Not total graph memory: excludes allocator overhead, expert weights, collective and kernel workspace,
    graph runtime objects and every buffer not named by the bucket.
    """

    by_buffer: tuple[tuple[BufferName, int], ...]
    evidence: str = "analytical"

    @property
    def total(self) -> int:
        return sum(b for _, b in self.by_buffer)


@dataclass(frozen=True)
class ExecutionLedger:
    """Analytical row / unit ledger of one or more execution units (spec 0x05B, 0x05C, 0x05E, 0x05F).

    Rows are counted, not timed: host submissions are *logical* host orchestration boundaries (not GPU
    launches) and control items are a declared teaching schema (not FLOPs, bytes or microseconds).
    ``control_items`` is None when no schema value was declared for some unit.
    """

    useful_input_rows: int
    executed_dispatch_slots: int
    useful_route_rows: int
    executed_runner_rows: int
    host_submissions: int
    phase_units: int = 1
    graph_units: int = 0
    control_items: int | None = None
    evidence: str = "analytical"

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"{f.name}={v}: must be >= 0")
        if self.executed_dispatch_slots < self.useful_input_rows:
            raise ValueError(
                f"executed_dispatch_slots={self.executed_dispatch_slots} < useful_input_rows={self.useful_input_rows}"
            )
        if self.executed_runner_rows < self.useful_route_rows:
            raise ValueError(
                f"executed_runner_rows={self.executed_runner_rows} < useful_route_rows={self.useful_route_rows}"
            )

    @property
    def dispatch_padding_slots(self) -> int:
        return self.executed_dispatch_slots - self.useful_input_rows

    @property
    def runner_padding_rows(self) -> int:
        return self.executed_runner_rows - self.useful_route_rows

    @property
    def control_items_per_route(self) -> Fraction | None:
        """C_control / R: amortisation of a fixed planning schema, not a latency (spec 0x05B)."""
        if self.control_items is None or self.useful_route_rows == 0:
            return None
        return Fraction(self.control_items, self.useful_route_rows)

    def __add__(self, other: "ExecutionLedger") -> "ExecutionLedger":
        if not isinstance(other, ExecutionLedger):
            return NotImplemented
        control = (
            None if self.control_items is None or other.control_items is None
            else self.control_items + other.control_items
        )
        return ExecutionLedger(
            useful_input_rows=self.useful_input_rows + other.useful_input_rows,
            executed_dispatch_slots=self.executed_dispatch_slots + other.executed_dispatch_slots,
            useful_route_rows=self.useful_route_rows + other.useful_route_rows,
            executed_runner_rows=self.executed_runner_rows + other.executed_runner_rows,
            host_submissions=self.host_submissions + other.host_submissions,
            phase_units=self.phase_units + other.phase_units,
            graph_units=self.graph_units + other.graph_units,
            control_items=control,
        )


def variable_path_ledger(rows: RowCounts, control_items: int | None = None) -> ExecutionLedger:
    """Variable dispatch + grouped runner: executed = useful, one submission per SPMD stage (0x05B)."""
    return ExecutionLedger(
        useful_input_rows=rows.input_rows,
        executed_dispatch_slots=rows.input_rows,
        useful_route_rows=rows.route_rows,
        executed_runner_rows=rows.route_rows,
        host_submissions=len(VARIABLE_PATH_STAGES),
        phase_units=1,
        graph_units=0,
        control_items=control_items,
    )


def reserved_bytes(bucket: DecodeBucket) -> ReservedBytesLedger:
    """M_graph: reserved payload bytes of the bucket's five named buffers (analytical)."""
    return ReservedBytesLedger(tuple((b.name, b.nbytes) for b in bucket.buffers))


def replay_ledger(bucket: DecodeBucket, rank_tokens: Sequence[int], slot_routes: Sequence[int],
                  control_items: int | None = None) -> ExecutionLedger:
    """Rows one replay of ``bucket`` executes for a step that was admitted (spec 0x05C): every reserved
    token slot and every reserved runner row runs, valid or masked. ``control_items`` is the declared
    schema value of the step, if any (spec 0x05C declares 12 for its decode fixture)."""
    t = check_counts("rank_tokens", rank_tokens)
    n = check_counts("slot_routes", slot_routes)
    for name, vals, caps in (("rank_tokens", t, bucket.key.rank_token_capacities),
                             ("slot_routes", n, bucket.key.slot_route_capacities)):
        if len(vals) != len(caps):
            raise ValueError(f"{name}: {len(vals)} entries, graph {bucket.graph_id!r} has {len(caps)}")
        for i, (v, c) in enumerate(zip(vals, caps)):
            if v > c:
                raise ValueError(f"{name}[{i}]={v}: over capacity {c} of {bucket.graph_id!r}; not replayable")
    return ExecutionLedger(
        useful_input_rows=sum(t),
        executed_dispatch_slots=bucket.key.token_slots,
        useful_route_rows=sum(n),
        executed_runner_rows=bucket.key.runner_rows,
        host_submissions=len(GRAPH_PATH_STAGES),
        phase_units=1,
        graph_units=1,
        control_items=control_items,
    )


@dataclass(frozen=True)
class FallbackPlan(RowCounts):
    """The uncaptured execution of a refused step (spec 0x05F): no truncation, no dropped route, no stale
    graph metadata. Every semantic row is executed exactly once.

    rank_tokens / slot_routes: the step's own counts, unchanged
    """

    reason: FallbackReason
    rank_tokens: tuple[int, ...]
    slot_routes: tuple[int, ...]

    def ledger(self, control_items: int | None = None) -> ExecutionLedger:
        """Variable dispatch slots = input rows, grouped runner rows = route rows (no padding)."""
        return variable_path_ledger(self, control_items)


def fallback_plan(step: AdmissionStep, outcome: Fallback) -> FallbackPlan:
    """The fallback of ``step``: its counts carried over unchanged."""
    return FallbackPlan(reason=outcome.reason, rank_tokens=step.rank_tokens, slot_routes=step.slot_routes)
