"""A block-scaled FP8 DeepSeek-V3 (MLA, grouped routing, a shared expert; 16 x 16 blocks) served by a local Ray
deployment of two ranks: greedy generation token-equal to transformers' ``generate`` of the dequantized model,
across a live rebalance and a scale (the copies go through the object store with their scales);
``expert_weights`` returns the dequantized values, ``raw=True`` the codes and scales every replica holds."""

from __future__ import annotations

import ray
import torch

import ray_moe
from ray_moe.model.source import HFWeightSource
from ray_moe.moe.experts.weights import experts_from_wire
from ray_moe_dev.testing.hf_models import fp8_model, live_expert_weights


def _prompts(seed: int, lens) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]


def test_fp8_deepseek_served_by_ray_across_rebalance_and_scale(ray_session, tmp_path):
    from tests.runtime.test_generate import _generate_during

    ref, folder = fp8_model("deepseek_v3", tmp_path / "ds3", block=(16, 16))
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=4, name="fp8-ds3")
    rt = ray_moe.Runtime.start(cfg)
    try:
        rt.serving(kv_tokens=256, block_size=8, step_tokens=16)
        prompts = _prompts(5, (7, 4, 10, 6))
        new = 10
        want = [ref.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
        assert rt.generate(prompts, max_new_tokens=new) == want
        g0 = rt.placement().generation
        assert _generate_during(rt, prompts, new, rt.rebalance, wait_steps=2) == want
        assert _generate_during(rt, prompts, new, lambda: rt.scale(expert=1, replicas=2), wait_steps=2) == want
        assert rt.placement().generation > g0 and rt.placement().replica_counts(0)[1] == 2
        # the dequantized values (float32), and the codes + scales every replica holds, bit-equal to the file
        src = HFWeightSource(folder)
        for layer, e in ((0, 1), (1, 6)):
            wg, wu, wd = rt.expert_weights(e, layer=layer)
            for got, live in zip((wg, wu, wd), live_expert_weights(ref, layer, e)):
                assert got.dtype == torch.float32 and torch.equal(got, live)
            raw = rt.expert_weights(e, layer=layer, raw=True)
            assert raw.quantized and raw.block == (16, 16) and raw.digest() == src.expert(layer, e).digest()
        holders = [s.destination_rank for s in rt.placement().replicas(1, 0)]
        assert len(set(holders)) == 2
        for r in holders:  # the scaled-out replica arrived with its scales
            w = experts_from_wire(ray.get(rt.shards[r].expert_weights.remote(0, 1)))[(0, 1)]
            assert w.quantized and w.digest() == src.expert(0, 1).digest()
        assert all(rc == 0 for rc in rt.refcounts().values())
    finally:
        rt.shutdown()
