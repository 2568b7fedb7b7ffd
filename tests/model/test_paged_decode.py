"""The in-place decode path of the varlen backend (model/paged_decode.py) on CPU: the reference kernel against
the per-sequence varlen reference over gathered contexts, the split rule, and a host whose decode steps read
the cache in place (the reference standing in for the Triton kernel) equal to the masked path. The Triton
kernel itself runs in tests/model/test_paged_decode_gpu.py."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.types import AttentionBackend
from ray_moe.model.attention import sequence_reference
from ray_moe.model.host import ModelHost
from ray_moe.model.kv import SeqChunk
from ray_moe.model.paged_decode import BLOCK_N, MAX_SPLITS, check_paged, decode_splits, paged_decode_reference
from ray_moe.model.source import HFWeightSource
from ray_moe_dev.testing.local_executor import LocalExecutor


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.sampled_from([(4, 2, 8, 8), (2, 2, 8, 4)]),
       st.integers(0, 1000))
def test_reference_equals_varlen_reference_over_gathered_contexts(lens, shape, seed):
    """Sequence i's one query over the keys at its scattered slots == the varlen contract (one query row per
    sequence, its context packed); GQA and a narrower value head; a sequence without keys is zero."""
    hq, hk, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    cap = sum(lens) + 7
    k_cache = torch.randn(cap, hk, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(cap, hk, dv, generator=g, dtype=torch.float64)
    slots = torch.randperm(cap, generator=g)[: sum(lens)]
    q = torch.randn(len(lens), hq, d, generator=g, dtype=torch.float64)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    got = paged_decode_reference(q, k_cache, v_cache, slots, cu_k, max(lens), 0.4)
    k, v = k_cache[slots], torch.nn.functional.pad(v_cache[slots], (0, d - dv))
    cu_q = torch.arange(len(lens) + 1, dtype=torch.int32)
    want = sequence_reference(q, k, v, cu_q, cu_k, 1, max(lens), 0.4)[..., :dv]
    torch.testing.assert_close(got, want)
    for i, n in enumerate(lens):
        if n == 0:
            assert got[i].abs().max() == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5)), min_size=1, max_size=6), st.integers(0, 1000))
def test_segments_with_room_equal_the_same_keys_packed(segs, seed):
    """``k_end``: sequence i reads slots[cu_k[i]:k_end[i]] of a segment with ``room`` unused entries after it (a
    multi-step decode plan) == the same keys packed back to back (``cu_k`` alone)."""
    lens, room = [n for n, _ in segs], [r for _, r in segs]
    g = torch.Generator().manual_seed(seed)
    cap = sum(lens) + sum(room) + 3
    k_cache = torch.randn(cap, 2, 8, generator=g, dtype=torch.float64)
    v_cache = torch.randn(cap, 2, 8, generator=g, dtype=torch.float64)
    perm = torch.randperm(cap, generator=g)
    q = torch.randn(len(lens), 4, 8, generator=g, dtype=torch.float64)
    starts = np.concatenate([[0], np.cumsum([n + r for n, r in segs])])
    roomy = perm[: int(starts[-1])]
    packed = torch.cat([roomy[int(a):int(a) + n] for a, n in zip(starts, lens)])
    cu_k = torch.tensor(starts, dtype=torch.int32)
    k_end = cu_k[:-1] + torch.tensor(lens, dtype=torch.int32)
    got = paged_decode_reference(q, k_cache, v_cache, roomy, cu_k, max(lens), 0.3, k_end)
    want = paged_decode_reference(q, k_cache, v_cache, packed,
                                  torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32),
                                  max(lens), 0.3)
    torch.testing.assert_close(got, want)


def test_split_rule_is_static_and_bounded():
    assert decode_splits(256, 4, 4096) == 1  # a full batch fills the device with one program per (row, head)
    assert decode_splits(1, 4, 64) == 1  # one key block: nothing to split
    assert decode_splits(1, 4, 100_000) == MAX_SPLITS
    assert decode_splits(4, 4, 4 * 2 * BLOCK_N) == 4  # capped by the longest context's key blocks
    for rows in (1, 3, 16, 100, 512):
        for max_k in (1, 63, 500, 9000):
            s = decode_splits(rows, 8, max_k)
            assert s & (s - 1) == 0 and 1 <= s <= MAX_SPLITS


def test_check_names_what_it_cannot_serve():
    assert "needs CUDA" in check_paged(torch.device("cpu"), torch.bfloat16, 4, 2, 8)
    assert "float16 / bfloat16" in check_paged(torch.device("cuda"), torch.float32, 4, 2, 8)
    assert "heads 4/3" in check_paged(torch.device("cuda"), torch.bfloat16, 4, 3, 8)


def _hosts(folder, calls):
    def decode(*a):
        calls.append(("decode", int(a[0].shape[0])))
        return paged_decode_reference(*a)

    def varlen(*a):
        calls.append(("varlen", int(a[0].shape[0])))
        return sequence_reference(*a)

    masked = ModelHost.from_checkpoint(folder, attention=AttentionBackend.MASKED, kv_tokens=512)
    paged = ModelHost.from_checkpoint(folder, attention=AttentionBackend.VARLEN, varlen_kernel=varlen,
                                      decode_kernel=decode, kv_tokens=512)
    return masked, paged


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_decode_rows_read_the_cache_in_place(hf_checkpoint, family):
    """Prefill, a mixed step (its leading one-row sequence read in place, the chunks over their gathered
    contexts), a decode step (every row in place) and a decode graph's rows (padded to 8: padding rows one
    trash key each, the slot vector a prefix of a longer one, the static context bound): every step's logits
    equal the masked path's, and each layer ran the decode kernel on the one-row rows only."""
    import numpy as np

    from ray_moe.core.types import AttentionBackend as B
    from ray_moe.model.attention import AttentionPlan, InlineAttention
    from ray_moe.model.kv import StepRows

    _, folder = hf_checkpoint(family)
    calls: list = []
    masked, paged = _hosts(folder, calls)
    assert paged.paged_decode and paged.decode_reason is None and not masked.paged_decode
    ex = types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(folder)).moe_forward)
    g = torch.Generator().manual_seed(0)
    layers = paged.config.num_hidden_layers
    steps = [[SeqChunk("a", 0, 5), SeqChunk("b", 0, 9)],
             [SeqChunk("a", 5, 1), SeqChunk("b", 9, 4), SeqChunk("c", 0, 7)],
             [SeqChunk("a", 6, 1), SeqChunk("b", 13, 1), SeqChunk("c", 7, 1)]]
    want_calls = [[("varlen", 14)], [("decode", 1), ("varlen", 11)], [("decode", 3)]]
    for chunks, want in zip(steps, want_calls):
        ids = torch.randint(0, masked.vocab_size, (sum(c.num_tokens for c in chunks),), generator=g)
        outs = []
        for host in (masked, paged):
            for c in chunks:
                host.kv.reserve(c.seq_id, c.start + c.num_tokens + 4)
            calls.clear()
            outs.append(host.forward(chunks, ids, ex))
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
        assert calls == want * layers
    # a decode graph's rows: 8 rows (5 padding sequences), the slots copied into a longer static vector
    chunks = [SeqChunk("a", 7, 1), SeqChunk("b", 14, 1), SeqChunk("c", 8, 1)]
    inp = paged.kv.plan_decode_graph(chunks, 8, 1, np.asarray([5, 6, 7]))[0]
    static = torch.full((1024,), paged.kv.trash_slot, dtype=torch.int64)
    static[: inp["read_index"].numel()] = inp["read_index"]
    plan = AttentionPlan(8, B.VARLEN, cu_k=inp["cu_k"], max_k=4096, single_rows=8, slots=static, k_end=inp["k_end"])
    calls.clear()
    got = paged.forward_rows(StepRows.of(inp, 8), InlineAttention(plan, paged.kernels), ex)
    want = masked.forward(chunks, torch.tensor([5, 6, 7]), ex)
    torch.testing.assert_close(got[:3], want, atol=2e-5, rtol=1e-4)
    assert calls == [("decode", 8)] * layers


def test_a_latent_cache_is_never_read_in_place(hf_checkpoint):
    """DeepSeek's MLA expands the latent it caches before attending: its host gathers every context (no decode
    kernel, said why), and a caller's varlen kernel keeps the gathered path too."""
    _, folder = hf_checkpoint("deepseek_v3")
    masked, paged = _hosts(folder, [])
    assert paged.latent_cache and not paged.paged_decode and "latent cache" in paged.decode_reason
    _, folder = hf_checkpoint("qwen3_moe")
    host = ModelHost.from_checkpoint(folder, attention=AttentionBackend.VARLEN, varlen_kernel=sequence_reference,
                                     kv_tokens=64)
    assert not host.paged_decode and "caller's varlen kernel" in host.decode_reason


@pytest.mark.parametrize("kv_heads", [1, 4, 8, 32])
def test_one_row_at_each_power_of_two_context_bound_takes_each_split_count(kv_heads):
    """What the lattice's start-time warm-up of the in-place kernel relies on (``StepGraphRunner``): one row with
    a context bound of 2 x BLOCK_N x t keys takes exactly t splits, for every split count a step can take, so
    warming those five calls compiles every variant a piecewise step's holes can meet."""
    seen = {decode_splits(rows, kv_heads, k) for rows in (1, 3, 64, 256) for k in (1, 100, 1000, 5000, 40960)}
    got = {decode_splits(1, kv_heads, 2 * BLOCK_N * t) for t in (1, 2, 4, 8, 16)}
    assert got == {1, 2, 4, 8, 16} and seen <= got
