"""The rows of a generation step: captured-shape buckets, one-row items first, marked rows after a split."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ray_moe.shard.records import WorkItem
from ray_moe.model.kv import SeqChunk
from ray_moe.shard.step_rows import marked_rows, pow2, pow4, prefill_query_bound, shape_bucket, single_rows_first


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
    assert pow4(n) >= n > pow4(n) // 4 and pow4(n).bit_length() % 2 == 1  # (4**e: an odd bit length)


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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=1, max_size=48), st.integers(0, 3))
def test_prefill_query_bound_covers_every_query_run_and_stays_in_the_rows(lens, extra_bits):
    """The captured prefill group's query bound (FlashAttention's grid): at least every chunk's new tokens and
    the padding sequence's rows (else rows past it would be left unwritten), at most the group's rows, and an
    octave of >= 128 below the rows (few captured shapes)."""
    chunks = [SeqChunk(f"s{i}", 3 * i, n) for i, n in enumerate(lens)]
    n = sum(lens)
    rows = shape_bucket(n, 16, 3) << extra_bits  # the step's bucket, or a larger one (more padding)
    b = prefill_query_bound(chunks, rows)
    assert b <= rows
    assert b >= min(rows, max(lens)) and b >= rows - n
    assert b == rows or (b >= 128 and b == pow2(b))


def test_prefill_query_bound_of_many_short_prompts_is_their_length_not_the_step():
    """34 prompts of 480 tokens in a 16,384-row step: 512 query rows a sequence (4 blocks of 128), not 16,384."""
    chunks = [SeqChunk(f"s{i}", 0, 480) for i in range(34)] + [SeqChunk("tail", 0, 64)]
    assert prefill_query_bound(chunks, 16384) == 512
    assert prefill_query_bound(chunks[:1], 480) == 480  # never above the rows
    assert prefill_query_bound([SeqChunk("a", 0, 100)], 4096) == 4096  # the padding sequence's 3,996 rows
