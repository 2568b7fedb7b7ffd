"""The varlen attention backend (model/attention.py) against the masked reference path, on CPU.

The FlashAttention kernel needs CUDA; here the backend's planning (per-sequence offsets, padded static shapes,
padding sequences, MLA's narrower value heads) runs with ``sequence_reference`` as its kernel and must give the
masked SDPA path's logits. The GPU test (tests/model/test_attention_gpu.py) runs the real kernel.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.errors import ConfigError
from ray_moe.core.types import AttentionBackend
from ray_moe.model.attention import check_flash, sequence_reference, varlen_attention
from ray_moe.model.host import ModelHost
from ray_moe.model.kv import SeqChunk, leading_single_rows, varlen_offsets
from ray_moe.model.source import HFWeightSource
from ray_moe_dev.testing.local_executor import LocalExecutor


def _dense_causal(q, k, v, lq, lk, scale):
    """One sequence, dense: query i of lq sees keys <= lk - lq + i (GQA heads repeated)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(lk)[None, :] <= (lk - lq + torch.arange(lq))[:, None]
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v)


def test_sequence_reference_is_per_sequence_bottom_right_causal():
    g = torch.Generator().manual_seed(3)
    lq, lk = [2, 0, 5, 1], [6, 0, 5, 9]
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32)
    got = sequence_reference(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.3)
    oq = ok = 0
    for a, b in zip(lq, lk):
        if a:
            want = _dense_causal(q[oq:oq + a], k[ok:ok + b], v[ok:ok + b], a, b, 0.3)
            torch.testing.assert_close(got[oq:oq + a], want)
        oq, ok = oq + a, ok + b


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), min_size=1, max_size=6), st.booleans(),
       st.integers(0, 5), st.integers(0, 7))
def test_varlen_offsets_cover_every_row_and_key(seqs, decode, extra_rows, extra_keys):
    """Real sequences first with their own lengths; padding rows and keys all land in padding sequences; the
    sequence count is static (rows for decode, last_rows + 1 for prefill)."""
    if decode:
        lens = np.ones(len(seqs), dtype=np.int64)
        ends = np.asarray([s + 1 for s, _ in seqs], dtype=np.int64)
    else:
        lens = np.asarray([n for _, n in seqs], dtype=np.int64)
        ends = np.asarray([s + n for s, n in seqs], dtype=np.int64)
    rows = int(lens.sum()) + extra_rows
    keys = int(ends.sum()) + (extra_rows if decode else 0) + extra_keys
    last_rows = None if decode else len(seqs) + extra_rows % 3
    cu_q, cu_k = varlen_offsets(lens, ends, rows, keys, last_rows)
    assert cu_q[0] == cu_k[0] == 0 and np.all(np.diff(cu_q) >= 0) and np.all(np.diff(cu_k) >= 0)
    np.testing.assert_array_equal(np.diff(cu_q)[: len(seqs)], lens)
    np.testing.assert_array_equal(np.diff(cu_k)[: len(seqs)], ends)
    assert len(cu_q) == len(cu_k) == (rows + 1 if decode else last_rows + 2)
    assert cu_q[-1] == rows and cu_k[-1] <= keys
    if decode:  # one query per sequence, each with a key
        assert np.all(np.diff(cu_q) == 1) and np.all(np.diff(cu_k) >= 1)
    else:  # the padding rows are one sequence with no key: no attention work for padding
        assert cu_k[-1] == ends.sum() and np.all(np.diff(cu_k)[len(seqs):] == 0)


def _hosts(folder: str, calls: list | None = None):
    def kernel(*a):
        if calls is not None:
            calls.append(int(a[0].shape[0]))
        return sequence_reference(*a)

    masked = ModelHost.from_checkpoint(folder, attention=AttentionBackend.MASKED, kv_tokens=512)
    varlen = ModelHost.from_checkpoint(folder, attention=AttentionBackend.VARLEN, varlen_kernel=kernel, kv_tokens=512)
    return masked, varlen


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_varlen_host_equals_masked_host_over_mixed_steps(hf_checkpoint, family):
    """Prefill of two sequences, then a mixed step (a decode token, a chunk continuing a context, a new
    sequence), then a decode step: every step's logits equal the masked path's (fp32, CPU)."""
    _, folder = hf_checkpoint(family)
    calls: list[int] = []
    masked, varlen = _hosts(folder, calls)
    assert varlen.attention is AttentionBackend.VARLEN and masked.attention is AttentionBackend.MASKED
    assert varlen.model.config._attn_implementation == "ray_moe_varlen"
    ex = types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(folder)).moe_forward)
    g = torch.Generator().manual_seed(0)
    vocab = masked.vocab_size
    steps = [
        [SeqChunk("a", 0, 5), SeqChunk("b", 0, 9)],
        [SeqChunk("a", 5, 1), SeqChunk("b", 9, 4), SeqChunk("c", 0, 7)],
        [SeqChunk("a", 6, 1), SeqChunk("b", 13, 1), SeqChunk("c", 7, 1)],
    ]
    for chunks in steps:
        ids = torch.randint(0, vocab, (sum(c.num_tokens for c in chunks),), generator=g)
        outs = []
        for host in (masked, varlen):
            for c in chunks:
                host.kv.reserve(c.seq_id, c.start + c.num_tokens)
            outs.append(host.forward(chunks, ids, ex))
        assert outs[0].shape == (len(chunks), vocab)
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    # the varlen kernel ran in every attention layer of every step, on the step's query rows: a step whose
    # one-row sequences lead (the mixed step: "a"'s decode token) runs them as a call of their own
    layers = varlen.config.num_hidden_layers
    want = []
    for chunks in steps:
        nd, n = leading_single_rows(chunks), sum(c.num_tokens for c in chunks)
        want += ([nd, n - nd] if 0 < nd < len(chunks) else [n]) * layers
    assert calls == want and want[layers:layers + 2] == [1, 11]


@pytest.mark.parametrize("decode", [False, True])
def test_padded_varlen_plan_equals_masked_plan(hf_checkpoint, decode):
    """The static shapes of a captured step: padding rows, keys and sequences change no real row's logits."""
    _, folder = hf_checkpoint("qwen3_moe")
    masked, varlen = _hosts(folder)
    ex = types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(folder)).moe_forward)
    g = torch.Generator().manual_seed(1)
    pre = [SeqChunk("a", 0, 6), SeqChunk("b", 0, 3)]
    ids = torch.randint(0, masked.vocab_size, (9,), generator=g)
    for host in (masked, varlen):
        for c in pre:
            host.kv.reserve(c.seq_id, c.start + c.num_tokens + 4)
        host.forward(pre, ids, ex)
    if decode:
        chunks, rows, last_rows = [SeqChunk("a", 6, 1), SeqChunk("b", 3, 1)], 8, None
    else:
        chunks, rows, last_rows = [SeqChunk("a", 6, 3), SeqChunk("b", 3, 2)], 16, 4
    n = sum(c.num_tokens for c in chunks)
    tok = np.zeros(rows, dtype=np.int64)
    tok[:n] = torch.randint(0, masked.vocab_size, (n,), generator=g).numpy()
    context = sum(c.start + c.num_tokens for c in chunks)
    keys = 64
    outs = []
    for host in (masked, varlen):
        inp = host.kv.plan_padded(chunks, rows, keys, host.dtype, last_rows=last_rows, varlen=host.varlen,
                                  extra={"token_ids": tok})
        assert ("mask" in inp) is (not host.varlen) and ("cu_q" in inp) is host.varlen
        from ray_moe.model.kv import StepLayout
        lay = StepLayout(inp["write_index"], inp["read_index"], inp["positions"], inp.get("mask"), inp.get("last"),
                         inp.get("cu_q"), inp.get("cu_k"), rows if last_rows else 1, keys)
        outs.append(host.forward_layout(lay, inp["token_ids"], ex))
    real = len(chunks) if last_rows else n
    assert context < keys
    torch.testing.assert_close(outs[1][:real], outs[0][:real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("single", [2, 4])
def test_split_padded_plan_equals_masked_plan(hf_checkpoint, single):
    """A captured mixed step's two groups (``single_rows``): the decode rows first, padded with one-row
    sequences, then the chunks padded to the step's rows; every real row's logits equal the masked path's
    unpadded step, the padding sequences attend nothing real, and the kernel runs twice per layer."""
    _, folder = hf_checkpoint("qwen3_moe")
    calls: list[int] = []
    masked, varlen = _hosts(folder, calls)
    ex = types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(folder)).moe_forward)
    g = torch.Generator().manual_seed(2)
    pre = [SeqChunk("a", 0, 6), SeqChunk("b", 0, 3)]
    ids = torch.randint(0, masked.vocab_size, (9,), generator=g)
    for host in (masked, varlen):
        for c in pre + [SeqChunk("c", 0, 5)]:
            host.kv.reserve(c.seq_id, c.start + c.num_tokens + 4)
        host.forward(pre, ids, ex)
    chunks = [SeqChunk("a", 6, 1), SeqChunk("b", 3, 1), SeqChunk("c", 0, 5)]  # two decode rows, a new prompt
    new = torch.randint(0, masked.vocab_size, (7,), generator=g)
    want = masked.forward(chunks, new, ex)  # [3, V] at each sequence's last row
    rows, keys, last_rows = single + 8, 64, single + 2
    tok = np.zeros(rows, dtype=np.int64)
    tok[:2], tok[single:single + 5] = new[:2].numpy(), new[2:].numpy()
    inp = varlen.kv.plan_padded(chunks, rows, keys, varlen.dtype, last_rows=last_rows, varlen=True,
                                single_rows=single, extra={"token_ids": tok})
    assert inp["cu_q"].tolist()[:single + 1] == list(range(single + 1))
    assert inp["row_valid"].tolist() == [True, True] + [False] * (single - 2) + [True] * 5 + [False] * 3
    assert inp["last"].tolist()[:3] == [0, 1, single + 4]
    from ray_moe.model.kv import StepLayout
    lay = StepLayout(inp["write_index"], inp["read_index"], inp["positions"], None, inp["last"], inp["cu_q"],
                     inp["cu_k"], 8, keys, single)
    calls.clear()
    got = varlen.forward_layout(lay, inp["token_ids"], ex)
    torch.testing.assert_close(got[:3], want, atol=2e-5, rtol=1e-4)
    assert calls == [single, 8] * varlen.config.num_hidden_layers
    with pytest.raises(ValueError, match="single_rows=1"):
        varlen.kv.plan_padded(chunks, rows, keys, varlen.dtype, last_rows=last_rows, varlen=True, single_rows=1)


def test_backend_choice_and_refusals(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3_moe")
    auto = ModelHost.from_checkpoint(folder, kv_tokens=64)  # CPU: the kernel check fails, masked kept with why
    assert auto.attention is AttentionBackend.MASKED and "CUDA" in auto.attention_reason
    with pytest.raises(ConfigError, match="attention=varlen: device cpu"):
        ModelHost.from_checkpoint(folder, attention=AttentionBackend.VARLEN, kv_tokens=64)
    assert "float16 / bfloat16" in check_flash(torch.device("cuda"), torch.float32, 4, 2, 8)
    assert "outside FlashAttention-2" in check_flash(torch.device("cuda"), torch.bfloat16, 4, 3, 8)
    with pytest.raises(RuntimeError, match="without a VarlenPlan"):
        varlen_attention(None, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), None)
