"""The runtime on a real local Ray instance: 4 shard actors + coordinator, outputs equal the reference."""

from __future__ import annotations

import pytest
import torch

import ray_moe
from ray_moe.core.errors import RouteValidationError
from ray_moe.model.source import weight_source
from ray_moe_dev.testing.reference import reference_moe
from ray_moe_dev.testing.reference_model import reference_forward

CFG = dict(num_ranks=4, num_experts=8, hidden_size=32, ffn_size=64, top_k=2, slots_per_rank=3, seed=3,
           name="test-local")


@pytest.fixture(scope="module")
def rt(ray_session):
    runtime = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**CFG))
    yield runtime
    runtime.shutdown()


def _routes(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(t, k, generator=g)
    return ids, w


@pytest.mark.parametrize("tokens", [1, 3, 5, 64, 257])
def test_explicit_routes_equal_reference(rt, tokens):
    cfg = rt.cfg
    src = weight_source(cfg)
    h = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
    ids, w = _routes(tokens, cfg.num_experts, cfg.top_k, tokens + 1)
    y = rt.forward(h, ids, w, phase="decode" if tokens <= 8 else "prefill")
    ref = reference_moe(h.double(), ids, w, lambda e: src.expert(0, e))
    assert y.shape == h.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-5)
    # the generation pin of the step was released on every shard
    assert all(v == 0 for v in rt.refcounts().values())


def test_router_mode_equals_reference(rt):
    cfg = rt.cfg
    h = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    y, routes = rt.forward(h, return_routes=True)
    ref = reference_forward(cfg, weight_source(cfg), h, runtime_routes=routes)
    assert ref.route_mismatches == 0
    torch.testing.assert_close(y.double(), ref.out, rtol=1e-4, atol=1e-5)


def test_replicas_are_exercised(rt):
    """Slots per rank 3 x 4 ranks = 12 slots for 8 experts: experts 0..3 have two replicas on two ranks."""
    man = rt.placement()
    counts = man.replica_counts()
    assert counts == [2, 2, 2, 2, 1, 1, 1, 1]
    before = dict(rt.stats()["rank_rows"])
    t = 64
    ids = torch.zeros(t, 2, dtype=torch.int64)
    ids[:, 1] = 5
    w = torch.full((t, 2), 0.5)
    h = torch.randn(t, rt.cfg.hidden_size)
    y = rt.forward(h, ids, w)
    ref = reference_moe(h.double(), ids, w, lambda e: weight_source(rt.cfg).expert(0, e))
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-5)
    after = rt.stats()["rank_rows"]
    delta = {u: after.get(u, 0) - before.get(u, 0) for u in range(4)}
    hosts0 = sorted(s.destination_rank for s in man.replicas(0))
    # expert 0's routes were split over both of its replicas' ranks
    assert all(delta[u] > 0 for u in hosts0)
    assert sum(delta.values()) == 2 * t


def test_expert_weights_match_source(rt):
    src = weight_source(rt.cfg)
    for e in (0, 7):
        wg, wu, wd = rt.expert_weights(e)
        ref = src.expert(0, e)
        assert wg.shape == (rt.cfg.ffn_size, rt.cfg.hidden_size) and wd.shape == (rt.cfg.hidden_size, rt.cfg.ffn_size)
        assert torch.equal(wg, ref.w_gate) and torch.equal(wu, ref.w_up) and torch.equal(wd, ref.w_down)


def test_stats_have_denominators(rt):
    rt.forward(torch.randn(8, rt.cfg.hidden_size))
    s = rt.stats()
    for name in ("drop", "remote", "inter_node"):
        r = s["ratios"][name]
        assert r["denominator"] > 0 and 0 <= r["numerator"] <= r["denominator"]
    assert s["ratios"]["remote"]["denominator"] == s["accepted_routes"]
    assert s["step_ms"]["n"] == s["steps"]


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(hidden=torch.randn(4, 31)), "hidden"),
        (dict(topk_ids=torch.full((4, 2), 8)), "topk_ids"),
        (dict(topk_ids=torch.tensor([[0, 1]] * 3)), "topk_ids"),
        (dict(topk_weights=torch.tensor([[0.5, float("nan")]] * 4)), "topk_weights"),
        (dict(topk_weights=torch.tensor([[0.5, -0.1]] * 4)), "topk_weights"),
        (dict(topk_ids=torch.zeros(4, 2)), "topk_ids"),
    ],
)
def test_bad_input_rejected_before_any_step(rt, bad, field):
    args = dict(hidden=torch.randn(4, 32), topk_ids=torch.tensor([[0, 1]] * 4), topk_weights=torch.rand(4, 2))
    args.update(bad)
    steps = rt.stats()["steps"]
    with pytest.raises(RouteValidationError, match=field):
        rt.forward(args["hidden"], args["topk_ids"], args["topk_weights"])
    assert rt.stats()["steps"] == steps


def test_multilayer_one_call_per_step(ray_session):
    cfg = ray_moe.RuntimeConfig(**{**CFG, "name": "test-multilayer", "num_layers": 3, "residual": True,
                                   "router_skew": 1.0, "num_ranks": 3, "slots_per_rank": 4})
    rt = ray_moe.Runtime.start(cfg)
    try:
        h = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        y, routes = rt.forward(h, return_routes=True)
        assert len(routes) == 3
        ref = reference_forward(cfg, weight_source(cfg), h, runtime_routes=routes)
        assert ref.route_mismatches == 0
        torch.testing.assert_close(y.double(), ref.out, rtol=1e-4, atol=1e-4)
        # explicit per-layer routes [L, T, k]
        ids = torch.stack([_routes(30, 8, 2, s)[0] for s in range(3)])
        w = torch.stack([_routes(30, 8, 2, s)[1] for s in range(3)])
        y2 = rt.forward(h, ids, w)
        ref2 = reference_forward(cfg, weight_source(cfg), h, routes=[(ids[l], w[l]) for l in range(3)])
        torch.testing.assert_close(y2.double(), ref2.out, rtol=1e-4, atol=1e-4)
        # one actor call per rank per step: every shard counted exactly the driver's steps
        steps = {r: s["counters"]["steps"] for r, s in rt.shard_status().items()}
        assert set(steps.values()) == {2}
    finally:
        rt.shutdown()


def test_shutdown_tears_down_actors(ray_session):
    import ray

    cfg = ray_moe.RuntimeConfig(**{**CFG, "name": "test-teardown", "num_ranks": 2, "slots_per_rank": 4})
    rt = ray_moe.Runtime.start(cfg)
    handles = list(rt.shards.values())
    assert ray.get([h.ping.remote() for h in handles]) == [0, 1]
    rt.shutdown()
    for h in handles:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(h.ping.remote(), timeout=30)
    with pytest.raises(ValueError, match="test-teardown"):
        ray_moe.Runtime.connect("test-teardown")


def test_gloo_exchange_equals_reference(ray_session):
    """The torch.distributed gloo backend between CPU actors: same outputs, prefill and decode buckets."""
    cfg = ray_moe.RuntimeConfig(**{**CFG, "name": "test-gloo", "exchange": "gloo", "decode_token_capacity": 8})
    rt = ray_moe.Runtime.start(cfg)
    try:
        src = weight_source(cfg)
        for tokens, phase in ((40, "prefill"), (12, "decode")):
            h = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
            ids, w = _routes(tokens, cfg.num_experts, cfg.top_k, tokens)
            y = rt.forward(h, ids, w, phase=phase)
            ref = reference_moe(h.double(), ids, w, lambda e: src.expert(0, e))
            torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-5)
        assert rt.stats()["bucket_layers"] == 1
        g1 = rt.scale(expert=5, replicas=2)
        h = torch.randn(9, cfg.hidden_size)
        ids, w = _routes(9, cfg.num_experts, cfg.top_k, 3)
        y = rt.forward(h, ids, w)
        torch.testing.assert_close(y.double(), reference_moe(h.double(), ids, w, lambda e: src.expert(0, e)),
                                   rtol=1e-4, atol=1e-5)
        assert rt.placement().generation == g1
    finally:
        rt.shutdown()


def test_background_telemetry_export_is_rate_limited_with_a_trailing_export(rt, monkeypatch):
    import time

    import ray_moe.runtime as runtime_mod

    calls = []
    monkeypatch.setattr(runtime_mod, "TELEMETRY_EXPORT_INTERVAL_S", 1.0)  # (wide: a loaded 2-core CI VM)
    monkeypatch.setattr(rt, "publish_telemetry", lambda: calls.append(time.monotonic()))
    deadline = time.monotonic() + 5
    while rt._publishing and time.monotonic() < deadline:  # an export of earlier steps still scheduled
        time.sleep(0.01)
    rt._published_at = float("-inf")
    t0 = time.monotonic()
    for _ in range(20):  # a burst of load flushes: one export now, the rest covered by one trailing export
        rt._publish_soon()
    while len(calls) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(20):
        rt._publish_soon()
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)
    assert len(calls) == 2, calls
    assert calls[0] - t0 < 0.5  # the first one right away
    assert calls[1] - calls[0] >= 0.99  # the trailing one an interval later, covering the second burst
