"""Dense FP8 Linears (``model/fp8_linear.py``): an FP8 checkpoint's attention projections kept as codes and block
scales in ``Fp8Linear`` modules where the dense kernel serves (``fp8_dense``), dequantized at load elsewhere.

On CPU (CI): the load itself: which modules are swapped (the swappable projections only; routers, norms and
embeddings never), their codes and scales equal to the checkpoint's bit for bit, a bias kept, the module bytes
smaller, the kernel fusions (CUDA only) leaving them alone on a CPU, and the automatic choice on a CPU keeping the dequantized modules with
the reason. Under Triton's CPU interpreter (``TRITON_INTERPRET=1 python -m pytest tests/model/test_fp8_linear.py``;
skipped without it): the kernel against ``fp8_linear_reference`` and every swapped module against the dequantized
Linear of the same checkpoint within the FP8 activation tolerance. On CUDA: ``test_fp8_checkpoints_gpu.py``."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from ray_moe.model.fp8_linear import Fp8Linear, fp8_linear_reason, fp8_linear_reference
from ray_moe.model.host import ModelHost
from ray_moe.moe.experts.fp8 import quantize
from ray_moe.moe.experts.runners import fp8_kernels
from ray_moe_dev.testing.hf_models import fp8_model

pytestmark = pytest.mark.triton  # its Triton kernels also run under the CPU interpreter (TRITON_INTERPRET=1)

BLOCK = (32, 32)  # the kernels take K blocks of 32 / 64 / 128 (the tiny models' hidden size is 32)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return fp8_model("qwen3_moe", tmp_path_factory.mktemp("fp8lin") / "q3", block=BLOCK, sharded=True)


def _checkpoint(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def test_the_swappable_projections_keep_their_codes_and_scales(qwen):
    ref, folder = qwen
    kept = ModelHost.from_checkpoint(folder, kv_tokens=64, fp8_dense=True)
    plain = ModelHost.from_checkpoint(folder, kv_tokens=64, fp8_dense=False)
    state = _checkpoint(folder)
    swapped = {n: m for n, m in kept.model.named_modules() if isinstance(m, Fp8Linear)}
    layers = ref.config.num_hidden_layers
    assert kept.fp8_dense["modules"] == len(swapped) == 4 * layers  # q, k, v, o of every layer
    assert kept.fp8_dense["paths"] == sorted(swapped)
    assert {n.rpartition(".")[2] for n in swapped} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for name, mod in swapped.items():
        key = f"{name}.weight"
        assert torch.equal(mod.codes.view(torch.uint8), state[key].view(torch.uint8))
        assert torch.equal(mod.scale_inv, state[f"{key}_scale_inv"].float()) and mod.block == BLOCK
        dense = plain.model.get_submodule(name)
        assert type(dense) is torch.nn.Linear and dense.weight.dtype == torch.float32
    assert not any(isinstance(m, Fp8Linear) for m in plain.model.modules()) and plain.fp8_dense["modules"] == 0
    # routers, norms, embeddings and the head stay dense (the router is bf16 in the checkpoint anyway)
    heads = [m for n, m in kept.model.named_modules() if n.endswith(("mlp.gate", "lm_head"))]
    assert len(heads) == layers + 1 and not any(isinstance(m, Fp8Linear) for m in heads)
    saved = sum(4 * m.codes.numel() - m.codes.numel() - 4 * m.scale_inv.numel() for m in swapped.values())
    assert plain.memory()["module_bytes"] - kept.memory()["module_bytes"] == saved
    kept.fuse_kernels()  # on a CPU nothing is fused (CUDA only): the swapped modules stay as loaded
    assert kept.qkv.modules == 0 and swapped["model.layers.0.self_attn.q_proj"] is kept.model.get_submodule(
        "model.layers.0.self_attn.q_proj")


def test_a_bias_travels_with_the_codes(tmp_path):
    ref, folder = fp8_model("qwen3_moe", tmp_path / "q3", block=BLOCK)
    lin = torch.nn.Linear(32, 64, bias=True)
    codes, scales = quantize(lin.weight.detach(), BLOCK)
    mod = Fp8Linear(codes, scales, BLOCK, lin.bias.detach())
    assert mod.bias is not None and torch.equal(mod.bias, lin.bias.detach()) and "block=[32, 32]" in repr(mod)


def test_on_a_cpu_the_automatic_choice_dequantizes_and_says_why(qwen):
    _, folder = qwen
    host = ModelHost.from_checkpoint(folder, kv_tokens=64)
    assert host.fp8_dense["modules"] == 0 and not any(isinstance(m, Fp8Linear) for m in host.model.modules())
    assert set(host.fp8_dense["reasons"].values()) == {"device cpu: the FP8 dense kernels need CUDA"}
    assert "K blocks" in fp8_linear_reason("cuda", torch.bfloat16, 64, 64, (128, 16))


# ------------------------------------------------------------------ the kernel: on a GPU, or under Triton's CPU interpreter
@pytest.fixture(params=[pytest.param("cpu", id="interpreter"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def device(request):
    """``cpu``: Triton's interpreter (``TRITON_INTERPRET=1``, else skipped); ``cuda``: the compiled kernel."""
    pytest.importorskip("triton")
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the FP8 dense kernel runs on CPU under Triton's interpreter: set TRITON_INTERPRET=1 for pytest")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    fp8_kernels._kernels.cache_clear()
    return torch.device(request.param)


@pytest.mark.parametrize("out_f,in_f,block,rows", [(200, 136, (128, 128), 37), (64, 96, (32, 64), 1),
                                                    (256, 128, (128, 128), 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_matches_its_reference(device, out_f, in_f, block, rows, dtype):
    g = torch.Generator().manual_seed(out_f + rows)
    codes, scales = quantize(torch.randn(out_f, in_f, generator=g) / in_f ** 0.5, block)
    codes, scales = codes.to(device), scales.to(device)
    x = (torch.randn(rows, in_f, generator=g) * 3).to(device=device, dtype=dtype)
    got, want = fp8_kernels.fp8_linear(x, codes, scales, block), fp8_linear_reference(x, codes, scales, block)
    assert got.dtype == dtype and got.shape == (rows, out_f)
    tol = 1e-2 if dtype == torch.float32 else 2e-2
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < tol
    assert fp8_kernels.fp8_linear(x[:0], codes, scales, block).shape == (0, out_f)
    with pytest.raises(ValueError, match="x: expected"):
        fp8_kernels.fp8_linear(x[:, :-1], codes, scales, block)


def test_swapped_modules_compute_what_the_dequantized_ones_do(device, qwen):
    _, folder = qwen
    kept = ModelHost.from_checkpoint(folder, device=device, kv_tokens=64, fp8_dense=True)
    plain = ModelHost.from_checkpoint(folder, device=device, kv_tokens=64, fp8_dense=False)
    g = torch.Generator().manual_seed(3)
    swapped = 0
    for name, mod in kept.model.named_modules():
        if isinstance(mod, Fp8Linear):
            swapped += 1
            dense = plain.model.get_submodule(name)
            xi = torch.randn(2, 5, mod.in_features, generator=g).to(device)
            with torch.no_grad():
                got, want = mod(xi), dense(xi)
            assert got.shape == want.shape
            # activations quantized per 1 x 32 group (e4m3): within a few percent of the dequantized Linear
            assert float((got - want).norm() / want.norm()) < 6e-2, name
    assert swapped > 0
