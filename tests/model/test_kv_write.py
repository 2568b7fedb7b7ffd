"""The cache write kernel (model/kv_write.py): a step's rows of a layer's two cached tensors at their slots, in one
launch, equal to the two ``index_copy_`` calls it replaces (``write_rows_reference``). Under Triton's CPU
interpreter (``TRITON_INTERPRET=1 python -m pytest tests/model/test_kv_write.py``) and on CUDA; without either the
cache keeps the reference path, and the kernel's entry refuses CPU operands by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.env import triton_interpreted
from ray_moe.model import kv_write

pytestmark = pytest.mark.triton  # its Triton kernels also run under the CPU interpreter (TRITON_INTERPRET=1)

interpreted = pytest.mark.skipif(not triton_interpreted(), reason="the kernel runs on CPU under Triton's "
                                 "interpreter: set TRITON_INTERPRET=1 for pytest")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _operands(rows: int, heads: tuple[int, int], dims: tuple[int, int], pad: int, capacity: int, seed: int,
              device: str = "cpu", dtype: torch.dtype = torch.float32):
    """a: a head-major view of the first heads of a wider [1, R, W, D] projection (row stride > H x D, as the fused
    QKV's key slice); b: a head-major view of a dense [1, R, H, D] tensor; the real rows' slots distinct, ``pad``
    padding rows at the trash slot (the last); buffers [C + 1, H, D] holding earlier values."""
    g = torch.Generator().manual_seed(seed)
    (ha, hb), (da, db) = heads, dims
    n = rows + pad
    wide = torch.randn(1, n, ha + 3, da, generator=g).to(device, dtype)
    a = wide[:, :, :ha].transpose(1, 2)
    b = torch.randn(1, n, hb, db, generator=g).to(device, dtype).transpose(1, 2)
    slots = torch.randperm(capacity, generator=g)[:rows]
    index = torch.cat([slots, torch.full((pad,), capacity)]).to(device)
    buffers = tuple(torch.randn(capacity + 1, h, d, generator=g).to(device, dtype) for h, d in ((ha, da), (hb, db)))
    return a, b, index, buffers


def _check(rows, heads, dims, pad, capacity, seed, device="cpu", dtype=torch.float32):
    a, b, index, buffers = _operands(rows, heads, dims, pad, capacity, seed, device, dtype)
    assert kv_write.available(a, b, index, buffers)
    want = tuple(t.clone() for t in buffers)
    kv_write.write_rows_reference(a, b, index, want)
    kv_write.write_rows(a, b, index, buffers)
    for got, ref in zip(buffers, want):  # every slot but the trash one (padding rows race for it) bit-equal
        assert torch.equal(got[:-1], ref[:-1])
    if pad:  # each element of the trash slot is that element of some padding row (the rows' programs race for
        # the slot element by element on a GPU, so the slot may mix rows)
        for got, src in zip(buffers, (a, b)):
            padding = src[0, :, rows:rows + pad].transpose(0, 1)  # [pad, H, D]
            assert bool((padding == got[-1]).any(0).all())


@interpreted
@settings(max_examples=12, deadline=None)
@given(rows=st.integers(0, 40), ha=st.sampled_from([1, 2, 4]), hb=st.sampled_from([1, 4]),
       da=st.sampled_from([8, 16, 24]), db=st.sampled_from([8, 32]), pad=st.integers(0, 3), seed=st.integers(0, 99))
def test_interpreted_kernel_writes_what_index_copy_writes(rows, ha, hb, da, db, pad, seed):
    """Any rows (0 included), head counts and head sizes of the two tensors (MLA's latent and rotary key differ),
    strided rows: the buffers equal the reference's, slot by slot."""
    _check(rows, (ha, hb), (da, db), pad, capacity=64, seed=seed)


def test_cpu_operands_take_the_reference_and_the_kernel_refuses_them():
    """Without CUDA (and no interpreter) ``available`` says no, so the cache writes through torch; the kernel's
    entry names the operands it cannot take."""
    if triton_interpreted():
        pytest.skip("the interpreter takes CPU operands")
    a, b, index, buffers = _operands(5, (2, 2), (8, 8), 1, 16, 0)
    assert not kv_write.available(a, b, index, buffers)
    with pytest.raises(ValueError, match="cache write takes"):
        kv_write.write_rows(a, b, index, buffers)
    want = tuple(t.clone() for t in buffers)
    kv_write.write_rows_reference(a, b, index, want)
    kv_write.write(a, b, index, buffers, fused=True)  # the cache's entry: operands the kernel refuses go through torch
    assert all(torch.equal(x, y) for x, y in zip(buffers, want)) and not torch.equal(want[0], _operands(5, (2, 2), (
        8, 8), 1, 16, 0)[3][0])


def test_mismatched_operands_are_not_taken():
    """Another dtype than the buffer's, a strided last dimension, int32 slots or a buffer of another head size:
    the reference path (which casts and copies) serves them."""
    a, b, index, buffers = _operands(6, (2, 2), (8, 8), 0, 16, 1)
    checks = [
        (a.to(torch.float64), b, index, buffers),
        (a[..., ::2], b, index, (buffers[0][..., :4].contiguous(), buffers[1])),
        (a, b, index.to(torch.int32), buffers),
        (a, b, index, (buffers[0][:, :1].contiguous(), buffers[1])),
    ]
    for operands in checks:
        assert not kv_write.available(*operands)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rows,pad", [(1, 0), (48, 7), (8192, 0), (3000, 5)])
def test_cuda_kernel_writes_what_index_copy_writes(rows, pad):
    """bf16 on the GPU, the Qwen3-30B-A3B shape's keys / values (4 heads of 128) and MLA's latent / rotary key
    (1 x 512, 1 x 64): bit-equal to the reference."""
    _check(rows, (4, 4), (128, 128), pad, capacity=20000, seed=rows, device="cuda", dtype=torch.bfloat16)
    _check(rows, (1, 1), (512, 64), pad, capacity=20000, seed=rows + 1, device="cuda", dtype=torch.bfloat16)


def test_a_cache_writes_through_the_kernel_only_where_its_check_passes():
    """The check runs when a cache is made: on CPU (no interpreter) the cache keeps ``index_copy_`` and says why;
    under the interpreter the kernel passes and the cache's writes equal a reference cache's."""
    from ray_moe.model.kv import PagedKVCache

    cache = PagedKVCache(4, 8, device="cpu", dtype=torch.float32)
    if not triton_interpreted():
        assert not cache.fused_write and "CUDA" in cache.write_reason
        return
    assert cache.fused_write and cache.write_reason is None
    ref = PagedKVCache(4, 8, device="cpu", dtype=torch.float32)
    ref.fused_write = False
    a, b, index, _ = _operands(20, (2, 2), (8, 8), 0, 32, 3)
    for c in (cache, ref):
        c.write_index = index
        c.update(a, b, 0)
    assert all(torch.equal(x, y) for x, y in zip(cache._store[0], ref._store[0]))
