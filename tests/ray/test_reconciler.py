"""The coordinator's reconcile loop without a cluster (``ray/reconciler.py``): what survives a coordinator restart
(members, bundles, target), what a restart drops (a change it interrupted), and the asks' refusals before anything
changes. The loop's changes themselves run on real actors: tests/runtime (elastic, self-heal, scaler, multinode)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import ray_moe
from ray_moe.control.target import BundleRef, DeploymentTarget, RankState
from ray_moe.core.errors import RequestError
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.ray.reconciler import Hooks, Reconciler

CFG = ray_moe.RuntimeConfig(num_ranks=3, num_experts=6, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=3,
                            heal_retries=2)


def _loop(group: ProcessGroupSpec) -> Reconciler:
    plane = SimpleNamespace(group=group, dead_ranks=set(), active_generation=lambda: 4)
    logged: list = []
    return Reconciler(CFG, Hooks(plane=lambda: plane, persist=lambda: None, put_nccl_id=lambda e, u: None,
                                 autopilot_tick=lambda: None, log=lambda e, d: logged.append((e, d))))


def test_members_bundles_and_target_survive_a_restart_and_an_interrupted_change_is_dropped():
    group = ProcessGroupSpec(group_id="ep-group-0", peer_order=(0, 2, 3), epoch=4)
    before = _loop(group)
    handles = {0: "h0", 2: "h2", 3: "h3"}  # (handles are opaque here)
    before.handles = dict(handles)
    before.records = {}
    from ray_moe.control.target import RankRecord

    before.records[0] = RankRecord(0, RankState.LIVE, BundleRef("pg0", 0), "n0")
    before.records[1] = RankRecord(1, RankState.GONE, BundleRef("pg0", 1), "n1", died=True)
    before.records[2] = RankRecord(2, RankState.LIVE, BundleRef("pg0", 2), "n1")
    before.records[3] = RankRecord(3, RankState.LIVE, BundleRef("pg0", 1), "n1", lineage=1, replaces=1)
    before.records[4] = RankRecord(4, RankState.STARTING, BundleRef("pg9", 0), "n0")  # a join the restart cut
    before.target = DeploymentTarget(ranks=3).changed(ranks=4, set_by="caller", reason="add a rank")
    blob = before.durable()
    blob["handles"] = {**handles, 4: "h4"}
    topo = Topology.uniform(5, 1)
    after = _loop(group)
    after.restore(blob, topo, group, before.target.model_dump_json())
    assert {r: rec.state for r, rec in after.records.items()} == {
        0: RankState.LIVE, 1: RankState.GONE, 2: RankState.LIVE, 3: RankState.LIVE, 4: RankState.GONE}
    assert after.records[3].bundle == BundleRef("pg0", 1) and after.records[3].replaces == 1
    assert after.records[1].died and 4 not in after.handles  # the interrupted join's actor is not a member
    assert after.target.ranks == 4 and after.target.version == 1 and after.target.set_by == "caller"
    assert after.roster.epoch == 4 and sorted(after.infos) == [0, 1, 2, 3, 4]
    view = after.view()
    assert view.epoch == 4 and view.handles == {0: "h0", 2: "h2", 3: "h3"} and view.lost == (1,)
    assert view.generation == 4


def test_an_ask_that_names_no_live_member_changes_nothing():
    group = ProcessGroupSpec(group_id="ep-group-0", peer_order=(0, 1), epoch=1)
    loop = _loop(group)
    from ray_moe.control.target import RankRecord

    loop.records = {0: RankRecord(0, RankState.LIVE), 1: RankRecord(1, RankState.LIVE),
                    2: RankRecord(2, RankState.GONE, died=True)}
    loop.target = DeploymentTarget(ranks=2)
    for rank in (2, 7):
        with pytest.raises(RequestError, match=rf"rank={rank} is not a live member of the group \[0, 1\]"):
            loop.ask_remove(rank, timeout_s=0.1)
    loop.records[1].move(RankState.DEAD)
    with pytest.raises(RequestError, match=r"rank=0 is the last rank"):
        loop.ask_remove(0, timeout_s=0.1)
    assert loop.target == DeploymentTarget(ranks=2) and loop.status()["target"]["version"] == 0
