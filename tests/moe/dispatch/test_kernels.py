"""Row-movement kernels (``dispatch/kernels.py``) and the direct path on GPUs.

* CPU (CI): ``move_rows`` and ``gated_combine`` (torch path) against naive per-row loops.
* GPU (``gpu``): the Triton kernels against the torch path, bit-exact for ``move_rows`` and within FP32
  summation order for ``gated_combine``; bf16, fp32 and fp8 rows; widths that are not a multiple of the
  column block.
* Two GPUs (``gpu``, ``multi_gpu``): ``DirectDispatcher`` over NCCL (comm stream, chunk rounds, own rows
  bypassing the network) gives the same expert-major rows and counts as ``engine.dispatch`` and the same
  output as ``engine.combine`` on random bf16 routes, and runs the same code through LocalExchangeGroup.
"""

from __future__ import annotations

import pytest
import torch

from ray_moe.moe.dispatch.kernels import gated_combine, gated_combine_torch, move_rows, triton_available
from ray_moe_dev.testing.spmd import exchange_device, run_spmd

GPU = pytest.mark.gpu


def _naive_combine(a, b, route_src, gate):
    t, k = route_src.shape
    out = torch.zeros(t, a.shape[1], dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            s = int(route_src[i, j])
            row = a[s] if s >= 0 else b[-1 - s]
            out[i] += float(gate[i, j]) * row.double()
    return out


def _case(device, dtype, t=37, k=3, na=50, nb=29, d=1100, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(na, d, generator=g).to(dtype).to(device)
    b = torch.randn(nb, d, generator=g).to(dtype).to(device)
    src = torch.randint(-nb, na, (t, k), generator=g).to(device)
    gate = torch.rand(t, k, generator=g).to(device)
    return a, b, src, gate


def test_gated_combine_torch_equals_naive():
    a, b, src, gate = _case("cpu", torch.float32)
    got = gated_combine(a, b, src, gate, torch.float64)
    torch.testing.assert_close(got, _naive_combine(a, b, src, gate), rtol=1e-6, atol=1e-6)
    # only own rows (no returned buffer) and the empty case
    own = src.clamp_min(0)
    torch.testing.assert_close(gated_combine(a, b[:0], own, gate, torch.float64),
                               _naive_combine(a, b, own, gate), rtol=1e-6, atol=1e-6)
    assert gated_combine(a, b, src[:0], gate[:0], torch.float32).shape == (0, a.shape[1])


def test_gated_combine_rejects_mismatched_gate():
    a, b, src, gate = _case("cpu", torch.float32)
    with pytest.raises(ValueError, match="gate: shape"):
        gated_combine(a, b, src, gate[:, :2], torch.float32)


def test_move_rows_equals_naive():
    g = torch.Generator().manual_seed(3)
    src = torch.randn(20, 7, generator=g)
    dst = torch.zeros(15, 7)
    si = torch.tensor([3, 3, 19, 0, 7])
    di = torch.tensor([14, 0, 2, 9, 5])
    move_rows(src, si, dst, di)
    want = torch.zeros(15, 7)
    for s, d in zip(si.tolist(), di.tolist()):
        want[d] = src[s]
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="dst_idx"):
        move_rows(src, si, dst, di[:2])
    # scatter form: src row i -> dst[dst_idx[i]]
    dst2 = torch.zeros(15, 7)
    move_rows(src[:5], None, dst2, di)
    want2 = torch.zeros(15, 7)
    want2[di] = src[:5]
    assert torch.equal(dst2, want2)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_triton_move_rows_bit_exact(dtype):
    assert triton_available()
    g = torch.Generator().manual_seed(5)
    src = torch.randn(300, 1100, generator=g).to(dtype).cuda()
    dst = torch.zeros(200, 1100).to(dtype).cuda()
    si = torch.randint(0, 300, (150,), generator=g).cuda()
    di = torch.randperm(200, generator=g)[:150].cuda()
    move_rows(src, si, dst, di)
    want = torch.zeros(200, 1100).to(dtype).cuda().view(torch.uint8)  # fp8 has no CUDA index_copy_
    want.index_copy_(0, di, src.view(torch.uint8).index_select(0, si))
    assert torch.equal(dst.view(torch.uint8), want)
    dst2 = torch.zeros(200, 1100).to(dtype).cuda()
    move_rows(src[:150], None, dst2, di)
    want2 = torch.zeros(200, 1100).to(dtype).cuda().view(torch.uint8)
    want2.index_copy_(0, di, src[:150].view(torch.uint8))
    assert torch.equal(dst2.view(torch.uint8), want2)



@GPU
def test_hidden_flag_catches_nan_and_inf_on_gpu():
    h = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    assert not torch.isnan(torch.linalg.vector_norm(h, float("inf")) * 0)
    for bad in (float("nan"), float("inf"), float("-inf")):
        h2 = h.clone()
        h2[7, 100] = bad
        assert torch.isnan(torch.linalg.vector_norm(h2, float("inf")) * 0)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_gated_combine_equals_torch(dtype):
    assert triton_available()
    a, b, src, gate = _case("cuda", dtype, t=257, k=8, na=900, nb=700, d=7168 + 64)
    got = gated_combine(a, b, src, gate, dtype)
    want = gated_combine_torch(a, b, src, gate, dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    exact = _naive_combine(a.cpu(), b.cpu(), src.cpu(), gate.cpu())
    torch.testing.assert_close(got.double().cpu(), exact, **tol)


# ------------------------------------------------------------------------------------- direct path, 2 GPUs
def _direct_vs_engine(exchange, rank, cfg):
    from ray_moe.moe.dispatch.direct import DirectDispatcher
    from ray_moe.moe.dispatch.engine import combine, dispatch
    from ray_moe.core.routes import RouteBatch
    from ray_moe.placement.manifest import manifest_from_assignment
    from ray_moe.placement.selector import make_selector
    from ray_moe.placement.snapshot import PlacementSnapshot
    from ray_moe.placement.topology import ProcessGroupSpec, Topology

    world, e, d, k, t = exchange.size, cfg["E"], cfg["d"], cfg["k"], cfg["T"]
    dev = exchange_device(exchange)
    topo = Topology.single_node(world)
    # experts 0..E-1 plus replicas of experts 0 and 1 on the other rank
    phy2log = list(range(e)) + [0, 1]
    slot_rank = [q * world // e for q in range(e)] + [world - 1, world - 1]
    man = manifest_from_assignment(generation=2, phy2log=[phy2log], slot_rank=[slot_rank], num_experts=e,
                                   topology=topo)
    snap = PlacementSnapshot.from_manifest(man, topo, ProcessGroupSpec.identity(world))
    g = torch.Generator().manual_seed(100 + rank)
    h = torch.randn(t, d, generator=g).to(torch.bfloat16).to(dev)
    ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices.to(dev)
    w = torch.softmax(torch.randn(t, k, generator=g), 1).to(dev)
    batch = RouteBatch(rank, h, ids, w)
    ref = dispatch(batch, snap, exchange, selector=make_selector("round_robin"), tag="ref")
    y_ref = combine(ref.rows * 2, ref.handle, snap, exchange, tag="ref", out_dtype=torch.bfloat16)
    out = {}
    for chunks in (1, 3):
        dd = DirectDispatcher(exchange, make_selector("round_robin"), chunks=chunks, wait_dispatch=chunks == 1)
        for step in range(2):  # a second step reuses the streams and the allocator's blocks
            got = dd.dispatch(batch, snap, tag=f"d{chunks}/{step}")
            y = dd.combine(got.rows * 2, got.handle, snap, tag=f"d{chunks}/{step}", out_dtype=torch.bfloat16)
        out[chunks] = {
            "rows_equal": bool(torch.equal(got.rows, ref.rows)),
            "counts_equal": got.counts_list == ref.counts_list,
            "max_abs_diff": float((y.float() - y_ref.float()).abs().max()) if t else 0.0,
            "remote_sent": got.handle.remote_sent,
        }
    return out


@pytest.mark.parametrize("backend", [pytest.param("local", id="local"),
                                     pytest.param("nccl", id="nccl", marks=(pytest.mark.gpu, pytest.mark.multi_gpu))])
def test_direct_over_nccl_equals_engine(backend):
    cfg = {"E": 16, "d": 1024, "k": 4, "T": 300}
    results = run_spmd(_direct_vs_engine, 2, args=(cfg,), backend=backend, timeout_s=180.0,
                       exchange_timeout_s=20.0)
    for per_rank in results:
        for chunks, r in per_rank.items():
            assert r["rows_equal"] and r["counts_equal"], (chunks, r)
            assert r["max_abs_diff"] <= 0.05, (chunks, r)  # bf16 output, FP32 sums in another order
            assert r["remote_sent"] > 0


@GPU
@pytest.mark.parametrize("fmt", ["fp8_row", "fp8_block128"])
@pytest.mark.parametrize("d", [7168, 1000])
def test_triton_fp8_equals_torch_math(fmt, d):
    """The one-pass CUDA quantise / dequantise give the same codes, scales and rows as the torch math
    (run on CPU here as the oracle): same formula, correctly rounded FP32 division, round-to-nearest-even."""
    from ray_moe.moe.dispatch.precision import dequantize, quantize
    from ray_moe.core.types import PayloadFormat

    f = PayloadFormat(fmt)
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(257, d, generator=g) * torch.logspace(-3, 3, 257)[:, None]).to(torch.bfloat16)
    x[5] = 0  # an all-zero row: the 1e-12 scale floor
    q, s = quantize(x.cuda(), f)
    q_ref, s_ref = quantize(x, f)
    assert q.dtype == q_ref.dtype and s.shape == s_ref.shape
    torch.testing.assert_close(s.cpu(), s_ref, rtol=0, atol=0)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    y = dequantize(q, s, f, torch.bfloat16)
    assert torch.equal(y.cpu().view(torch.int16), dequantize(q_ref, s_ref, f, torch.bfloat16).view(torch.int16))
