# ======================================================================================================
#  THE ROWS OF ONE GENERATION STEP (pure: numpy / torch, no Ray)
#
#   items (scheduler order) ──> one-row items first (decode tokens, one-token chunks) ──> packed rows
#     ──> a captured step's static shapes: rows / keys / sequences bucketed (``shape_bucket``, ``pow2``)
#     ──> the rows of marked items (expert statistics) and of each phase (the eager phase split)
# ======================================================================================================
"""Packed-row helpers and captured-shape buckets of the shard's generation steps."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from enum import Enum

import numpy as np
import torch

from ray_moe.shard.records import WorkItem


class DecodeLayout(str, Enum):
    """How a captured decode step feeds attention.

    PACKED:  every sequence's token in one row of a [1, N] batch over the packed contexts of all sequences
             (a block-diagonal mask): attention work ~ tokens x total context
    BATCHED: one row per sequence over its own context padded to the longest (a [B, 1] batch): attention
             work ~ tokens x longest context, grouped-query attention without repeating keys
    AUTO:    BATCHED unless padding every context to the longest would gather more than twice the packed
             context (one long sequence among short ones)
    """

    PACKED = "packed"
    BATCHED = "batched"
    AUTO = "auto"

    def pick(self, rows: int, longest: int, packed_keys: int) -> "DecodeLayout":
        if self is not DecodeLayout.AUTO:
            return self
        return DecodeLayout.BATCHED if rows * longest <= 2 * packed_keys else DecodeLayout.PACKED


def phase_rows(items: tuple[WorkItem, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode rows, prefill rows): packed row indices of the step's decode and prefill tokens, on ``device``."""
    flags = np.fromiter((it.decode for it in items for _ in it.tokens), dtype=bool)
    return (torch.from_numpy(np.flatnonzero(flags)).to(device), torch.from_numpy(np.flatnonzero(~flags)).to(device))


def marked_rows(items: tuple[WorkItem, ...], after: int = 0, shift: int = 0) -> tuple[tuple[str, ...], list[tuple[int, int]]]:
    """The items that asked for expert statistics: (their sequence ids, (first packed row, rows) of each).
    ``shift``: rows added before every item from index ``after`` on (a split layout's padding rows)."""
    ids, segments, row = [], [], 0
    for k, it in enumerate(items):
        if it.expert_stats:
            ids.append(it.seq_id)
            segments.append((row + (shift if k >= after else 0), len(it.tokens)))
        row += len(it.tokens)
    return tuple(ids), segments


def single_rows_order(items: Sequence[WorkItem]) -> list[int]:
    """Indices of ``items`` with the one-row items (decode tokens, one-token chunks) first, the others after,
    each group in order (the identity when all or none have one row)."""
    one = [k for k, it in enumerate(items) if it.num_tokens == 1]
    if len(one) in (0, len(items)):
        return list(range(len(items)))
    return one + [k for k, it in enumerate(items) if it.num_tokens != 1]


def single_rows_first(items: tuple[WorkItem, ...]) -> tuple[WorkItem, ...]:
    """The step's items in ``single_rows_order``: attention runs the one-row sequences as a group of their own
    (``StepLayout.single_rows``). The same tuple when the order does not change."""
    order = single_rows_order(items)
    return items if order == list(range(len(items))) else tuple(items[k] for k in order)


def packed_ids(items: tuple[WorkItem, ...], rows: int | None = None) -> np.ndarray:
    """[rows or N] int64 the step's token ids in packed order (zero padding past the real tokens)."""
    n = sum(len(it.tokens) for it in items)
    out = np.zeros(n if rows is None else rows, dtype=np.int64)
    out[:n] = np.fromiter(itertools.chain.from_iterable(it.tokens for it in items), dtype=np.int64, count=n)
    return out


# A captured mixed step's static sizes are coarse, so steps planned a little differently (the same workload
# again, or a step planned while another was in flight) find a graph already captured instead of running
# eagerly and capturing (~2x a replay's device time on an H200 plus the capture): the decode group's rows (a
# padding row costs a row of dense work), its slot vector (an upload only: powers of four), the sampled rows
# (LM-head rows) and the chunks' query bound (empty query blocks exit at once)
MIXED_DECODE_FLOOR = 64
MIXED_SLOTS_FLOOR = 1 << 16
SAMPLED_ROWS_FLOOR = 64
QUERY_BOUND_FLOOR = 512
QUERY_BOUND_AT = 6  # the query bound's position in a captured step's key (an upper bound: ``StepGraphs.covering``)


def pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def read_fills(items: tuple[WorkItem, ...], fills: list[tuple[int, torch.Tensor, int]]) -> tuple[WorkItem, ...]:
    """Items with their device-held deferred tokens read to the host (waits for the step that sampled them).
    fills: (item index, the sampling step's token tensor, index in it)."""
    if not fills:
        return items
    out = list(items)
    for k, t, i in fills:
        out[k] = dataclasses.replace(out[k], tokens=(int(t[i]),))
    return tuple(out)


def pow4(n: int) -> int:
    """The smallest power of four >= n (n >= 1)."""
    e = max(0, int(n) - 1).bit_length()
    return 1 << (e + (e & 1))


def shape_bucket(n: int, floor: int, bits: int) -> int:
    """The captured-shape bucket of a size: the smallest ``m * 2**e >= max(n, floor)`` with ``m`` of ``bits``
    significant bits (3: quarter octaves, at most 25% padding; 2: half octaves, at most 50%)."""
    n = max(int(n), int(floor), 1)
    e = max(0, n.bit_length() - bits)
    return -(-n >> e) << e


def prefill_query_bound(chunks: Sequence, rows: int, floor: int = 128) -> int:
    """The longest query run of a captured prefill group, as FlashAttention's grid needs it (a host int baked
    into the graph): the kernel launches ``max_q / block rows`` query blocks for EVERY sequence, so bounding it
    by the group's ``rows`` (the whole step) made a step of many short prompts launch blocks that find no query
    row (16k rows of ~34 prompts: ~128 blocks a sequence, ~4 with work; FlashAttention took ~44 ms of a ~256 ms
    48-layer step on an H200). The bound is the octave (>= ``floor``) of the longest real chunk and of the
    padding sequence (``rows`` minus the chunks' tokens, one sequence: ``varlen_offsets``), never above ``rows``:
    few captured shapes, and every padding row still inside the grid (its output zero, no key).
    ``chunks``: the group's ``SeqChunk``s (``num_tokens`` each); ``rows``: the group's padded rows."""
    n = sum(c.num_tokens for c in chunks)
    longest = max([c.num_tokens for c in chunks] + [rows - n, 1])
    return min(int(rows), max(int(floor), pow2(longest)))


__all__ = ["DecodeLayout", "prefill_query_bound", "phase_rows", "marked_rows", "single_rows_first", "single_rows_order", "packed_ids", "pow2", "pow4", "read_fills", "shape_bucket"]
