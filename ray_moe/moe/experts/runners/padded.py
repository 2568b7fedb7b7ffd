"""Capacity-padded dense runner (spec 0x04B, 0x04E, 0x0AD).

Every local slot reserves ``C`` rows (the capacity), rounded up to the kernel row alignment ``a``:

    C_exec = a * ceil(C / a),    executed rows = Q_local * C_exec.

Algorithm (vectorised, no loop over slots):
  1. C = capacity or max(counts); capacity < max(counts) raises (a runner never drops a route, 0x04G)
  2. (slot, position) of every row -> destination row ``slot * C_exec + position``
  3. scatter rows into a zero buffer [Q, C_exec, d]
  4. batched SwiGLU: G = bmm(X, Wg^T), U = bmm(X, Wu^T) [Q, C_exec, f]; A = silu(G) * U (in place);
     Y = bmm(A, Wd^T) [Q, C_exec, d]
  5. gather the useful rows back in input order; padding rows are never returned (0x04G)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ray_moe.moe.experts.runners.base import ExpertRunner, RunnerLedger, down_operand, gate_up_operands, swiglu_act
from ray_moe.moe.experts.runners.grouped import (
    as_counts,
    check_rows,
    segment_positions,
)
from ray_moe.moe.experts.weights import SlotWeights
from ray_moe.core.types import RunnerKind


@dataclass(frozen=True)
class PaddedPlan:
    """Row accounting of one capacity-padded call (spec 0x04B table).

    capacity: C rows reserved per slot; exec_capacity: C_exec after alignment;
    capacity_rows = Q*C; executed_rows = Q*C_exec; capacity_unused = Q*C - useful;
    alignment_only = Q*(C_exec - C); waste = executed - useful.
    """

    num_slots: int
    useful_rows: int
    capacity: int
    exec_capacity: int

    @property
    def capacity_rows(self) -> int:
        return self.num_slots * self.capacity

    @property
    def executed_rows(self) -> int:
        return self.num_slots * self.exec_capacity

    @property
    def capacity_unused(self) -> int:
        return self.capacity_rows - self.useful_rows

    @property
    def alignment_only(self) -> int:
        return self.executed_rows - self.capacity_rows

    @property
    def waste(self) -> int:
        return self.executed_rows - self.useful_rows


class PaddedRunner(ExpertRunner):
    """Capacity-padded dense execution: one [Q, C_exec, d] batch through batched matmuls.

    capacity: rows reserved per slot (None: the largest count of each call); alignment: the row
    multiple ``a`` of the dense kernel path. The ledger's metadata is the valid-row mask, one byte per
    executed row slot.
    """

    kind = RunnerKind.PADDED

    def __init__(self, capacity: int | None = None, alignment: int = 1) -> None:
        if capacity is not None and (isinstance(capacity, bool) or int(capacity) != capacity or capacity < 0):
            raise ValueError(f"capacity={capacity!r} must be None or an integer >= 0")
        if isinstance(alignment, bool) or int(alignment) != alignment or alignment < 1:
            raise ValueError(f"alignment={alignment!r} must be an integer >= 1")
        self.capacity = None if capacity is None else int(capacity)
        self.alignment = int(alignment)

    def plan(self, counts: Sequence[int]) -> PaddedPlan:
        """Capacity and aligned stride for ``counts``; raises if a slot would overflow its capacity."""
        counts = as_counts(counts)
        largest = max(counts, default=0)
        cap = largest if self.capacity is None else self.capacity
        if cap < largest:
            raise ValueError(
                f"capacity={cap} is below max(counts)={largest} for counts={counts}: the padded runner "
                f"would drop {sum(max(0, c - cap) for c in counts)} routed rows"
            )
        a = self.alignment
        return PaddedPlan(num_slots=len(counts), useful_rows=sum(counts), capacity=cap,
                          exec_capacity=a * -(-cap // a))

    def run(self, x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> torch.Tensor:
        """x: [N, d] expert-major rows; counts: len Q_local -> [N, d]."""
        counts = check_rows(x, counts, weights)
        plan = self.plan(counts)
        n, d = x.shape
        if n == 0:
            return torch.empty_like(x)
        q, c_exec = plan.num_slots, plan.exec_capacity
        # 2. destination row of every useful row inside the padded buffer.
        slot, position = segment_positions(counts, x.device)
        dest = slot * c_exec + position
        # 3. scatter into zeros: padding rows carry no route identity.
        dense = x.new_zeros(q * c_exec, d)
        dense.index_copy_(0, dest, x)
        # 4. batched SwiGLU over every reserved row slot.
        xs = dense.view(q, c_exec, d)
        wg, wu = gate_up_operands(weights)
        a = swiglu_act(torch.bmm(xs, wg), torch.bmm(xs, wu))
        y = torch.bmm(a, down_operand(weights))
        # 5. only useful rows come back, in input order.
        return y.reshape(q * c_exec, d).index_select(0, dest)

    def ledger(self, counts: Sequence[int], d: int, f: int) -> RunnerLedger:
        plan = self.plan(counts)
        e, u = plan.executed_rows, plan.useful_rows
        return RunnerLedger(self.kind, u, e, e * d, e * f, 6 * e * d * f, 6 * u * d * f, e)
