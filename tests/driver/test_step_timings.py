"""The loop's per-step timings: every collected step records the shard's host work (``StepResult.host_s``: its
launch and completion, not the waits) next to its elapsed time on the shard; the serving benchmark's share
is the sum of host over the sum of device time (in-process deployment, the driver's real loop)."""

from __future__ import annotations

import gc

import pytest
import torch

import ray_moe
from ray_moe.driver.loop import GenerationLoop
from ray_moe.model.sampling import SamplingParams
from ray_moe_dev.testing.hf_models import tiny_model
from ray_moe_dev.testing.inprocess import InProcessDeployment, LocalTransport
from ray_moe_bench.serving import host_share, host_share_by_kind, memory_after_start


@pytest.fixture
def tiny_loop(tmp_path):
    """(the transformers model, its in-process one-rank deployment, the driver's loop over it); closed after."""
    model, folder = tiny_model("qwen3_moe", tmp_path / "m")
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, decode_token_capacity=8))
    transport = LocalTransport(dep)
    loop = GenerationLoop(transport, device="cpu", kv_tokens=1024, block_size=8, step_tokens=16)
    try:
        yield model, dep, loop
    finally:
        loop.close()
        transport.close()


def test_every_step_records_the_shards_host_work(tiny_loop):
    _, _, loop = tiny_loop
    g = torch.Generator().manual_seed(1)
    hs = [loop.submit(torch.randint(0, 128, (n,), generator=g).tolist(), SamplingParams(max_new_tokens=5))
          for n in (9, 20, 4)]
    assert all(len(h.result(120)) == 5 for h in hs)
    host, shard = list(loop.timings["host"]), list(loop.timings["shard"])
    assert len(host) == len(shard) == loop.steps > 0
    assert all(0.0 < h <= s + 1e-6 for h, s in zip(host, shard)), (host, shard)
    # the shard thread's CPU time over the same spans: positive, and no more than their wall time
    cpu = list(loop.timings["host_cpu"])
    assert len(cpu) == len(host) and all(0.0 < c <= h + 0.5 for c, h in zip(cpu, host)), (cpu, host)
    share = host_share(loop.timings)
    assert share["steps"] == loop.steps and share["host_ms"] == sum(host) and share["host_cpu_ms"] == sum(cpu)
    assert share["host_over_device"] is None  # CPU: no device time is measured
    # every collected step's shape, aligned with the timings: the prompt tokens and decode rows it ran
    shapes = list(loop.step_shapes)
    assert len(shapes) == loop.steps and sum(p for p, _, _ in shapes) == 9 + 20 + 4
    assert sum(r * n for _, r, n in shapes) == 3 * 4  # every token after a request's first came from a decode row
    kinds = host_share_by_kind(loop.timings, loop.step_shapes)
    assert [row[:3] for row in kinds["steps"]] == [list(x) for x in shapes]
    assert sum(v["steps"] for k, v in kinds.items() if k != "steps") == loop.steps
    assert kinds["prefill"]["host_ms"] == sum(h for h, (p, _, _) in zip(host, shapes) if p)


def test_the_loop_counts_its_processs_collector_pauses_and_removes_its_callback(tiny_loop):
    _, _, loop = tiny_loop
    assert loop.gc._callback in gc.callbacks
    before = loop.gc_counters()
    assert before["gc_freezes"] == 0  # on CPU the heap is not frozen (no device to keep fed)
    gc.collect(2)
    after = loop.gc_counters()
    assert after["gc_full_collections"] == before["gc_full_collections"] + 1
    assert after["gc_pause_us"] > before["gc_pause_us"]
    loop.close()
    assert loop.gc._callback not in gc.callbacks


def test_deferred_collections_run_at_the_loop_and_shard_safe_points_with_tokens_unchanged(tiny_loop):
    """The CUDA policy (``defer_to_safe_points``, set up as the driver loop and the shard actor do it there) on the
    real loop: collections run at the safe points after launches (the driver's with two steps in flight, the
    shard's after each launch), none past them, and the tokens equal the same requests' under Python's policy."""
    _, dep, loop = tiny_loop
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (12,), generator=g)]
    params = SamplingParams(max_new_tokens=12)
    want = [h.result(120) for h in loop.submit_many([(p, params, None) for p in prompts])]
    core = dep.cores[0]
    seen: list[int | None] = []  # what each of the shard's safe points collected

    def shard_point():
        seen.append(loop.gc.safe_point())
        return seen[-1]

    loop.gc.defer_to_safe_points(young=1, safety=10_000_000)  # (young=1: every safe point collects)
    core.safe_point = shard_point
    try:
        before = loop.gc_counters()
        got = [h.result(120) for h in loop.submit_many([(p, params, None) for p in prompts])]
        after = loop.gc_counters()
    finally:
        core.safe_point = lambda: None
        loop.close()  # (restores the thresholds)
    assert got == want
    safe = after["gc_safe_point_collections"] - before["gc_safe_point_collections"]
    shard = sum(x is not None for x in seen)
    assert shard > 0 and safe - shard > 0  # the shard's safe points and the driver's both collected
    # no automatic collection with the net at 10 M (one explicit gc.collect from another thread may land)
    assert safe <= after["gc_collections"] - before["gc_collections"] <= safe + 1


def test_the_shard_reports_the_bytes_it_holds_weights_and_kv_cache(tiny_loop):
    model, dep, loop = tiny_loop
    core = dep.cores[0]
    mem = core.status()["memory"]
    c = model.config
    # the model's non-expert tensors: everything but the routed experts' (which the slot buffers hold)
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n)
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = c.tie_word_embeddings * model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert mem["module_bytes"] == everything - tied - experts + buffers, (mem, everything, experts, buffers)
    assert mem["expert_bytes"] == core.store.nbytes > 0
    assert mem["kv_bytes"] == 0  # each layer's cache tensors are allocated at its first step
    assert memory_after_start({0: core.status()}) == {"0": mem}  # (CPU: no allocator figures, no ratio)
    assert len(loop.submit(list(range(1, 12)), SamplingParams(max_new_tokens=3)).result(120)) == 3
    kv = core.status()["memory"]["kv_bytes"]
    head = getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    slots = loop.kv_tokens + 1  # (+ the trash slot)
    assert kv == c.num_hidden_layers * 2 * slots * c.num_key_value_heads * head * 4  # float32 keys and values
