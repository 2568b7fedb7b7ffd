"""The fused softmax top-k router (model/router_topk.py): the torch contract against transformers' own
routers, which routers it takes (checked per class against the router's own forward), restoring them, and on
CUDA the kernel against the contract and a fused model against its own routers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.model import router_topk as rt
from ray_moe_dev.testing.hf_models import FAMILIES, build_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SOFTMAX_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Router")]


def _same_choice(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                 logits: torch.Tensor, rtol: float) -> None:
    """Scores close; ids equal except between experts of equal probability."""
    (gs, gi), (ws, wi) = got, want
    assert gs.dtype == ws.dtype and gi.dtype == wi.dtype == torch.int64
    torch.testing.assert_close(gs, ws, rtol=rtol, atol=1e-6)
    p = torch.softmax(logits.float(), -1)
    differ = gi != wi
    assert torch.equal(p.gather(1, gi)[differ], p.gather(1, wi)[differ])


@pytest.fixture
def cpu_kernel(monkeypatch):
    """The kernel's seam on CPU: ``available`` for CPU rows of the weight's dtype and the torch contract as
    the kernel (the selection logic is the one CUDA runs)."""
    calls = []

    def avail(x, w, k):
        return x.dim() == 2 and x.dtype == w.dtype and x.shape[1] == w.shape[1] and 1 <= k <= w.shape[0]

    def fake(logits, k, renorm, out_dtype):
        calls.append((tuple(logits.shape), k, renorm, out_dtype))
        return rt.softmax_topk_reference(logits, k, renorm, out_dtype)

    monkeypatch.setattr(rt, "available", avail)
    monkeypatch.setattr(rt, "softmax_topk", fake)
    return calls


@pytest.mark.parametrize("family", SOFTMAX_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_reproduces_transformers_routers(family, dtype):
    router = _routers(build_model(family, seed=1).to(dtype))[0]
    x = torch.randn(40, router.weight.shape[1], generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        logits, scores, ids = router(x)
    renorm = getattr(router, "norm_topk_prob", True)
    got = rt.softmax_topk_reference(logits, router.top_k, renorm, scores.dtype)
    _same_choice(got, (scores, ids), logits, rt._RTOL[scores.dtype])


def test_reference_orders_ties_by_the_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    scores, ids = rt.softmax_topk_reference(logits, 3, True, torch.float32)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(scores, torch.full((2, 3), 1 / 3))


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 9), e=st.integers(1, 40), k=st.integers(1, 8), renorm=st.booleans(),
       levels=st.integers(2, 50), seed=st.integers(0, 2 ** 16))
def test_reference_is_a_softmax_top_k(t, e, k, renorm, levels, seed):
    """For any shape and heavy ties: the values are torch.topk's, descending; every id's probability is its
    value; ids are distinct; renormalised rows sum to one."""
    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (t, e), generator=g).float() / 7  # few levels: many exact ties
    scores, ids = rt.softmax_topk_reference(logits, k, renorm, torch.float32)
    p = torch.softmax(logits, -1)
    top = torch.topk(p, k, -1).values
    want = top / top.sum(-1, keepdim=True) if renorm else top
    torch.testing.assert_close(scores, want)
    assert torch.equal(p.gather(1, ids), top)
    assert all(len(set(r)) == k for r in ids.tolist())
    if renorm:
        torch.testing.assert_close(scores.sum(-1), torch.ones(t))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_softmax_router_is_taken_and_outputs_stay(cpu_kernel, family):
    model = build_model(family, seed=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
    fused = rt.fuse_routers(model)
    if family in ("deepseek_v2", "deepseek_v3"):  # grouped top-k / sigmoid with a correction bias
        assert fused.modules == 0 and fused.skipped, fused
    if family in SOFTMAX_FAMILIES:
        assert fused.modules == len(_routers(model)) > 0 and fused.skipped == {}, fused
    cpu_kernel.clear()
    with torch.no_grad():
        got = model(ids).logits
    assert len(cpu_kernel) == (len(_routers(model)) if fused.modules else 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rt.fuse_routers(model).modules == 0  # fusing twice changes nothing
    assert rt.unfuse_routers(model) == fused.modules
    cpu_kernel.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
    assert cpu_kernel == []


def test_the_variant_follows_the_router(cpu_kernel):
    """qwen2_moe's tiny model has norm_topk_prob False (scores in the model's dtype), mixtral renormalises
    and returns FP32 scores."""
    for family, renorm, out in (("qwen2_moe", False, torch.bfloat16), ("mixtral", True, torch.float32),
                                ("qwen3_moe", True, torch.bfloat16)):
        model = build_model(family, seed=1).to(torch.bfloat16)
        assert rt.fuse_routers(model).modules > 0
        cpu_kernel.clear()
        router = _routers(model)[0]
        with torch.no_grad():
            router(torch.randn(3, router.weight.shape[1]).to(torch.bfloat16))
        assert cpu_kernel == [((3, router.weight.shape[0]), router.top_k, renorm, out)], family


def test_another_formula_and_other_inputs_keep_the_router_forward(cpu_kernel):
    class BiasedRouter(torch.nn.Module):  # a softmax router with a bias added to its scores: another formula
        def __init__(self) -> None:
            super().__init__()
            self.top_k, self.hidden_dim = 2, 8
            self.weight = torch.nn.Parameter(torch.randn(6, 8))
            self.register_buffer("shift", torch.linspace(0, 2, 6))

        def forward(self, h):
            logits = torch.nn.functional.linear(h.reshape(-1, 8), self.weight)
            v, i = torch.topk(torch.softmax(logits, -1) + self.shift, self.top_k, -1)
            return logits, v, i

    net = torch.nn.ModuleList([BiasedRouter(), _routers(build_model("qwen3_moe"))[0]])
    fused = rt.fuse_routers(net)
    assert fused.modules == 1 and fused.classes == ("Qwen3MoeTopKRouter",)
    assert "BiasedRouter" in fused.skipped and "forward" not in vars(net[0])
    cpu_kernel.clear()
    x = torch.randn(4, net[1].weight.shape[1])
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(rt, "available", lambda *a: False)  # rows the kernel cannot take: the router's own forward
        got = net[1](x)
        want = type(net[1]).forward(net[1], x)
    assert cpu_kernel == [] and all(torch.equal(a, b) for a, b in zip(got, want))


def test_on_cpu_nothing_is_replaced_and_the_kernel_refuses_by_name():
    model = build_model("qwen3_moe")
    fused = rt.fuse_routers(model)
    assert fused.modules == 0 and "Qwen3MoeTopKRouter" in fused.skipped
    assert not any("forward" in vars(m) for m in model.modules())
    with pytest.raises(ValueError, match=r"logits \(2, 8\).*fused softmax top-k"):
        rt.softmax_topk(torch.zeros(2, 8), 2, True, torch.float32)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,e,k", [(0, 128, 8), (1, 8, 2), (7, 60, 4), (256, 128, 8), (1025, 256, 8), (33, 1024, 6)])
def test_cuda_kernel_matches_the_reference(dtype, t, e, k):
    g = torch.Generator().manual_seed(t + e + k)
    logits = (torch.randn(t, e, generator=g) * 2).to(dtype).cuda()
    if t > 3:  # exact ties, inside the top k and at its edge
        logits[3, :5] = logits[3].max()
        logits[2, : e // 2] = 0.25
    for renorm in (True, False):
        for out in (dtype, torch.float32):
            got = rt.softmax_topk(logits, k, renorm, out)
            want = rt.softmax_topk_reference(logits, k, renorm, out)
            _same_choice((got[0].cpu(), got[1].cpu()), (want[0].cpu(), want[1].cpu()), logits.cpu(), rt._RTOL[out])
            assert got[1].tolist() == want[1].tolist()  # ties too: the lowest id first in both


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("family", SOFTMAX_FAMILIES)
def test_cuda_fused_model_matches_its_own_routers(family):
    model = build_model(family, seed=3).cuda().to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        want = model(ids).logits.float()
        fused = rt.fuse_routers(model)
        got = model(ids).logits.float()
    assert fused.modules == len(_routers(model)) and fused.skipped == {}, fused
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
