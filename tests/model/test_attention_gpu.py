"""The varlen backend's real kernel (FlashAttention-2 through PyTorch) on CUDA, against the references."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from ray_moe.core.types import AttentionBackend
from ray_moe.model.attention import check_flash, flash_varlen, sequence_reference
from ray_moe.model.host import ModelHost
from ray_moe.model.attention import InlineAttention
from ray_moe.model.kv import SeqChunk
from ray_moe.model.source import HFWeightSource
from ray_moe_dev.testing.local_executor import LocalExecutor

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 4, 128), (16, 16, 192), (8, 2, 64)])
def test_flash_varlen_equals_the_per_sequence_reference(heads, kv_heads, dim):
    """Ragged sequences (a chunk continuing its context, fresh prompts, decode rows, an empty sequence and a
    padding sequence with more queries than keys) in bf16: the kernel equals SDPA per sequence."""
    assert check_flash(DEV, torch.bfloat16, heads, kv_heads, dim) is None
    g = torch.Generator().manual_seed(0)
    lq, lk = [7, 1, 33, 0, 1, 5], [40, 9, 33, 0, 300, 2]
    q = torch.randn(sum(lq), heads, dim, generator=g).to(DEV, torch.bfloat16)
    k = torch.randn(sum(lk), kv_heads, dim, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(sum(lk), kv_heads, dim, generator=g).to(DEV, torch.bfloat16)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32, device=DEV)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32, device=DEV)
    got = flash_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), dim ** -0.5).float()
    want = sequence_reference(q.float(), k.float(), v.float(), cu_q, cu_k, max(lq), max(lk), dim ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    # the padding sequence's first queries see no key: zero rows, not NaN
    assert got[-5:-2].abs().max() == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_varlen_host_equals_masked_host_in_bf16(hf_checkpoint, family):
    """The real kernel inside transformers' own modules (GQA; MLA's narrower values) over a mixed step, and a
    padded decode step (the rows a captured step runs; the captured paths themselves run in
    tests/model/test_piecewise_gpu.py and the shard's GPU tests): equal to the masked SDPA path within bf16
    error."""
    _, folder = hf_checkpoint(family)
    masked = ModelHost.from_checkpoint(folder, device=DEV, dtype=torch.bfloat16, kv_tokens=1024,
                                       attention=AttentionBackend.MASKED)
    varlen = ModelHost.from_checkpoint(folder, device=DEV, dtype=torch.bfloat16, kv_tokens=1024)
    assert varlen.attention is AttentionBackend.VARLEN, varlen.attention_reason
    ex = types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(folder)).moe_forward)
    g = torch.Generator().manual_seed(0)
    steps = [[SeqChunk("a", 0, 30), SeqChunk("b", 0, 9)],
             [SeqChunk("a", 30, 1), SeqChunk("b", 9, 20), SeqChunk("c", 0, 17)]]
    for chunks in steps:
        ids = torch.randint(0, masked.vocab_size, (sum(c.num_tokens for c in chunks),), generator=g)
        outs = []
        for host in (masked, varlen):
            for c in chunks:
                host.kv.reserve(c.seq_id, c.start + c.num_tokens + 8)
            outs.append(host.forward(chunks, ids, ex))
        torch.testing.assert_close(outs[1], outs[0], atol=0.1, rtol=0.05)
    # a padded step (the rows a captured step runs): padding rows past the real ones change no real row
    chunks = [SeqChunk("a", 31, 1), SeqChunk("b", 29, 1), SeqChunk("c", 17, 1)]
    rows, plan = varlen.plan(chunks, np.asarray([5, 6, 7]), rows=8, last_rows=4)
    got = varlen.forward_rows(rows, InlineAttention(plan, varlen.kernels, varlen.cache_gathers), ex,
                              gather=plan.gather if varlen.cache_gathers else None)
    want = masked.forward(chunks, torch.tensor([5, 6, 7]), ex)
    torch.testing.assert_close(got[:3], want, atol=0.1, rtol=0.05)
