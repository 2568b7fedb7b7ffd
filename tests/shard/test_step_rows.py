"""The rows of a generation step: captured-shape buckets, one-row items first, marked rows after a split."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ray_moe.shard.records import WorkItem
from ray_moe.shard.step_rows import marked_rows, pow2, shape_bucket, single_rows_first


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 20), st.integers(1, 64), st.sampled_from([2, 3]))
def test_shape_bucket_bounds_the_padding(n, floor, bits):
    """The bucket covers n (and the floor), pads at most 1 / 2**(bits - 1) of it above the floor, and is
    idempotent; pow2 is the one-bit bucket."""
    b = shape_bucket(n, floor, bits)
    assert b >= max(n, floor) and shape_bucket(b, floor, bits) == b
    if n > floor:
        assert b - n <= n / 2 ** (bits - 1)
    assert pow2(n) == shape_bucket(n, 1, 1) and pow2(n) >= n > pow2(n) // 2


def _item(sid: str, n: int, *, start: int = 4, deferred: bool = False, stats: bool = False) -> WorkItem:
    return WorkItem(sid, () if deferred else tuple(range(n)), start, None, n == 1 and start > 0, deferred, False, stats)


def test_one_row_items_go_first_in_order():
    items = (_item("p", 5, start=0), _item("d1", 1), _item("q", 3), _item("d2", 1, deferred=True), _item("t", 1, start=0))
    assert [it.seq_id for it in single_rows_first(items)] == ["d1", "d2", "t", "p", "q"]
    only = (_item("d1", 1), _item("d2", 1))
    assert single_rows_first(only) is only
    assert [it.seq_id for it in single_rows_first(items[:1] + items[2:3])] == ["p", "q"]


def test_marked_rows_move_past_the_padding_of_the_one_row_group():
    items = (_item("d1", 1, stats=True), _item("d2", 1), _item("p", 5, start=0, stats=True))
    assert marked_rows(items) == (("d1", "p"), [(0, 1), (2, 5)])
    assert marked_rows(items, 2, 6) == (("d1", "p"), [(0, 1), (8, 5)])
