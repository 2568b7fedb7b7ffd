"""Block-scaled FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 layout, written by ``fp8_model`` with real block scales):
every load entry (``RuntimeConfig.from_pretrained``, the weight source, ``ModelHost.from_checkpoint``) refuses a
quantization ray-moe does not serve, and float8 tensors under a config that declares none, naming the method or
tensor and the file; FP8 experts are read as codes with their scales (per-expert, fused and sharded layouts);
the non-expert layers are dequantized at load, bit-equal to transformers' own load of the dequantized model;
and generation through the in-process deployment is token-equal to transformers' greedy ``generate`` of that
dequantized model (Qwen3-MoE, DeepSeek-V3 with MLA, grouped routing and a shared expert, Mixtral; one block
per tensor at 128 x 128 and several at 16 x 16)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import ray_moe
from ray_moe.core.errors import ConfigError
from ray_moe.model.checkpoint import CheckpointIndex
from ray_moe.model.host import ModelHost
from ray_moe.model.source import HFWeightSource
from ray_moe.moe.experts.fp8 import FP8_DTYPE, dequantize
from ray_moe_dev.testing.hf_models import dense_modules_equal, fp8_model, live_expert_weights
from ray_moe_dev.testing.inprocess import InProcessDeployment, generate_inprocess


@pytest.fixture(scope="module")
def qwen_fp8(tmp_path_factory):
    """(reference model, FP8 folder): Qwen3-MoE in 16 x 16 blocks (several per tensor), sharded."""
    return fp8_model("qwen3_moe", tmp_path_factory.mktemp("fp8") / "q3", block=(16, 16), sharded=True)


def _edit(src: str, dst, quantization, side: str | None = None) -> str:
    """A copy of ``src`` whose config.json has ``quantization`` as its quantization_config (None: removed)."""
    dst = os.fspath(dst)
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    cfg.pop("quantization_config", None)
    if isinstance(quantization, dict) and "compression_config" in quantization:
        cfg.update(quantization)
    elif quantization is not None:
        cfg["quantization_config"] = quantization
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    if side:
        with open(os.path.join(dst, side), "w") as fh:
            json.dump({"bits": 4, "group_size": 128}, fh)
    return dst


def _every_entry_refuses(folder: str, match: str) -> None:
    for entry in (lambda: ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2),
                  lambda: HFWeightSource(folder).expert(0, 0),
                  lambda: ModelHost.from_checkpoint(folder, kv_tokens=64)):
        with pytest.raises(ConfigError, match=match):
            entry()


FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
REFUSED = [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method='gptq'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "quant_method='awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}},
     "quant_method='compressed-tensors' \\(format='float-quantized'\\)"),
    ({"quant_method": "mxfp4"}, "quant_method='mxfp4'"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme='static' \\(static activation scales\\)"),
    ({k: v for k, v in FP8.items() if k != "weight_block_size"}, "weight_block_size=None .*per-tensor scales"),
    ({**FP8, "weight_block_size": [128]}, "weight_block_size=\\[128\\]: expected two integers"),
    ({**FP8, "expert_dtype": "fp4"}, "expert_dtype='fp4'"),
    ({"compression_config": {"quant_method": "compressed-tensors"}}, "compression_config"),
]


@pytest.mark.parametrize("quantization,match", REFUSED, ids=[m.split("'")[1] if "'" in m else m[:20] for _, m in REFUSED])
def test_every_load_entry_refuses_a_quantization_it_does_not_serve(hf_checkpoint, tmp_path, quantization, match):
    _, plain = hf_checkpoint("qwen3_moe")
    folder = _edit(plain, tmp_path / "q", quantization)
    _every_entry_refuses(folder, f"{folder}/config.json: .*{match}")


def test_a_gptq_side_file_is_refused_naming_it(hf_checkpoint, tmp_path):
    _, plain = hf_checkpoint("qwen3_moe")
    folder = _edit(plain, tmp_path / "q", None, side="quantize_config.json")
    _every_entry_refuses(folder, f"{folder}/quantize_config.json: a quantization toolkit's config")


def test_float8_tensors_under_a_config_without_quantization_are_refused_naming_the_tensor(qwen_fp8, tmp_path):
    _, fp8 = qwen_fp8
    folder = _edit(fp8, tmp_path / "q", None)
    tensor = ".*tensor 'model\\.layers\\.\\d\\.[a-z_.0-9]+' (is torch.float8_e4m3fn|is F8_E4M3|holds scales)"
    _every_entry_refuses(folder, f"{folder}/model-0000\\d-of-00003.safetensors: {tensor} .*declares no "
                                 f"quantization_config")
    with pytest.raises(ConfigError, match="'model.layers.0.mlp.experts.0.gate_proj.weight' is torch.float8_e4m3fn"):
        HFWeightSource(folder).expert(0, 0)


def test_missing_or_misshapen_scales_are_refused(qwen_fp8, tmp_path):
    _, fp8 = qwen_fp8
    # the checkpoint says 32 x 32 blocks but its scales are 16 x 16 ones
    folder = _edit(fp8, tmp_path / "blocks", {**FP8, "weight_block_size": [32, 32]})
    with pytest.raises(ConfigError, match="scales .*_scale_inv' have shape \\[3, 2\\], expected \\[2, 1\\] .*blocks "
                                          "of \\[32, 32\\] \\(weight_block_size of .*config.json\\)"):
        ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2)
    # one expert's scales dropped
    folder = _edit(fp8, tmp_path / "gone", FP8)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            part = load_file(os.path.join(folder, f))
            if part.pop(name + "_scale_inv", None) is not None:
                save_file(part, os.path.join(folder, f))
    with open(os.path.join(folder, "model.safetensors.index.json")) as fh:
        index = json.load(fh)
    del index["weight_map"][name + "_scale_inv"]
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh)
    with pytest.raises(ConfigError, match=f"FP8 tensor '{name}' has no '{name}_scale_inv'"):
        ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2)
    with pytest.raises(ConfigError, match=f"FP8 tensor '{name}' has no '{name}_scale_inv'"):
        HFWeightSource(folder).expert(1, 3)


def test_fp8_experts_are_codes_with_their_scales_in_every_layout(qwen_fp8, tmp_path):
    ref, folder = qwen_fp8
    index = CheckpointIndex(folder)
    assert index.spec.fp8_block == (16, 16) and len(index.files) == 3
    assert index.validate()["dtype"] == "F8_E4M3" and index.validate()["fp8_block"] == [16, 16]
    raw = {}
    for f in index.files:
        raw.update(load_file(f))
    fref, fused = fp8_model("qwen3_moe", tmp_path / "fused", block=(16, 16), layout="fused")
    findex = CheckpointIndex(fused)
    for layer, e in ((0, 0), (2, 7)):
        w = index.read_expert(layer, e, torch.bfloat16)  # dtype does not apply to codes
        assert w.quantized and w.block == (16, 16) and w.w_gate.dtype == FP8_DTYPE
        assert [tuple(s.shape) for s in w.scales] == [(3, 2), (3, 2), (2, 3)]  # f=48, d=32 in 16 x 16 blocks
        name = f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"
        assert torch.equal(w.w_gate.view(torch.uint8), raw[name].view(torch.uint8))
        assert torch.equal(w.scales[0], raw[name + "_scale_inv"])
        deq = w.dequantized()
        for got, want in zip((deq.w_gate, deq.w_up, deq.w_down), live_expert_weights(ref, layer, e)):
            assert torch.equal(got, want)  # = transformers' load of the dequantized checkpoint
        # fused [E, 2f, d] with the gate's and the up's scale rows concatenated: the same expert
        fw = findex.read_expert(layer, e)
        assert fw.quantized and fw.digest() == w.digest()
        for got, want in zip(fw.dequantized().tensors(), live_expert_weights(fref, layer, e)):
            assert torch.equal(got, want)


def test_non_expert_layers_are_dequantized_at_load_exactly(qwen_fp8):
    ref, folder = qwen_fp8
    checked = dense_modules_equal(ModelHost.from_checkpoint(folder, kv_tokens=64), ref)
    assert checked >= 3 * 4  # every attention projection of every layer came from FP8 codes
    codes = load_file(os.path.join(folder, "model-00001-of-00003.safetensors"))
    assert any(t.dtype == FP8_DTYPE for t in codes.values())


def _prompts(seed: int, lens) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]


def _reference(model, prompts, new: int) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


@pytest.mark.parametrize("family,block,layout", [("deepseek_v3", (16, 16), "per_expert"),
                                                 ("mixtral", (128, 128), "per_expert"),
                                                 ("qwen3_moe", (128, 128), "fused")])
def test_inprocess_generation_equals_the_dequantized_model(tmp_path, family, block, layout):
    ref, folder = fp8_model(family, tmp_path / family, block=block, layout=layout)
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=4)
    dep = InProcessDeployment(cfg)
    held = dep.cores[0].store.get(dep.cores[0].store.held()[0])
    assert held.quantized and held.block == block  # the slots hold codes and scales, once
    info = dep.cores[0].load_model(kv_tokens=256, block_size=8)  # (what the driver hears at start)
    assert info["fp8_expert_layers"] == ref.config.num_hidden_layers - getattr(ref.config, "first_k_dense_replace", 0)
    assert "need CUDA" in info["fp8_dequantized_reason"]  # (on a CPU: the dequantized path, and why)
    prompts = _prompts(0, (5, 13, 2, 9))
    got = generate_inprocess(dep, prompts, 7, step_tokens=8, join_after={3: _prompts(1, (6,))})
    assert got == _reference(ref, prompts + _prompts(1, (6,)), 7)


def test_sharded_fp8_generation_across_a_rebalance_and_a_corrupted_scale(qwen_fp8):
    """Several blocks per tensor, scales in other files than their codes; a rebalance copies codes with their
    scales (token-equal after it); a copy whose scale changed in transit fails the digest check, nothing is
    published and the prior generation keeps serving."""
    ref, folder = qwen_fp8
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=4))
    prompts = _prompts(2, (4, 11, 7))
    want = _reference(ref, prompts, 6)
    assert generate_inprocess(dep, prompts, 6, step_tokens=8) == want
    g0 = dep.generation
    dep.plane.scale(3, 2, 0)
    dep.generation = dep.plane.registry.active()
    assert dep.generation > g0 and generate_inprocess(dep, prompts, 6, step_tokens=8) == want
    for core in dep.cores.values():  # every replica of expert 3: its codes and scales, bit-equal to the file
        w = core.store.get((0, 3))
        if w is not None:
            assert w.digest() == HFWeightSource(folder).expert(0, 3).digest()
    real = dep.cores[0].export_experts, dep.cores[1].export_experts

    def corrupt(export):
        def run(keys, **kw):
            out = export(keys, **kw)
            for w in out.values():
                w.scales[1][0, 0] *= 1.5  # one block scale of w_up
            return out
        return run

    dep.cores[0].export_experts, dep.cores[1].export_experts = corrupt(real[0]), corrupt(real[1])
    g1 = dep.generation
    with pytest.raises(Exception, match="parameter_digest"):
        dep.plane.scale(5, 2, 1)
    dep.cores[0].export_experts, dep.cores[1].export_experts = real
    assert dep.plane.registry.active() == g1
    assert generate_inprocess(dep, prompts, 6, step_tokens=8) == want


def test_fp8_on_the_h200_step_paths_on_cpu_stays_token_equal(qwen_fp8, eager_capture, paged_references):
    """One rank (the local route plan's indexed rows), the step lattice captured at start and replayed (decode
    graphs, piecewise graphs; eager emulations on CPU): FP8 slots change nothing but the weights' format."""
    ref, folder = qwen_fp8
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1))
    core = dep.cores[0]
    prompts, late = _prompts(11, (5, 13)), _prompts(12, (9,))
    got = generate_inprocess(dep, prompts, 5, step_tokens=8, join_after={2: late})
    assert got == _reference(ref, prompts + late, 5)
    c = {**core.generator.counters, **core.pipeline.counters, **core.generator.graph_runner.counters}
    assert c.get("decode_graph_steps", 0) >= 3 and not c.get("eager_steps"), c


def test_online_fp8_quantizes_an_unquantized_checkpoints_experts_at_load(hf_checkpoint):
    """``quantization="fp8"`` (``ray-moe serve --quantization fp8``): the routed experts of a float32 checkpoint
    quantized per 128 x 128 block at load and served from FP8 slots; token-equal to the model whose experts are
    replaced by their quantized values (the non-expert modules unchanged)."""
    import copy

    from ray_moe.apps.cli import build_parser, serve_config_fields
    from ray_moe.model.seam import model_experts
    from ray_moe.moe.experts.fp8 import quantize

    model, folder = hf_checkpoint("mixtral")
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=4, quantization="fp8")
    dep = InProcessDeployment(cfg)
    w = dep.cores[1].store.get(dep.cores[1].store.held()[0])
    assert w.quantized and w.block == (128, 128) and dep.cores[1].source.fp8_block == (128, 128)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        for _, mod in model_experts(ref):
            f = mod.gate_up_proj.shape[1] // 2
            for e in range(mod.gate_up_proj.shape[0]):
                for part in (mod.gate_up_proj[e, :f], mod.gate_up_proj[e, f:], mod.down_proj[e]):
                    part.copy_(dequantize(*quantize(part, (128, 128)), (128, 128)))
    prompts = _prompts(3, (6, 11, 3))
    assert generate_inprocess(dep, prompts, 6, step_tokens=8) == _reference(ref, prompts, 6)
    args = build_parser().parse_args(["serve", "--checkpoint", folder, "--quantization", "fp8"])
    assert serve_config_fields(args)["quantization"] == "fp8"
    with pytest.raises(Exception, match="quantization"):
        ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, quantization="int4")


def test_fp8_payloads_across_ranks_equal_the_model_with_quantized_expert_inputs(tmp_path, monkeypatch):
    """``payload_format=fp8_block128`` on two ranks (issue 41: FP8 across ranks): every routed row travels as e4m3
    codes with one float32 scale per 128 columns, on the engine path (prefill, mixed steps) and the decode buckets
    alike, half the bytes of bf16 rows; generation is token-equal to the dequantized model whose experts' inputs are
    quantized the same way (per token, before any expert: the result does not depend on placement)."""
    from ray_moe.core.types import PayloadFormat
    from ray_moe.moe.dispatch import bucket, engine, precision

    ref, folder = fp8_model("qwen3_moe", tmp_path / "q3", block=(16, 16))

    def quantized_inputs(_mod, args, kwargs):
        x = args[0]
        q, s = precision.quantize(x.reshape(-1, x.shape[-1]), PayloadFormat.FP8_BLOCK128)
        return (precision.dequantize(q, s, PayloadFormat.FP8_BLOCK128, x.dtype).reshape(x.shape), *args[1:]), kwargs

    for name, mod in ref.named_modules():
        if name.endswith("mlp.experts"):
            mod.register_forward_pre_hook(quantized_inputs, with_kwargs=True)
    sent: dict[str, list[torch.dtype]] = {"engine": [], "bucket": []}
    for path, module in (("engine", engine), ("bucket", bucket)):
        def spy(x, fmt, _path=path, _real=precision.quantize):
            out = _real(x, fmt)
            sent[_path].append(out[0].dtype)
            return out
        monkeypatch.setattr(module, "quantize", spy)
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=4,
                                                payload_format="fp8_block128")
    assert not any("payload_format" in w for w in cfg.start_warnings())  # (every path carries it: nothing to say)
    prompts = _prompts(0, (5, 13, 2, 9))
    got = generate_inprocess(InProcessDeployment(cfg), prompts, 7, step_tokens=8)
    assert got == _reference(ref, prompts, 7)
    assert sent["engine"] and sent["bucket"] and set(sent["engine"] + sent["bucket"]) == {FP8_DTYPE}
