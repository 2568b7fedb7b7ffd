"""``GET /metrics`` of ``ray-moe serve`` (``apps.metrics``): Prometheus text parsed with ``prometheus_client``'s
parser. Pure parts first (the route label, TTFT / TPOT from token times, the scheduler's gauges, the telemetry
series equal to ``export_points``), then a served deployment: after a few completions (one with n=2, one
streamed, a 400, a 401) the request and token counters equal what was sent and generated, the histograms hold
one TTFT per choice and one TPOT per choice of 2+ tokens, the queue / KV / prefix / out-of-memory gauges are
there, the deployment's ``ray_moe_*`` telemetry series are there with values, and no API key is needed."""

from __future__ import annotations

import argparse
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ray_moe.apps.metrics import (
    PREFIX_CACHE_HELP,
    ApiRoute,
    EngineState,
    ServerMetrics,
    TelemetryCollector,
)
from ray_moe.core.telemetry.metrics import MetricName, Telemetry
from ray_moe.driver.scheduler import Scheduler
from ray_moe.model.sampling import SamplingParams
from ray_moe.ray.prometheus import export_points, exported_metrics

KEY = "metrics-key-789"


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    """The one sample of ``family`` named ``sample`` (default: the family's name) whose labels include ``labels``."""
    want = sample or family
    hits = [s.value for s in fams[family].samples if s.name == want and all(s.labels.get(k) == v
                                                                            for k, v in labels.items())]
    assert len(hits) == 1, (family, want, labels, fams[family].samples)
    return hits[0]


# ---------------------------------------------------------------- pure
@pytest.mark.parametrize("path,route", [("/v1/completions", ApiRoute.COMPLETIONS), ("/v1/models/", ApiRoute.MODELS),
                                        ("/v1/models/a/b", ApiRoute.MODEL), ("/metrics", ApiRoute.METRICS),
                                        ("/v1/chat/completions", ApiRoute.CHAT), ("/nope", ApiRoute.OTHER)])
def test_the_endpoint_label_is_the_route_template(path, route):
    assert ApiRoute.of(path) is route


class _Loop:
    """A stand-in ``GenerationLoop``: a real scheduler, no shards."""

    def __init__(self, sched: Scheduler) -> None:
        self.scheduler = sched
        self.memory_events = []


def test_scheduler_gauges_read_reserved_blocks_and_the_queue():
    sched = Scheduler([0, 1], kv_blocks=10, block_size=4, max_context=64, max_running=2)
    for n in (5, 3, 2):  # prompts of 5, 3, 2 tokens + 4 new: 3, 2 and 2 blocks; the third waits (max_running)
        sched.submit(list(range(1, n + 1)), SamplingParams(max_new_tokens=4))
    plan = sched.plan()  # admits two
    st = EngineState.read(_Loop(sched))
    assert (st.running, st.waiting) == (2, 1)
    assert sorted(st.blocks_used.values()) == [2, 3] and st.blocks_total == {0: 10, 1: 10}
    assert sum(st.blocks_used.values()) == sum(sched._used.values())  # the scheduler's own books
    sched.preempt(plan)
    sched.memory_backoff()
    st = EngineState.read(_Loop(sched))
    assert (st.running, st.waiting, st.preempted, st.oom_steps) == (0, 3, 2, 1)
    assert sum(st.blocks_used.values()) == 0

    fams = _families(generate_latest(ServerMetrics(lambda: _Loop(sched), lambda: None).registry).decode())
    assert _value(fams, "ray_moe_server_requests_waiting") == 3
    assert _value(fams, "ray_moe_server_preemptions", "ray_moe_server_preemptions_total") == 2
    assert _value(fams, "ray_moe_server_oom_steps", "ray_moe_server_oom_steps_total") == 1
    assert _value(fams, "ray_moe_server_kv_cache_blocks_total", rank="1") == 10
    assert _value(fams, "ray_moe_server_prefix_cache_hit_ratio") == 0.0  # no prefill yet: 0, not a division
    assert fams["ray_moe_server_prefix_cache_hit_ratio"].documentation == PREFIX_CACHE_HELP

    loop = _Loop(sched)
    loop.prefix_hit_tokens, loop.prefix_lookup_tokens = 48, 160  # the loop's counters (committed steps)
    fams = _families(generate_latest(ServerMetrics(lambda: loop, lambda: None).registry).decode())
    hit, look = "ray_moe_server_prefix_cache_hit_tokens", "ray_moe_server_prefix_cache_lookup_tokens"
    assert _value(fams, hit, hit + "_total") == 48 and _value(fams, look, look + "_total") == 160
    assert _value(fams, "ray_moe_server_prefix_cache_hit_ratio") == pytest.approx(0.3)


def test_ttft_and_tpot_come_from_the_token_times():
    m = ServerMetrics(lambda: None, lambda: None)
    t = m.timer(arrived=10.0)
    for now in (10.5, 10.7, 11.1):  # choice 0: 3 tokens, first after 0.5 s, 0.3 s per token after it
        t.token(0, now)
    t.token(1, 12.0)  # choice 1: one token, no TPOT
    t.ended(0), t.ended(1), t.ended(0)  # a second end is not observed twice
    fams = _families(generate_latest(m.registry).decode())
    ttft, tpot = "ray_moe_server_time_to_first_token_seconds", "ray_moe_server_time_per_output_token_seconds"
    assert _value(fams, ttft, ttft + "_count") == 2
    assert _value(fams, ttft, ttft + "_sum") == pytest.approx(0.5 + 2.0)
    assert _value(fams, tpot, tpot + "_count") == 1
    assert _value(fams, tpot, tpot + "_sum") == pytest.approx(0.3)
    assert _value(fams, tpot, tpot + "_bucket", le="0.3") == 1 and _value(fams, tpot, tpot + "_bucket", le="0.2") == 0


def test_the_telemetry_series_are_export_points_with_ray_names_and_stay_when_idle():
    tel = Telemetry("drv")
    base = {"release": "r1", "phase": "decode"}
    tel.add_ratio(MetricName.ROUTE_DROP_RATIO, base, 3, 40)
    tel.add_ratio(MetricName.FALLBACK_STEP_RATIO, {**base, "reason": "oversize"}, 2, 2)
    tel.add_ratio(MetricName.FALLBACK_STEP_RATIO, {**base, "reason": "none"}, 6, 6)
    tel.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, base, 4)
    for s in (0.01, 0.02, 0.03):
        tel.observe_step_latency(base, s)
    snap = tel.snapshot()
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(TelemetryCollector(lambda: snap.model_dump(mode="json")))  # the JSON form Runtime returns
    fams = _families(generate_latest(reg).decode())
    assert _value(fams, "ray_moe_server_telemetry_up") == 1
    points = export_points(snap)
    assert len(points) > 8
    for p in points:
        fam = p.scraped_name.removesuffix("_total")
        assert _value(fams, fam, p.scraped_name, **dict(p.tags)) == pytest.approx(p.value), p
    assert _value(fams, "ray_moe_fallback_step_ratio", reason="oversize") == pytest.approx(2 / 8)
    # every exported metric is described, with the exporter's help, values or not
    for m in exported_metrics():
        fam = fams["ray_" + m.name.removesuffix("_total")]
        assert fam.documentation == m.description and fam.type == m.kind.value

    def broken():
        raise RuntimeError("coordinator gone")

    reg = CollectorRegistry(auto_describe=False)
    reg.register(TelemetryCollector(broken))
    fams = _families(generate_latest(reg).decode())
    assert _value(fams, "ray_moe_server_telemetry_up") == 0
    assert fams["ray_moe_route_drop_ratio"].samples == []


# ---------------------------------------------------------------- served
@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory, serve_port, serve_running):
    pytest.importorskip("fastapi")
    from ray_moe_dev.testing.hf_models import tiny_model

    _, folder = tiny_model("qwen3_moe", tmp_path_factory.mktemp("srv-metrics") / "tiny-metrics", seed=5)
    args = argparse.Namespace(checkpoint=str(folder), ranks=2, device="cpu", dtype="float32", name="http-metrics",
                              host="127.0.0.1", port=serve_port, api_key=KEY, model_name=None, kv_tokens=256,
                              block_size=8, step_tokens=64, max_running=64, max_queued=128)
    with serve_running(args) as base:
        yield base


def test_metrics_after_a_few_completions(server):
    import httpx

    auth = {"Authorization": f"Bearer {KEY}"}
    url = f"{server}/v1/completions"
    body = {"model": "tiny-metrics", "temperature": 0.0, "ignore_eos": True}
    shared = list(range(20, 37))  # 17 tokens: two full blocks of 8 before the last token's block
    # (prompt, max_tokens, n), one after the other: the last one finds the one before's two blocks cached
    sent = [([1, 2, 3, 4], 5, 1), ([5, 6, 7], 3, 2), ([9, 8, 7, 6, 5, 4], 1, 1), (shared, 2, 1), (shared, 2, 1)]
    for prompt, max_tokens, n in sent:
        r = httpx.post(url, headers=auth, json={**body, "prompt": prompt, "max_tokens": max_tokens, "n": n},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == max_tokens * n
    with httpx.stream("POST", url, headers=auth, timeout=120,
                      json={**body, "prompt": [3, 1, 4, 1, 5], "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200
        assert "[DONE]" in "".join(r.iter_text())
    assert httpx.post(url, headers=auth, json={**body, "prompt": [1], "max_tokens": 0}, timeout=60).status_code == 400
    assert httpx.get(f"{server}/v1/models", timeout=60).status_code == 401
    assert httpx.get(f"{server}/v1/models", headers=auth, timeout=60).status_code == 200

    r = httpx.get(f"{server}/metrics", timeout=60)  # no API key needed
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = _families(r.text)
    req = "ray_moe_server_requests"
    assert _value(fams, req, req + "_total", endpoint="/v1/completions", status="200") == 6
    assert _value(fams, req, req + "_total", endpoint="/v1/completions", status="400") == 1
    assert _value(fams, req, req + "_total", endpoint="/v1/models", status="401") == 1
    assert _value(fams, req, req + "_total", endpoint="/v1/models", status="200") == 1
    assert _value(fams, req, req + "_total", endpoint="/health", status="200") >= 1  # the fixture's readiness poll
    assert not [s for s in fams[req].samples if s.labels.get("endpoint") == "/metrics"]

    prompt_tokens = sum(len(p) for p, _, _ in sent) + 5  # each prompt once, whatever n (as usage counts)
    generated = sum(m * n for _, m, n in sent) + 4
    assert _value(fams, "ray_moe_server_prompt_tokens", "ray_moe_server_prompt_tokens_total") == prompt_tokens
    assert _value(fams, "ray_moe_server_generation_tokens", "ray_moe_server_generation_tokens_total") == generated
    ttft, tpot = "ray_moe_server_time_to_first_token_seconds", "ray_moe_server_time_per_output_token_seconds"
    assert _value(fams, ttft, ttft + "_count") == 7  # one per choice: 1 + 2 + 1 + 1 + 1 + 1
    assert _value(fams, tpot, tpot + "_count") == 6  # choices of 2+ tokens (max_tokens=1 has none)
    assert 0 < _value(fams, ttft, ttft + "_sum") < 600
    assert _value(fams, ttft, ttft + "_bucket", le="+Inf") == 7

    assert _value(fams, "ray_moe_server_requests_running") == 0
    assert _value(fams, "ray_moe_server_requests_waiting") == 0
    assert {s.labels["rank"]: s.value for s in fams["ray_moe_server_kv_cache_blocks_total"].samples} == \
        {"0": 32, "1": 32}  # 256 KV tokens / blocks of 8, per rank
    assert _value(fams, "ray_moe_server_kv_cache_usage_ratio") == 0.0
    # prefix caching: every choice's prompt is prefilled (n=2: twice); the second shared prompt is routed to the
    # first one's rank and finds its two full blocks there
    prefilled = sum(len(p) * n for p, _, n in sent) + 5
    hit, look = "ray_moe_server_prefix_cache_hit_tokens", "ray_moe_server_prefix_cache_lookup_tokens"
    assert _value(fams, hit, hit + "_total") == 16
    assert _value(fams, look, look + "_total") == prefilled
    assert _value(fams, "ray_moe_server_prefix_cache_hit_ratio") == pytest.approx(16 / prefilled)
    assert _value(fams, "ray_moe_server_oom_steps", "ray_moe_server_oom_steps_total") == 0
    assert _value(fams, "ray_moe_server_preemptions", "ray_moe_server_preemptions_total") == 0

    # the deployment's telemetry, with values (cumulative: later scrapes never read less, and once Ray's metrics
    # agent has exported the last steps an idle deployment's scrapes read the same)
    assert _value(fams, "ray_moe_server_telemetry_up") == 1
    steps = sum(s.value for s in fams["ray_moe_step_latency_seconds_count"].samples)
    assert steps > 0
    assert sum(s.value for s in fams["ray_moe_remote_route_ratio_denominator"].samples) > 0  # routes served
    assert fams["ray_moe_remote_route_ratio"].samples  # the value gauge, as Ray's agent exports it
    seen, deadline = [steps], time.monotonic() + 60
    while True:  # the agent exports on its own period: the first scrape may precede the last steps' export
        time.sleep(2)
        again = _families(httpx.get(f"{server}/metrics", timeout=60).text)
        seen.append(sum(s.value for s in again["ray_moe_step_latency_seconds_count"].samples))
        if seen[-1] == seen[-2] or time.monotonic() > deadline:
            break
    assert seen == sorted(seen) and seen[-1] == seen[-2], seen
    assert _value(again, req, req + "_total", endpoint="/v1/completions", status="200") == 6
