"""SwiGLU's one-pass activation (moe/experts/runners/swiglu.py): silu(g) * u in place in g, with torch's two roundings,
against ``swiglu_reference`` (torch's ``silu_`` then ``mul_``). Under Triton's CPU interpreter (``TRITON_INTERPRET=1
python -m pytest tests/moe/experts/test_swiglu.py``) and on CUDA; without either ``swiglu_act`` keeps torch's calls and
the kernel's entry refuses CPU operands by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.env import triton_interpreted
from ray_moe.moe.experts.runners import swiglu
from ray_moe.moe.experts.runners.base import swiglu_act

pytestmark = pytest.mark.triton  # its Triton kernel also runs under the CPU interpreter (TRITON_INTERPRET=1)

interpreted = pytest.mark.skipif(not triton_interpreted(), reason="the kernel runs on CPU under Triton's "
                                 "interpreter: set TRITON_INTERPRET=1 for pytest")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# relative: the kernel's exp and division may round a few FP32 units apart from torch's (measured: at most 3.1e-7 under
# the interpreter), which can move a bf16 / fp16 result by one unit of the dtype where it sits at a rounding boundary
_ULP = {torch.float32: 2.0 ** -21, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _operands(rows: int, f: int, seed: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(rows, f, generator=g) * 4.0).to(device, dtype)  # silu's both tails and its bend
    up = torch.randn(rows, f, generator=g).to(device, dtype)
    return gate, up


def _check(rows: int, f: int, seed: int, device: str, dtype: torch.dtype) -> float:
    """The kernel against the oracle on fresh operands; returns the share of elements bit-equal."""
    gate, up = _operands(rows, f, seed, device, dtype)
    want = swiglu.swiglu_reference(gate.clone(), up)
    got = gate.clone()
    assert swiglu.swiglu_(got, up) is got  # in place, as the runners use it
    torch.testing.assert_close(got, want, rtol=_ULP[dtype], atol=1e-30)
    return float((got == want).float().mean()) if got.numel() else 1.0


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (the interpreter truncates to bf16: CUDA only)
def test_interpreted_equals_torch(dtype):
    share = _check(37, 768, 0, "cpu", dtype)  # 28,416 elements: 14 programs, the last one partial
    if dtype != torch.float32:  # FP32 keeps the exp's last units (84% bit-equal); a 16-bit dtype rounds them away
        assert share > 0.99


@interpreted
@settings(max_examples=12, deadline=None)
@given(rows=st.integers(0, 9), f=st.integers(1, 700), seed=st.integers(0, 2 ** 16))
def test_interpreted_any_size(rows, f, seed):
    _check(rows, f, seed, "cpu", torch.float32)


@interpreted
def test_swiglu_act_takes_the_kernel_where_it_can():
    """The runners' entry: the kernel for contiguous operands, torch's calls for a strided one (same values)."""
    gate, up = _operands(5, 64, 1, "cpu", torch.float32)
    want = swiglu.swiglu_reference(gate.clone(), up)
    torch.testing.assert_close(swiglu_act(gate.clone(), up), want, rtol=_ULP[torch.float32], atol=1e-30)
    wide = torch.cat([gate, gate], dim=1)[:, :64]  # a strided view: not the kernel's
    assert not swiglu.available(wide, up)
    torch.testing.assert_close(swiglu_act(wide, up), want, rtol=0, atol=0)


@interpreted
def test_a_kernel_failing_its_check_is_not_used(monkeypatch):
    """Where the kernel's check fails on a device (it does not compile, or computes something else) the runners keep
    torch's calls, and the kernel's entry refuses."""
    swiglu._verdict.cache_clear()
    monkeypatch.setattr(swiglu, "_check", lambda device, dtype: False)
    try:
        gate, up = _operands(5, 64, 6, "cpu", torch.float32)
        assert not swiglu.works(gate.device, gate.dtype) and not swiglu.available(gate, up)
        torch.testing.assert_close(swiglu_act(gate.clone(), up), swiglu.swiglu_reference(gate.clone(), up),
                                   rtol=0, atol=0)
        with pytest.raises(ValueError, match="g: "):
            swiglu.swiglu_(gate, up)
    finally:
        swiglu._verdict.cache_clear()


def test_refuses_what_it_does_not_take():
    gate, up = _operands(3, 8, 2, "cpu", torch.float32)
    if not triton_interpreted():
        assert not swiglu.available(gate, up)
        with pytest.raises(ValueError, match="g: .*one-pass SwiGLU"):
            swiglu.swiglu_(gate, up)
        torch.testing.assert_close(swiglu_act(gate.clone(), up), swiglu.swiglu_reference(gate.clone(), up))
    assert not swiglu.available(gate, up[:, :4].contiguous())  # another shape
    assert not swiglu.available(gate, up.double())  # another dtype
    assert not swiglu.available(gate.double(), up.double())  # a dtype it does not take


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_equals_torch(dtype):
    share = _check(4099, 768, 3, "cuda", dtype)  # a partial last program, three million elements
    if dtype != torch.float32:
        assert share > 0.999
    _check(1, 1, 4, "cuda", dtype)


@cuda
@pytest.mark.gpu
def test_cuda_check_before_captures():
    """The kernel's check runs at its first eager use and holds inside later captures; a capture that comes first
    captures torch's calls (no check, no synchronisation inside it) and leaves the check to the next eager use."""
    swiglu._verdict.cache_clear()
    gate, up = _operands(4, 256, 5, "cuda", torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            assert not swiglu.works(gate.device, gate.dtype)
    assert swiglu._verdict.cache_info().currsize == 0
    assert swiglu.works(gate.device, gate.dtype)  # eager: checked
    with torch.cuda.stream(side):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            assert swiglu.works(gate.device, gate.dtype)
