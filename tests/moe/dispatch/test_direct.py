"""The direct data path (``dispatch/direct.py``) against the engine path and the naive references.

Property test over the same random scenarios as ``test_properties`` (random replica layouts, peer
orders, group subsets, every replica policy) and every chunk count 1..3:

* the agreed count matrix, expert counts and expert-major rows equal ``engine.dispatch``'s exactly;
* the combined output of a tagged "expert" (rows encode their expert-major position) equals the
  engine's combine (float64: exact up to summation order) and ``reference_moe`` with real experts;
* bad input: the offending rank raises the engine's validation error, every peer aborts with
  CountAgreementError, no payload moves; a stale generation aborts every rank;
* the layout helpers (chunk bounds, blocks, expert-major shifts) against hand-computed values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.moe.dispatch.direct import DirectDispatcher
from ray_moe.moe.dispatch.direct_layout import _HostMaps, build_layout, chunk_bounds, chunk_major_blocks, chunk_table
from ray_moe.shard.fault_wrappers import FaultyExchange, ShardFault
from ray_moe.moe.dispatch.engine import combine, dispatch
from ray_moe.moe.dispatch.protocol import ControlStatus, DeferredChecks
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.core.routes import RouteBatch
from ray_moe.core.errors import CountAgreementError, RouteValidationError, StaleGenerationError
from ray_moe.moe.experts.runners import make_runner
from ray_moe.moe.experts.weights import SeededWeightSource, SlotWeights
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.selector import make_selector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe_dev.testing.reference import reference_moe
from tests.moe.dispatch.test_properties import SETTINGS, D, _build, _selector, scenarios


# ------------------------------------------------------------------------------------- layout helpers
def test_chunk_bounds_and_tables():
    assert chunk_bounds(10, 3).tolist() == [0, 3, 6, 10]
    assert chunk_bounds(0, 2).tolist() == [0, 0, 0]
    t = chunk_table(np.array([5, 7, 2]), me=1, chunks=2)
    assert t.tolist() == [[2, 0, 1], [3, 0, 1]]  # own column never travels
    starts, lens = chunk_major_blocks(np.array([5, 7, 2]), me=1, chunks=2)
    # segments start at 0 (peer 0), 5 (peer 1, own), 12 (peer 2); chunk-major, own skipped
    assert starts.tolist() == [0, 12, 2, 13] and lens.tolist() == [2, 1, 3, 1]


def test_build_layout_hand_example():
    # 2 peers, 4 slots: slots 0,2 on peer 0 (local order [2, 0]), slots 1,3 on peer 1
    slot_counts = np.array([[1, 2, 3, 4],   # peer 0 sends 1 row to q0, 3 to q2 (own), 2 to q1, 4 to q3
                            [5, 6, 7, 8]])
    my_slots = np.array([2, 0])
    maps = _HostMaps(slot_peer=np.array([0, 1, 0, 1]), onehot=np.array([[1, 0], [0, 1], [1, 0], [0, 1]]),
                     my_slots=my_slots, by_id=np.argsort(my_slots))
    lay = build_layout(slot_counts, maps, me=0, chunks=1)
    assert lay.send_splits.tolist() == [4, 6] and lay.recv_splits.tolist() == [4, 12]
    assert lay.expert_counts.tolist() == [3 + 7, 1 + 5]  # local order: q2 then q0
    # source-major rows: peer 0 segment = q0 (1 row), q2 (3 rows); peer 1 segment = q0 (5), q2 (7)
    em = np.arange(16) + np.repeat(lay.em_shift, lay.em_repeats)
    # expert-major: q2 rows [0..10) = src0 (3) then src1 (7); q0 rows [10..16) = src0 (1) then src1 (5)
    assert em.tolist() == [10, 0, 1, 2, 11, 12, 13, 14, 15, 3, 4, 5, 6, 7, 8, 9]


# ------------------------------------------------------------------------------------- against the engine
def _tagged(rows: torch.Tensor) -> torch.Tensor:
    """A stand-in expert whose output encodes each row's expert-major position (and its input)."""
    pos = torch.arange(rows.shape[0], dtype=rows.dtype)[:, None]
    return rows * 3.0 + pos


@settings(max_examples=60, **SETTINGS)
@given(sc=scenarios(), chunks=st.integers(1, 3))
def test_direct_equals_engine(sc, chunks):
    snap, group, batches = _build(sc, torch.float64)
    sel_engine = {r: _selector(sc) for r in sc["members"]}
    sel_direct = {r: _selector(sc) for r in sc["members"]}

    def engine_step(ex):
        h, ids, w = batches[ex.rank]
        out = dispatch(RouteBatch(ex.rank, h, ids, w), snap, ex, selector=sel_engine[ex.rank], tag="e")
        y = combine(_tagged(out.rows), out.handle, snap, ex, tag="e", out_dtype=torch.float64)
        return out, y

    def direct_step(ex):
        h, ids, w = batches[ex.rank]
        dd = DirectDispatcher(ex, sel_direct[ex.rank], chunks=chunks)
        out = dd.dispatch(RouteBatch(ex.rank, h, ids, w), snap, tag="d")
        y = dd.combine(_tagged(out.rows), out.handle, snap, tag="d", out_dtype=torch.float64)
        return out, y

    members = sc["members"]
    want = dict(zip(members, LocalExchangeGroup(group).run(engine_step)))
    got = dict(zip(members, LocalExchangeGroup(group).run(direct_step)))
    for r in members:
        (eo, ey), (do, dy) = want[r], got[r]
        assert do.handle.count_matrix.tolist() == eo.handle.count_matrix.tolist()
        assert do.counts_list == eo.counts_list
        assert do.expert_counts.tolist() == list(eo.counts_list)
        assert torch.equal(do.rows, eo.rows)  # same rows in the same expert-major order
        assert do.handle.generation == snap.generation and do.handle.rank == r
        assert dy.shape == ey.shape
        torch.testing.assert_close(dy, ey, rtol=1e-12, atol=1e-9)
        # every route is sent exactly once: own rows + peer rows = T * k
        t, k = batches[r][1].shape
        own = int((do.handle.route_src >= 0).sum())
        assert own + do.handle.remote_sent == t * k


@settings(max_examples=25, **SETTINGS)
@given(sc=scenarios(), chunks=st.integers(1, 2))
def test_direct_full_path_equals_reference_moe(sc, chunks):
    snap, group, batches = _build(sc, torch.float64)
    source = SeededWeightSource(num_layers=1, num_experts=sc["E"], hidden_size=D, ffn_size=16,
                                seed=sc["seed"] % 97, dtype=torch.float64)
    runner = make_runner("loop")
    selectors = {r: _selector(sc) for r in sc["members"]}

    def step(ex):
        h, ids, w = batches[ex.rank]
        dd = DirectDispatcher(ex, selectors[ex.rank], chunks=chunks)
        out = dd.dispatch(RouteBatch(ex.rank, h, ids, w), snap, tag="f")
        slots = snap.rank_slot_ids(ex.rank).tolist()
        weights = (SlotWeights.stack(0, slots, [source.expert(0, int(snap.phy2log[q])) for q in slots])
                   if slots else None)
        y_rows = runner.run(out.rows, out.counts_list, weights) if weights is not None else out.rows
        return dd.combine(y_rows, out.handle, snap, tag="f", out_dtype=torch.float64)

    members = sc["members"]
    got = dict(zip(members, LocalExchangeGroup(group).run(step)))
    for r in members:
        h, ids, w = batches[r]
        ref = reference_moe(h, ids, w, lambda e: source.expert(0, e))
        torch.testing.assert_close(got[r], ref, rtol=1e-5, atol=1e-5)  # FP32 accumulation (spec 0x0AE)


# ------------------------------------------------------------------------------------- refusals
def _two_rank_setup(tokens=6, k=2, e=4):
    topo = Topology.single_node(2)
    man = manifest_from_assignment(generation=3, phy2log=[list(range(e))], slot_rank=[[q % 2 for q in range(e)]],
                                   num_experts=e, topology=topo)
    group = ProcessGroupSpec.identity(2)
    snap = PlacementSnapshot.from_manifest(man, topo, group)
    g = torch.Generator().manual_seed(1)
    batches = {}
    for r in range(2):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
        batches[r] = RouteBatch(r, torch.randn(tokens, 8, generator=g), ids, torch.rand(tokens, k, generator=g))
    return snap, group, batches


@pytest.mark.parametrize("fault", ["expert_range", "nan_hidden", "negative_gate"])
def test_bad_input_aborts_every_rank_with_the_engine_error(fault):
    snap, group, batches = _two_rank_setup()
    b = batches[1]
    ids, h, w = b.topk_ids.clone(), b.hidden.clone(), b.topk_weights.clone()
    if fault == "expert_range":
        ids[2, 1] = 9
    elif fault == "nan_hidden":
        h[3, 0] = float("nan")
    else:
        w[0, 0] = -0.5
    batches[1] = RouteBatch(1, h, ids, w)
    sel = make_selector("round_robin")

    def step(ex):
        try:
            DirectDispatcher(ex, sel).dispatch(batches[ex.rank], snap, tag="bad")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
        return None

    errs = LocalExchangeGroup(group).run(step)
    assert isinstance(errs[1], RouteValidationError)
    assert {"expert_range": "expert id 9", "nan_hidden": "NaN", "negative_gate": "negative gate"}[fault] in str(errs[1])
    assert isinstance(errs[0], CountAgreementError) and "rank(s) [(1, 'BAD_INPUT')]" in str(errs[0])


def test_stale_generation_aborts_every_rank():
    snap, group, batches = _two_rank_setup()
    sel = make_selector("round_robin")

    def step(ex):
        status = ControlStatus.STALE_GENERATION if ex.rank == 0 else ControlStatus.OK
        try:
            DirectDispatcher(ex, sel).dispatch(batches[ex.rank], snap, tag="stale", status=status)
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    errs = LocalExchangeGroup(group).run(step)
    assert all(isinstance(e, StaleGenerationError) for e in errs)


def test_combine_refuses_another_generation_and_wrong_rows():
    snap, group, batches = _two_rank_setup()
    sel = make_selector("round_robin")
    other = PlacementSnapshot.from_manifest(
        manifest_from_assignment(generation=4, phy2log=[list(range(4))], slot_rank=[[q % 2 for q in range(4)]],
                                 num_experts=4, topology=Topology.single_node(2)),
        Topology.single_node(2), group)

    def step(ex):
        dd = DirectDispatcher(ex, sel)
        out = dd.dispatch(batches[ex.rank], snap, tag="g")
        with pytest.raises(StaleGenerationError, match="generation 3"):
            dd.combine(out.rows, out.handle, other, tag="g", out_dtype=torch.float32)
        with pytest.raises(RouteValidationError, match="expert_rows"):
            dd.combine(out.rows[:-1], out.handle, snap, tag="g", out_dtype=torch.float32)
        return dd.combine(out.rows, out.handle, snap, tag="g", out_dtype=torch.float32)

    ys = LocalExchangeGroup(group).run(step)
    for r, y in enumerate(ys):  # identity expert: y_t = h_t * sum_j g_tj
        b = batches[r]
        torch.testing.assert_close(y, b.hidden * b.topk_weights.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)


def test_chunks_must_be_positive():
    snap, group, _ = _two_rank_setup()
    ex = LocalExchangeGroup(group).endpoint(0)
    with pytest.raises(ValueError, match="chunks=0"):
        DirectDispatcher(ex, make_selector("round_robin"), chunks=0)


@pytest.mark.parametrize("fault", ["count", "scale"])
def test_injected_control_faults_abort_every_rank(fault):
    snap, group, batches = _two_rank_setup()
    sel = make_selector("round_robin")

    def step(ex):
        kind = ShardFault.COUNT if fault == "count" else ShardFault.SCALE
        endpoint = FaultyExchange(ex, frozenset({kind})) if ex.rank == 1 else ex
        try:
            DirectDispatcher(endpoint, sel).dispatch(batches[ex.rank], snap, tag="f")
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    errs = LocalExchangeGroup(group).run(step)
    assert all(isinstance(e, CountAgreementError) for e in errs)
    assert ("split vector" if fault == "count" else "scale count mismatch") in str(errs[0])


def test_handle_check_catches_a_corrupt_route_map():
    from ray_moe.shard.fault_wrappers import corrupt_handle
    from ray_moe.moe.dispatch.direct import handle_ok

    snap, group, batches = _two_rank_setup()
    sel = make_selector("round_robin")

    def step(ex):
        dd = DirectDispatcher(ex, sel)
        out = dd.dispatch(batches[ex.rank], snap, tag="h")
        good = bool(handle_ok(out.handle))
        bad = corrupt_handle(out.handle)
        checks = DeferredChecks()
        dd.combine(out.rows, bad, snap, tag="h", out_dtype=torch.float32, checks=checks)
        try:
            checks.verify()
            deferred = ""
        except RouteValidationError as exc:
            deferred = str(exc)
        try:
            dd.combine(out.rows, bad, snap, tag="h2", out_dtype=torch.float32)
        except RouteValidationError as exc:
            return good, deferred, str(exc)
        return good, deferred, ""

    for good, deferred, msg in LocalExchangeGroup(group).run(step):
        assert good and "output rejected before publish" in deferred
        assert "output rejected before publish" in msg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_in_one_process_capture_their_first_plans_at_once():
    """Two ranks of one process on one GPU capture their first plan graphs at the same moment (a barrier):
    captures take turns (``_PlanGraph.CAPTURE_LOCK``) and both replay the eager plan. Without the turns one
    rank's capture failed ("Cannot register the state during capturing stage": the process's one CUDA generator
    takes one capture at a time) and its peer waited on the exchange (bench.rebalance_memory's two-rank GPU run,
    bench/results/logs/rebalance_memory-h200x1-48l-s14-failed.log)."""
    import threading

    from ray_moe.moe.dispatch.direct import _PlanGraph, _plan_tensors

    sc = dict(P=2, E=8, k=2, phy2log=list(range(8)) + [0, 5], slot_rank=[0, 1] * 5, nodes=1, peer_order=(0, 1),
              members=[0, 1], tokens=[12, 9], policy="round_robin", observe=None, seed=3)
    snap, _, batches = _build(sc, torch.float32)
    barrier, got, errors = threading.Barrier(2), {}, []

    def rank(r: int) -> None:
        try:
            _, ids, w = batches[r]
            ids, w = ids.cuda(), w.cuda()
            barrier.wait()
            g = _PlanGraph(ids, w, snap, _selector(sc), r)
            got[r] = [t.clone() for t in g.run(ids, w)]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for r in (0, 1):
        _, ids, w = batches[r]
        want = _plan_tensors(ids.cuda(), w.cuda(), snap, _selector(sc), r)
        assert all(torch.equal(a, b) for a, b in zip(got[r], want)), r
