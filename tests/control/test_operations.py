"""Stage deadlines of elastic operations (no Ray): the tracker's clock arithmetic and progress, and a control
plane over in-process shards whose copy (or publish) does not answer in time: the operation aborts naming the
stage and the rank, the prior generation keeps serving with correct outputs, staged copies are freed."""

from __future__ import annotations

import pickle

import pydantic
import pytest
import torch

from ray_moe.control.operations import (OperationOutcome, OperationStage, OperationTracker, RankTimeoutError,
                                        StageDeadlineError, StageDeadlines)
from ray_moe.control.plane import LocalFleet
from ray_moe.model.config import RuntimeConfig
from ray_moe_dev.testing.inprocess import InProcessDeployment, reference_output

BASE = dict(num_ranks=4, num_experts=8, hidden_size=16, ffn_size=24, top_k=2, slots_per_rank=3, seed=5,
            tagged_weights=True)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_tracker_stage_deadlines_progress_and_outcomes():
    clock = Clock()
    ops = OperationTracker(StageDeadlines(copy_s=2.0, verify_s=5.0), clock=clock, wall=lambda: 1.0e9)
    assert ops.remaining() is None and ops.status()["in_flight"] is None
    ops.check()  # no operation: no deadline
    with pytest.raises(StageDeadlineError) as err:
        with ops.operation("scale expert 1 to 3 replicas", 7):
            with ops.operation("nested stage() joins the outer operation", 7):
                ops.enter(OperationStage.PLAN)
                clock.t += 0.5
                ops.enter(OperationStage.COPY, copies_planned=4, bytes_planned=4000)
                clock.t += 1.5
                ops.copied(1000, 1)
                assert ops.remaining() == pytest.approx(0.5)
                st = ops.status()["in_flight"]
                assert st["stage"] == "copy" and st["stage_deadline_s"] == 2.0
                assert st["elapsed_s"] == pytest.approx(2.0) and st["stage_elapsed_s"] == pytest.approx(1.5)
                assert (st["bytes_copied"], st["bytes_planned"], st["copies_done"], st["copies_planned"]) == (1000, 4000, 1, 4)
                assert [s["stage"] for s in st["stages"]] == ["plan", "copy"] and st["stages"][0]["seconds"] == pytest.approx(0.5)
                clock.t += 0.6
                assert ops.remaining() == 0.0
                raise ops.expired([3, 1, 3], "copy of 2 expert(s) rank 0 -> rank 3")
    e = err.value
    assert e.stage is OperationStage.COPY and e.ranks == (1, 3) and e.generation == 7 and e.deadline_s == 2.0
    assert "stage copy of generation 7 passed its 2s deadline: rank(s) [1, 3] did not answer" in str(e)
    assert ops.current() is None
    (done,) = ops.recent()
    assert done.outcome is OperationOutcome.ABORTED and done.late_ranks == (1, 3) and done.stage is OperationStage.COPY
    assert done.stages[-1].seconds == pytest.approx(2.1) and done.reason == "scale expert 1 to 3 replicas"
    # a stage that ran long on the coordinator's own work names no rank
    with pytest.raises(StageDeadlineError) as err2, ops.operation("rebalance", 8):
        ops.enter(OperationStage.VERIFY)
        clock.t += 5.0
        ops.check("the solve")
    assert err2.value.stage is OperationStage.VERIFY and err2.value.ranks == ()
    with ops.operation("rebalance", 9):
        ops.enter(OperationStage.PUBLISH)
    assert [d["outcome"] for d in ops.status()["recent"]] == ["aborted", "aborted", "done"]
    # the errors cross process boundaries with their fields
    back = pickle.loads(pickle.dumps(e))
    assert (back.stage, back.ranks, back.generation, str(back)) == (e.stage, e.ranks, e.generation, str(e))
    assert pickle.loads(pickle.dumps(RankTimeoutError("x", ranks=(2,)))).ranks == (2,)


def test_deadlines_are_validated_and_configurable():
    with pytest.raises(pydantic.ValidationError, match="copy_s"):
        StageDeadlines(copy_s=0)
    with pytest.raises(pydantic.ValidationError, match="nap_s"):
        StageDeadlines(nap_s=1.0)
    cfg = RuntimeConfig(**BASE, deadlines={"copy_s": 1.5})
    assert cfg.deadlines.of(OperationStage.COPY) == 1.5 and cfg.deadlines.of(OperationStage.DRAIN) == 60.0
    assert RuntimeConfig.model_validate_json(cfg.model_dump_json()).deadlines == cfg.deadlines
    with pytest.raises(ValueError):
        cfg.deadlines.of("nap")


class StallingFleet(LocalFleet):
    """In-process shards where the calls of one method (or the copies into one rank) do not answer in time:
    the ranks in ``reached`` ran the call, the others are reported late, as ``RayFleet`` does after ray.wait."""

    def __init__(self, cores, *, copy_into: int | None = None, method: str | None = None, late: int | None = None):
        super().__init__(cores)
        self.copy_into, self.method, self.late = copy_into, method, late
        self.timeouts: list[float | None] = []

    def copy_within(self, dst, src, keys, timeout_s):
        self.timeouts.append(timeout_s)
        if dst == self.copy_into:
            raise RankTimeoutError(f"copy rank {src} -> rank {dst}: no answer", ranks=(dst,))
        return super().copy_within(dst, src, keys, timeout_s)

    def call_within(self, method, args, timeout_s):
        if method == self.method:
            self.method = None  # once: the roll-back's calls answer
            super().call(method, {r: a for r, a in args.items() if r != self.late})
            raise RankTimeoutError(f"{method}: rank(s) [{self.late}] did not answer", ranks=(self.late,))
        return super().call_within(method, args, timeout_s)


def _serves_correctly(dep: InProcessDeployment, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(12, dep.cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(dep.cfg.num_experts, generator=g)[:2] for _ in range(12)])
    w = torch.rand(12, 2, generator=g)
    y, res = dep.step(h, ids, w)
    assert not dep.errors(res), dep.errors(res)
    ref = reference_output(dep.cfg, h, ids, w)
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-4


def _held(dep: InProcessDeployment) -> dict[int, list]:
    return {r: sorted(c.held_experts()) for r, c in dep.cores.items()}


def test_a_copy_past_its_deadline_aborts_and_the_prior_generation_serves():
    dep = InProcessDeployment(RuntimeConfig(**BASE, deadlines={"copy_s": 3.0}))
    g0, held0 = dep.plane.active_generation(), _held(dep)
    # expert 1 lives on ranks 0 and 3 (spread placement); 4 copies need two new ranks, one of them rank 1 or 2
    fleet = StallingFleet(dep.cores, copy_into=2)
    dep.plane.fleet = fleet
    with pytest.raises(StageDeadlineError) as err:
        dep.plane.scale(1, 4)
    e = err.value
    assert e.stage is OperationStage.COPY and e.ranks == (2,)
    assert fleet.timeouts and all(t is not None and 0 < t <= 3.0 for t in fleet.timeouts)
    assert dep.plane.active_generation() == g0
    assert dep.plane.generation_states().get(e.generation) in (None, "RETIRED")  # abandoned
    assert _held(dep) == held0  # copies that landed on other ranks were freed again
    assert all(g0 == c.registry.active() and set(c._gens) == {g0} for c in dep.cores.values())
    events = [ev for ev in dep.plane.timeline() if ev.event == "deadline"]
    assert events and "stage copy" in events[-1].detail and "rank(s) [2]" in events[-1].detail
    assert dep.plane.timeline()[-1].event == "abort" and dep.plane.op is None
    (done,) = dep.plane.ops.recent()
    assert done.outcome is OperationOutcome.ABORTED and done.stage is OperationStage.COPY and done.late_ranks == (2,)
    _serves_correctly(dep, 1)
    # the same change goes through once the rank answers
    dep.plane.fleet = LocalFleet(dep.cores)
    rep = dep.plane.scale(1, 4)
    assert dep.plane.active_generation() == rep.new_generation and dep.plane.manifest().replica_counts(0)[1] == 4
    assert dep.plane.ops.recent()[-1].outcome is OperationOutcome.DONE
    assert [s.stage for s in dep.plane.ops.recent()[-1].stages] == list(OperationStage)
    dep.generation = rep.new_generation
    _serves_correctly(dep, 2)


def test_a_publish_past_its_deadline_rolls_back_to_the_prior_generation():
    dep = InProcessDeployment(RuntimeConfig(**BASE))
    g0 = dep.plane.active_generation()
    dep.plane.fleet = StallingFleet(dep.cores, method="publish", late=3)
    with pytest.raises(StageDeadlineError) as err:
        dep.plane.scale(2, 3)
    assert err.value.stage is OperationStage.PUBLISH and err.value.ranks == (3,)
    assert dep.plane.active_generation() == g0 and dep.plane.retire_pending == set()
    assert all(c.registry.active() == g0 and set(c._gens) == {g0} for c in dep.cores.values())
    assert any(ev.event == "abort" and "rolled back" in ev.detail for ev in dep.plane.timeline())
    _serves_correctly(dep, 3)
