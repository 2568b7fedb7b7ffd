"""The FP8 arithmetic reference (``ray_moe_dev.testing.fp8_reference``) the GPU test compares the served FP8 path
with: its module list is what ``ModelHost`` swaps to ``Fp8Linear``, each such Linear computes
``fp8_linear_reference`` inside it, every routed expert's GEMM input is quantized, the LM head and routers are
untouched, and ``F.linear`` is restored on exit."""

from __future__ import annotations

import pytest
import torch

from ray_moe.model.fp8_linear import Fp8Linear, fp8_linear_reference
from ray_moe.model.host import ModelHost
from ray_moe_dev.testing.fp8_reference import eager_experts, fp8_activations, fp8_dense_modules
from ray_moe_dev.testing.hf_models import fp8_model

BLOCK = (32, 32)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_module_list_is_what_the_host_swaps(tmp_path, family):
    ref, folder = fp8_model(family, tmp_path / family, block=BLOCK)
    host = ModelHost.from_checkpoint(folder, kv_tokens=64, fp8_dense=True)
    swapped = sorted(n for n, m in host.model.named_modules() if isinstance(m, Fp8Linear))
    assert swapped == sorted(fp8_dense_modules(ref)) and host.fp8_dense["modules"] == len(swapped) > 0


def test_a_dense_projection_computes_the_kernel_contract_and_the_rest_is_untouched(tmp_path):
    ref, folder = fp8_model("qwen3_moe", tmp_path / "q3", block=BLOCK)
    eager_experts(ref)
    host = ModelHost.from_checkpoint(folder, kv_tokens=64, fp8_dense=True)
    name = "model.layers.1.self_attn.o_proj"
    lin, fp8 = ref.get_submodule(name), host.model.get_submodule(name)
    x = torch.randn(7, lin.in_features, generator=torch.Generator().manual_seed(0)) * 3
    plain = torch.nn.functional.linear
    with torch.no_grad(), fp8_activations(ref, BLOCK):
        got = lin(x)
        head = ref.lm_head(x[:, :ref.config.hidden_size])
    assert torch.nn.functional.linear is plain
    want = fp8_linear_reference(x, fp8.codes, fp8.scale_inv, BLOCK)  # the dequantized weight is code x scale
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, lin(x), rtol=1e-3, atol=1e-4)  # the activations were quantized
    assert torch.equal(head, ref.lm_head(x[:, :ref.config.hidden_size]))


def test_the_routed_experts_inputs_are_quantized(tmp_path):
    ref, _ = fp8_model("qwen3_moe", tmp_path / "q3", block=BLOCK)
    eager_experts(ref)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    seen: list[torch.Tensor] = []
    experts = ref.model.layers[0].mlp.experts
    handle = experts.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        with torch.no_grad():
            with fp8_activations(ref, BLOCK, dense=[]):  # experts only
                ref(ids)
            ref(ids)
    finally:
        handle.remove()
    quantized, plain = seen
    assert quantized.shape == plain.shape and not torch.allclose(quantized, plain, rtol=1e-3, atol=1e-5)
    assert float((quantized - plain).norm() / plain.norm()) < 0.1  # e4m3 activations: a few percent
