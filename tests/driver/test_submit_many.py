"""A batch submitted at once (``GenerationLoop.submit_many``): all or none, planned together, the same tokens
as requests submitted one by one (in-process deployment, the driver's real loop)."""

from __future__ import annotations

import pytest
import torch

import ray_moe
from ray_moe.driver.loop import OverloadedError
from ray_moe.driver.loop import GenerationLoop
from ray_moe.model.sampling import SamplingParams
from ray_moe_dev.testing.hf_models import tiny_model
from ray_moe_dev.testing.inprocess import InProcessDeployment, LocalTransport


@pytest.fixture
def loop(tmp_path):
    _, folder = tiny_model("qwen3_moe", tmp_path / "m")
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, decode_token_capacity=8))
    transport = LocalTransport(dep)
    lp = GenerationLoop(transport, device="cpu", kv_tokens=1024, block_size=8, step_tokens=64, max_queued=8)
    yield lp
    lp.close()
    transport.close()


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (3 + i,), generator=g).tolist() for i in range(n)]


def test_a_batch_is_planned_together_with_the_tokens_of_single_requests(loop):
    prompts, params = _prompts(6), SamplingParams(max_new_tokens=2)
    got = [h.result(120) for h in loop.submit_many([(p, params, None) for p in prompts])]
    assert loop.steps == 2  # one prefill step with all six prompts, one decode step
    want = [loop.submit(p, params).result(120) for p in prompts]
    assert got == want and all(len(t) == 2 for t in got)


def test_a_bad_request_or_too_many_queue_nothing(loop):
    params = SamplingParams(max_new_tokens=2)
    good = _prompts(3)
    with pytest.raises(ValueError, match=r"^prompt: token id 999 is out of range \[0, 128\)") as info:
        loop.submit_many([(good[0], params, None), (good[1], params, None), ([5, 999], params, None)])
    assert info.value.__notes__ == ["requests[2] of a batch of 3: nothing was queued"]
    with pytest.raises(OverloadedError, match=r"0 requests in flight and 9 more \(max_queued=8\)"):
        loop.submit_many([(p, params, None) for p in _prompts(9)])
    assert loop.scheduler.pending() == 0 and loop.steps == 0
    events = []
    (h,) = loop.submit_many([(good[0], params, events.append)])
    assert len(h.result(120)) == 2 and [e for e in events if isinstance(e, int)] == h.result(1)
