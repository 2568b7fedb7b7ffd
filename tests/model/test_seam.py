"""The transformers seam: MoE blocks and whole models served by a bound executor match the model's own
experts (eager and grouped_mm), greedy generation is unchanged, router weights reach the executor as
produced, and weights can be dropped from the replica."""

from __future__ import annotations

import pytest
import torch

from ray_moe.core.errors import ConfigError, RayMoEError
from ray_moe_dev.testing.local_executor import LocalExecutor
from ray_moe.model.seam import (IMPLEMENTATION, MoEExecutor, bind, model_experts,
                                 ray_moe_experts_forward, register, unbind)
from ray_moe.model.source import HFWeightSource
from ray_moe.model.spec import build_spec
from ray_moe_dev.testing.hf_models import EXPERTS, FAMILIES, FFN, HIDDEN, MOE_LAYERS, VOCAB, tiny_model


class Recording:
    """Wraps an executor and records every call's arguments."""

    def __init__(self, inner: MoEExecutor):
        self.inner = inner
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def moe_forward(self, layer, hidden, topk_ids, topk_weights):
        self.calls.append((layer, hidden.clone(), topk_ids.clone(), topk_weights.clone()))
        return self.inner.moe_forward(layer, hidden, topk_ids, topk_weights)


def _block_out(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def _prompt(seed=1, batch=2, length=6):
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def test_register_is_idempotent():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    register()
    register()
    assert ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] is ray_moe_experts_forward
    assert list(ALL_EXPERTS_FUNCTIONS.keys()).count(IMPLEMENTATION) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_block_matches_eager_and_grouped_mm(family, tmp_path):
    model, folder = tiny_model(family, tmp_path / family)
    spec = build_spec(folder)
    x = torch.randn(3, 5, HIDDEN, generator=torch.Generator().manual_seed(7))
    blocks = [model.get_submodule(p.rsplit(".", 1)[0]) for p in spec.experts_paths]
    refs = {}
    with torch.no_grad():
        for impl in ("eager", "grouped_mm"):
            model.set_experts_implementation(impl)
            refs[impl] = [_block_out(b, x) for b in blocks]
        torch.testing.assert_close(refs["eager"], refs["grouped_mm"], atol=1e-5, rtol=0)
        ex = Recording(LocalExecutor(HFWeightSource(folder)))
        assert bind(model, ex) == list(spec.experts_paths)
        assert model.config._experts_implementation == IMPLEMENTATION
        outs = [_block_out(b, x) for b in blocks]
    assert [c[0] for c in ex.calls] == list(range(len(blocks)))
    for layer, (ref, out) in enumerate(zip(refs["eager"], outs)):
        assert ref.abs().max() > 0.3, "outputs must be O(1) for atol 1e-5 to mean something"
        assert out.dtype == torch.float32 and out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=f"{family} MoE layer {layer}")
    unbind(model)
    assert model.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        torch.testing.assert_close(_block_out(blocks[0], x), refs["grouped_mm"][0], atol=0, rtol=0)


@pytest.mark.parametrize("family,layout", [(f, "per_expert") for f in FAMILIES]
                         + [(f, "fused") for f in ("mixtral", "qwen3_moe", "deepseek_v3")])
def test_generate_same_tokens(family, layout, tmp_path):
    model, folder = tiny_model(family, tmp_path / family, layout=layout, sharded=True)
    ids, mask = _prompt()
    with torch.no_grad():
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        ex = LocalExecutor(HFWeightSource(folder))
        bind(model, ex)
        served = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert plain.shape == (2, 14)
    assert torch.equal(plain, served)
    # every MoE layer served every step: one prefill of 12 tokens, then 7 decode steps of 2 tokens
    n = len(MOE_LAYERS[family])
    assert ex.calls[:n] == [(layer, 12) for layer in range(n)]
    assert len(ex.calls) == 8 * n and all(t == 2 for _, t in ex.calls[n:])


@pytest.mark.parametrize("family,sums", [("deepseek_v3", 2.5), ("qwen2_moe", None), ("mixtral", 1.0)])
def test_router_weights_reach_executor_as_produced(family, sums, tmp_path):
    """Correction bias, grouped top-k, renormalisation and routed scaling are the model's: the executor
    receives exactly what the router returned (DeepSeek-V3 weights sum to routed_scaling_factor 2.5,
    Qwen2-MoE's norm_topk_prob=False weights sum to less than 1)."""
    model, folder = tiny_model(family, tmp_path / family)
    spec = build_spec(folder)
    seen = []
    router = model.get_submodule(spec.router_paths[0])
    router.register_forward_hook(lambda mod, args, out: seen.append(out))
    ex = Recording(LocalExecutor(HFWeightSource(folder)))
    bind(model, ex)
    ids, mask = _prompt(seed=3)
    with torch.no_grad():
        model(ids, attention_mask=mask)
    _, weights, indices = seen[0]
    layer, hidden, got_ids, got_w = ex.calls[0]
    assert layer == 0 and hidden.shape == (12, HIDDEN)
    assert torch.equal(got_ids, indices.to(torch.int64)) and torch.equal(got_w, weights)
    total = got_w.sum(-1)
    if sums is None:
        assert (total < 1 - 1e-3).all()
    else:
        torch.testing.assert_close(total, torch.full_like(total, sums), atol=1e-5, rtol=0)


def test_drop_weights(tmp_path):
    model, folder = tiny_model("deepseek_v3", tmp_path / "ds3", layout="fused")
    ids, mask = _prompt(seed=4)
    before = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    bind(model, LocalExecutor(HFWeightSource(folder)), drop_weights=True)
    for _, mod in model_experts(model):
        assert mod.gate_up_proj.numel() == 0 and mod.down_proj.numel() == 0
        assert mod.gate_up_proj.dtype == torch.float32
    assert before - sum(p.numel() for p in model.parameters()) == 2 * EXPERTS * 3 * FFN * HIDDEN
    with torch.no_grad():
        served = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(plain, served)
    with pytest.raises(RayMoEError, match="dropped"):
        unbind(model)


def test_bfloat16_block(tmp_path):
    model, folder = tiny_model("qwen3_moe", tmp_path / "q3")
    model = model.to(torch.bfloat16)
    block = model.get_submodule(build_spec(folder).experts_paths[1].rsplit(".", 1)[0])
    x = torch.randn(2, 4, HIDDEN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        model.set_experts_implementation("eager")
        ref = _block_out(block, x)
        bind(model, LocalExecutor(HFWeightSource(folder, dtype=torch.bfloat16)))
        out = _block_out(block, x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2 * float(ref.abs().max()), rtol=0)


def test_unbound_module_and_bad_bindings(tmp_path):
    model, folder = tiny_model("mixtral", tmp_path / "mx")
    register()
    model.set_experts_implementation(IMPLEMENTATION)
    ids, mask = _prompt()
    with pytest.raises(RayMoEError, match="not bound to an executor"):
        with torch.no_grad():
            model(ids, attention_mask=mask)
    with pytest.raises(ConfigError, match="moe_forward"):
        bind(model, object())  # type: ignore[arg-type]
    dense, _ = tiny_model("llama", tmp_path / "llama")
    with pytest.raises(ConfigError, match="LlamaForCausalLM has no routed experts"):
        bind(dense, LocalExecutor(HFWeightSource(folder)))
    assert isinstance(LocalExecutor(HFWeightSource(folder)), MoEExecutor)


def test_local_executor_layer_range(hf_checkpoint):
    _, folder = hf_checkpoint("mixtral")
    ex = LocalExecutor(HFWeightSource(folder))
    h = torch.randn(2, HIDDEN)
    ids = torch.tensor([[0, 1], [2, 3]])
    w = torch.full((2, 2), 0.5)
    assert ex.moe_forward(1, h, ids, w).shape == (2, HIDDEN)
    with pytest.raises(ConfigError, match=r"layer=2 is out of range \[0, 2\)"):
        ex.moe_forward(2, h, ids, w)


def test_bind_rejects_biased_experts():
    import transformers as tf

    cfg = tf.GptOssConfig(hidden_size=32, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                          head_dim=8, layer_types=["full_attention"] * 2)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ConfigError, match=r"GptOssForCausalLM.*has_bias=True"):
        bind(model, Recording(None))  # type: ignore[arg-type]
    assert model.config._experts_implementation != IMPLEMENTATION
