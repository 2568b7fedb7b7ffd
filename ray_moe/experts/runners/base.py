"""The expert-runner interface (spec 0x04).

A runner receives the already selected, placed and repacked rows of one rank in expert-major order,
plus per-local-slot counts, and returns one output row per input row in the same order. It never
applies the gate and never returns a padding row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from ray_moe.experts.weights import SlotWeights
from ray_moe.types import RunnerKind


@dataclass(frozen=True)
class RunnerLedger:
    """Analytical row ledger of one runner call (spec 0x04F). Labeled analytical: no time is claimed.

    useful_rows: routed rows; executed_rows: rows presented to the matmuls (padding included);
    flops: 6 * executed_rows * d * f (the three SwiGLU matmuls).
    """

    kind: RunnerKind
    useful_rows: int
    executed_rows: int
    input_values: int
    intermediate_values: int
    flops: int
    useful_flops: int
    metadata_bytes: int
    evidence: str = "analytical"

    @property
    def utilization(self) -> float:
        return self.useful_rows / self.executed_rows if self.executed_rows else 1.0


class ExpertRunner(ABC):
    """Runs the local experts of one rank on expert-major rows."""

    kind: RunnerKind

    @abstractmethod
    def run(self, x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> torch.Tensor:
        """x: [N, d] expert-major rows; counts: rows per local slot (len Q_local, sum N) -> [N, d]."""

    @abstractmethod
    def ledger(self, counts: Sequence[int], d: int, f: int) -> RunnerLedger:
        """Analytical rows/values/FLOPs this runner executes for ``counts``."""

    @staticmethod
    def _check(x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> None:
        if len(counts) != weights.num_slots:
            raise ValueError(f"counts: {len(counts)} entries but the rank hosts {weights.num_slots} slots")
        if sum(int(c) for c in counts) != x.shape[0]:
            raise ValueError(f"counts: sum {sum(int(c) for c in counts)} != rows {x.shape[0]}")
        if x.dim() != 2 or x.shape[1] != weights.hidden_size:
            raise ValueError(f"x: expected [N, {weights.hidden_size}], got {tuple(x.shape)}")


class LoopRunner(ExpertRunner):
    """The per-expert loop baseline: one SwiGLU per non-empty local slot."""

    kind = RunnerKind.LOOP

    def run(self, x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> torch.Tensor:
        self._check(x, counts, weights)
        out = torch.empty_like(x)
        start = 0
        for q, c in enumerate(counts):
            c = int(c)
            if c:
                seg = x[start:start + c]
                h = torch.nn.functional.silu(seg @ weights.w_gate[q].T) * (seg @ weights.w_up[q].T)
                out[start:start + c] = h @ weights.w_down[q].T
            start += c
        return out

    def ledger(self, counts: Sequence[int], d: int, f: int) -> RunnerLedger:
        n = sum(int(c) for c in counts)
        return RunnerLedger(self.kind, n, n, n * d, n * f, 6 * n * d * f, 6 * n * d * f, 0)
