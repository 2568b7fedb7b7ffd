"""The fused RMSNorm (models/norms.py): which layers it takes (checked per class against the layer's own
forward), restoring them, and on CUDA the kernel against the row-loop reference and the layers themselves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.model import norms
from ray_moe_dev.testing.hf_models import FAMILIES, build_model
from ray_moe_dev.testing.reference import reference_rms_norm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class OffsetRMSNorm(torch.nn.Module):
    """A Gemma-style norm, ``(1 + weight) * y``: another formula, which must keep its own forward."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(h))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1.0 + self.weight) * y.to(x.dtype)


@pytest.fixture
def cpu_kernel(monkeypatch):
    """The kernel's seam on CPU: ``available`` for any floating CPU rows of the weight's dtype and the
    row-loop reference as the kernel (the selection logic is the same on CUDA)."""
    calls = []

    def avail(x, w):
        return x.dtype == w.dtype and x.shape[-1] == w.shape[0] and x.stride(-1) == 1

    def fake(x, w, eps):
        calls.append(tuple(x.shape))
        return reference_rms_norm(x, w, eps)

    monkeypatch.setattr(norms, "available", avail)
    monkeypatch.setattr(norms, "rms_norm", fake)
    return calls


def test_reference_matches_transformers_rms_norm_in_float32_and_bfloat16():
    model = build_model("qwen3_moe")
    layer = model.model.layers[0].input_layernorm
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 1.5, layer.weight.numel()))
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -7)):
            layer.to(dtype)
            x = torch.randn(5, layer.weight.numel(), generator=torch.Generator().manual_seed(0)).to(dtype)
            torch.testing.assert_close(reference_rms_norm(x, layer.weight, layer.variance_epsilon), layer(x),
                                       rtol=tol, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_norm_is_taken_and_outputs_stay(cpu_kernel, family):
    model = build_model(family, seed=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
    expected = sum(1 for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
    fused = norms.fuse_rms_norms(model)
    assert expected > 0 and fused.modules == expected, fused
    assert fused.skipped == {}
    cpu_kernel.clear()
    with torch.no_grad():
        got = model(ids).logits
    assert len(cpu_kernel) >= model.config.num_hidden_layers * 2  # the layers really took the "kernel"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # fusing twice changes nothing; unfusing gives every layer its own forward back
    assert norms.fuse_rms_norms(model).modules == 0
    assert norms.unfuse_rms_norms(model) == expected
    cpu_kernel.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
    assert cpu_kernel == []


def test_another_formula_keeps_its_forward(cpu_kernel):
    net = torch.nn.Sequential(OffsetRMSNorm(16), build_model("mixtral").model.norm)
    fused = norms.fuse_rms_norms(net)
    assert fused.modules == 1 and fused.classes == ("MixtralRMSNorm",)
    assert set(fused.skipped) == {"OffsetRMSNorm"} and "another formula" in fused.skipped["OffsetRMSNorm"]
    assert "forward" not in vars(net[0]) and "forward" in vars(net[1])


def test_inputs_the_kernel_cannot_take_use_the_layer_forward(cpu_kernel):
    layer = build_model("qwen3_moe").model.norm
    norms.fuse_rms_norms(layer)
    x = torch.randn(4, 6, layer.weight.numel())
    cpu_kernel.clear()
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # last dim not contiguous
    with torch.no_grad():
        torch.testing.assert_close(layer(strided), layer.__class__.forward(layer, strided), rtol=0, atol=0)
        layer(x.double())  # another dtype than the weight's
    assert cpu_kernel == []
    with torch.no_grad():
        layer(x)
    assert cpu_kernel == [tuple(x.shape)]


def test_on_cpu_nothing_is_replaced_and_the_kernel_refuses_by_name():
    model = build_model("qwen3_moe")
    fused = norms.fuse_rms_norms(model)
    assert fused.modules == 0 and "Qwen3MoeRMSNorm" in fused.skipped
    assert not any("forward" in vars(m) for m in model.modules())
    with pytest.raises(ValueError, match="x: .*fused RMSNorm takes CUDA rows"):
        norms.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(0, 64), (1, 128), (37, 96), (3, 5, 128), (257, 2048), (9, 7168)])
def test_cuda_kernel_matches_the_reference(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).cuda()
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).cuda()
    got = norms.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    want = reference_rms_norm(x.cpu(), w.cpu(), 1e-6)
    rtol = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 1e-5}[dtype]  # two ulps
    torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=1e-6)
    if x.numel() and dtype != torch.float32:  # almost every element bit-identical after the rounding to
        assert (got.cpu() == want).float().mean() > 0.97  # bf16 / fp16 (the sum order differs from a row loop)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_reads_head_slices_of_a_wider_projection_in_place(dtype):
    """The K slice of a fused Q/K/V output viewed as heads ([1, T, Hk, D], rows 5120 wide), a transposed
    tensor (read in place) and one whose leading dims do not merge (copied first): each as its contiguous
    copy's result."""
    g = torch.Generator().manual_seed(5)
    y = (torch.randn(1, 37, 40 * 128, generator=g) * 3).to(dtype).cuda()
    w = (torch.rand(128, generator=g) + 0.5).to(dtype).cuda()
    k = y[..., 32 * 128:36 * 128].view(1, 37, 4, 128)
    assert not k.is_contiguous()
    got = norms.rms_norm(k, w, 1e-6)
    assert got.is_contiguous() and got.shape == k.shape
    assert torch.equal(got, norms.rms_norm(k.contiguous(), w, 1e-6))
    t = y.view(37, 40, 128).transpose(0, 1)  # [40, 37, 128]: rows of stride 5120 inside, 128 outside
    assert torch.equal(norms.rms_norm(t, w, 1e-6), norms.rms_norm(t.contiguous(), w, 1e-6))
    u = y.view(37, 40, 128)[:24].view(4, 6, 40, 128).transpose(0, 1)[:, :, :5]  # leading dims do not merge
    assert torch.equal(norms.rms_norm(u, w, 1e-6), norms.rms_norm(u.contiguous(), w, 1e-6))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_cuda_fused_model_matches_its_own_norms(family):
    model = build_model(family, seed=3).cuda().to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        want = model(ids).logits.float()
        fused = norms.fuse_rms_norms(model)
        got = model(ids).logits.float()
    assert fused.modules == sum(1 for m in model.modules() if type(m).__name__.endswith("RMSNorm")), fused
    assert fused.skipped == {}
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 4), h=st.integers(1, 40), scale=st.floats(1e-3, 1e3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2 ** 16))
def test_reference_matches_the_transformers_norm_for_any_width(rows, h, scale, dtype, seed):
    """The oracle itself: within two ulps of transformers' own RMSNorm layer for any width, scale and dtype."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    g = torch.Generator().manual_seed(seed)
    layer = Qwen3MoeRMSNorm(h, eps=1e-6).to(dtype)
    with torch.no_grad():
        layer.weight.copy_((torch.rand(h, generator=g) + 0.5).to(dtype))
    x = (torch.randn(rows, h, generator=g) * scale).to(dtype)
    rtol = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 1e-5}[dtype]
    with torch.no_grad():
        torch.testing.assert_close(reference_rms_norm(x, layer.weight, 1e-6), layer(x), rtol=rtol, atol=1e-6)
