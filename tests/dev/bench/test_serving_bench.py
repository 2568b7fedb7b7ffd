"""The serving benchmark: its ``--quick`` preset on CPU (ray-moe and transformers' continuous batching on the same
tiny model, vLLM skipped when absent) writes a result whose every count is what ran and whose ratios are the
quotient of the two measured throughputs; the online client's TTFT / TPOT / ITL against a scripted SSE server;
the seeded workloads."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math

import httpx
import pytest
import torch
from ray_moe_bench import serving
from ray_moe_bench.serving import (
    Workload,
    WorkloadSpec,
    run_online,
    token_metrics,
    workload_spec,
)

LATENCY_KEYS = {"p50_ms", "p99_ms", "mean_ms", "count"}


def _check_latency(lat: dict, requests: int, new: int) -> None:
    assert set(lat) == {"ttft", "tpot", "itl", "e2e"}
    for name, s in lat.items():
        assert set(s) == LATENCY_KEYS, name
        assert 0 <= s["p50_ms"] <= s["p99_ms"], (name, s)
    assert lat["ttft"]["count"] == lat["e2e"]["count"] == requests
    assert lat["tpot"]["count"] == requests
    assert lat["itl"]["count"] == requests * (new - 1)
    assert lat["ttft"]["p50_ms"] <= lat["e2e"]["p50_ms"]


def test_quick_preset_runs_both_systems_and_every_count_is_what_ran(ray_session, tmp_path):
    out = tmp_path / "out"
    rc = serving.main(["--quick", "--in-process", "--no-warmup", "--out", str(out)])
    assert rc == 0
    (path,) = out.glob("serving-*.json")
    body = json.loads(path.read_text())
    assert body["benchmark"] == "serving" and body["quick"] is True and body["mode"] == "offline"
    assert body["device"] == "cpu" and body["dtype"] == "float32"
    assert {"machine", "torch", "ray"} <= set(body["hardware"]) and body["versions"]["transformers"]
    work = body["workload"]
    req, new = work["requests"], work["new_tokens"]
    assert (req, new, work["kind"]) == (8, 4, "mixed")
    assert body["model"]["random"] and body["model"]["config"]["num_hidden_layers"] == 2
    systems = body["systems"]
    for name in ("ray_moe", "transformers"):
        s = systems[name]
        assert s["status"] == "ok", s
        assert s["requests"] == req and s["output_tokens"] == req * new == s["expected_output_tokens"]
        assert s["output_tokens_per_request"] == [new]
        assert s["prompt_tokens"] == work["prompt_tokens"]
        assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
        assert s["total_tokens_per_s"] == pytest.approx((s["output_tokens"] + s["prompt_tokens"]) / s["wall_s"])
        assert s["streams"] is True and s["start_s"] > 0
        _check_latency(s["latency"], req, new)
        assert s["latency"]["e2e"]["p99_ms"] <= s["wall_s"] * 1e3 + 1.0
    assert systems["ray_moe"]["settings"]["ranks"] == 2
    # float32 greedy on the same weights: the two systems made the same tokens
    assert body["same_tokens"]["identical"] is True
    assert systems["ray_moe"]["outputs_digest"] == systems["transformers"]["outputs_digest"]
    ratios = body["ratios"]
    assert ratios["ray_moe_over_transformers_output_tokens_per_s"] == pytest.approx(
        systems["ray_moe"]["output_tokens_per_s"] / systems["transformers"]["output_tokens_per_s"])
    if importlib.util.find_spec("vllm") is None:
        assert systems["vllm"] == {"status": "skipped", "reason": "vllm is not installed (import vllm fails)"}
        assert ratios["ray_moe_over_vllm_output_tokens_per_s"] is None
        assert "vllm: skipped" in ratios["ray_moe_over_vllm_output_tokens_per_s_why_none"]
    lens = work["prompt_len_min_mean_max"]
    assert 16 <= lens[0] <= lens[1] <= lens[2] <= int(3.2 * 24)


def test_config_only_builds_transformers_on_the_device_without_weights(tmp_path):
    """``--config-only`` writes no weights; transformers' generate_batch still runs, on a model built from the
    config with its own initialisation (the whole 48-layer shape would need its 61 GB written to disk)."""
    out = tmp_path / "out"
    rc = serving.main(["--quick", "--in-process", "--no-warmup", "--config-only", "--systems", "transformers",
                       "--keep-model", str(tmp_path / "m"), "--out", str(out)])
    assert rc == 0
    assert not list((tmp_path / "m").glob("*.safetensors"))  # the folder holds the config and tokenizer only
    (path,) = out.glob("serving-*.json")
    body = json.loads(path.read_text())
    s = body["systems"]["transformers"]
    assert s["status"] == "ok", s
    work = body["workload"]
    assert s["output_tokens"] == work["requests"] * work["new_tokens"] == s["expected_output_tokens"]
    assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
    assert serving.random_model_bytes(str(tmp_path / "m"), torch.float32) > 0


def _scripted_server(delays_s: list[float], record: list[dict]):
    """A streaming /v1/completions that sends one token per chunk after each delay (token i = 100 + i)."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        record.append(body)

        async def events():
            for i, d in enumerate(delays_s[:body["max_tokens"]]):
                await asyncio.sleep(d)
                chunk = {"choices": [{"index": 0, "token_ids": [100 + i], "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            final = {"choices": [{"index": 0, "token_ids": [], "finish_reason": "length"}]}
            yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode()

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_online_client_measures_ttft_tpot_itl_as_benchmark_serving_defines_them():
    delays = [0.20, 0.05, 0.05, 0.05]
    record: list[dict] = []
    prompts = [[1, 2, 3], [4, 5], [6]]
    res = asyncio.run(run_online("http://bench", prompts, 4, math.inf, 0,
                                 transport=_scripted_server(delays, record)))
    assert res["status"] == "ok" and res["model"] == "tiny" and res["errors"] == []
    assert res["output_tokens"] == 12 and res["output_tokens_per_request"] == [4] and res["stopped_early"] == 0
    assert res["finish_reasons"] == {"length": 3}
    assert all(b["prompt"] == p and b["stream"] is True and b["temperature"] == 0.0 and b["model"] == "tiny"
               for b, p in zip(sorted(record, key=lambda b: b["prompt"]), prompts))
    lat = res["latency"]
    _check_latency(lat, 3, 4)
    assert 190 <= lat["ttft"]["p50_ms"] < 600
    assert 45 <= lat["itl"]["p50_ms"] < 300 and 45 <= lat["tpot"]["p50_ms"] < 300
    assert lat["e2e"]["p50_ms"] >= lat["ttft"]["p50_ms"] + 3 * 45


def test_online_client_stops_early_and_reports_it():
    res = asyncio.run(run_online("http://bench", [[1]] * 2, 5, 50.0, 0, model="tiny",
                                 transport=_scripted_server([0.0, 0.0], [])))
    assert res["output_tokens"] == 4 and res["stopped_early"] == 2
    assert res["latency"]["itl"]["count"] == 2 and res["rate_per_s"] == 50.0


def test_workloads_are_seeded_and_shaped():
    mixed = workload_spec(Workload.MIXED, 2000, None, None, 3)
    lens = mixed.prompt_lengths()
    assert lens == workload_spec(Workload.MIXED, 2000, None, None, 3).prompt_lengths()
    assert lens != workload_spec(Workload.MIXED, 2000, None, None, 4).prompt_lengths()
    assert min(lens) >= 16 and max(lens) <= 1536 and 400 <= sum(lens) / len(lens) <= 520
    assert mixed.new_tokens == 128
    dec = workload_spec(Workload.DECODE_HEAVY, 5, None, None, 0)
    assert dec.prompt_lengths() == [32] * 5 and dec.new_tokens == 256
    pre = workload_spec(Workload.PREFILL_HEAVY, 300, None, None, 0)
    assert 1024 <= min(pre.prompt_lengths()) and max(pre.prompt_lengths()) <= 2048 and pre.new_tokens == 16
    prompts = WorkloadSpec(Workload.DECODE_HEAVY, 3, 2, 7, 0).prompts(50)
    assert [len(p) for p in prompts] == [7] * 3 and all(0 <= t < 50 for p in prompts for t in p)
    with pytest.raises(ValueError, match=r"--new-tokens=0"):
        workload_spec(Workload.MIXED, 4, 0, None, 0)


def test_metrics_without_timestamps_are_throughput_only():
    res = token_metrics([[1, 2], [3]], [[5, 6, 7], [8, 9, 10]], 2.0)
    assert res["output_tokens"] == 6 and res["output_tokens_per_s"] == 3.0 and res["total_tokens_per_s"] == 4.5
    assert res["streams"] is False and "latency" not in res


def test_bad_flags_fail_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        serving.main(["--quick", "--requests", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--requests=0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving.main(["--online", "--out", str(tmp_path)])
    assert "--vocab-size" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
