"""Manifest and objective report from EPLB output (spec 0x08C3, 0x08D)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe_dev.analysis.placement_builder import ObjectiveReport, manifest_from_eplb, objective_report
from ray_moe.placement.eplb import EPLBResult, rebalance_experts
from ray_moe.placement.eplb_solver import ideal_rank_loads
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import ProcessGroupSpec, Topology

FIXTURE = [4, 2, 1, 1]
CHECKPOINT = "checkpoint-0042"


@pytest.fixture
def hierarchical() -> EPLBResult:
    return rebalance_experts([FIXTURE], 8, 2, 2, 4)


@pytest.fixture
def global_policy() -> EPLBResult:
    return rebalance_experts([FIXTURE], 8, 1, 2, 4)


class TestObjectiveReport:
    def test_hierarchical_fixture(self, hierarchical):
        rep = objective_report(FIXTURE, hierarchical, 4)
        assert isinstance(rep, ObjectiveReport)
        assert rep.replica_counts == ((3, 1, 2, 2),)
        assert rep.rank_loads == ((Fraction(10, 3), Fraction(8, 3), Fraction(1), Fraction(1)),)
        assert rep.gamma_rank == (Fraction(5, 3),)
        assert rep.gamma_rank_float[0] == pytest.approx(5 / 3)
        assert rep.rank_loads_float[0] == pytest.approx([10 / 3, 8 / 3, 1.0, 1.0])
        assert rep.num_layers == 1 and rep.slots_per_gpu == 2 and rep.worst_gamma == pytest.approx(5 / 3)

    def test_global_counterfactual(self, global_policy):
        rep = objective_report(torch.tensor(FIXTURE), global_policy, 4)
        assert rep.replica_counts == ((4, 2, 1, 1),)
        assert rep.rank_loads == ((Fraction(2),) * 4,)
        assert rep.gamma_rank == (Fraction(1),)

    def test_more_balanced_is_not_more_local(self, hierarchical, global_policy):
        # 0x08D: global wins the ideal row-load coordinate; hierarchical keeps each group on one node.
        h = objective_report(FIXTURE, hierarchical, 4)
        g = objective_report(FIXTURE, global_policy, 4)
        assert g.gamma_rank[0] < h.gamma_rank[0]
        nodes_of = lambda p2l, e: {q // 4 for q, x in enumerate(p2l[0].tolist()) if x == e}  # noqa: E731
        assert nodes_of(hierarchical.phy2log, 0) == {0} and nodes_of(global_policy.phy2log, 0) == {0, 1}

    def test_multi_layer_and_float_weights(self):
        w = np.array([[4, 2, 1, 1], [0.1, 0.2, 0.3, 0.4]])
        res = rebalance_experts(w, 8, 2, 2, 4)
        rep = objective_report(w, res, 4)
        assert rep.num_layers == 2
        # exact fractions of the binary floats; they agree with the float64 helper
        assert rep.rank_loads_float[1] == pytest.approx(ideal_rank_loads(w, res.phy2log, 4)[1].tolist())
        assert sum(rep.rank_loads[1]) == Fraction(0.1) + Fraction(0.2) + Fraction(0.3) + Fraction(0.4)

    def test_all_zero_layer_has_gamma_one(self):
        res = rebalance_experts([[0, 0, 0, 0]], 8, 2, 2, 4)
        assert objective_report([0, 0, 0, 0], res, 4).gamma_rank == (Fraction(1),)

    def test_bad_input(self, hierarchical):
        with pytest.raises(ValueError, match="weight must be"):
            objective_report([4, 2, 1], hierarchical, 4)
        with pytest.raises(ValueError, match="num_gpus=3"):
            objective_report(FIXTURE, hierarchical, 3)
        with pytest.raises(ValueError, match="negative"):
            objective_report([4, -2, 1, 1], hierarchical, 4)
        with pytest.raises(ValueError, match="logcnt"):
            objective_report(FIXTURE, EPLBResult(hierarchical.phy2log, hierarchical.log2phy,
                                                 torch.tensor([[2, 2, 2, 2]])), 4)

    @settings(max_examples=100, deadline=None)
    @given(
        weights=st.lists(st.lists(st.integers(0, 50), min_size=8, max_size=8), min_size=1, max_size=3),
        groups=st.sampled_from([1, 2, 4]),
        nodes=st.sampled_from([1, 2]),
        per_gpu=st.integers(2, 4),
    )
    def test_loads_conserve_weight(self, weights, groups, nodes, per_gpu):
        res = rebalance_experts(weights, 4 * per_gpu, groups, nodes, 4)
        rep = objective_report(weights, res, 4)
        for l, row in enumerate(weights):
            assert sum(rep.rank_loads[l]) == sum(row)  # exact: every copy carries W_e / m_e
            assert rep.gamma_rank[l] >= 1
            assert list(rep.replica_counts[l]) == res.logcnt[l].tolist()


class TestManifest:
    def test_fixture_manifest(self, hierarchical):
        topo = Topology.uniform(4, 2)
        m = manifest_from_eplb(hierarchical, topology=topo, generation=17, num_experts=4,
                               checkpoint_version=CHECKPOINT)
        assert m.placement_version == "placement-v17" and m.checkpoint_version == CHECKPOINT
        assert m.process_group_id == "ep-group-0" and m.num_ranks == 4 and m.num_layers == 1
        assert [s.destination_rank for s in m.layer_slots()] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert [s.topology_domain_id for s in m.layer_slots()] == ["node-0"] * 4 + ["node-1"] * 4
        assert m.replica_counts() == [3, 1, 2, 2]
        assert [s.logical_expert_id for s in m.rank_slots(0)] == [1, 0]
        assert [s.logical_expert_id for s in m.rank_slots(1)] == [0, 0]
        # replica sets agree with EPLB's log2phy (the manifest numbers replicas in slot order)
        for e in range(4):
            eplb_slots = {q for q in hierarchical.log2phy[0, e].tolist() if q >= 0}
            assert {s.physical_slot_id for s in m.replicas(e)} == eplb_slots
        assert [s.replica_id for s in m.replicas(0)] == ["e0-r0", "e0-r1", "e0-r2"]

    def test_snapshot_from_eplb_manifest(self, hierarchical):
        topo = Topology.uniform(4, 2)
        m = manifest_from_eplb(hierarchical, topology=topo, generation=1, num_experts=4,
                               checkpoint_version=CHECKPOINT)
        snap = PlacementSnapshot.from_manifest(m, topo, ProcessGroupSpec.identity(4))
        assert snap.phy2log.tolist() == hierarchical.phy2log[0].tolist()
        assert snap.logcnt.tolist() == hierarchical.logcnt[0].tolist()
        for e in range(4):
            a = sorted(q for q in snap.log2phy[e].tolist() if q >= 0)
            b = sorted(q for q in hierarchical.log2phy[0, e].tolist() if q >= 0)
            assert a == b

    def test_multi_layer_and_digests(self):
        rng = np.random.default_rng(5)
        w = rng.random((3, 16)).astype(np.float32)
        res = rebalance_experts(w, 24, 4, 2, 8)
        digests = {(2, 5): "sha256:abc"}
        m = manifest_from_eplb(res, topology=Topology.uniform(8, 2), generation=3, num_experts=16,
                               checkpoint_version=CHECKPOINT, process_group_id="ep-group-7", digests=digests)
        assert m.num_layers == 3 and m.process_group_id == "ep-group-7"
        for l in range(3):
            assert m.replica_counts(l) == res.logcnt[l].tolist()
            assert [s.destination_rank for s in m.layer_slots(l)] == [q // 3 for q in range(24)]
        assert {s.parameter_digest for s in m.replicas(5, layer=2)} == {"sha256:abc"}
        assert {s.parameter_digest for s in m.replicas(5, layer=1)} == {f"expert-5-layer-1@{CHECKPOINT}"}

    def test_bad_input(self, hierarchical):
        with pytest.raises(ValueError, match="num_experts=5"):
            manifest_from_eplb(hierarchical, topology=Topology.uniform(4, 2), generation=1, num_experts=5,
                               checkpoint_version=CHECKPOINT)
        with pytest.raises(ValueError, match="3 ranks"):
            manifest_from_eplb(hierarchical, topology=Topology.uniform(3, 1), generation=1, num_experts=4,
                               checkpoint_version=CHECKPOINT)
        broken = EPLBResult(torch.tensor([[1, 1, 0, 0, 2, 2, 3, 3]]), hierarchical.log2phy, hierarchical.logcnt)
        with pytest.raises(ValueError, match="logcnt"):
            manifest_from_eplb(broken, topology=Topology.uniform(4, 2), generation=1, num_experts=4,
                               checkpoint_version=CHECKPOINT)
