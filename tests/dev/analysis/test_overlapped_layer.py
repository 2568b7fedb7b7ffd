"""The overlapped MoE layer (``ray_moe_dev.analysis.overlapped_layer``) on CPU, over LocalExchangeGroup (1-4 ranks).

On CPU every stream is ``None``, so the DAG runs serially in issue order; what is checked here is the
protocol and the arithmetic the GPU run relies on:

* output == the unchunked engine path (``engine.dispatch`` -> grouped runner -> ``engine.combine``) and
  == ``reference_moe`` (+ the shared SwiGLU), for chunks 1, 2, 3, 5 (chunks > tokens: empty chunks), with
  and without a shared expert, random replicas and slot orders, a rank without tokens, the serialized
  baseline and both communication orders;
* ONE control round per step, and every rank issues the same payload rounds in the same (chunk) order;
* the per-chunk count matrices add up to the engine's count matrix (conservation);
* the recorded DAG is a valid ``overlap_schedule.Schedule`` (no task before its dependencies, no overlap on a
  stream) and every buffer outlives its last reader (``check_release``);
* bad routes abort every rank before payload; bad arguments raise ValueError naming the field.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_moe_dev.analysis.overlapped_layer import chunk_bounds, comm_sequence, overlapped_layer
from ray_moe_dev.analysis.overlapped_streams import MEASURED, ROLES, StreamSet, step_buffers
from ray_moe.moe.dispatch.engine import combine, dispatch
from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.core.routes import RouteBatch
from ray_moe.core.errors import CountAgreementError, RouteValidationError
from ray_moe.moe.experts.runners import make_runner
from ray_moe.moe.experts.weights import ExpertWeights, SeededWeightSource, SlotWeights, swiglu
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.selector import make_selector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe_dev.testing.reference import reference_moe

D, F, FS = 16, 32, 24  # hidden, expert FFN, shared-expert FFN (multiples of 4: fp32 grouped-mm strides)
TOL_ENGINE = dict(rtol=1e-5, atol=1e-5)
TOL_REF = dict(rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------- fixtures
class RecordingExchange(Exchange):
    """Delegates to a real endpoint and logs every collective: ("gather", tag) / ("a2a", tag, send, recv)."""

    def __init__(self, inner: Exchange, log: list) -> None:
        self._inner = inner
        self.rank = inner.rank
        self.group = inner.group
        self.log = log

    def all_gather(self, tag: str, vec: np.ndarray) -> np.ndarray:
        self.log.append(("gather", tag))
        return self._inner.all_gather(tag, vec)

    def all_to_all_v(self, tag: str, tensors: Mapping[str, torch.Tensor], send_splits: Sequence[int],
                     recv_splits: Sequence[int]) -> dict[str, torch.Tensor]:
        self.log.append(("a2a", tag, tuple(int(x) for x in send_splits), tuple(int(x) for x in recv_splits)))
        return self._inner.all_to_all_v(tag, tensors, send_splits, recv_splits)


def scenario(world: int, seed: int, *, experts: int = 6, replicas: int = 3, tokens: Sequence[int] | None = None,
             k: int = 2, empty_rank: bool = False, peer_order: Sequence[int] | None = None):
    """A random placement (every expert once + ``replicas`` extra copies, random slot order and ranks; with
    ``empty_rank`` the last rank hosts no slot) and random routes per rank (distinct top-k experts)."""
    g = torch.Generator().manual_seed(seed)
    phy2log = list(range(experts)) + torch.randint(0, experts, (replicas,), generator=g).tolist()
    perm = torch.randperm(len(phy2log), generator=g).tolist()
    phy2log = [phy2log[i] for i in perm]
    hosts = world - 1 if (empty_rank and world > 1) else world
    slot_rank = [i % hosts for i in range(len(phy2log))]  # every hosting rank has a slot
    shuffle = torch.randperm(len(slot_rank), generator=g).tolist()
    slot_rank = [slot_rank[i] for i in shuffle]
    topo = Topology.single_node(world)
    manifest = manifest_from_assignment(generation=3, phy2log=[phy2log], slot_rank=[slot_rank], num_experts=experts,
                                        topology=topo)
    group = ProcessGroupSpec(group_id="ep-group-0", peer_order=tuple(peer_order or range(world)), epoch=2)
    snap = PlacementSnapshot.from_manifest(manifest, topo, group)
    if tokens is None:
        tokens = torch.randint(0, 8, (world,), generator=g).tolist()
    batches = {}
    for r in range(world):
        t = tokens[r]
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)]) if t else \
            torch.zeros(0, k, dtype=torch.int64)
        batches[r] = (torch.randn(t, D, generator=g), ids.to(torch.int64), torch.rand(t, k, generator=g))
    source = SeededWeightSource(num_layers=1, num_experts=experts, hidden_size=D, ffn_size=F, seed=seed % 101)
    return snap, group, batches, source


def slot_weights(snap: PlacementSnapshot, rank: int, source: SeededWeightSource) -> SlotWeights | None:
    ids = snap.rank_slot_ids(rank).tolist()
    if not ids:
        return None
    return SlotWeights.stack(0, ids, [source.expert(0, int(snap.phy2log[q])) for q in ids])


def shared_weights(seed: int, dtype: torch.dtype = torch.float32) -> ExpertWeights:
    g = torch.Generator().manual_seed(10_000 + seed)
    return ExpertWeights(0, -1, torch.randn(FS, D, generator=g).to(dtype) / D**0.5,
                         torch.randn(FS, D, generator=g).to(dtype) / D**0.5,
                         torch.randn(D, FS, generator=g).to(dtype) / FS**0.5)


def run_both(snap, group, batches, source, *, chunks: int, shared: ExpertWeights | None, serialized: bool = False,
             comm_order: str = "dispatch_first", policy: str = "round_robin"):
    """Overlapped step, then the engine path on the same inputs, on every rank; returns rank -> dict."""
    runner = make_runner("grouped")

    def step(ex: Exchange) -> dict:
        log: list = []
        rex = RecordingExchange(ex, log)
        h, ids, w = batches[ex.rank]
        weights = slot_weights(snap, ex.rank, source)
        res = overlapped_layer(RouteBatch(ex.rank, h, ids, w), snap, rex, selector=make_selector(policy),
                               runner=runner, weights=weights, tag="ov", chunks=chunks, shared_expert=shared,
                               serialized=serialized, comm_order=comm_order)
        out = dispatch(RouteBatch(ex.rank, h, ids, w), snap, ex, selector=make_selector(policy), tag="en")
        rows = runner.run(out.rows, out.counts_list, weights) if weights is not None else out.rows
        y = combine(rows, out.handle, snap, ex, tag="en", out_dtype=torch.float32)
        if shared is not None:
            y = y + swiglu(h, shared.w_gate, shared.w_up, shared.w_down).float()
        return {"res": res, "engine": y, "log": log, "count_matrix": out.handle.count_matrix,
                "counts": out.counts_list}

    members = sorted(group.peer_order)
    return dict(zip(members, LocalExchangeGroup(group, timeout_s=20.0).run(step)))


def check_step(snap, group, batches, source, got, *, chunks: int, shared: ExpertWeights | None,
               comm_order: str = "dispatch_first") -> None:
    k = next(iter(batches.values()))[1].shape[1]
    for r, out in got.items():
        res, h = out["res"], batches[r][0]
        # 1. numbers: engine path and the naive reference
        assert res.hidden.shape == h.shape and res.hidden.dtype == h.dtype
        torch.testing.assert_close(res.hidden, out["engine"], **TOL_ENGINE)
        ref = reference_moe(h, batches[r][1], batches[r][2], lambda e: source.expert(0, e))
        if shared is not None:
            ref = ref + swiglu(h.double(), shared.w_gate.double(), shared.w_up.double(), shared.w_down.double())
        torch.testing.assert_close(res.hidden.double(), ref, **TOL_REF)
        # 2. conservation: per-chunk count matrices add up to the engine's, expert counts too
        assert res.count_matrices.shape == (chunks, snap.num_ranks, snap.num_ranks)
        assert torch.equal(res.count_matrices.sum(0), out["count_matrix"])
        assert tuple(map(sum, zip(*res.expert_counts))) == tuple(out["counts"]) or not out["counts"]
        assert res.chunk_bounds == chunk_bounds(h.shape[0], chunks)
        for c in range(chunks):
            want = (res.chunk_bounds[c + 1] - res.chunk_bounds[c]) * k
            assert int(res.count_matrices[c, r].sum()) == want
        # 3. one control round, then the payload rounds in chunk order, skipping globally empty chunks
        totals = res.count_matrices.sum(dim=(1, 2)).tolist()
        want_tags = [("gather", "ov/ctl")] + [
            ("a2a", f"ov/{'dispatch' if kind == 'dispatch' else 'combine'}{c}")
            for kind, c in comm_sequence(chunks, comm_order) if totals[c]
        ]
        assert [e[:2] for e in out["log"]] == want_tags
        # 4. the recorded DAG validates as a measured schedule, buffers outlive their last readers
        tl = res.timeline()
        assert tl.evidence == MEASURED and tl.schedule.evidence == MEASURED
        names = [t.name for t in res.tasks]
        assert names.count("count_agreement") == 1 and names[-1] == "reduce"
        assert ("shared_path" in names) == (shared is not None)
        released = {b for b, _, _ in tl.release.last_reader}
        assert released == {u.name for u in step_buffers(chunks, shared=shared is not None)}
        reduce_deps = set(tl.schedule["reduce"].task.deps)
        assert reduce_deps == {f"scatter_{c}" for c in range(chunks)} | ({"shared_path"} if shared else set())
    # every rank issued the identical sequence of collectives (same tags, same order)
    logs = [[e[:2] for e in out["log"]] for out in got.values()]
    assert all(lg == logs[0] for lg in logs)


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_equals_engine_and_reference(world, chunks, shared):
    seed = 100 * world + 10 * chunks + int(shared)
    tokens = [(7, 0, 2, 4)[r] for r in range(world)] if world > 1 else [3]  # a rank with no token; T < chunks
    snap, group, batches, source = scenario(world, seed, tokens=tokens)
    sw = shared_weights(seed) if shared else None
    got = run_both(snap, group, batches, source, chunks=chunks, shared=sw)
    check_step(snap, group, batches, source, got, chunks=chunks, shared=sw)


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
def test_serialized_baseline_equals_engine(chunks, shared):
    snap, group, batches, source = scenario(3, 7 + chunks, tokens=[5, 6, 1])
    sw = shared_weights(3) if shared else None
    got = run_both(snap, group, batches, source, chunks=chunks, shared=sw, serialized=True)
    check_step(snap, group, batches, source, got, chunks=chunks, shared=sw)
    for out in got.values():
        res = out["res"]
        assert res.serialized and {t.stream for t in res.tasks} == {"serial"}
        assert res.timeline().overlap_ms == 0.0  # one stream: nothing can overlap
        if shared:  # the baseline issues the shared expert just before the reduce
            assert [t.name for t in res.tasks][-2:] == ["shared_path", "reduce"]


@pytest.mark.parametrize("chunks", [2, 5])
def test_interleaved_comm_order(chunks):
    snap, group, batches, source = scenario(2, 31 + chunks, tokens=[6, 4])
    sw = shared_weights(5)
    got = run_both(snap, group, batches, source, chunks=chunks, shared=sw, comm_order="interleaved")
    check_step(snap, group, batches, source, got, chunks=chunks, shared=sw, comm_order="interleaved")


def test_streams_and_task_labels_on_cpu():
    snap, group, batches, source = scenario(2, 3, tokens=[4, 5])
    got = run_both(snap, group, batches, source, chunks=2, shared=shared_weights(1))
    res = got[0]["res"]
    by = {t.name: t for t in res.tasks}
    assert by["route_plan"].stream == by["pack_1"].stream == "compute"
    assert {by[n].stream for n in ("count_agreement", "dispatch_0", "combine_1")} == {"communication"}
    assert by["expert_0"].stream == "expert" and by["shared_path"].stream == "shared"
    assert by["scatter_0"].stream == by["reduce"].stream == "output"
    assert by["dispatch_1"].deps == ("pack_1", "count_agreement") and by["expert_1"].deps == ("dispatch_1",)
    assert {t.kind for t in res.tasks if t.stream == "communication"} == {"communication"}
    assert by["pack_0"].rows + by["pack_1"].rows == 4 * 2
    cpu_streams = StreamSet.for_device("cpu")
    assert not cpu_streams.on_cuda and all(cpu_streams.stream(r) is None for r in ROLES)
    assert StreamSet.for_device("cpu", serialized=True).label("expert") == "serial"
    d = res.timeline().as_dict()
    assert d["evidence"] == "measured" and d["unit"] == "ms" and len(d["tasks"]) == len(res.tasks)
    assert [t.name for t in res.dag()] == [t.name for t in res.tasks]


def test_chunks_beyond_tokens_and_empty_group_chunks():
    # every rank has 2 tokens, 5 chunks: chunks 0, 2 (of b = [0,0,0,1,1,2]) are empty on every rank and skip
    # both payload rounds; a rank that hosts no slot still takes part in every round
    snap, group, batches, source = scenario(3, 11, tokens=[2, 2, 2], empty_rank=True)
    sw = shared_weights(2)
    got = run_both(snap, group, batches, source, chunks=5, shared=sw)
    check_step(snap, group, batches, source, got, chunks=5, shared=sw)
    assert chunk_bounds(2, 5) == (0, 0, 0, 1, 1, 2)
    log = got[0]["log"]
    assert [e[1] for e in log if e[0] == "a2a"] == ["ov/dispatch2", "ov/dispatch4", "ov/combine2", "ov/combine4"]


def test_all_ranks_without_tokens():
    snap, group, batches, source = scenario(2, 5, tokens=[0, 0])
    got = run_both(snap, group, batches, source, chunks=3, shared=shared_weights(4))
    for out in got.values():
        assert out["res"].hidden.shape == (0, D)
        assert [e[0] for e in out["log"]] == ["gather"]  # no payload round at all


def test_peer_order_is_not_rank_order():
    snap, group, batches, source = scenario(3, 21, tokens=[5, 3, 6], peer_order=(2, 0, 1))
    got = run_both(snap, group, batches, source, chunks=2, shared=None)
    check_step(snap, group, batches, source, got, chunks=2, shared=None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    snap, group, batches, source = scenario(2, 41, tokens=[6, 5])
    batches = {r: (h.to(dtype), i, w) for r, (h, i, w) in batches.items()}
    src = SeededWeightSource(num_layers=1, num_experts=6, hidden_size=D, ffn_size=F, seed=41 % 101, dtype=dtype)
    sw = shared_weights(6, dtype)
    got = run_both(snap, group, batches, src, chunks=3, shared=sw)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else TOL_ENGINE  # FP32 accumulation, both
    for out in got.values():
        assert out["res"].hidden.dtype == dtype
        torch.testing.assert_close(out["res"].hidden.float(), out["engine"].to(dtype).float(), **tol)


def test_bad_routes_abort_every_rank_before_payload():
    snap, group, batches, source = scenario(3, 9, tokens=[4, 4, 4])
    h, ids, w = batches[1]
    ids = ids.clone()
    ids[2, 0] = 99  # out of range on rank 1 only
    batches[1] = (h, ids, w)
    runner = make_runner("grouped")

    def step(ex):
        log: list = []
        hh, ii, ww = batches[ex.rank]
        try:
            overlapped_layer(RouteBatch(ex.rank, hh, ii, ww), snap, RecordingExchange(ex, log),
                             selector=make_selector("round_robin"), runner=runner,
                             weights=slot_weights(snap, ex.rank, source), tag="bad", chunks=2)
        except Exception as exc:  # noqa: BLE001 - the type is the assertion
            return type(exc), str(exc), log
        return None, "", log

    out = LocalExchangeGroup(group, timeout_s=10.0).run(step)
    assert out[1][0] is RouteValidationError and "topk_ids" in out[1][1]
    assert out[0][0] is CountAgreementError and out[2][0] is CountAgreementError
    for _, _, log in out:
        assert [e[0] for e in log] == ["gather"]  # aborted before any payload round


def test_wrong_slot_from_selector_aborts_every_rank():
    snap, group, batches, source = scenario(2, 13, tokens=[3, 3])

    class WrongSelector:
        def select(self, routes, snapshot):
            return (snapshot.log2phy[routes.logical_expert, 0] + 1) % snapshot.num_slots  # another expert's slot

    def step(ex):
        hh, ii, ww = batches[ex.rank]
        sel = WrongSelector() if ex.rank == 0 else make_selector("hash")
        try:
            overlapped_layer(RouteBatch(ex.rank, hh, ii, ww), snap, ex, selector=sel, runner=make_runner("grouped"),
                             weights=slot_weights(snap, ex.rank, source), tag="ws", chunks=3)
        except Exception as exc:  # noqa: BLE001
            return type(exc), str(exc)
        return None, ""

    out = LocalExchangeGroup(group, timeout_s=10.0).run(step)
    assert out[0][0] is RouteValidationError and "stores logical expert" in out[0][1]
    assert out[1][0] is CountAgreementError


def test_argument_errors_name_the_field():
    snap, group, batches, source = scenario(1, 17, tokens=[4])
    ex = LocalExchangeGroup(group, timeout_s=2.0).endpoint(0)
    h, ids, w = batches[0]
    batch = RouteBatch(0, h, ids, w)
    weights = slot_weights(snap, 0, source)
    kw = dict(selector=make_selector("round_robin"), runner=make_runner("grouped"), weights=weights, tag="a")
    for chunks in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="chunks="):
            overlapped_layer(batch, snap, ex, chunks=chunks, **kw)
    with pytest.raises(ValueError, match="comm_order="):
        overlapped_layer(batch, snap, ex, chunks=2, comm_order="random", **kw)
    with pytest.raises(ValueError, match="weights"):
        overlapped_layer(batch, snap, ex, chunks=2, **{**kw, "weights": None})
    with pytest.raises(ValueError, match="shared_expert.w_gate"):
        bad = ExpertWeights(0, -1, torch.zeros(FS, D + 1), torch.zeros(FS, D + 1), torch.zeros(D + 1, FS))
        overlapped_layer(batch, snap, ex, chunks=2, shared_expert=bad, **kw)
    with pytest.raises(ValueError, match="shared_expert.w_up"):
        sw = shared_weights(0)
        bad = ExpertWeights(0, -1, sw.w_gate, sw.w_up.double(), sw.w_down)
        overlapped_layer(batch, snap, ex, chunks=2, shared_expert=bad, **kw)
    with pytest.raises(ValueError, match="streams"):
        overlapped_layer(batch, snap, ex, chunks=2, streams="cuda", **kw)
    with pytest.raises(ValueError, match="tag="):
        overlapped_layer(batch, snap, ex, chunks=2, **{**kw, "tag": ""})
    with pytest.raises(ValueError, match="roles"):
        StreamSet(compute=object())
    with pytest.raises(ValueError, match="num_chunks"):
        step_buffers(0, shared=False)
    with pytest.raises(ValueError, match="comm_order="):
        comm_sequence(2, "zigzag")


def test_comm_sequences():
    assert comm_sequence(3, "dispatch_first") == (("dispatch", 0), ("dispatch", 1), ("dispatch", 2),
                                                  ("combine", 0), ("combine", 1), ("combine", 2))
    assert comm_sequence(3, "interleaved") == (("dispatch", 0), ("dispatch", 1), ("combine", 0), ("dispatch", 2),
                                               ("combine", 1), ("combine", 2))
    assert comm_sequence(1, "interleaved") == (("dispatch", 0), ("combine", 0))
    for n in range(1, 7):
        for order in ("dispatch_first", "interleaved"):
            seq = comm_sequence(n, order)
            assert sorted(seq) == sorted([("dispatch", c) for c in range(n)] + [("combine", c) for c in range(n)])
            assert seq.index(("dispatch", n - 1)) < seq.index(("combine", n - 1))
            for c in range(n):
                assert seq.index(("dispatch", c)) < seq.index(("combine", c))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=st.integers(1, 4), chunks=st.integers(1, 6), seed=st.integers(0, 10_000),
       k=st.integers(1, 3), shared=st.booleans(), order=st.sampled_from(["dispatch_first", "interleaved"]),
       policy=st.sampled_from(["round_robin", "hash", "least_load", "locality"]))
def test_property_equals_engine(world, chunks, seed, k, shared, order, policy):
    snap, group, batches, source = scenario(world, seed, k=k, experts=5, replicas=4)
    sw = shared_weights(seed) if shared else None
    got = run_both(snap, group, batches, source, chunks=chunks, shared=sw, comm_order=order, policy=policy)
    for r, out in got.items():
        torch.testing.assert_close(out["res"].hidden, out["engine"], **TOL_ENGINE)
        assert torch.equal(out["res"].count_matrices.sum(0), out["count_matrix"])
        out["res"].timeline()


def test_bench_rank_worker_runs_on_local_threads():
    """ray_moe/bench/overlap.py's rank function end to end on two CPU threads (tiny shape, one timed step)."""
    from ray_moe_bench.overlap import Plan, Shape, _rank_worker, configs, summarize
    from ray_moe_dev.testing.spmd import run_spmd

    plan = Plan(shapes=(Shape("t", tokens=8, d=16, f=16, experts_per_rank=2, k=2, dtype="float32", shared_f=8),),
                configs=configs((2,), ("interleaved",)), warmup=0, iters=1, seed=0)
    ranks = run_spmd(_rank_worker, 2, args=(plan,), backend="local", timeout_s=60.0, exchange_timeout_s=10.0)
    shapes = summarize(plan, ranks)
    rows = {r["config"]: r for r in shapes[0]["configs"]}
    assert set(rows) == {"serialized", "engine", "c2-interleaved", "serialized+shared", "engine+shared",
                         "c2-interleaved+shared"}
    for name, r in rows.items():
        assert r["step_ms"] > 0 and not r["timeline_errors"]
        assert r["max_rel_err_vs_serialized"] is not None and r["max_rel_err_vs_serialized"] < 1e-5
        assert (r["timeline_rank0"] is None) == (r["kind"] == "engine")
    assert rows["serialized"]["speedup_vs_serialized"] == 1.0
    assert rows["c2-interleaved+shared"]["timeline_rank0"]["evidence"] == "measured"


# ------------------------------------------------------------------ the same checks on GPUs (NCCL)
GPU = [pytest.mark.gpu, pytest.mark.multi_gpu]
GPU_D, GPU_F, GPU_FS = 128, 256, 64  # bf16 rows: 16-byte strides for the grouped kernel


def _gpu_worker(exchange: Exchange, rank: int, tokens: tuple[int, ...], seed: int, cases: tuple) -> dict:
    """Every case on this rank: overlapped (timed) vs serialized vs the engine path, bf16 on the rank's
    device; returns max relative errors, timeline validity and the overlapped outputs (for cross-checks)."""
    from ray_moe_dev.testing.spmd import exchange_device

    dev = exchange_device(exchange)
    world = exchange.size
    g = torch.Generator().manual_seed(seed)
    experts = 4 * world
    phy2log = list(range(experts)) + [1, experts - 1]
    slot_rank = [q * world // experts for q in range(experts)] + [world - 1, 0]
    topo = Topology.single_node(world)
    manifest = manifest_from_assignment(generation=0, phy2log=[phy2log], slot_rank=[slot_rank],
                                        num_experts=experts, topology=topo)
    snap = PlacementSnapshot.from_manifest(manifest, topo, ProcessGroupSpec.identity(world))
    for r in range(rank + 1):  # draw every rank's inputs in order, keep ours
        t = tokens[r]
        hidden = torch.randn(t, GPU_D, generator=g).to(torch.bfloat16)
        ids = torch.rand(t, experts, generator=g).argsort(dim=1)[:, :2].contiguous()
        gates = torch.rand(t, 2, generator=g)
    batch = RouteBatch(rank, hidden.to(dev), ids.to(dev), gates.to(dev))
    source = SeededWeightSource(num_layers=1, num_experts=experts, hidden_size=GPU_D, ffn_size=GPU_F, seed=seed,
                                dtype=torch.bfloat16)
    ids_here = snap.rank_slot_ids(rank).tolist()
    weights = SlotWeights.stack(0, ids_here, [source.expert(0, int(snap.phy2log[q])).to(dev) for q in ids_here])
    gs = torch.Generator().manual_seed(seed + 1)
    shared_w = ExpertWeights(0, -1, *(t.to(torch.bfloat16).to(dev) for t in (
        torch.randn(GPU_FS, GPU_D, generator=gs) / GPU_D**0.5, torch.randn(GPU_FS, GPU_D, generator=gs) / GPU_D**0.5,
        torch.randn(GPU_D, GPU_FS, generator=gs) / GPU_FS**0.5)))
    runner = make_runner("grouped")
    streams = StreamSet.for_device(dev)
    out: dict = {"cases": []}
    for i, (chunks, order, shared) in enumerate(cases):
        sw = shared_w if shared else None
        kw = dict(selector=make_selector("round_robin"), runner=runner, weights=weights, shared_expert=sw)
        base = overlapped_layer(batch, snap, exchange, tag=f"s{i}", chunks=1, serialized=True, **kw).hidden.float()
        ys = []
        for rep in range(2):  # twice: a stream race shows up as a difference between repeats or vs the base
            res = overlapped_layer(batch, snap, exchange, tag=f"o{i}r{rep}", chunks=chunks, comm_order=order,
                                   streams=streams, timed=True, **kw)
            ys.append(res.hidden.float())
            tl = res.timeline()  # validates dependencies, stream exclusion and release; raises otherwise
        e = dispatch(batch, snap, exchange, selector=make_selector("round_robin"), tag=f"e{i}")
        y_engine = combine(runner.run(e.rows, e.counts_list, weights), e.handle, snap, exchange, tag=f"e{i}",
                           out_dtype=torch.float32)
        if sw is not None:
            y_engine = y_engine + swiglu(batch.hidden, sw.w_gate, sw.w_up, sw.w_down).float()
        scale = float(base.abs().max()) or 1.0
        out["cases"].append({
            "case": (chunks, order, shared),
            "err_vs_serialized": max(float((y - base).abs().max()) for y in ys) / scale,
            "err_vs_engine": float((ys[0] - y_engine.to(torch.bfloat16).float()).abs().max()) / scale,
            "err_repeat": float((ys[0] - ys[1]).abs().max()) / scale,
            "device": str(res.hidden.device), "overlap_ms": tl.overlap_ms, "makespan_ms": tl.makespan_ms,
            "streams": sorted({t.stream for t in res.tasks}),
        })
    return out


GPU_CASES = tuple((c, o, s) for c in (1, 2, 4, 7) for o in ("dispatch_first", "interleaved") for s in (False, True))


@pytest.mark.parametrize("backend", [pytest.param("local", id="local"), pytest.param("nccl", id="nccl", marks=GPU)])
def test_overlapped_on_devices_matches_serialized_and_engine(backend):
    from ray_moe_dev.testing.spmd import run_spmd

    cases = GPU_CASES if backend == "nccl" else GPU_CASES[:4]
    got = run_spmd(_gpu_worker, 2, args=((300, 257), 5, cases), backend=backend,
                   timeout_s=60.0 if backend == "local" else 240.0,
                   exchange_timeout_s=10.0 if backend == "local" else 30.0)
    for rank, res in enumerate(got):
        for c in res["cases"]:
            assert c["device"] == (f"cuda:{rank}" if backend == "nccl" else "cpu")
            assert c["err_vs_serialized"] < 2e-2, c  # bf16 outputs, FP32 accumulation in another order
            assert c["err_vs_engine"] < 2e-2, c
            assert c["err_repeat"] < 2e-2, c
            assert c["streams"] == ["communication", "compute", "expert", "output"] + (["shared"] if c["case"][2]
                                                                                      else [])
