"""The one-rank route plan (``dispatch/route_plan.py``) and the planned path of ``LocalDispatcher``: the plan
equals the general path's stable expert-major order, counts and gates (hypothesis), the planned dispatch +
runner + combine equals the naive reference with padding rows and padding routes, a corrupted planned handle
is rejected, row-mapped slot weights give the plain result; on CUDA the one-launch kernel equals the torch
plan, the skinny kernels read rows through the order (and slot-buffer rows), and the whole layer captures."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.errors import RouteValidationError
from ray_moe.core.routes import RouteBatch
from ray_moe.moe.dispatch.local import LocalDispatcher, PlannedDispatchOutput, PlannedHandle
from ray_moe.moe.dispatch.plan import expert_major_order
from ray_moe.moe.dispatch.protocol import DeferredChecks
from ray_moe.moe.dispatch.records import DispatchOutputFormat
from ray_moe.moe.dispatch.route_plan import (RouteTables, combine_planned, plan_routes, plan_routes_torch,
                                             route_tables)
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.moe.experts.runners import make_runner
from ray_moe.moe.experts.weights import SeededWeightSource, SlotWeights
from ray_moe.moe.layer import run_experts
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.selector import make_selector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.shard.fault_wrappers import corrupt_handle
from ray_moe_dev.testing.reference import reference_moe

pytestmark = pytest.mark.triton  # its Triton kernels also run under the CPU interpreter (TRITON_INTERPRET=1)

E, D, F = 6, 16, 24


def _setup(seed: int = 0):
    """One rank holding every expert once, in a shuffled slot order."""
    g = torch.Generator().manual_seed(seed)
    phy2log = [torch.randperm(E, generator=g).tolist()]
    topo = Topology.single_node(1)
    group = ProcessGroupSpec(group_id="ep-group-0", peer_order=(0,), epoch=0)
    man = manifest_from_assignment(generation=1, phy2log=phy2log, slot_rank=[[0] * len(phy2log[0])], num_experts=E,
                                   topology=topo, process_group_id=group.group_id, checkpoint_version="ck",
                                   digests={})
    snap = PlacementSnapshot.from_manifest(man, topo, group, layer=0)
    src = SeededWeightSource(num_layers=1, num_experts=E, hidden_size=D, ffn_size=F, seed=3)
    experts = [src.expert(0, e) for e in phy2log[0]]
    weights = SlotWeights.stack(0, list(range(len(phy2log[0]))), experts)
    return snap, src, weights, LocalExchangeGroup(group).endpoint(0)


def _routes(t: int, k: int, seed: int, pad: float = 0.15):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)]) if t else \
        torch.zeros(0, k, dtype=torch.int64)
    ids[torch.rand(t, k, generator=g) < pad] = -1
    return ids, torch.rand(t, k, generator=g), torch.rand(t, generator=g) > 0.25


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 40), st.integers(1, 4), st.booleans())
def test_the_plan_is_the_stable_expert_major_order(t, k, masked):
    snap, _, _, _ = _setup(seed=t)
    tables = route_tables(snap.slot_local, snap.slot_rank, snap.log2phy, 0, snap.rank_num_slots[0])
    ids, w, rv = _routes(t, k, seed=t * 13 + k)
    plan = plan_routes_torch(ids, w, rv if masked else None, tables)
    live = (ids >= 0) & (rv[:, None] if masked else True)
    q = snap.rank_num_slots[0]
    slot = torch.where(live, snap.slot_local[snap.log2phy[ids.clamp_min(0), 0]], torch.full_like(ids, q)).reshape(-1)
    order, dest, counts = expert_major_order(slot, q + 1, counting=False)
    assert torch.equal(plan.order.long(), order)
    assert torch.equal(plan.src, torch.where(slot < q, dest, -1))
    assert torch.equal(plan.slot_rows, counts[:q]) and torch.equal(plan.ends.long(), counts[:q].cumsum(0))
    assert torch.equal(plan.sent, counts[snap.slot_local])  # one rank: every physical slot is local
    assert torch.equal(plan.gates, torch.where(live.reshape(-1), w.reshape(-1), 0.0))
    assert int(plan.slot_rows.sum()) == int(live.sum())  # conservation: every live route has one row
    assert bool(plan.ok)


def test_a_replicated_expert_takes_the_general_path():
    snap, *_ = _setup()
    two = torch.tensor([[0, 1]] * E)
    assert route_tables(snap.slot_local, snap.slot_rank, two, 0, E) is None


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 24), st.integers(1, 3), st.sampled_from(["round_robin", "hash", "least_load"]))
def test_the_planned_layer_equals_the_reference(t, k, policy):
    snap, src, weights, ex = _setup(seed=t + k)
    ids, w, rv = _routes(t, k, seed=t * 7 + k)
    h = torch.randn(t, D, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
    d = LocalDispatcher(ex, make_selector(policy), validate=False)
    out = d.dispatch(RouteBatch(0, h, ids, w, rv), snap, tag="p")
    assert isinstance(out, PlannedDispatchOutput) and out.format is DispatchOutputFormat.EXPERT_MAJOR_INDEXED
    assert out.rows is h  # nothing gathered by the dispatch
    w64 = SlotWeights(weights.layer, weights.slot_ids, weights.experts, weights.w_gate.double(),
                      weights.w_up.double(), weights.w_down.double())
    y_rows = run_experts(make_runner("grouped"), out, w64, D)
    checks = DeferredChecks()
    y = d.combine(y_rows, out.handle, snap, tag="p", out_dtype=torch.float64, checks=checks)
    checks.verify()
    masked_ids = torch.where(rv[:, None], ids, torch.full_like(ids, -1))
    ref = torch.zeros(t, D, dtype=torch.float64)
    for j in range(k):  # the reference per route slot; padding routes add nothing
        live = masked_ids[:, j] >= 0
        if live.any():
            ref[live] += reference_moe(h[live], masked_ids[live, j:j + 1], w[live, j:j + 1],
                                       lambda e: src.expert(0, e))
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-6)
    assert int(d.sent_slot_counts(out.handle).sum()) == int((masked_ids >= 0).sum())


def test_a_corrupted_planned_handle_is_rejected_before_publish():
    snap, _, weights, ex = _setup()
    d = LocalDispatcher(ex, make_selector("round_robin"), validate=False)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0]])
    h, w = torch.randn(4, D), torch.rand(4, 2)
    out = d.dispatch(RouteBatch(0, h, ids, w), snap, tag="c")
    assert isinstance(out.handle, PlannedHandle)
    y_rows = run_experts(make_runner("grouped"), out, weights, D)
    d.combine(y_rows, out.handle, snap, tag="c", out_dtype=torch.float32)  # whole: accepted
    with pytest.raises(RouteValidationError, match="output rejected before publish"):
        d.combine(y_rows, corrupt_handle(out.handle), snap, tag="c", out_dtype=torch.float32)
    checks = DeferredChecks()
    d.combine(y_rows, corrupt_handle(out.handle), snap, tag="c", out_dtype=torch.float32, checks=checks)
    with pytest.raises(RouteValidationError, match="not a permutation"):
        checks.verify()


def test_row_mapped_slot_weights_give_the_plain_result():
    """A generation over a slot buffer (local slot i -> buffer row rows[i]) through the planned path."""
    snap, _, weights, ex = _setup(seed=2)
    q = weights.num_slots
    rows = torch.randperm(q + 3, generator=torch.Generator().manual_seed(4))[:q]
    buf = {n: torch.zeros(q + 3, *getattr(weights, n).shape[1:]) for n in ("w_gate", "w_up", "w_down")}
    for n, b in buf.items():
        b[rows] = getattr(weights, n)
    mapped = SlotWeights(weights.layer, weights.slot_ids, weights.experts, buf["w_gate"], buf["w_up"], buf["w_down"],
                         rows=tuple(rows.tolist()))
    ids, w, rv = _routes(12, 2, seed=5)
    h = torch.randn(12, D)
    d = LocalDispatcher(ex, make_selector("round_robin"), validate=False)
    out = d.dispatch(RouteBatch(0, h, ids, w, rv), snap, tag="m")
    runner = make_runner("grouped")
    plain = d.combine(run_experts(runner, out, weights, D), out.handle, snap, tag="m", out_dtype=torch.float32)
    via = d.combine(run_experts(runner, out, mapped, D), out.handle, snap, tag="m", out_dtype=torch.float32)
    torch.testing.assert_close(via, plain, atol=1e-6, rtol=1e-6)


def test_combine_planned_reads_nothing_for_padding_routes():
    snap, *_ = _setup()
    tables = route_tables(snap.slot_local, snap.slot_rank, snap.log2phy, 0, snap.rank_num_slots[0])
    ids = torch.full((3, 2), -1)
    plan = plan_routes(ids, torch.rand(3, 2), None, tables)
    y = torch.full((6, D), float("nan"))  # rows past ends[-1] are never computed: whatever they hold
    out = combine_planned(y, plan, 2, torch.float32)
    assert torch.equal(out, torch.zeros(3, D)) and int(plan.ends[-1]) == 0


# ---------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,spare", [(1, 8, 128, 0), (256, 8, 128, 0), (37, 2, 8, 3), (512, 8, 256, 5),
                                         (5, 1, 6, 0), (300, 4, 60, 1)])
def test_cuda_route_plan_kernel_equals_the_torch_plan(t, k, e, spare):
    from ray_moe.moe.dispatch.route_plan import kernel_available

    g = torch.Generator().manual_seed(t + e)
    s = e + spare
    slot_local, slot_rank = torch.randperm(s, generator=g), torch.zeros(s, dtype=torch.int64)
    log2phy = torch.randperm(s, generator=g)[:e][:, None]
    host = route_tables(slot_local, slot_rank, log2phy, 0, s)
    cuda = route_tables(slot_local.cuda(), slot_rank.cuda(), log2phy.cuda(), 0, s)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[torch.rand(t, k, generator=g) < 0.1] = -1
    w, rv = torch.rand(t, k, generator=g), torch.rand(t, generator=g) > 0.2
    for row_valid in (None, rv):
        assert kernel_available(ids.cuda(), s)
        got = plan_routes(ids.cuda(), w.cuda(), None if row_valid is None else row_valid.cuda(), cuda)
        want = plan_routes_torch(ids, w, row_valid, host)
        for f in ("src", "gates", "order", "ends", "slot_rows", "sent", "ok"):
            assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f


@pytest.mark.gpu
@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("t", [96, 700, 3000])
def test_cuda_planned_layer_reads_rows_in_place_and_captures(mapped, t):
    """bf16: route plan -> skinny kernels reading each token's row through the order (and the slot buffer's rows)
    up to SKINNY_ROWS_PER_SLOT rows a slot on average (96 tokens: 6 a slot), grouped GEMMs on rows gathered through
    the order above (700 tokens, the blocked plan: 44 a slot; 3,000 tokens: 188) -> checked combine, against the
    general path on gathered rows; then the same layer captured in a CUDA graph and replayed on new routes."""
    from ray_moe.moe.experts.runners.grouped import SKINNY_ROWS_PER_SLOT
    from ray_moe.moe.dispatch.local import LocalDispatchOutput

    e, d, f, k = 64, 256, 128, 4
    phy2log = [list(range(e))]
    topo, group = Topology.single_node(1), ProcessGroupSpec(group_id="g", peer_order=(0,), epoch=0)
    man = manifest_from_assignment(generation=1, phy2log=phy2log, slot_rank=[[0] * e], num_experts=e, topology=topo,
                                   process_group_id="g", checkpoint_version="ck", digests={})
    snap = PlacementSnapshot.from_manifest(man, topo, group, layer=0)
    src = SeededWeightSource(num_layers=1, num_experts=e, hidden_size=d, ffn_size=f, seed=1)
    plain = SlotWeights.stack(0, list(range(e)), [src.expert(0, i) for i in range(e)])
    plain = SlotWeights(0, plain.slot_ids, plain.experts, *(x.to("cuda", torch.bfloat16).contiguous()
                                                             for x in (plain.w_gate, plain.w_up, plain.w_down)))
    weights = plain
    if mapped:
        rows = torch.randperm(e + 5, generator=torch.Generator().manual_seed(2))[:e]
        buf = [torch.zeros(e + 5, *x.shape[1:], dtype=x.dtype, device="cuda") for x in (plain.w_gate, plain.w_up,
                                                                                       plain.w_down)]
        for b, x in zip(buf, (plain.w_gate, plain.w_up, plain.w_down)):
            b[rows.cuda()] = x
        weights = SlotWeights(0, plain.slot_ids, plain.experts, *buf, rows=tuple(rows.tolist()))
    d_ = LocalDispatcher(LocalExchangeGroup(group).endpoint(0), make_selector("round_robin"), validate=False)
    runner = make_runner("grouped")
    g = torch.Generator().manual_seed(3)

    def draw():
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).cuda()
        return (torch.randn(t, d, generator=g).to("cuda", torch.bfloat16), ids, torch.rand(t, k, generator=g).cuda(),
                (torch.rand(t, generator=g) > 0.1).cuda())

    def layer(h, ids, w, rv):
        out = d_.dispatch(RouteBatch(0, h, ids, w, rv), snap, tag="x")
        return d_.combine(run_experts(runner, out, weights, d), out.handle, snap, tag="x", out_dtype=torch.bfloat16,
                          checks=DeferredChecks())  # deferred: no host read inside the capture

    def general(h, ids, w, rv):
        masked = torch.where(rv[:, None], ids, torch.full_like(ids, -1))
        gen = LocalDispatcher(LocalExchangeGroup(group).endpoint(0), make_selector("round_robin"), validate=False,
                              planned=False)
        out = gen.dispatch(RouteBatch(0, h, masked, w), snap, tag="r")
        assert isinstance(out, LocalDispatchOutput)
        return gen.combine(run_experts(runner, out, plain, d), out.handle, snap, tag="r", out_dtype=torch.bfloat16)

    args = draw()
    out = d_.dispatch(RouteBatch(0, *args[:3], args[3]), snap, tag="p")
    assert isinstance(out, PlannedDispatchOutput)
    assert runner.takes_indexed(args[0], t * k, weights) == (t * k <= SKINNY_ROWS_PER_SLOT * e) == (t == 96)
    torch.testing.assert_close(layer(*args).float(), general(*args).float(), atol=3e-2, rtol=3e-2)
    static = [a.clone() for a in args]
    layer(*static)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(*static)
    fresh = draw()
    for s_, f_ in zip(static, fresh):
        s_.copy_(f_)
    graph.replay()
    torch.testing.assert_close(y.float(), general(*fresh).float(), atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------------------------------------------
# The blocked plan (steps past ROUTE_PLAN_MAX routes): Triton's interpreter on CPU, the compiler for sm_90
# ---------------------------------------------------------------------------------------------------


def _random_tables(e: int, spare: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    s = e + spare
    slot_local, slot_rank = torch.randperm(s, generator=g), torch.zeros(s, dtype=torch.int64)
    return route_tables(slot_local, slot_rank, torch.randperm(s, generator=g)[:e][:, None], 0, s), g


@pytest.fixture
def interpret():
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the route-plan kernels run on CPU under Triton's interpreter: set TRITON_INTERPRET=1 for pytest")


@pytest.mark.parametrize("t,k,e,spare,block", [(37, 8, 12, 2, 16), (9, 2, 5, 0, 16), (64, 4, 30, 1, 64),
                                               (1, 8, 16, 0, 16), (50, 8, 128, 0, 1024),
                                               (300, 8, 128, 2, 256)])  # a decode step's blocks (BLOCKED_MIN_BLOCK)
def test_blocked_plan_equals_the_torch_plan(interpret, t, k, e, spare, block):
    """Blocks of ``block`` routes (many blocks, a partial last one, slots empty in some blocks, padding routes
    and masked rows) give exactly the torch plan: the stable order, rows, ends, gates, sent counts."""
    from ray_moe.moe.dispatch.route_plan import plan_routes_blocked

    tables, g = _random_tables(e, spare, t * 31 + e)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids[torch.rand(t, k, generator=g) < 0.15] = -1
    w, rv = torch.rand(t, k, generator=g), torch.rand(t, generator=g) > 0.25
    for row_valid in (None, rv):
        got = plan_routes_blocked(ids, w, row_valid, tables, block=block)
        want = plan_routes_torch(ids, w, row_valid, tables)
        for f in ("src", "gates", "order", "ends", "slot_rows", "sent", "ok"):
            assert torch.equal(getattr(got, f), getattr(want, f)), f


@pytest.mark.parametrize("t,k,e,spare", [(37, 8, 12, 2), (9, 2, 5, 0), (64, 4, 30, 1)])
def test_one_program_plan_equals_the_torch_plan(interpret, t, k, e, spare):
    """The one-program kernel (decode sizes on CUDA), launched as ``plan_routes`` launches it, on CPU tensors."""
    from ray_moe.moe.dispatch import route_plan as rp

    tables, g = _random_tables(e, spare, t * 7 + e)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids[torch.rand(t, k, generator=g) < 0.15] = -1
    w, rv = torch.rand(t, k, generator=g), torch.rand(t, generator=g) > 0.25
    n, q, s = t * k, tables.num_local, int(tables.phys_local.numel())
    for row_valid in (None, rv):
        plan = rp._empty_plan(n, q, s, ids.device)
        flat = ids.reshape(-1).contiguous()
        rows = row_valid.contiguous().view(torch.uint8) if row_valid is not None else flat
        rp._kernel()[0][(1,)](flat, w.reshape(-1).contiguous(), rows, tables.expert_slot, tables.phys_local, plan.src,
                              plan.gates, plan.order, plan.ends, plan.slot_rows, plan.sent, plan.ok.view(torch.uint8),
                              n, int(tables.expert_slot.numel()), q, s, K=k, HAS_RV=row_valid is not None,
                              BLOCK_N=max(rp._pow2(n), 16), BLOCK_Q=rp._pow2(q + 2), BLOCK_S=rp._pow2(s))
        want = plan_routes_torch(ids, w, row_valid, tables)
        for f in ("src", "gates", "order", "ends", "slot_rows", "sent", "ok"):
            assert torch.equal(getattr(plan, f), getattr(want, f)), f


def test_blocked_shape_and_refusals():
    from ray_moe.moe.dispatch.route_plan import (BLOCKED_MAX_BLOCKS, ROUTE_PLAN_MAX, blocked_shape, kernel_available,
                                                 plan_routes_blocked)

    assert blocked_shape(8192 * 8, 130) == (1024, 64, 256)  # an 8k-token prefill step of the Qwen3-30B-A3B shape
    assert blocked_shape(8448 * 8, 130) == (2048, 33, 256)  # past 64 blocks of 1,024: 2,048 routes a block
    assert blocked_shape(4097, 6) == (256, 17, 8)  # a decode step's routes in blocks of 256 (BLOCKED_MIN_BLOCK)
    assert blocked_shape(BLOCKED_MAX_BLOCKS * 4096 + 1, 8) is None and blocked_shape(5000, 600) is None
    assert not kernel_available(torch.zeros(ROUTE_PLAN_MAX + 1, dtype=torch.int64), 6)  # CPU tensors: the torch plan
    tables, _ = _random_tables(6, 0, 0)
    with pytest.raises(ValueError, match="block=24"):
        plan_routes_blocked(torch.zeros(10, 2, dtype=torch.int64), torch.rand(10, 2), None, tables, block=24)


def test_blocked_plan_kernels_compile_for_hopper():
    """Triton's compiler (no GPU needed) builds the blocked plan's three launches for sm_90 at an 8k-token step's
    shape, and the one-program plan at 1,024 routes."""
    triton = pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("the kernels are built for the interpreter here, or run for real (the CUDA test above)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ray_moe.moe.dispatch import route_plan

    one, _, hist, offsets, scatter = route_plan._kernel()

    def build(fn, types, consts, warps):
        sig = dict(zip([a for a in fn.arg_names if a not in consts], types.split()))
        triton.compile(ASTSource(fn, {**sig, **{c: "constexpr" for c in consts}}, consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

    common = dict(K=8, HAS_RV=True, B=1024, QB=256)
    build(hist, "*i64 *bf16 *u8 *i32 *fp32 *i32 i32 i32 i32", common, 4)
    build(offsets, "*i32 *i32 *i32 *i64 *i64 *i32 *u8 i32 i32 i32", dict(PP=64, QB=256, BLOCK_S=256), 8)
    build(scatter, "*i64 *u8 *i32 *i32 *i32 *i64 i32 i32 i32", common, 4)
    build(one, "*i64 *bf16 *u8 *i32 *i32 *i64 *fp32 *i32 *i32 *i64 *i64 *u8 i32 i32 i32 i32",
          dict(K=8, HAS_RV=True, BLOCK_N=1024, BLOCK_Q=256, BLOCK_S=256), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,spare", [(8192, 8, 128, 2), (1000, 8, 128, 0), (8448, 8, 256, 5), (600, 8, 60, 1)])
def test_cuda_blocked_plan_equals_the_torch_plan(t, k, e, spare):
    from ray_moe.moe.dispatch.route_plan import kernel_available

    tables, g = _random_tables(e, spare, t + e)
    cuda = RouteTables(tables.expert_slot.cuda(), tables.phys_local.cuda(), tables.num_local)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids[torch.rand(t, k, generator=g) < 0.1] = -1
    w, rv = torch.rand(t, k, generator=g), torch.rand(t, generator=g) > 0.2
    for row_valid in (None, rv):
        assert kernel_available(ids.cuda(), tables.num_local)
        got = plan_routes(ids.cuda(), w.cuda(), None if row_valid is None else row_valid.cuda(), cuda)
        want = plan_routes_torch(ids, w, row_valid, tables)
        for f in ("src", "gates", "order", "ends", "slot_rows", "sent", "ok"):
            assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
