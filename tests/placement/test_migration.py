"""Migration planning: the 0x08F v18 -> v19 table, refusals, and property tests."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.errors import AdmissionError
from ray_moe.placement.layout import ParallelLayout
from ray_moe.placement.manifest import PlacementManifest, manifest_from_assignment
from ray_moe.placement.migration import (
    NEXT_PUBLICATION_STEP,
    PUBLICATION_STEPS,
    MigrationActionKind as K,
    MigrationPlan,
    PublicationStep,
    plan_migration,
)
from ray_moe.placement.topology import Topology
from ray_moe_dev.testing.fixtures import CHECKPOINT, topology

EXPERT_BYTES = 36  # BF16 SwiGLU d=2, d_ff=3: 3*2*3 = 18 elements * 2 B (spec 0x08F)
DIGESTS = {(0, e): f"expert-{e}-state-v42" for e in range(4)}


def _manifest(generation: int, phy2log, ranks, *, topo: Topology | None = None, digests=None,
              checkpoint: str = CHECKPOINT, num_experts: int = 4) -> PlacementManifest:
    topo = topo or topology()
    layers = phy2log if phy2log and isinstance(phy2log[0], (list, tuple)) else [phy2log]
    rank_layers = ranks if ranks and isinstance(ranks[0], (list, tuple)) else [ranks]
    if digests is None:
        digests = {(l, e): f"expert-{e}-layer-{l}-state-v42" for l in range(len(layers)) for e in range(num_experts)}
        digests.update(DIGESTS)
    return manifest_from_assignment(
        generation=generation, phy2log=layers, slot_rank=rank_layers, num_experts=num_experts,
        topology=topo, checkpoint_version=checkpoint, digests=digests,
    )


def v18() -> PlacementManifest:
    # The spec (0x08F) does not list every placement-v18 slot. This fixture is pinned here so that the
    # spec's v18 -> v19 table follows from it exactly:
    #   q0: E0 on rank 0, q1: E0 on rank 3, q2: E1 on rank 1, q3: E1 on rank 2, q4: E2 on rank 2, q5: E3 on rank 3
    # checkpoint-0042, topology = fixtures.topology() (ranks 0,1 on node-0; 2,3 on node-1).
    return _manifest(18, [0, 0, 1, 1, 2, 3], [0, 3, 1, 2, 2, 3])


def v19() -> PlacementManifest:
    # The EPLB hierarchical target of spec 0x08C3.
    return _manifest(19, [1, 0, 0, 0, 2, 2, 3, 3], [0, 0, 1, 1, 2, 2, 3, 3])


def _row(a):
    return (a.action, a.target_slot, a.target_rank, a.expert, a.source_rank, a.source_slot, a.source_generation, a.bytes)


def test_publication_steps_are_ordered_by_the_table():
    assert PUBLICATION_STEPS == (
        PublicationStep.RESERVE, PublicationStep.MATERIALIZE, PublicationStep.VERIFY_DIGESTS,
        PublicationStep.PUBLISH, PublicationStep.DRAIN, PublicationStep.RETIRE,
    )
    assert NEXT_PUBLICATION_STEP[PublicationStep.VERIFY_DIGESTS] is PublicationStep.PUBLISH
    assert NEXT_PUBLICATION_STEP[PublicationStep.RETIRE] is None


def test_spec_0x08F_v18_to_v19_plan_golden():
    plan = plan_migration(v18(), v19(), topology(), expert_bytes=EXPERT_BYTES)
    assert [_row(a) for a in plan.target_actions()] == [
        (K.SAME_NODE_COPY, 0, 0, 1, 1, 2, 18, 36),   # p0 E1: same-node network copy from rank 1 q2
        (K.RETAIN, 1, 0, 0, 0, 0, 18, 36),           # p1 E0: retain rank 0 q0
        (K.SAME_NODE_COPY, 2, 1, 0, 0, 0, 18, 36),   # p2 E0: same-node network copy from rank 0 q0
        (K.SAME_GPU_COPY, 3, 1, 0, 1, 2, 19, 36),    # p3 E0: same-GPU duplicate after p2
        (K.RETAIN, 4, 2, 2, 2, 4, 18, 36),           # p4 E2: retain rank 2 q4
        (K.SAME_GPU_COPY, 5, 2, 2, 2, 4, 19, 36),    # p5 E2: same-GPU duplicate after p4
        (K.RETAIN, 6, 3, 3, 3, 5, 18, 36),           # p6 E3: retain rank 3 q5
        (K.SAME_GPU_COPY, 7, 3, 3, 3, 6, 19, 36),    # p7 E3: same-GPU duplicate after p6
    ]
    # old copies retired later: q1 (E0 rank 3), q2 (E1 rank 1), q3 (E1 rank 2)
    assert [(a.source_slot, a.source_rank, a.expert) for a in plan.retire_actions()] == [(1, 3, 0), (2, 1, 1), (3, 2, 1)]
    L = plan.ledger
    assert (L.retained_copies, L.retained_bytes) == (3, 108)
    assert (L.same_node_copies, L.same_node_bytes) == (2, 72)
    assert (L.same_gpu_copies, L.same_gpu_bytes) == (3, 108)
    assert (L.retired_copies, L.retired_bytes) == (3, 108)
    assert (L.cross_node_copies, L.cross_node_bytes, L.checkpoint_loads, L.checkpoint_load_bytes) == (0, 0, 0, 0)
    assert (L.resident_old_bytes, L.resident_new_bytes, L.peak_bytes) == (216, 288, 396)
    assert L.network_bytes == 72
    # 0x08G: reserve storage for five non-retained target copies
    assert L.reserved_bytes == 5 * 36
    assert L.rank_reserved_bytes == {0: 36, 1: 72, 2: 36, 3: 36}
    assert L.rank_peak_bytes == {0: 72, 1: 108, 2: 108, 3: 108}
    assert sum(L.rank_peak_bytes.values()) == L.peak_bytes
    assert L.evidence == "analytical"
    assert plan.steps == PUBLICATION_STEPS
    assert (plan.old_placement_version, plan.new_placement_version, plan.layers) == ("placement-v18", "placement-v19", (0,))
    assert plan.action_for(3).source_slot == 2
    assert {(a.checkpoint_version, a.parameter_digest) for a in plan.target_actions() if a.expert == 0} == {
        (CHECKPOINT, "expert-0-state-v42")}
    # JSON round trip and schema export (user-facing record)
    assert MigrationPlan.model_validate_json(plan.model_dump_json()) == plan
    assert "ledger" in MigrationPlan.model_json_schema()["properties"]


def test_cross_node_copy_and_checkpoint_load():
    old = _manifest(1, [0, 1, 2, 3], [0, 1, 2, 3])
    # E0 to rank 2 (node-1): only source q0 on rank 0 (node-0) -> cross node.
    # E3 to rank 1 (node-0): sources q3 on rank 3 (node-1) only -> cross node.
    new = _manifest(2, [0, 1, 2, 3, 0, 3], [0, 1, 2, 3, 2, 1])
    plan = plan_migration(old, new, topology(), expert_bytes=10)
    rows = {a.target_slot: (a.action, a.source_rank, a.source_slot) for a in plan.target_actions()}
    assert rows == {0: (K.RETAIN, 0, 0), 1: (K.RETAIN, 1, 1), 2: (K.RETAIN, 2, 2), 3: (K.RETAIN, 3, 3),
                    4: (K.CROSS_NODE_COPY, 0, 0), 5: (K.CROSS_NODE_COPY, 3, 3)}
    assert (plan.ledger.cross_node_copies, plan.ledger.cross_node_bytes, plan.ledger.network_bytes) == (2, 20, 20)
    assert plan.ledger.retired_copies == 0
    # A new parameter digest for E1: nothing compatible exists anywhere -> checkpoint load, old E1 retired.
    digests = {(0, e): f"expert-{e}-state-v42" for e in range(4)} | {(0, 1): "expert-1-state-v43"}
    new2 = _manifest(3, [0, 1, 2, 3], [0, 1, 2, 3], digests=digests)
    plan2 = plan_migration(old, new2, topology(), expert_bytes=10)
    a = plan2.action_for(1)
    assert (a.action, a.source_rank, a.source_slot, a.source_generation) == (K.CHECKPOINT_LOAD, None, None, None)
    assert [(r.source_slot, r.expert) for r in plan2.retire_actions()] == [(1, 1)]


def test_source_prefers_same_node_then_lowest_rank_slot():
    topo = Topology.uniform(6, 2)  # node-0: 0,1,2  node-1: 3,4,5
    old = _manifest(1, [0, 0, 0, 1, 2, 3], [4, 2, 1, 0, 3, 5], topo=topo)
    new = _manifest(2, [0, 0, 1, 2, 3], [0, 5, 1, 3, 4], topo=topo)
    plan = plan_migration(old, new, topo, expert_bytes=1)
    # E0 to rank 0 (node-0): same-node candidates rank 1 (q2), rank 2 (q1) -> lowest rank: rank 1 q2
    assert _row(plan.action_for(0))[:7] == (K.SAME_NODE_COPY, 0, 0, 0, 1, 2, 1)
    # E0 to rank 5 (node-1): same-node candidate rank 4 q0
    assert _row(plan.action_for(1))[:7] == (K.SAME_NODE_COPY, 1, 5, 0, 4, 0, 1)


def test_retains_each_old_slot_at_most_once_and_multi_layer():
    old = _manifest(1, [[0, 0, 1], [1, 0, 0]], [[0, 0, 1], [1, 0, 0]],
                    digests={(l, e): f"d{l}{e}" for l in range(2) for e in range(2)}, num_experts=2)
    new = _manifest(2, [[0, 0, 0, 1], [0, 1]], [[0, 0, 0, 1], [1, 1]],
                    digests={(l, e): f"d{l}{e}" for l in range(2) for e in range(2)}, num_experts=2)
    plan = plan_migration(old, new, topology(), expert_bytes=4)
    l0 = [a.action for a in plan.target_actions(0)]
    assert l0 == [K.RETAIN, K.RETAIN, K.SAME_GPU_COPY, K.RETAIN]
    assert plan.action_for(2, layer=0).source_slot == 0  # duplicate of the first materialised p0
    l1 = [(a.action, a.source_rank, a.source_slot) for a in plan.target_actions(1)]
    assert l1 == [(K.SAME_NODE_COPY, 0, 1), (K.RETAIN, 1, 0)]
    assert [(a.layer, a.source_slot) for a in plan.retire_actions()] == [(1, 1), (1, 2)]
    assert plan.ledger.peak_bytes == (6 + 6 - 4) * 4
    only1 = plan_migration(old, new, topology(), expert_bytes=4, layer=1)
    assert only1.layers == (1,) and only1.ledger.resident_old_bytes == 12 and only1.ledger.resident_new_bytes == 8
    with pytest.raises(ValueError, match="layer=2 is outside 0..1"):
        plan_migration(old, new, topology(), expert_bytes=4, layer=2)


def test_admission_budget_refusal_names_rank_peak_and_budget():
    ok = plan_migration(v18(), v19(), topology(), expert_bytes=36,
                        rank_budget_bytes={0: 72, 1: 108, 2: 108, 3: 108})
    assert ok.rank_budget_bytes == {0: 72, 1: 108, 2: 108, 3: 108}
    with pytest.raises(AdmissionError, match=r"rank 1: peak 108 B > budget 107 B") as ei:
        plan_migration(v18(), v19(), topology(), expert_bytes=36, rank_budget_bytes={0: 1000, 1: 107})
    assert "rank 0" not in str(ei.value)
    with pytest.raises(ValueError, match=r"rank_budget_bytes\[2\]=-1"):
        plan_migration(v18(), v19(), topology(), expert_bytes=36, rank_budget_bytes={2: -1})
    with pytest.raises(ValueError, match="rank_budget_bytes: rank 9"):
        plan_migration(v18(), v19(), topology(), expert_bytes=36, rank_budget_bytes={9: 1})


def test_refusals_before_planning():
    with pytest.raises(AdmissionError, match="new.generation=18 equals old.generation"):
        plan_migration(v18(), v18(), topology(), expert_bytes=36)
    five = _manifest(19, [0, 1, 2, 3, 4], [0, 1, 2, 3, 3], num_experts=5,
                     digests={(0, e): f"x{e}" for e in range(5)})
    with pytest.raises(AdmissionError, match="new.num_experts=5 != old.num_experts=4"):
        plan_migration(v18(), five, topology(), expert_bytes=36)
    for bad in (0, -36, 1.5, True):
        with pytest.raises(ValueError, match="expert_bytes="):
            plan_migration(v18(), v19(), topology(), expert_bytes=bad)
    with pytest.raises(ValueError, match="new.topology_version='topology-v3' but the topology given is 'topology-v0'"):
        plan_migration(v18(), v19(), Topology.uniform(4, 2), expert_bytes=36)


def test_layout_change_under_same_generation_is_refused_0x0BB():
    active = ParallelLayout(tp=2, cp=1, dp=2, pp=1, etp=1, ep=4, edp=1, ranks=(0, 1, 2, 3))
    candidate = ParallelLayout(tp=2, cp=1, dp=2, pp=1, etp=2, ep=2, edp=1, ranks=(0, 1, 2, 3))
    v19_again = v19()
    with pytest.raises(AdmissionError, match=r"etp=1->2, ep=4->2.*new generation \(spec 0x0BB\)"):
        plan_migration(v19_again, v19_again, topology(), expert_bytes=36, old_layout=active, new_layout=candidate)
    # A new generation is required, and an ETP>1 candidate needs a per-shard manifest: refused explicitly.
    with pytest.raises(AdmissionError, match="new_layout.etp=2.*one copy spanning an ETP group"):
        plan_migration(v18(), v19(), topology(), expert_bytes=36, old_layout=active, new_layout=candidate)
    # The same layout on both sides plans normally.
    plan = plan_migration(v18(), v19(), topology(), expert_bytes=36, old_layout=active, new_layout=active)
    assert plan.ledger.peak_bytes == 396


# ---------------------------------------------------------------------------- properties
TOPOS = (topology(), Topology.uniform(4, 1), Topology.uniform(6, 3))


@st.composite
def migrations(draw):
    topo = draw(st.sampled_from(TOPOS))
    P = topo.num_ranks
    E = draw(st.integers(1, 4))
    L = draw(st.integers(1, 2))

    def layout(extra_max: int):
        p2l, rk = [], []
        for _ in range(L):
            extra = draw(st.lists(st.integers(0, E - 1), max_size=extra_max))
            experts = list(range(E)) + extra
            experts = draw(st.permutations(experts))
            p2l.append(list(experts))
            rk.append(draw(st.lists(st.integers(0, P - 1), min_size=len(experts), max_size=len(experts))))
        return p2l, rk

    old_p2l, old_rk = layout(5)
    new_p2l, new_rk = layout(6)
    # Each (layer, expert) keeps its digest or gets a new one in the candidate.
    base = {(l, e): f"d{l}-{e}" for l in range(L) for e in range(E)}
    bumped = dict(base)
    for key in draw(st.lists(st.sampled_from(sorted(base)), max_size=2)):
        bumped[key] = base[key] + "-new"
    old = _manifest(1, old_p2l, old_rk, topo=topo, digests=base, num_experts=E)
    new = _manifest(2, new_p2l, new_rk, topo=topo, digests=bumped, num_experts=E)
    return old, new, topo, draw(st.integers(1, 100))


@settings(max_examples=60, deadline=None)
@given(migrations())
def test_property_every_slot_accounted_and_ledgers_add_up(case):
    old, new, topo, xb = case
    plan = plan_migration(old, new, topo, expert_bytes=xb)
    L = plan.ledger
    targets, retires = plan.target_actions(), plan.retire_actions()
    # every target slot gets exactly one action
    assert Counter((a.layer, a.target_slot) for a in targets) == Counter((s.layer, s.physical_slot_id) for s in new.slots)
    # every old slot is retained or retired exactly once
    retained = [(a.layer, a.source_slot) for a in targets if a.action is K.RETAIN]
    retired = [(a.layer, a.source_slot) for a in retires]
    assert sorted(retained + retired) == sorted((s.layer, s.physical_slot_id) for s in old.slots)
    assert len(set(retained)) == len(retained)
    # action semantics against the manifests
    for a in targets:
        t = next(s for s in new.slots if s.layer == a.layer and s.physical_slot_id == a.target_slot)
        assert (a.expert, a.target_rank, a.bytes) == (t.logical_expert_id, t.destination_rank, xb)
        assert a.parameter_digest == t.parameter_digest
        if a.action in (K.RETAIN, K.SAME_NODE_COPY, K.CROSS_NODE_COPY):
            src = next(s for s in old.slots if s.layer == a.layer and s.physical_slot_id == a.source_slot)
            assert (src.logical_expert_id, src.parameter_digest) == (t.logical_expert_id, t.parameter_digest)
            assert src.destination_rank == a.source_rank and a.source_generation == old.generation
            assert topo.route_class(a.source_rank, a.target_rank).value == {
                K.RETAIN: "same-gpu", K.SAME_NODE_COPY: "same-node-remote-gpu", K.CROSS_NODE_COPY: "different-node",
            }[a.action]
        elif a.action is K.SAME_GPU_COPY:
            assert a.source_generation == new.generation and a.source_rank == a.target_rank
            assert a.source_slot < a.target_slot
        else:
            assert a.action is K.CHECKPOINT_LOAD
            assert not any(s.layer == a.layer and s.logical_expert_id == a.expert
                           and s.parameter_digest == t.parameter_digest for s in old.slots)
    # byte ledgers add up
    assert L.resident_old_bytes == len(old.slots) * xb and L.resident_new_bytes == len(new.slots) * xb
    copies = L.same_gpu_bytes + L.same_node_bytes + L.cross_node_bytes + L.checkpoint_load_bytes
    assert L.retained_bytes + copies == L.resident_new_bytes
    assert L.retained_bytes + L.retired_bytes == L.resident_old_bytes
    assert L.reserved_bytes == copies == sum(L.rank_reserved_bytes.values())
    assert L.network_bytes == L.same_node_bytes + L.cross_node_bytes
    # peak formula, globally and per rank
    assert L.peak_bytes == L.resident_old_bytes + L.resident_new_bytes - L.retained_bytes
    assert sum(L.rank_peak_bytes.values()) == L.peak_bytes
    for r, peak in L.rank_peak_bytes.items():
        assert peak >= max(sum(xb for s in old.slots if s.destination_rank == r),
                           sum(xb for s in new.slots if s.destination_rank == r))
    # the plan's own budget is admitted; one byte less on the hottest rank is refused
    hot = max(L.rank_peak_bytes, key=lambda r: (L.rank_peak_bytes[r], -r))
    plan_migration(old, new, topo, expert_bytes=xb, rank_budget_bytes=dict(L.rank_peak_bytes))
    with pytest.raises(AdmissionError, match=f"rank {hot}: peak {L.rank_peak_bytes[hot]} B"):
        plan_migration(old, new, topo, expert_bytes=xb, rank_budget_bytes={hot: L.rank_peak_bytes[hot] - 1})
