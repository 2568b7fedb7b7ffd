"""Prefix-aware assignment across data-parallel ranks and block-aligned chunks in the ``Scheduler`` (pure, no
Ray): a request goes to the rank that recently got its prompt's prefix unless that rank is more than
``prefix_slack`` sequences busier than the least-loaded one; the index is bounded (LRU) and forgets departed
ranks; the expected-cached tokens ride outside the step's prefill budget."""

from __future__ import annotations

import pytest

from ray_moe.driver.scheduler import PREFIX_LOAD_SLACK, Scheduler
from ray_moe.model.prefix_cache import chain_hashes
from ray_moe.model.sampling import SamplingParams

SP = SamplingParams(max_new_tokens=4)
BASE = list(range(50, 67))  # 17 tokens: four full blocks of 4 before the last token


def _rank(s: Scheduler, rid: str) -> int:
    return s.seqs[rid].rank


def _sched(ranks=(0, 1, 2), **kw) -> Scheduler:
    return Scheduler(list(ranks), kv_blocks=64, block_size=4, max_context=256, step_tokens=64, **kw)


def test_a_request_follows_its_prefix_to_the_rank_that_got_it():
    s = _sched()
    a = s.submit(BASE + [1, 2], SP)
    s.plan()
    ra = _rank(s, a)
    b = s.submit([9] * 10, SP)  # unrelated: the least-loaded rank
    c = s.submit(BASE + [3], SP)  # shares four blocks with a: a's rank though it already runs one
    s.plan()
    assert _rank(s, b) != ra and _rank(s, c) == ra
    assert s.prefix_routed == 1
    d = s.submit([7] + BASE[1:], SP)  # the first block differs: no prefix at all, least-loaded
    s.plan()
    assert _rank(s, d) not in (ra, _rank(s, b))


def test_the_longest_match_wins_and_a_much_busier_rank_is_passed_over():
    s = _sched(ranks=(0, 1, 2), prefix_slack=1)
    h = chain_hashes(None, BASE[:16], 4)
    # rank 0 got three of the blocks (prefilled the first two so far), rank 1 one (prefilled)
    for key, done in (((0, h[0]), True), ((0, h[1]), True), ((0, h[2]), False), ((1, h[0]), True)):
        s._prefix_index[key] = done
    assert s._prefix_rank("x", h, [0, 1, 2], {0: 1, 1: 1, 2: 0}, least=2) == 0  # longest, within the slack
    assert s._expect["x"] == 8  # the two prefilled blocks are expected cached there, not the third
    assert s._prefix_rank("y", h, [0, 1, 2], {0: 2, 1: 1, 2: 0}, least=2) == 1  # rank 0 is 2 beyond: rank 1
    assert s._prefix_rank("z", h, [0, 1, 2], {0: 3, 1: 3, 2: 0}, least=2) == 2  # both too busy: least-loaded
    assert "z" not in s._expect and s.prefix_routed == 2
    assert s._prefix_rank("w", h, [1, 2], {1: 0, 2: 0}, least=1) == 1  # only ranks that fit count
    assert PREFIX_LOAD_SLACK == 4 and _sched().prefix_slack == PREFIX_LOAD_SLACK


def test_prefix_caching_off_assigns_least_loaded_and_chunks_by_budget():
    s = _sched(prefix_caching=False)
    a = s.submit(BASE, SP)
    s.plan()
    c = s.submit(BASE, SP)
    s.plan()
    assert _rank(s, c) != _rank(s, a) and s.prefix_routed == 0 and not s._prefix_index
    with pytest.raises(TypeError, match="prefix_caching=1: must be a bool"):
        _sched(prefix_caching=1)
    from ray_moe.driver.loop import GenerationLoop

    with pytest.raises(TypeError, match="prefix_caching='no': must be a bool"):
        GenerationLoop(None, prefix_caching="no")  # refused before any shard loads the model
    with pytest.raises(ValueError, match="prefix_slack=-1"):
        _sched(prefix_slack=-1)
    with pytest.raises(ValueError, match="prefix_index_blocks=0"):
        _sched(prefix_index_blocks=0)


def test_the_index_is_bounded_lru_and_forgets_departed_ranks():
    s = _sched(ranks=(0, 1), prefix_index_blocks=6)
    a = s.submit(BASE, SP)  # four blocks recorded
    s.plan()
    s.submit(list(range(200, 213)), SP)  # three more: the oldest of a's is dropped
    s.plan()
    assert len(s._prefix_index) == 6
    assert (_rank(s, a), s._prefix_hashes(s.seqs[a])[0]) not in s._prefix_index
    gone = _rank(s, a)
    s.set_ranks([1 - gone])  # the departed rank's cache went with it
    assert s._prefix_index and {r for r, _ in s._prefix_index} == {1 - gone}


def test_chunks_end_on_block_boundaries_and_expected_hits_ride_outside_the_budget():
    s = Scheduler([0], kv_blocks=64, block_size=4, max_context=256, step_tokens=6)
    a = s.submit(list(range(14)), SP)
    burst = s.submit(list(range(14)), SP)  # the same prompt at once: its blocks are assigned, not prefilled
    first = s.plan()
    # a: 6 rounded down to the block boundary; the burst request's 2 left of the budget reach no boundary, and
    # nothing is expected cached for it (so no budget beyond the step's): it waits
    assert {x.seq_id: (x.start, len(x.tokens)) for x in first.items[0]} == {a: (0, 4)}
    assert burst not in s._expect
    s.commit(first, {})
    while s.seqs[a].cached < 14:  # a's prefill to its end (its first token sampled)
        plan = s.plan()
        s.commit(plan, {x.seq_id: 1 for x in plan.items[0] if x.sample is not None})
    b = s.submit(list(range(14)), SP)  # now three prefilled blocks are expected cached on rank 0
    plan = s.plan()
    got = {x.seq_id: (x.start, len(x.tokens)) for x in plan.items[0]}
    # 12 expected-cached tokens beyond the budget: b's whole prompt in one chunk (2 computed)
    assert got[b] == (0, 14) and s.seqs[b].rank == 0
    assert b not in s._expect  # its expectation is used up once its chunk passed it
