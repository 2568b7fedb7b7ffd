"""The versioned placement manifest, topology and process-group records (spec 0x02B1, 0x02B2, 0x01D1,
0x07A, 0x07B) and the PlacementSnapshot tensors built from them."""

from __future__ import annotations

import json

import pydantic
import pytest
import torch

from ray_moe.placement.manifest import PlacementManifest, SlotSpec, manifest_from_assignment
from ray_moe.placement.snapshot import PlacementSnapshot, snapshots_for
from ray_moe.placement.topology import (
    NodeInfo,
    ProcessGroupSpec,
    RankInfo,
    Topology,
    check_group_in_topology,
)
from ray_moe_dev.testing import fixtures as fx
from ray_moe.core.types import GenerationState

SIX_SLOT_TABLE = [  # 0x02B1: slot, logical expert, replica, rank, domain, checkpoint
    ("q0", 0, "e0-r0", 0, "node-0", "checkpoint-0042"),
    ("q1", 0, "e0-r1", 1, "node-0", "checkpoint-0042"),
    ("q2", 1, "e1-r0", 1, "node-0", "checkpoint-0042"),
    ("q3", 1, "e1-r1", 2, "node-1", "checkpoint-0042"),
    ("q4", 2, "e2-r0", 2, "node-1", "checkpoint-0042"),
    ("q5", 3, "e3-r0", 3, "node-1", "checkpoint-0042"),
]


def _fields(**over):
    m = fx.six_slot_manifest()
    body = dict(generation=m.generation, process_group_id=m.process_group_id,
                checkpoint_version=m.checkpoint_version, num_experts=m.num_experts, num_ranks=m.num_ranks,
                topology_version=m.topology_version, slots=m.slots)
    body.update(over)
    return body


def _with_slot(index: int, **update) -> tuple[SlotSpec, ...]:
    slots = list(fx.six_slot_manifest().slots)
    slots[index] = slots[index].model_copy(update=update)
    return tuple(slots)


def _raises(pattern: str, fn, *args, **kwargs):
    with pytest.raises((ValueError, pydantic.ValidationError), match=pattern):
        fn(*args, **kwargs)


# ------------------------------------------------------------------------------- 0x02B1 / 0x02B2
def test_six_slot_manifest_table_0x02B1():
    m = fx.six_slot_manifest()
    rows = [(s.label, s.logical_expert_id, s.replica_id, s.destination_rank, s.topology_domain_id,
             s.checkpoint_version or m.checkpoint_version) for s in m.layer_slots()]
    assert rows == SIX_SLOT_TABLE
    assert (m.num_experts, m.num_ranks, m.num_slots(), m.num_layers) == (4, 4, 6, 1)
    assert m.generation == 17 and m.placement_version == "placement-v17"
    assert m.process_group_id == "ep-group-0" and m.checkpoint_version == "checkpoint-0042"
    assert m.state == GenerationState.PENDING and m.in_flight_refcount == 0
    # two logical experts are replicated; the router vocabulary is still four experts
    assert m.replica_counts() == [2, 2, 1, 1]
    assert [s.label for s in m.replicas(0)] == ["q0", "q1"]
    assert [s.replica_id for s in m.replicas(1)] == ["e1-r0", "e1-r1"]
    assert [s.label for s in m.replicas(3)] == ["q5"]
    assert {r: [s.label for s in m.rank_slots(r)] for r in range(4)} == \
        {0: ["q0"], 1: ["q1", "q2"], 2: ["q3", "q4"], 3: ["q5"]}
    # two nodes
    assert {s.topology_domain_id for s in m.rank_slots(0) + m.rank_slots(1)} == {"node-0"}
    assert {s.topology_domain_id for s in m.rank_slots(2) + m.rank_slots(3)} == {"node-1"}
    m.validate_against(fx.topology(), fx.flat_group())
    m.validate_against(fx.topology(), fx.permuted_group())


def test_versioned_manifest_json_0x02B2():
    """A report view in state DRAINING with one in-flight handle, and the slot record of q1."""
    view = fx.six_slot_manifest().with_state(GenerationState.DRAINING, 1)
    doc = json.loads(view.model_dump_json())
    assert {k: doc[k] for k in ("placement_version", "generation", "state", "process_group_id",
                                "checkpoint_version", "in_flight_refcount")} == {
        "placement_version": "placement-v17",
        "generation": 17,
        "state": "DRAINING",
        "process_group_id": "ep-group-0",
        "checkpoint_version": "checkpoint-0042",
        "in_flight_refcount": 1,
    }
    q1 = [s for s in doc["slots"] if s["physical_slot_id"] == 1][0]
    assert {k: q1[k] for k in ("logical_expert_id", "replica_id", "destination_rank", "topology_domain_id",
                               "parameter_digest")} == {
        "logical_expert_id": 0,
        "replica_id": "e0-r1",
        "destination_rank": 1,
        "topology_domain_id": "node-0",
        "parameter_digest": "expert-0-state-v42",
    }
    # the JSON round-trips to the same content
    back = PlacementManifest.model_validate_json(view.model_dump_json())
    assert back.content_digest() == view.content_digest()
    assert back.state == GenerationState.DRAINING and back.in_flight_refcount == 1


def test_json_schema_export():
    schema = PlacementManifest.model_json_schema()
    props = schema["properties"]
    for key in ("generation", "placement_version", "state", "process_group_id", "checkpoint_version",
                "in_flight_refcount", "num_experts", "num_ranks", "slots"):
        assert key in props, key
    assert schema["additionalProperties"] is False
    slot = schema["$defs"]["SlotSpec"]
    assert set(slot["required"]) >= {"physical_slot_id", "logical_expert_id", "replica_id", "destination_rank",
                                     "topology_domain_id", "parameter_digest"}
    assert slot["properties"]["physical_slot_id"]["minimum"] == 0
    json.dumps(schema)  # serialisable
    json.dumps(Topology.model_json_schema())
    json.dumps(ProcessGroupSpec.model_json_schema())


def test_manifest_is_frozen():
    m = fx.six_slot_manifest()
    with pytest.raises(pydantic.ValidationError):
        m.generation = 18
    with pytest.raises(pydantic.ValidationError):
        m.slots[0].logical_expert_id = 1


def test_manifest_from_assignment_matches_the_fixture():
    m = manifest_from_assignment(generation=17, phy2log=[[0, 0, 1, 1, 2, 3]], slot_rank=[[0, 1, 1, 2, 2, 3]],
                                 num_experts=4, topology=fx.topology(), checkpoint_version="checkpoint-0042")
    rows = [(s.label, s.logical_expert_id, s.replica_id, s.destination_rank, s.topology_domain_id,
             s.checkpoint_version or m.checkpoint_version) for s in m.layer_slots()]
    assert rows == SIX_SLOT_TABLE
    assert m.layer_slots()[3].parameter_digest == "expert-1-layer-0@checkpoint-0042"
    # two layers, each complete
    m2 = manifest_from_assignment(generation=1, phy2log=[[0, 1, 1], [1, 0, 0]], slot_rank=[[0, 1, 0], [1, 0, 1]],
                                  num_experts=2, topology=Topology.single_node(2))
    assert m2.num_layers == 2 and m2.num_slots(0) == m2.num_slots(1) == 3
    assert [s.replica_id for s in m2.layer_slots(1)] == ["e1-r0", "e0-r0", "e0-r1"]
    assert len(snapshots_for(m2, Topology.single_node(2), ProcessGroupSpec.identity(2))) == 2
    _raises(r"slot_rank has 1 layers but phy2log has 2", manifest_from_assignment, generation=1,
            phy2log=[[0], [0]], slot_rank=[[0]], num_experts=1, topology=Topology.single_node(1))
    _raises(r"slot_rank\[0\] has 1 slots but phy2log\[0\] has 2", manifest_from_assignment, generation=1,
            phy2log=[[0, 0]], slot_rank=[[0]], num_experts=1, topology=Topology.single_node(1))


# ------------------------------------------------------------------------------- manifest validation
def test_duplicate_slot_id():
    _raises(r"duplicate physical_slot_id=1 in layer 0", PlacementManifest,
            **_fields(slots=_with_slot(2, physical_slot_id=1)))


def test_slot_ids_must_be_contiguous():
    _raises(r"physical_slot_id in layer 0 must be 0\.\.5, got \[0, 1, 2, 3, 4, 6\]", PlacementManifest,
            **_fields(slots=_with_slot(5, physical_slot_id=6)))


def test_unknown_expert():
    _raises(r"slots\[q5\]\.logical_expert_id=4 is unknown \(num_experts=4\)", PlacementManifest,
            **_fields(slots=_with_slot(5, logical_expert_id=4)))


def test_expert_with_no_slot():
    _raises(r"logical expert 4 has no slot in layer 0", PlacementManifest, **_fields(num_experts=5))
    # q5 moved to expert 2: expert 3 loses its only slot
    _raises(r"logical expert 3 has no slot", PlacementManifest,
            **_fields(slots=_with_slot(5, logical_expert_id=2, parameter_digest="expert-2-state-v42")))


def test_rank_outside_group():
    _raises(r"slots\[q5\]\.destination_rank=4 is outside the group of 4 ranks", PlacementManifest,
            **_fields(slots=_with_slot(5, destination_rank=4)))
    _raises(r"slots\[q3\]\.destination_rank=2 is outside the group of 2 ranks", PlacementManifest,
            **_fields(num_ranks=2))


def test_replicas_with_different_checkpoint():
    _raises(r"slots\[q1\]\.checkpoint_version='checkpoint-0041' differs from replica 'e0-r0' "
            r"\('checkpoint-0042'\) of logical expert 0", PlacementManifest,
            **_fields(slots=_with_slot(1, checkpoint_version="checkpoint-0041")))
    # an explicit checkpoint equal to the manifest's is the same checkpoint
    PlacementManifest(**_fields(slots=_with_slot(1, checkpoint_version="checkpoint-0042")))


def test_replicas_with_different_digest():
    _raises(r"slots\[q3\]\.parameter_digest='expert-1-state-v41' differs from replica 'e1-r0' "
            r"\('expert-1-state-v42'\) of logical expert 1", PlacementManifest,
            **_fields(slots=_with_slot(3, parameter_digest="expert-1-state-v41")))


def test_placement_version_must_name_the_generation():
    _raises(r"placement_version='placement-v18' does not name generation=17", PlacementManifest,
            **_fields(placement_version="placement-v18"))
    assert PlacementManifest(**_fields(placement_version="placement-v17")).placement_version == "placement-v17"


def test_slot_layer_outside_manifest():
    _raises(r"slots\[q5\]\.layer=1 >= num_layers=1", PlacementManifest, **_fields(slots=_with_slot(5, layer=1)))


def test_field_constraints_name_the_field():
    _raises(r"physical_slot_id", SlotSpec, physical_slot_id=-1, logical_expert_id=0, replica_id="e0-r0",
            destination_rank=0, topology_domain_id="node-0", parameter_digest="d")
    _raises(r"destination_rank", SlotSpec, physical_slot_id=0, logical_expert_id=0, replica_id="e0-r0",
            destination_rank=-3, topology_domain_id="node-0", parameter_digest="d")
    _raises(r"replica_id", SlotSpec, physical_slot_id=0, logical_expert_id=0, replica_id="",
            destination_rank=0, topology_domain_id="node-0", parameter_digest="d")
    _raises(r"slots", PlacementManifest, **_fields(slots=()))
    _raises(r"in_flight_refcount", PlacementManifest, **_fields(in_flight_refcount=-1))
    _raises(r"surprise", PlacementManifest, **_fields(surprise=1))  # extra fields are forbidden


# ------------------------------------------------------------------------------- validate_against (0x01D1)
def test_domain_not_owning_its_rank():
    m = PlacementManifest(**_fields(slots=_with_slot(3, topology_domain_id="node-0")))
    _raises(r"slots\[q3\]\.topology_domain_id='node-0' does not own rank 2 \(its node is 'node-1'\)",
            m.validate_against, fx.topology(), fx.flat_group())
    _raises(r"does not own rank 2", PlacementSnapshot.from_manifest, m, fx.topology(), fx.flat_group())


def test_group_id_must_match():
    group = ProcessGroupSpec(group_id="ep-group-9", peer_order=(0, 1, 2, 3))
    _raises(r"process_group_id='ep-group-0' but the group given is 'ep-group-9'",
            fx.six_slot_manifest().validate_against, fx.topology(), group)


def test_slot_rank_outside_the_process_group():
    group = ProcessGroupSpec(group_id="ep-group-0", peer_order=(0, 1, 2))
    _raises(r"slots\[q5\]\.destination_rank=3 is outside process group 'ep-group-0'",
            fx.six_slot_manifest().validate_against, fx.topology(), group)


def test_group_member_outside_num_ranks():
    group = ProcessGroupSpec(group_id="ep-group-0", peer_order=(0, 1, 2, 3, 4))
    _raises(r"member rank 4 is outside num_ranks=4", fx.six_slot_manifest().validate_against, fx.topology(), group)


# ------------------------------------------------------------------------------- topology / process group
def _ranks():
    return list(fx.topology().ranks)


def test_fixture_topology():
    t = fx.topology()
    assert t.num_ranks == 4 and t.version == "topology-v3"
    assert [t.node_of(r) for r in range(4)] == ["node-0", "node-0", "node-1", "node-1"]
    assert t.node_index() == [0, 0, 1, 1]
    assert [n.relay_rank for n in t.nodes] == [0, 2]
    assert [t.route_class(0, u).value for u in range(4)] == \
        ["same-gpu", "same-node-remote-gpu", "different-node", "different-node"]
    _raises(r"rank=7 is not in topology 'topology-v3'", t.rank_info, 7)


def test_rank_in_two_nodes():
    nodes = (NodeInfo(node_id="node-0", ranks=(0, 1), relay_rank=0),
             NodeInfo(node_id="node-1", ranks=(1, 2, 3), relay_rank=2))
    _raises(r"nodes: rank 1 is in two nodes \('node-0' and 'node-1'\)", Topology, ranks=_ranks(), nodes=nodes)


def test_relay_outside_node():
    _raises(r"relay_rank=2 of node 'node-0' is outside its node ranks \[0, 1\]", NodeInfo,
            node_id="node-0", ranks=(0, 1), relay_rank=2)


def test_topology_rank_errors():
    nodes = fx.topology().nodes
    ranks = _ranks()
    _raises(r"ranks: duplicate rank 1", Topology, ranks=ranks[:3] + [ranks[1]], nodes=nodes)
    gap = ranks[:3] + [ranks[3].model_copy(update={"rank": 5})]
    _raises(r"ranks: global ranks must be 0\.\.3, got \[0, 1, 2, 5\]", Topology, ranks=gap, nodes=nodes)
    short = (NodeInfo(node_id="node-0", ranks=(0, 1)), NodeInfo(node_id="node-1", ranks=(2,)))
    _raises(r"nodes: rank 3 belongs to no node", Topology, ranks=ranks, nodes=short)
    wrong = ranks[:3] + [ranks[3].model_copy(update={"node_id": "node-0"})]
    _raises(r"ranks\[3\]\.node_id='node-0' but nodes list it under 'node-1'", Topology, ranks=wrong, nodes=nodes)
    extra = (NodeInfo(node_id="node-0", ranks=(0, 1)), NodeInfo(node_id="node-1", ranks=(2, 3, 4)))
    _raises(r"nodes: rank 4 is not a declared rank", Topology, ranks=ranks, nodes=extra)
    same_local = ranks[:3] + [ranks[3].model_copy(update={"local_rank": 0})]
    _raises(r"ranks\[3\]\.local_rank=0 repeats inside node 'node-1'", Topology, ranks=same_local, nodes=nodes)
    dup_node = (NodeInfo(node_id="node-0", ranks=(0, 1)), NodeInfo(node_id="node-0", ranks=(2, 3)))
    _raises(r"nodes: duplicate node_id", Topology,
            ranks=[r.model_copy(update={"node_id": "node-0", "local_rank": i}) for i, r in enumerate(ranks)],
            nodes=dup_node)
    _raises(r"num_ranks=4 is not divisible by num_nodes=3", Topology.uniform, 4, 3)
    _raises(r"rank", RankInfo, rank=-1, node_id="node-0", local_rank=0)


def test_uniform_topology():
    t = Topology.uniform(4, 2)
    assert [n.ranks for n in t.nodes] == [(0, 1), (2, 3)]
    assert [n.relay_rank for n in t.nodes] == [0, 2]
    assert [t.rank_info(r).nic_via_rank for r in range(4)] == [None, 0, None, 2]
    assert Topology.single_node(3).node_index() == [0, 0, 0]


def test_process_group_errors():
    _raises(r"peer_order: rank 1 appears twice in group 'ep-group-0'", ProcessGroupSpec,
            group_id="ep-group-0", peer_order=(0, 1, 1, 3))
    _raises(r"peer_order: negative rank in \[0, -1\]", ProcessGroupSpec, group_id="g", peer_order=(0, -1))
    _raises(r"peer_order", ProcessGroupSpec, group_id="g", peer_order=())
    _raises(r"group_id", ProcessGroupSpec, group_id="", peer_order=(0,))
    g = fx.permuted_group()
    _raises(r"rank=5 is not a member of process group 'ep-group-0'", g.peer_of, 5)
    _raises(r"process group 'ep-group-0': rank 4 is outside topology 'topology-v3'", check_group_in_topology,
            ProcessGroupSpec(group_id="ep-group-0", peer_order=(0, 1, 4)), fx.topology())
    _raises(r"members \[0, 1, 2, 3\] != expected \[0, 1\]", check_group_in_topology, g, fx.topology(), [0, 1])
    check_group_in_topology(g, fx.topology(), [0, 1, 2, 3])


def test_peer_order_0x07B():
    g = fx.permuted_group()
    assert g.peer_order == (2, 0, 3, 1) and g.size == 4 and g.members == frozenset({0, 1, 2, 3})
    assert [g.rank_at(i) for i in range(4)] == [2, 0, 3, 1]
    assert [g.peer_of(r) for r in range(4)] == [1, 3, 0, 2]
    groups = fx.process_groups()
    assert groups["ep-node-0"].peer_order == (1, 0) and groups["ep-relays"].peer_order == (2, 0)


# ------------------------------------------------------------------------------- content digest
def test_content_digest_ignores_state_and_refcount():
    m = fx.six_slot_manifest()
    d = m.content_digest()
    assert len(d) == 64 and d == fx.six_slot_manifest().content_digest()
    for state in GenerationState:
        assert m.with_state(state, 3).content_digest() == d
    view = m.with_state(GenerationState.DRAINING, 1)
    assert view.state == GenerationState.DRAINING and view.in_flight_refcount == 1
    assert m.state == GenerationState.PENDING  # with_state returns a view, the original is unchanged


SLOT_MUTATIONS = {  # every SlotSpec field, each change keeping the manifest valid
    "physical_slot_id": lambda s: (s[:4] + (s[4].model_copy(update={"physical_slot_id": 5}),
                                            s[5].model_copy(update={"physical_slot_id": 4}))),
    "logical_expert_id": lambda s: (s[:4] + (s[4].model_copy(update={"logical_expert_id": 3}),
                                             s[5].model_copy(update={"logical_expert_id": 2}))),
    "replica_id": lambda s: s[:1] + (s[1].model_copy(update={"replica_id": "e0-r9"}),) + s[2:],
    "destination_rank": lambda s: s[:5] + (s[5].model_copy(update={"destination_rank": 2}),),
    "topology_domain_id": lambda s: s[:5] + (s[5].model_copy(update={"topology_domain_id": "node-9"}),),
    "parameter_digest": lambda s: s[:5] + (s[5].model_copy(update={"parameter_digest": "expert-3-state-v43"}),),
    "checkpoint_version": lambda s: s[:5] + (s[5].model_copy(update={"checkpoint_version": "checkpoint-0043"}),),
}


@pytest.mark.parametrize("field", sorted(SLOT_MUTATIONS))
def test_content_digest_changes_with_any_slot_field(field):
    assert set(SLOT_MUTATIONS) == set(SlotSpec.model_fields) - {"layer"}
    m = fx.six_slot_manifest()
    changed = PlacementManifest(**_fields(slots=SLOT_MUTATIONS[field](m.slots)))
    assert changed.content_digest() != m.content_digest()


def test_content_digest_changes_with_layer_and_manifest_fields():
    m = fx.six_slot_manifest()
    d = m.content_digest()
    two = manifest_from_assignment(generation=17, phy2log=[[0, 0, 1, 1, 2, 3]] * 2,
                                   slot_rank=[[0, 1, 1, 2, 2, 3]] * 2, num_experts=4, topology=fx.topology(),
                                   checkpoint_version="checkpoint-0042")
    swapped = [s.model_copy(update={"layer": 1 - s.layer}) if s.physical_slot_id == 5 else s for s in two.slots]
    assert PlacementManifest(**{**two.model_dump(), "slots": swapped}).content_digest() != two.content_digest()
    for key, value in (("generation", 18), ("checkpoint_version", "checkpoint-0043"),
                       ("process_group_id", "ep-group-1"), ("num_ranks", 5), ("topology_version", "topology-v4")):
        assert PlacementManifest(**_fields(**{key: value})).content_digest() != d, key


# ------------------------------------------------------------------------------- snapshot tensors
def test_snapshot_tensors_flat_group():
    s = fx.snapshot()
    assert s.phy2log.tolist() == [0, 0, 1, 1, 2, 3]
    assert s.slot_rank.tolist() == [0, 1, 1, 2, 2, 3]
    assert s.slot_local.tolist() == [0, 0, 1, 0, 1, 0]
    assert s.log2phy.tolist() == [[0, 1], [2, 3], [4, -1], [5, -1]]
    assert s.logcnt.tolist() == [2, 2, 1, 1]
    assert s.peer_order.tolist() == [0, 1, 2, 3]
    assert s.rank_to_peer.tolist() == [0, 1, 2, 3]
    assert s.rank_node.tolist() == [0, 0, 1, 1]
    assert s.rank_num_slots == (1, 2, 2, 1)
    assert [s.rank_slot_ids(r).tolist() for r in range(4)] == [[0], [1, 2], [3, 4], [5]]
    assert (s.num_slots, s.num_experts, s.num_ranks, s.generation, s.layer) == (6, 4, 4, 17, 0)
    assert (s.placement_version, s.checkpoint_version, s.process_group_id, s.pg_epoch) == \
        ("placement-v17", "checkpoint-0042", "ep-group-0", 12)
    for t in (s.phy2log, s.slot_rank, s.slot_local, s.log2phy, s.logcnt, s.peer_order, s.rank_to_peer):
        assert t.dtype == torch.int64
    # log2phy padding is -1 exactly where logcnt ends
    for e in range(4):
        row = s.log2phy[e].tolist()
        assert all(q >= 0 for q in row[: s.logcnt[e]]) and all(q == -1 for q in row[s.logcnt[e]:])
        assert all(s.phy2log[q] == e for q in row[: s.logcnt[e]])


def test_snapshot_tensors_permuted_group():
    s = fx.snapshot(fx.permuted_group())
    assert s.peer_order.tolist() == [2, 0, 3, 1]
    assert s.rank_to_peer.tolist() == [1, 3, 0, 2]
    assert s.phy2log.tolist() == [0, 0, 1, 1, 2, 3]  # the maps do not depend on the peer order
    assert s.map_digest != fx.snapshot().map_digest  # but the digest peers compare does


def test_snapshot_map_digest():
    a, b = fx.snapshot(), fx.snapshot()
    assert a.map_digest == b.map_digest and 0 < a.map_digest < 2**56
    assert fx.snapshot(generation=18).map_digest != a.map_digest
    assert fx.snapshot(fx.flat_group(epoch=13)).map_digest != a.map_digest
    moved = PlacementManifest(**_fields(slots=_with_slot(5, destination_rank=2, topology_domain_id="node-1")))
    assert PlacementSnapshot.from_manifest(moved, fx.topology(), fx.flat_group()).map_digest != a.map_digest


def test_snapshot_local_order_follows_slot_ids():
    """Local slot index follows the manifest's physical-slot order, whatever the tuple order."""
    m = fx.six_slot_manifest()
    shuffled = PlacementManifest(**_fields(slots=tuple(reversed(m.slots))))
    s = PlacementSnapshot.from_manifest(shuffled, fx.topology(), fx.flat_group())
    assert s.slot_local.tolist() == [0, 0, 1, 0, 1, 0]
    assert s.log2phy.tolist() == [[0, 1], [2, 3], [4, -1], [5, -1]]
    assert s.map_digest == fx.snapshot().map_digest
