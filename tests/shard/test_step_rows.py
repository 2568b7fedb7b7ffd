"""The rows of a generation step: one-row items first, marked rows, deferred tokens filled on the device."""

from __future__ import annotations

import torch

from ray_moe.shard.records import WorkItem
from ray_moe.shard.step_rows import fill_rows, marked_rows, packed_ids, single_rows_first


def _item(sid: str, n: int, *, start: int = 4, deferred: bool = False, stats: bool = False) -> WorkItem:
    return WorkItem(sid, () if deferred else tuple(range(n)), start, None, n == 1 and start > 0, deferred, False, stats)


def test_one_row_items_go_first_in_order():
    items = (_item("p", 5, start=0), _item("d1", 1), _item("q", 3), _item("d2", 1, deferred=True), _item("t", 1, start=0))
    assert [it.seq_id for it in single_rows_first(items)] == ["d1", "d2", "t", "p", "q"]
    only = (_item("d1", 1), _item("d2", 1))
    assert single_rows_first(only) is only
    assert [it.seq_id for it in single_rows_first(items[:1] + items[2:3])] == ["p", "q"]


def test_marked_rows_are_each_marked_items_packed_rows():
    items = (_item("d1", 1, stats=True), _item("d2", 1), _item("p", 5, start=0, stats=True))
    assert marked_rows(items) == (("d1", "p"), [(0, 1), (2, 5)])


def test_device_fills_land_on_each_items_first_row():
    """Deferred tokens still on the device: each fill copies its source step's sample into its item's row,
    grouped by source step, the other rows untouched."""
    items = (_item("a", 1), _item("b", 1), _item("c", 3, start=0), _item("d", 1))
    ids = torch.from_numpy(packed_ids(items, rows=8))
    src1, src2 = torch.tensor([40, 41, 42]), torch.tensor([90, 91])
    fill_rows(ids, items, [(0, src1, 2), (1, src2, 0), (3, src1, 0)])
    assert ids.tolist() == [42, 90, 0, 1, 2, 40, 0, 0]
