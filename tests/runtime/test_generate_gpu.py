"""Generation in the shard on one GPU: float32 on CUDA, decode steps captured as whole-step CUDA graphs and
replayed; tokens equal to transformers' greedy generate (float32 on the CPU)."""

from __future__ import annotations

import pytest
import torch

import ray_moe
from ray_moe_dev.testing.hf_models import tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_cuda_generation_replays_whole_step_graphs(ray_session, tmp_path, family):
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, device="cuda", dtype="float32",
                                                decode_token_capacity=8, name=f"gpu-gen-{family}")
    rt = ray_moe.Runtime.start(cfg)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 11, 3, 8, 6)]
        got = rt.generate(prompts, max_new_tokens=12)
        want = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
        assert got == want
        status = rt.shard_status()[0]
        assert status["capture_error"] is None, status["capture_error"]
        # the model's norm layers and rotary embedding took the fused kernels (and still token-equal)
        fused = status["fused_kernels"]
        assert fused["norm_layers"] >= 2 * model.config.num_hidden_layers and fused["rotary_modules"], fused
        # softmax top-k routers took the fused kernel, DeepSeek's (sigmoid, grouped) kept its own; FP32 keeps
        # the separate Q/K/V GEMMs (the fusion is for bf16 / fp16)
        if family == "qwen3_moe":
            assert fused["router_layers"] == model.config.num_hidden_layers and fused["skipped"] == {}, fused
        else:
            assert fused["router_layers"] == 0 and set(fused["skipped"]) == {"DeepseekV3TopkRouter"}, fused
        assert fused["qkv_modules"] == 0, fused
        counters = status["counters"]
        assert counters.get("graphs_captured", 0) >= 2 and counters.get("graph_replays", 0) >= 5, counters
        # the same prompts again: the prefill step (a group of one captures it too) and the decode steps replay
        assert rt.generate(prompts, max_new_tokens=12) == want
        assert [rt.generate([p], max_new_tokens=4)[0] for p in prompts[:2]] == [w[:4] for w in want[:2]]
        again = rt.shard_status()[0]
        assert again["capture_error"] is None, again["capture_error"]
        assert again["counters"]["graph_replays"] >= counters["graph_replays"] + 12, again["counters"]
        # multi-step decode ran (several sub-steps per call, fed on the device) and device time was measured
        assert again["counters"].get("multi_step_requests", 0) >= 2, again["counters"]
        assert again["counters"].get("device_busy_us", 0) > 0, again["counters"]
        # on CUDA the shard's heap was frozen after the model loaded, and its collector pauses are counted
        assert again["counters"]["gc_freezes"] == 1 and again["counters"]["gc_frozen_objects"] > 10_000
        assert again["counters"]["gc_collections"] > 0, again["counters"]
        assert rt.serving().gc_counters()["gc_freezes"] == 1
        timings = rt.serving().timing_summary()
        assert timings["device"] > 0 and timings["device"] <= timings["shard"] + 1e-6, timings
    finally:
        rt.shutdown()


def _prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of new tokens before the first divergence of each pair (greedy bf16 runs drift apart after one)."""
    same = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same / max(1, sum(len(x) for x in a))


def test_bf16_generation_on_the_varlen_backend_matches_the_masked_one(ray_session, tmp_path):
    """bf16 on CUDA takes FlashAttention varlen (captured decode steps included); the masked SDPA backend on the
    same weights gives the same greedy tokens up to bf16 drift."""
    _, folder = tiny_model("qwen3_moe", tmp_path / "m")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 40, 3, 17, 9, 64)]
    outs, infos = {}, {}
    for backend in ("auto", "masked"):
        cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, device="cuda", dtype="bfloat16",
                                                    decode_token_capacity=8, name=f"gpu-attn-{backend}")
        rt = ray_moe.Runtime.start(cfg)
        try:
            eng = rt.serving(attention=backend)
            outs[backend] = rt.generate(prompts, max_new_tokens=16)
            st = rt.shard_status()[0]
            infos[backend] = (eng.attention_backend, st["capture_error"], st["counters"].get("graph_replays", 0),
                              eng.kv_tokens)
        finally:
            rt.shutdown()
    assert infos["auto"][0] == "varlen" and infos["masked"][0] == "masked", infos
    assert infos["auto"][1] is None and infos["auto"][2] >= 5, infos
    # kv_tokens=None: the cache was sized from the GPU's memory (far beyond the old 8192 default)
    assert infos["auto"][3] > 100_000, infos
    agree = _prefix_agreement(outs["auto"], outs["masked"])
    print("varlen vs masked greedy prefix agreement:", agree)
    assert agree >= 0.75, (agree, outs)


def test_captured_mixed_steps_read_their_decode_rows_in_place(ray_session, tmp_path):
    """bf16 varlen with small steps: later prompts are prefilled in chunks while earlier ones decode, so the
    captured mixed steps' one-row groups read the cache in place (``paged_mixed_steps`` counts them) and their
    chunks attend gathered contexts; greedy tokens agree with the masked backend up to bf16 drift, and again
    with prefix hits."""
    _, folder = tiny_model("qwen3_moe", tmp_path / "m")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 70, 33, 5, 110, 48, 17, 90)]
    outs, counters = {}, {}
    for backend in ("auto", "masked"):
        cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, device="cuda", dtype="bfloat16",
                                                    decode_token_capacity=8, name=f"gpu-mixed-{backend}")
        rt = ray_moe.Runtime.start(cfg)
        try:
            rt.serving(attention=backend, step_tokens=64)
            outs[backend] = rt.generate(prompts, max_new_tokens=12)
            st = rt.shard_status()[0]
            assert st["capture_error"] is None, st["capture_error"]
            if backend == "auto":  # again (prefix hits now): the captured shapes replay, tokens up to drift
                assert _prefix_agreement(rt.generate(prompts, max_new_tokens=12), outs[backend]) >= 0.75
            counters[backend] = rt.shard_status()[0]["counters"]
        finally:
            rt.shutdown()
    assert counters["auto"].get("paged_mixed_steps", 0) >= 2, counters["auto"]
    assert counters["masked"].get("paged_mixed_steps", 0) == 0, counters["masked"]
    agree = _prefix_agreement(outs["auto"], outs["masked"])
    assert agree >= 0.75, (agree, outs)
