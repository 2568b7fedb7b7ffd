"""PlacementPlanner on its own (no control plane): the placements it proposes, value by value.

Every case starts from the spread placement of 2 layers x 6 experts on 4 ranks with 3 slots each: rank 0 and 2
hold experts 0, 1, 2; ranks 1 and 3 hold 3, 4, 5 (every expert twice).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from ray_moe.core.errors import AdmissionError, ExpertUnavailableError
from ray_moe.placement.floors import ReplicaFloors
from ray_moe.placement.load import LoadWindow
from ray_moe.placement.manifest import PlacementManifest, manifest_from_assignment
from ray_moe.placement.migration import MigrationActionKind
from ray_moe.placement.planner import Assignment, PlacementPlanner
from ray_moe.placement.topology import Topology

L, E, S, RANKS = 2, 6, 3, [0, 1, 2, 3]
TOPO = Topology.single_node(4)
SPREAD = [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]] * L
SPREAD_RANKS = [[0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]] * L


def _planner(topology: Topology = TOPO) -> PlacementPlanner:
    return PlacementPlanner(L, E, S, topology)


def _manifest(a: Assignment, generation: int = 0, topology: Topology = TOPO) -> PlacementManifest:
    return manifest_from_assignment(generation=generation, phy2log=a.phy2log, slot_rank=a.slot_rank, num_experts=E,
                                    topology=topology)


def _current() -> PlacementManifest:
    return _manifest(_planner().initial(RANKS))


def _load(rows) -> LoadWindow:
    w = LoadWindow(L, E, 8)
    w.record(np.asarray(rows), phase="prefill", generation=0, checkpoint="checkpoint-test")
    return w


def _hosts(a: Assignment, layer: int, expert: int) -> list[int]:
    """Ranks of the copies of ``expert`` in ``layer``, in slot order (a rank twice = two copies on it)."""
    return [u for e, u in zip(a.phy2log[layer], a.slot_rank[layer]) if e == expert]


def _counts(a: Assignment, layer: int) -> list[int]:
    c = Counter(a.phy2log[layer])
    return [c[e] for e in range(E)]


def _slots_per_rank(a: Assignment, layer: int) -> dict[int, int]:
    return dict(sorted(Counter(a.slot_rank[layer]).items()))


def _no_rank_twice(a: Assignment, ranks: int = len(RANKS)) -> bool:
    """No two copies of one expert share a rank while the expert has at most one copy per rank."""
    return all(len(set(_hosts(a, l, e))) == min(len(_hosts(a, l, e)), ranks) for l in range(L) for e in range(E))


def test_initial_is_the_spread_and_names_each_ranks_copies():
    a = _planner().initial(RANKS)
    assert a.phy2log == SPREAD and a.slot_rank == SPREAD_RANKS and a.notes == ()
    keys = a.keys_by_rank()
    assert keys[0] == keys[2] == {(l, e) for l in range(L) for e in (0, 1, 2)}
    assert keys[1] == keys[3] == {(l, e) for l in range(L) for e in (3, 4, 5)}


def test_scale_up_adds_copies_on_the_emptiest_new_ranks_only():
    a = _planner().scale(_current(), RANKS, 0, 3)
    for l in range(L):
        # ranks 1 and 3 both have 3 slots and no copy of expert 0: the tie goes to the lower rank
        assert a.phy2log[l] == SPREAD[l] + [0] and a.slot_rank[l] == SPREAD_RANKS[l] + [1]
        assert _counts(a, l) == [3, 2, 2, 2, 2, 2]
        assert _slots_per_rank(a, l) == {0: 3, 1: 4, 2: 3, 3: 3}
    a = _planner().scale(_current(), RANKS, 4, 4)  # one copy on every rank
    assert [sorted(_hosts(a, l, 4)) for l in range(L)] == [RANKS, RANKS] and _no_rank_twice(a)


def test_scale_down_drops_from_the_fullest_rank_and_scale_back_restores():
    p = _planner()
    a = p.scale(_current(), RANKS, 0, 1)
    # ranks 0 and 2 tie on 3 slots: the copy on the higher rank goes
    assert all(_hosts(a, l, 0) == [0] and _counts(a, l) == [1, 2, 2, 2, 2, 2] for l in range(L))
    up = p.scale(_current(), RANKS, 0, 3)
    back = p.scale(_manifest(up, 1), RANKS, 0, 2)  # rank 1 has 4 slots now: its copy goes
    assert back.phy2log == SPREAD and back.slot_rank == SPREAD_RANKS


def test_scale_of_one_layer_keeps_the_others():
    a = _planner().scale(_current(), RANKS, 5, 3, layer=1)
    assert a.phy2log[0] == SPREAD[0] and a.slot_rank[0] == SPREAD_RANKS[0]
    assert _counts(a, 1) == [2, 2, 2, 2, 2, 3] and sorted(_hosts(a, 1, 5)) == [0, 1, 3]


def test_scale_over_live_ranks_skips_a_dead_one():
    a = _planner().scale(_current(), [0, 2, 3], 0, 3)  # rank 1 is not live
    assert all(sorted(_hosts(a, l, 0)) == [0, 2, 3] for l in range(L))
    with pytest.raises(ValueError, match=r"replicas=4 exceeds the 3 live ranks"):
        _planner().scale(_current(), [0, 2, 3], 0, 4)


@pytest.mark.parametrize("args, match", [
    ((6, 2, None), r"expert=6 is out of range \[0, 6\)"),
    ((1, 0, None), r"replicas=0 must be >= 1"),
    ((1, 2, 2), r"layer=2 is out of range \[0, 2\)"),
    ((1, 5, None), r"replicas=5 exceeds the 4 live ranks"),
])
def test_scale_refuses_bad_requests(args, match):
    with pytest.raises(ValueError, match=match):
        _planner().scale(_current(), RANKS, *args)


def test_rebalance_replicates_the_hot_experts_without_two_copies_on_a_rank():
    a = _planner().rebalance(_current(), RANKS, _load([[6, 4, 1, 1, 1, 1], [1, 1, 1, 1, 4, 6]]))
    for l, hot, warm in ((0, 0, 1), (1, 5, 4)):
        c = _counts(a, l)
        assert sum(c) == 12 and min(c) >= 1
        assert c[hot] == max(c) and c[warm] > 1 and c[hot] > min(c)
        assert _slots_per_rank(a, l) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert _no_rank_twice(a)


def test_rebalance_of_a_balanced_load_keeps_every_slot():
    a = _planner().rebalance(_current(), RANKS, _load([[1] * E] * L), migration_aware=True)
    assert a.phy2log == SPREAD and a.slot_rank == SPREAD_RANKS


def test_rebalance_keeps_replica_floors():
    floors = ReplicaFloors(L, E)
    floors.set(5, 3)
    a = _planner().rebalance(_current(), RANKS, _load([[9, 1, 1, 1, 1, 1]] * L), floors)
    assert all(_counts(a, l)[5] == 3 for l in range(L)) and a.notes == ()
    assert all(sorted(_hosts(a, l, 5)) == [1, 2, 3] for l in range(L))  # three copies, three ranks
    plain = _planner().rebalance(_current(), RANKS, _load([[9, 1, 1, 1, 1, 1]] * L))
    assert all(_counts(plain, l)[5] < 3 for l in range(L))  # the floor, not the load, gave expert 5 its copies


def test_rebalance_lowers_floors_that_no_longer_fit_and_says_so():
    floors = ReplicaFloors(L, E)
    floors.set(5, 3)
    a = _planner().rebalance(_current(), [0, 1], _load([[9, 1, 1, 1, 1, 1]] * L), floors)  # 6 slots: one each
    assert all(_counts(a, l) == [1] * E for l in range(L))
    assert a.slot_rank == [[0, 0, 0, 1, 1, 1]] * L
    assert a.notes == ("expert 5 of layer 1: floor 3 lowered to 1 (6 slots per layer)",
                       "expert 5 of layer 0: floor 3 lowered to 1 (6 slots per layer)")


def test_rebalance_refuses_an_empty_window():
    with pytest.raises(ValueError, match="load window: no observation yet"):
        _planner().rebalance(_current(), RANKS, LoadWindow(L, E, 8))


def test_without_a_dead_rank_drops_its_slots_and_keeps_every_expert():
    a = _planner().without(_current(), RANKS, [1])
    for l in range(L):
        assert 1 not in a.slot_rank[l]
        assert a.phy2log[l] == [0, 1, 2, 0, 1, 2, 3, 4, 5] and a.slot_rank[l] == [0, 0, 0, 2, 2, 2, 3, 3, 3]
        assert _counts(a, l) == [2, 2, 2, 1, 1, 1]


def test_without_two_ranks_rebuilds_orphans_on_the_emptiest_survivor():
    a = _planner().without(_current(), RANKS, [1, 3])  # experts 3, 4, 5 lose every copy
    for l in range(L):
        assert set(a.slot_rank[l]) == {0, 2} and _counts(a, l) == [2, 2, 2, 1, 1, 1]
        assert (_hosts(a, l, 3), _hosts(a, l, 4), _hosts(a, l, 5)) == ([0], [2], [0])
        assert _slots_per_rank(a, l) == {0: 5, 2: 4}


def test_without_every_rank_is_refused():
    with pytest.raises(ExpertUnavailableError, match="no live rank left"):
        _planner().without(_current(), RANKS, RANKS)


def test_require_survivors_names_the_lost_expert_unless_the_checkpoint_can_rebuild():
    p = _planner()
    with pytest.raises(ExpertUnavailableError, match=r"logical expert 3 of layer 0 has no surviving replica "
                                                     r"\(its copies were on ranks \[1, 3\]\)") as exc:
        p.require_survivors(_current(), [0, 2], can_rebuild=False)
    assert (exc.value.expert, exc.value.layer) == (3, 0)
    p.require_survivors(_current(), [0, 2], can_rebuild=True)
    p.require_survivors(_current(), [0, 1], can_rebuild=False)  # every expert still has a copy


def test_admit_refuses_a_plan_over_the_memory_budget_naming_the_rank():
    p = _planner()
    cur = _current()
    new = _manifest(p.scale(cur, RANKS, 0, 3), 1)  # rank 1 gets expert 0 in both layers: 4 copies per layer
    with pytest.raises(AdmissionError, match=r"\(rank 1: peak 800 B > budget 700 B\)$"):
        p.admit(cur, new, RANKS, expert_bytes=100, memory_budget_bytes=700)
    plan = p.admit(cur, new, RANKS, expert_bytes=100, memory_budget_bytes=800)
    assert plan.ledger.same_node_copies == 2 and plan.ledger.retained_copies == 24
    p.admit(cur, new, [0, 2, 3], expert_bytes=100, memory_budget_bytes=700)  # rank 1 not live: not budgeted
    assert p.admit(cur, new, RANKS, expert_bytes=0).rank_budget_bytes is None


def test_transfers_copy_from_live_sources_and_load_for_dead_ones():
    p = _planner()
    cur = _current()
    plan = p.admit(cur, _manifest(p.scale(cur, RANKS, 0, 3), 1), RANKS, expert_bytes=100)
    moved = [a for a in plan.target_actions() if a.action is not MigrationActionKind.RETAIN]
    assert {(a.layer, a.source_rank, a.target_rank) for a in moved} == {(0, 0, 1), (1, 0, 1)}
    t = p.transfers(plan, lambda r: True)
    assert t.copies == {(1, 0): {(0, 0), (1, 0)}} and t.loads == {}
    t = p.transfers(plan, lambda r: r != 0)
    assert t.copies == {} and t.loads == {1: {(0, 0), (1, 0)}}


def test_planner_refuses_a_bad_shape():
    with pytest.raises(ValueError, match=r"slots_per_rank=0 must be an int >= 1"):
        PlacementPlanner(L, E, 0, TOPO)
