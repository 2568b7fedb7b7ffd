"""The KV block pool with prefix caching (``model/prefix_cache.py``) and the cache's bookkeeping over it
(``PagedKVCache.attach`` / ``register``): chained hashes, reference counts, LRU eviction of cached blocks only
under pressure, the budget unchanged, and blocks conserved across any reserve / register / attach / free."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.model.kv import KVBudgetError, PagedKVCache
from ray_moe.model.prefix_cache import BlockPool, block_hash, chain_hashes


def test_block_hashes_chain_the_prefix_and_are_stable_across_processes():
    a = chain_hashes(None, list(range(10)), 4)  # two full blocks, the last two tokens have none
    assert len(a) == 2
    assert a[0] == block_hash(None, [0, 1, 2, 3]) and a[1] == block_hash(a[0], [4, 5, 6, 7])
    # the second block's name depends on the first block's tokens: same tokens after another prefix differ
    b = chain_hashes(None, [9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert b[0] != a[0] and b[1] != a[1]
    assert chain_hashes(a[0], [4, 5, 6, 7], 4) == [a[1]]
    # a BLAKE2b digest of fixed bytes (no per-process salt, unlike hash()): the driver computes the same names
    want = hashlib.blake2b(b"-" + bytes(8 * 0) + b"".join(t.to_bytes(8, "little") for t in (0, 1, 2, 3)),
                           digest_size=8).digest()
    assert a[0] == int.from_bytes(want, "little")
    with pytest.raises(ValueError, match="block_size=0"):
        chain_hashes(None, [1], 0)


def _written(kv: PagedKVCache, seq: str, tokens: list[int]) -> list[int]:
    """Reserve ``tokens`` for ``seq`` from position 0 and register its full blocks (as a finished prefill)."""
    kv.reserve(seq, len(tokens))
    hashes = chain_hashes(None, tokens, kv.block_size)
    kv.register(seq, hashes)
    return hashes


def test_a_new_sequence_attaches_cached_blocks_with_reference_counts():
    kv = PagedKVCache(num_blocks=6, block_size=4)
    h = _written(kv, "a", list(range(10)))  # blocks 0, 1 named; block 2 (tokens 8, 9) private
    assert kv.held("a") == 3 and kv.valid_tokens("a") == 8 and kv.free_blocks == 3
    assert kv.attach("b", h) == 2  # shares a's two blocks: nothing allocated
    assert kv.held("b") == 2 and kv.free_blocks == 3 and kv.pool.refs == {0: 2, 1: 2, 2: 1}
    assert kv.slots("b", 0, 8).tolist() == kv.slots("a", 0, 8).tolist()
    kv.reserve("b", 9)  # its own third block for position 8
    assert kv.slots("b", 8, 9).tolist() == [3 * 4] and kv.free_blocks == 2
    kv.free("a")  # the shared blocks stay held by b; a's private block is free again
    assert kv.pool.refs == {0: 1, 1: 1, 3: 1} and kv.pool.counts() == {"free": 3, "held": 3, "cached": 0, "hashed": 2}
    kv.free("b")  # named blocks stay cached (findable), the private one is free
    assert kv.pool.counts() == {"free": 4, "held": 0, "cached": 2, "hashed": 2} and kv.free_blocks == 6
    assert kv.attach("c", h[:1] + [12345]) == 1  # up to the first name not cached
    assert kv.pool.counts()["cached"] == 1 and kv.held("c") == 1


def test_attach_only_extends_a_sequence_that_holds_just_its_valid_blocks():
    kv = PagedKVCache(num_blocks=8, block_size=4)
    h = _written(kv, "a", list(range(12)))
    kv.reserve("b", 2)  # b has a private block 0 already: its positions 0.. are its own
    assert kv.attach("b", h) == 0 and kv.held("b") == 1
    with pytest.raises(KVBudgetError, match="3 blocks registered, 1 held"):
        kv.register("b", h)


def test_cached_blocks_are_evicted_least_recently_released_first_and_only_under_pressure():
    kv = PagedKVCache(num_blocks=4, block_size=2)
    ha = _written(kv, "a", [1, 1, 2, 2])        # blocks 0, 1
    hb = _written(kv, "b", [7, 7])              # block 2
    kv.free("a")  # released in reverse chain order: block 1 is evicted before block 0
    kv.free("b")
    assert kv.pool.counts() == {"free": 1, "held": 0, "cached": 3, "hashed": 3} and kv.free_blocks == 4
    kv.reserve("c", 2)  # the free block first: nothing evicted
    assert kv.slots("c", 0, 1).tolist() == [3 * 2] and kv.pool.evictions == 0
    kv.reserve("c", 4)  # under pressure: a's tail block (released first) goes
    assert kv.pool.evictions == 1 and kv.pool.find(ha[1]) is None
    assert kv.pool.find(ha[0]) == 0 and kv.pool.find(hb[0]) == 2
    kv.reserve("c", 6)  # then a's first block, then b's
    assert kv.pool.find(ha[0]) is None and kv.pool.find(hb[0]) == 2
    assert kv.attach("d", ha) == 0 and kv.attach("d", hb) == 1  # b's block is still shared
    assert kv.free_blocks == 0 and not kv.can_reserve("e", 1)
    with pytest.raises(KVBudgetError, match="0 free of 4"):
        kv.reserve("e", 1)


def test_a_registered_duplicate_stays_private_and_the_first_copy_is_shared():
    kv = PagedKVCache(num_blocks=4, block_size=2)
    h = _written(kv, "a", [5, 6])
    _written(kv, "b", [5, 6])  # the same content computed again: b's block is valid for b, not named
    assert kv.valid_tokens("b") == 2 and kv.pool.find(h[0]) == kv.slots("a", 0, 1)[0] // 2
    kv.free("b")
    assert kv.pool.counts()["free"] == 3  # b's copy was never named: free, not cached


def test_pool_refuses_what_it_cannot_do():
    pool = BlockPool(1)
    with pytest.raises(ValueError, match="neither held nor cached"):
        pool.share(0)
    b = pool.take()
    with pytest.raises(RuntimeError, match="no cache block available of 1"):
        pool.take()
    pool.release([b])
    with pytest.raises(ValueError, match="only a held block"):
        pool.register(b, 1)
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockPool(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "attach", "free"]), st.integers(0, 3), st.integers(1, 12),
                          st.integers(0, 2)), max_size=40))
def test_blocks_are_conserved_free_plus_held_plus_cached(ops):
    """Any sequence of reservations (registering the full blocks of a prompt drawn from 3 families), attaches
    and frees: every block is free, held or cached, references equal the holders, budget checks hold."""
    kv = PagedKVCache(num_blocks=10, block_size=2)
    prompts = {f: [f] * 3 + list(range(9)) for f in range(3)}
    for op, seq, n, fam in ops:
        sid = f"s{seq}"
        toks = prompts[fam][:n]
        if op == "free":
            kv.free(sid)
        elif op == "attach":
            if kv.held(sid) == 0:
                kv.attach(sid, chain_hashes(None, toks, 2))
        elif kv.can_reserve(sid, n):
            kv.reserve(sid, n)
            if kv.valid_tokens(sid) == 0 and kv.held(sid) * 2 >= n:
                kv.register(sid, chain_hashes(None, toks, 2)[: kv.held(sid)])
        else:
            with pytest.raises(KVBudgetError):
                kv.reserve(sid, n)
        c = kv.pool.counts()
        assert c["free"] + c["held"] + c["cached"] == kv.num_blocks
        assert kv.free_blocks == c["free"] + c["cached"]
        holders: dict[int, int] = {}
        for s in kv.sequences():
            for b in kv._blocks[s]:
                holders[b] = holders.get(b, 0) + 1
        assert holders == kv.pool.refs
