"""The random block-FP8 checkpoint writer (``ray_moe_bench.fp8_checkpoint``) on a tiny Qwen3-MoE and a tiny
DeepSeek-V3 (MLA, a dense layer, shared expert, correction bias) in 16 x 16 blocks (partial edge blocks, several
shards): every decoder Linear is e4m3 codes with scales of its shape, the rest bf16 (the bias float32), the
names are exactly what transformers' ``save_pretrained`` writes; its dequantized twin loads in transformers with
every weight, equal to the seeded N(0, 1/in) draw within e4m3's rounding, and ray-moe reads the same values
(experts and non-expert modules) and accepts the folder, refusing a broken quantization_config; the marker
reuses a folder (nothing written), a new seed or a damaged file rewrites it, a foreign folder is refused; the
layer fit of the DeepSeek-V3 shape against hand-counted bytes."""

from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from ray_moe_bench.fp8_checkpoint import (
    DEEPSEEK_V3,
    DEEPSEEK_V3_QUICK,
    DISK_MARGIN,
    MARKER,
    _generator,
    checkpoint_config,
    default_layers,
    ensure_checkpoint,
    layers_that_fit,
)
from ray_moe_bench.generate import QUICK
from safetensors import safe_open
from safetensors.torch import save_file

import ray_moe
from ray_moe.core.errors import ConfigError
from ray_moe.model.checkpoint import CheckpointIndex
from ray_moe.model.host import ModelHost
from ray_moe.moe.experts.fp8 import FP8_DTYPE, dequantize
from ray_moe_dev.testing.hf_models import dense_modules_equal, live_expert_weights

BLOCK = (16, 16)
#: the checkpoint names each family stores as FP8 (written here by hand, not by the writer's rule)
FP8_NAMES = {
    "qwen3_moe": re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)"
                            r"\.weight"),
    "deepseek_v3": re.compile(r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|"
                              r"o_proj)|mlp\.(gate|up|down)_proj|mlp\.shared_experts\.(gate|up|down)_proj|"
                              r"mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight"),
}
CONFIGS = {"qwen3_moe": dict(QUICK, num_hidden_layers=2), "deepseek_v3": dict(DEEPSEEK_V3_QUICK, num_hidden_layers=3)}


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read through its index (each from the file the index names)."""
    with open(os.path.join(folder, "model.safetensors.index.json")) as fh:
        weight_map = json.load(fh)["weight_map"]
    out = {}
    for name, fname in weight_map.items():
        with safe_open(os.path.join(folder, fname), framework="pt") as fh:
            out[name] = fh.get_tensor(name)
    return out


def _dequantized_twin(folder: str, dst: str) -> dict[str, torch.Tensor]:
    """``folder`` with every FP8 weight replaced by code x block scale (float32, the product's ``dequantize``),
    no scales, no quantization_config; its tensors."""
    raw = _tensors(folder)
    dense = {k: (dequantize(v, raw[k + "_scale_inv"], BLOCK) if v.dtype == FP8_DTYPE else v)
             for k, v in raw.items() if not k.endswith("_scale_inv")}
    os.makedirs(dst)
    save_file(dense, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as fh:
        cfg = json.load(fh)
    cfg.pop("quantization_config")
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return dense


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def written(request, tmp_path_factory):
    """(family, config dict, folder, report): the tiny model's checkpoint, seed 3, in 16 x 16 blocks, 40 kB shards."""
    family = request.param
    folder = str(tmp_path_factory.mktemp(family) / "ckpt")
    rep = ensure_checkpoint(CONFIGS[family], folder, seed=3, device="cpu", shard_bytes=40_000, block=BLOCK,
                            log=lambda *a: None)
    return family, CONFIGS[family], folder, rep


def test_every_decoder_linear_is_e4m3_with_its_block_scales_and_the_rest_high_precision(written, tmp_path):
    family, conf, folder, rep = written
    raw = _tensors(folder)
    assert len(rep.files) >= 5 and sum(f.endswith(".safetensors") for f in rep.files) > 2  # several shards
    # the names are exactly those transformers' save_pretrained writes for this config
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(checkpoint_config(conf)).save_pretrained(tmp_path / "plain")
    with safe_open(str(tmp_path / "plain" / "model.safetensors"), framework="pt") as fh:
        plain = set(fh.keys())
    assert {k for k in raw if not k.endswith("_scale_inv")} == plain
    fp8 = {k for k in raw if FP8_NAMES[family].fullmatch(k)}
    assert len(fp8) > 20
    for name, t in raw.items():
        if name in fp8:
            out, inp = t.shape
            assert t.dtype == FP8_DTYPE, name
            s = raw[name + "_scale_inv"]
            assert s.dtype == torch.float32 and tuple(s.shape) == (-(-out // 16), -(-inp // 16)), name
            assert (s > 0).all()
        elif name.endswith("_scale_inv"):
            assert name.removesuffix("_scale_inv") in fp8, name
        else:
            want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            assert t.dtype == want, name
    if family == "deepseek_v3":  # partial edge blocks: kv_a_proj_with_mqa [16 + 8, 64] -> [2, 4]
        assert raw["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 4)
        assert raw["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    with open(os.path.join(folder, "config.json")) as fh:
        qc = json.load(fh)["quantization_config"]
    assert {k: v for k, v in qc.items() if k != "modules_to_not_convert"} == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [16, 16]}
    kept = set(qc["modules_to_not_convert"])
    assert {"lm_head", "model.embed_tokens", "model.norm"} <= kept and not kept & {k[:-7] for k in fp8}
    assert {f"model.layers.{i}.mlp.gate" for i in range(conf.get("first_k_dense_replace", 0), 2)} <= kept
    # the report's bytes are the tensors'
    b = rep.bytes
    assert b.codes == sum(raw[k].numel() for k in fp8)
    assert b.scales == sum(4 * raw[k + "_scale_inv"].numel() for k in fp8)
    assert b.other == sum(t.numel() * t.element_size() for k, t in raw.items()
                          if k not in fp8 and not k.endswith("_scale_inv"))


def test_the_dequantized_twin_loads_in_transformers_and_ray_moe_reads_the_same_values(written, tmp_path):
    family, conf, folder, _ = written
    from transformers import AutoModelForCausalLM

    dense = _dequantized_twin(folder, str(tmp_path / "deq"))
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "deq"), dtype=torch.float32,
                                                      output_loading_info=True)
    assert all(not v for v in info.values()), info  # every weight found, none unexpected or misshapen
    # the values: the seeded N(0, 1/in) draw, rounded to e4m3 in its block (3 mantissa bits: within 2^-4 relative,
    # or the block scale's subnormal step)
    raw = _tensors(folder)
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
        shape = tuple(raw[name].shape)
        w = torch.randn(shape, generator=_generator(3, name, torch.device("cpu"))) * shape[1] ** -0.5
        got = dense[name]
        tol = 2.0 ** -4 * w.abs() + raw[name + "_scale_inv"].max() * 2.0 ** -9
        assert ((got - w).abs() <= tol).all(), name
        assert 0.85 < got.std().item() * shape[1] ** 0.5 < 1.15
    # transformers' fused experts hold the per-expert tensors of the right expert
    first_moe = conf.get("first_k_dense_replace", 0)
    for moe_layer, e in ((0, 0), (1, 5)):
        layer = first_moe + moe_layer
        got = live_expert_weights(model, moe_layer, e)
        for i, part in enumerate(("gate_proj", "up_proj", "down_proj")):
            assert torch.equal(got[i], dense[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"].float())
    with torch.no_grad():
        logits = model(torch.arange(1, 12)[None]).logits
    assert torch.isfinite(logits).all() and 0.05 < logits.std().item() < 20
    # ray-moe: the config, the experts as codes + scales with transformers' values, the other modules dequantized
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2)
    assert (cfg.num_experts, cfg.num_layers, cfg.checkpoint) == (8, 2, folder)
    index = CheckpointIndex(folder)
    assert index.spec.fp8_block == BLOCK
    w = index.read_expert(1, 5)
    assert w.quantized and w.w_gate.dtype == FP8_DTYPE
    for got, want in zip(w.dequantized().tensors(), live_expert_weights(model, 1, 5)):
        assert torch.equal(got, want)
    checked = dense_modules_equal(ModelHost.from_checkpoint(folder, kv_tokens=64), model)
    assert checked >= 4 * 2  # every attention projection came from FP8 codes
    # a broken quantization_config is refused
    broken = str(tmp_path / "broken")
    shutil.copytree(folder, broken)
    with open(os.path.join(broken, "config.json")) as fh:
        body = json.load(fh)
    del body["quantization_config"]["weight_block_size"]
    with open(os.path.join(broken, "config.json"), "w") as fh:
        json.dump(body, fh)
    with pytest.raises(ConfigError, match="weight_block_size=None"):
        ray_moe.RuntimeConfig.from_pretrained(broken, num_ranks=2)


def test_a_second_call_reuses_the_folder_and_a_new_seed_or_damage_rewrites_it(tmp_path, monkeypatch):
    conf = dict(QUICK, num_hidden_layers=1)
    folder = str(tmp_path / "c")
    quiet = {"device": "cpu", "shard_bytes": 30_000, "log": lambda *a: None}
    first = ensure_checkpoint(conf, folder, seed=0, **quiet)
    assert not first.reused and first.counters["shards_written"] >= 3 and first.counters["fp8_tensors"] > 0
    stamps = {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in os.listdir(folder)}
    again = ensure_checkpoint(conf, folder, seed=0, **quiet)
    assert again.reused and again.counters == {"reused": 1} and again.bytes == first.bytes
    assert again.write_s == first.write_s and again.digest == first.digest
    assert {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in os.listdir(folder)} == stamps  # nothing written
    assert not os.path.exists(folder + ".partial")
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    before = _tensors(folder)[name].view(torch.uint8).clone()
    other = ensure_checkpoint(conf, folder, seed=1, **quiet)
    assert not other.reused and other.digest != first.digest
    assert not torch.equal(_tensors(folder)[name].view(torch.uint8), before)
    # a damaged shard (its size changed) is not reused
    shard = next(f for f in sorted(os.listdir(folder)) if f.endswith(".safetensors"))
    with open(os.path.join(folder, shard), "ab") as fh:
        fh.write(b"\0")
    assert not ensure_checkpoint(conf, folder, seed=1, **quiet).reused
    # a folder this writer did not make is refused, not replaced
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"holds no {MARKER}"):
        ensure_checkpoint(conf, str(foreign), seed=0, **quiet)
    assert (foreign / "notes.txt").read_text() == "mine"
    # a disk that cannot take the new checkpoint (the old one's bytes count as free): refused, the old one kept
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 40, used=1 << 40, free=0))
    with pytest.raises(ValueError, match="fewer --layers"):
        ensure_checkpoint(conf, folder, seed=2, **quiet)
    assert ensure_checkpoint(conf, folder, seed=1, **quiet).reused


def _layer_bytes_by_hand() -> int:
    """One DeepSeek-V3 MoE layer's checkpoint bytes, counted from the model card's shapes: FP8 codes + float32
    scales per 128 x 128 block of every Linear, bf16 router and norms, float32 correction bias."""
    d, f, e = 7168, 2048, 256
    heads, nope, rope, v, q_lora, kv_lora = 128, 128, 64, 128, 1536, 512
    linears = [(f, d), (f, d), (d, f)] * (e + 1)  # routed + shared experts: gate, up [f, d]; down [d, f]
    linears += [(q_lora, d), (heads * (nope + rope), q_lora), (kv_lora + rope, d), (heads * (nope + v), kv_lora),
                (d, heads * v)]  # MLA: q_a, q_b, kv_a_proj_with_mqa, kv_b, o
    fp8 = sum(o * i + 4 * -(-o // 128) * -(-i // 128) for o, i in linears)
    return fp8 + 2 * e * d + 4 * e + 2 * (2 * d + q_lora + kv_lora)


def test_the_layer_fit_is_the_most_moe_layers_the_gpu_and_the_disk_hold(tmp_path):
    fit = layers_that_fit(dict(DEEPSEEK_V3), gpu_bytes=141 * 10**9)
    assert fit.checkpoint_per_moe_layer == _layer_bytes_by_hand()
    assert fit.checkpoint_per_moe_layer > 256 * 3 * 7168 * 2048  # ~11.3 GB of expert codes
    assert fit.budget_bytes == int(0.75 * 141 * 10**9) and fit.dense_layers == 3 and fit.bound == "gpu"
    per, fixed = fit.resident_per_moe_layer, fit.resident_fixed_bytes
    assert fixed + fit.moe_layers * per <= fit.budget_bytes < fixed + (fit.moe_layers + 1) * per
    assert (fit.moe_layers, fit.layers) == (8, 11)
    disk = 45 * 10**9
    on_disk = layers_that_fit(dict(DEEPSEEK_V3), gpu_bytes=141 * 10**9, disk_free=disk)
    assert on_disk.bound == "disk" and on_disk.layers == 3 + on_disk.moe_layers_disk
    ck = on_disk.checkpoint_fixed_bytes + on_disk.moe_layers_disk * on_disk.checkpoint_per_moe_layer
    assert ck + DISK_MARGIN <= disk < ck + on_disk.checkpoint_per_moe_layer + DISK_MARGIN
    # a complete checkpoint of the shape already in the folder keeps its layer count (a second process reuses it)
    tiny = dict(DEEPSEEK_V3_QUICK)
    folder = str(tmp_path / "ds")
    assert default_layers(tiny, folder, 0, "cpu").layers > 100  # (a tiny layer: the GPU and disk hold many)
    ensure_checkpoint(dict(tiny, num_hidden_layers=3), folder, seed=0, device="cpu", log=lambda *a: None)
    kept = default_layers(tiny, folder, 0, "cpu")
    assert (kept.layers, kept.moe_layers, kept.bound) == (3, 2, "existing checkpoint")
    assert default_layers(tiny, folder, 1, "cpu").layers > 100  # (another seed: not that checkpoint)
