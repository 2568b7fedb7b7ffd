"""kernel_mix (bench/ray_moe_bench/kernel_mix.py): kernels sorted into categories by name, a Chrome trace and a
step_profile JSON summed by kernel, and the side-by-side mix."""

from __future__ import annotations

import gzip
import json

import pytest

from ray_moe_bench import kernel_mix as km

NAMES = {  # names as the profiler reported them in this project's and vLLM's runs
    "_gate_up": "experts",
    "fused_moe_kernel": "experts",
    "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17"
    "GroupProblemShapeIN4cute5tupleIJiiiEEEEE": "experts",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0": "attention",
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>": "attention",
    "_decode": "attention",
    "_decode_combine": "attention",
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>": "cache_write",
    "void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl<at::native::OpaqueType<2> >"
    ">": "cache_write",
    "_write_kv": "cache_write",
    "_rope": "rotary",
    "_rms_norm": "norm",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
    "_softmax_topk": "routing",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "routing",
    "_combine": "moe_combine",
    "nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN": "dense_gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float>": "dense_gemm",
    "Memcpy DtoD (Device -> Device)": "copies_elementwise",
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>": "copies_elementwise",
    "something_unheard_of": "other",
}


@pytest.mark.parametrize("name,cat", list(NAMES.items()))
def test_known_kernels_land_in_their_category(name, cat):
    assert km.categorize(name) == cat


def _trace(events):
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def test_a_trace_sums_device_events_by_name_and_skips_host_ones(tmp_path):
    """Complete events of the kernel / memcpy / memset categories count (durations in us); CPU ops, runtime calls
    and instant events do not; gzipped and plain files under the folder add up."""
    ev = [{"ph": "X", "cat": "kernel", "name": "_gate_up", "dur": 1500.0},
          {"ph": "X", "cat": "kernel", "name": "_gate_up", "dur": 500.0},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "dur": 250.0},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9e6},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 9e6},
          {"ph": "i", "cat": "kernel", "name": "_gate_up", "dur": 9e6}]
    with gzip.open(tmp_path / "w0.pt.trace.json.gz", "wt") as fh:
        json.dump(_trace(ev), fh)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w1.pt.trace.json").write_text(json.dumps(_trace(ev[:1])))
    by_name, files = km.read_trace_dir(str(tmp_path))
    assert len(files) == 2
    assert by_name["_gate_up"] == {"ms": pytest.approx(3.5), "calls": 3}
    assert by_name["Memcpy DtoD (Device -> Device)"] == {"ms": pytest.approx(0.25), "calls": 1}
    assert set(by_name) == {"_gate_up", "Memcpy DtoD (Device -> Device)"}


def test_the_mix_of_both_systems_side_by_side(tmp_path, capsys):
    """A step_profile's windows and a vLLM trace folder: categories sum to each total, shares to 1, ms per 1,000
    tokens from --tokens; the table names every category; the JSON holds both mixes."""
    prof = {"variants": [{"windows": [
        {"kernels": [{"name": "_gate_up", "self_device_ms": 6.0, "calls": 2},
                     {"name": "_rms_norm", "self_device_ms": 1.0, "calls": 4}]},
        {"kernels": [{"name": "_gate_up", "self_device_ms": 3.0, "calls": 1}], "kernel_ms_total": 3.5}]}]}
    (tmp_path / "prof.json").write_text(json.dumps(prof))
    trace = tmp_path / "vllm"
    trace.mkdir()
    (trace / "t.json").write_text(json.dumps(_trace(
        [{"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "dur": 8000.0},
         {"ph": "X", "cat": "kernel", "name": "void vllm::reshape_and_cache_flash_kernel<bf16>", "dur": 2000.0}])))
    out = tmp_path / "mix.json"
    assert km.main(["--ray-moe", str(tmp_path / "prof.json"), "--vllm-trace", str(trace), "--tokens", "2000",
                    "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    ray, vllm = doc["mixes"]["ray-moe"], doc["mixes"]["vllm"]
    # (the second window's 0.5 ms past its listed kernels: counted as "other")
    assert ray["total_ms"] == pytest.approx(10.5) and vllm["total_ms"] == pytest.approx(10.0)
    assert ray["categories"]["experts"] == {"ms": pytest.approx(9.0), "share": pytest.approx(9.0 / 10.5),
                                            "ms_per_1k_tokens": pytest.approx(4.5)}
    assert ray["categories"]["other"]["ms"] == pytest.approx(0.5)
    assert vllm["categories"]["cache_write"]["share"] == pytest.approx(0.2)
    assert sum(r["share"] for r in ray["categories"].values()) == pytest.approx(1.0)
    assert ray["top_kernels"][0]["name"] == "_gate_up" and ray["top_kernels"][0]["calls"] == 3
    text = capsys.readouterr().out
    assert all(c in text for c in ("experts", "norm", "cache_write")) and "ray-moe" in text and "vllm" in text


def test_an_empty_trace_folder_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        km.main(["--vllm-trace", str(tmp_path)])


def test_the_serving_bench_waits_for_trace_files_to_settle(tmp_path):
    """``wait_for_traces``: the files under the folder once their sizes hold still (an empty folder: none, after
    the timeout)."""
    from ray_moe_bench.serving import wait_for_traces

    (tmp_path / "w0.pt.trace.json.gz").write_bytes(b"x" * 10)
    assert wait_for_traces(str(tmp_path), timeout_s=10, settle_s=0.6) == [str(tmp_path / "w0.pt.trace.json.gz")]
    empty = tmp_path / "none"
    empty.mkdir()
    assert wait_for_traces(str(empty), timeout_s=1.0, settle_s=0.2) == []
