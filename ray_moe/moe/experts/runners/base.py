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

import ray_moe.moe.experts.runners.swiglu as swiglu
from ray_moe.moe.experts.weights import SlotWeights
from ray_moe.core.types import RunnerKind


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


def gate_up_operands(weights: SlotWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up projections as ``[Q, d, f]`` operands (K-major views of ``w_gate`` / ``w_up``)."""
    return weights.w_gate.transpose(1, 2), weights.w_up.transpose(1, 2)


def down_operand(weights: SlotWeights) -> torch.Tensor:
    """The down projection as a ``[Q, f, d]`` operand (a K-major view of ``w_down`` [Q, d, f])."""
    return weights.w_down.transpose(1, 2)


def swiglu_act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u computed in place in ``g`` (both contiguous, same shape) -> g: one kernel where it takes the
    operands (``swiglu.py``: CUDA), else torch's silu and multiply (the same roundings)."""
    if swiglu.available(g, u):
        return swiglu.swiglu_(g, u)
    return swiglu.swiglu_reference(g, u)


class ExpertRunner(ABC):
    """Runs the local experts of one rank on expert-major rows: the only place SwiGLU is computed on the
    serving path (flat expert-major rows with host counts, or the decode bucket's capacity layout)."""

    kind: RunnerKind

    @abstractmethod
    def run(self, x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> torch.Tensor:
        """x: [N, d] expert-major rows; counts: rows per local slot (len Q_local, sum N) -> [N, d]."""

    def run_capacity(self, x: torch.Tensor, weights: SlotWeights, valid: torch.Tensor | None = None) -> torch.Tensor:
        """x: [Q_local, C, d] capacity layout (padding rows zero), valid: [Q_local] int64 device-side rows per
        slot (or None) -> [Q_local, C, d], fixed shapes and no host sync (the decode bucket, CUDA-graph
        capturable). Padding rows are never read by the combine. Batched matmuls over every slot here;
        runners may override (the grouped runner skips empty slots)."""
        if x.dim() != 3 or x.shape[0] != weights.num_slots or x.shape[2] != weights.hidden_size:
            raise ValueError(f"x: expected [{weights.num_slots}, C, {weights.hidden_size}], got {tuple(x.shape)}")
        wg, wu = gate_up_operands(weights)
        return torch.bmm(swiglu_act(torch.bmm(x, wg), torch.bmm(x, wu)), down_operand(weights))

    def run_offsets(self, x: torch.Tensor, offsets: torch.Tensor, weights: SlotWeights) -> torch.Tensor:
        """x: [R, d] expert-major rows, offsets: [Q_local] int32 device-side inclusive row ends per slot (rows
        past ``offsets[-1]`` are padding and need not be computed) -> [R, d]. Here: one host read of the
        offsets, then ``run``; runners with device-offset kernels override (no host sync)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # inside a CUDA graph capture: no host read; each row multiplies its own slot's weights
            slot = torch.searchsorted(offsets.to(torch.int64), torch.arange(x.shape[0], device=x.device),
                                      right=True).clamp_max(weights.num_slots - 1)
            xr = x[:, None, :]
            a = swiglu_act(torch.bmm(xr, weights.w_gate[slot].transpose(1, 2)),
                           torch.bmm(xr, weights.w_up[slot].transpose(1, 2)))
            return torch.bmm(a, weights.w_down[slot].transpose(1, 2))[:, 0, :]
        ends = [int(v) for v in offsets.tolist()]
        n = ends[-1] if ends else 0
        counts = [b - a for a, b in zip([0, *ends[:-1]], ends)]
        y = torch.zeros_like(x)
        if n:
            y[:n] = self.run(x[:n], counts, weights)
        return y

    def takes_indexed(self, hidden: torch.Tensor, rows: int, weights: SlotWeights) -> bool:
        """Whether ``run_indexed`` takes ``rows`` expert-major rows read from the token-major ``hidden``
        (else the caller gathers them and calls ``run_offsets``); ``run_indexed`` is called only when it is
        (it does not ask again). Here: never."""
        return False

    def run_indexed(self, hidden: torch.Tensor, order: torch.Tensor, top_k: int, offsets: torch.Tensor,
                    weights: SlotWeights, *, weight_rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, d] token-major, order [R] int32 route of each expert-major row (row r is token
        order[r] // top_k), offsets [Q_local] int32 inclusive row ends -> [R, d] expert-major outputs (rows
        past offsets[-1] uncomputed). ``weight_rows``: [Q_local] int64 buffer row of each local slot when
        ``weights`` is row-mapped (its tensors are the whole slot buffer)."""
        raise NotImplementedError(f"{type(self).__name__} reads no indexed rows (takes_indexed is False)")

    def kernels(self) -> str:
        """How this runner computes, in words (``status``'s paths; runners with size-dependent kernels say more)."""
        return f"{self.kind.value} runner"

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
                out[start:start + c] = swiglu_act(seg @ weights.w_gate[q].T, seg @ weights.w_up[q].T) @ weights.w_down[q].T
            start += c
        return out

    def ledger(self, counts: Sequence[int], d: int, f: int) -> RunnerLedger:
        n = sum(int(c) for c in counts)
        return RunnerLedger(self.kind, n, n, n * d, n * f, 6 * n * d * f, 6 * n * d * f, 0)
