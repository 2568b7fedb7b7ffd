"""A step's host index vectors (``model/kv_host.py`` through ``PagedKVCache``): every entry equals the slot lookup
it stands for, one chunk at a time, for mixed chunks, padded varlen plans and the split (one-row group) plan;
the records' direct constructors equal ``dataclasses.replace``; the chained block hashes equal ``block_hash``'s."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
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


def test_host_plan_vectors_are_the_chunks_slots_in_packed_order():
    kv = _cache(CHUNKS)
    v = kv._host_plan(CHUNKS)
    assert v["read"].tolist() == [s for c in CHUNKS for s in kv.slots(c.seq_id, 0, c.start + c.num_tokens).tolist()]
    assert v["write"].tolist() == [s for c in CHUNKS for s in kv.slots(c.seq_id, c.start, c.start + c.num_tokens).tolist()]
    assert v["q_pos"].tolist() == [p for c in CHUNKS for p in range(c.start, c.start + c.num_tokens)]
    assert v["k_pos"].tolist() == [p for c in CHUNKS for p in range(c.start + c.num_tokens)]
    assert v["q_seq"].tolist() == [i for i, c in enumerate(CHUNKS) for _ in range(c.num_tokens)]
    assert v["last"].tolist() == (np.cumsum([c.num_tokens for c in CHUNKS]) - 1).tolist()
    assert kv._host_plan([])["read"].size == 0


def test_padded_and_split_varlen_plans_place_each_group_past_its_padding():
    kv = _cache(CHUNKS)
    trash = kv.trash_slot
    reads = [kv.slots(c.seq_id, 0, c.start + c.num_tokens).tolist() for c in CHUNKS]
    writes = [kv.slots(c.seq_id, c.start, c.start + c.num_tokens).tolist() for c in CHUNKS]
    tok = np.arange(32, dtype=np.int64)
    p = kv.plan_padded(CHUNKS, 32, 64, torch.float32, last_rows=8, varlen=True, extra={"token_ids": tok})
    assert p["read_index"].tolist() == sum(reads, []) + [trash] * (64 - 37)
    assert p["write_index"].tolist() == sum(writes, []) + [trash] * (32 - 14)
    assert p["token_ids"].tolist() == tok.tolist() and int(p["row_valid"].sum()) == 14
    # two one-row sequences first (padded to 4 rows), the other chunks after; group 1 read in place
    for paged_keys in (0, 16):
        s = kv.plan_padded(CHUNKS, 4 + 16, 64, torch.float32, last_rows=4 + 8, varlen=True, single_rows=4,
                           paged_keys=paged_keys, extra={"token_ids": tok[:20]})
        g1 = reads[0] + reads[1]
        off2 = paged_keys or len(g1) + 2
        read = s["read_index"].tolist()
        assert read[:len(g1)] == g1 and set(read[len(g1):off2]) == {trash}
        assert read[off2:off2 + 37 - len(g1)] == sum(reads[2:], [])
        assert s["write_index"].tolist()[:4] == writes[0] + writes[1] + [trash] * 2
        assert s["write_index"].tolist()[4:16] == sum(writes[2:], []) and s["positions"].tolist()[:2] == [9, 3]
        assert s["last"].tolist()[:5] == [0, 1, 2 + 2 + 6, 2 + 2 + 6, 2 + 2 + 11]


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
    plans = kv.plan_decode_steps(chunks, rows, keys, steps, extra={"token_ids": ids})
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
        kv.plan_decode_steps(chunks, len(chunks), sum(c.start + steps for c in chunks) - 1, steps)


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
