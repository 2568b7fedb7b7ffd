"""MegaBlocks-style block-padded dropless runner (spec 0x04D, 0x04E).

Each slot's rows are rounded up independently to the token-row block size ``B_r``:

    n~_q = B_r * ceil(n_q / B_r),    executed rows R = sum_q n~_q,

so an expert's segment is a whole number of row blocks and the expert layer is a block-diagonal
product. The output-column block ``B_c`` splits ``d_ff`` into ``ceil(d_ff / B_c)`` column blocks per
row block; the block topology (CSR row offsets, column indices, row indices, transpose indices) is
built per call from the counts, never reused across counts (0x04G).

Algorithm:
  1. padded counts and padded bins (inclusive prefix) from the raw counts; the same bins drive the
     gather, the compute and the scatter (0x04G: bins and gather share offsets)
  2. padded_gather: row i of slot q goes to ``padded_start[q] + position_i``, fringe rows are zero
  3. compute every padded bin with its own slot's weights (``torch._grouped_mm`` over the bins where
     available, else a loop over bins); the dense bin product equals the sum over its nonzero blocks
  4. padded_scatter: only useful rows come back, in input order

The production block size pinned by the spec's MegaBlocks source is 128 rows (the default here); the
2-row fixture block is a teaching value only.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch

from ray_moe.moe.experts.runners.base import ExpertRunner, RunnerLedger, down_operand, gate_up_operands, swiglu_act
from ray_moe.moe.experts.runners.grouped import (
    as_counts,
    check_rows,
    device_tensor,
    grouped_mm_available,
    grouped_swiglu,
    segment_positions,
)
from ray_moe.moe.experts.weights import SlotWeights
from ray_moe.core.types import RunnerKind

MEGABLOCKS_BLOCK_SIZE = 128


@dataclass(frozen=True)
class BlockPlan:
    """Block padding of one call. padded_counts: n~_q per slot; bins: inclusive prefix of them."""

    counts: tuple[int, ...]
    padded_counts: tuple[int, ...]
    block_size: int

    @property
    def bins(self) -> tuple[int, ...]:
        return tuple(accumulate(self.padded_counts))

    @property
    def starts(self) -> tuple[int, ...]:
        return (0, *self.bins[:-1])

    @property
    def executed_rows(self) -> int:
        return sum(self.padded_counts)

    @property
    def useful_rows(self) -> int:
        return sum(self.counts)

    @property
    def row_blocks(self) -> tuple[int, ...]:
        return tuple(p // self.block_size for p in self.padded_counts)


@dataclass(frozen=True)
class BlockTopology:
    """Minimal block-diagonal topology (spec 0x04D), every array int32.

    row_offsets: [row_blocks + 1] CSR offsets into the nonzero blocks;
    column_indices: [nnz] column block of each nonzero block (slot q owns columns
    ``q*cb .. q*cb + cb - 1``, cb = ceil(d_ff / B_c));
    row_indices: [nnz] row block of each nonzero block;
    transpose_indices: [nnz] nonzero blocks in column-major (CSC) order.
    """

    row_offsets: torch.Tensor
    column_indices: torch.Tensor
    row_indices: torch.Tensor
    transpose_indices: torch.Tensor

    @property
    def nnz(self) -> int:
        return int(self.column_indices.numel())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.row_offsets, self.column_indices, self.row_indices, self.transpose_indices))


def make_block_diagonal_topology(plan: BlockPlan, ffn_size: int, column_block: int) -> BlockTopology:
    """Topology of the block-diagonal expert product for ``plan`` (vectorised).

    1. row blocks per slot -> slot of every row block
    2. every row block of slot q holds cb nonzero column blocks, columns q*cb + j
    3. CSR row offsets = row_block * cb; transpose order = stable sort by (column, row)
    """
    cb = -(-ffn_size // column_block)
    per_slot = torch.tensor(plan.row_blocks, dtype=torch.int64)
    n_rb = int(per_slot.sum())
    block_slot = torch.repeat_interleave(torch.arange(len(plan.row_blocks)), per_slot, output_size=n_rb)
    column_indices = (block_slot[:, None] * cb + torch.arange(cb)[None, :]).reshape(-1)
    row_indices = torch.repeat_interleave(torch.arange(n_rb), cb, output_size=n_rb * cb)
    transpose_indices = torch.argsort(column_indices * max(n_rb, 1) + row_indices, stable=True)
    return BlockTopology(
        row_offsets=(torch.arange(n_rb + 1) * cb).to(torch.int32),
        column_indices=column_indices.to(torch.int32),
        row_indices=row_indices.to(torch.int32),
        transpose_indices=transpose_indices.to(torch.int32),
    )


class BlockRunner(ExpertRunner):
    """Block-padded dropless execution (MegaBlocks construction, spec 0x04D).

    block_size: token-row block B_r; column_block: output-column block B_c (enters the topology);
    use_grouped_mm: None picks ``torch._grouped_mm`` over the padded bins where available, False forces
    the per-bin loop.
    """

    kind = RunnerKind.BLOCK

    def __init__(self, block_size: int = MEGABLOCKS_BLOCK_SIZE, column_block: int = MEGABLOCKS_BLOCK_SIZE,
                 use_grouped_mm: bool | None = None) -> None:
        for name, v in (("block_size", block_size), ("column_block", column_block)):
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if use_grouped_mm not in (None, True, False):
            raise ValueError(f"use_grouped_mm={use_grouped_mm!r} must be None, True or False")
        self.block_size = int(block_size)
        self.column_block = int(column_block)
        self.use_grouped_mm = use_grouped_mm

    def plan(self, counts: Sequence[int]) -> BlockPlan:
        counts = as_counts(counts)
        b = self.block_size
        return BlockPlan(counts=tuple(counts), padded_counts=tuple(b * -(-c // b) for c in counts), block_size=b)

    def topology(self, counts: Sequence[int], ffn_size: int) -> BlockTopology:
        return make_block_diagonal_topology(self.plan(counts), ffn_size, self.column_block)

    def backend(self, x: torch.Tensor, weights: SlotWeights) -> str:
        """``"grouped_mm"`` or ``"loop"``: how ``run`` computes the padded bins."""
        ok = grouped_mm_available(x.device, x.dtype, weights.hidden_size, weights.ffn_size)
        if self.use_grouped_mm is True and not ok:
            raise ValueError(
                f"use_grouped_mm=True but torch._grouped_mm cannot take dtype {x.dtype} on {x.device} "
                f"with d={weights.hidden_size}, f={weights.ffn_size}"
            )
        return "grouped_mm" if ok and self.use_grouped_mm is not False else "loop"

    def run(self, x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> torch.Tensor:
        """x: [N, d] expert-major rows; counts: len Q_local -> [N, d]."""
        counts = check_rows(x, counts, weights)
        if x.shape[0] == 0:
            return torch.empty_like(x)
        plan = self.plan(counts)
        # 1-2. padded_gather through the padded bins.
        slot, position = segment_positions(counts, x.device)
        dest = device_tensor(plan.starts, torch.int64, x.device)[slot] + position
        blocked = x.new_zeros(plan.executed_rows, x.shape[1])
        blocked.index_copy_(0, dest, x)
        # 3. every bin with its own slot's weights.
        y = grouped_swiglu(blocked, plan.bins, weights, use_grouped_mm=self.backend(x, weights) == "grouped_mm")
        # 4. padded_scatter of useful rows only.
        return y.index_select(0, dest)

    def ledger(self, counts: Sequence[int], d: int, f: int) -> RunnerLedger:
        plan = self.plan(counts)
        e, u = plan.executed_rows, plan.useful_rows
        cb = -(-f // self.column_block)
        n_rb = sum(plan.row_blocks)
        metadata = 4 * ((n_rb + 1) + 3 * n_rb * cb)
        return RunnerLedger(self.kind, u, e, e * d, e * f, 6 * e * d * f, 6 * u * d * f, metadata)
