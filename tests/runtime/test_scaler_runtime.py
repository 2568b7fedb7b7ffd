"""Load-driven scaling on local Ray: a queue of generation requests (few may run at once, so they wait) makes the
coordinator's scaler (its signals: what this driver's generation loop reports) add a rank; once the queue is served
and the deployment sits idle it drains and removes that rank; the greedy outputs are token-equal to transformers'
own generation of the same prompts (as without scaling)."""

from __future__ import annotations

import time

import torch
from ray_moe_dev.testing.hf_models import tiny_model

import ray_moe
from ray_moe.control.scaling import ScalingPolicy

POLICY = ScalingPolicy(enabled=True, min_ranks=2, max_ranks=3, target_wait_s=0.3, idle_s=1.0, cooldown_s=0.5,
                       hysteresis=0.0, tick_s=0.1)


def _prompts(seed: int, n: int, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_scaler_adds_a_rank_under_a_queue_and_removes_it_when_idle(ray_session, tmp_path):
    model, folder = tiny_model("mixtral", tmp_path / "mixtral")
    model.eval()
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, slots_per_rank=4, decode_token_capacity=4,
                                                name="scaler", scaling=POLICY)
    prompts = _prompts(3, 16)
    want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    rt = ray_moe.Runtime.start(cfg)
    try:
        assert rt.members()["scaler"] is not None and rt.group.peer_order == (0, 1)
        rt.serving(kv_tokens=96, block_size=8, step_tokens=32, max_running=2)  # the rest of the requests wait
        got = rt.generate(prompts, max_new_tokens=8, timeout_s=120)
        assert got == want
        deadline = time.monotonic() + 60  # (the add decided under the queue may still be starting its shard)
        while time.monotonic() < deadline and not any(e.get("action") == "add" for e in rt.scale_events()):
            time.sleep(0.1)
        while time.monotonic() < deadline and not any(e.get("action") == "add" and "done" in e
                                                      for e in rt.scale_events()):
            time.sleep(0.1)
        waits = [e.get("oldest_wait_s") for e in rt.scale_events()]
        added = [e for e in rt.scale_events() if e.get("action") == "add" and e.get("done")]
        assert added and added[0]["reason"] == "queue_wait" and added[0]["oldest_wait_s"] > 0.3, waits
        assert added[0]["ranks"] == 2 and added[0]["waiting"] > 0
        new = added[0]["rank"]
        assert len(added) == 1  # max_ranks=3
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(e.get("action") == "remove" and e.get("done")
                                                      for e in rt.scale_events()):
            time.sleep(0.1)
        removed = [e for e in rt.scale_events() if e.get("action") == "remove" and e.get("done")]
        assert removed and removed[0]["reason"] == "idle" and removed[0]["rank"] == new, rt.scale_events()
        assert removed[0]["since_work_s"] >= 1.0
        deadline = time.monotonic() + 10  # (this driver follows the membership within a poll)
        while sorted(rt.group.peer_order) != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(rt.group.peer_order) == [0, 1]
        # past the cooldown, at the floor: it holds (decisions keep coming; a loaded machine may still log one
        # 'within_target' between the removal and the floor)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and [e["reason"] for e in list(rt.scale_events())[-3:]] != ["at_floor"] * 3:
            time.sleep(0.2)
        assert [e["reason"] for e in list(rt.scale_events())[-3:]] == ["at_floor"] * 3, list(rt.scale_events())[-5:]
        assert not any(e.get("action") == "add" for e in list(rt.scale_events())[-3:])
        # the same requests on the scaled-in deployment: token-equal still
        assert rt.generate(prompts[:4], max_new_tokens=8, timeout_s=120) == want[:4]
    finally:
        rt.shutdown()
