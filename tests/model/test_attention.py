"""The attention backends (model/attention.py) over the paged cache (model/kv.py), on CPU.

The FlashAttention kernel needs CUDA; here the varlen backend's plans (per-sequence offsets, the leading one-row
group in a call of its own, MLA's narrower value heads) run with ``sequence_reference`` as their kernel and must
give the masked SDPA path's logits. A step padded to more rows (what a captured step runs) gives every real row
the same logits, and a hole of a piecewise graph (``model/piecewise.py``: attention with each step's own plan
into a static output) the same as attention inline. The GPU test (tests/model/test_attention_gpu.py) runs the
real kernel.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from ray_moe.core.errors import ConfigError
from ray_moe.core.types import AttentionBackend
from ray_moe.model.attention import InlineAttention, check_flash, sequence_reference, step_attention
from ray_moe.model.host import ModelHost
from ray_moe.model.kv import SeqChunk, leading_single_rows
from ray_moe.model.piecewise import Hole, OutputArena
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


def _hosts(folder: str, calls: list | None = None, paged: bool = False):
    """(masked, varlen) hosts of one checkpoint; ``calls``: the query rows of each varlen kernel call;
    ``paged``: the varlen host reads one-row sequences in place (the per-sequence reference kernel)."""
    from ray_moe.model.paged_decode import paged_decode_reference

    def kernel(*a):
        if calls is not None:
            calls.append(int(a[0].shape[0]))
        return sequence_reference(*a)

    masked = ModelHost.from_checkpoint(folder, attention=AttentionBackend.MASKED, kv_tokens=512)
    varlen = ModelHost.from_checkpoint(folder, attention=AttentionBackend.VARLEN, varlen_kernel=kernel, kv_tokens=512,
                                       decode_kernel=paged_decode_reference if paged else None)
    return masked, varlen


def _executor(folder):
    return types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(folder)).moe_forward)


STEPS = [
    [SeqChunk("a", 0, 5), SeqChunk("b", 0, 9)],
    [SeqChunk("a", 5, 1), SeqChunk("b", 9, 4), SeqChunk("c", 0, 7)],  # a decode row first, a chunk, a new prompt
    [SeqChunk("a", 6, 1), SeqChunk("b", 13, 1), SeqChunk("c", 7, 1)],  # a decode step
]


@pytest.mark.parametrize("family,paged", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True),
                                          ("deepseek_v3", True)])
def test_varlen_host_equals_masked_host_over_mixed_steps(hf_checkpoint, family, paged):
    """Prefill of two sequences, then a mixed step (a decode token, a chunk continuing a context, a new
    sequence), then a decode step: every step's logits equal the masked path's (fp32, CPU). In place (``paged``):
    the one-row sequences read their slots through the decode kernel, the others gather; MLA's latent cache
    (DeepSeek) is always gathered."""
    _, folder = hf_checkpoint(family)
    calls: list[int] = []
    masked, varlen = _hosts(folder, calls, paged)
    assert varlen.attention is AttentionBackend.VARLEN and masked.attention is AttentionBackend.MASKED
    assert varlen.model.config._attn_implementation == masked.model.config._attn_implementation == "ray_moe"
    assert varlen.paged_decode is (paged and family != "deepseek_v3"), varlen.decode_reason
    ex = _executor(folder)
    g = torch.Generator().manual_seed(0)
    vocab = masked.vocab_size
    for chunks in STEPS:
        ids = torch.randint(0, vocab, (sum(c.num_tokens for c in chunks),), generator=g)
        outs = []
        for host in (masked, varlen):
            for c in chunks:
                host.kv.reserve(c.seq_id, c.start + c.num_tokens)
            outs.append(host.forward(chunks, ids, ex))
        assert outs[0].shape == (len(chunks), vocab)
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    # the varlen kernel ran in every attention layer of every step, on the step's query rows: a step whose
    # one-row sequences lead (the mixed step: "a"'s decode token) runs them as a call of their own, or in place
    layers = varlen.config.num_hidden_layers
    want = []
    for chunks in STEPS:
        nd, n = leading_single_rows(chunks), sum(c.num_tokens for c in chunks)
        if varlen.paged_decode:
            want += ([] if nd == len(chunks) else [n - nd]) * layers
        else:
            want += ([nd, n - nd] if 0 < nd < len(chunks) else [n]) * layers
    assert calls == want


@pytest.mark.parametrize("backend,paged", [("masked", False), ("varlen", False), ("varlen", True)])
def test_padding_rows_and_holes_change_no_real_row(hf_checkpoint, backend, paged):
    """The rows of a captured step: a mixed step padded to 24 rows (padding rows write the trash slot, route
    nowhere, sit past every real row) gives each sequence's logits of the unpadded step; and the same step with
    its attention run as holes (each layer's attention into a static output from the step's own plan, what a
    piecewise graph replays) gives them too."""
    _, folder = hf_checkpoint("qwen3_moe")
    masked, varlen = _hosts(folder, paged=paged)
    host = masked if backend == "masked" else varlen
    ex = _executor(folder)
    g = torch.Generator().manual_seed(1)
    pre, chunks = STEPS[0], STEPS[1]
    for c in pre + chunks:
        host.kv.reserve(c.seq_id, c.start + c.num_tokens)
    host.forward(pre, torch.randint(0, host.vocab_size, (14,), generator=g), ex)
    ids = torch.randint(0, host.vocab_size, (12,), generator=g)
    want = host.forward(chunks, ids, ex)  # [3, V]
    rows, plan = host.plan(chunks, ids, rows=24, last_rows=8)
    assert rows.rows == 24 and rows.n == 12 and rows.row_valid.sum() == 12
    assert (rows.write_index[12:] == host.kv.trash_slot).all() and rows.last.tolist()[3:] == [0] * 5
    padded = host.forward_rows(rows, InlineAttention(plan, host.kernels), ex)
    torch.testing.assert_close(padded[:3], want, atol=2e-5, rtol=1e-4)
    # holes: the attention calls recorded (weights of the forward), replayed into the arena with the plan
    arena = OutputArena(64, host.config.num_attention_heads, host.config.head_dim, host.dtype, host.device)

    def holes(module, query, key, value, scaling):
        out = arena.view(int(query.shape[2]), int(query.shape[1]), int(value.shape[-1]))
        Hole(module, query, key, value, scaling, out).run(plan, host.kernels)
        return out.clone()  # (every layer shares the arena: a piece reads it before the next hole writes)

    holed = host.forward_rows(rows, holes, ex)
    torch.testing.assert_close(holed[:3], want, atol=2e-5, rtol=1e-4)


def test_backend_choice_and_refusals(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3_moe")
    auto = ModelHost.from_checkpoint(folder, kv_tokens=64)  # CPU: the kernel check fails, masked kept with why
    assert auto.attention is AttentionBackend.MASKED and "CUDA" in auto.attention_reason
    with pytest.raises(ConfigError, match="attention=varlen: device cpu"):
        ModelHost.from_checkpoint(folder, attention=AttentionBackend.VARLEN, kv_tokens=64)
    assert "float16 / bfloat16" in check_flash(torch.device("cuda"), torch.float32, 4, 2, 8)
    assert "outside FlashAttention-2" in check_flash(torch.device("cuda"), torch.bfloat16, 4, 3, 8)
    with pytest.raises(RuntimeError, match="without a step's attention"):
        step_attention(None, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), None)
    with pytest.raises(ValueError, match="rows=4"):
        auto.kv.reserve("x", 6)
        auto.plan([SeqChunk("x", 0, 6)], np.zeros(6, dtype=np.int64), rows=4)
