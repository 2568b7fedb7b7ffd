"""``PagedKVCache``'s per-sequence slot index (``_index``: a buffer grown by doubling, the reserved prefix a
view): under any interleaving of reservations, prefix attaches and frees, every sequence's slots equal the naive
index of its blocks (block * B + offset), and a context read before the index grew (a launched step's view)
keeps its values."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.model.kv import PagedKVCache

B = 4
OPS = st.lists(st.tuples(st.sampled_from(["reserve", "free", "attach"]), st.integers(0, 3), st.integers(1, 40)),
               max_size=60)


def _naive(kv: PagedKVCache, seq: str) -> np.ndarray:
    return np.array([b * B + o for b in kv.block_table(seq) for o in range(B)], dtype=np.int64)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_slots_equal_the_blocks_index_and_earlier_reads_keep_their_values(ops):
    kv = PagedKVCache(num_blocks=64, block_size=B)
    held: list[tuple[np.ndarray, np.ndarray]] = []  # (a view read earlier, its values then)
    for i, (op, k, n) in enumerate(ops):
        seq = f"s{k}"
        if op == "reserve":
            if not kv.can_reserve(seq, n):
                continue
            kv.reserve(seq, n)
            got = kv.slots(seq, 0, n)
            assert np.array_equal(got, _naive(kv, seq)[:n])
            held.append((got, got.copy()))
        elif op == "free":
            kv.free(seq)
            assert kv.held(seq) == 0
        else:  # register this sequence's written blocks and attach them to a fresh sequence
            valid = kv.valid_tokens(seq) // B
            blocks = kv.held(seq)
            if blocks > valid:
                kv.register(seq, [hash((seq, valid + j, i)) for j in range(blocks - valid)])
            other = f"t{k}-{i}"
            got = kv.attach(other, kv.valid_hashes(seq))
            if got:  # the same blocks, so the same slots
                assert np.array_equal(kv.slots(other, 0, got * B), _naive(kv, other))
                assert np.array_equal(kv.slots(other, 0, got * B), kv.slots(seq, 0, got * B))
        for view, then in held:
            assert np.array_equal(view, then)
    for seq in kv.sequences():
        assert np.array_equal(kv.slots(seq, 0, kv.held(seq) * B), _naive(kv, seq))


def test_a_decoding_sequence_grows_its_index_in_place():
    """Block by block (a decoding sequence): the index's buffer is replaced O(log n) times, not once a block."""
    kv = PagedKVCache(num_blocks=300, block_size=B)
    bufs = set()
    for end in range(1, 300 * B + 1):
        kv.reserve("a", end)
        bufs.add(id(kv.slots("a", 0, end).base))  # (the buffer the reserved prefix views)
    assert len(bufs) <= 10
    assert np.array_equal(kv.slots("a", 0, 300 * B), _naive(kv, "a"))
