"""Hugging Face MoE checkpoints served by a local Ray deployment (2-4 CPU ranks with replicas): per MoE layer,
ray-moe's routed output equals the transformers block's routed experts (the block minus its shared experts),
expert weights are bit-equal to the checkpoint, and a transformers model whose experts run in the deployment
through the ``ray_moe`` seam generates greedily the same tokens as the plain model."""

from __future__ import annotations

import pytest
import torch

import ray_moe
from ray_moe.model.seam import bind, unbind
from ray_moe_dev.testing.hf_models import live_expert_weights, tiny_model

# (family, layout, sharded, ranks): per-expert and fused layouts, sharded index, dense first layers
CASES = [
    ("mixtral", "per_expert", True, 2),
    ("qwen3_moe_dense0", "fused", False, 3),
    ("deepseek_v3", "per_expert", False, 4),
]


def _captured_inputs(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run the plain model once and record, per MoE layer, what its experts module got and returned."""
    from ray_moe.model.spec import experts_modules

    seen: dict[int, tuple] = {}
    hooks = []
    for layer, (_, mod) in enumerate(experts_modules(model)):
        def hook(m, args, out, layer=layer):
            h, i, w = args
            seen[layer] = (h.detach().clone(), i.detach().clone(), w.detach().clone(), out.detach().clone())
        hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("family,layout,sharded,ranks", CASES)
def test_checkpoint_served_layer_by_layer_and_generation_through_the_seam(ray_session, tmp_path, family, layout,
                                                                          sharded, ranks):
    model, folder = tiny_model(family, tmp_path / family, layout=layout, sharded=sharded)
    model.eval()
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=ranks, name=f"hf-{family}")
    assert cfg.slots_per_rank * ranks > cfg.num_experts  # replicas
    rt = ray_moe.Runtime.start(cfg)
    try:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=g)
        seen = _captured_inputs(model, ids)
        assert sorted(seen) == list(range(cfg.num_layers))
        for layer, (h, topk_ids, topk_w, want) in seen.items():
            got = rt.forward(h, topk_ids, topk_w, layer=layer)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            for e in (0, cfg.num_experts - 1):
                wg, wu, wd = rt.expert_weights(e, layer=layer)
                lg, lu, ld = live_expert_weights(model, layer, e)
                assert torch.equal(wg, lg) and torch.equal(wu, lu) and torch.equal(wd, ld)
        # the whole model generating with its experts in the deployment
        want_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        bind(model, rt.moe_executor())
        try:
            got_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        finally:
            unbind(model)
        assert got_tokens.tolist() == want_tokens.tolist()
        assert rt.stats()["accepted_routes"] > 0
    finally:
        rt.shutdown()


def test_layer_out_of_range_is_refused_before_any_step(ray_session, tmp_path):
    _, folder = tiny_model("mixtral", tmp_path / "m")
    rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, name="hf-bad-layer"))
    try:
        h = torch.randn(3, rt.cfg.hidden_size)
        ids = torch.zeros(3, 2, dtype=torch.int64)
        w = torch.ones(3, 2)
        with pytest.raises(ValueError, match="layer=5"):
            rt.forward(h, ids, w, layer=5)
        with pytest.raises(ValueError, match="topk_ids"):
            rt.forward(h, torch.zeros(2, 3, 2, dtype=torch.int64), torch.ones(2, 3, 2), layer=0)
        assert rt.stats()["dropped_routes"] == rt.stats()["attempted_routes"] > 0
    finally:
        rt.shutdown()
