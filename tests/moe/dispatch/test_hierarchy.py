"""Topology ledgers, process-group checks and the hierarchical relay exchange (spec 0x07B-0x07G)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.moe.dispatch.engine import combine, dispatch
from ray_moe.moe.exchange.hierarchical import HierarchicalExchange
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.moe.dispatch.hierarchy import (
    build_topology_plan,
    check_process_groups,
    classify_routes,
    count_matrix_from_routes,
    flat_ledger,
    hierarchical_ledger,
    peer_splits,
    relay_rounds,
    relay_stage_ledger,
)
from ray_moe.moe.dispatch.precision import dequantize
from ray_moe.core.routes import RouteBatch
from ray_moe.core.errors import CountAgreementError
from ray_moe.placement.selector import ExplicitSelector
from ray_moe.placement.topology import NodeInfo, ProcessGroupSpec, RankInfo, Topology
from ray_moe_dev.testing import fixtures
from ray_moe.core.types import PayloadFormat, RouteClass

ROUTE_IDS = tuple(r[0] for r in fixtures.EIGHT_ROUTES)
SOURCE = torch.tensor([r[1] for r in fixtures.EIGHT_ROUTES])
DEST = torch.tensor([r[7] for r in fixtures.EIGHT_ROUTES])
ROW_BYTES = 3 * torch.bfloat16.itemsize  # d = 3 BF16 values: six bytes per teaching row


@pytest.fixture
def topo() -> Topology:
    return fixtures.topology()


@pytest.fixture
def counts() -> torch.Tensor:
    return count_matrix_from_routes(SOURCE, DEST, 4)


# --------------------------------------------------------------------------------------------- 0x07B
def test_global_count_matrix(counts):
    assert counts.tolist() == [[1, 2, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_peer_slot_split_vectors(counts):
    s = peer_splits(counts, fixtures.permuted_group())
    assert s.peer_order == (2, 0, 3, 1)
    assert s.send == ((1, 1, 0, 2), (1, 1, 1, 1), (0, 0, 0, 0), (0, 0, 0, 0))
    assert s.recv[1] == (0, 2, 0, 1)  # not its global-source column [2, 1, 0, 0]
    assert counts[:, 1].tolist() == [2, 1, 0, 0]
    # zero-count peers stay: every vector has P entries
    assert all(len(v) == 4 for v in s.send + s.recv)


def test_peer_order_is_a_different_coordinate_system(counts):
    flat = peer_splits(counts, fixtures.flat_group())
    perm = peer_splits(counts, fixtures.permuted_group())
    assert flat.send[0] == (1, 2, 1, 0) and perm.send[0] == (1, 1, 0, 2)
    assert sum(flat.send[0]) == sum(perm.send[0])  # same total, different peers


def test_peer_splits_reject_bad_matrix():
    with pytest.raises(ValueError, match="count_matrix"):
        peer_splits(torch.zeros(3, 4, dtype=torch.int64), fixtures.permuted_group())
    with pytest.raises(ValueError, match="negative"):
        peer_splits(-torch.ones(4, 4, dtype=torch.int64), fixtures.permuted_group())


# --------------------------------------------------------------------------------------------- 0x07C
def test_route_classes(topo):
    led = classify_routes(SOURCE, DEST, topo, ROUTE_IDS)
    assert led.ids(RouteClass.SAME_GPU) == ("r00", "r07")
    assert led.ids(RouteClass.SAME_NODE) == ("r01", "r02", "r05")
    assert led.ids(RouteClass.CROSS_NODE) == ("r03", "r04", "r06")
    assert led.rows == (2, 3, 3)
    assert (led.fraction("same-gpu"), led.fraction("same-node-remote-gpu"), led.fraction("different-node")) == (
        Fraction(2, 8), Fraction(3, 8), Fraction(3, 8))
    assert sum(led.fraction(c) for c in RouteClass) == 1
    # agrees with Topology.route_class route by route
    for rid, s, d in zip(ROUTE_IDS, SOURCE.tolist(), DEST.tolist()):
        assert rid in led.ids(topo.route_class(s, d))


def test_flat_ledger(topo, counts):
    led = flat_ledger(counts, topo, ROW_BYTES)
    intra, inter = led[RouteClass.SAME_NODE], led[RouteClass.CROSS_NODE]
    assert (intra.dispatch_rows, intra.dispatch_bytes, intra.round_trip_bytes, intra.directed_pairs) == (3, 18, 36, 2)
    assert (inter.dispatch_rows, inter.dispatch_bytes, inter.round_trip_bytes, inter.directed_pairs) == (3, 18, 36, 3)
    assert intra.evidence == inter.evidence == "analytical"


# --------------------------------------------------------------------------------------------- 0x07E
def test_relay_ledger(topo, counts):
    h = hierarchical_ledger(counts, topo, ROW_BYTES)
    assert h.dispatch.stages == (2, 3, 1)
    assert h.combine.stages == (1, 3, 2)
    assert h.hier_inter_roundtrip_bytes == h.flat_inter_roundtrip_bytes == 36
    assert h.added_relay_bytes == (2 + 1 + 1 + 2) * 6 == 36
    assert (h.flat_inter_directed_pairs, h.hier_inter_directed_pairs) == (6, 2)
    # direct rows do not touch relays
    assert (h.dispatch.direct_same_node, h.dispatch.same_gpu) == (3, 2)
    assert h.evidence == "analytical"


@pytest.mark.parametrize("rid,stages", [("r03", (0, 1, 0)), ("r04", (1, 1, 1)), ("r06", (1, 1, 0))])
def test_relay_path_of_each_inter_node_route(topo, rid, stages):
    i = ROUTE_IDS.index(rid)
    c = count_matrix_from_routes(SOURCE[i:i + 1], DEST[i:i + 1], 4)
    assert relay_stage_ledger(c, topo).stages == stages


def test_relay_rounds_conserve_rows(topo, counts):
    r = relay_rounds(counts, topo)
    total = int(counts.sum())
    assert int(r.round_matrix(1).sum()) == total  # every row leaves its source in round 1 (self-sends included)
    # every different-node row crosses nodes exactly once, between two distinct relays
    assert int(r.direct.sum()) + int(r.stage2.sum()) == total
    assert int(r.stage2.diagonal().sum()) == 0
    # stage 3 only delivers to non-relay ranks (rank 3 here)
    assert r.stage3.sum(0).tolist() == [0, 0, 0, 1]


# --------------------------------------------------------------------------------------------- 0x07G
def test_process_groups_bind(topo):
    b = check_process_groups(topo, fixtures.process_groups(), epoch=12)
    assert b.ep.peer_order == (2, 0, 3, 1)
    assert [(n, g.peer_order) for n, g in b.node_groups] == [("node-0", (1, 0)), ("node-1", (3, 2))]
    assert b.relays.peer_order == (2, 0)
    assert b.epoch == 12


def _groups(**changes: ProcessGroupSpec) -> dict[str, ProcessGroupSpec]:
    g = fixtures.process_groups()
    g.update(changes)
    return g


@pytest.mark.parametrize(
    "groups,epoch,match",
    [
        (_groups(), 11, "epoch"),
        (_groups(**{"ep-node-1": ProcessGroupSpec(group_id="ep-node-1", peer_order=(3, 2), epoch=13)}), 12, "epoch"),
        (_groups(**{"ep-group-0": ProcessGroupSpec(group_id="ep-group-0", peer_order=(2, 0, 3), epoch=12)}), 12,
         "topology ranks"),
        (_groups(**{"ep-node-0": ProcessGroupSpec(group_id="ep-node-0", peer_order=(1, 2), epoch=12)}), 12,
         "node 'node-0'"),
        (_groups(**{"ep-relays": ProcessGroupSpec(group_id="ep-relays", peer_order=(2, 1), epoch=12)}), 12,
         "relays"),
        (_groups(**{"ep-relays": ProcessGroupSpec(group_id="ep-relays", peer_order=(2, 0, 1), epoch=12)}), 12,
         "relays"),
        (_groups(**{"ep-relays": ProcessGroupSpec(group_id="ep-other", peer_order=(2, 0), epoch=12)}), 12,
         "disagree"),
        ({k: v for k, v in fixtures.process_groups().items() if k != "ep-node-1"}, 12, "missing"),
    ],
)
def test_process_group_mismatches_raise(topo, groups, epoch, match):
    with pytest.raises(ValueError, match=match):
        check_process_groups(topo, groups, epoch=epoch)


def test_topology_mutations_raise():
    with pytest.raises(ValueError, match="two nodes"):
        Topology(ranks=fixtures.topology().ranks,
                 nodes=(NodeInfo(node_id="node-0", ranks=(0, 1, 2), relay_rank=0),
                        NodeInfo(node_id="node-1", ranks=(2, 3), relay_rank=2)))
    with pytest.raises(ValueError, match="relay_rank"):
        NodeInfo(node_id="node-0", ranks=(0, 1), relay_rank=2)
    no_relay = Topology(ranks=fixtures.topology().ranks,
                        nodes=(NodeInfo(node_id="node-0", ranks=(0, 1)), NodeInfo(node_id="node-1", ranks=(2, 3), relay_rank=2)))
    with pytest.raises(ValueError, match="relay"):
        check_process_groups(no_relay, fixtures.process_groups(), epoch=12)
    with pytest.raises(ValueError, match="relay"):
        relay_rounds(torch.zeros(4, 4, dtype=torch.int64), no_relay)


def test_build_topology_plan(topo):
    plan = build_topology_plan(SOURCE, DEST, topo, fixtures.process_groups(), epoch=12, row_bytes=ROW_BYTES,
                               route_ids=ROUTE_IDS)
    assert plan.splits.send[0] == (1, 1, 0, 2)
    assert plan.classes.rows == (2, 3, 3)
    assert plan.hierarchical.dispatch.stages == (2, 3, 1)
    assert plan.flat[RouteClass.CROSS_NODE].round_trip_bytes == 36
    with pytest.raises(ValueError, match="out of range"):
        build_topology_plan(SOURCE, DEST + 4, topo, fixtures.process_groups(), epoch=12, row_bytes=ROW_BYTES)


# --------------------------------------------------------------------------------------------- exchange
def _flat_vs_hier(topology: Topology, group: ProcessGroupSpec, c_global: np.ndarray, width: int, seed: int):
    """Run the flat and the hierarchical all-to-all-v on every rank; return both results per rank."""
    peer = list(group.peer_order)
    p = len(peer)

    def body(ex):
        me = ex.rank
        send = [int(c_global[me, peer[i]]) for i in range(p)]
        recv = [int(c_global[peer[i], me]) for i in range(p)]
        n = sum(send)
        g = torch.Generator().manual_seed(seed * 101 + me)
        rows = {"x": torch.randn(n, width, generator=g, dtype=torch.float64),
                "slot": torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)}
        flat = ex.all_to_all_v("flat", rows, send, recv)
        h = HierarchicalExchange(ex, topology)
        hier = h.all_to_all_v("hier", rows, send, recv)
        return flat, hier, h.last_call

    return LocalExchangeGroup(group, timeout_s=20.0).run(body)


def test_hierarchical_equals_flat_on_fixture(topo, counts):
    res = _flat_vs_hier(topo, fixtures.permuted_group(), counts.numpy(), 3, 0)
    for flat, hier, _ in res:
        assert flat.keys() == hier.keys()
        for k in flat:
            assert torch.equal(flat[k], hier[k])
    # per-stage rows: the global ledger every rank agrees on, and the rows each rank actually moved
    ledgers = [call.global_ledger for _, _, call in res]
    assert all(led == ledgers[0] for led in ledgers)
    assert ledgers[0].stages == (2, 3, 1)
    moved = [call.local_rows for _, _, call in res]
    assert sum(m.source_to_source_relay for m in moved) == 2
    assert sum(m.relay_to_relay for m in moved) == 3
    assert sum(m.relay_to_final for m in moved) == 1
    assert sum(m.direct_same_node for m in moved) == 3
    assert [m.relay_to_relay for m in moved] == [3, 0, 0, 0]  # only relay rank 0 crosses nodes


@st.composite
def _scenario(draw):
    num_nodes = draw(st.integers(1, 3))
    per_node = draw(st.integers(1, 3))
    p = num_nodes * per_node
    ranks, nodes = [], []
    for n in range(num_nodes):
        members = tuple(range(n * per_node, (n + 1) * per_node))
        relay = members[draw(st.integers(0, per_node - 1))]
        nodes.append(NodeInfo(node_id=f"node-{n}", ranks=members, relay_rank=relay))
        ranks += [RankInfo(rank=r, node_id=f"node-{n}", local_rank=i) for i, r in enumerate(members)]
    topology = Topology(ranks=tuple(ranks), nodes=tuple(nodes))
    order = draw(st.permutations(list(range(p))))
    c = np.asarray(draw(st.lists(st.integers(0, 3), min_size=p * p, max_size=p * p)), dtype=np.int64).reshape(p, p)
    width = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 10_000))
    return topology, ProcessGroupSpec(group_id="ep-group-0", peer_order=tuple(order)), c, width, seed


@settings(max_examples=25, deadline=None)
@given(_scenario())
def test_hierarchical_equals_flat_random(scenario):
    topology, group, c, width, seed = scenario
    res = _flat_vs_hier(topology, group, c, width, seed)
    expected = relay_stage_ledger(torch.from_numpy(c), topology)
    for flat, hier, call in res:
        for k in flat:
            assert torch.equal(flat[k], hier[k]), k
        assert call.global_ledger == expected
    assert sum(call.local_rows.relay_to_relay for _, _, call in res) == expected.relay_to_relay
    assert sum(call.local_rows.source_to_source_relay for _, _, call in res) == expected.source_to_source_relay
    assert sum(call.local_rows.relay_to_final for _, _, call in res) == expected.relay_to_final


def test_hierarchical_disagreement_aborts_every_rank_before_payload(topo, counts):
    group = fixtures.permuted_group()
    peer = list(group.peer_order)
    c = counts.numpy()

    def body(ex):
        me = ex.rank
        send = [int(c[me, peer[i]]) for i in range(4)]
        recv = [int(c[peer[i], me]) for i in range(4)]
        if me == 3:
            recv[0] += 1  # rank 3 expects a row nobody sends
        rows = {"x": torch.zeros(sum(send), 3)}
        h = HierarchicalExchange(ex, topo)
        try:
            h.all_to_all_v("t", rows, send, recv)
        except CountAgreementError as exc:
            return str(exc)
        return None

    msgs = LocalExchangeGroup(group, timeout_s=10.0).run(body)
    assert all(m is not None and "rank 3" in m for m in msgs)


def test_hierarchical_rejects_reserved_names_and_foreign_groups(topo):
    group = fixtures.permuted_group()
    ex = LocalExchangeGroup(group).endpoint(0)
    h = HierarchicalExchange(ex, topo)
    with pytest.raises(ValueError, match="reserved"):
        h.all_to_all_v("t", {"__hier.final": torch.zeros(0)}, [0] * 4, [0] * 4)
    small = ProcessGroupSpec(group_id="g", peer_order=(0, 1))
    with pytest.raises(ValueError, match="topology ranks"):
        HierarchicalExchange(LocalExchangeGroup(small).endpoint(0), topo)


# --------------------------------------------------------------------------------------------- engine
def _engine_run(group: ProcessGroupSpec, hierarchical: bool, fmt: PayloadFormat = PayloadFormat.NATIVE):
    snap = fixtures.snapshot(group)
    topo = fixtures.topology()
    selector = ExplicitSelector({o: fixtures.route_tensors(o)[3] for o in (0, 1)})
    scales = torch.tensor(fixtures.SCALES, dtype=torch.float64)

    def body(ex):
        ex = HierarchicalExchange(ex, topo) if hierarchical else ex
        hidden, ids, gates, _ = fixtures.route_tensors(ex.rank)
        out = dispatch(RouteBatch(ex.rank, hidden, ids, gates), snap, ex, selector=selector, tag="L0",
                       payload_format=fmt)
        logical = snap.phy2log[out.handle.receive.slot_ids].repeat_interleave(out.expert_counts)
        x = dequantize(out.rows, out.scales, fmt, torch.float64)
        y = x * scales[logical][:, None]  # the teaching expert E_e(x) = s_e * x
        d_call = ex.last_call if hierarchical else None
        res = combine(y, out.handle, snap, ex, tag="L0", out_dtype=torch.float64)
        c_call = ex.last_call if hierarchical else None
        return res, d_call, c_call

    return LocalExchangeGroup(group, timeout_s=20.0).run(body)


@pytest.mark.parametrize("group", [fixtures.flat_group(), fixtures.permuted_group()], ids=["flat-order", "peer-order"])
def test_engine_over_hierarchical_equals_flat(group):
    flat = _engine_run(group, hierarchical=False)
    hier = _engine_run(group, hierarchical=True)
    for rank in range(4):
        assert torch.equal(flat[rank][0], hier[rank][0])
    for rank, want in fixtures.EXPECTED_OUTPUT.items():
        assert torch.allclose(hier[rank][0], torch.tensor(want, dtype=torch.float64), rtol=1e-6)
    assert hier[2][0].shape == (0, 3) and hier[3][0].shape == (0, 3)
    # the relay ledger of the fixture, reported by the exchange itself
    assert hier[0][1].global_ledger.stages == (2, 3, 1)
    assert hier[0][2].global_ledger.stages == (1, 3, 2)
    assert sum(r[1].local_rows.source_to_source_relay for r in hier) == 2
    assert sum(r[2].local_rows.relay_to_final for r in hier) == 2


def test_engine_over_hierarchical_keeps_fp8_scales_with_rows():
    group = fixtures.permuted_group()
    flat = _engine_run(group, hierarchical=False, fmt=PayloadFormat.FP8_ROW)
    hier = _engine_run(group, hierarchical=True, fmt=PayloadFormat.FP8_ROW)
    for rank in range(4):
        assert torch.equal(flat[rank][0], hier[rank][0])
    for rank, want in fixtures.EXPECTED_OUTPUT.items():
        assert torch.allclose(hier[rank][0], torch.tensor(want, dtype=torch.float64), rtol=0.1)
