"""A step that runs out of device memory fails alone: its sequences are recomputed, steps get smaller, every
request still completes with transformers' greedy tokens (in-process deployment, the driver's real loop)."""

from __future__ import annotations

import torch

import ray_moe
from ray_moe.core.errors import StepMemoryError
from ray_moe.driver.loop import GenerationLoop
from ray_moe.driver.scheduler import RECOVER_AFTER_STEPS, Scheduler, StepPlan
from ray_moe.model.sampling import SamplingParams
from ray_moe.shard.records import WorkItem
from ray_moe_dev.testing.hf_models import tiny_model
from ray_moe_dev.testing.inprocess import InProcessDeployment, LocalTransport


def _prompts(seed: int, lens) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]


def test_out_of_memory_step_is_contained_and_every_request_completes(tmp_path):
    model, folder = tiny_model("qwen3_moe", tmp_path / "m")
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, decode_token_capacity=8))
    transport = LocalTransport(dep)
    loop = GenerationLoop(transport, device="cpu", kv_tokens=1024, block_size=8, step_tokens=64)
    host = dep.cores[0].generator.host
    real = host.forward_rows
    fired: list[int] = []

    def forward_rows(rows, attention, executor, gather=None):  # the first step of > 20 rows runs out of memory
        if rows.n > 20 and not fired:
            fired.append(rows.n)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(rows, attention, executor, gather)

    host.forward_rows = forward_rows
    prompts = _prompts(0, (9, 14, 5, 11))
    try:
        handles = [loop.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts]
        got = [h.result(120) for h in handles]
        assert fired == [39]  # the first prefill step of all four prompts
        want = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
        assert got == want  # nothing lost, nothing duplicated, recomputed exactly
        ev = list(loop.memory_events)
        assert len(ev) == 1 and ev[0]["preempted"] == 4, ev
        assert ev[0]["step_tokens"] == 32 and ev[0]["max_running"] == 128, ev
        assert "ran out of device memory" in ev[0]["error"] and "rank 0" in ev[0]["error"], ev
        assert loop.scheduler.preempted == 4 and loop.scheduler.backoffs == 1
        assert dep.cores[0].generator.counters["oom_steps"] == 1
        assert loop.failed is None
        # the loop keeps serving afterwards
        assert loop.submit(prompts[0], SamplingParams(max_new_tokens=6)).result(60) == want[0]
    finally:
        loop.close()
        transport.close()


def test_preempt_and_backoff_bookkeeping():
    s = Scheduler([0], kv_blocks=64, block_size=4, max_context=512, step_tokens=64, max_running=8)
    ids = [s.submit([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=3)) for _ in range(3)]
    plan = s.plan()
    used = s._used[0]
    assert used == 3 * 2 and all(s.seqs[i].state.value == "RUNNING" for i in ids)
    s.commit(plan, {i: 7 for i in ids})  # one token each
    plan2 = s.plan()
    back = s.preempt(plan2)
    assert back == ids and s._used[0] == 0 and s._to_free[0] == ids  # ranks drop the caches next step
    assert all(s.seqs[i].state.value == "WAITING" and s.seqs[i].generated == [7] for i in ids)
    assert list(s._queue) == ids and s.preempted == 3
    again = s.plan()  # re-prefilled: prompt + what was generated, from position 0
    assert [(it.start, it.tokens) for it in again.items[0]] == [(0, (1, 2, 3, 4, 5, 7))] * 3
    assert again.free[0] == tuple(ids)
    assert s.memory_backoff() == (32, 4) and s.memory_backoff() == (16, 2)
    for _ in range(RECOVER_AFTER_STEPS):
        s.step_succeeded()
    assert (s.step_tokens, s.max_running) == (32, 4)
    for _ in range(2 * RECOVER_AFTER_STEPS):
        s.step_succeeded()
    assert (s.step_tokens, s.max_running) == (64, 8) == s.configured
    assert isinstance(StepPlan, type) and WorkItem and StepMemoryError
