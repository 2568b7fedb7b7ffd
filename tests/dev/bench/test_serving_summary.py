"""The serving summary reads each system's result JSON back (no figure computed anew but the ratio)."""

from __future__ import annotations

import json
import os

from ray_moe_bench import serving_summary


def _write(root, system, workload, entry):
    os.makedirs(os.path.join(root, system, workload))
    with open(os.path.join(root, system, workload, "serving-x.json"), "w") as fh:
        json.dump({"systems": {system: entry}}, fh)


def test_summary_pairs_the_systems_by_workload(tmp_path):
    lat = {"ttft": {"p50_ms": 90.0, "p99_ms": 150.0}, "tpot": {"p50_ms": 16.0, "p99_ms": 19.0}}
    _write(tmp_path, "ray_moe", "chat", {"output_tokens_per_s": 6000.0, "requests": 1000, "start_s": 50.0,
                                         "timed_pass_graphs": {"total": {"captures_serving": 0}},
                                         "non_defaults": {}, "step_paths": {"paths": {"decode": "x"}},
                                         "shard_gc": {"0": {"gc_pause_us": 1500}, "1": {"gc_pause_us": 500}}})
    _write(tmp_path, "vllm", "chat", {"output_tokens_per_s": 5000.0, "requests": 1000, "non_defaults": {"a": 1}})
    _write(tmp_path, "ray_moe", "chat-online", {"output_tokens_per_s": 1280.0, "latency": lat})
    res = serving_summary.main([str(tmp_path), "--what", "a lease"])
    assert res["workloads"]["chat"]["ratio"] == 1.2 and res["workloads"]["chat-online"]["ratio"] is None
    assert res["workloads"]["chat"]["ray_moe_timed_pass_graphs"] == {"captures_serving": 0}
    assert res["workloads"]["chat-online"]["ray_moe_ttft_p50_p99_ms"] == [90.0, 150.0]
    assert res["workloads"]["chat"]["ray_moe_shard_gc_pause_ms"] == 2.0
    assert res["workloads"]["chat-online"]["ray_moe_shard_gc_pause_ms"] is None
    assert res["non_defaults"]["vllm"] == {"a": 1} and res["ray_moe_start"]["start_s"] == 50.0
    with open(tmp_path / "summary.json") as fh:
        assert json.load(fh)["what"] == "a lease"
