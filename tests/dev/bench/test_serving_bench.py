"""The serving benchmark: its ``--quick`` preset on CPU (ray-moe and transformers' continuous batching on the same
tiny model over two workloads in one worker process each, vLLM skipped when absent) writes one result per
workload whose every count is what ran, whose warm-up shares no length with the timed passes, whose ray-moe
settings are the product's defaults (only the flags given are passed) and whose timed-pass graph counters are
reported; a capture while serving fails the run; the in-process online mode (Poisson arrivals) reports TTFT /
TPOT / ITL per request; the HTTP client's TTFT / TPOT / ITL against a scripted SSE server; the seeded
workloads (chat's variable outputs, long's 6-8k prompts)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import subprocess

import httpx
import numpy as np
import pytest
import torch
from ray_moe_bench import serving
from ray_moe_bench.serving import (
    Requests,
    Role,
    Workload,
    WorkloadSpec,
    graph_deltas,
    poisson_arrivals,
    run_online,
    timed_requests,
    token_metrics,
    warmup_count,
    warmup_requests,
    workload_spec,
)

from ray_moe.driver.defaults import DEFAULT_STEP_TOKENS

LATENCY_KEYS = {"p50_ms", "p99_ms", "mean_ms", "count"}


def _check_latency(lat: dict, news: list[int]) -> None:
    """Every request streamed its own count of tokens: one TTFT and e2e each, a TPOT each (all >= 2 tokens),
    an ITL per gap."""
    assert set(lat) == {"ttft", "tpot", "itl", "e2e"}
    for name, s in lat.items():
        assert set(s) == LATENCY_KEYS, name
        assert 0 <= s["p50_ms"] <= s["p99_ms"], (name, s)
    assert lat["ttft"]["count"] == lat["e2e"]["count"] == len(news)
    assert lat["tpot"]["count"] == sum(n > 1 for n in news)
    assert lat["itl"]["count"] == sum(n - 1 for n in news)
    assert lat["ttft"]["p50_ms"] <= lat["e2e"]["p50_ms"]


def _body(out, kind: str, online: bool = False) -> dict:
    (path,) = (out / (kind + ("-online" if online else ""))).glob("serving-*.json")
    return json.loads(path.read_text())


def _check_graphs(s: dict, ranks: int = 2) -> None:
    """The timed pass's graph counters, per shard: no capture (everything is captured at start), every step a
    shard ran counted on some path (CPU: eager)."""
    g = s["timed_pass_graphs"]
    assert set(g["per_shard"]) == {str(r) for r in range(ranks)} and g["serving_captures_ok"] is True
    for d in g["per_shard"].values():
        assert set(d) == {"captures", "captures_serving", "decode_graph_steps", "token_graph_steps", "piecewise_steps",
                          "eager_steps", "graph_replays", "completions_between_pieces"}
        assert d["captures"] == d["captures_serving"] == d["completions_between_pieces"] == 0  # (CPU: no pieces)
    assert g["total"]["eager_steps"] == sum(d["eager_steps"] for d in g["per_shard"].values()) > 0
    assert g["total"]["decode_graph_steps"] == g["total"]["piecewise_steps"] == 0  # (CPU: no CUDA graphs)
    # the experts each (step, layer) of the pass touched: the pass's own counts (a difference of the books')
    u = s["expert_use"]
    assert u["layer_steps"] > 0 and u["routes"] >= u["touched"] >= u["layer_steps"]
    assert 1 <= u["touched_per_layer_step"] <= u["experts"] and 1 <= u["peak_over_mean"] <= u["experts"]


@pytest.fixture(scope="module")
def deployments(ray_session):
    """The ray-moe deployment this module's default-settings runs share (a CPU start costs 20-40 s), once started."""
    held: dict = {}
    yield held
    if "rt" in held:
        held.pop("rt").shutdown()


@pytest.fixture
def shared_deployment(deployments, monkeypatch):
    """The benchmark's ``start_runtime`` hands this run the module's deployment (started by the first run that
    asks: its engine, built by that run's ``rt.serving()``, serves the later ones too; every run's own model
    folder holds the same seeded model); ``stop_runtime`` leaves it running."""
    real = serving.start_runtime

    def start(cfg):
        if "rt" not in deployments:
            deployments["rt"] = real(cfg)
        return deployments["rt"]

    monkeypatch.setattr(serving, "start_runtime", start)
    monkeypatch.setattr(serving, "stop_runtime", lambda rt: None)
    return deployments


def _spy_serving(monkeypatch) -> list[dict]:
    """Record the keyword arguments every ``rt.serving`` call of the benchmark gets."""
    calls: list[dict] = []
    start = serving.start_runtime

    def spying(cfg):
        rt = start(cfg)
        real = rt.serving

        def serving_(**kw):
            calls.append(kw)
            return real(**kw)

        monkeypatch.setattr(rt, "serving", serving_)
        return rt

    monkeypatch.setattr(serving, "start_runtime", spying)
    return calls


def test_quick_preset_runs_two_workloads_in_one_process_and_every_count_is_what_ran(shared_deployment, tmp_path,
                                                                                       monkeypatch):
    calls = _spy_serving(monkeypatch)
    out = tmp_path / "out"
    rc = serving.main(["--quick", "--in-process", "--workloads", "mixed", "chat", "--second-pass",
                       "--systems", "ray_moe", "transformers", "vllm", "--out", str(out)])
    assert rc == 0
    assert calls == [{}]  # one start for both workloads, every ray-moe setting left to the product
    mixed, chat = _body(out, "mixed"), _body(out, "chat")
    for body in (mixed, chat):
        assert body["benchmark"] == "serving" and body["quick"] is True and body["mode"] == "offline"
        assert body["device"] == "cpu" and body["dtype"] == "float32"
        assert {"machine", "torch", "ray"} <= set(body["hardware"]) and body["versions"]["transformers"]
        assert body["run"]["workloads"] == ["mixed", "chat"] and body["run"]["second_pass"] is True
        assert body["model"]["random"] and body["model"]["config"]["num_hidden_layers"] == 2
        # the warm-up: fewer requests, no prompt length, output length or first token id of any timed request
        warm = body["warmup"]
        assert warm["disjoint_prompt_lengths"] and warm["disjoint_new_tokens"] and warm["shared_first_tokens"] == 0
        assert warm["by_workload"]["mixed"]["requests"] == warm["by_workload"]["chat"]["requests"] == 4
        r = body["systems"]["ray_moe"]
        assert r["status"] == "ok", r
        assert r["process"] == {"workloads": ["mixed", "chat"], "shared": True, "status": "ok", "error": None}
        assert set(r["warmup_s"]) == {"mixed", "chat"}
        # the product's defaults, read back from the engine; nothing passed, nothing listed as changed
        assert r["non_defaults"] == {} and r["bench_passed"] == {}
        # each shard says which tuned FP8 launch table drove its kernels (none on a CPU: no FP8 kernels)
        assert [s["fp8_launch_table"] for s in r["shards"].values()] == [None, None]
        st = r["settings"]
        assert (st["ranks"], st["step_tokens"], st["max_running"]) == (2, DEFAULT_STEP_TOKENS["cpu"], 256)
        assert st["rank_running"] == 128 and st["decode_steps"] == 1 and st["prefix_caching"] is True
        assert st["kv_tokens_per_rank"] > 0 and st["decode_token_capacity"] is None
        assert set(r["step_paths"]) >= {"lattice", "paths", "captures"} and "decode" in r["step_paths"]["paths"]
        assert r["engine_warnings"] == [] and r["capture_s"] >= 0
        _check_graphs(r)
        assert r["prefix_hit_tokens"] == 0  # neither the warm-up nor the other workload served a timed prompt
        second = r["second_pass"]
        assert second["status"] == "ok" and second["output_tokens"] == r["output_tokens"]
        assert second["outputs_digest"] == r["outputs_digest"] and second["prefix_hit_tokens"] > 0
        _check_graphs(second)
    # mixed: 8 requests of 4 tokens, ray-moe and transformers both, the same tokens
    work = mixed["workload"]
    assert (work["requests"], work["new_tokens"], work["kind"]) == (8, 4, "mixed")
    assert work["expected_output_tokens"] == 32 and work["first_token_shifts"] == 0
    systems = mixed["systems"]
    for name in ("ray_moe", "transformers"):
        s = systems[name]
        assert s["status"] == "ok", s
        assert s["requests"] == 8 and s["output_tokens"] == 32 == s["expected_output_tokens"]
        assert s["output_tokens_per_request"] == [4] and s["mismatched_requests"] == 0
        assert s["prompt_tokens"] == work["prompt_tokens"]
        assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
        assert s["total_tokens_per_s"] == pytest.approx((s["output_tokens"] + s["prompt_tokens"]) / s["wall_s"])
        assert s["streams"] is True and s["start_s"] > 0
        _check_latency(s["latency"], [4] * 8)
        assert s["latency"]["e2e"]["p99_ms"] <= s["wall_s"] * 1e3 + 1.0
        assert s["second_pass"]["status"] == "ok" and s["second_pass"]["output_tokens"] == 32
    # float32 greedy on the same weights: the two systems made the same tokens
    assert mixed["same_tokens"]["identical"] is True
    assert systems["ray_moe"]["outputs_digest"] == systems["transformers"]["outputs_digest"]
    ratios = mixed["ratios"]
    assert ratios["ray_moe_over_transformers_output_tokens_per_s"] == pytest.approx(
        systems["ray_moe"]["output_tokens_per_s"] / systems["transformers"]["output_tokens_per_s"])
    lens = work["prompt_len_min_mean_max"]
    assert 16 <= lens[0] <= lens[1] <= lens[2] <= int(3.2 * 24)
    # chat: each request its own count of tokens; transformers (one max_new_tokens per call) skipped, saying why
    news = WorkloadSpec(Workload.CHAT, 8, 4, 24, 0).new_tokens_list()
    assert len(set(news)) > 1
    c = chat["systems"]["ray_moe"]
    assert c["output_tokens"] == sum(news) == c["expected_output_tokens"] == chat["workload"]["expected_output_tokens"]
    assert c["mismatched_requests"] == 0 and c["output_tokens_per_request"] == sorted(set(news))
    _check_latency(c["latency"], news)
    tf = chat["systems"]["transformers"]
    assert tf["status"] == "skipped" and "one max_new_tokens per call" in tf["reason"]
    assert chat["ratios"]["ray_moe_over_transformers_output_tokens_per_s"] is None
    if importlib.util.find_spec("vllm") is None:
        for body in (mixed, chat):
            assert body["systems"]["vllm"] == {"status": "skipped",
                                               "reason": "vllm is not installed (import vllm fails)"}
            assert "vllm: skipped" in body["ratios"]["ray_moe_over_vllm_output_tokens_per_s_why_none"]


def test_a_graph_captured_while_serving_fails_the_run(shared_deployment, tmp_path, monkeypatch):
    """``graphs_captured_serving`` grows in the timed pass (simulated: the counter read after the warm-up and
    pass reports one more capture on shard 1): the pass and the run say so, the benchmark exits 1."""
    real = serving.read_graph_counters
    reads = []

    def grows(rt):
        got = real(rt)
        reads.append(got)
        if len(reads) % 2 == 0:  # the read after the pass
            got["1"]["graphs_captured_serving"] += 1
        return got

    monkeypatch.setattr(serving, "read_graph_counters", grows)
    out = tmp_path / "out"
    rc = serving.main(["--quick", "--in-process", "--systems", "ray_moe", "--requests", "2", "--new-tokens", "2",
                       "--no-warmup", "--out", str(out)])
    assert rc == 1 and len(reads) == 2
    (path,) = out.glob("serving-*.json")
    s = json.loads(path.read_text())["systems"]["ray_moe"]
    assert s["status"] == "error" and "graphs_captured_serving grew" in s["error"] and "'1': 1" in s["error"]
    g = s["timed_pass_graphs"]
    assert g["per_shard"]["1"]["captures_serving"] == 1 and g["per_shard"]["0"]["captures_serving"] == 0
    assert g["serving_captures_ok"] is False
    assert s["output_tokens"] == 4 == s["expected_output_tokens"]  # (what it measured is still there)
    assert s["process"]["status"] == "error"


def test_online_inprocess_submits_at_poisson_arrivals_and_reports_latency_per_request(shared_deployment, tmp_path,
                                                                                      monkeypatch):
    calls = _spy_serving(monkeypatch)
    out = tmp_path / "out"
    rate = 20.0
    # (seed 1: other prompts than the first test's, whose blocks the shared deployment's prefix cache holds)
    rc = serving.main(["--quick", "--in-process", "--online-inprocess", "--rate", str(rate), "--workloads", "chat",
                       "--seed", "1", "--systems", "ray_moe", "transformers", "--out", str(out)])
    assert rc == 0
    assert calls == [{}]
    body = _body(out, "chat", online=True)
    assert body["mode"] == "online-inprocess" and body["run"]["rate_per_s"] == rate
    assert body["run"]["flags_changed"] == {"quick": True, "in_process": True, "online_inprocess": True,
                                            "rate": rate, "workloads": ["chat"], "seed": 1,
                                            "systems": ["ray_moe", "transformers"]}
    s = body["systems"]["ray_moe"]
    assert s["status"] == "ok", s
    assert s["non_defaults"] == {}
    news = WorkloadSpec(Workload.CHAT, 8, 4, 24, 1).new_tokens_list()
    assert s["output_tokens"] == sum(news) == s["expected_output_tokens"] and s["mismatched_requests"] == 0
    _check_latency(s["latency"], news)
    arrivals = poisson_arrivals(8, rate, 1)
    assert s["rate_per_s"] == rate and s["arrival_span_s"] == pytest.approx(arrivals[-1])
    assert s["wall_s"] >= s["arrival_span_s"] and s["max_submit_lag_ms"] < 500
    assert s["errors"] == [] and s["prefix_hit_tokens"] == 0
    _check_graphs(s)
    assert body["warmup"]["disjoint_prompt_lengths"] and body["warmup"]["requests"] == 4
    tf = body["systems"]["transformers"]
    assert tf["status"] == "skipped" and "online mode" in tf["reason"]


def test_only_the_flags_given_reach_ray_moe():
    """Each ray-moe flag goes to its own keyword (RuntimeConfig or rt.serving) only when given."""
    parse = serving.build_parser().parse_args
    assert serving.ray_moe_flags(parse([])) == ({}, {})
    got = serving.ray_moe_flags(parse(["--max-running", "4", "--decode-capacity", "3", "--step-tokens", "512",
                                       "--decode-steps", "2", "--kv-tokens", "4096", "--attention", "masked",
                                       "--no-prefix-caching"]))
    assert got == ({"decode_token_capacity": 3},
                   {"max_running": 4, "step_tokens": 512, "decode_steps": 2, "kv_tokens": 4096,
                    "attention": "masked", "prefix_caching": False})


def test_a_failed_worker_exits_nonzero_and_keeps_its_result(tmp_path, monkeypatch):
    spec = {"result_path": str(tmp_path / "r.json")}
    (tmp_path / "s.json").write_text(json.dumps(spec))
    monkeypatch.setattr(serving, "WORKERS", {Role.RAY_MOE: lambda spec, save: {"status": "error", "error": "x",
                                                                               "passes": {}}})
    assert serving.worker_main(Role.RAY_MOE, str(tmp_path / "s.json")) == 1
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "error"
    monkeypatch.setattr(serving, "WORKERS", {Role.RAY_MOE: lambda spec, save: {"passes": {}}})
    assert serving.worker_main(Role.RAY_MOE, str(tmp_path / "s.json")) == 0


def test_a_failed_workers_error_lines_are_kept_beside_its_last_lines():
    """The root cause a worker printed early (vLLM's engine core: an OutOfMemoryError, then pages of re-raises
    whose last 15 lines name only the wrapper) is kept in ``stderr_errors``."""
    lines = ["loading"] * 50 + ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.88 GiB"] + \
        ["  File x.py, line 1"] * 40 + ["RuntimeError: Engine core initialization failed"]
    proc = subprocess.CompletedProcess([], 1, "ValueError: from stdout", "\n".join(lines))
    assert serving._error_lines(proc) == ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.88 GiB",
                                          "RuntimeError: Engine core initialization failed",
                                          "ValueError: from stdout"]
    assert len(serving._error_lines(subprocess.CompletedProcess([], 1, "", "KeyError\n" * 50))) == 20


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
    assert body["warmup"] == {"requests": 0, "skipped": "--no-warmup"}
    assert serving.random_model_bytes(str(tmp_path / "m"), torch.float32) > 0


def test_vllm_gets_its_own_defaults():
    """vLLM is given the folder, dtype, seed, its tensor parallelism and the user's arguments: no max_model_len."""
    spec = {"folder": "/m", "dtype": "bfloat16", "vllm_tp": 1, "vllm_args": {"load_format": "dummy",
                                                                            "attention_backend": "FLASH_ATTN"}}
    assert serving.vllm_kwargs(spec) == {"model": "/m", "tokenizer": "/m", "dtype": "bfloat16", "seed": 0,
                                         "tensor_parallel_size": 1, "load_format": "dummy",
                                         "attention_backend": "FLASH_ATTN"}


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
    assert res["finish_reasons"] == {"length": 3} and res["mismatched_requests"] == 0
    assert all(b["prompt"] == p and b["stream"] is True and b["temperature"] == 0.0 and b["model"] == "tiny"
               and b["ignore_eos"] is True and b["max_tokens"] == 4
               for b, p in zip(sorted(record, key=lambda b: b["prompt"]), prompts))
    lat = res["latency"]
    _check_latency(lat, [4, 4, 4])
    assert 190 <= lat["ttft"]["p50_ms"] < 600
    assert 45 <= lat["itl"]["p50_ms"] < 300 and 45 <= lat["tpot"]["p50_ms"] < 300
    assert lat["e2e"]["p50_ms"] >= lat["ttft"]["p50_ms"] + 3 * 45


def test_online_client_stops_early_and_reports_it():
    res = asyncio.run(run_online("http://bench", [[1]] * 2, [5, 1], 50.0, 0, model="tiny",
                                 transport=_scripted_server([0.0, 0.0], [])))
    assert res["output_tokens"] == 3 and res["stopped_early"] == 1 and res["mismatched_requests"] == 1
    assert res["latency"]["itl"]["count"] == 1 and res["rate_per_s"] == 50.0


def test_workloads_are_seeded_and_shaped():
    mixed = workload_spec(Workload.MIXED, 2000, None, None, 3)
    lens = mixed.prompt_lengths()
    assert lens == workload_spec(Workload.MIXED, 2000, None, None, 3).prompt_lengths()
    assert lens != workload_spec(Workload.MIXED, 2000, None, None, 4).prompt_lengths()
    assert min(lens) >= 16 and max(lens) <= 1536 and 400 <= sum(lens) / len(lens) <= 520
    assert mixed.new_tokens_list() == [128] * 2000
    dec = workload_spec(Workload.DECODE_HEAVY, 5, None, None, 0)
    assert dec.prompt_lengths() == [32] * 5 and dec.new_tokens_list() == [256] * 5
    pre = workload_spec(Workload.PREFILL_HEAVY, 300, None, None, 0)
    assert 1024 <= min(pre.prompt_lengths()) and max(pre.prompt_lengths()) <= 2048 and pre.new_tokens == 16
    prompts = WorkloadSpec(Workload.DECODE_HEAVY, 3, 2, 7, 0).prompts(50)
    assert [len(p) for p in prompts] == [7] * 3 and all(0 <= t < 50 for p in prompts for t in p)
    # the draws sessions 14-17 measured are unchanged: lengths from seed, tokens from seed + 1
    rng = np.random.default_rng(0)
    pre4 = workload_spec(Workload.PREFILL_HEAVY, 4, None, None, 0).prompt_lengths()
    assert pre4 == rng.integers(1024, 2049, 4).tolist()
    assert prompts[0] == np.random.default_rng(1).integers(0, 50, 7).tolist()
    with pytest.raises(ValueError, match=r"--new-tokens=0"):
        workload_spec(Workload.MIXED, 4, 0, None, 0)
    with pytest.raises(ValueError, match=r"--seed=-1"):
        workload_spec(Workload.MIXED, 4, None, None, -1)


def test_chat_has_lognormal_prompts_and_outputs_and_long_has_6_to_8k_prompts():
    chat = workload_spec(Workload.CHAT, None, None, None, 0)
    assert (chat.requests, chat.new_tokens, chat.prompt_mean) == (1000, 160, 480)
    lens, news = chat.prompt_lengths(), chat.new_tokens_list()
    assert len(lens) == len(news) == 1000
    assert min(lens) >= 16 and max(lens) <= 1536 and 400 <= np.mean(lens) <= 540
    assert min(news) >= 8 and max(news) <= 1024 and 135 <= np.mean(news) <= 180 and len(set(news)) > 200
    assert news == workload_spec(Workload.CHAT, None, None, None, 0).new_tokens_list()
    assert news != workload_spec(Workload.CHAT, None, None, None, 1).new_tokens_list()
    # chat's prompts are not mixed's (another stream), though both are lognormal of mean 480
    assert lens[:256] != workload_spec(Workload.MIXED, None, None, None, 0).prompt_lengths()
    long = workload_spec(Workload.LONG, None, None, None, 0)
    assert (long.requests, long.new_tokens) == (48, 192)
    ll = long.prompt_lengths()
    assert len(ll) == 48 and 6144 <= min(ll) and max(ll) <= 8192 and len(set(ll)) > 40
    assert long.new_tokens_list() == [192] * 48
    small = WorkloadSpec(Workload.CHAT, 50, 4, 24, 0).new_tokens_list()  # --quick's mean: [4, 26]
    assert min(small) >= 4 and max(small) <= 26


def test_the_warmup_shares_no_length_and_no_first_token_with_the_timed_passes():
    specs = [workload_spec(k, None, None, None, 0) for k in (Workload.CHAT, Workload.MIXED, Workload.DECODE_HEAVY,
                                                             Workload.LONG)]
    vocab = 151936
    timed, shifts = timed_requests(specs, vocab)
    assert shifts[0] == 0 and [len(r.prompts) for r in timed] == [1000, 256, 256, 48]
    # no timed prompt opens with the first id of a prompt of an earlier pass (no prefix-cache block shared)
    seen: set[int] = set()
    for r in timed:
        firsts = {p[0] for p in r.prompts}
        assert not firsts & seen
        seen |= firsts
    warm, info = warmup_requests(specs, timed, vocab, 40960)
    assert [len(w.prompts) for w in warm] == [64, 64, 64, 16] == [warmup_count(s.requests) for s in specs]
    t_lens = {len(p) for r in timed for p in r.prompts}
    t_news = {n for r in timed for n in r.new_tokens}
    t_first = {p[0] for r in timed for p in r.prompts}
    for w, spec in zip(warm, specs):
        lens = [len(p) for p in w.prompts]
        assert not set(lens) & t_lens and not set(w.new_tokens) & t_news
        assert not {p[0] for p in w.prompts} & t_first
        assert all(0 <= t < vocab for p in w.prompts for t in p)
    assert {len(p) for p in warm[2].prompts} <= {31, 33}  # decode-heavy's 32, moved by one
    assert set(warm[2].new_tokens) <= {255, 257}
    assert all(6000 <= len(p) <= 8400 for p in warm[3].prompts)  # long's family
    assert info["disjoint_prompt_lengths"] and info["disjoint_new_tokens"] and info["shared_first_tokens"] == 0
    assert info["by_workload"]["long"]["requests"] == 16 and info["requests"] == 208
    assert warmup_count(8) == 4 and warmup_count(48) == 16 and warmup_count(1000) == 64 and warmup_count(1) == 1


def test_metrics_count_each_requests_own_tokens():
    res = token_metrics([[1, 2], [3]], [[5, 6, 7], [8, 9, 10]], 2.0)
    assert res["output_tokens"] == 6 and res["output_tokens_per_s"] == 3.0 and res["total_tokens_per_s"] == 4.5
    assert res["streams"] is False and "latency" not in res and "mismatched_requests" not in res
    # TPOT over output tokens (chunks of two: one stamp each), as benchmark_serving defines it
    res = token_metrics([[1], [2]], [[5, 6, 7, 8], [9]], 1.0, sent=[0.0, 0.0], stamps=[[0.1, 0.4], [0.2]],
                        expected=[4, 2])
    assert res["expected_output_tokens"] == 6 and res["mismatched_requests"] == 1
    assert res["latency"]["tpot"]["count"] == 1 and res["latency"]["tpot"]["p50_ms"] == pytest.approx(100.0)
    assert res["latency"]["ttft"]["p50_ms"] == pytest.approx(100.0) and res["latency"]["itl"]["count"] == 1
    assert res["output_tokens_min_mean_max"] == [1, 2.5, 4]
    assert Requests([[1, 2], [3]], [4, 2]).summary()["expected_output_tokens"] == 6


def test_graph_deltas_and_arrivals():
    before = {"0": dict.fromkeys(serving.GRAPH_KEYS, 0), "1": dict.fromkeys(serving.GRAPH_KEYS, 2)}
    after = {"0": {**before["0"], "eager_steps": 5, "decode_graph_steps": 3},
             "1": {**before["1"], "graphs_captured_serving": 3, "piecewise_steps": 4, "completions_between_pieces": 5}}
    d = graph_deltas(before, after)
    assert d["per_shard"]["0"] == {"captures": 0, "captures_serving": 0, "decode_graph_steps": 3,
                                   "token_graph_steps": 0, "piecewise_steps": 0, "eager_steps": 5, "graph_replays": 0,
                                   "completions_between_pieces": 0}
    assert d["per_shard"]["1"]["completions_between_pieces"] == 3
    assert d["per_shard"]["1"]["captures"] == d["per_shard"]["1"]["captures_serving"] == 1
    assert d["total"]["piecewise_steps"] == 2 and d["serving_captures_ok"] is False
    before["1"].update(gc_collections=7, gc_pause_us=900, gc_safe_point_collections=2)
    after["1"].update(gc_collections=10, gc_full_collections=1, gc_pause_us=1500, gc_safe_point_collections=4)
    assert serving.shard_gc_deltas(before, after) == {
        "0": {"gc_collections": 0, "gc_full_collections": 0, "gc_pause_us": 0, "gc_safe_point_collections": 0},
        "1": {"gc_collections": 3, "gc_full_collections": 1, "gc_pause_us": 600, "gc_safe_point_collections": 2}}
    a = poisson_arrivals(2000, 8.0, 0)
    assert a[0] == 0 and np.all(np.diff(a) >= 0) and 2000 / 8 * 0.9 <= a[-1] <= 2000 / 8 * 1.1
    assert np.array_equal(a, poisson_arrivals(2000, 8.0, 0)) and not np.array_equal(a, poisson_arrivals(2000, 8.0, 1))
    assert not poisson_arrivals(3, math.inf, 0).any()


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--requests", "0"], "--requests=0"),
    (["--online"], "--vocab-size"),
    (["--quick", "--workload", "chat", "--workloads", "mixed"], "--workload and --workloads"),
    (["--quick", "--workloads", "chat", "chat"], "named twice"),
    (["--quick", "--online-inprocess", "--rate", "0"], "--rate=0"),
    (["--quick", "--max-running", "0"], "--max-running=0"),
    (["--quick", "--decode-steps", "65"], "--decode-steps=65"),
    (["--quick", "--vllm-args", "[1]"], "--vllm-args"),
    (["--online", "--online-inprocess", "--vocab-size", "9"], "--online and --online-inprocess"),
    (["--quick", "--workload", "long", "--prompt-mean", "1900"], "exceeds the model's context"),
])
def test_bad_flags_fail_before_anything_runs(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        serving.main([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
