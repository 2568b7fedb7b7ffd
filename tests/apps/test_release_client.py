"""ReleaseClient against a small local deployment: every call a typed round trip to the coordinator.

Placement side: a staged candidate (StageReport with its manifest) serves pinned steps, is promoted, fenced,
the prior re-activated, the candidate drained and retired; shard faults arm and disarm. Registry side: real
bundles of the live generations go BUILT -> ... -> ACTIVE -> DRAINING -> RETIRED and come back as
``ReleaseRecord`` / ``TransitionEvent``. Arguments are refused before anything reaches the actor.
"""

from __future__ import annotations

import pytest
import torch

import ray_moe
from ray_moe.apps.release_client import ReleaseClient, ShardFault, StageKind, StageReport
from ray_moe.core.errors import CountAgreementError, root_cause
from ray_moe.model.source import weight_source
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.release.build import ReleaseInputs, build_release_bundle, check_step_schedule, step_tasks
from ray_moe.release.lifecycle import ReleaseRecord, TransitionEvent
from ray_moe_dev.testing.reference import reference_moe
from ray_moe.core.types import ReleaseState as S
from tests.release.test_lifecycle import passing_verdict

CFG = dict(num_ranks=3, num_experts=6, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=3, seed=3,
           tagged_weights=True, name="release-client-test")


@pytest.fixture(scope="module")
def rt(ray_session):
    runtime = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**CFG))
    yield runtime
    runtime.shutdown()


def _batch(rt, seed: int, tokens: int = 9):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, rt.cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(rt.cfg.num_experts, generator=g)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=g)
    ref = reference_moe(h.double(), ids, w, lambda e: weight_source(rt.cfg).expert(0, e))
    return h, ids, w, ref


def _served_ok(rt, seed: int, generation: int | None = None) -> bool:
    h, ids, w, ref = _batch(rt, seed)
    y = rt.forward(h, ids, w, generation=generation)
    return float((y.double() - ref).abs().max()) < 1e-4


def _bundle(rt, client: ReleaseClient, generation: int, name: str):
    p = len(rt.group.peer_order)
    inputs = ReleaseInputs(name=name, config=rt.cfg, manifest=rt.placement(generation), group_id=rt.group.group_id,
                           group_epoch=rt.group.epoch, topology_version=rt.topology.version,
                           load_provenance=client.load_provenance(), migration_ledger={"generation": generation},
                           schedule=check_step_schedule(step_tasks(p), p))
    return build_release_bundle(inputs)[0]


def test_arguments_are_refused_before_the_actor():
    client = ReleaseClient(object())  # never called: every case fails validation first
    with pytest.raises(ValueError, match="not one of"):
        client.inject_fault("meltdown", rank=0)
    with pytest.raises(ValueError, match="rank"):
        client.inject_fault(ShardFault.CRASH, rank=-1)
    with pytest.raises(ValueError, match="count"):
        client.inject_fault(ShardFault.CRASH, rank=0, count=-2)
    with pytest.raises(ValueError, match="expert"):
        client.stage(StageKind.SCALE, replicas=2)
    with pytest.raises(ValueError, match="manifest"):
        client.stage("manifest")
    with pytest.raises(ValueError, match="kind"):
        client.stage("shuffle")
    with pytest.raises(ValueError, match="generation"):
        client.promote(-1)
    with pytest.raises(ValueError, match="timeout_s"):
        client.drain_and_retire(1, timeout_s=0)
    with pytest.raises(ValueError, match="ReleaseBundle"):
        client.register({"release_id": "x"})
    with pytest.raises(ValueError):
        ReleaseClient(None)
    assert [k.value for k in ShardFault] == ["count", "scale", "inverse", "parity", "crash", "graph_key", "hang_copy"]
    from ray_moe.shard.fault_wrappers import ShardFault as Shards

    assert ShardFault is Shards  # one definition: what the client arms is what the shard takes


def test_candidate_stage_promote_and_roll_back(rt):
    client = ReleaseClient.for_runtime(rt)
    assert client.coordinator is rt.coordinator
    prior = rt.placement().generation
    rep = client.stage(StageKind.SCALE, expert=2, replicas=2)
    assert isinstance(rep, StageReport) and isinstance(rep.manifest, PlacementManifest)
    g = rep.new_generation
    assert g > prior and rep.manifest.generation == g and rep.manifest.replica_counts(0)[2] == 2
    assert rt.generations()[g] == "PENDING" and rt.placement().generation == prior  # staged, not published
    assert _served_ok(rt, 1, generation=g)  # a pinned step on the candidate
    assert client.shard_refcount(g) == 0  # its pin was released
    # promote: the driver learns the new active generation from the shards' stale refusal
    assert client.promote(g) == prior
    assert rt.generations()[g] == "ACTIVE" and rt.generations()[prior] == "DRAINING"
    assert _served_ok(rt, 2)
    assert rt.placement().generation == g
    # rollback: fence, re-activate the prior, drain, free graphs, retire
    client.stop_dispatch(g)
    client.activate(prior)
    assert rt.generations()[prior] == "ACTIVE"
    assert client.shard_refcount(g) == 0
    assert client.release_graphs(g) == 0  # CPU: no captured graphs
    assert client.drain_and_retire(g, timeout_s=10.0) is True
    assert rt.generations()[g] == "RETIRED"
    assert _served_ok(rt, 3)  # unpinned steps replan onto the prior
    events = [(e["event"], e["generation"]) for e in rt.timeline()]
    assert ("stop-dispatch", g) in events and ("activate", prior) in events


def test_shard_faults_arm_and_disarm(rt):
    client = ReleaseClient.for_runtime(rt)
    g = rt.placement().generation
    client.inject_fault(ShardFault.COUNT, rank=1, generation=g)
    h, ids, w, _ = _batch(rt, 4)
    with pytest.raises(Exception) as info:
        rt.forward(h, ids, w)
    assert isinstance(root_cause(info.value), CountAgreementError) or "CountAgreementError" in repr(info.value)
    assert _served_ok(rt, 5)  # one-shot
    client.inject_fault("crash", rank=2, count=1000, generation=g)
    client.inject_fault(ShardFault.CRASH, rank=2, count=0, generation=g)  # count=0 disarms it
    assert _served_ok(rt, 6)
    assert any(e["event"] == "fault-armed" and "crash x1000 on rank 2" in e["detail"] for e in rt.timeline())


def test_release_registry_round_trip(rt):
    client = ReleaseClient.for_runtime(rt)
    g0 = rt.placement().generation
    r0 = _bundle(rt, client, g0, "client-test-r0")
    rec = client.register(r0)
    assert isinstance(rec, ReleaseRecord) and rec.state is S.BUILT and rec.release_id == r0.release_id
    for s in (S.VERIFIED, S.LOADED, S.ACTIVE):
        rec = client.transition(r0.release_id, s, f"-> {s.value}")
    assert rec.state is S.ACTIVE and client.active_release() == r0.release_id
    g1 = client.stage(StageKind.REBALANCE).new_generation
    cand = _bundle(rt, client, g1, "client-test-cand")
    client.register(cand)
    for s in (S.VERIFIED, S.LOADED, S.SHADOW):
        client.transition(cand.release_id, s.value, f"-> {s.value}")  # the state's value works too
    rec = client.begin_canary(cand.release_id, 0.25, "shadow clean")
    assert rec.state is S.CANARY and client.candidate_release() == cand.release_id
    client.set_canary_fraction(cand.release_id, 0.5)
    assert client.promote_release(cand.release_id, passing_verdict(cand.release_id)) == r0.release_id
    assert client.state(cand.release_id) is S.ACTIVE and client.state(r0.release_id) is S.DRAINING
    client.stop_new_dispatch(cand.release_id)
    client.activate_release(r0.release_id)
    client.retire_release(cand.release_id)
    assert client.record(cand.release_id).path() == (S.BUILT, S.VERIFIED, S.LOADED, S.SHADOW, S.CANARY, S.ACTIVE,
                                                     S.DRAINING, S.RETIRED)
    assert client.active_release() == r0.release_id and client.candidate_release() is None
    states = {r.release_id: r.state for r in client.records()}
    assert states == {r0.release_id: S.ACTIVE, cand.release_id: S.RETIRED}
    timeline = client.release_timeline()
    assert all(isinstance(e, TransitionEvent) for e in timeline)
    assert [e.seq for e in timeline] == sorted(e.seq for e in timeline) and len(timeline) == 4 + 8 + 2
    with pytest.raises(Exception, match="illegal transition"):
        client.transition(cand.release_id, S.ACTIVE, "a retired release never comes back")
    client.stop_dispatch(g1)  # the staged generation is not needed any more
    assert client.drain_and_retire(g1, timeout_s=10.0) and rt.generations()[g1] == "RETIRED"
