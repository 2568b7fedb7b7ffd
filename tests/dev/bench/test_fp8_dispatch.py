"""ray_moe/bench/fp8_dispatch.py on CPU: the quick run end to end (JSON on disk, real values), and the SPMD rank
body that the GPU run uses (``bench_rank`` through ``run_spmd``), here with backend="local" on two ranks."""

from __future__ import annotations

import json
from dataclasses import asdict

from ray_moe_bench.fp8_dispatch import Fp8BenchConfig, aggregate, bench_rank, main
from ray_moe_dev.testing.spmd import run_spmd

FORMATS = ("native", "fp8_row", "fp8_block128")


def _check_case(case: dict, iters: int) -> None:
    assert set(case) == set(FORMATS)
    native = case["native"]
    assert native["remote_rows"] > 0
    assert native["rel_error_vs_exact"] < 1e-2  # bf16 payload: only the bf16 output rounding
    assert native["wire_bytes_vs_bf16"] == 1.0 and native["dispatch_time_vs_bf16"] == 1.0
    for f in ("fp8_row", "fp8_block128"):
        r = case[f]
        assert r["count_matrix"] == native["count_matrix"]  # same routes in every format
        assert r["wire_bytes_vs_bf16"] < 0.6 and r["analytical_bytes_vs_bf16"] < 0.6
        assert 0.0 < r["rel_error_vs_exact"] < 0.1  # e4m3: ~2^-5 relative, never exact
        assert r["rel_error_vs_exact"] > native["rel_error_vs_exact"]
        assert r["received_dtype"] == "torch.float8_e4m3fn"
    assert case["fp8_block128"]["wire_bytes_from_counts"] > case["fp8_row"]["wire_bytes_from_counts"]
    for r in case.values():
        assert r["dispatch"]["iters"] == iters and r["dispatch_combine"]["iters"] == iters
        assert 0 < r["dispatch"]["median_ms"] and 0 < r["dispatch_combine"]["median_ms"]
        # wire bytes from the counts: remote rows * (data + scales + slot id) per row
        rb = r["row_bytes"]
        assert r["wire_bytes_from_counts"] == r["remote_rows"] * (rb["data"] + rb["scales"] + rb["slot_id"])
        assert r["wire_bytes_from_counts"] - r["dispatch_payload_bytes_analytical"] == 4 * r["remote_rows"]
        assert r["ledger"]["evidence"] == "analytical"


def test_quick_run_writes_real_values(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_MOE_RESULTS_DIR", str(tmp_path))
    path = main(["--quick", "--backend", "local"])
    assert path.endswith("fp8_dispatch-cpu-quick.json")
    body = json.loads(open(path).read())
    assert body["hardware"]["cpu_count"] and body["config"]["backend"] == "local"
    assert body["shapes"] == {"world": 4, "d": 1024, "tokens_per_rank": [64], "k": 8, "experts": 32,
                              "activation_dtype": "bfloat16"}
    assert body["evidence"]["time"].startswith("measured")
    assert body["evidence"]["dispatch_payload_bytes_analytical"].startswith("analytical")
    assert "from counts" in body["evidence"]["wire_bytes_from_counts"]
    _check_case(body["results"]["64"], iters=3)


def test_bench_rank_spmd_local_two_ranks_deterministic():
    cfg = Fp8BenchConfig(world=2, backend="local", d=256, k=4, experts=8, tokens=(16, 48), warmup=1, iters=2, seed=3)
    fields = {**asdict(cfg), "tokens": list(cfg.tokens)}
    ranks = run_spmd(bench_rank, 2, args=(fields,), backend="local", timeout_s=60.0, exchange_timeout_s=10.0)
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["device"] == "cpu" for r in ranks)
    res = aggregate(cfg, ranks)
    assert list(res) == ["16", "48"]
    for t, case in res.items():
        _check_case(case, iters=2)
        assert sum(map(sum, case["native"]["count_matrix"])) == 2 * int(t) * cfg.k  # every route, once
    again = aggregate(cfg, run_spmd(bench_rank, 2, args=(fields,), backend="local", timeout_s=60.0,
                                    exchange_timeout_s=10.0))
    for t in res:
        for f in FORMATS:
            assert again[t][f]["count_matrix"] == res[t][f]["count_matrix"]
            assert again[t][f]["rel_error_vs_exact"] == res[t][f]["rel_error_vs_exact"]
