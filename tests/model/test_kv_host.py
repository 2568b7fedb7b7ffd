"""A step's plan (``PagedKVCache.plan_step`` / ``plan_decode_graph``, host vectors of ``model/kv_host.py``): every
entry equals the slot lookup it stands for, one chunk at a time, padded rows after the real ones, for each backend
and the in-place one-row group; the records' direct constructors equal ``dataclasses.replace``; the chained block
hashes equal ``block_hash``'s."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.model.kv import PagedKVCache, SeqChunk
from ray_moe.model.prefix_cache import block_hash, chain_hashes
from ray_moe.model.sampling import SampleSpec
from ray_moe.shard.records import WorkItem


def _cache(chunks: list[SeqChunk]) -> PagedKVCache:
    kv = PagedKVCache(256, 4)
    for c in chunks:  # interleaved reservations: every sequence's blocks are scattered
        kv.reserve(c.seq_id, c.start // 2 + 1)
    for c in chunks:
        kv.reserve(c.seq_id, c.start + c.num_tokens)
    return kv


CHUNKS = [SeqChunk("a", 9, 1), SeqChunk("b", 3, 1), SeqChunk("c", 0, 7), SeqChunk("d", 5, 0), SeqChunk("e", 6, 5)]


@pytest.mark.parametrize("backend,paged", [("masked", False), ("varlen", False), ("varlen", True)])
def test_a_step_plan_is_the_chunks_slots_in_packed_order(backend, paged):
    """``plan_step``: every row's write slot and position equal the slot lookups of its chunk, padding rows
    after the real ones write the trash slot at position 0, ``last`` is each chunk's last row; the attention
    plan gathers every context in packed order, or (``paged``) reads the leading one-row sequences' slots in
    place and gathers the others', with offsets into each."""
    from ray_moe.core.types import AttentionBackend

    kv = _cache(CHUNKS[:3] + CHUNKS[4:])
    chunks = [c for c in CHUNKS if c.num_tokens]  # a (1), b (1), c (7), e (5)
    reads = [kv.slots(c.seq_id, 0, c.start + c.num_tokens).tolist() for c in chunks]
    writes = [kv.slots(c.seq_id, c.start, c.start + c.num_tokens).tolist() for c in chunks]
    ids = np.arange(14, dtype=np.int64) + 7
    rows, plan = kv.plan_step(chunks, ids, AttentionBackend(backend), paged=paged, rows=20, last_rows=6)
    trash = kv.trash_slot
    assert rows.write_index.tolist() == sum(writes, []) + [trash] * 6
    assert rows.positions.tolist() == [p for c in chunks for p in range(c.start, c.start + c.num_tokens)] + [0] * 6
    assert rows.token_ids.tolist() == ids.tolist() + [0] * 6 and rows.row_valid.tolist() == [True] * 14 + [False] * 6
    assert rows.last.tolist() == [0, 1, 8, 13, 0, 0] and plan.rows == 14
    if backend == "masked":
        assert plan.gather.tolist() == sum(reads, []) and plan.mask.shape == (1, 1, 14, len(sum(reads, [])))
        return
    assert plan.cu_q.tolist() == [0, 1, 2, 9, 14] and plan.max_q == 7 and plan.single_rows == 2
    if paged:
        assert plan.slots.tolist() == reads[0] + reads[1] and plan.gather.tolist() == reads[2] + reads[3]
        assert plan.cu_k.tolist() == [0, 10, 14, 0, 7, 18]
    else:
        assert plan.slots is None and plan.gather.tolist() == sum(reads, [])
        assert plan.cu_k.tolist() == [0, 10, 14, 21, 32]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True), st.integers(1, 5), st.integers(0, 3))
def test_a_decode_plan_of_several_sub_steps_reads_each_sub_steps_context(starts, steps, pad_rows):
    """``plan_decode_steps``: sub-step j of sequence i writes and reads position start_i + j: its write slot,
    position and keys (``read_index[cu_k[i]:k_end[i]]``) equal the slot lookups of positions 0 .. start_i + j;
    a padding row writes the trash slot at position 0 and reads one trash key; every sub-step shares one slot
    vector, and sub-step 0 carries the given token ids (the later ones zeros, filled on the device)."""
    chunks = [SeqChunk(f"s{i}", p, 1) for i, p in enumerate(starts)]
    kv = PagedKVCache(1024, 4)
    for c in chunks:  # interleaved: scattered blocks
        kv.reserve(c.seq_id, c.start // 2 + 1)
    for c in chunks:
        kv.reserve(c.seq_id, c.start + steps)
    rows = len(chunks) + pad_rows
    keys = sum(c.start + steps for c in chunks) + pad_rows + 3
    ids = np.arange(rows, dtype=np.int64) + 100
    from ray_moe.model.kv_host import plan_decode_steps

    hc = kv._chunks([SeqChunk(x.seq_id, x.start, steps) for x in chunks])
    plans = plan_decode_steps(hc, steps, rows, keys, kv.trash_slot, kv.device, {"token_ids": ids})
    assert len(plans) == steps
    trash = kv.trash_slot
    for j, p in enumerate(plans):
        assert p["read_index"] is plans[0]["read_index"]
        read, cu, end = p["read_index"].tolist(), p["cu_k"].tolist(), p["k_end"].tolist()
        assert p["cu_q"].tolist() == list(range(rows + 1))
        assert p["row_valid"].tolist() == [True] * len(chunks) + [False] * pad_rows
        assert p["token_ids"].tolist() == (ids.tolist() if j == 0 else [0] * rows)
        for i, c in enumerate(chunks):
            assert read[cu[i]:end[i]] == kv.slots(c.seq_id, 0, c.start + j + 1).tolist()
            assert p["write_index"][i] == kv.slots(c.seq_id, c.start + j, c.start + j + 1)[0]
            assert p["positions"][i] == c.start + j
        for i in range(len(chunks), rows):
            assert read[cu[i]:end[i]] == [trash] and p["write_index"][i] == trash and p["positions"][i] == 0
    with pytest.raises(ValueError, match=f"steps={steps}"):  # the keys cannot hold every sub-step's context
        plan_decode_steps(hc, steps, len(chunks), sum(x.start + steps for x in chunks) - 1, kv.trash_slot, kv.device)
    # the decode graph's plan: the same, over exactly the slots it uses (a prefix of the graph's slot vector)
    graph = kv.plan_decode_graph(chunks, rows, steps, ids[:len(chunks)])
    assert graph[0]["read_index"].numel() == sum(x.start + steps for x in chunks) + pad_rows
    assert graph[0]["token_ids"].tolist() == ids[:len(chunks)].tolist() + [0] * pad_rows


def test_direct_constructors_equal_dataclasses_replace():
    sp = SampleSpec(0.7, 0.9, 5, 40, 0.1, 0.2, 1.1, 12, (3, 4), 50, 2, ((1, 0.5),))
    assert sp.at(43) == dataclasses.replace(sp, position=43)
    it = WorkItem("s", (), 40, sp, True, True, True, True)
    assert it.resolved(7) == dataclasses.replace(it, tokens=(7,), deferred=False)
    assert it.substep(3) == dataclasses.replace(it, tokens=(), start=43, decode=True, deferred=True,
                                                sample=dataclasses.replace(sp, position=43))
    assert {f.name for f in dataclasses.fields(WorkItem)} == {"seq_id", "tokens", "start", "sample", "decode",
                                                             "deferred", "keep_tokens", "expert_stats"}
    assert len(dataclasses.fields(SampleSpec)) == 12  # (a new field: ``SampleSpec.at`` passes it on too)


def test_chain_hashes_equal_block_hashes_chained():
    toks = tuple(range(1000, 1037))
    want, parent = [], 77
    for i in range(37 // 4):
        parent = block_hash(parent, toks[i * 4:(i + 1) * 4])
        want.append(parent)
    assert chain_hashes(77, toks, 4) == want and chain_hashes(None, list(toks[:3]), 4) == []
    assert chain_hashes(None, toks, 4)[0] == block_hash(None, toks[:4])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 30)), min_size=0, max_size=12),
       st.integers(1, 40), st.integers(0, 50))
def test_expansion_runs_partition_the_sequences_within_their_bound(seqs, bound, base):
    """``expand_groups``: consecutive runs covering every sequence once, in order; each run's rows and keys the
    cumulative sums of its sequences' (keys from ``base``); a run over the bound holds one sequence; no two
    neighbouring runs could have been one; None exactly where every key fits one run (or there is one sequence)."""
    from ray_moe.model.kv import expand_groups

    lens = np.array([q for q, _ in seqs], dtype=np.int64)
    ends = np.array([q + e for q, e in seqs], dtype=np.int64)  # a context holds its own rows
    groups = expand_groups(lens, ends, base, bound)
    if len(seqs) < 2 or int(ends.sum()) <= bound:
        assert groups is None
        return
    assert groups is not None and len(groups) > 1
    cq, ck = np.concatenate([[0], np.cumsum(lens)]), np.concatenate([[0], np.cumsum(ends)])
    assert groups[0].seq_lo == 0 and groups[-1].seq_hi == len(seqs)
    for g, h in zip(groups, groups[1:]):
        assert g.seq_hi == h.seq_lo
        assert (g.k_hi - g.k_lo) + int(ends[h.seq_lo]) > bound  # the next sequence did not fit this run
    for g in groups:
        assert g.seq_lo < g.seq_hi
        assert (g.q_lo, g.q_hi) == (cq[g.seq_lo], cq[g.seq_hi])
        assert (g.k_lo, g.k_hi) == (base + ck[g.seq_lo], base + ck[g.seq_hi])
        assert g.k_hi - g.k_lo <= bound or g.seq_hi - g.seq_lo == 1
        assert (g.max_q, g.max_k) == (lens[g.seq_lo:g.seq_hi].max(), ends[g.seq_lo:g.seq_hi].max())
