"""The attention bench's dense SDPA candidates (``ray_moe_bench.paged_varlen.dense_backends``): every backend is
timed against the varlen reference or records why it does not run here; none raises."""

from __future__ import annotations

import torch

from ray_moe_bench.paged_varlen import dense_backends


def test_dense_backends_record_a_time_or_the_reason_for_each_backend(monkeypatch):
    """On CPU the fused backends refuse (their reasons recorded); with the math backend standing in for one of them
    the causal output of a grouped-query sequence matches the reference computed by hand."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(12, 4, 16, generator=g), torch.randn(12, 2, 16, generator=g), torch.randn(12, 2, 16, generator=g)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, kr) * 0.25
    logits = logits.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", logits.softmax(-1), vr)
    import ray_moe_bench.paged_varlen as bench
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(bench, "time_interleaved", lambda fns, warmup, iters: {n: {"median_ms": 1.0} for n in fns})
    out = dense_backends(q, k, v, 0.25, ref, 2e9)
    assert set(out) == {"cudnn_attention", "flash_attention", "efficient_attention"}
    assert all(("error" in r) != ("ms" in r) for r in out.values()), out
    real_kernel = torch.nn.attention.sdpa_kernel
    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", lambda backend: real_kernel(SDPBackend.MATH))
    out = dense_backends(q, k, v, 0.25, ref, 2e9)
    assert all(r["max_abs_diff_vs_flash_varlen"] < 1e-5 and r["tflops"] == 2.0 for r in out.values()), out
