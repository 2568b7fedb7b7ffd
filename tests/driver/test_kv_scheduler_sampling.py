"""The pure serving pieces: the paged KV cache's bookkeeping and step layout, the continuous-batching
scheduler (admission, budgets, chunked prefill, requeue on rank loss), seeded retry-safe sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.types import AttentionBackend
from ray_moe.model.kv import KVBudgetError, PagedKVCache, SeqChunk
from ray_moe.model.sampling import SampleSpec, SamplingParams, sample
from ray_moe.driver.scheduler import THIN_KV_TOKENS_PER_SEQUENCE, KvCapacity, Scheduler, SeqState


def test_paged_cache_reserves_blocks_and_lays_out_a_packed_step():
    kv = PagedKVCache(num_blocks=6, block_size=4)
    kv.reserve("a", 6)   # blocks 0, 1
    kv.reserve("b", 3)   # block 2
    kv.reserve("a", 8)   # still 2 blocks: idempotent growth
    assert kv.held("a") == 2 and kv.held("b") == 1 and kv.free_blocks == 3
    rows, plan = kv.plan_step([SeqChunk("a", 5, 1), SeqChunk("b", 0, 3)], np.arange(4), AttentionBackend.MASKED)
    assert rows.write_index.tolist() == [5, 8, 9, 10]
    assert plan.gather.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    assert rows.positions.tolist() == [5, 0, 1, 2]
    assert rows.last.tolist() == [0, 3]
    allowed = (plan.mask[0, 0] == 0)
    # the decode token of "a" sees a's six positions only; b's tokens see b's causal prefix
    assert allowed[0].tolist() == [True] * 6 + [False] * 3
    assert allowed[3].tolist() == [False] * 6 + [True] * 3
    assert allowed[1].tolist() == [False] * 6 + [True, False, False]
    # update writes the new tokens at their slots and hands back the cache itself (the trash slot last); with
    # ``gather`` (a layer that transforms its cache) the packed contexts
    a = torch.arange(4 * 2 * 3, dtype=torch.float32).view(1, 2, 4, 3)
    kv.write_index = rows.write_index
    k, v = kv.update(a, a + 100, layer_idx=0)
    assert k.shape == (1, 2, 6 * 4 + 1, 3) and torch.equal(k[0, :, 8:11], a[0, :, 1:])
    assert torch.equal(v[0, :, 5], a[0, :, 0] + 100)
    kv.gather = plan.gather
    k, v = kv.update(a, a + 100, layer_idx=0)
    assert k.shape == (1, 2, 9, 3) and torch.equal(k[0, :, 6:], a[0, :, 1:]) and torch.equal(v[0, :, 5], a[0, :, 0] + 100)
    kv.write_index = kv.gather = None
    kv.free("a")
    assert kv.free_blocks == 5
    with pytest.raises(KVBudgetError, match="need 7 cache blocks"):
        kv.reserve("c", 25)


def test_scheduler_refuses_what_can_never_fit_and_others_run():
    s = Scheduler([0, 1], kv_blocks=4, block_size=4, max_context=64)
    with pytest.raises(KVBudgetError, match="need 5 KV blocks"):
        s.submit([1] * 15, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        s.submit([1] * 60, SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="prompt: empty"):
        s.submit([], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="token id 500"):
        s.submit([500], SamplingParams(max_new_tokens=1), vocab_size=128)
    rid = s.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    plan = s.plan()
    assert [it.seq_id for items in plan.items.values() for it in items] == [rid]


def test_scheduler_chunks_prefill_samples_at_the_end_and_requeues_a_lost_rank():
    s = Scheduler([0, 1], kv_blocks=16, block_size=4, max_context=256, step_tokens=5,
                  prefix_caching=False)  # (chunks of the budget, not block-aligned)
    a = s.submit(list(range(12)), SamplingParams(max_new_tokens=3))
    b = s.submit([7, 8], SamplingParams(max_new_tokens=3))
    plan = s.plan()
    ra, rb = s.seqs[a].rank, s.seqs[b].rank
    assert ra != rb  # spread over the ranks
    (ia,), (ib,) = plan.items[ra], plan.items[rb]
    assert (ia.start, len(ia.tokens), ia.sample) == (0, 5, None)   # a chunk of a long prompt: no sample yet
    assert ib.sample is not None and ib.sample.position == 2
    s.commit(plan, {b: 40})
    plan = s.plan()
    (ia,), (ib,) = plan.items[ra], plan.items[rb]
    assert (ia.start, len(ia.tokens)) == (5, 5) and ib.decode and ib.tokens == (40,)
    s.commit(plan, {b: 41})
    moved = s.set_ranks([ra])  # b's rank left: b goes back to the queue with what it generated
    assert moved == ([b] if rb != ra else [])
    assert s.seqs[b].state is SeqState.WAITING and s.seqs[b].generated == [40, 41]
    plan = s.plan()
    (ib_new,) = [it for it in plan.items[ra] if it.seq_id == b]
    # a's last 2 prompt tokens come first, b's re-prefill takes the 3 left of the 5-token budget
    assert ib_new.tokens == (7, 8, 40) and ib_new.start == 0 and ib_new.sample is None
    s.commit(plan, {a: 50})
    (ib_new,) = [it for it in s.plan().items[ra] if it.seq_id == b]
    # a one-token chunk over an existing cache is a decode step (same math, the decode unit)
    assert ib_new.tokens == (41,) and ib_new.start == 3 and ib_new.sample.position == 4 and ib_new.decode


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=8), st.integers(1, 6), st.integers(2, 9))
def test_scheduler_serves_every_request_exactly_its_tokens(lens, new, budget):
    """Conservation: every request gets exactly max_new_tokens, every prompt token is cached once per
    placement, blocks return to the pool."""
    s = Scheduler([0, 1, 2], kv_blocks=24, block_size=4, max_context=256, step_tokens=budget)
    rids = [s.submit(list(range(n)), SamplingParams(max_new_tokens=new)) for n in lens]
    got = {r: 0 for r in rids}
    for _ in range(500):
        if not s.pending():
            break
        plan = s.plan()
        sampled = {it.seq_id: 1 for items in plan.items.values() for it in items if it.sample is not None}
        for ev in s.commit(plan, sampled):
            got[ev.request_id] += 1
    assert got == {r: new for r in rids}
    assert all(v == 0 for v in s._used.values())


def test_lookahead_plan_defers_decode_tokens_and_stops_at_the_last_one():
    """A plan made while the previous step is in flight: chunks continue after the in-flight chunk, a sequence
    being sampled continues with a deferred decode item at the sampled position, and a sequence whose last
    token is in flight gets nothing."""
    s = Scheduler([0], kv_blocks=16, block_size=4, max_context=256, step_tokens=6)
    b = s.submit([7, 8], SamplingParams(max_new_tokens=1))
    a = s.submit(list(range(6)), SamplingParams(max_new_tokens=3))
    p1 = s.plan()
    assert [(it.seq_id, it.start, it.tokens) for it in p1.items[0]] == [(b, 0, (7, 8)), (a, 0, (0, 1, 2, 3))]
    p2 = s.plan(ahead=p1)  # p1 not committed: a's next chunk, nothing for b (its only token is in flight)
    assert [(it.seq_id, it.start, it.tokens, it.deferred) for it in p2.items[0]] == [(a, 4, (4, 5), False)]
    assert p2.items[0][0].sample.position == 6
    assert [e.token for e in s.commit(p1, {b: 30})] == [30]  # b finished with its one token
    p3 = s.plan(ahead=p2)
    (ia,) = p3.items[0]
    assert (ia.start, ia.tokens, ia.deferred, ia.decode, ia.num_tokens) == (6, (), True, True, 1)
    assert ia.sample.position == 7 and p3.free[0] == (b,)
    s.commit(p2, {a: 40})
    p4 = s.plan(ahead=p3)
    assert [(it.start, it.deferred) for it in p4.items[0]] == [(7, True)]
    s.commit(p3, {a: 41})
    assert s.plan(ahead=p4).empty  # a's third and last token is in flight
    events = s.commit(p4, {a: 42})
    assert [(e.token, e.finished) for e in events] == [(42, True)] and s.status(a).generated == [40, 41, 42]


def test_lookahead_drops_the_token_after_an_end_of_sequence():
    s = Scheduler([0], kv_blocks=16, block_size=4, max_context=256, eos_token_ids=[2])
    a = s.submit([5, 6], SamplingParams(max_new_tokens=8))
    p1 = s.plan()
    p2 = s.plan(ahead=p1)
    assert [e.token for e in s.commit(p1, {a: 2})] == [2]  # end of sequence
    assert s.commit(p2, {a: 9}) == []  # the speculative step's token is dropped
    assert s.status(a).generated == [2] and s.pending() == 0 and s._used[0] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=8), st.integers(1, 6), st.integers(2, 9),
       st.lists(st.integers(0, 4), min_size=1, max_size=30), st.integers(1, 4))
def test_pipelined_scheduler_serves_every_request_exactly_its_tokens(lens, new, budget, eos_at, decode_steps):
    """Conservation with one step always in flight (and multi-step decode): every request ends with exactly
    its tokens (or at its end-of-sequence), positions advance by one per token, and blocks return to the pool."""
    s = Scheduler([0, 1, 2], kv_blocks=24, block_size=4, max_context=256, step_tokens=budget, eos_token_ids=[99],
                  decode_steps=decode_steps)
    rids = [s.submit(list(range(n)), SamplingParams(max_new_tokens=new)) for n in lens]
    seen: dict[str, list[int]] = {r: [] for r in rids}
    flying, i = None, 0
    for _ in range(500):
        nxt = s.plan(ahead=flying)
        if flying is not None:
            assert flying.steps == 1 or not flying.has_prefill
            sampled = {}
            for items in flying.items.values():
                for it in items:
                    if it.sample is not None:  # tokens that encode their positions (99: end of sequence)
                        toks = []
                        for j in range(flying.steps):
                            i += 1
                            toks.append(99 if eos_at[i % len(eos_at)] == 0 else it.sample.position + j)
                        sampled[it.seq_id] = tuple(toks)
            for ev in s.commit(flying, sampled):
                seen[ev.request_id].append(ev.token)
        flying = None if nxt.empty else nxt
        if flying is None and not s.pending():
            break
    assert s.pending() == 0
    for r, n in zip(rids, lens):
        toks = seen[r]
        assert 1 <= len(toks) <= new and (len(toks) == new or toks[-1] == 99)
        assert all(t == n + j for j, t in enumerate(toks) if t != 99)  # each sampled for its own position
    assert all(v == 0 for v in s._used.values())
    assert s.seqs == {} and sorted(s.finished) == sorted(rids)  # finished ones leave the live set


def test_sampling_is_greedy_at_zero_temperature_and_seeded_otherwise():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = sample(logits, [SampleSpec(0.0, 1.0, 0, 5)] * 3)
    assert greedy == logits.argmax(-1).tolist()
    spec = [SampleSpec(1.0, 0.9, 123, 7), SampleSpec(1.0, 0.9, 123, 8), SampleSpec(0.7, 1.0, 9, 7)]
    assert sample(logits, spec) == sample(logits, spec)  # a rerun step samples the same tokens
    many = {sample(logits[:1], [SampleSpec(1.0, 0.9, s, 1)])[0] for s in range(200)}
    assert len(many) > 3
    # top_p=tiny keeps only the most likely token
    assert sample(logits, [SampleSpec(1.0, 1e-6, s, 1) for s in range(3)]) == greedy
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=1, top_p=0.0)


def test_multi_step_decode_plans_bounded_sub_steps_only_for_pure_decode():
    """Multi-step decode: a step of decode items only (nothing waiting) runs up to ``decode_steps`` tokens per
    sequence, bounded by the fewest any sequence still needs; a prefill or a waiting request keeps one; the
    lookahead plan continues after every in-flight sub-step; an end of sequence drops the rest."""
    s = Scheduler([0], kv_blocks=16, block_size=4, max_context=256, decode_steps=4, eos_token_ids=[2])
    a = s.submit([5, 6], SamplingParams(max_new_tokens=9))
    b = s.submit([7], SamplingParams(max_new_tokens=3))
    p1 = s.plan()
    assert p1.steps == 1 and p1.has_prefill  # prefill: one step
    s.commit(p1, {a: 10, b: 20})
    p2 = s.plan()
    assert p2.steps == 2  # b needs 2 more tokens: no sequence runs past its reservation
    assert [(it.seq_id, it.start, it.sample.position) for it in p2.items[0]] == [(a, 2, 3), (b, 1, 2)]
    p3 = s.plan(ahead=p2)  # b's last tokens are in flight; a continues after both sub-steps
    assert [(it.seq_id, it.start, it.deferred, it.sample.position) for it in p3.items[0]] == [(a, 4, True, 5)]
    assert p3.steps == 4
    with pytest.raises(ValueError, match="1 tokens for a step of 2"):
        s.commit(p2, {a: (11,), b: (21, 22)})
    ev = s.commit(p2, {a: (11, 12), b: (21, 22)})
    assert [(e.token, e.finished) for e in ev] == [(11, False), (12, False), (21, False), (22, True)]
    assert s.seqs[a].cached == 4 and s.status(b).state.value == "FINISHED"
    ev = s.commit(p3, {a: (13, 2, 14, 15)})  # end of sequence at the second sub-step: the rest dropped
    assert [e.token for e in ev] == [13, 2] and ev[-1].finished and s.status(a).generated == [10, 11, 12, 13, 2]
    assert s.pending() == 0 and s._used[0] == 0
    c = s.submit([1, 2, 3], SamplingParams(max_new_tokens=8))
    s.commit(s.plan(), {c: 3})
    d = s.submit([4], SamplingParams(max_new_tokens=8))
    s.kv_blocks = 0  # d waits for blocks: c decodes one token per step meanwhile
    assert s.plan().steps == 1
    with pytest.raises(ValueError, match="decode_steps=0"):
        Scheduler([0], kv_blocks=4, block_size=4, max_context=64, decode_steps=0)


def test_a_sequence_one_token_from_its_end_does_not_shorten_the_step():
    """Two sub-steps a step (the CUDA default): a sequence with one token left still runs both (its second sample
    lands past its last token, within its reservation, and is dropped at commit), so the others keep their two
    tokens a step; a sequence whose expert counts are kept, or whose extra positions would pass its reserved blocks,
    shortens the step as before."""
    s = Scheduler([0], kv_blocks=16, block_size=4, max_context=256, decode_steps=2)
    a = s.submit([5, 6], SamplingParams(max_new_tokens=9))
    b = s.submit([7], SamplingParams(max_new_tokens=2))
    s.commit(s.plan(), {a: 10, b: 20})
    p = s.plan()
    assert p.steps == 2 and [it.seq_id for it in p.items[0]] == [a, b]
    ev = s.commit(p, {a: (11, 12), b: (21, 22)})
    assert [(e.request_id, e.token, e.finished) for e in ev] == [(a, 11, False), (a, 12, False), (b, 21, True)]
    assert s.status(b).generated == [20, 21] and s._used[0] == s.blocks(2 + 9)
    c = s.submit([8], SamplingParams(max_new_tokens=2, expert_stats=True))
    s.commit(s.plan(), {a: 13, c: 30})
    assert s.plan().steps == 1  # c's counts would count its dropped sample's rows
    t = Scheduler([0], kv_blocks=16, block_size=4, max_context=256, decode_steps=4)
    d, e = t.submit([1, 2], SamplingParams(max_new_tokens=9)), t.submit([3], SamplingParams(max_new_tokens=3))
    t.commit(t.plan(), {d: 4, e: 5})
    assert t.plan().steps == 2  # e: 2 left, its reservation's block full: 4 sub-steps would write past it
    u = Scheduler([0], kv_blocks=16, block_size=8, max_context=256, decode_steps=4)
    f, g = u.submit([1, 2], SamplingParams(max_new_tokens=9)), u.submit([3], SamplingParams(max_new_tokens=2))
    u.commit(u.plan(), {f: 4, g: 5})
    assert u.plan().steps == 4  # g: 1 left, 2 positions past its 3 reserved: within its one block of 8
    v = Scheduler([0], kv_blocks=16, block_size=8, max_context=4, decode_steps=4)
    h, k = v.submit([1, 2], SamplingParams(max_new_tokens=2)), v.submit([3], SamplingParams(max_new_tokens=2))
    v.commit(v.plan(), {h: 4, k: 5})
    assert v.plan().steps == 1  # past the model's 4 positions: never


def test_finished_sequences_leave_the_live_set_and_their_record_is_bounded():
    """A long-running server: per-step work and memory follow the live requests, not every request served."""
    s = Scheduler([0, 1], kv_blocks=64, block_size=4, max_context=256, keep_finished=8)
    served = 0
    for _ in range(50):
        rids = [s.submit([1, 2, 3], SamplingParams(max_new_tokens=2)) for _ in range(10)]
        while s.pending():
            plan = s.plan()
            sampled = {it.seq_id: 5 for its in plan.items.values() for it in its if it.sample is not None}
            served += sum(ev.finished for ev in s.commit(plan, sampled))
        assert s.seqs == {} and len(s.finished) == 8
    assert served == 500 and all(v == 0 for v in s._used.values())
    assert s.status(rids[-1]).generated == [5, 5] and s.status(rids[-1]).state is SeqState.FINISHED
    assert s.status(rids[0]) is None and s.status("req-0") is None  # the oldest records were dropped
    with pytest.raises(ValueError, match="keep_finished=-1"):
        Scheduler([0], kv_blocks=4, block_size=4, max_context=64, keep_finished=-1)


@pytest.mark.parametrize("keep", [0, 4])
def test_a_finished_request_id_is_refused_while_a_step_for_it_may_still_commit(keep):
    s = Scheduler([0], kv_blocks=16, block_size=4, max_context=256, eos_token_ids=[2], keep_finished=keep)
    s.submit([5, 6], SamplingParams(max_new_tokens=8), request_id="x")
    p1 = s.plan()
    p2 = s.plan(ahead=p1)  # a decode step for x, planned before x's end of sequence is known
    assert [it.seq_id for it in p2.items[0]] == ["x"]
    assert [e.finished for e in s.commit(p1, {"x": 2})] == [True]
    with pytest.raises(ValueError, match="request_id='x' is already in use"):
        s.submit([1], SamplingParams(max_new_tokens=1), request_id="x")
    assert s.commit(p2, {"x": 9}) == []  # the old step's token goes nowhere
    p3 = s.plan()  # carries x's free to its rank
    assert p3.free[0] == ("x",)
    s.commit(p3, {})
    if keep:  # still in the finished record: refused by name until it ages out
        with pytest.raises(ValueError, match="recently finished"):
            s.submit([1], SamplingParams(max_new_tokens=1), request_id="x")
    else:  # nothing in flight can name it any more: the id is free again
        assert s.submit([1], SamplingParams(max_new_tokens=1), request_id="x") == "x"
        assert s.status("x").state is SeqState.WAITING and s.status("x").generated == []


def test_kv_capacity_names_a_running_limit_the_cache_cannot_hold():
    """The start's capacity record: tokens per running sequence and whole-context sequences from a rank's blocks;
    the warning only where each running sequence gets fewer than THIN_KV_TOKENS_PER_SEQUENCE tokens
    (the 48-layer Qwen3-30B-A3B shape's caches on an H100 and an H200, measured at f048dfe / 76a48a1)."""
    h100 = KvCapacity(5286 * 16, 256, 40_960)
    assert h100.tokens_per_sequence == 330 and round(h100.full_context_sequences, 2) == 2.06
    assert "84,576 tokens a rank" in h100.note() and "2.06 sequences" in h100.note()
    thin = h100.warning()
    assert thin is not None and "330 tokens each" in thin and "--gpu-memory-utilization" in thin
    h200 = KvCapacity(647_472, 256, 40_960)
    assert h200.tokens_per_sequence == 2529 and h200.warning() is None
    edge = KvCapacity(THIN_KV_TOKENS_PER_SEQUENCE * 8, 8, 4096)
    assert edge.warning() is None and KvCapacity(edge.kv_tokens - 1, 8, 4096).warning() is not None
