"""FP8 checkpoints served on CUDA (issue 41's GPU tests): a tiny Qwen3-MoE and DeepSeek-V3 (MLA, grouped routing,
a shared expert, a dense first layer) written with real 128 x 128 block scales (``fp8_model``), served by a Runtime
on one GPU in float32 with the block-FP8 expert kernels and the dense projections' FP8 GEMM (``Fp8Linear``) inside
the step graphs captured at start, against transformers' own forward of the dequantized model (code x scale,
float32, on the CPU).

The FP8 path quantizes the experts' activations per 1 x 128 group (e4m3: 3 mantissa bits, ~2-3% per element),
the dequantized model does not, so the two agree within a tolerance, not bit for bit. Teacher-forced on the
served tokens (the reference's forward over prompt + served tokens: no divergence cascades):
  * each served token's logprob and its top-5 alternatives' within LOGPROB_TOL x the standard deviation of the
    reference's logprobs over the vocabulary at that position (a checkpoint served with its scales ignored is off
    by several deviations);
  * the served greedy token is the reference's argmax wherever the reference's top-1 margin exceeds twice that
    tolerance, and such positions are most of them (the comparison is not vacuous).
Run: ``python -m pytest -q -m gpu tests/model/test_fp8_checkpoints_gpu.py`` on the GPU machine."""

from __future__ import annotations

import pytest
import torch

import ray_moe
from ray_moe.model.sampling import SamplingParams
from ray_moe_dev.testing.hf_models import fp8_model

pytestmark = pytest.mark.gpu
LOGPROB_TOL = 0.1  # of the reference's logprobs' standard deviation at the position
NEW_TOKENS = 8


def _prompts(seed: int, lens) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fp8_kernels_serve_within_tolerance_of_the_dequantized_model(ray_session, tmp_path, family):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ref, folder = fp8_model(family, tmp_path / family, block=(128, 128))
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, device="cuda", dtype="float32",
                                                name=f"gpu-fp8-{family}")
    rt = ray_moe.Runtime.start(cfg)
    try:
        engine = rt.serving()
        assert not [w for w in engine.warnings if "FP8" in w], engine.warnings  # the kernels serve, no fallback
        prompts = _prompts(3, (5, 17, 2, 30, 9))
        handles = [engine.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True))
                   for p in prompts]
        served = [h.result(120) for h in handles]
        compared = positions = 0
        for p, h, toks in zip(prompts, handles, served):
            assert len(toks) == NEW_TOKENS and len(h.logprobs) == NEW_TOKENS
            with torch.no_grad():
                logits = ref(torch.tensor([p + toks])).logits[0, len(p) - 1:len(p) - 1 + NEW_TOKENS].double()
            want = torch.log_softmax(logits, dim=-1)
            for i, (tok, lp) in enumerate(zip(toks, h.logprobs)):
                sd = float(want[i].std())
                for t, v in ((tok, lp.logprob), *zip(lp.top_ids, lp.top_logprobs)):
                    err = abs(v - float(want[i, t]))
                    assert err <= LOGPROB_TOL * sd, (family, p, i, t, err, sd)
                top2 = torch.topk(want[i], 2).values
                positions += 1
                if float(top2[0] - top2[1]) > 2 * LOGPROB_TOL * sd:
                    compared += 1
                    assert tok == int(want[i].argmax()), (family, p, i, toks)
        assert compared >= 0.3 * positions, (compared, positions)
        counters = rt.shard_status()[0]["counters"]
        assert not counters.get("graphs_captured_serving"), counters
        assert counters.get("fp8_dense_modules", 0) >= 4 * ref.config.num_hidden_layers, counters  # kept in FP8
        if family == "qwen3_moe":  # (DeepSeek's MLA attends its gathered contexts eagerly, and says so)
            assert not counters.get("eager_steps") and counters.get("decode_graph_steps", 0) > 0, counters
    finally:
        rt.shutdown()
