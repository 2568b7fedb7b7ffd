"""HFWeightSource, weight_source(cfg) over HF and legacy folders, and config_from_pretrained."""

from __future__ import annotations

import os

import pytest
import torch

from ray_moe.model.config import RuntimeConfig
from ray_moe.core.errors import ConfigError
from ray_moe.model.source import weight_source
from ray_moe.moe.experts.weights import SeededWeightSource, save_checkpoint
from ray_moe.model.config import config_from_pretrained, default_slots_per_rank
from ray_moe.model.source import HFWeightSource
from ray_moe.model.spec import build_spec
from ray_moe_dev.testing.hf_models import EXPERTS, FFN, HIDDEN, live_expert_weights


def test_hf_weight_source(hf_checkpoint):
    model, folder = hf_checkpoint("deepseek_v3", "per_expert", True)
    src = HFWeightSource(folder, dtype=torch.bfloat16)
    assert (src.num_layers, src.num_experts, src.hidden_size, src.ffn_size, src.top_k) == (2, EXPERTS, HIDDEN, FFN, 2)
    w = src.expert(1, 4)
    assert w.w_gate.dtype == torch.bfloat16
    assert torch.equal(w.w_down, live_expert_weights(model, 1, 4)[2].to(torch.bfloat16))
    assert src.router(0).dtype == torch.float32 and src.router(0).shape == (EXPERTS, HIDDEN)
    d = src.describe()
    assert d["kind"] == "hf" and d["moe_layers"] == [1, 2] and d["layouts"] == ["per_expert"] * 2
    assert src.validate()["moe_layers"] == 2


def test_prebuilt_spec_is_reused(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3_moe_dense0", "fused")
    spec = build_spec(folder)
    src = HFWeightSource(folder, spec=spec)
    assert src.spec is spec and src.num_layers == 2


def test_weight_source_from_config(hf_checkpoint):
    model, folder = hf_checkpoint("qwen2_moe", "fused", True)
    cfg = config_from_pretrained(folder, num_ranks=2)
    src = weight_source(cfg)
    assert isinstance(src, HFWeightSource)
    assert torch.equal(src.expert(1, 7).w_gate, live_expert_weights(model, 1, 7)[0])
    bad = cfg.model_copy(update={"num_layers": 3})
    with pytest.raises(ConfigError, match=r"num_layers=3 but checkpoint .* has 2 MoE layers"):
        weight_source(bad)
    bad = cfg.model_copy(update={"ffn_size": 64})
    with pytest.raises(ConfigError, match=r"ffn_size=64 but checkpoint"):
        weight_source(bad)


def test_legacy_folder_without_config(tmp_path):
    """save_checkpoint's Mixtral-named folder (no config.json) reads through the same index."""
    seeded = SeededWeightSource(num_layers=3, num_experts=4, hidden_size=8, ffn_size=16, seed=5)
    save_checkpoint(seeded, str(tmp_path), shards=2)
    cfg = RuntimeConfig(num_ranks=2, num_experts=4, hidden_size=8, ffn_size=16, top_k=2, slots_per_rank=2,
                        num_layers=3, checkpoint=str(tmp_path))
    src = weight_source(cfg)
    assert isinstance(src, HFWeightSource)
    assert src.spec.top_k is None and src.spec.moe_layers == (0, 1, 2)
    assert src.index.validate()["layouts"] == {"per_expert": 3, "fused": 0}
    for layer in range(3):
        assert torch.equal(src.router(layer), seeded.router(layer))
        for e in range(4):
            assert src.expert(layer, e).digest() == seeded.expert(layer, e).digest()


def test_legacy_folder_of_qwen_names(hf_checkpoint, tmp_path):
    """A save_pretrained folder whose config.json was lost still reads (per-expert names, shapes from headers)."""
    import shutil

    model, folder = hf_checkpoint("qwen3_moe_dense0")
    shutil.copytree(folder, tmp_path / "ck")
    os.remove(tmp_path / "ck" / "config.json")
    src = HFWeightSource(str(tmp_path / "ck"))
    assert src.spec.moe_layers == (1, 2) and (src.hidden_size, src.ffn_size, src.num_experts) == (HIDDEN, FFN, EXPERTS)
    assert torch.equal(src.expert(0, 2).w_up, live_expert_weights(model, 0, 2)[1])
    with pytest.raises(ConfigError, match="config.json"):
        config_from_pretrained(str(tmp_path / "ck"), num_ranks=2)


def test_config_from_pretrained(hf_checkpoint):
    _, folder = hf_checkpoint("deepseek_v3")
    cfg = config_from_pretrained(folder, num_ranks=4, dtype="bfloat16")
    assert (cfg.num_experts, cfg.hidden_size, cfg.ffn_size, cfg.top_k, cfg.num_layers) == (EXPERTS, HIDDEN, FFN, 2, 2)
    assert cfg.checkpoint == folder and cfg.dtype == "bfloat16" and cfg.device == "cpu"
    assert cfg.slots_per_rank == default_slots_per_rank(8, 4) == 3
    cfg = config_from_pretrained(folder, num_ranks=4, slots_per_rank=2, top_k=1, name="ds3")
    assert (cfg.slots_per_rank, cfg.top_k, cfg.name) == (2, 1, "ds3")


def test_default_slots_rule():
    assert default_slots_per_rank(8, 4) == 3
    assert default_slots_per_rank(8, 1) == 8  # one rank: no replica on the same device
    assert default_slots_per_rank(256, 8) == 40
    assert default_slots_per_rank(60, 8) == 10  # base 8 + 2
    for e in (1, 7, 64, 160):
        for p in (1, 3, 8):
            q = default_slots_per_rank(e, p) * p
            # every expert; on several ranks at least one replica slot per rank as well
            assert q == e if p == 1 else q > e


def test_config_errors_name_the_field(hf_checkpoint, tmp_path):
    _, folder = hf_checkpoint("mixtral")
    with pytest.raises(ConfigError, match=r"slots_per_rank=1 x num_ranks=2"):
        config_from_pretrained(folder, num_ranks=2, slots_per_rank=1)
    with pytest.raises(ConfigError, match=r"dtype='int8'"):
        config_from_pretrained(folder, num_ranks=2, dtype="int8")
    with pytest.raises(ConfigError, match=r"num_ranks=0"):
        config_from_pretrained(folder, num_ranks=0)
    with pytest.raises(ConfigError, match=r"not_a_field=1: not a RuntimeConfig field"):
        config_from_pretrained(folder, num_ranks=2, not_a_field=1)
    with pytest.raises(ConfigError, match=r"no such folder"):
        config_from_pretrained(str(tmp_path / "missing"), num_ranks=2)


def test_config_validates_checkpoint_in_driver(hf_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, folder = hf_checkpoint("qwen3_moe")
    shutil.copytree(folder, tmp_path / "ck")
    path = tmp_path / "ck" / "model.safetensors"
    state = load_file(str(path))
    del state["model.layers.0.mlp.experts.3.gate_proj.weight"]
    save_file(state, str(path))
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.experts\.3\.gate_proj\.weight"):
        config_from_pretrained(str(tmp_path / "ck"), num_ranks=2)
    assert config_from_pretrained(str(tmp_path / "ck"), num_ranks=2, validate=False).num_layers == 3


def test_source_pickles_without_open_handles(hf_checkpoint):
    """Ray ships sources and specs between processes: open safetensors handles stay behind."""
    import pickle

    model, folder = hf_checkpoint("deepseek_v3", "fused", True)
    src = HFWeightSource(folder)
    src.expert(0, 0)
    assert src.index._handles
    copy = pickle.loads(pickle.dumps(src))
    assert copy.index._handles == {} and copy.spec == src.spec
    assert torch.equal(copy.expert(1, 6).w_gate, live_expert_weights(model, 1, 6)[0])
