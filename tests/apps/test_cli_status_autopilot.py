"""``ray-moe status`` shows the autopilot's mode and last decisions and the elastic operation in flight (no Ray: the
command runs over an in-process deployment whose control plane stands in for the coordinator)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ray_moe.apps import cli
from ray_moe.control.autopilot import Autopilot
from ray_moe.control.operations import OperationStage, OperationTracker, StageDeadlines
from ray_moe.model.config import AutopilotPolicy, EplbMode, RuntimeConfig
from ray_moe_dev.testing.inprocess import InProcessDeployment

POLICY = AutopilotPolicy(mode=EplbMode.AUTO, threshold_gain=0.2, min_interval_s=0.0, min_interval_steps=2,
                         min_window_steps=2)
SKEWED = [10, 200, 10, 10, 10, 10, 10, 10]


class FakeRuntime:
    """What ``cmd_status`` reads from a ``Runtime``, answered by an in-process deployment and an autopilot."""

    def __init__(self, dep: InProcessDeployment, pilot: Autopilot) -> None:
        self.dep, self.pilot = dep, pilot

    def placement(self):
        return self.dep.plane.manifest()

    def generations(self):
        return self.dep.plane.generation_states()

    def refcounts(self):
        return self.dep.plane.refcounts()

    def floors(self):
        return self.dep.plane.floor_list()

    def telemetry_snapshot(self):
        return {}

    def telemetry_table(self):
        return ""

    def timeline(self):
        return [dataclasses.asdict(e) for e in self.dep.plane.timeline()]

    def shard_status(self):
        return {r: c.status() for r, c in self.dep.cores.items()}

    def control_status(self):
        return {"eplb": self.pilot.status(8), "operation": self.dep.plane.ops.status(4)}


@pytest.fixture()
def deployment(monkeypatch):
    cfg = RuntimeConfig(num_ranks=4, num_experts=8, hidden_size=8, ffn_size=8, top_k=2, slots_per_rank=3, seed=3,
                        eplb=POLICY)
    dep = InProcessDeployment(cfg)
    clock = iter(float(t) for t in range(1000, 2000))
    pilot = Autopilot(cfg.eplb, clock=lambda: next(clock))

    def rebalance(why: str):
        rep = dep.plane.apply(dep.plane.propose_rebalance(), reason=why)
        pilot.rebalanced()
        return {"new_generation": rep.new_generation, "copied_bytes": 4096, "publish_s": 0.25}

    for _ in range(2):
        dep.plane.record_load(np.asarray([SKEWED]), phase="prefill", generation=0)
        pilot.observe_step()
    assert pilot.tick(dep.plane, rebalance).taken
    dep.plane.record_load(np.asarray([SKEWED]), phase="prefill", generation=1)
    pilot.observe_step()
    assert not pilot.tick(dep.plane, rebalance).taken  # within the interval
    rt = FakeRuntime(dep, pilot)
    monkeypatch.setattr(cli, "_connect", lambda args: rt)
    monkeypatch.setattr(cli, "_control_status", lambda r: r.control_status())
    return rt


def test_status_table_shows_the_autopilots_decisions_and_the_last_operation(deployment, capsys):
    assert cli.main(["status", "--name", "auto"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(l for l in lines if l.startswith("autopilot: "))
    assert "mode auto (gain >= 0.20" in head and "3 load steps seen" in head and "last rebalance" in head
    taken = next(l for l in lines if "REBALANCE" in l)
    d = deployment.pilot.history()[0]
    assert f"imbalance {d['imbalance_now']:.3f} -> {d['imbalance_predicted']:.3f}" in taken
    assert "gain" in taken and f"{d['bytes']} B" in taken and "published generation 1 in 0.25s" in taken
    assert any("HOLD" in l and "interval_not_passed" in l for l in lines)
    assert "operation in flight: none" in out
    done = next(l for l in lines if l.strip().startswith("DONE"))
    assert "autopilot (gain)" in done and "(generation 1) at stage retire" in done


def test_status_json_carries_the_autopilot_and_the_operation(deployment, capsys):
    assert cli.main(["status", "--name", "auto", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["autopilot"]["mode"] == "auto"
    assert [d["reason"] for d in body["autopilot"]["decisions"]] == ["gain", "interval_not_passed"]
    assert body["operation"]["in_flight"] is None and body["operation"]["recent"][-1]["outcome"] == "done"


def test_operation_lines_show_the_stage_in_flight_and_an_abort():
    t = [50.0]
    ops = OperationTracker(StageDeadlines(copy_s=2.0), clock=lambda: t[0])
    with pytest.raises(Exception), ops.operation("rebalance", 4):
        ops.enter(OperationStage.COPY, copies_planned=3, bytes_planned=3000)
        ops.copied(1000, 1)
        t[0] += 1.25
        lines = cli.operation_lines(ops.status())
        assert lines == ["operation in flight: rebalance (generation 4): stage copy 1.2s of its 2s deadline, 1.2s in "
                         "all; 1 of 3 copies, 1000 B copied of 3000 B"]
        t[0] += 1.0
        raise ops.expired([2], "copy of 1 expert(s) rank 0 -> rank 2")
    lines = cli.operation_lines(ops.status())
    assert lines[0] == "operation in flight: none"
    assert lines[1].startswith("  ABORTED  rebalance (generation 4) at stage copy after 2.25s, rank(s) [2] did not "
                               "answer: StageDeadlineError: stage copy of generation 4 passed its 2s deadline")
    assert cli.operation_lines(None) == [] and cli.autopilot_lines(None) == []


def test_members_lines_say_the_target_each_rank_and_what_healed():
    from ray_moe.apps.status_lines import members_lines

    ctl = {"target": {"ranks": 2, "remove": [], "version": 3, "set_by": "healer", "reason": "rank 1 lost"},
           "converged": False,
           "members": {"0": {"state": "live", "bundle": ["abcdef0123", 0], "node": "n0aaaaaaaa", "replaces": None},
                       "1": {"state": "gone", "died": True, "bundle": ["abcdef0123", 1], "node": "n1bbbbbbbb",
                             "replaces": None},
                       "2": {"state": "live", "bundle": ["abcdef0123", 1], "node": "n1bbbbbbbb", "replaces": 1}},
           "healer": {"retries": 2, "healing": [], "events": [{"lost": 1, "replacement": 2, "attempts": 1,
                                                                "seconds": 4.2}]},
           "scaler": {"policy": {"min_ranks": 1, "max_ranks": 3},
                      "events": [{"action": "add", "reason": "queue_wait", "rank": 3, "done": True},
                                 {"action": "hold", "reason": "cooldown"}]}}
    assert members_lines(ctl) == [
        "target: 2 ranks (version 3, set by healer: rank 1 lost); converging",
        "  rank 0: live, bundle 0 of abcdef01, node n0aaaaaa",
        "  rank 1: gone (died), bundle 1 of abcdef01, node n1bbbbbb",
        "  rank 2: live, bundle 1 of abcdef01, node n1bbbbbb, replaced rank 1",
        "healing: 2 attempts per lost rank; last: rank 1 -> 2 in 4.2s",
        "scaling: 1..3 ranks; last change: add (queue_wait), rank 3"]
    assert members_lines(None) == [] and members_lines({"eplb": {}}) == []
