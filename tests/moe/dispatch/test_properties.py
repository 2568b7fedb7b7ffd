"""Property tests of the dispatch data path against the naive loop references (spec 0x01B, 0x01D1,
0x03B-0x03C3, 0x07B).

Random shapes (T 0..12 per rank, k 1..3, E 1..8, P 1..4), random replica layouts (every expert has at
least one slot, extra replicas on random experts and ranks, random slot order), random node counts,
random peer orders (sometimes over a subset of the topology's ranks) and every replica policy. Each example runs the real SPMD path through
LocalExchangeGroup and checks:

* conservation: sum of logical-expert counts = sum of slot counts = sum of rank counts = sum T*k;
* cardinality + compatibility: exactly one slot per route, and phy2log[slot] == logical expert;
* the vectorised plan (SourcePlan, ReceivePlan, count matrix) equals ``naive_plan`` field by field;
* round trip: expert rows tagged with the naive plan's route at each expert position come back to
  exactly that route's semantic position;
* full path output == ``reference_moe`` for every runner kind that is importable (loop always).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_moe.moe.dispatch.engine import combine, dispatch
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.moe.dispatch.plan import semantic_from_send, source_major_from_expert
from ray_moe.core.routes import RouteBatch
from ray_moe.moe.experts.runners import make_runner
from ray_moe.moe.experts.weights import SeededWeightSource, SlotWeights
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.selector import make_selector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe_dev.testing.reference import naive_plan, reference_moe
from ray_moe.core.types import ReplicaPolicy

POLICIES = [p.value for p in ReplicaPolicy if p is not ReplicaPolicy.EXPLICIT]  # explicit needs an assignment
D, F = 8, 16
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def scenarios(draw):
    """A random placement generation + a random routing step, as plain data."""
    p = draw(st.integers(1, 4))
    e = draw(st.integers(1, 8))
    k = draw(st.integers(1, min(3, e)))
    extra = draw(st.integers(0, 4))
    phy2log = list(range(e)) + draw(st.lists(st.integers(0, e - 1), min_size=extra, max_size=extra))
    perm = draw(st.permutations(range(len(phy2log))))
    phy2log = [phy2log[i] for i in perm]  # random slot order
    nodes = draw(st.sampled_from([n for n in (1, 2, 4) if p % n == 0]))
    # the expert-parallel group: usually every rank, sometimes a subset of the topology's ranks
    if draw(st.integers(0, 3)) == 0:
        members = draw(st.lists(st.integers(0, p - 1), min_size=1, max_size=p, unique=True))
    else:
        members = list(range(p))
    peer_order = draw(st.permutations(members))
    slot_rank = draw(st.lists(st.sampled_from(sorted(members)), min_size=len(phy2log), max_size=len(phy2log)))
    tokens = draw(st.lists(st.integers(0, 12), min_size=p, max_size=p))
    tokens = [t if r in members else 0 for r, t in enumerate(tokens)]
    policy = draw(st.sampled_from(POLICIES))
    observe = draw(st.one_of(st.none(), st.lists(st.integers(0, 20), min_size=p, max_size=p)))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(P=p, E=e, k=k, phy2log=phy2log, slot_rank=slot_rank, nodes=nodes, peer_order=tuple(peer_order),
                members=sorted(members),
                tokens=tokens, policy=policy, observe=observe, seed=seed)


def _build(sc, dtype):
    topo = Topology.uniform(sc["P"], sc["nodes"])
    manifest = manifest_from_assignment(generation=5, phy2log=[sc["phy2log"]], slot_rank=[sc["slot_rank"]],
                                        num_experts=sc["E"], topology=topo)
    group = ProcessGroupSpec(group_id="ep-group-0", peer_order=sc["peer_order"], epoch=1)
    snap = PlacementSnapshot.from_manifest(manifest, topo, group)
    g = torch.Generator().manual_seed(sc["seed"])
    batches = {}
    for rank in sc["members"]:
        t = sc["tokens"][rank]
        ids = torch.zeros(t, sc["k"], dtype=torch.int64)
        for row in range(t):  # distinct experts per token, like a top-k router
            ids[row] = torch.randperm(sc["E"], generator=g)[: sc["k"]]
        gates = torch.rand(t, sc["k"], generator=g, dtype=torch.float32)
        hidden = torch.randn(t, D, generator=g, dtype=torch.float64).to(dtype)
        batches[rank] = (hidden, ids, gates)
    return snap, group, batches


def _selector(sc):
    sel = make_selector(sc["policy"])
    if sc["observe"] is not None:
        sel.observe(torch.tensor(sc["observe"], dtype=torch.int64))
    return sel


def _code(origin: int, route: int) -> float:
    return float(origin * 1000 + route)


# ------------------------------------------------------------------------------- plan properties
@settings(max_examples=60, **SETTINGS)
@given(sc=scenarios())
def test_plan_matches_naive_and_round_trips(sc):
    snap, group, batches = _build(sc, torch.float32)
    selectors = {r: _selector(sc) for r in sc["members"]}

    def step(ex):
        h, ids, w = batches[ex.rank]
        out = dispatch(RouteBatch(ex.rank, h, ids, w), snap, ex, selector=selectors[ex.rank], tag="p")
        return out

    members = sc["members"]
    outs = dict(zip(members, LocalExchangeGroup(group).run(step)))  # run() returns sorted-member order
    handles = {r: o.handle for r, o in outs.items()}
    experts = {r: batches[r][1].reshape(-1).tolist() for r in members}
    slots = {r: handles[r].source.physical_slot.tolist() for r in members}
    total = sum(t * sc["k"] for t in sc["tokens"])

    # cardinality + compatibility: one slot per route, storing the route's logical expert
    phy2log = snap.phy2log.tolist()
    log2phy = snap.log2phy.tolist()
    logcnt = snap.logcnt.tolist()
    for r in members:
        assert handles[r].rank == r
        assert len(slots[r]) == len(experts[r]) == sc["tokens"][r] * sc["k"]
        for e, q in zip(experts[r], slots[r]):
            assert phy2log[q] == e
            assert q in log2phy[e][: logcnt[e]]
        # the selector never changed the semantic columns
        assert handles[r].routes.logical_expert.tolist() == experts[r]
        assert torch.equal(handles[r].routes.gate, batches[r][2].reshape(-1))

    plan = naive_plan(experts, slots, snap)
    # conservation
    assert sum(plan["logical_counts"]) == sum(plan["slot_counts"]) == sum(plan["rank_counts"]) == total
    got_slot_counts = [0] * snap.num_slots
    for u in members:
        for q, c in zip(handles[u].receive.slot_ids.tolist(), handles[u].receive.expert_counts.tolist()):
            got_slot_counts[q] += c
    assert got_slot_counts == plan["slot_counts"]
    assert sum(o.rows.shape[0] for o in outs.values()) == total

    # vectorised == naive, every field
    for u in members:
        h = handles[u]
        assert h.count_matrix.tolist() == plan["count_matrix"]
        assert h.source.counts_by_rank.tolist() == plan["count_matrix"][u]
        assert h.source.send_counts.tolist() == plan["send_counts"][u]
        assert h.source.send_offsets.tolist() == plan["send_offsets"][u]
        assert h.source.send_order.tolist() == plan["send_order"][u]
        assert h.source.inverse_send.tolist() == plan["inverse_send"][u]
        assert h.source.send_slot.tolist() == plan["send_slot"][u]
        assert h.source.dest_rank.tolist() == [sc["slot_rank"][q] for q in slots[u]]
        assert h.receive.recv_counts.tolist() == plan["recv_counts"][u]
        assert h.receive.recv_offsets.tolist() == plan["recv_offsets"][u]
        assert h.receive.recv_slot.tolist() == plan["recv_slot"][u]
        assert h.receive.slot_ids.tolist() == plan["slot_ids"][u]
        assert h.receive.expert_order.tolist() == plan["expert_order"][u]
        assert h.receive.expert_counts.tolist() == plan["expert_counts"][u]
        assert h.receive.expert_offsets.tolist() == plan["expert_offsets"][u]
        assert outs[u].counts_list == tuple(plan["expert_counts"][u])
        # the payload rows are the routes' hidden rows, expert-major
        want = [batches[src][0][r // sc["k"]].tolist() for src, r in plan["expert_routes"][u]]
        assert outs[u].rows.tolist() == want if want else outs[u].rows.shape[0] == 0

    # round trip through the real inverse path: tag expert position i with the naive plan's route there
    def back(ex):
        out = outs[ex.rank]
        tags = [[_code(src, r)] * D for src, r in plan["expert_routes"][ex.rank]]
        rows = torch.tensor(tags, dtype=torch.float64).reshape(-1, D)
        src_major = source_major_from_expert(rows, out.handle.receive)
        got = ex.all_to_all_v("rt/return", {"y": src_major}, out.handle.receive.recv_counts.tolist(),
                              out.handle.source.send_counts.tolist())
        return semantic_from_send(got["y"], out.handle.source)

    semantic = dict(zip(members, LocalExchangeGroup(group).run(back)))
    for r in members:
        assert semantic[r][:, 0].tolist() == [_code(r, i) for i in range(len(experts[r]))]


# ------------------------------------------------------------------------------- full path
RUNNER_KINDS = ["loop", "grouped", "padded", "block"]


def _runner_or_skip(kind: str):
    if kind != "loop" and importlib.util.find_spec(f"ray_moe.moe.experts.runners.{kind}") is None:
        pytest.skip(f"runner {kind!r} is not written yet (ray_moe/experts/runners/{kind}.py)")
    return make_runner(kind)


@pytest.mark.parametrize("kind", RUNNER_KINDS)
def test_full_path_equals_reference_moe(kind):
    runner = _runner_or_skip(kind)

    @settings(max_examples=40, **SETTINGS)
    @given(sc=scenarios(), dtype=st.sampled_from([torch.float32, torch.float64]))
    def check(sc, dtype):
        snap, group, batches = _build(sc, dtype)
        source = SeededWeightSource(num_layers=1, num_experts=sc["E"], hidden_size=D, ffn_size=F,
                                    seed=sc["seed"] % 97, dtype=dtype)
        selectors = {r: _selector(sc) for r in sc["members"]}

        def step(ex):
            h, ids, w = batches[ex.rank]
            out = dispatch(RouteBatch(ex.rank, h, ids, w), snap, ex, selector=selectors[ex.rank], tag="fp")
            slot_ids = snap.rank_slot_ids(ex.rank).tolist()
            if slot_ids:
                weights = SlotWeights.stack(0, slot_ids, [source.expert(0, int(snap.phy2log[q])) for q in slot_ids])
                expert_rows = runner.run(out.rows, out.counts_list, weights)
            else:
                assert out.rows.shape[0] == 0
                expert_rows = out.rows
            assert expert_rows.shape == out.rows.shape
            return combine(expert_rows, out.handle, snap, ex, tag="fp", out_dtype=h.dtype)

        ys = dict(zip(sc["members"], LocalExchangeGroup(group).run(step)))
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-5, atol=1e-5)
        for r in sc["members"]:
            h, ids, w = batches[r]
            ref = reference_moe(h, ids, w, lambda e: source.expert(0, e))
            assert ys[r].dtype == dtype and ys[r].shape == h.shape
            torch.testing.assert_close(ys[r].to(torch.float64), ref, **tol)

    check()


def test_reference_moe_is_a_plain_sum():
    """The reference itself, on a hand-computable case: E(x) = w_down (silu(w_gate x) * w_up x)."""
    from ray_moe.moe.experts.weights import ExpertWeights

    eye = torch.eye(2, dtype=torch.float64)

    def weight(e):
        return ExpertWeights(0, e, eye * 50.0, eye * (e + 1.0), eye)  # silu(50x) ~ 50x for x > 0

    h = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    ids = torch.tensor([[0, 1]])
    w = torch.tensor([[0.25, 0.75]])
    y = reference_moe(h, ids, w, weight)
    x = h[0]
    want = 0.25 * (torch.nn.functional.silu(50 * x) * x) + 0.75 * (torch.nn.functional.silu(50 * x) * 2 * x)
    torch.testing.assert_close(y[0], want)


def test_reference_multilayer_composes_reference_moe():
    from ray_moe_dev.testing.reference import reference_multilayer

    source = SeededWeightSource(num_layers=2, num_experts=4, hidden_size=D, ffn_size=F, seed=3, dtype=torch.float64)

    def route(layer, h):
        logits = h.to(torch.float32) @ source.router(layer).T
        w, ids = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)
        return ids, w

    h = torch.randn(5, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids0, w0 = route(0, h)
    y0 = reference_moe(h, ids0, w0, lambda e: source.expert(0, e))
    torch.testing.assert_close(reference_multilayer(h, 1, route, source.expert, residual=False), y0)
    h1 = h + y0
    ids1, w1 = route(1, h1)
    want = h1 + reference_moe(h1, ids1, w1, lambda e: source.expert(1, e))
    torch.testing.assert_close(reference_multilayer(h, 2, route, source.expert, residual=True), want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 130), st.integers(0, 4100 + 300), st.integers(0, 2**31 - 1))
def test_expert_major_order_is_the_stable_sort_on_both_paths(n, m, seed):
    """The counting sort (CUDA's choice up to COUNTING_ORDER_MAX entries) and the sort path give the stable
    sort's order, its inverse and the histogram, exactly."""
    from ray_moe.moe.dispatch.plan import expert_major_order

    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, n, (m,), generator=g, dtype=torch.int64)
    want = torch.sort(index, stable=True).indices
    for counting in (True, False, None):
        order, dest, counts = expert_major_order(index, n, counting=counting)
        assert torch.equal(order, want)
        assert torch.equal(dest[order], torch.arange(m)) and torch.equal(order[dest], torch.arange(m))
        assert torch.equal(counts, torch.bincount(index, minlength=n)) and counts.dtype == torch.int64


def test_expert_major_order_counting_path_equals_the_sort_path_with_skew():
    """A hot value taking most entries (the skewed routing a rebalance answers): both paths agree."""
    from ray_moe.moe.dispatch import plan

    index = torch.cat([torch.full((3000,), 7), torch.arange(129), torch.full((5,), 128)]).to(torch.int64)
    index = index[torch.randperm(index.numel(), generator=torch.Generator().manual_seed(3))]
    counted = plan.expert_major_order(index, 129 + 1, counting=True)
    sorted_ = plan.expert_major_order(index, 129 + 1, counting=False)
    for a, b in zip(counted, sorted_):
        assert torch.equal(a, b)
