"""The in-place varlen kernel (Triton, model/paged_varlen.py) on CUDA against the per-sequence reference: decode
rows beside prefill chunks continuing long contexts at scattered cache slots, grouped-query shapes, empty table
entries, and inside a CUDA graph of static tables replayed with steps of other sequences."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ray_moe.model import paged_varlen as pv

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def _step(qlens, extra, hq, hk, d, dv, seed=0, dtype=torch.bfloat16, cap=None):
    g = torch.Generator().manual_seed(seed)
    klens = [q + e for q, e in zip(qlens, extra)]
    cap = cap or sum(klens) + 64
    k = torch.randn(cap, hk, d, generator=g).to(DEV, dtype)
    v = torch.randn(cap, hk, dv, generator=g).to(DEV, dtype)
    slots = torch.randperm(cap, generator=g)[: sum(klens)].to(DEV)
    q = torch.randn(sum(qlens), hq, d, generator=g).to(DEV, dtype)
    cu_q = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, *itertools.accumulate(klens)], dtype=torch.int32, device=DEV)
    return q, k, v, slots, cu_q, cu_k


def _tables(qlens, rows, seqs, bq, pad_to=None):
    na, nb = pv.table_sizes(rows, seqs, bq)
    one, seq, first = np.zeros(na, np.int64), np.zeros(nb, np.int64), np.zeros(nb, np.int64)
    pv.work_tables(np.asarray(qlens, dtype=np.int64), one, seq, first, bq)
    return tuple(torch.from_numpy(x).to(DEV, torch.int32) for x in (one, seq, first))


CASES = [
    ([1] * 40 + [513, 1, 70], [500] * 40 + [0, 3000, 2000]),  # decode rows, a fresh chunk, a continued one
    ([2048], [4000]),  # one long chunk over a long context
    ([1, 1, 1], [1, 64, 1000]),  # decode rows only
    ([3, 17, 16, 1, 33], [0, 5, 100, 0, 64]),  # short ragged chunks
]


@pytest.mark.parametrize("hq,hk,d,dv", [(32, 4, 128, 128), (32, 8, 128, 128), (8, 8, 64, 64), (16, 2, 64, 32)])
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference(hq, hk, d, dv, case):
    assert pv.check_paged_varlen(DEV, torch.bfloat16, hq, hk, d, dv) is None
    qlens, extra = case
    q, k, v, slots, cu_q, cu_k = _step(qlens, extra, hq, hk, d, dv)
    tables = _tables(qlens, sum(qlens) + 7, len(qlens) + 3, pv.block_rows(hq, hk))
    got = pv.paged_varlen(q, k, v, slots, cu_q, cu_k, *tables, d ** -0.5).float()
    want = pv.paged_varlen_reference(q.float(), k.float(), v.float(), slots, cu_q, cu_k, *tables, d ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_kernel_replays_in_a_cuda_graph_over_other_steps():
    """Static tables, offsets and slot vector sized for 1,100 rows and 64 sequences, captured once; replayed
    with two steps of different sequences (each copied into the static inputs): each equals the reference."""
    hq, hk, d = 32, 4, 128
    rows, seqs, bq = 1100, 64, pv.block_rows(hq, hk)
    na, nb = pv.table_sizes(rows, seqs, bq)
    cap = 40000
    g = torch.Generator().manual_seed(1)
    k = torch.randn(cap, hk, d, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(cap, hk, d, generator=g).to(DEV, torch.bfloat16)
    st = {"q": torch.zeros(rows, hq, d, dtype=torch.bfloat16, device=DEV),
          "slots": torch.zeros(cap, dtype=torch.int64, device=DEV),
          "cu_q": torch.zeros(seqs + 1, dtype=torch.int32, device=DEV),
          "cu_k": torch.zeros(seqs + 1, dtype=torch.int32, device=DEV),
          "one": torch.full((na,), -1, dtype=torch.int32, device=DEV),
          "seq": torch.full((nb,), -1, dtype=torch.int32, device=DEV),
          "first": torch.zeros(nb, dtype=torch.int32, device=DEV)}

    def run():
        return pv.paged_varlen(st["q"], k, v, st["slots"], st["cu_q"], st["cu_k"], st["one"], st["seq"],
                               st["first"], d ** -0.5)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed, qlens, extra in ((2, [1] * 60 + [900], [300] * 60 + [5000]), (3, [1, 400, 1, 33], [7, 0, 9000, 17])):
        gq = torch.Generator().manual_seed(seed)
        klens = [a + b for a, b in zip(qlens, extra)]
        slots = torch.randperm(cap, generator=gq)[: sum(klens)].to(DEV)
        q = torch.randn(sum(qlens), hq, d, generator=gq).to(DEV, torch.bfloat16)
        cu_q = torch.tensor([0, *itertools.accumulate(qlens)] + [sum(qlens)] * (seqs - len(qlens)),
                            dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([0, *itertools.accumulate(klens)] + [sum(klens)] * (seqs - len(qlens)),
                            dtype=torch.int32, device=DEV)
        one, seq, first = _tables(qlens, rows, seqs, bq)
        st["q"].zero_()
        st["q"][: q.shape[0]].copy_(q)
        st["slots"][: slots.numel()].copy_(slots)
        for name, t in (("cu_q", cu_q), ("cu_k", cu_k), ("one", one), ("seq", seq), ("first", first)):
            st[name].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        want = pv.paged_varlen_reference(q.float(), k.float(), v.float(), slots, cu_q, cu_k, one, seq, first,
                                         d ** -0.5)
        torch.testing.assert_close(out[: q.shape[0]].float(), want, atol=2e-2, rtol=2e-2)
        assert out[q.shape[0]:].abs().max() == 0
