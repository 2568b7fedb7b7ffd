"""One Q/K/V GEMM per attention module (model/qkv.py): which modules it takes, the model's outputs with it,
the fallbacks (another input, weights replaced), restoring, and on CUDA a bf16 model against its own
projections."""

from __future__ import annotations

import pytest
import torch

from ray_moe.model import qkv
from ray_moe_dev.testing.hf_models import FAMILIES, build_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _attention(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if all(isinstance(getattr(m, n, None), torch.nn.Linear)
                                               for n in ("q_proj", "k_proj", "v_proj"))]


class _Spy:
    """Counts F.linear launches (the GEMMs a forward runs)."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = torch.nn.functional.linear

        def linear(*a, **k):
            self.calls += 1
            return real(*a, **k)

        mp.setattr(torch.nn.functional, "linear", linear)


def _cpu_fuse(model: torch.nn.Module) -> qkv.FusedQKV:
    return qkv.fuse_qkv(model, dtypes=(torch.float32,), cuda_only=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_qkv_module_is_fused_and_outputs_stay(family, monkeypatch):
    model = build_model(family, seed=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
    n = len(_attention(model))
    fused = _cpu_fuse(model)
    assert fused.modules == n  # DeepSeek's MLA has no q/k/v trio: nothing there
    if family.startswith("deepseek"):
        assert n == 0
    else:
        assert n == model.config.num_hidden_layers
    for m in _attention(model):  # one buffer: the three weights are consecutive views of it
        q, k, v = m.q_proj.weight, m.k_proj.weight, m.v_proj.weight
        assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    spy = _Spy(monkeypatch)
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fused_calls = spy.calls
    assert qkv.fuse_qkv(model, dtypes=(torch.float32,), cuda_only=False).modules == 0  # twice: nothing more
    assert qkv.unfuse_qkv(model) == n
    spy.calls = 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    assert spy.calls - fused_calls == 2 * n  # k and v ran their own GEMMs again


def test_other_inputs_and_replaced_weights_take_the_projection_forward():
    attn = _attention(build_model("qwen3_moe", seed=1))[0]
    x = torch.randn(5, attn.q_proj.in_features, generator=torch.Generator().manual_seed(0))
    want = [torch.nn.functional.linear(x, p.weight) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    _cpu_fuse(attn)
    with torch.no_grad():
        # 1. the module's order, one input: the slices of one GEMM
        got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))
        assert got[1].data_ptr() == got[0].data_ptr() + attn.q_proj.out_features * x.element_size()
        # 2. k / v of another tensor (equal values, another object): their own GEMMs
        attn.q_proj(x)
        y = x.clone()
        k_other = attn.k_proj(y)
        assert k_other.is_contiguous() and torch.allclose(k_other, want[1], rtol=1e-5, atol=1e-6)
        assert attn.v_proj(x).data_ptr() != k_other.data_ptr()  # v of x still comes from the pending GEMM
        # 3. k called twice: the second runs its own
        attn.q_proj(x)
        first, second = attn.k_proj(x), attn.k_proj(x)
        assert not first.is_contiguous() and second.is_contiguous()
        # 4. a weight replaced after fusing: every projection runs its own (with the new weight)
        attn.k_proj.weight = torch.nn.Parameter(torch.zeros_like(attn.k_proj.weight), requires_grad=False)
        attn.q_proj(x)
        assert torch.equal(attn.k_proj(x), torch.zeros(5, attn.k_proj.out_features))
        torch.testing.assert_close(attn.v_proj(x), want[2], rtol=1e-5, atol=1e-6)


def test_defaults_fuse_half_cuda_models_only():
    model = build_model("mixtral")
    assert qkv.fuse_qkv(model).modules == 0  # fp32 on CPU: the reference precision stays unfused
    assert qkv.fuse_qkv(model.to(torch.bfloat16)).modules == 0  # bf16, but not on CUDA
    assert not any("forward" in vars(m) for m in model.modules())


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_cuda_fused_model_matches_its_own_projections(family):
    model = build_model(family, seed=3).cuda().to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        want = model(ids).logits.float()
        fused = qkv.fuse_qkv(model)
        got = model(ids).logits.float()
    assert fused.modules == model.config.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
