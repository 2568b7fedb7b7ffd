"""A coordinator that dies and is rebuilt (no Ray): the ControlPlane's durable state plus the shards' registry
mirrors give back the same generations, manifests, digests, floors and next id; an operation interrupted at
any shard call is completed (publish, stop fence, retire) or abandoned (staging), and no generation is retired
at a non-zero refcount. Replica floors: a manual scale survives EPLB rebalances until scale lowers it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_moe.control.plane import ControlPlane, LocalFleet
from ray_moe.control.restore import restore_plane
from ray_moe.control.recovery import (
    GenerationOnShard,
    PendingOp,
    PlaneState,
    ShardRegistrySnapshot,
    load_summary,
    plan_rebuild,
    registry_from_bytes,
    registry_state_bytes,
)
from ray_moe.model.config import RuntimeConfig
from ray_moe_dev.testing.inprocess import InProcessDeployment, reference_output

BASE = dict(num_ranks=4, num_experts=8, hidden_size=16, ffn_size=24, top_k=2, slots_per_rank=3, num_layers=2,
            seed=5, tagged_weights=True)
LOAD = np.array([[40, 1, 1, 1, 30, 1, 1, 1], [5, 30, 1, 1, 1, 1, 20, 1]])


class Crash(BaseException):
    """The coordinator process died (nothing after this runs, not even its error handling)."""


class CrashingFleet(LocalFleet):
    """A LocalFleet whose coordinator 'dies' at the n-th call of ``method``, after that call reached only
    ``reached`` ranks; every later call of the dead plane fails too."""

    def __init__(self, cores, method: str | None = None, n: int = 1, reached: tuple[int, ...] = ()) -> None:
        super().__init__(cores)
        self.method, self.n, self.reached, self.dead = method, n, reached, False

    def call(self, method, args):
        if self.dead:
            raise Crash(method)
        if method == self.method:
            self.n -= 1
            if self.n == 0:
                for r in self.reached:
                    if r in args:
                        getattr(self.cores[r], method)(*args[r])
                self.dead = True
                raise Crash(method)
        return super().call(method, args)

    def copy_experts(self, dst, src, keys):
        if self.dead:
            raise Crash("copy")
        return super().copy_experts(dst, src, keys)


def _dep(**over) -> tuple[InProcessDeployment, list[PlaneState]]:
    """A deployment whose plane writes its durable state into ``saved`` on every change (as the actor does)."""
    dep = InProcessDeployment(RuntimeConfig(**{**BASE, **over}))
    saved = [dep.plane.durable_state()]
    dep.plane.on_change = lambda: saved.append(dep.plane.durable_state().model_copy(deep=True))
    return dep, saved


def _restore(dep: InProcessDeployment, saved: list[PlaneState], **kw) -> ControlPlane:
    plane = restore_plane(dep.cfg, LocalFleet(dep.cores), dep.topology, dep.group, saved[-1], **kw)
    dep.plane = plane
    dep.generation = plane.active_generation()
    return plane


def _routes(t: int, seed: int, cfg: RuntimeConfig):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(t)])
    return h, ids, torch.rand(t, cfg.top_k, generator=g)


def _serves(dep: InProcessDeployment, seed: int = 0) -> None:
    h, ids, w = _routes(11, seed, dep.cfg)
    y, res = dep.step(h, ids, w)
    assert not dep.errors(res), dep.errors(res)
    ref = reference_output(dep.cfg, h, ids, w)
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-4


def _shard_states(dep: InProcessDeployment) -> dict[int, dict[int, str]]:
    return {r: {g: i["state"] for g, i in c.registry_snapshot()["generations"].items()} for r, c in dep.cores.items()}


def _crash(dep: InProcessDeployment, method: str, n: int = 1, reached: tuple[int, ...] = ()) -> None:
    dep.plane.fleet = CrashingFleet(dep.cores, method, n, reached)


# ================================================================ rebuild of a healthy deployment
def test_restore_gives_back_generations_digests_floors_and_next_id():
    dep, saved = _dep()
    p = dep.plane
    p.record_load(LOAD, phase="prefill", generation=0)
    g1 = p.scale(3, 2).new_generation
    g2 = p.apply(p.propose_rebalance(), reason="rebalance").new_generation
    before = {"active": p.active_generation(), "states": p.generation_states(), "digests": dict(p.digests),
              "manifest": p.manifest().content_digest(), "floors": p.floor_list(), "next": p.next_generation}
    assert (g1, g2) == (1, 2) and before["floors"] == [{"layer": 0, "expert": 3, "replicas": 2},
                                                        {"layer": 1, "expert": 3, "replicas": 2}]
    p.record_load(LOAD * 2, phase="prefill", generation=2)
    window = p.load.snapshot().weight
    q = _restore(dep, saved, load_rows=load_summary(p.load.observations()))
    assert q.active_generation() == before["active"] == g2
    assert q.generation_states() == before["states"] == {0: "RETIRED", 1: "RETIRED", 2: "ACTIVE"}
    assert q.digests == before["digests"]
    assert q.manifest().content_digest() == before["manifest"]
    assert q.floor_list() == before["floors"]
    assert q.next_generation == before["next"] == 3
    assert np.array_equal(q.load.snapshot().weight, window)  # the window's sum: the same EPLB input
    assert q.rebuild_report["abandoned"] == [] and q.op is None
    assert q.timeline()[-1].event == "rebuild"
    _serves(dep)
    # the rebuilt plane keeps going: next id, floors still honoured by EPLB
    g3 = q.apply(q.propose_rebalance(), reason="rebalance after restart").new_generation
    assert g3 == 3 and all(len(q.manifest().replicas(3, l)) >= 2 for l in range(2))
    dep.generation = g3
    _serves(dep, 1)


# ================================================================ interrupted operations
def test_crash_while_staging_abandons_the_candidate_and_drops_its_weights():
    dep, saved = _dep()
    held0 = {r: c.held_experts() for r, c in dep.cores.items()}
    _crash(dep, "prepare_generation", reached=(0, 1))  # prepared on ranks 0 and 1 only, copies staged everywhere
    with pytest.raises(Crash):
        dep.plane.scale(5, 3)
    assert saved[-1].op == PendingOp(kind="stage", generation=1, detail="scale expert 5 to 3 replicas")
    assert 1 in dep.cores[0].registry_snapshot()["generations"]
    q = _restore(dep, saved)
    assert q.rebuild_report["abandoned"] == [1] and q.active_generation() == 0
    assert _shard_states(dep) == {r: {0: "ACTIVE"} for r in range(4)}
    assert {r: c.held_experts() for r, c in dep.cores.items()} == held0  # staged copies dropped
    assert q.floor_list() == []  # the scale never completed: no floor
    _serves(dep)
    assert q.scale(5, 3).new_generation == 2  # id 1 is never reused


def test_crash_mid_publish_is_completed_on_every_shard():
    dep, saved = _dep()
    _crash(dep, "publish", reached=(0, 2))  # generation 1 ACTIVE on ranks 0, 2; still PENDING on 1, 3
    with pytest.raises(Crash):
        dep.plane.scale(2, 2)
    assert {r: s[1] for r, s in _shard_states(dep).items()} == {0: "ACTIVE", 1: "PENDING", 2: "ACTIVE", 3: "PENDING"}
    q = _restore(dep, saved)
    assert q.active_generation() == 1 and sorted(q.rebuild_report["published_on"]) == [1, 3]
    # ... and the interrupted scale's last step too: the superseded generation retires once drained
    assert q.rebuild_report["retired"] == [0]
    assert all(s == {1: "ACTIVE"} for s in _shard_states(dep).values())
    assert q.generation_states() == {0: "RETIRED", 1: "ACTIVE"}
    _serves(dep)
    rep = q.scale(2, 1)
    assert rep.new_generation == 2 and q.generation_states()[1] == "RETIRED"


def test_crash_mid_retire_retires_only_after_rereading_refcounts():
    dep, saved = _dep()
    _crash(dep, "retire", reached=(0,))  # generation 0 retired on rank 0 only
    with pytest.raises(Crash):
        dep.plane.scale(1, 2)
    assert 0 not in dep.cores[0].registry_snapshot()["generations"]
    # a step is still pinned to generation 0 on rank 3 (a DRAINING generation serves its pinned handles)
    entry = dep.cores[3].registry._entries[0]
    entry.leases["lease-pin"] = object()  # an in-flight handle the rebuild must see
    q = _restore(dep, saved, retire_timeout_s=0.2)
    assert q.rebuild_report["retired"] == [] and q.generation_states()[0] == "DRAINING"
    assert dep.cores[3].registry_snapshot()["generations"][0]["state"] == "DRAINING"
    assert any(e.event == "drain-timeout" for e in q.timeline())
    del entry.leases["lease-pin"]  # the handle completes; the next change retires the leftover
    assert q.scale(2, 2).new_generation == 2
    assert q.generation_states() == {0: "RETIRED", 1: "RETIRED", 2: "ACTIVE"}
    assert all(s == {2: "ACTIVE"} for s in _shard_states(dep).values())
    assert all(rc == 0 for _, rc in q.retired_with_refcount)
    dep.generation = 2
    _serves(dep)


def test_crash_while_draining_retires_the_superseded_generation_but_keeps_a_rollback_fallback():
    dep, saved = _dep()
    _crash(dep, "refcount")  # published everywhere; the drain of generation 0 never finished
    with pytest.raises(Crash):
        dep.plane.scale(4, 2)
    assert saved[-1].retire_pending == [0] and saved[-1].op is None
    q = _restore(dep, saved)
    assert q.rebuild_report["retired"] == [0] and q.generation_states() == {0: "RETIRED", 1: "ACTIVE"}
    assert all(s == {1: "ACTIVE"} for s in _shard_states(dep).values())
    # a prior kept loaded on purpose (promote without retiring it: the rollback fallback) stays DRAINING
    q.record_load(LOAD, phase="prefill", generation=1)
    cand = q.stage(q.propose_rebalance(), reason="candidate", serve_candidate=True).new_generation
    q.promote(cand, retire_prior=False)
    q2 = _restore(dep, [q.durable_state()])
    assert q2.generation_states() == {0: "RETIRED", 1: "DRAINING", 2: "ACTIVE"}
    q2.activate(1)  # the rollback still works after the restart
    assert q2.active_generation() == 1


def test_crash_mid_stop_fence_completes_it():
    dep, saved = _dep()
    _crash(dep, "stop_dispatch", reached=(1,))
    with pytest.raises(Crash):
        dep.plane.stop_dispatch(0)
    q = _restore(dep, saved)
    assert q.active_generation() is None and q.generation_states() == {0: "DRAINING"}
    assert all(s == {0: "DRAINING"} for s in _shard_states(dep).values())
    q.activate(0)  # the rollback's second step works on the rebuilt plane
    assert all(s == {0: "ACTIVE"} for s in _shard_states(dep).values())


def test_candidate_survives_and_is_completed_everywhere():
    dep, saved = _dep()
    dep.plane.record_load(LOAD, phase="prefill", generation=0)
    _crash(dep, "allow_candidate", reached=(0, 1))
    with pytest.raises(Crash):
        dep.plane.stage(dep.plane.propose_rebalance(), reason="candidate", serve_candidate=True)
    q = _restore(dep, saved)
    assert q.generation_states() == {0: "ACTIVE", 1: "PENDING"} and q.rebuild_report["abandoned"] == []
    assert all(c.registry_snapshot()["generations"][1]["candidate"] for c in dep.cores.values())
    h, ids, w = _routes(9, 3, dep.cfg)
    y, res = dep.step(h, ids, w, generation=1)  # shadow / canary steps name the candidate
    assert not dep.errors(res)
    q.promote(1)
    assert q.generation_states() == {0: "RETIRED", 1: "ACTIVE"}


def test_dead_shard_is_skipped_by_the_rebuild():
    dep, saved = _dep(slots_per_rank=4)
    survivors = [0, 1, 3]
    group = dep.regroup(survivors)
    dep.plane.remove_ranks([2], group)
    saved.append(dep.plane.durable_state())  # rank 2 is recorded dead; its core is not in the fleet any more
    plane = restore_plane(dep.cfg, LocalFleet({r: dep.cores[r] for r in survivors}), dep.topology, group,
                                 saved[-1])
    dep.plane, dep.generation = plane, plane.active_generation()
    assert plane.live_ranks() == survivors and plane.active_generation() == 1
    _serves(dep)


# ================================================================ the plan on its own
def _snap(rank, **gens):
    return ShardRegistrySnapshot(rank=rank, generations={int(g[1:]): GenerationOnShard(state=s) for g, s in gens.items()})


def test_plan_prefers_the_recorded_publish_and_never_reuses_ids():
    snaps = {0: _snap(0, g4="DRAINING", g5="ACTIVE"), 1: _snap(1, g4="ACTIVE", g5="DRAINING")}
    # ambiguous without the record (a rollback in flight): the recorded publish decides
    assert plan_rebuild([0, 1], snaps, PendingOp(kind="publish", generation=4)).active == 4
    assert plan_rebuild([0, 1], snaps, PendingOp(kind="publish", generation=5)).active == 5
    plan = plan_rebuild([0, 1], {0: _snap(0, g2="ACTIVE", g7="PENDING"), 1: _snap(1, g2="ACTIVE")}, None)
    assert plan.active == 2 and plan.abandon == {7: [0]} and plan.max_seen == 7


def test_release_registry_round_trips():
    from ray_moe.release.lifecycle import ReleaseRegistry
    from ray_moe.core.types import ReleaseState
    from tests.release.test_bundle import spec_release

    reg = ReleaseRegistry()
    bundle = spec_release()
    reg.register(bundle)
    for s in (ReleaseState.VERIFIED, ReleaseState.LOADED):
        reg.transition(bundle.release_id, s, f"-> {s.value}")
    again = registry_from_bytes(ReleaseRegistry, registry_state_bytes(reg))
    assert again.records() == reg.records() and again.timeline() == reg.timeline()
    assert again.get(bundle.release_id).state is ReleaseState.LOADED and again._lock is not reg._lock
    again.transition(bundle.release_id, ReleaseState.SHADOW, "shadow after a restart")  # and it keeps going
    assert again.timeline()[-1].seq == reg.timeline()[-1].seq + 1


# ================================================================ replica floors
def test_manual_scale_is_a_floor_that_rebalance_keeps_until_scale_lowers_it():
    dep, _ = _dep(num_layers=1)
    p = dep.plane
    cold = np.array([[40, 10, 10, 0, 30, 10, 10, 10]])  # expert 3 takes no load at all
    p.record_load(cold, phase="prefill", generation=0)
    p.scale(3, 2)
    assert p.floor_list() == [{"layer": 0, "expert": 3, "replicas": 2}]
    for _ in range(2):  # plain, then migration-aware
        p.apply(p.propose_rebalance(), reason="rebalance")
        assert len(p.manifest().replicas(3, 0)) >= 2
    p.scale(3, 1)
    assert p.floor_list() == []
    p.apply(p.propose_rebalance(), reason="rebalance")
    assert len(p.manifest().replicas(3, 0)) == 1
    dep.generation = p.active_generation()
    _serves(dep)


def test_floors_beyond_a_shrunken_capacity_keep_the_newest_and_say_so():
    dep, saved = _dep(num_layers=1)
    p = dep.plane
    p.record_load(LOAD[:1], phase="prefill", generation=0)
    p.scale(1, 3)
    p.scale(5, 2)  # 8 experts + 3 floor copies <= 12 slots
    survivors = [0, 1, 3]
    p.remove_ranks([2], dep.regroup(survivors))  # 9 slots now: room for one floor copy
    assert p.effective_floors(9) == ({(0, 5): 2}, ["expert 1 of layer 0: floor 3 lowered to 1 (9 slots per layer)"])
    p.apply(p.propose_rebalance(), reason="rebalance")
    assert len(p.manifest().replicas(5, 0)) >= 2
    assert any(e.event == "floor-clipped" and "expert 1" in e.detail for e in p.timeline())
    # the recorded floors are unchanged (and durable), in set order
    assert p.floor_list() == [{"layer": 0, "expert": 1, "replicas": 3}, {"layer": 0, "expert": 5, "replicas": 2}]
    assert saved[-1].floors == [(0, 1, 3), (0, 5, 2)]
    dep.generation = p.active_generation()
    _serves(dep)
