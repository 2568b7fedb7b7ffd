"""Long prompt chunks through the dense kernel (model/dense_prefill.py), on CPU.

On CPU ``dense_causal`` runs PyTorch's math SDPA (the same padding, head repetition and cut as on the GPU, where
cuDNN's fused kernel runs it): it must equal the per-sequence reference; a step's chunks cut into runs must cover
every sequence once; and a host whose long chunks attend through it must give the masked path's logits over
fresh, continuing and mixed steps. The GPU test (tests/model/test_dense_prefill_gpu.py) runs cuDNN.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.types import AttentionBackend
from ray_moe.model import dense_prefill as dp
from ray_moe.model.attention import sequence_reference
from ray_moe.model.host import ModelHost
from ray_moe.model.kv import SeqChunk
from ray_moe.model.paged_decode import paged_decode_reference
from ray_moe.model.source import HFWeightSource
from ray_moe_dev.testing.local_executor import LocalExecutor, step_logits


@pytest.mark.parametrize("nq,nk,hq,hk", [(5, 5, 4, 2), (300, 300, 4, 1), (200, 450, 2, 2), (1, 7, 4, 2),
                                         (256, 256, 2, 1), (257, 600, 4, 2)])
@pytest.mark.parametrize("kernel", [dp.dense_causal, dp.dense_causal_gqa])
def test_dense_causal_equals_the_reference(nq, nk, hq, hk, kernel):
    """A fresh chunk, one over earlier context (bottom-right causal), squares that are and are not multiples of
    SQUARE_ROWS, grouped-query heads (repeated, or read in place by SDPA's enable_gqa): equal to
    ``sequence_reference`` (float64)."""
    g = torch.Generator().manual_seed(nq * 1000 + nk)
    q = torch.randn(nq, hq, 16, generator=g, dtype=torch.float64)
    k = torch.randn(nk, hk, 16, generator=g, dtype=torch.float64)
    v = torch.randn(nk, hk, 16, generator=g, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, nq], dtype=torch.int32), torch.tensor([0, nk], dtype=torch.int32)
    got = kernel(q, k, v, 0.25)
    assert got.shape == (nq, hq, 16)
    torch.testing.assert_close(got, sequence_reference(q, k, v, cu_q, cu_k, nq, nk, 0.25))


@pytest.mark.parametrize("nq,after", [(5, 300), (300, 212), (300, 211), (256, 0), (40, 0)])
@pytest.mark.parametrize("kernel", [dp.dense_causal, dp.dense_causal_gqa])
def test_a_fresh_chunk_followed_by_enough_rows_is_read_in_place(nq, after, kernel):
    """A fresh chunk whose storage holds a whole square's rows from its first (the step's other rows or padding
    after it: here NaN and huge values) is read in place, those rows' outputs dropped; with fewer rows after it (or
    strided rows) the square is copied as before. Equal to the reference either way."""
    g = torch.Generator().manual_seed(nq + after)
    buf = torch.randn(nq + after, 4, 16, generator=g, dtype=torch.float64)
    buf[nq::2] = float("nan")  # whatever follows the chunk never reaches its outputs
    buf[nq + 1::2] = 1e30
    q = buf[:nq]
    k = torch.randn(nq, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(nq, 2, 16, generator=g, dtype=torch.float64)
    side = -(-nq // dp.SQUARE_ROWS) * dp.SQUARE_ROWS
    view = dp.rows_in_place(q, side)
    assert (view is not None) == (nq + after >= side)
    if view is not None:
        assert view.data_ptr() == q.data_ptr() and view.shape[0] == side
    cu = torch.tensor([0, nq], dtype=torch.int32)
    want = sequence_reference(q, k, v, cu, cu, nq, nq, 0.25)
    got = kernel(q, k, v, 0.25)
    assert got.shape == (nq, 4, 16) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want)
    assert dp.rows_in_place(buf[:, :, :8][:nq], side) is None  # rows not dense (a slice of each head)
    assert dp.rows_in_place(q, nq - 1) is None  # (fewer rows than the chunk: never)


def test_dense_worthy_bounds_the_padded_work():
    """Long enough, and the square's work within MAX_PAD_WORK of the causal work: a fresh chunk always, one over a
    short context yes, one over a context longer than itself no."""
    assert dp.dense_worthy(1024, 1024, 1024) and not dp.dense_worthy(1023, 1023, 1024)
    assert dp.dense_worthy(6000, 7200, 1024)  # a prompt's second chunk over its first 1,200 tokens
    assert not dp.dense_worthy(1024, 8000, 1024)  # a prompt's tail over 7k tokens: the square is ~4x the work
    for rows, ctx in ((1024, 1024), (4000, 5000), (3000, 6000), (2000, 2500)):
        square, causal = ctx * ctx / 2, rows * (ctx - rows / 2)
        assert dp.dense_worthy(rows, ctx, 1) is (square <= dp.MAX_PAD_WORK * causal)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=12), st.integers(0, 9),
       st.integers(1, 30))
def test_prefill_runs_cover_every_sequence_once(seqs, k_base, min_rows):
    """Runs partition the sequences in order; each run's rows and keys are its sequences' (keys from k_base); a
    dense run is one dense-worthy chunk, a varlen run holds none; None exactly where no chunk is dense-worthy."""
    lens = np.array([q for q, _ in seqs], dtype=np.int64)
    ends = np.array([q + e for q, e in seqs], dtype=np.int64)
    worthy = [dp.dense_worthy(int(q), int(e), min_rows) for q, e in zip(lens, ends)]
    runs = dp.prefill_runs(lens, ends, k_base, min_rows)
    if not any(worthy):
        assert runs is None
        return
    assert runs[0].seq_lo == 0 and runs[-1].seq_hi == len(seqs)
    assert all(a.seq_hi == b.seq_lo and a.q_hi == b.q_lo and a.k_hi == b.k_lo for a, b in zip(runs, runs[1:]))
    assert runs[0].q_lo == 0 and runs[0].k_lo == k_base and runs[-1].q_hi == lens.sum()
    assert runs[-1].k_hi == k_base + ends.sum()
    for r in runs:
        assert r.max_q == lens[r.seq_lo:r.seq_hi].max() and r.max_k == ends[r.seq_lo:r.seq_hi].max()
        if r.dense:
            assert r.seq_hi - r.seq_lo == 1 and worthy[r.seq_lo]
        else:
            assert not any(worthy[r.seq_lo:r.seq_hi])


def test_check_dense_keeps_flash_off_cuda():
    choice = dp.check_dense(torch.device("cpu"), torch.float32, 4, 2, 16, 16, sequence_reference, sequence_reference)
    assert choice.kernel is None and "cpu" in choice.reason


def test_threshold_is_where_the_dense_kernel_wins_from_there_up():
    """The shortest measured length from which dense beats FlashAttention-2 by MIN_SPEEDUP at every longer one."""
    win, lose = (1.0, 2.0), (1.0, 1.05)
    assert dp.threshold({1024: win, 2048: win, 4096: win}) == 1024
    assert dp.threshold({1024: lose, 2048: win, 4096: win}) == 2048
    assert dp.threshold({1024: win, 2048: lose, 4096: win}) == 4096  # a loss above 1024: not from 1024
    assert dp.threshold({1024: win, 2048: win, 4096: lose}) is None
    assert dp.threshold({4096: (1.0, 1.0 * dp.MIN_SPEEDUP)}) == 4096  # exactly MIN_SPEEDUP wins


# a prefill of two fresh prompts; a mixed step (a decode row, a short tail over a longer context, a fresh prompt,
# a second chunk over a short first one); a decode step
STEPS = [
    [SeqChunk("a", 0, 5), SeqChunk("b", 0, 9)],
    [SeqChunk("a", 5, 1), SeqChunk("b", 9, 4), SeqChunk("c", 0, 7), SeqChunk("d", 0, 3)],
    [SeqChunk("d", 3, 6), SeqChunk("a", 6, 1)],
    [SeqChunk("a", 7, 1), SeqChunk("b", 13, 1), SeqChunk("c", 7, 1), SeqChunk("d", 9, 1)],
]


@pytest.mark.parametrize("paged", [False, True])
def test_host_with_dense_chunks_equals_masked_host(hf_checkpoint, paged):
    """A varlen host whose chunks of >= 4 rows attend through ``dense_causal`` (the reference varlen kernel for
    the others; in place for one-row sequences when ``paged``) gives the masked host's logits at every step (fp32,
    CPU), and the dense kernel ran exactly on the dense-worthy chunks of each step, in every attention layer."""
    _, folder = hf_checkpoint("qwen3_moe")
    dense_calls: list[tuple[int, int]] = []

    def dense(q, k, v, scale):
        dense_calls.append((int(q.shape[0]), int(k.shape[0])))
        return dp.dense_causal(q, k, v, scale)

    masked = ModelHost.from_checkpoint(folder, attention=AttentionBackend.MASKED, kv_tokens=512)
    host = ModelHost.from_checkpoint(folder, attention=AttentionBackend.VARLEN, varlen_kernel=sequence_reference,
                                     kv_tokens=512, decode_kernel=paged_decode_reference if paged else None,
                                     dense_kernel=dense, dense_rows=4)
    assert host.kernels.dense is dense and host.dense_reason == "a caller's dense kernel"
    ex = types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(folder)).moe_forward)
    g = torch.Generator().manual_seed(0)
    want_calls = []
    for chunks in STEPS:
        ids = torch.randint(0, masked.vocab_size, (sum(c.num_tokens for c in chunks),), generator=g)
        want, got = step_logits([masked, host], chunks, ids, ex)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        step = [(c.num_tokens, c.start + c.num_tokens) for c in chunks
                if c.num_tokens > 1 and dp.dense_worthy(c.num_tokens, c.start + c.num_tokens, 4)]
        want_calls += step * host.config.num_hidden_layers
    assert dense_calls == want_calls and len(set(want_calls)) == 4  # a, b, c and d's second chunk


def test_masked_host_has_no_dense_kernel(hf_checkpoint):
    """The masked backend attends every chunk with its mask, and says so."""
    _, folder = hf_checkpoint("qwen3_moe")
    host = ModelHost.from_checkpoint(folder, attention=AttentionBackend.MASKED, kv_tokens=64)
    assert host.kernels.dense is None and "masked" in host.dense_reason


def test_the_squares_planned_at_start_cover_the_default_step():
    """A fresh prompt chunk of the default CUDA step (``driver/defaults.py``) finds its square planned at start,
    not on a request's step."""
    from ray_moe.driver.defaults import DEFAULT_STEP_TOKENS
    from ray_moe.model.dense_prefill import SQUARE_ROWS, WARM_ROWS

    assert WARM_ROWS >= DEFAULT_STEP_TOKENS["cuda"] and WARM_ROWS % SQUARE_ROWS == 0
