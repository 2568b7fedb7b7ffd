"""The in-place decode kernel (Triton, model/paged_decode.py) on CUDA against the per-sequence reference:
ragged contexts at scattered cache slots, one split and several, grouped-query and MLA-shaped heads, inside a
CUDA graph replayed with new lengths, and inside transformers' modules over a captured decode shape."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from ray_moe.core.types import AttentionBackend
from ray_moe.model.host import ModelHost
from ray_moe.model.attention import InlineAttention
from ray_moe.model.kv import SeqChunk
from ray_moe.model.paged_decode import check_paged, decode_splits, paged_decode, paged_decode_reference
from ray_moe.model.source import HFWeightSource
from ray_moe_dev.testing.local_executor import LocalExecutor

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def _case(lens, hq, hk, d, dv, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    cap = sum(lens) + 100
    k = torch.randn(cap, hk, d, generator=g).to(DEV, dtype)
    v = torch.randn(cap, hk, dv, generator=g).to(DEV, dtype)
    slots = torch.randperm(cap, generator=g)[: sum(lens)].to(DEV)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEV, dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=DEV)
    return q, k, v, slots, cu


@pytest.mark.parametrize("hq,hk,d,dv", [(32, 4, 128, 128), (16, 16, 192, 128), (8, 2, 64, 64), (4, 4, 128, 128), (4, 2, 8, 8)])
@pytest.mark.parametrize("lens", [[1], [37, 0, 1, 300, 64, 65], [2000, 5], list(range(1, 257))])
def test_kernel_equals_reference(hq, hk, d, dv, lens):
    assert check_paged(DEV, torch.bfloat16, hq, hk, d, dv) is None
    q, k, v, slots, cu = _case(lens, hq, hk, d, dv)
    got = paged_decode(q, k, v, slots, cu, max(lens), d ** -0.5).float()
    want = paged_decode_reference(q.float(), k.float(), v.float(), slots, cu, max(lens), d ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for i, n in enumerate(lens):
        if n == 0:
            assert got[i].abs().max() == 0


@pytest.mark.parametrize("lens", [[37, 0, 1, 300, 64, 65], list(range(1, 257))])
def test_kernel_with_segment_ends_equals_reference(lens):
    """``k_end``: each sequence stops short of the next one's segment (room after it): kernel == reference."""
    q, k, v, slots, cu = _case(lens, 32, 4, 128, 128, seed=4)
    end = cu[:-1] + torch.tensor([n // 2 for n in lens], dtype=torch.int32, device=DEV)
    got = paged_decode(q, k, v, slots, cu, max(lens), 0.1, end).float()
    want = paged_decode_reference(q.float(), k.float(), v.float(), slots, cu, max(lens), 0.1, end)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_kernel_replays_in_a_cuda_graph_with_new_lengths():
    """Captured once with an upper bound on the context; replayed with other lengths and slots (the values of
    the captured buffers change, the shapes do not): each replay equals the reference."""
    lens = [100, 3, 700, 0]
    q, k, v, slots, cu = _case(lens, 32, 4, 128, 128, seed=1)
    max_k = 1024
    assert decode_splits(len(lens), 4, max_k) > 1  # the split path and its combine kernel are in the graph
    static = {"q": q.clone(), "slots": torch.zeros(2000, dtype=torch.int64, device=DEV), "cu": cu.clone()}
    static["slots"][: slots.numel()] = slots
    paged_decode(static["q"], k, v, static["slots"], static["cu"], max_k, 0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(static["q"], k, v, static["slots"], static["cu"], max_k, 0.1)
    for seed, new in ((2, [1, 1000, 50, 9]), (3, [0, 0, 0, 1])):
        q2, _, _, slots2, cu2 = _case(new, 32, 4, 128, 128, seed=seed)
        slots2 = slots2 % k.shape[0]
        static["q"].copy_(q2)
        static["slots"][: slots2.numel()] = slots2
        static["cu"].copy_(cu2)
        graph.replay()
        want = paged_decode_reference(q2.float(), k.float(), v.float(), slots2, cu2, max_k, 0.1)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_host_decode_reads_the_cache_in_place_in_bf16(hf_checkpoint, family):
    """A CUDA host picks the kernel by itself; a prefill, an eager decode step and a padded (captured-shape)
    paged decode step equal the masked SDPA path within bf16 error."""
    _, folder = hf_checkpoint(family)
    masked = ModelHost.from_checkpoint(folder, device=DEV, dtype=torch.bfloat16, kv_tokens=1024,
                                       attention=AttentionBackend.MASKED)
    host = ModelHost.from_checkpoint(folder, device=DEV, dtype=torch.bfloat16, kv_tokens=1024)
    assert host.paged_decode, host.decode_reason
    ex = types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(folder)).moe_forward)
    g = torch.Generator().manual_seed(0)
    steps = [[SeqChunk("a", 0, 30), SeqChunk("b", 0, 9), SeqChunk("c", 0, 17)],
             [SeqChunk("a", 30, 1), SeqChunk("b", 9, 1), SeqChunk("c", 17, 1)]]
    for chunks in steps:
        ids = torch.randint(0, masked.vocab_size, (sum(c.num_tokens for c in chunks),), generator=g)
        outs = []
        for h in (masked, host):
            for c in chunks:
                h.kv.reserve(c.seq_id, c.start + c.num_tokens + 8)
            outs.append(h.forward(chunks, ids, ex))
        torch.testing.assert_close(outs[1], outs[0], atol=0.1, rtol=0.05)
    chunks = [SeqChunk("a", 31, 1), SeqChunk("b", 10, 1), SeqChunk("c", 18, 1)]
    rows, plan = host.plan(chunks, np.asarray([5, 6, 7]), rows=16, last_rows=8)  # padded: a captured step's rows
    assert plan.in_place
    got = host.forward_rows(rows, InlineAttention(plan, host.kernels), ex)
    want = masked.forward(chunks, torch.tensor([5, 6, 7]), ex)
    torch.testing.assert_close(got[:3], want, atol=0.1, rtol=0.05)
