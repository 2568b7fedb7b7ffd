"""The step-profile benchmark's ``--quick`` preset on CPU (in process, no Ray): every variant's counts are what
ran (output tokens, one device time per engine step, the plans within the variant's budgets, multi-step decode
only where asked) and a profiler window on the shard's generation thread records CPU ops as data."""

from __future__ import annotations

import json

import pytest
from ray_moe_bench import available, step_profile


def test_quick_variants_and_a_profiler_window(tmp_path, eager_capture):
    """Each variant captures its own lattice (the CUDA-graph paths on CPU: ``eager_capture``), the larger step
    tokens' after the smaller's graphs were released (their shared buffers re-made to its sizes), then runs."""
    assert available()["step_profile"].startswith("Where a serving step's time goes")
    out = tmp_path / "out"
    assert step_profile.main(["--quick", "--variants", "64:1,128:2", "--windows", "1:2", "--out", str(out)]) == 0
    (path,) = out.glob("step_profile-*.json")
    body = json.loads(path.read_text())
    assert body["benchmark"] == "step_profile" and body["quick"] is True
    assert body["device"] == "cpu" and body["dtype"] == "float32" and body["layers"] == 2
    assert {"machine", "torch"} <= set(body["hardware"])
    work = body["workload"]
    req, new = work["requests"], work["new_tokens"]
    assert (req, new) == (8, 4)
    variants = body["variants"]
    assert [(v["step_tokens"], v["decode_steps"]) for v in variants] == [(64, 1), (128, 2)]
    for v in variants:
        assert not v["capture"]["errors"] and v["capture"]["piecewise_graphs"] > 0, v["capture"]
        assert v["output_tokens"] == req * new
        assert v["output_tokens_per_s"] == pytest.approx(v["output_tokens"] / v["wall_s"])
        assert v["steps"] >= 1 and len(v["device_ms"]) == v["steps"] and v["device_ms_complete"]
        assert v["warm"]["steps"] >= 1 and not v["memory_events"] and v["backoffs"] == 0
        assert len(v["plans"]) == v["steps"]  # nothing failed: every launched step was committed
        assert all(p[1] <= v["step_tokens"] for p in v["plans"]), v["plans"]
        assert sum(p[1] for p in v["plans"]) == work["prompt_tokens"]  # every prompt prefilled once
        # every token past a request's first is one decode item's sub-step (the prefill samples the first), and a
        # request one token from its end may run a step's second sub-step anyway (its sample dropped)
        assert req * (new - 1) <= sum(p[0] * p[2] for p in v["plans"]) <= req * (new - 1) + req * (v["decode_steps"] - 1)
        assert set(v["timing_medians_ms"]) >= {"plan", "wait", "device"}
        (w,) = v["windows"]
        assert w["steps"] == [1, 2] and w["steps_collected"] >= 1 and w["wall_ms"] > 0
        assert isinstance(w["kernels"], list) and w["kernel_ms_total"] >= 0
        assert w["cpu_ops"] and all(r["calls"] >= 1 and r["self_cpu_ms"] >= 0 for r in w["cpu_ops"])
        # the memory ops by input shape: what ran eagerly in the window, each with its operands' shapes
        assert w["memory_ops"] and all(r["name"] in step_profile.MEMORY_OPS and r["calls"] >= 1 and r["device_ms"] >= 0
                                       for r in w["memory_ops"])
        assert any(r["input_shapes"] and all(isinstance(d, int) for sh in r["input_shapes"] for d in sh)
                   for r in w["memory_ops"])
    assert step_profile.plain_shapes([[2, 3], [[4], [5, 6]], []]) == [[2, 3], [[4], [5, 6]], []]  # a tensor list nests
    one, two = variants
    assert max(p[2] for p in one["plans"]) == 1
    assert any(p[2] == 2 for p in two["plans"]), two["plans"]


def test_bad_variants_and_windows_are_usage_errors(tmp_path):
    for args in (["--variants", "64:65"], ["--variants", "8:64:1"], ["--windows", "3:2"], ["--windows", "1:4,2:5"]):
        with pytest.raises(SystemExit) as exc:
            step_profile.main(["--quick", "--out", str(tmp_path), *args])
        assert exc.value.code == 2, args
    assert not list(tmp_path.glob("*.json"))


def test_a_checkpoint_is_served_as_from_pretrained_reads_it(tmp_path):
    """``--checkpoint``: a tiny FP8 Qwen3-MoE written by the test, every one of its layers, the workload's prompts
    drawn from its vocabulary; a folder that is no checkpoint is a usage error naming the flag."""
    from ray_moe_dev.testing.hf_models import fp8_model

    ref, folder = fp8_model("qwen3_moe", tmp_path / "q3", block=(32, 32))
    out = tmp_path / "out"
    assert step_profile.main(["--quick", "--checkpoint", folder, "--out", str(out)]) == 0
    (path,) = out.glob("step_profile-*.json")
    body = json.loads(path.read_text())
    assert body["checkpoint"] == folder and body["layers"] == ref.config.num_hidden_layers
    (v,) = body["variants"]
    assert v["output_tokens"] == body["workload"]["requests"] * body["workload"]["new_tokens"]
    with pytest.raises(SystemExit) as exc:
        step_profile.main(["--quick", "--checkpoint", str(tmp_path / "nothing"), "--out", str(out)])
    assert exc.value.code == 2
