"""Prefix caching on a shard (``shard/prefix.py``): prefill chunks cut past their sequence's cached blocks, never
the block of a sampled chunk's last token, reruns cut the same, blocks named once written; and through the
driver's real generation loop over in-process shards, greedy tokens equal with prefix caching on and off (and
equal to transformers' own greedy generate), with the hit counters equal to the shared full-block tokens."""

from __future__ import annotations

import pytest
import torch
from ray_moe_dev.testing.hf_models import tiny_model
from ray_moe_dev.testing.inprocess import InProcessDeployment, serve_requests

import ray_moe
from ray_moe.model.kv import PagedKVCache
from ray_moe.model.sampling import SampleSpec, SamplingParams
from ray_moe.shard.prefix import ShardPrefixes
from ray_moe.shard.records import WorkItem

SPEC = SampleSpec(0.0, 1.0, 0, 0)


def _chunk(sid: str, tokens, start: int, sample: bool) -> WorkItem:
    return WorkItem(sid, tuple(tokens), start, SPEC if sample else None, False)


def _step(pre: ShardPrefixes, kv: PagedKVCache, items: list[WorkItem], reuse: bool = True):
    """One step as the executor runs it: trim, reserve the cut items, (forward), commit the uncut ones (with the
    trim's hashes, ``reuse``, as the executor passes them)."""
    cut = pre.trim(kv, items, [])
    for it in cut.items:
        kv.reserve(it.seq_id, it.start + len(it.tokens))
    pre.commit(kv, items, cut.hashed if reuse else None)
    return cut


def test_commit_reuses_the_trims_hashes_and_names_the_same_blocks(monkeypatch):
    """Each step's prompt blocks are hashed once (the lookup's hashes registered at commit): the blocks named,
    what later prompts find, equal hashing again at commit, with hits, chunks and a block two chunks fill."""
    import ray_moe.shard.prefix as prefix

    calls = []
    real = prefix.chain_hashes
    monkeypatch.setattr(prefix, "chain_hashes", lambda *a: calls.append(len(a[1])) or real(*a))
    prompt = list(range(100, 118))  # 18 tokens: four full blocks of 4
    steps = [[_chunk("a", prompt, 0, True)], [_chunk("b", prompt[:10], 0, False)],
             [_chunk("b", prompt[10:], 10, True)], [_chunk("c", prompt + [5, 6, 7], 0, True)]]
    named, counts = {}, {}
    for reuse in (True, False):
        kv, pre = PagedKVCache(32, 4), ShardPrefixes()
        calls.clear()
        cuts = [_step(pre, kv, items, reuse) for items in steps]
        named[reuse] = ({s: kv.valid_hashes(s) for s in "abc"}, [(c.cached, c.looked_up) for c in cuts])
        counts[reuse] = len(calls)
    assert named[True] == named[False] and named[True][0]["a"]
    assert counts[True] < counts[False]
    assert named[True][1][3][0] == {"c": 16}  # c finds a's four named blocks


def test_a_second_prompt_skips_the_shared_blocks_but_never_its_last_tokens_block():
    kv, pre = PagedKVCache(16, 4), ShardPrefixes()
    prompt = list(range(100, 112))  # 12 tokens: three full blocks
    first = _step(pre, kv, [_chunk("a", prompt, 0, True)])
    assert first.cached == {} and first.looked_up == 12 and first.items[0].start == 0
    assert kv.valid_tokens("a") == 8  # block 2 holds the sampled last token: never named
    again = _step(pre, kv, [_chunk("b", prompt, 0, True)])  # the same prompt: its last token is computed
    (it,) = again.items
    assert (it.start, it.tokens) == (8, tuple(prompt[8:])) and again.cached == {"b": 8}
    assert kv.slots("b", 0, 8).tolist() == kv.slots("a", 0, 8).tolist()  # shared
    assert set(kv.slots("b", 8, 12).tolist()).isdisjoint(kv.slots("a", 8, 12).tolist())  # private
    longer = _step(pre, kv, [_chunk("c", prompt + [7, 7], 0, True)])  # 14 tokens: blocks 0, 1 shared, 2 not named
    assert longer.cached == {"c": 8} and longer.items[0].start == 8
    other = _step(pre, kv, [_chunk("d", [1] + prompt[1:], 0, True)])  # first token differs: nothing shared
    assert other.cached == {} and other.items[0].start == 0


def test_chunks_continue_the_lookup_and_a_block_two_chunks_fill_is_named():
    kv, pre = PagedKVCache(16, 4), ShardPrefixes()
    prompt = list(range(20, 34))  # 14 tokens
    _step(pre, kv, [_chunk("a", prompt[:6], 0, False)])  # block 0 named; tokens 4, 5 wait for the next chunk
    assert kv.valid_tokens("a") == 4
    _step(pre, kv, [_chunk("a", prompt[6:], 6, True)])  # block 1 (positions 4..7) spans both chunks
    assert kv.valid_tokens("a") == 12  # blocks 0-2; block 3 holds the last token
    c1 = _step(pre, kv, [_chunk("b", prompt[:8], 0, False)])  # wholly cached, no sample: runs no rows
    assert c1.items == () and c1.cached == {"b": 8} and c1.looked_up == 8
    c2 = _step(pre, kv, [_chunk("b", prompt[8:], 8, True)])  # the lookup goes on from the sequence's blocks
    assert c2.cached == {"b": 4} and (c2.items[0].start, len(c2.items[0].tokens)) == (12, 2)


def test_a_rerun_step_cuts_the_same_cached_tokens_and_writes_no_shared_block():
    kv, pre = PagedKVCache(16, 4), ShardPrefixes()
    prompt = list(range(40, 50))
    _step(pre, kv, [_chunk("a", prompt, 0, True)])
    items = [_chunk("b", prompt, 0, True), WorkItem("a", (5,), 10, SPEC, True)]
    one = _step(pre, kv, items)
    two = _step(pre, kv, items)  # the same request again (a stale generation, a recovered rank)
    assert one.cached == two.cached == {"b": 8} and one.items == two.items
    assert [it.seq_id for it in one.items] == ["a", "b"]  # one-row items first (the decode token, then b's)
    pre.forget("b")
    kv.free("b")
    assert kv.pool.refs[kv.slots("a", 0, 1)[0] // 4] == 1


def test_disabled_prefix_caching_changes_nothing():
    kv, pre = PagedKVCache(16, 4), ShardPrefixes(enabled=False)
    prompt = list(range(12))
    _step(pre, kv, [_chunk("a", prompt, 0, True)])
    cut = _step(pre, kv, [_chunk("b", prompt, 0, True)])
    assert cut.cached == {} and cut.looked_up == 0 and cut.items[0].start == 0 and kv.valid_tokens("a") == 0


def _prompts(seed: int) -> list[list[int]]:
    """Prompts over a shared 21-token prefix (blocks of 8: two shared full blocks), and one unrelated."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 128, (21,), generator=g).tolist()
    return [base + [5, 6, 7], base + [9], base[:17] + [3] * 5, torch.randint(0, 128, (19,), generator=g).tolist()]


@pytest.mark.parametrize("family,ranks,decode_steps", [("qwen3_moe", 1, 1), ("mixtral", 2, 4)])
def test_greedy_tokens_are_equal_with_and_without_prefix_caching(tmp_path, family, ranks, decode_steps):
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    prompts = _prompts(3)
    new = 6
    ref = [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
           for p in prompts]
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    got, stats = {}, {}
    for on in (True, False):
        dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=ranks,
                                                                        decode_token_capacity=8))
        # the first prompt and the unrelated one (on two ranks: one each), then the two that share the first
        # one's prefix once it is done (its blocks are cached by then)
        handles, stats[on] = serve_requests(dep, [(prompts[0], sp), (prompts[3], sp)],
                                            after=[[(prompts[1], sp), (prompts[2], sp)]],
                                            decode_steps=decode_steps, prefix_caching=on)
        got[on] = [handles[i].result() for i in (0, 2, 3, 1)]
        shard = {k: sum(c.generator.counters.get(k, 0) for c in dep.cores.values())
                 for k in ("prefix_hit_tokens", "prefix_lookup_tokens")}
        assert shard == {"prefix_hit_tokens": stats[on]["prefix"]["hit_tokens"],
                         "prefix_lookup_tokens": stats[on]["prefix"]["lookup_tokens"]}
    assert got[True] == got[False] == ref
    # the second and third prompts each find the first one's two full blocks (16 tokens) on its rank (the
    # driver routes both there: on two ranks the least-loaded rank would take the third); every prompt token is
    # looked up once
    assert stats[True]["prefix"]["hit_tokens"] == 2 * 16
    assert stats[True]["prefix"]["routed"] == (1 if ranks == 2 else 0)
    assert stats[True]["prefix"]["lookup_tokens"] == sum(len(p) for p in prompts)
    assert stats[True]["prefix"]["hit_ratio"] == pytest.approx(32 / sum(len(p) for p in prompts))
    assert stats[False]["prefix"] == {"enabled": False, "hit_tokens": 0, "lookup_tokens": 0, "hit_ratio": None,
                                      "routed": 0}
    assert stats[True]["steps"] < stats[False]["steps"]  # cached chunks take no budget of their own


def test_penalties_read_the_cached_prefix_tokens(tmp_path):
    """A penalized sequence keeps its token ids by position (``keep_tokens``): the cut chunk's cached prefix
    is in that history, so repetition penalties give the same tokens with and without prefix caching."""
    _, folder = tiny_model("qwen3_moe", tmp_path / "m")
    prompts = _prompts(4)[:3]
    sp = SamplingParams(max_new_tokens=6, repetition_penalty=1.5, frequency_penalty=0.5, ignore_eos=True)
    out = {}
    for on in (True, False):
        dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1))
        handles, stats = serve_requests(dep, [(prompts[0], sp)], after=[[(p, sp) for p in prompts[1:]]],
                                        prefix_caching=on)
        out[on] = [h.result() for h in handles]
        assert (stats["prefix"]["hit_tokens"] > 0) == on
    assert out[True] == out[False]


def test_a_reused_sequence_id_with_other_tokens_drops_its_old_blocks():
    """A restarted driver reuses ids its predecessor never freed on the rank: the old valid blocks are not
    this prompt's, so they are dropped (never cut past, never written); a shared one stays intact."""
    kv, pre = PagedKVCache(16, 4), ShardPrefixes()
    old = list(range(12))
    _step(pre, kv, [_chunk("a", old, 0, True)])
    _step(pre, kv, [_chunk("b", old, 0, True)])  # b shares a's two named blocks
    shared = kv.slots("a", 0, 8).tolist()
    cut = _step(pre, kv, [_chunk("a", [9] * 12, 0, True)])  # "a" again, other tokens
    assert cut.cached == {} and cut.items[0].start == 0
    assert set(kv.slots("a", 0, 8).tolist()).isdisjoint(shared)  # fresh blocks: b's are untouched
    assert kv.slots("b", 0, 8).tolist() == shared and kv.valid_tokens("b") == 8
    # a chunk shorter than its sequence's valid blocks cannot show they are its own: dropped too, then looked
    # up afresh (its first block is still cached by name)
    short = _step(pre, kv, [_chunk("b", old[:5], 0, False)])
    assert short.items[0].start == 4 and short.cached == {"b": 4} and kv.valid_tokens("b") == 4
