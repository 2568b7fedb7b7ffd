"""The autopilot on local Ray: a deployment in auto mode holds under a balanced load, rebalances by itself within a
bounded number of steps once the load turns skewed, and the routed-row imbalance measured afterwards is lower.

Weights are tagged (expert e's output is (e+1) x a shared function), so a route served by the wrong expert after
the automatic migration shows up in the output. Spread placement of 8 experts on 4 ranks x 3 slots: rank 0 holds
experts 0, 1, 2; rank 1: 3, 4, 5; rank 2: 6, 7, 0; rank 3: 1, 2, 3.
"""

from __future__ import annotations

import itertools
import time

import ray
import torch
from ray_moe_dev.testing.reference import reference_moe

import ray_moe
from ray_moe.control.autopilot import AutopilotPolicy, EplbMode
from ray_moe.model.source import weight_source

POLICY = AutopilotPolicy(mode=EplbMode.AUTO, threshold_gain=0.2, min_interval_s=0.5, min_interval_steps=2,
                         min_window_steps=3, tick_s=0.1)
CFG = dict(num_ranks=4, num_experts=8, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=3, seed=11,
           tagged_weights=True, exchange_timeout_s=20.0, load_window=6, name="autopilot", eplb=POLICY)
# each copy gets the same rows under the spread placement: experts 0-3 (two copies) twice the rows of 4-7
BALANCED = [(0, 4), (1, 5), (2, 6), (3, 7), (0, 1), (2, 3)] * 2
# expert 4 (one copy, on rank 1) is in every token
SKEWED = [(4, e) for e in (0, 1, 2, 3, 5, 6, 7)] * 2


def _step(rt, src, pairs, step: int) -> float:
    """One forward with the given routes; the largest deviation from the reference MoE."""
    g = torch.Generator().manual_seed(500 + step)
    h = torch.randn(len(pairs), rt.cfg.hidden_size, generator=g)
    ids = torch.tensor(pairs, dtype=torch.int64)
    w = torch.rand(len(pairs), 2, generator=g)
    y = rt.forward(h, ids, w)
    ref = reference_moe(h.double(), ids, w, lambda e: src.expert(0, e))
    return float((y.double() - ref).abs().max())


def _rows(rt) -> dict[int, int]:
    return {int(r): int(c) for r, c in rt.stats()["rank_rows"].items()}


def _imbalance(before: dict[int, int], after: dict[int, int]) -> float:
    """max / mean of the rows each rank received between two ``_rows`` readings."""
    d = [after.get(r, 0) - before.get(r, 0) for r in range(4)]
    return max(d) / (sum(d) / len(d))


def _eplb(rt) -> dict:
    return ray.get(rt.coordinator.status.remote())["eplb"]


def test_autopilot_rebalances_a_skewed_load_by_itself_and_holds_a_balanced_one(ray_session):
    rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**CFG))
    src = weight_source(rt.cfg)
    step = 0
    try:
        st = _eplb(rt)
        assert st["mode"] == "auto" and st["running"]
        # 1. balanced: the window fills, the autopilot decides and holds (no gain to take)
        deadline = time.monotonic() + 10.0
        decisions: list[dict] = []
        while time.monotonic() < deadline:
            for _ in range(4):  # one load report per 4 steps
                assert _step(rt, src, BALANCED, step) < 1e-4
                step += 1
            decisions = _eplb(rt)["decisions"]
            if any(d["reason"] == "gain_below_threshold" for d in decisions) and step >= 24:
                break
        held = [d for d in decisions if d["reason"] == "gain_below_threshold"]
        assert held, decisions
        assert held[-1]["imbalance_now"] == 1.0 and held[-1]["gain"] < 0.2
        assert not any(d["taken"] for d in decisions) and rt.placement().generation == 0
        # 2. skewed: the first 4 steps run on generation 0 (their load report is sent after the 4th)
        r0 = _rows(rt)
        for _ in range(4):
            assert _step(rt, src, SKEWED, step) < 1e-4
            step += 1
        before = _imbalance(r0, _rows(rt))
        assert before > 2.0  # rank 1 serves every token's expert 4
        # 3. the autopilot rebalances by itself within a bounded number of steps
        shift = step
        while rt.placement().generation == 0 and step - shift < 120:
            assert _step(rt, src, SKEWED, step) < 1e-4
            step += 1
        assert rt.placement().generation > 0, _eplb(rt)["decisions"]
        steps_to_rebalance = step - shift
        # 4. the load stays skewed: once the window holds only skewed steps the placement settles (a rebalance
        # decided on a half-shifted window may be followed by one more, never sooner than the interval)
        settle = step + 4 * rt.cfg.load_window + 8
        while step < settle:
            assert _step(rt, src, SKEWED, step) < 1e-4
            step += 1
        g = rt.placement().generation
        r1 = _rows(rt)
        for _ in range(8):
            assert _step(rt, src, SKEWED, step) < 1e-4
            step += 1
        after = _imbalance(r1, _rows(rt))
        assert after < 0.7 * before, (before, after)
        # 5. the decisions are in the coordinator's status: what did it, spaced by the interval, holds since
        time.sleep(4 * POLICY.tick_s)
        st = _eplb(rt)
        assert rt.placement().generation == g  # a steady load: no further rebalance
        decisions = st["decisions"]
        taken = [d for d in decisions if d["taken"]]
        assert 1 <= len(taken) <= 2, decisions
        first = taken[0]
        assert first["reason"] == "gain" and first["action"] == "rebalance" and first["generation"] == 0
        for d in taken:
            assert d["imbalance_predicted"] < d["imbalance_now"] and d["gain"] >= POLICY.threshold_gain
            assert d["bytes"] > 0 and d["publish_s"] > 0
        for a, b in itertools.pairwise(taken):
            assert b["step"] - a["step"] >= POLICY.min_interval_steps and b["time"] - a["time"] >= POLICY.min_interval_s
            assert b["generation"] == a["new_generation"]
        assert taken[-1]["new_generation"] == g
        later = decisions[decisions.index(taken[-1]) + 1:]
        assert later and all(x["action"] == "hold" for x in later)
        assert later[-1]["reason"] == "gain_below_threshold" and later[-1]["imbalance_now"] < 0.7 * before
        assert st["last_rebalance"] is not None and steps_to_rebalance <= 120
        events = [e["event"] for e in rt.timeline()]
        assert events.count("autopilot") == len(taken) and "publish" in events
    finally:
        rt.shutdown()
