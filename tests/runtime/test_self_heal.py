"""A killed shard is replaced without an operator (``heal_retries``: the coordinator's healer keeps the target's
rank count, its reconcile loop starts the replacement): traffic keeps flowing with correct outputs, the deployment is
back to full strength (a new rank hosting slots, in the dead rank's own placement-group bundle), nothing lost. With
healing off (the library's default) the deployment runs one rank short, and the start said so."""

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
        while not any("replacement" in e for e in rt.heal_events()) and time.time() < deadline and not errors:
            time.sleep(0.2)
        before = steps[0]
        time.sleep(1.0)  # traffic on the healed deployment
        after = steps[0]
    finally:
        stop.set()
        th.join(timeout=60)
    try:
        assert not errors, errors
        healed = [e for e in rt.heal_events() if "replacement" in e]
        assert healed and healed[0]["lost"] == 2, rt.heal_events()
        new = healed[0]["replacement"]
        assert rt.lost_ranks == [2]
        assert sorted(rt.group.peer_order) == sorted([0, 1, new]) and len(rt.group.peer_order) == 3
        members = rt.members()["members"]
        assert members[str(new)]["bundle"] == members["2"]["bundle"]  # the dead rank's bundle, its node alive
        assert members[str(new)]["replaces"] == 2 and members["2"]["state"] == "gone" and members["2"]["died"]
        # full strength: load was observed, so the regroup rebalanced onto the new rank
        assert rt.placement().rank_slots(new), rt.placement()
        assert worst[0] < 1e-4 and after > before, (worst, before, after)
        assert 0 < healed[0]["seconds"] < 90
    finally:
        rt.shutdown()


def test_generation_through_a_healed_kill_is_token_equal(ray_session, tmp_path):
    """Generation inside the shards across a killed shard with heal_retries: the dead rank's sequences are
    re-prefilled on the survivors, a replacement joins, every request completes with transformers' greedy tokens
    (none lost), and the next requests run on the full-strength group."""
    from ray_moe_dev.testing.hf_models import tiny_model

    model, folder = tiny_model("qwen3_moe", tmp_path / "m")
    model.eval()
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=3, decode_token_capacity=4, heal_retries=2,
                                                name="self-heal-gen")
    rt = ray_moe.Runtime.start(cfg)
    try:
        engine = rt.serving(kv_tokens=512, block_size=8, step_tokens=32, decode_steps=2)
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 6, 8)]
        want = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
        out: dict = {}
        th = threading.Thread(target=lambda: out.setdefault("t", rt.generate(prompts, max_new_tokens=12,
                                                                          timeout_s=300)))
        start = engine.steps
        th.start()
        deadline = time.time() + 120
        while engine.steps < start + 3 and time.time() < deadline and th.is_alive():
            time.sleep(0.01)
        assert th.is_alive(), "generation finished before the kill: make it longer"
        ray.kill(rt.shards[1])
        th.join(timeout=300)
        assert out["t"] == want  # nothing lost or duplicated through the kill
        deadline = time.time() + 90
        while not any("replacement" in e for e in rt.heal_events()) and time.time() < deadline:
            time.sleep(0.2)
        healed = [e for e in rt.heal_events() if "replacement" in e]
        assert healed and healed[0]["lost"] == 1, rt.heal_events()
        deadline = time.time() + 30  # (this driver follows the membership within a poll)
        while healed[0]["replacement"] not in rt.group.peer_order and time.time() < deadline:
            time.sleep(0.1)
        assert len(rt.group.peer_order) == 3 and healed[0]["replacement"] in rt.group.peer_order
        assert rt.generate(prompts, max_new_tokens=12) == want  # on the healed group (the new rank loads the model)
        assert healed[0]["replacement"] in engine.scheduler.ranks
    finally:
        rt.shutdown()


def test_healing_off_is_said_at_start_and_the_target_follows_the_loss(ray_session, caplog):
    """The library's default (``heal_retries=0``; ``ray-moe serve`` heals twice): the start says healing is off, and a
    killed shard is left out: the healer lowers the target (3 ranks -> 2, with the reason) and traffic goes on."""
    import logging

    with caplog.at_level(logging.WARNING, logger="ray_moe"):
        rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**{**BASE, "name": "heal-off", "heal_retries": 0}))
    try:
        assert any("healing is off (heal_retries=0)" in r.getMessage() and "'heal-off'" in r.getMessage()
                   for r in caplog.records), caplog.text
        src = weight_source(rt.cfg)
        assert _step(rt, src, 0) < 1e-4
        ray.kill(rt.shards[1])
        assert _step(rt, src, 1) < 1e-4  # the step finds rank 1 dead, runs again on the survivors
        assert sorted(rt.group.peer_order) == [0, 2] and rt.lost_ranks == [1]
        m = rt.members()
        assert m["target"]["ranks"] == 2 and m["target"]["set_by"] == "healer" and "healing is off" in m["target"]["reason"]
        assert rt.heal_events() == [{"lost": 1, "left_out": True, "reason": "healing is off (heal_retries=0)"}]
        time.sleep(2.5)  # a health check later: still two ranks, nothing started
        assert sorted(rt.members()["group"]) == [0, 2] and rt.members()["converged"]
    finally:
        rt.shutdown()
