"""The in-place varlen attention of whole-step token graphs (model/paged_varlen.py) on CPU: its reference against
the per-sequence varlen reference over gathered contexts, the work tables (every real query row covered once,
within the static sizes), a token graph's plan against the exact step plan (the same rows, the same attention),
and the Triton kernel itself under Triton's CPU interpreter where Triton is installed (the GPU runs it in
tests/model/test_paged_varlen_gpu.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.types import AttentionBackend
from ray_moe.model import paged_varlen as pv
from ray_moe.model.attention import Kernels, attend, sequence_reference
from ray_moe.model.kv import PagedKVCache, SeqChunk

pytestmark = pytest.mark.triton  # its Triton kernels also run under the CPU interpreter (TRITON_INTERPRET=1)


def _tables(qlens: list[int], rows: int, seqs: int, bq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    na, nb = pv.table_sizes(rows, seqs, bq)
    one, seq, first = np.zeros(na, np.int64), np.zeros(nb, np.int64), np.zeros(nb, np.int64)
    pv.work_tables(np.asarray(qlens, dtype=np.int64), one, seq, first, bq)
    return tuple(torch.from_numpy(x).to(torch.int32) for x in (one, seq, first))


def _step(seed: int, qlens: list[int], extra: list[int], hq: int, hk: int, d: int, dv: int, dtype=torch.float64):
    """A ragged step: sequence i has ``extra[i]`` earlier keys plus its ``qlens[i]`` new rows, keys scattered
    over a cache of spare slots."""
    g = torch.Generator().manual_seed(seed)
    klens = [q + e for q, e in zip(qlens, extra)]
    cap = sum(klens) + 11
    k = torch.randn(cap, hk, d, generator=g, dtype=dtype)
    v = torch.randn(cap, hk, dv, generator=g, dtype=dtype)
    slots = torch.randperm(cap, generator=g)[: sum(klens)]
    q = torch.randn(sum(qlens), hq, d, generator=g, dtype=dtype)
    cu_q = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(klens)], dtype=torch.int32)
    return q, k, v, slots, cu_q, cu_k


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 30)), min_size=1, max_size=6),
       st.sampled_from([(4, 2, 8, 8), (2, 2, 8, 4), (8, 1, 16, 16)]), st.integers(0, 1000))
def test_reference_equals_the_varlen_reference_over_gathered_contexts(seqs, shape, seed):
    """Every sequence's rows over the keys at its scattered slots == the varlen contract over its context packed
    (causal at the bottom right, GQA, a narrower value head)."""
    hq, hk, d, dv = shape
    qlens, extra = [a for a, _ in seqs], [b for _, b in seqs]
    q, k, v, slots, cu_q, cu_k = _step(seed, qlens, extra, hq, hk, d, dv)
    tables = _tables(qlens, sum(qlens), len(qlens), pv.block_rows(hq, hk))
    got = pv.paged_varlen_reference(q, k, v, slots, cu_q, cu_k, *tables, 0.3)
    kg, vg = k[slots], torch.nn.functional.pad(v[slots], (0, d - dv))
    want = sequence_reference(q, kg, vg, cu_q, cu_k, max(qlens), int(max(cu_k.diff())), 0.3)[..., :dv]
    torch.testing.assert_close(got, want)


def test_rows_no_table_names_come_out_zero():
    q, k, v, slots, cu_q, cu_k = _step(3, [1, 5, 2], [4, 0, 3], 4, 2, 8, 8)
    one, seq, first = _tables([1, 5, 2], 8, 3, 4)
    seq[seq == 1] = -1  # the 5-row sequence left out of the tables
    got = pv.paged_varlen_reference(q, k, v, slots, cu_q, cu_k, one, seq, first, 0.3)
    assert got[1:6].abs().max() == 0 and got[0].abs().max() > 0 and got[6:].abs().max() > 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=12), st.sampled_from([1, 4, 16, 64]),
       st.integers(0, 40), st.integers(0, 4))
def test_work_tables_cover_every_row_once_within_their_sizes(lens, bq, pad_rows, pad_seqs):
    """Each one-row sequence once; each longer sequence's rows covered by its blocks exactly once; the tables'
    static sizes (from the step's row and sequence bounds) always hold them; empty entries -1."""
    rows, seqs = sum(lens) + pad_rows, len(lens) + pad_seqs
    na, nb = pv.table_sizes(rows, seqs, bq)
    one, seq, first = np.zeros(na, np.int64), np.zeros(nb, np.int64), np.zeros(nb, np.int64)
    pv.work_tables(np.asarray(lens, dtype=np.int64), one, seq, first, bq)
    covered = [0] * sum(lens)
    off = np.concatenate([[0], np.cumsum(lens)])
    for s in one[one >= 0]:
        assert lens[s] == 1
        covered[off[s]] += 1
    for s, f in zip(seq[seq >= 0], first[seq >= 0]):
        assert lens[s] > 1 and f % bq == 0 and f < lens[s]
        for r in range(f, min(f + bq, lens[s])):
            covered[off[s] + r] += 1
    assert covered == [1] * sum(lens)
    assert (one[(one < 0)] == -1).all() and (seq[np.flatnonzero(seq < 0)] == -1).all()


def test_work_tables_refuse_a_step_beyond_their_sizes():
    one, seq, first = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="one-row sequences"):
        pv.work_tables(np.asarray([1, 1]), one, seq, first, 4)
    with pytest.raises(ValueError, match="query blocks"):
        pv.work_tables(np.asarray([9]), one, seq, first, 4)


@pytest.mark.parametrize("chunks", [[(0, 7)], [(4, 1), (0, 9), (11, 1), (3, 6)], [(2, 1), (5, 1)]])
def test_a_token_graph_plan_attends_as_the_exact_step_plan(chunks):
    """``plan_token_graph`` (padded rows, offsets past the sequences, work tables) and ``plan_step`` (the
    exact plan) give the same rows, and attention over the cache through the token plan (the reference kernel,
    in place) equals ``attend`` over the exact plan's gathered contexts, padding rows zero."""
    cache = PagedKVCache(16, 4)
    seqs = [SeqChunk(f"s{i}", start, n) for i, (start, n) in enumerate(chunks)]
    for c in seqs:
        cache.reserve(c.seq_id, c.start + c.num_tokens)
    n = sum(c.num_tokens for c in seqs)
    ids = np.arange(1, n + 1, dtype=np.int64)
    rows, last_rows = n + 5, len(seqs) + 2
    hq, hk, d = 4, 2, 8
    bq = pv.block_rows(hq, hk)
    staged = cache.plan_token_graph(seqs, ids, rows, last_rows, (*pv.table_sizes(rows, last_rows, bq), bq))
    exact, plan = cache.plan_step(seqs, ids, AttentionBackend.VARLEN, rows=rows, last_rows=last_rows)
    for name in ("token_ids", "positions", "write_index", "row_valid", "last"):
        assert torch.equal(staged[name], getattr(exact, name)), name
    g = torch.Generator().manual_seed(0)
    k = torch.randn(cache.capacity_tokens + 1, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(cache.capacity_tokens + 1, hk, d, generator=g, dtype=torch.float64)
    q = torch.randn(1, hq, rows, d, generator=g, dtype=torch.float64)
    kernels = Kernels(sequence_reference, None, pv.paged_varlen_reference)
    want = attend(None, q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], plan, 0.3, kernels)  # [1, n, Hq, D]
    whole = type(plan)(rows, AttentionBackend.VARLEN, cu_q=staged["cu_q"], cu_k=staged["cu_k"],
                       slots=staged["read_index"], tables=(staged["one"], staged["seq"], staged["first"]))
    got = attend(None, q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], whole, 0.3, kernels)  # [1, R, Hq, D]
    torch.testing.assert_close(got[:, :n], want)
    assert got[:, n:].abs().max() == 0


@pytest.mark.parametrize("shape", [(8, 2, 16, 16), (4, 4, 32, 16), (16, 2, 16, 16)])
def test_the_triton_kernel_under_the_interpreter_equals_the_reference(shape):
    """The Triton kernel itself (both launches: one-row sequences, blocks of longer ones with causal diagonal
    tiles and contexts before them) run by Triton's CPU interpreter, fp32, against the reference (in a process
    of its own: the interpreter is chosen when Triton is imported)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    hq, hk, d, dv = shape
    code = ("import torch; from ray_moe.model import paged_varlen as pv; "
            f"print(pv.reference_error(torch.device('cpu'), torch.float32, {hq}, {hk}, {d}, {dv}, "
            "kernel=pv.paged_varlen))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) < 1e-4


def test_the_kernel_check_names_what_is_missing_on_a_cpu():
    assert "needs CUDA" in pv.check_paged_varlen(torch.device("cpu"), torch.bfloat16, 8, 2, 16)
