"""A killed shard is replaced without an operator (``heal_retries``): traffic keeps flowing with correct
outputs, the deployment is back to full strength (a new rank hosting slots), nothing lost."""

from __future__ import annotations

import threading
import time

import ray
import torch

import ray_moe
from ray_moe.model.source import weight_source
from ray_moe_dev.testing.reference import reference_moe

BASE = dict(num_ranks=3, num_experts=6, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=3, seed=5,
            tagged_weights=True, exchange_timeout_s=20.0, heal_retries=2)


def _step(rt, src, i):
    g = torch.Generator().manual_seed(500 + i)
    t = int(torch.randint(1, 24, (1,), generator=g))
    h = torch.randn(t, 16, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=g)
    y = rt.forward(h, ids, w)
    return float((y.double() - reference_moe(h.double(), ids, w, lambda e: src.expert(0, e))).abs().max())


def test_killed_shard_is_replaced_under_traffic(ray_session):
    rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**{**BASE, "name": "self-heal"}))
    src = weight_source(rt.cfg)
    stop, errors, worst, steps = threading.Event(), [], [0.0], [0]

    def stream():
        i = 0
        while not stop.is_set():
            try:
                worst[0] = max(worst[0], _step(rt, src, i))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return
            i += 1
            steps[0] = i

    th = threading.Thread(target=stream)
    th.start()
    try:
        time.sleep(1.0)
        ray.kill(rt.shards[2])
        deadline = time.time() + 90
        while not any("replacement" in e for e in rt.healer.events) and time.time() < deadline and not errors:
            time.sleep(0.2)
        before = steps[0]
        time.sleep(1.0)  # traffic on the healed deployment
        after = steps[0]
    finally:
        stop.set()
        th.join(timeout=60)
    try:
        assert not errors, errors
        healed = [e for e in rt.healer.events if "replacement" in e]
        assert healed and healed[0]["lost"] == 2, list(rt.healer.events)
        new = healed[0]["replacement"]
        assert rt.lost_ranks == [2]
        assert sorted(rt.group.peer_order) == sorted([0, 1, new]) and len(rt.group.peer_order) == 3
        # full strength: load was observed, so the regroup rebalanced onto the new rank
        assert rt.placement().rank_slots(new), rt.placement()
        assert worst[0] < 1e-4 and after > before, (worst, before, after)
        assert 0 < healed[0]["seconds"] < 90
    finally:
        rt.shutdown()
