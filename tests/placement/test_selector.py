"""Replica selection (spec 0x01D1 cardinality contract, 0x02B, 0x08H).

Every policy assigns each accepted route exactly one compatible physical slot of its logical expert
and never touches the logical expert or the gate. Policy-specific behaviour: round-robin splits an
origin's routes to a replicated expert evenly, hash is a pure function of (origin, token, route slot),
least-load balances predicted rank load (and listens to ``observe``), locality prefers the origin rank,
then the origin node.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.routes import RouteBatch, SemanticRoutes
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.selector import (
    ExplicitSelector,
    HashSelector,
    LeastLoadSelector,
    LocalityFirstSelector,
    RoundRobinSelector,
    _water_fill,
    make_selector,
)
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe_dev.testing import fixtures as fx
from ray_moe.core.types import ReplicaPolicy, RouteClass

POLICIES = [p.value for p in ReplicaPolicy if p is not ReplicaPolicy.EXPLICIT]  # explicit needs an assignment


def _routes(origin: int, experts, k: int = 1, gates=None) -> SemanticRoutes:
    """Semantic routes of ``origin`` with the given logical experts (token-major, k per token)."""
    ids = torch.tensor(experts, dtype=torch.int64).reshape(-1, k)
    t = ids.shape[0]
    w = torch.tensor(gates, dtype=torch.float32).reshape(t, k) if gates is not None else torch.full((t, k), 0.5)
    return SemanticRoutes.from_batch(RouteBatch(origin, torch.zeros(t, 3), ids, w))


def _rank_load(slots: torch.Tensor, snap: PlacementSnapshot) -> list[int]:
    return torch.bincount(snap.slot_rank[slots], minlength=snap.num_ranks).tolist()


def _assert_compatible(routes: SemanticRoutes, slots: torch.Tensor, snap: PlacementSnapshot) -> None:
    assert slots.dtype == torch.int64 and slots.shape == (routes.num_routes,)
    for e, q in zip(routes.logical_expert.tolist(), slots.tolist()):
        candidates = snap.log2phy[e, : snap.logcnt[e]].tolist()
        assert q in candidates, (e, q, candidates)  # exactly one slot, and one of rho(e)
        assert int(snap.phy2log[q]) == e


# ------------------------------------------------------------------------------- all policies
@pytest.mark.parametrize("policy", POLICIES)
def test_every_route_gets_one_compatible_slot(policy):
    snap = fx.snapshot()
    sel = make_selector(policy)
    assert sel.policy == ReplicaPolicy(policy)
    for origin in range(4):
        routes = _routes(origin, [0, 1, 2, 3, 0, 0, 1, 3, 2, 1, 0, 1], k=3)
        _assert_compatible(routes, sel.select(routes, snap), snap)
    empty = _routes(0, [], k=2)
    out = sel.select(empty, snap)
    assert out.shape == (0,)


@pytest.mark.parametrize("policy", POLICIES)
def test_selection_never_changes_expert_or_gate(policy):
    snap = fx.snapshot()
    sel = make_selector(policy)
    sel.observe(torch.tensor([3, 0, 9, 1]))
    routes = _routes(1, [0, 1, 0, 2, 3, 1, 0, 0], k=2, gates=[0.6, 0.4, 0.7, 0.3, 0.58, 0.42, 0.55, 0.45])
    before = (routes.logical_expert.clone(), routes.gate.clone(), routes.origin_token.clone(),
              routes.route_slot.clone(), routes.digest())
    slots = sel.select(routes, snap)
    assert torch.equal(routes.logical_expert, before[0]) and torch.equal(routes.gate, before[1])
    assert torch.equal(routes.origin_token, before[2]) and torch.equal(routes.route_slot, before[3])
    assert routes.digest() == before[4]
    # the logical ledger is the router's, whatever the physical choice
    assert Counter(int(snap.phy2log[q]) for q in slots.tolist()) == Counter(before[0].tolist())


@settings(max_examples=50, deadline=None)
@given(
    e=st.integers(1, 8), p=st.integers(1, 4), data=st.data(),
    policy=st.sampled_from(POLICIES),
)
def test_random_layouts_one_compatible_slot(e, p, data, policy):
    extra = data.draw(st.lists(st.integers(0, e - 1), max_size=5))
    phy2log = data.draw(st.permutations(list(range(e)) + extra))
    slot_rank = data.draw(st.lists(st.integers(0, p - 1), min_size=len(phy2log), max_size=len(phy2log)))
    nodes = data.draw(st.sampled_from([n for n in (1, 2, 4) if p % n == 0]))
    topo = Topology.uniform(p, nodes)
    m = manifest_from_assignment(generation=1, phy2log=[phy2log], slot_rank=[slot_rank], num_experts=e, topology=topo)
    snap = PlacementSnapshot.from_manifest(m, topo, ProcessGroupSpec(group_id="ep-group-0",
                                                                     peer_order=tuple(data.draw(st.permutations(range(p))))))
    origin = data.draw(st.integers(0, p - 1))
    experts = data.draw(st.lists(st.integers(0, e - 1), max_size=24))
    sel = make_selector(policy)
    if data.draw(st.booleans()):
        sel.observe(torch.tensor(data.draw(st.lists(st.integers(0, 30), min_size=p, max_size=p))))
    routes = _routes(origin, experts)
    _assert_compatible(routes, sel.select(routes, snap), snap)


def test_make_selector():
    assert isinstance(make_selector("round_robin"), RoundRobinSelector)
    assert isinstance(make_selector(ReplicaPolicy.HASH), HashSelector)
    assert isinstance(make_selector("least_load"), LeastLoadSelector)
    assert isinstance(make_selector("locality"), LocalityFirstSelector)
    with pytest.raises(ValueError, match="nearest"):
        make_selector("nearest")


def test_explicit_selector_returns_the_frozen_assignment():
    snap = fx.snapshot()
    sel = ExplicitSelector({p: fx.route_tensors(p)[3] for p in (0, 1)})
    h, ids, w, slots = fx.route_tensors(1)
    routes = SemanticRoutes.from_batch(RouteBatch(1, h, ids, w))
    assert sel.select(routes, snap).tolist() == [5, 0, 3, 1]
    assert sel.select(_routes(3, []), snap).tolist() == []


# ------------------------------------------------------------------------------- round robin
def test_round_robin_splits_evenly():
    snap = fx.snapshot()
    sel = RoundRobinSelector()
    slots = sel.select(_routes(0, [0] * 10), snap)
    assert Counter(slots.tolist()) == {0: 5, 1: 5}
    assert slots.tolist()[:4] == [0, 1, 0, 1]
    # origin 1 starts one replica later: (i + p) mod logcnt
    assert sel.select(_routes(1, [0] * 4), snap).tolist() == [1, 0, 1, 0]
    odd = sel.select(_routes(2, [1] * 7), snap)
    assert sorted(Counter(odd.tolist()).values()) == [3, 4]
    # interleaved experts: each expert's own routes alternate, independent of the other experts
    mixed = sel.select(_routes(0, [0, 1, 0, 1, 3, 0, 1]), snap)
    assert mixed.tolist() == [0, 2, 1, 3, 5, 0, 2]


def test_round_robin_with_three_replicas():
    topo = Topology.single_node(3)
    m = manifest_from_assignment(generation=1, phy2log=[[0, 0, 0, 1]], slot_rank=[[0, 1, 2, 2]], num_experts=2,
                                 topology=topo)
    snap = PlacementSnapshot.from_manifest(m, topo, ProcessGroupSpec.identity(3))
    for n in range(1, 12):
        counts = Counter(RoundRobinSelector().select(_routes(1, [0] * n), snap).tolist())
        assert sum(counts.values()) == n
        assert max(counts.values()) - min(counts.get(q, 0) for q in (0, 1, 2)) <= 1, (n, counts)


# ------------------------------------------------------------------------------- hash
def test_hash_is_deterministic():
    snap = fx.snapshot()
    routes = _routes(1, [0, 1, 0, 1, 0, 1, 0, 0] * 4, k=2)
    a = HashSelector().select(routes, snap)
    b = HashSelector().select(routes, snap)
    assert torch.equal(a, b)
    assert torch.equal(HashSelector().select(routes, snap), a)
    _assert_compatible(routes, a, snap)


def test_hash_depends_only_on_the_route_key():
    """A route's slot is a function of (origin, token, route slot): other routes do not move it."""
    snap = fx.snapshot()
    experts = [0, 1, 0, 2, 0, 3, 0, 1, 1, 0, 0, 0]
    base = HashSelector().select(_routes(2, experts, k=2), snap)
    other = list(experts)
    other[3], other[5], other[8] = 3, 2, 0  # change routes that are not expert 0 at positions 0/2/4
    moved = HashSelector().select(_routes(2, other, k=2), snap)
    for i in (0, 2, 4, 6, 9, 10, 11):  # expert-0 routes untouched by the edit
        assert int(base[i]) == int(moved[i]), i
    # many tokens spread over both replicas of E0
    many = HashSelector().select(_routes(0, [0] * 64), snap)
    assert set(many.tolist()) == {0, 1}


# ------------------------------------------------------------------------------- least load
def _skewed_routes():
    # origin 0: 8 rows to E2 (only on rank 2), 4 to E1 (q2 rank 1 / q3 rank 2), 4 to E0 (q0 rank 0 / q1 rank 1)
    return _routes(0, [2] * 8 + [1] * 4 + [0] * 4)


def test_least_load_beats_round_robin_on_a_skewed_case():
    snap = fx.snapshot()
    routes = _skewed_routes()
    rr = _rank_load(RoundRobinSelector().select(routes, snap), snap)
    ll_slots = LeastLoadSelector().select(routes, snap)
    ll = _rank_load(ll_slots, snap)
    assert rr == [2, 4, 10, 0]
    assert ll == [2, 6, 8, 0]
    assert max(ll) < max(rr) and sum(ll) == sum(rr) == 16
    _assert_compatible(routes, ll_slots, snap)
    # the logical ledger is unchanged; only the physical ledgers moved
    assert Counter(int(snap.phy2log[q]) for q in ll_slots.tolist()) == {2: 8, 1: 4, 0: 4}


def test_least_load_uses_observe_feedback():
    snap = fx.snapshot()
    routes = _routes(0, [0] * 4)
    assert _rank_load(LeastLoadSelector().select(routes, snap), snap) == [2, 2, 0, 0]
    sel = LeastLoadSelector()
    sel.observe(torch.tensor([0, 10, 0, 0]))
    assert _rank_load(sel.select(routes, snap), snap) == [4, 0, 0, 0]
    sel.observe(torch.tensor([0, 0, 0, 0]))  # decayed: 0.5 * 10 = 5 still on rank 1
    assert _rank_load(sel.select(routes, snap), snap) == [4, 0, 0, 0]
    sel = LeastLoadSelector()
    sel.observe(torch.tensor([3, 0, 0, 0]))
    # water-filling: rank 0 starts at 3 -> of 5 rows, rank 1 takes 4, rank 0 takes 1 (levels 4 and 4)
    assert _rank_load(sel.select(_routes(0, [0] * 5), snap), snap) == [1, 4, 0, 0]


@settings(max_examples=60, deadline=None)
@given(base=st.lists(st.integers(0, 20), min_size=1, max_size=6), n=st.integers(0, 40))
def test_water_fill_minimises_the_max_load(base, n):
    """Compared with the naive greedy: hand each row, one at a time, to the least-loaded bin."""
    quota = _water_fill(torch.tensor(base, dtype=torch.float64), n)
    assert quota.dtype == torch.int64 and int(quota.sum()) == n and bool((quota >= 0).all())
    loads = list(base)
    for _ in range(n):
        i = min(range(len(loads)), key=lambda j: (loads[j], j))
        loads[i] += 1
    assert max(b + int(q) for b, q in zip(base, quota.tolist())) == max(loads)


# ------------------------------------------------------------------------------- locality
def _pick(sel, origin, expert, snap):
    return int(sel.select(_routes(origin, [expert]), snap)[0])


def test_locality_prefers_same_rank_then_same_node():
    snap = fx.snapshot()  # node-0 = ranks 0, 1; node-1 = ranks 2, 3
    sel = LocalityFirstSelector()
    assert _pick(sel, 0, 0, snap) == 0  # q0 on rank 0 itself
    assert _pick(sel, 1, 0, snap) == 1  # q1 on rank 1 itself
    assert _pick(sel, 1, 1, snap) == 2  # q2 on rank 1 itself
    assert _pick(sel, 2, 1, snap) == 3  # q3 on rank 2 itself
    assert _pick(sel, 3, 1, snap) == 3  # q3 on rank 2: same node-1 beats q2 on node-0
    assert _pick(sel, 0, 1, snap) == 2  # q2 on rank 1: same node-0 beats q3 on node-1
    assert _pick(sel, 2, 0, snap) == 0  # no E0 replica on node-1: least load, then lowest slot
    assert _pick(sel, 0, 3, snap) == 5  # a single replica is forced
    assert snap.rank_node.tolist() == [0, 0, 1, 1]


def test_locality_breaks_ties_by_load_and_ranks_class_above_load():
    snap = fx.snapshot()
    sel = LocalityFirstSelector()
    sel.observe(torch.tensor([5, 0, 0, 0]))
    assert _pick(sel, 2, 0, snap) == 1  # both remote-node: the less loaded rank 1
    sel.observe(torch.tensor([100, 0, 0, 0]))
    assert _pick(sel, 0, 0, snap) == 0  # same rank wins over any load
    sel.observe(torch.tensor([0, 0, 100, 0]))
    assert _pick(sel, 3, 1, snap) == 3  # same node wins over load


def test_locality_cuts_cross_node_routes():
    snap = fx.snapshot()
    topo = fx.topology()
    experts = [0, 1, 0, 1, 1, 0, 1, 0]
    classes = {}
    for name, sel in (("locality", LocalityFirstSelector()), ("round_robin", RoundRobinSelector())):
        counts = Counter()
        for origin in range(4):
            routes = _routes(origin, experts)
            for q in sel.select(routes, snap).tolist():
                counts[topo.route_class(origin, int(snap.slot_rank[q]))] += 1
        classes[name] = counts
    # locality: E0 and E1 have a replica on node-0 and E1 on node-1, E0 only on node-0
    assert classes["locality"][RouteClass.CROSS_NODE] == 8  # only node-1 origins' E0 routes
    assert classes["locality"][RouteClass.CROSS_NODE] < classes["round_robin"][RouteClass.CROSS_NODE]
    assert sum(classes["locality"].values()) == sum(classes["round_robin"].values()) == 32
