# ======================================================================================================
#  THE ROWS OF ONE GENERATION STEP (pure: numpy / torch, no Ray)
#
#   items (scheduler order) ──> one-row items first (decode tokens, one-token chunks) ──> packed rows
#     ──> deferred tokens still on the device filled into them (``fill_rows``)
#     ──> the rows of marked items (expert statistics) and of each phase (the eager phase split)
# ======================================================================================================
"""Packed-row helpers of the shard's generation steps."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from ray_moe.moe.experts.runners.grouped import device_tensor
from ray_moe.shard.records import WorkItem


def phase_rows(items: tuple[WorkItem, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode rows, prefill rows): packed row indices of the step's decode and prefill tokens, on ``device``."""
    flags = np.fromiter((it.decode for it in items for _ in it.tokens), dtype=bool)
    return (torch.from_numpy(np.flatnonzero(flags)).to(device), torch.from_numpy(np.flatnonzero(~flags)).to(device))


def marked_rows(items: tuple[WorkItem, ...]) -> tuple[tuple[str, ...], list[tuple[int, int]]]:
    """The items that asked for expert statistics: (their sequence ids, (first packed row, rows) of each)."""
    ids, segments, row = [], [], 0
    for it in items:
        if it.expert_stats:
            ids.append(it.seq_id)
            segments.append((row, len(it.tokens)))
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


def read_fills(items: tuple[WorkItem, ...], fills: list[tuple[int, torch.Tensor, int]]) -> tuple[WorkItem, ...]:
    """Items with their device-held deferred tokens read to the host (waits for the step that sampled them).
    fills: (item index, the sampling step's token tensor, index in it)."""
    if not fills:
        return items
    out = list(items)
    for k, t, i in fills:
        out[k] = dataclasses.replace(out[k], tokens=(int(t[i]),))
    return tuple(out)


def fill_rows(token_ids: torch.Tensor, items: tuple[WorkItem, ...], fills: list[tuple[int, torch.Tensor, int]]) -> None:
    """Deferred tokens still on the device into a step's packed ``token_ids`` [R] (the rows of item k start at
    the items' token count before it): one gather per source step, the index vectors uploaded without a host
    wait, queued behind the step that sampled them. fills: (item index, that step's token tensor, index in it)."""
    if not fills:
        return
    starts = np.cumsum([0] + [len(it.tokens) for it in items])
    dev = token_ids.device
    by_source: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for k, t, i in fills:
        _, dst, idx = by_source.setdefault(id(t), (t, [], []))
        dst.append(int(starts[k]))
        idx.append(i)
    for t, dst, idx in by_source.values():
        token_ids.index_copy_(0, device_tensor(dst, torch.int64, dev),
                              t.index_select(0, device_tensor(idx, torch.int64, dev)).to(torch.int64))


__all__ = ["phase_rows", "marked_rows", "single_rows_first", "single_rows_order", "packed_ids", "read_fills",
           "fill_rows"]
