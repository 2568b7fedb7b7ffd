"""CheckpointIndex: per-expert, fused and sharded layouts read bit-equal to the model's own parameters;
fused reads touch one expert only; header-only validation; every broken-folder case names file/tensor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import ray_moe.model.checkpoint as ckpt
from ray_moe.core.errors import ConfigError
from ray_moe.model.checkpoint import FUSED, PER_EXPERT, CheckpointIndex
from ray_moe_dev.testing.hf_models import EXPERTS, FAMILIES, FFN, HIDDEN, MOE_LAYERS, live_expert_weights

SAVED_FUSED = {"aria_text", "granitemoe"}  # save_pretrained keeps these stacked (under renamed names)


def _assert_bit_equal(index: CheckpointIndex, model) -> None:
    for layer in range(index.spec.num_moe_layers):
        for e in range(EXPERTS):
            w = index.read_expert(layer, e)
            assert (w.layer, w.expert) == (layer, e)
            gate, up, down = live_expert_weights(model, layer, e)
            assert torch.equal(w.w_gate, gate) and torch.equal(w.w_up, up) and torch.equal(w.w_down, down)
            assert w.w_gate.shape == (FFN, HIDDEN) and w.w_down.shape == (HIDDEN, FFN)
        router = index.read_router(layer)
        live = model.get_submodule(index.spec.router_paths[layer]).weight.detach()
        assert router.dtype == torch.float32 and torch.equal(router, live.float())


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_read_bit_equal(family, layout, sharded, hf_checkpoint):
    model, folder = hf_checkpoint(family, layout, sharded)
    index = CheckpointIndex(folder)
    want = FUSED if layout == "fused" or family in SAVED_FUSED else PER_EXPERT
    assert [lay.kind for lay in index.layouts] == [want] * len(MOE_LAYERS[family])
    assert [lay.decoder_layer for lay in index.layouts] == list(MOE_LAYERS[family])
    assert (index.index_path is not None) == sharded
    if sharded:
        assert len(index.files) > 1
    summary = index.validate()
    assert summary["layouts"][want] == len(MOE_LAYERS[family]) and summary["dtype"] == "F32"
    _assert_bit_equal(index, model)


def test_dtype_cast(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3_moe", "fused")
    w = CheckpointIndex(folder).read_expert(1, 3, torch.bfloat16)
    assert w.w_gate.dtype == w.w_up.dtype == w.w_down.dtype == torch.bfloat16


class _Spy:
    """Wraps a safe_open handle and records which tensors were read whole or sliced."""

    def __init__(self, handle, log):
        self._h, self._log = handle, log

    def get_tensor(self, name):
        self._log.append(("get_tensor", name))
        return self._h.get_tensor(name)

    def get_slice(self, name):
        self._log.append(("get_slice", name))
        return self._h.get_slice(name)

    def keys(self):
        return self._h.keys()


def test_fused_read_slices_one_expert(hf_checkpoint, monkeypatch):
    model, folder = hf_checkpoint("deepseek_v3", "fused")
    log: list[tuple[str, str]] = []
    real = ckpt.safe_open
    monkeypatch.setattr(ckpt, "safe_open", lambda path, framework: _Spy(real(path, framework=framework), log))
    index = CheckpointIndex(folder)
    log.clear()
    w = index.read_expert(1, 5)
    fused = {index.layouts[1].gate, index.layouts[1].down}
    assert not [n for kind, n in log if kind == "get_tensor" and n in fused], log
    assert {n for kind, n in log if kind == "get_slice"} == fused
    # the tensors own one expert's bytes, not the stacked [E, ...] tensor
    assert w.w_gate.untyped_storage().nbytes() == FFN * HIDDEN * 4
    assert w.w_down.untyped_storage().nbytes() == HIDDEN * FFN * 4
    assert torch.equal(w.w_up, live_expert_weights(model, 1, 5)[1])
    log.clear()
    index.validate()  # headers only
    assert not [n for kind, n in log if kind == "get_tensor"]


def test_per_expert_read_touches_only_that_expert(hf_checkpoint, monkeypatch):
    _, folder = hf_checkpoint("mixtral", "per_expert", True)
    log: list[tuple[str, str]] = []
    real = ckpt.safe_open
    monkeypatch.setattr(ckpt, "safe_open", lambda path, framework: _Spy(real(path, framework=framework), log))
    index = CheckpointIndex(folder)
    log.clear()
    index.read_expert(0, 6)
    assert sorted(n for _, n in log) == sorted(
        f"model.layers.0.block_sparse_moe.experts.6.{w}.weight" for w in ("w1", "w2", "w3"))


def test_range_errors(hf_checkpoint):
    index = CheckpointIndex(hf_checkpoint("qwen3_moe_dense0")[1])
    with pytest.raises(ConfigError, match=r"expert=8 is out of range \[0, 8\).*experts\.8\.gate_proj"):
        index.read_expert(0, 8)
    with pytest.raises(ConfigError, match=r"layer=2 is out of range \[0, 2\)"):
        index.read_expert(2, 0)


# ------------------------------------------------------------------------------------------- errors
def _copy(hf_checkpoint, tmp_path, family="qwen3_moe", layout="per_expert", sharded=False) -> str:
    _, folder = hf_checkpoint(family, layout, sharded)
    dst = tmp_path / "ck"
    shutil.copytree(folder, dst)
    return str(dst)


def test_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match="gone.*no such folder"):
        CheckpointIndex(str(tmp_path / "gone"))


def test_missing_tensor_in_file(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint, tmp_path)
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    victim = "model.layers.2.mlp.experts.5.up_proj.weight"
    del state[victim]
    save_file(state, path)
    index = CheckpointIndex(folder)
    with pytest.raises(ConfigError, match=rf"{victim.replace('.', '[.]')}.*missing.*not in any of \['model.safetensors'\]"):
        index.validate()
    with pytest.raises(ConfigError, match=victim.replace(".", "[.]")):
        index.read_expert(2, 5)
    index.read_expert(2, 4)  # the others still read


def test_missing_tensor_in_index(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint, tmp_path, "deepseek_v3", sharded=True)
    index_path = os.path.join(folder, "model.safetensors.index.json")
    data = json.loads(open(index_path).read())
    victim = "model.layers.1.mlp.experts.7.down_proj.weight"
    del data["weight_map"][victim]
    open(index_path, "w").write(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"{victim.replace('.', '[.]')}.*missing.*model[.]safetensors[.]index[.]json"):
        CheckpointIndex(folder).validate()


def test_index_names_a_file_without_the_tensor(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint, tmp_path, "mixtral", sharded=True)
    index_path = os.path.join(folder, "model.safetensors.index.json")
    data = json.loads(open(index_path).read())
    victim = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    other = next(f for f in sorted(set(data["weight_map"].values())) if f != data["weight_map"][victim])
    data["weight_map"][victim] = other
    open(index_path, "w").write(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"{victim.replace('.', '[.]')}.*missing from .*{other}"):
        CheckpointIndex(folder).validate()


def test_index_names_a_missing_file(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint, tmp_path, "qwen2_moe", sharded=True)
    index_path = os.path.join(folder, "model.safetensors.index.json")
    victim = sorted(json.loads(open(index_path).read())["weight_map"].values())[-1]
    os.remove(os.path.join(folder, victim))
    with pytest.raises(ConfigError, match=rf"{victim}.*does not exist"):
        CheckpointIndex(folder)


@pytest.mark.parametrize("keep", [0.5, 0.001], ids=["data-cut", "header-cut"])
def test_truncated_file(hf_checkpoint, tmp_path, keep):
    folder = _copy(hf_checkpoint, tmp_path, "deepseek_v3", "fused")
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: max(4, int(len(data) * keep))])
    with pytest.raises(ConfigError, match=r"model\.safetensors: not a readable safetensors file"):
        CheckpointIndex(folder)


def test_fused_layer_missing(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint, tmp_path, "deepseek_v3", "fused")
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    del state["model.layers.2.mlp.experts.down_proj"]
    save_file(state, path)
    with pytest.raises(ConfigError, match=r"MoE layer 1 \(decoder layer 2\) has no expert tensors.*"
                                          r"model\.layers\.2\.mlp\.experts\.gate_up_proj"):
        CheckpointIndex(folder)


def test_wrong_shape(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint, tmp_path, "deepseek_v2", "fused")
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    state[name] = state[name][:6].contiguous()  # 6 experts instead of 8
    save_file(state, path)
    with pytest.raises(ConfigError, match=rf"model\.safetensors: tensor '{name}' has shape \[6, 96, 32\], "
                                          rf"expected \[8, 96, 32\]"):
        CheckpointIndex(folder).validate()


def test_mixed_dtype(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint, tmp_path, "mixtral")
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    state[name] = state[name].to(torch.bfloat16)
    save_file(state, path)
    with pytest.raises(ConfigError, match=rf"{name.replace('.', '[.]')}' has dtype BF16"):
        CheckpointIndex(folder).validate()


def test_no_safetensors(tmp_path):
    with pytest.raises(ConfigError, match="holds no \\*.safetensors file"):
        CheckpointIndex(str(tmp_path))
