"""The serving benchmark's FP8 mode (``--quantization fp8``, ``serving_fp8``) end to end on CPU: the tiny Qwen3-MoE
as a random block-FP8 checkpoint written under ``--fp8-dir``, served by ray-moe through its checkpoint path
(product defaults), the JSON's quantization, checkpoint bytes and seconds and ray-moe's memory over them; a
second run reuses the folder and hands vLLM that folder (no dummy weights); the flags' combinations."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from ray_moe_bench import serving
from ray_moe_bench.serving import Role
from safetensors import safe_open

from ray_moe.moe.experts.fp8 import FP8_DTYPE


def _body(out) -> dict:
    (path,) = out.glob("serving-*.json")
    return json.loads(path.read_text())


def _fp8_bytes(folder: str) -> tuple[int, int]:
    """(FP8 code bytes, routed expert codes + scales bytes) of the checkpoint, read from its files."""
    codes = routed = 0
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), framework="pt") as fh:
                for k in fh.keys():
                    t = fh.get_tensor(k)
                    codes += t.numel() if t.dtype == FP8_DTYPE else 0
                    routed += t.numel() * t.element_size() if ".experts." in k else 0
    return codes, routed


def test_fp8_mode_serves_the_written_checkpoint_then_reuses_it_for_vllm(ray_session, tmp_path, monkeypatch):
    fp8 = str(tmp_path / "fp8")
    out = tmp_path / "out"
    rc = serving.main(["--quick", "--in-process", "--quantization", "fp8", "--config-only", "--systems", "ray_moe",
                       "transformers", "--requests", "4", "--new-tokens", "3", "--no-warmup", "--fp8-dir", fp8,
                       "--out", str(out)])
    assert rc == 0
    body = _body(out)
    assert body["quantization"] == "fp8"
    assert body["run"]["flags_changed"]["quantization"] == "fp8" and body["run"]["flags_changed"]["fp8_dir"] == fp8
    model = body["model"]
    assert model["folder"] == fp8 and model["quantization"] == "fp8" and model["config"]["num_hidden_layers"] == 2
    ck = model["checkpoint"]
    codes, routed = _fp8_bytes(fp8)
    assert ck["folder"] == fp8 and ck["reused"] is False and ck["seconds"] >= ck["write_s"] > 0
    b = ck["bytes"]
    assert b["codes"] == codes and b["scales"] > 0 and b["other"] > 0
    assert b["total"] == b["codes"] + b["scales"] + b["other"] <= sum(
        os.path.getsize(os.path.join(fp8, f)) for f in os.listdir(fp8) if f.endswith(".safetensors"))
    assert ck["counters"]["fp8_tensors"] > 0 and ck["counters"]["shards_written"] == 1
    # ray-moe: the checkpoint path with the product's defaults (no random model passed), every token made
    r = body["systems"]["ray_moe"]
    assert r["status"] == "ok", r
    assert r["non_defaults"] == {} and r["bench_passed"] == {} and r["settings"]["seeded_on_device"] is False
    assert r["output_tokens"] == 12 == r["expected_output_tokens"] and r["mismatched_requests"] == 0
    mem = r["fp8_memory"]
    assert mem["checkpoint_bytes"] == b and mem["ranks"] == 2 and mem["measured_by"] == "held_bytes"
    assert mem["expert_bytes"] >= routed  # every routed expert's codes and scales, on some rank
    assert mem["held_bytes"] == mem["expert_bytes"] + mem["module_bytes"]
    assert mem["held_over_checkpoint"] == pytest.approx(mem["held_bytes"] / b["total"])
    assert mem["allocated_bytes"] is None and mem["within_target"] is None  # (CPU, two ranks: not judged)
    tf = body["systems"]["transformers"]
    assert tf["status"] == "skipped" and "--quantization fp8" in tf["reason"]
    # a second run: the folder reused, and vLLM given that folder with its own defaults (no dummy weights)
    got = {}

    def fake_vllm(spec):
        got.update(serving.vllm_kwargs(spec))
        return {"status": "skipped", "reason": "(test: what vLLM is given)"}

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(serving, "WORKERS", {**serving.WORKERS, Role.VLLM: fake_vllm})
    out2 = tmp_path / "out2"
    assert serving.main(["--quick", "--in-process", "--quantization", "fp8", "--config-only", "--systems", "vllm",
                         "--requests", "4", "--new-tokens", "3", "--no-warmup", "--fp8-dir", fp8,
                         "--out", str(out2)]) == 0
    again = _body(out2)["model"]["checkpoint"]
    assert again["reused"] is True and again["counters"] == {"reused": 1} and again["bytes"] == b
    assert again["write_s"] == ck["write_s"] and again["seconds"] < ck["seconds"]
    assert got["model"] == got["tokenizer"] == fp8 and "load_format" not in got and got["dtype"] == "float32"


@pytest.mark.parametrize("argv,message", [
    (["--quantization", "fp8"], "--quantization fp8 writes a random FP8 checkpoint"),
    (["--quantization", "fp8", "--config-only", "--model", "/m"], "give --config-only \\(and no --model"),
    (["--config-only", "--fp8-dir", "/x"], "--fp8-dir: with --quantization fp8 only"),
    (["--config-only", "--shape", "deepseek-v3"], "--shape deepseek-v3: with --quantization fp8 only"),
    (["--quantization", "fp8", "--config-only", "--layers", "0"], "--layers=0: must be >= 1"),
])
def test_fp8_flags_are_checked_before_anything_runs(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        serving.main(argv + ["--out", str(tmp_path)])
    import re

    assert re.search(message, capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


def test_the_model_config_of_each_shape():
    """Qwen3's 48 layers by default, --layers otherwise; DeepSeek-V3: --layers or the fit (its own test); --quick:
    the shape's tiny config."""
    from ray_moe_bench import serving_fp8

    parse = serving.build_parser().parse_args
    conf, fit = serving_fp8.random_config(parse(["--config-only"]), "cpu")
    assert conf["model_type"] == "qwen3_moe" and conf["num_hidden_layers"] == 48 and fit is None
    conf, _ = serving_fp8.random_config(parse(["--quantization", "fp8", "--shape", "deepseek-v3", "--layers", "5"]),
                                        "cpu")
    assert (conf["model_type"], conf["num_hidden_layers"], conf["n_routed_experts"], conf["hidden_size"]) == (
        "deepseek_v3", 5, 256, 7168)
    assert (conf["n_group"], conf["topk_group"], conf["num_experts_per_tok"], conf["q_lora_rank"]) == (8, 4, 8, 1536)
    conf, _ = serving_fp8.random_config(parse(["--quick", "--shape", "deepseek-v3"]), "cpu")
    assert conf["hidden_size"] == 64 and conf["num_hidden_layers"] == 2
    assert serving_fp8.fp8_dir(parse(["--shape", "deepseek-v3"])) == "/tmp/ray-moe-fp8/deepseek-v3"


def test_the_writer_process_and_the_benchmark_name_one_checkpoint(tmp_path):
    """The writer in its own process (the GPU path: ``--config-json``, ``--report``) writes what the benchmark's
    in-process call then reuses (one digest), and the writer's command line gives each shape the benchmark's
    config (so ``fp8-write`` writes the checkpoint the timed steps reuse)."""
    from ray_moe_bench import fp8_checkpoint, serving_fp8

    parse = serving.build_parser().parse_args
    a = parse(["--quick", "--quantization", "fp8", "--config-only", "--fp8-dir", str(tmp_path / "q")])
    conf, fit = serving_fp8.random_config(a, "cpu")
    (tmp_path / "work").mkdir()
    first = serving_fp8.prepare(a, conf, fit, "cpu", str(tmp_path / "work"), 300, in_process=False)
    assert first["folder"] == str(tmp_path / "q") and first["checkpoint"]["reused"] is False
    again = serving_fp8.prepare(a, conf, fit, "cpu", str(tmp_path / "work"), 300, in_process=True)
    assert again["checkpoint"]["reused"] is True and again["checkpoint"]["digest"] == first["checkpoint"]["digest"]
    for shape in ("qwen3-30b-a3b", "deepseek-v3"):
        folder, rep = str(tmp_path / shape), tmp_path / f"{shape}.json"
        assert fp8_checkpoint.main(["--shape", shape, "--fit", "--dir", folder, "--device", "cpu",
                                    "--report", str(rep)]) == 0
        got = json.loads(rep.read_text())
        want, fit = serving_fp8.random_config(parse(["--quantization", "fp8", "--config-only", "--shape", shape,
                                                     "--fp8-dir", folder]), "cpu")
        assert got["config"] == want and "checkpoint" not in got and not os.path.exists(folder)
        assert (got["fit"] is None) == (fit is None) == (shape == "qwen3-30b-a3b")


def test_the_memory_check_leaves_the_kv_cache_out():
    """One rank as the H100 run of session 22 reported it (the KV cache allocated by ``rt.serving()``): judged on
    allocated bytes beside the KV cache, not on everything allocated."""
    from ray_moe_bench import serving_fp8

    b = {"codes": 29_896_998_912, "scales": 7_299_072, "other": 1_270_247_424, "total": 31_174_545_408}
    mem = {"expert_bytes": 29_451_202_560, "module_bytes": 2_176_438_784, "kv_bytes": 38_562_004_992,
           "allocated_bytes": 70_626_475_520}
    got = serving_fp8.memory_check({"memory_after_start": {"0": mem}}, {"bytes": b})
    assert got["measured_by"] == "allocated_beside_kv_bytes" and got["kv_bytes"] == mem["kv_bytes"]
    assert got["allocated_beside_kv_bytes"] == 70_626_475_520 - 38_562_004_992
    assert got["allocated_beside_kv_over_checkpoint"] == pytest.approx(1.0286, abs=1e-4)
    assert got["within_target"] is True
    over = serving_fp8.memory_check({"memory_after_start": {"0": {**mem, "kv_bytes": 30_000_000_000}}}, {"bytes": b})
    assert over["within_target"] is False  # 40.6 GB beside the cache: over 1.05 x 31.2 GB
