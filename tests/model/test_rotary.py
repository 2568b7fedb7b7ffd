"""The fused rotary embedding (models/rotary.py): which modeling modules take it (checked against their own
``apply_rotary_pos_emb``), putting them back, and on CUDA the kernel bit-identical to transformers' rotary."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.env import triton_interpreted
from ray_moe.model import rotary
from ray_moe_dev.testing.hf_models import FAMILIES, build_model
from ray_moe_dev.testing.reference import reference_rope

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rotary_of(model):
    return {type(m).__module__ for m in model.modules() if "Attention" in type(m).__name__
            and callable(getattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb", None))}


@pytest.fixture
def cpu_kernel(monkeypatch):
    """The kernel's seam on CPU: ``available`` for CPU operands of one dtype and the row-loop reference as
    the kernel (the selection logic is the same on CUDA). Every replaced function is put back afterwards."""
    calls = []

    def avail(q, k, cos, sin, unsqueeze_dim=1):
        return unsqueeze_dim == 1 and q.dim() == 4 and cos.dim() == 3 and q.dtype == cos.dtype and q.shape[-1] % 2 == 0

    def fake(q, k, cos, sin):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return reference_rope(q, cos, sin), reference_rope(k, cos, sin)

    monkeypatch.setattr(rotary, "available", avail)
    monkeypatch.setattr(rotary, "rope", fake)
    patched = []
    yield calls, patched
    for model in patched:
        rotary.unfuse_rotary(model)


def test_reference_matches_transformers_rotary():
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 5, 3, 8, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(2, 5, 1, 8, generator=g).to(dtype).transpose(1, 2)
        ang = torch.randn(2, 5, 4, generator=g)
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
        wq, wk = m.apply_rotary_pos_emb(q, k, cos, sin)
        torch.testing.assert_close(reference_rope(q, cos, sin), wq, rtol=0, atol=0)
        torch.testing.assert_close(reference_rope(k, cos, sin), wk, rtol=0, atol=0)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "deepseek_v2"])
def test_every_family_rotary_is_taken_and_outputs_stay(cpu_kernel, family):
    calls, patched = cpu_kernel
    model = build_model(family, seed=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
    fused = rotary.fuse_rotary(model, torch.device("cpu"), torch.float32)
    patched.append(model)
    assert fused.modules == tuple(sorted(_rotary_of(model))) and fused.skipped == {}, fused
    with torch.no_grad():
        got = model(ids).logits
    assert len(calls) >= 1  # the attention really took the "kernel"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rotary.fuse_rotary(model, torch.device("cpu"), torch.float32).modules == fused.modules  # idempotent
    assert rotary.unfuse_rotary(model) == len(fused.modules)
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
    assert calls == []


def test_deepseek_v2_has_its_own_rotary_and_keeps_it(cpu_kernel):
    model = build_model("deepseek_v2")
    assert rotary.fuse_rotary(model, torch.device("cpu"), torch.float32).modules == ()


def test_another_formula_keeps_its_own(cpu_kernel, monkeypatch):
    from transformers.models.mixtral import modeling_mixtral as m

    calls, patched = cpu_kernel

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # a different rotation: the check must refuse it
        return q * cos.unsqueeze(1), k * cos.unsqueeze(1)

    monkeypatch.setattr(m, "apply_rotary_pos_emb", interleaved)
    model = build_model("mixtral")
    fused = rotary.fuse_rotary(model, torch.device("cpu"), torch.float32)
    assert fused.modules == () and "another formula" in fused.skipped[m.__name__]
    assert m.apply_rotary_pos_emb is interleaved


def test_a_kernel_that_fails_here_keeps_its_own(cpu_kernel, monkeypatch):
    """A kernel that does not compile or run on the device: the check says so, and the model keeps its rotary."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    def broken(q, k, cos, sin):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(rotary, "rope", broken)
    before = m.apply_rotary_pos_emb
    fused = rotary.fuse_rotary(build_model("qwen3_moe"), torch.device("cpu"), torch.float32)
    assert fused.modules == () and "the kernel failed here: RuntimeError" in fused.skipped[m.__name__]
    assert m.apply_rotary_pos_emb is before


def test_on_cpu_nothing_is_replaced_and_the_kernel_refuses_by_name():
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    before = m.apply_rotary_pos_emb
    fused = rotary.fuse_rotary(build_model("qwen3_moe"), torch.device("cpu"), torch.float32)
    assert fused.modules == () and "not taken" in fused.skipped[m.__name__]
    assert m.apply_rotary_pos_emb is before
    with pytest.raises(ValueError, match="q: .*fused rotary takes CUDA"):
        rotary.rope(torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 3, 8), torch.zeros(1, 3, 8), torch.zeros(1, 3, 8))


def _operands(b, hq, hk, t, d, dtype, device, per_batch=False, k_layout="bthd"):
    """q [B, Hq, T, D] (a [B, T, H, D] buffer's view), k [B, Hk, T, D] (the same layout, or dense ``bhtd``), cos /
    sin [B or 1, T, D] of angles up to ~30 radians."""
    g = torch.Generator().manual_seed(t + d)
    q = torch.randn(b, t, hq, d, generator=g).to(dtype).to(device).transpose(1, 2)
    k = (torch.randn(b, t, hk, d, generator=g).to(dtype).to(device).transpose(1, 2) if k_layout == "bthd"
         else torch.randn(b, hk, t, d, generator=g).to(dtype).to(device))
    ang = torch.randn(b if per_batch else 1, t, d // 2, generator=g) * 10
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dtype).to(device) for f in (torch.cos, torch.sin))
    return q, k, cos, sin


def _is_transformers_rotary(q, k, cos, sin):
    """The kernel's (q, k) against transformers' own function: bit for bit in 16-bit dtypes, 1e-6 in FP32, each
    output keeping its input's layout."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    original = getattr(m.apply_rotary_pos_emb, "__wrapped__", m.apply_rotary_pos_emb)
    want = original(q, k, cos, sin)
    got = rotary.rope(q, k, cos, sin)
    tol = dict(rtol=0, atol=0) if q.dtype != torch.float32 else dict(rtol=1e-6, atol=1e-6)
    for a, w in zip(got, want):
        assert a.shape == w.shape and a.dtype == w.dtype
        torch.testing.assert_close(a, w, **tol)
    assert got[0].stride() == q.stride() and got[1].stride() == k.stride()
    return got


@pytest.mark.triton  # under Triton's CPU interpreter only (TRITON_INTERPRET=1): one launch for query and key
@pytest.mark.skipif(not triton_interpreted(), reason="set TRITON_INTERPRET=1 for pytest")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # (the interpreter truncates to bf16: CUDA only)
@pytest.mark.parametrize("b,hq,hk,t,d,per_batch", [(1, 32, 4, 5, 128, False), (2, 80, 3, 3, 256, True),
                                                   (1, 2, 7, 2, 64, False), (1, 4, 2, 0, 128, False)])
def test_interpreted_kernel_is_transformers_rotary(dtype, b, hq, hk, t, d, per_batch):
    """The query's head blocks and the key's in one grid (80 + 3 heads of 256: three query blocks and one key block;
    more key heads than query heads), cos / sin per batch or broadcast, the key in another layout than the query."""
    _is_transformers_rotary(*_operands(b, hq, hk, t, d, dtype, "cpu", per_batch, k_layout="bhtd"))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,hq,hk,t,d", [(1, 32, 4, 37, 128), (2, 3, 1, 5, 64), (1, 16, 16, 1, 96), (1, 4, 2, 0, 128),
                                         (2, 80, 3, 3, 256)])
def test_cuda_kernel_is_transformers_rotary(dtype, b, hq, hk, t, d):
    q, k, cos, sin = _operands(b, hq, hk, t, d, dtype, "cuda")
    got = _is_transformers_rotary(q, k, cos, sin)
    if t and dtype != torch.float32:  # and the row-loop oracle, bit for bit
        torch.testing.assert_close(got[1].cpu(), reference_rope(k.cpu(), cos.cpu(), sin.cpu()), rtol=0, atol=0)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_cuda_fused_model_is_bit_identical(family):
    model = build_model(family, seed=3).cuda().to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(4)).cuda()
    try:
        with torch.no_grad():
            want = model(ids).logits
            fused = rotary.fuse_rotary(model, torch.device("cuda"), torch.bfloat16)
            got = model(ids).logits
        assert fused.modules and fused.skipped == {}, fused
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        rotary.unfuse_rotary(model)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 4), t=st.integers(1, 5), half=st.integers(1, 8),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2 ** 16))
def test_reference_is_transformers_rotary_for_any_shape(b, h, t, half, dtype, seed):
    """The oracle itself: bit-identical to transformers' apply_rotary_pos_emb for any shape and dtype."""
    from transformers.models.mixtral import modeling_mixtral as m

    g = torch.Generator().manual_seed(seed)
    d = 2 * half
    q = (torch.randn(b, t, h, d, generator=g) * 4).to(dtype).transpose(1, 2)
    ang = torch.randn(b, t, half, generator=g) * 20
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    original = getattr(m.apply_rotary_pos_emb, "__wrapped__", m.apply_rotary_pos_emb)
    want, _ = original(q, q[:, :1], cos, sin)
    torch.testing.assert_close(reference_rope(q, cos, sin), want, rtol=0, atol=0)
