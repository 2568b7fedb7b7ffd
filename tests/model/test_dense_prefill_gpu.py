"""Long prompt chunks through cuDNN's dense attention (model/dense_prefill.py) on CUDA, against FlashAttention-2
and the per-sequence reference."""

from __future__ import annotations

import types

import pytest
import torch

from ray_moe.core.types import AttentionBackend
from ray_moe.model import dense_prefill as dp
from ray_moe.model.attention import flash_varlen, sequence_reference
from ray_moe.model.host import ModelHost
from ray_moe.model.kv import SeqChunk
from ray_moe.model.source import HFWeightSource
from ray_moe_dev.testing.local_executor import LocalExecutor, step_logits

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.mark.parametrize("nq,nk", [(8192, 8192), (6000, 7200), (1024, 1024), (1500, 1700), (300, 300)])
@pytest.mark.parametrize("gqa", [False, True])
def test_dense_causal_equals_flash_in_bf16(nq, nk, gqa):
    """The Qwen3-30B-A3B head shape (32 query heads over 4 key/value heads, 128 wide) in bf16: a fresh 8k
    prompt, a second chunk over a first, squares off SQUARE_ROWS: cuDNN's output within bf16 error of
    FlashAttention-2's on the same keys, and of the float32 reference on the short one."""
    g = torch.Generator().manual_seed(nq + nk)
    q = torch.randn(nq, 32, 128, generator=g).to(DEV, torch.bfloat16)
    k = torch.randn(nk, 4, 128, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(nk, 4, 128, generator=g).to(DEV, torch.bfloat16)
    cu_q = torch.tensor([0, nq], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, nk], dtype=torch.int32, device=DEV)
    try:
        got = dp.dense_causal(q, k, v, 128 ** -0.5, gqa=gqa).float()
    except RuntimeError as exc:  # cuDNN without grouped-query heads here: the start check keeps the other variant
        assert gqa, exc
        pytest.skip(f"cuDNN's SDPA takes no enable_gqa here: {exc}")
    flash = flash_varlen(q, k, v, cu_q, cu_k, nq, nk, 128 ** -0.5).float()
    assert got.shape == (nq, 32, 128) and torch.isfinite(got).all()
    torch.testing.assert_close(got, flash, atol=2e-2, rtol=2e-2)
    if nq <= 300:
        want = sequence_reference(q.float(), k.float(), v.float(), cu_q, cu_k, nq, nk, 128 ** -0.5)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("nq", [5000, 7000, 4096])
def test_a_fresh_chunk_read_in_place_equals_its_copied_square_on_cuda(nq):
    """cuDNN over a fresh chunk's queries read in place (the rows after it NaN, as a step's padding may hold) gives
    the copied square's output bit for bit: the same kernel and plan, the other rows' outputs dropped."""
    side = -(-nq // dp.SQUARE_ROWS) * dp.SQUARE_ROWS
    g = torch.Generator().manual_seed(nq)
    buf = torch.randn(side + 64, 32, 128, generator=g).to(DEV, torch.bfloat16)
    buf[nq:] = float("nan")
    k = torch.randn(nq, 4, 128, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(nq, 4, 128, generator=g).to(DEV, torch.bfloat16)
    assert dp.rows_in_place(buf[:nq], side) is not None
    in_place = dp.dense_causal(buf[:nq], k, v, 128 ** -0.5)
    copied = dp.dense_causal(buf[:nq].clone(), k, v, 128 ** -0.5)  # (no rows after it: the square is copied)
    assert torch.isfinite(in_place).all() and torch.equal(in_place, copied)


def test_check_dense_decides_on_this_gpu():
    """On a Hopper GPU the check picks cuDNN's dense kernel (equal to the reference, faster than FlashAttention-2
    from some checked chunk length to 8k, every square from there planned); what decided it is said either way."""
    choice = dp.check_dense(DEV, torch.bfloat16, 32, 4, 128, 128, flash_varlen, sequence_reference)
    print(choice.reason)
    assert "FlashAttention-2" in choice.reason or "failed" in choice.reason
    if torch.cuda.get_device_capability(DEV)[0] == 9:
        assert choice.kernel in (dp.dense_causal, dp.dense_causal_gqa), choice.reason
        assert choice.min_rows in dp.CHECK_SIZES, choice.reason


def test_host_with_dense_chunks_equals_host_without_in_bf16(hf_checkpoint):
    """A tiny Qwen3-MoE on CUDA whose chunks of >= 64 rows attend through cuDNN: each step's logits within bf16
    error of the same host's FlashAttention-2 path (dense off), over fresh prompts, a second chunk over its first
    and a mixed step with decode rows."""
    _, folder = hf_checkpoint("qwen3_moe")
    kw = dict(device=DEV, dtype=torch.bfloat16, kv_tokens=2048, attention=AttentionBackend.VARLEN)
    dense = ModelHost.from_checkpoint(folder, dense_kernel=dp.dense_causal, dense_rows=64, **kw)
    flash = ModelHost.from_checkpoint(folder, dense_rows=None, **kw)
    assert dense.kernels.dense is dp.dense_causal and flash.kernels.dense is None
    ex = types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(folder)).moe_forward)
    g = torch.Generator().manual_seed(0)
    steps = [[SeqChunk("a", 0, 300), SeqChunk("b", 0, 40)],
             [SeqChunk("a", 300, 1), SeqChunk("b", 40, 200), SeqChunk("c", 0, 129)]]
    for chunks in steps:
        ids = torch.randint(0, dense.vocab_size, (sum(c.num_tokens for c in chunks),), generator=g)
        want, got = step_logits([flash, dense], chunks, ids, ex)
        assert [h.plan(chunks, ids)[1].prefill_runs is not None for h in (flash, dense)] == [False, True]
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
