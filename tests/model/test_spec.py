"""ModelSpec from config.json alone: MoE layers of every family (dense layers skipped), shapes, top-k,
checkpoint names, and the ConfigErrors for folders ray-moe cannot serve."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ray_moe.core.errors import ConfigError
from ray_moe.model.spec import build_spec
from ray_moe_dev.testing.hf_models import EXPERTS, FAMILIES, FFN, HIDDEN, MODEL_TYPES, MOE_LAYERS, TOP_K, tiny_config

ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen2_moe_step2": "Qwen2MoeForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_moe_dense0": "Qwen3MoeForCausalLM",
        "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
        "aria_text": "AriaTextForCausalLM", "granitemoe": "GraniteMoeForCausalLM"}


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_per_family(family, hf_checkpoint):
    model, folder = hf_checkpoint(family)
    spec = build_spec(folder)
    assert spec.model_type == MODEL_TYPES.get(family, family)
    assert spec.architecture == ARCH[family] == type(model).__name__
    assert spec.moe_layers == MOE_LAYERS[family]
    assert spec.num_moe_layers == len(MOE_LAYERS[family])
    assert spec.num_decoder_layers == model.config.num_hidden_layers
    assert (spec.num_experts, spec.top_k, spec.hidden_size, spec.ffn_size) == (EXPERTS, TOP_K, HIDDEN, FFN)
    assert spec.is_transposed is (family == "aria_text")
    for layer, path in zip(spec.moe_layers, spec.experts_paths):
        assert f".{layer}." in path and path.endswith("experts")
        assert model.get_submodule(path).gate_up_proj.shape[0] == EXPERTS
    for rpath in spec.router_paths:
        assert tuple(model.get_submodule(rpath).weight.shape) == (EXPERTS, HIDDEN)
    assert spec.moe_index(spec.moe_layers[-1]) == spec.num_moe_layers - 1


def test_dense_layers_are_not_moe_layers(hf_checkpoint):
    _, folder = hf_checkpoint("deepseek_v3")
    spec = build_spec(folder)
    with pytest.raises(ConfigError, match="decoder layer 0 .* has no routed experts"):
        spec.moe_index(0)


def test_spec_reads_no_weights(hf_checkpoint, tmp_path):
    """Only config.json is needed: the spec of a folder without any safetensors file builds."""
    tiny_config("qwen3_moe_dense0").save_pretrained(tmp_path)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    spec = build_spec(str(tmp_path))
    assert spec.moe_layers == (1, 2)


def test_saved_names_come_from_transformers(hf_checkpoint):
    spec = build_spec(hf_checkpoint("mixtral")[1])
    gate, up, down = spec.names[1].per_expert[0]
    assert (gate, up, down) == tuple(f"model.layers.1.block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2"))
    assert spec.names[1].router[0] == "model.layers.1.block_sparse_moe.gate.weight"
    assert ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj") in spec.names[1].fused
    spec = build_spec(hf_checkpoint("deepseek_v3")[1])
    assert spec.names[0].per_expert[0][2] == "model.layers.1.mlp.experts.{e}.down_proj.weight"


# ------------------------------------------------------------------------------------------- errors
def test_missing_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="nope.*no such folder"):
        build_spec(str(missing))


def test_missing_config_json(hf_checkpoint, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="config.json"):
        build_spec(str(tmp_path))


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model_xyz", "architectures": ["X"]}))
    with pytest.raises(ConfigError, match=r"config\.json.*no_such_model_xyz"):
        build_spec(str(tmp_path))


def test_dense_architecture_is_unsupported(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"config\.json.*LlamaForCausalLM.*no routed experts"):
        build_spec(str(tmp_path))


def test_non_silu_experts_rejected(tmp_path):
    cfg = tiny_config("mixtral")
    cfg.hidden_act = "gelu"
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"MixtralForCausalLM.*hidden_act='gelu'"):
        build_spec(str(tmp_path))


def test_biased_experts_rejected(tmp_path):
    """gpt-oss experts have biases (and a clamped, interleaved gate): not ray-moe's SwiGLU."""
    import transformers as tf

    cfg = tf.GptOssConfig(hidden_size=32, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                          head_dim=8, layer_types=["full_attention"] * 2)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"GptOssForCausalLM.*has_bias=True"):
        build_spec(str(tmp_path))


def test_spec_is_frozen(hf_checkpoint):
    spec = build_spec(hf_checkpoint("mixtral")[1])
    with pytest.raises(Exception):
        spec.num_experts = 4  # type: ignore[misc]
    assert torch is not None
