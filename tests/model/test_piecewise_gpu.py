"""Piecewise CUDA graphs (model/piecewise.py) on CUDA: a step size captured in pieces between its attention calls
replays steps of any sequences and contexts (decode rows read in place, chunks over gathered contexts) with the
logits of the same rows run eagerly; two sizes share one pool and their outputs (held weakly) stay right when
replayed alternately; a whole-step decode graph over a shared slot vector (a prefix copied per step) too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_moe.core.types import AttentionBackend
from ray_moe.model.attention import AttentionPlan, InlineAttention
from ray_moe.model.host import ModelHost
from ray_moe.model.kv import SeqChunk, StepRows
from ray_moe.model.kv_host import HostChunks
from ray_moe.model.piecewise import OutputArena, PiecewiseGraph
from ray_moe.model.source import HFWeightSource
from ray_moe.moe.decode.graphs import CapturedStep

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


class DenseExperts:
    """A capturable MoE executor for the tests (every route through its expert's weights gathered on the
    device, SwiGLU, gated sum; no host sync): ``layer_entry`` is transformers' experts seam."""

    def __init__(self, folder: str, num_experts: int, dtype: torch.dtype) -> None:
        src = HFWeightSource(folder)
        self.w = []
        for layer in range(src.num_layers):
            ws = [src.expert(layer, e) for e in range(num_experts)]
            self.w.append(tuple(torch.stack([getattr(x, n) for x in ws]).to(DEV, dtype)
                                for n in ("w_gate", "w_up", "w_down")))

    def layer_entry(self, layer, hidden, topk_ids, topk_weights):
        g, u, d = self.w[layer]
        ids = topk_ids.clamp_min(0)
        h = hidden[:, None, :, None]  # [T, 1, d, 1]
        a = torch.nn.functional.silu((g[ids] @ h).squeeze(-1)) * (u[ids] @ h).squeeze(-1)  # [T, k, f]
        y = (d[ids] @ a[..., None]).squeeze(-1)  # [T, k, d]
        gate = torch.where(topk_ids >= 0, topk_weights, torch.zeros_like(topk_weights))
        return (y.float() * gate[..., None].float()).sum(1).to(hidden.dtype)


def _host(folder):
    host = ModelHost.from_checkpoint(folder, device=DEV, dtype=torch.bfloat16, kv_tokens=2048)
    assert host.varlen and host.paged_decode, (host.attention_reason, host.decode_reason)
    host.fuse_kernels()
    return host


def _trash(host, lens):
    arr = np.asarray(lens, dtype=np.int64)
    return HostChunks(np.zeros_like(arr), arr, arr.copy(), [np.full(n, host.kv.trash_slot, dtype=np.int64) for n in lens])


def test_piecewise_replays_equal_eager_rows_for_any_sequences(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3_moe")
    host = _host(folder)
    ex = DenseExperts(folder, host.config.num_experts, host.dtype)
    arena = OutputArena(64, host.config.num_attention_heads, host.config.head_dim, host.dtype, DEV)
    graphs, pool = {}, None
    for rows in (32, 64):  # warm-up then capture, one pool
        step, plan = host.kv.plan_step(_trash(host, [rows]), np.zeros(rows, dtype=np.int64), host.attention,
                                       rows=rows, last_rows=8)

        def body(inp, attention, rows=rows):
            return host.forward_rows(StepRows.of(inp, rows), attention, ex)

        body(step.tensors(), InlineAttention(plan, host.kernels))
        g = PiecewiseGraph({k: v.clone() for k, v in step.tensors().items()})
        pool = g.capture(body, pool, arena)
        assert g.num_pieces == host.config.num_hidden_layers + 1
        graphs[rows] = g
    g = torch.Generator().manual_seed(0)
    for c, n in (("a", 30), ("b", 9), ("c", 17)):
        host.kv.reserve(c, n + 8)
    pre = [SeqChunk("a", 0, 30), SeqChunk("b", 0, 9), SeqChunk("c", 0, 17)]
    steps = [([SeqChunk("a", 30, 1), SeqChunk("b", 9, 6), SeqChunk("c", 17, 1)], 32),  # (decode rows: sorted first)
             ([SeqChunk("a", 31, 1), SeqChunk("c", 18, 1), SeqChunk("b", 15, 2)], 64)]
    ids0 = torch.randint(0, host.vocab_size, (56,), generator=g).numpy()
    step, plan = host.plan(pre, ids0, rows=64, last_rows=8)
    graphs[64].replay(step.tensors(), plan, host.kernels)  # the prefill, through a graph as well
    for chunks, rows in steps + steps[::-1]:  # alternating sizes: the shared pool's outputs stay right
        ids = torch.randint(0, host.vocab_size, (sum(c.num_tokens for c in chunks),), generator=g).numpy()
        step, plan = host.plan(chunks, ids, rows=rows, last_rows=8)
        eager = host.forward_rows(step, InlineAttention(plan, host.kernels), ex)[: len(chunks)].float().clone()
        got = graphs[rows].replay(step.tensors(), plan, host.kernels)[: len(chunks)].float()
        torch.testing.assert_close(got, eager, atol=2e-2, rtol=2e-2)
        assert torch.isfinite(got).all()


def test_a_decode_graph_over_a_shared_slot_vector_equals_eager(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3_moe")
    host = _host(folder)
    ex = DenseExperts(folder, host.config.num_experts, host.dtype)
    slots = torch.full((4096,), host.kv.trash_slot, dtype=torch.int64, device=DEV)
    max_k = 4096

    def body(inp):
        plan = AttentionPlan(8, AttentionBackend.VARLEN, cu_k=inp["cu_k"], max_k=max_k, single_rows=8,
                             slots=inp["read_index"], k_end=inp["k_end"])
        return host.forward_rows(StepRows.of(inp, 8), InlineAttention(plan, host.kernels), ex)

    warm = host.kv.plan_decode_graph(_trash(host, [1] * 8), 8, 1, np.zeros(8, dtype=np.int64))[0]
    body(warm)
    inputs = {k: v.clone() for k, v in warm.items() if k != "read_index"}
    inputs["read_index"] = slots
    graph = CapturedStep(inputs, weak_outputs=True)
    graph.capture(lambda inp: (body(inp), None))
    g = torch.Generator().manual_seed(1)
    for c, n in (("a", 40), ("b", 3), ("c", 200)):
        host.kv.reserve(c, n + 4)
        ids = torch.randint(0, host.vocab_size, (n,), generator=g).numpy()
        step, plan = host.plan([SeqChunk(c, 0, n)], ids)
        host.forward_rows(step, InlineAttention(plan, host.kernels), ex)
    for j in range(3):
        chunks = [SeqChunk("a", 40 + j, 1), SeqChunk("b", 3 + j, 1), SeqChunk("c", 200 + j, 1)]
        ids = torch.randint(0, host.vocab_size, (3,), generator=g).numpy()
        staged = host.kv.plan_decode_graph(chunks, 8, 1, ids)[0]
        out, _ = graph.replay(staged)
        got = out[:3].float().clone()
        step, plan = host.plan(chunks, ids)
        want = host.forward_rows(step, InlineAttention(plan, host.kernels), ex).float()
        # (bf16: the graph's static context bound splits each sequence's keys more finely than the eager step's
        # exact one, so the softmax sums in another order)
        torch.testing.assert_close(got, want, atol=6e-2, rtol=5e-2)
        assert (got.argmax(-1) == want.argmax(-1)).all()
