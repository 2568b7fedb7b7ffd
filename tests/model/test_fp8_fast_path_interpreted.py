"""The FP8 serving path's logic against its naive reference, on the CPU: the block-FP8 Triton kernels (experts and
dense projections) run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, else skipped: the README's second
pytest), the start's gates forced open (on a CPU they say "device cpu" and dequantize), a tiny Qwen3-MoE and
DeepSeek-V3 FP8 checkpoint served in float32 by one in-process rank through the driver's generation loop, teacher-forced against
``fp8_activations`` (transformers' forward of the dequantized model with every FP8 GEMM's input quantized as the
kernels quantize it). Measured (session 22): within 1.3e-6 standard deviations of the reference's logprobs at every
position (the dequantized model: a median 0.17 / 0.19 away), so what the GPU test finds beyond that (a median
0.03 / 0.06 on an H100) is the GPU's float32 numerics, not the path's arithmetic."""

from __future__ import annotations

import os

import pytest
import torch

import ray_moe
from ray_moe.driver.loop import GenerationLoop
from ray_moe.model.sampling import SamplingParams
from ray_moe_dev.testing.fp8_reference import eager_experts, fp8_activations, fp8_dense_modules, quantized_inputs
from ray_moe_dev.testing.hf_models import fp8_model
from ray_moe_dev.testing.inprocess import InProcessDeployment, LocalTransport

pytestmark = pytest.mark.triton  # its Triton kernels also run under the CPU interpreter (TRITON_INTERPRET=1)

NEW_TOKENS = 5
TOL = 1e-4  # deviations of the reference's logprobs (float32 end to end: measured <= 1.3e-6)


@pytest.fixture
def kernels_forced(monkeypatch):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the FP8 kernels run on CPU under Triton's interpreter: set TRITON_INTERPRET=1 for pytest")
    import ray_moe.model.fp8_linear as fp8_linear
    import ray_moe.moe.experts.runners.fp8 as fp8_runner
    import ray_moe.shard.core as shard_core
    from ray_moe.moe.experts.runners import fp8_kernels

    fp8_kernels._kernels.cache_clear()
    for module, name in ((fp8_linear, "fp8_linear_reason"), (fp8_runner, "fast_path_reason"),
                         (shard_core, "fast_path_reason")):
        monkeypatch.setattr(module, name, lambda *a, **k: None)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_fp8_path_computes_the_fp8_arithmetic(kernels_forced, tmp_path, family):
    ref, folder = fp8_model(family, tmp_path / family, block=(128, 128))
    eager_experts(ref)
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, name=f"interp-{family}"))
    transport = LocalTransport(dep)
    loop = GenerationLoop(transport, device="cpu", kv_tokens=512, block_size=8, step_tokens=64)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 17, 2, 9)]
    try:
        handles = [loop.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True))
                   for p in prompts]
        served = [h.result(600) for h in handles]
        dense = dep.cores[0].generator.host.fp8_dense["paths"]
    finally:
        loop.close()
        transport.close()
    assert dense == sorted(fp8_dense_modules(ref))  # every swappable projection computed by the FP8 kernel
    worst, away = 0.0, []
    for p, h, toks in zip(prompts, handles, served):
        ids = torch.tensor([p + toks])
        with torch.no_grad():
            deq = torch.log_softmax(ref(ids).logits[0, len(p) - 1:len(p) - 1 + NEW_TOKENS].double(), -1)
            with fp8_activations(ref, (128, 128), dense=quantized_inputs(dense)):
                arith = torch.log_softmax(ref(ids).logits[0, len(p) - 1:len(p) - 1 + NEW_TOKENS].double(), -1)
        for i, (tok, lp) in enumerate(zip(toks, h.logprobs)):
            which = [tok, *lp.top_ids]
            got = torch.tensor([lp.logprob, *lp.top_logprobs], dtype=torch.float64)
            worst = max(worst, float((got - arith[i, which]).abs().max() / arith[i].std()))
            away.append(float((got - deq[i, which]).abs().max() / deq[i].std()))
            top2 = torch.topk(arith[i], 2).values
            if float(top2[0] - top2[1]) > 2 * TOL * float(arith[i].std()):
                assert tok == int(arith[i].argmax()), (family, p, i, toks)
    assert worst < TOL, worst
    assert float(torch.tensor(away).median()) > 100 * TOL  # the FP8 activations were there: the check can fail
