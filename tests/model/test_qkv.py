"""One Q/K/V GEMM per attention module (model/qkv.py): which modules it takes, the model's outputs with it,
the fallbacks (another input, weights replaced), restoring, and on CUDA a bf16 model against its own
projections. FP8 trios (``Fp8Linear``): on CPU with ``fp8_kernels.fp8_linear`` patched to a counting
``fp8_linear_reference`` (one kernel call instead of three, outputs bit-equal, the buffers views of one storage,
the fallbacks, which trios stay unfused, a tiny FP8 checkpoint's logits and bytes unchanged); on CUDA the real
kernel fused against unfused."""

from __future__ import annotations

import types

import pytest
import torch

from ray_moe.model import qkv
from ray_moe.model.fp8_linear import Fp8Linear, fp8_linear_reference
from ray_moe.model.host import ModelHost
from ray_moe.model.kv import SeqChunk
from ray_moe.model.source import HFWeightSource
from ray_moe.moe.experts.fp8 import quantize
from ray_moe.moe.experts.runners import fp8_kernels
from ray_moe_dev.testing.hf_models import FAMILIES, build_model, fp8_model
from ray_moe_dev.testing.local_executor import LocalExecutor

pytestmark = pytest.mark.triton  # its Triton kernels also run under the CPU interpreter (TRITON_INTERPRET=1)

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


# ------------------------------------------------------------------ FP8 trios (Fp8Linear projections)
BLOCK = (128, 128)


class _Fp8Attention(torch.nn.Module):
    """q_proj / k_proj / v_proj ``Fp8Linear`` [out, d] of seeded random weights quantized in ``blocks`` (one per
    projection); forward: x [..., d] -> (q [..., nq], k [..., nk], v [..., nv]) in x's dtype, called in that order."""

    def __init__(self, outs=(256, 128, 128), d=256, blocks=(BLOCK,) * 3, bias=False, seed=0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, n, block in zip(("q_proj", "k_proj", "v_proj"), outs, blocks):
            codes, scales = quantize(torch.randn(n, d, generator=g) / d ** 0.5, block)
            setattr(self, name, Fp8Linear(codes, scales, block, torch.randn(n, generator=g) if bias else None))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


@pytest.fixture
def kernel(monkeypatch) -> list[tuple[int, int]]:
    """``fp8_kernels.fp8_linear`` replaced by ``fp8_linear_reference``; the list records each call's codes shape."""
    calls: list[tuple[int, int]] = []

    def fp8_linear(x, codes, scales, block):
        calls.append(tuple(codes.shape))
        return fp8_linear_reference(x, codes, scales, block)

    monkeypatch.setattr(fp8_kernels, "fp8_linear", fp8_linear)
    return calls


def _x(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def _storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages under ``module``'s buffers (as ``ModelHost.memory`` counts them)."""
    return sum({b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in module.buffers()}.values())


@pytest.mark.parametrize("outs", [(256, 128, 128), (256, 128, 200)], ids=["whole", "v-partial-block"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape,dtype", [((7, 256), torch.float32), ((2, 5, 256), torch.float32),
                                         ((2, 5, 256), torch.bfloat16)], ids=["2d", "3d", "3d-bf16"])
def test_fp8_trio_runs_one_kernel_with_the_same_outputs(kernel, outs, bias, shape, dtype):
    attn = _Fp8Attention(outs, bias=bias)
    x = _x(shape, dtype)
    with torch.no_grad():
        want = attn(x)
    assert kernel == [(n, 256) for n in outs]
    before = _storage_bytes(attn)
    fused = qkv.fuse_qkv(attn, dtypes=(), cuda_only=False)  # dtypes: n/a
    assert fused == qkv.FusedQKV(modules=1, fp8_modules=1, fp8_shapes=((sum(outs), 256, BLOCK),))
    assert all(qkv.is_fused(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    # one buffer each for the codes, the scales (and the biases): the modules' buffers are consecutive views
    for name in ("codes", "scale_inv", *(("bias",) if bias else ())):
        bq, bk, bv = (getattr(p, name) for p in (q, k, v))
        assert bq.untyped_storage().data_ptr() == bk.untyped_storage().data_ptr() == bv.untyped_storage().data_ptr()
        assert bk.data_ptr() == bq.data_ptr() + bq.numel() * bq.element_size()
        assert bv.data_ptr() == bk.data_ptr() + bk.numel() * bk.element_size()
    assert tuple(v.scale_inv.shape) == (-(-outs[2] // BLOCK[0]), 2) and q.codes.shape == (256, 256)
    assert _storage_bytes(attn) == before  # no second copy: the same resident bytes
    kernel.clear()
    with torch.no_grad():
        got = attn(x)
    assert kernel == [(sum(outs), 256)]  # one GEMM for the three
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype  # x's dtype (promoted by a float32 bias, as unfused)
        assert torch.equal(g, w)  # the reference computes each output column alone: bit-equal
    assert qkv.fuse_qkv(attn, cuda_only=False).modules == 0  # twice: nothing more


def test_fp8_other_inputs_and_replaced_buffers_take_the_projection_forward(kernel):
    attn = _Fp8Attention()
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    x = _x((5, 256))
    with torch.no_grad():
        want = attn(x)
    qkv.fuse_qkv(attn, cuda_only=False)
    with torch.no_grad():
        # another tensor of equal values: k runs its own GEMM; v of x still comes from the pending one
        kernel.clear()
        q(x)
        k_other = k(x.clone())
        assert torch.equal(k_other, want[1]) and torch.equal(v(x), want[2])
        assert kernel == [(512, 256), (128, 256)]
        # k called twice: the second runs its own
        kernel.clear()
        q(x)
        assert torch.equal(k(x), want[1]) and torch.equal(k(x), want[1]) and kernel == [(512, 256), (128, 256)]
        # v without q before it: its own
        kernel.clear()
        assert torch.equal(v(_x((5, 256))), want[2]) and kernel == [(128, 256)]
        # a scale grid replaced (same values, another tensor): every projection runs its own
        k.scale_inv = k.scale_inv.clone()
        kernel.clear()
        assert all(torch.equal(a, b) for a, b in zip(attn(x), want))
        assert kernel == [(256, 256), (128, 256), (128, 256)]
        # codes replaced by zeros: k computes with its new codes
        k.codes = torch.zeros_like(k.codes)
        got = attn(x)
        assert torch.equal(got[1], torch.zeros(5, 128)) and torch.equal(got[0], want[0])
        assert torch.equal(got[2], want[2])


def test_fp8_unfuse_restores_the_three_gemms(kernel):
    attn = _Fp8Attention(bias=True)
    x = _x((3, 4, 256))
    with torch.no_grad():
        want = attn(x)
        assert qkv.fuse_qkv(attn, cuda_only=False).fp8_modules == 1
        kernel.clear()
        attn(x)
        assert len(kernel) == 1
        bias = attn.v_proj.bias
        attn.v_proj.bias = bias + 1  # a bias replaced: the projections run their own (the new bias)
        kernel.clear()
        got = attn(x)
        assert len(kernel) == 3 and torch.equal(got[0], want[0])
        torch.testing.assert_close(got[2], want[2] + 1, rtol=1e-6, atol=1e-6)
        attn.v_proj.bias = bias  # the view again: fused again
        kernel.clear()
        attn(x)
        assert len(kernel) == 1
        assert qkv.unfuse_qkv(attn) == 1
        assert not any("forward" in vars(m) for m in attn.modules())
        kernel.clear()
        got = attn(x)
    assert kernel == [(256, 256), (128, 256), (128, 256)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the views hold the same values


@pytest.mark.parametrize("attn", [
    _Fp8Attention(outs=(192, 128, 128)),  # q not whole blocks of rows: its scale rows would not concatenate
    _Fp8Attention(outs=(256, 64, 64)),  # k neither
    _Fp8Attention(blocks=(BLOCK, (64, 128), (64, 128))),  # mixed blocks
    _Fp8Attention(blocks=(BLOCK, BLOCK, (128, 64))),
], ids=["q-partial", "k-partial", "mixed-rows", "mixed-columns"])
def test_fp8_trios_that_cannot_concatenate_stay_unfused(attn):
    assert qkv.fuse_qkv(attn, cuda_only=False) == qkv.FusedQKV()
    assert not any("forward" in vars(m) for m in attn.modules())


def test_fp8_mixed_kinds_hooks_and_cpu_default_stay_unfused():
    attn = _Fp8Attention()
    assert qkv.fuse_qkv(attn).modules == 0  # cuda_only=True (the default) on a CPU: nothing
    attn.v_proj = torch.nn.Linear(256, 128, bias=False)  # one dense projection among FP8 ones
    assert qkv.fuse_qkv(attn, dtypes=(torch.float32,), cuda_only=False).modules == 0
    hooked = _Fp8Attention()
    hooked.k_proj.register_forward_hook(lambda *a: None)
    biased = _Fp8Attention()
    biased.v_proj.bias = torch.zeros(128)  # biases not all present
    for m in (hooked, biased):
        assert qkv.fuse_qkv(m, cuda_only=False).modules == 0
    assert not any("forward" in vars(m) for mod in (attn, hooked, biased) for m in mod.modules())


@pytest.fixture(scope="module")
def qwen_fp8(tmp_path_factory):
    """A tiny Qwen3-MoE FP8 checkpoint in 16 x 32 blocks (q 32 and k / v 16 rows: whole blocks)."""
    return fp8_model("qwen3_moe", tmp_path_factory.mktemp("fp8qkv") / "q3", block=(16, 32))[1]


def test_fp8_checkpoint_logits_and_bytes_unchanged(kernel, qwen_fp8):
    host = ModelHost.from_checkpoint(qwen_fp8, kv_tokens=128, fp8_dense=True)  # Fp8Linear on a CPU: forced
    layers = host.config.num_hidden_layers
    assert host.fp8_dense["modules"] == 4 * layers
    ex = types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(qwen_fp8 + ".dequantized")).moe_forward)
    ids = torch.randint(0, host.vocab_size, (14,), generator=torch.Generator().manual_seed(0))

    def logits(a: str, b: str) -> torch.Tensor:  # a new pair of sequences (5 and 9 tokens), prefilled
        chunks = [SeqChunk(a, 0, 5), SeqChunk(b, 0, 9)]
        for c in chunks:
            host.kv.reserve(c.seq_id, c.num_tokens)
        return host.forward(chunks, ids, ex)

    want = logits("a", "b")
    assert len(kernel) == 4 * layers  # q, k, v, o
    before = host.memory()["module_bytes"]
    cfg = host.config
    shapes = {(m.out_features, m.in_features, m.block) for m in host.model.modules() if isinstance(m, Fp8Linear)}
    assert host.fp8_gemm_shapes() == shapes  # unfused: every projection's own GEMM
    fused = qkv.fuse_qkv(host.model, cuda_only=False)
    qkv_shape = ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, cfg.hidden_size, (16, 32))
    assert fused == qkv.FusedQKV(modules=layers, fp8_modules=layers, fp8_shapes=(qkv_shape,) * layers)
    host.qkv = fused  # (what ModelHost.fuse_kernels keeps on CUDA)
    o_proj = host.model.model.layers[0].self_attn.o_proj
    assert host.fp8_gemm_shapes() == {qkv_shape, (o_proj.out_features, o_proj.in_features, (16, 32))}
    assert host.memory()["module_bytes"] == before  # views of one buffer per module: counted once
    kernel.clear()
    got = logits("c", "d")
    assert len(kernel) == 2 * layers  # one Q/K/V GEMM and o_proj
    assert torch.equal(got, want)
    host.fuse_kernels()  # on a CPU nothing more (the FP8 trios fuse on CUDA only by default)
    assert qkv.unfuse_qkv(host.model) == layers


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 256])
def test_cuda_fp8_trio_fused_matches_unfused(rows):
    pytest.importorskip("triton")
    if fp8_kernels.interpreted():
        pytest.skip("Triton runs its CPU interpreter (TRITON_INTERPRET)")
    attn = _Fp8Attention(outs=(4096, 512, 512), d=2048, bias=True).cuda()  # the Qwen3-30B-A3B attention shape
    x = _x((rows, 2048), torch.bfloat16).cuda()
    with torch.no_grad():
        want = attn(x)
        assert qkv.fuse_qkv(attn).fp8_modules == 1  # CUDA: the defaults take it
        got = attn(x)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert float((g.float() - w.float()).abs().max() / w.float().abs().max()) < 1e-2
