"""The autopilot's policy on its own (no Ray): skewed windows rebalance with a gain, balanced ones hold, the
interval and the byte budget hold it back, periodic mode rebalances every N steps, bad settings are refused.

Every case starts from the spread placement of 1 layer x 8 experts on 4 ranks with 3 slots each: rank 0 holds
experts 0, 1, 2; rank 1: 3, 4, 5; rank 2: 6, 7, 0; rank 3: 1, 2, 3 (experts 0-3 twice, 4-7 once).
"""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from ray_moe.control.autopilot import (
    AutopilotPolicy,
    DecisionAction,
    DecisionReason,
    EplbMode,
    Moment,
    decide,
    imbalance,
    parse_eplb,
    predict,
    rank_loads,
)
from ray_moe.model.config import RuntimeConfig
from ray_moe.placement.load import LoadWindow
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.planner import PlacementPlanner
from ray_moe.placement.topology import Topology

L, E, S, RANKS = 1, 8, 3, [0, 1, 2, 3]
TOPO = Topology.single_node(4)
PLANNER = PlacementPlanner(L, E, S, TOPO)
CURRENT = manifest_from_assignment(generation=0, phy2log=PLANNER.initial(RANKS).phy2log,
                                   slot_rank=PLANNER.initial(RANKS).slot_rank, num_experts=E, topology=TOPO)
# every copy carries the same rows under the spread placement: experts 0-3 (two copies) twice the rows of 4-7
BALANCED = [20, 20, 20, 20, 10, 10, 10, 10]
# expert 4 (one copy, on rank 1 with 3 and 5) is hot
SKEWED = [10, 10, 10, 10, 200, 10, 10, 10]
AUTO = AutopilotPolicy(mode=EplbMode.AUTO, threshold_gain=0.1, min_interval_s=10.0, min_interval_steps=4,
                       min_window_steps=4)


def _window(row, steps: int = 8) -> LoadWindow:
    w = LoadWindow(L, E, 16)
    for _ in range(steps):
        w.record(np.asarray([row]), phase="prefill", generation=0, checkpoint="checkpoint-test")
    return w


def _decide(policy, window, *, t=100.0, step=50, last=None, expert_bytes=1000):
    return decide(policy, window, CURRENT, PLANNER, live=RANKS, now=Moment(t, step), last=last,
                  expert_bytes=expert_bytes)


def test_rank_loads_split_rows_evenly_over_copies():
    loads = rank_loads(np.asarray([SKEWED], dtype=float), CURRENT, RANKS)
    # rank 0: e0/2 + e1/2 + e2/2; rank 1: e3/2 + e4 + e5; rank 2: e6 + e7 + e0/2; rank 3: e1/2 + e2/2 + e3/2
    assert loads.tolist() == [[15.0, 215.0, 25.0, 15.0]]
    imb, layer = imbalance(loads)
    assert imb == pytest.approx(215.0 / 67.5) and layer == (pytest.approx(215.0 / 67.5),)
    balanced, _ = imbalance(rank_loads(np.asarray([BALANCED], dtype=float), CURRENT, RANKS))
    assert balanced == 1.0
    with pytest.raises(ValueError, match="rank 3, not one of ranks"):
        rank_loads(np.asarray([SKEWED], dtype=float), CURRENT, [0, 1, 2])


def test_skewed_window_rebalances_with_the_predicted_gain():
    d = _decide(AUTO, _window(SKEWED))
    assert d.action is DecisionAction.REBALANCE and d.reason is DecisionReason.GAIN
    assert d.imbalance_now == pytest.approx(215.0 / 67.5)
    # EPLB gives the hot expert copies on several ranks: the bottleneck rank's rows drop by more than half
    assert d.imbalance_predicted < 0.5 * d.imbalance_now
    assert d.gain == pytest.approx(1 - d.imbalance_predicted / d.imbalance_now) and d.gain > 0.5
    assert d.bytes > 0 and d.bytes % 1000 == 0  # whole expert copies of 1000 B each
    assert d.generation == 0 and d.window_steps == 8 and d.step == 50
    # the prediction is the solve the control plane runs: same planner call, same placement
    p = predict(_window(SKEWED), CURRENT, PLANNER, RANKS, expert_bytes=1000)
    assert (p.now, p.after, p.bytes) == (d.imbalance_now, d.imbalance_predicted, d.bytes)
    assert d.as_dict()["reason"] == "gain" and d.as_dict()["action"] == "rebalance"


def test_balanced_window_holds_below_the_threshold():
    d = _decide(AUTO, _window(BALANCED))
    assert d.action is DecisionAction.HOLD and d.reason is DecisionReason.GAIN_BELOW_THRESHOLD
    assert d.imbalance_now == 1.0 and d.imbalance_predicted == pytest.approx(1.0) and d.gain == pytest.approx(0.0)
    # a threshold above the skewed gain holds that too
    high = AUTO.model_copy(update={"threshold_gain": 0.95})
    assert _decide(high, _window(SKEWED)).reason is DecisionReason.GAIN_BELOW_THRESHOLD


def test_not_enough_window():
    d = _decide(AUTO, _window(SKEWED, steps=3))
    assert d.action is DecisionAction.HOLD and d.reason is DecisionReason.NOT_ENOUGH_WINDOW
    assert d.window_steps == 3 and d.gain is None


def test_interval_is_respected_in_seconds_and_steps():
    w = _window(SKEWED)
    # 5 s after the last rebalance (min 10 s), steps passed: hold, with the imbalance now but no solve
    d = _decide(AUTO, w, t=105.0, step=50, last=Moment(100.0, 10))
    assert d.action is DecisionAction.HOLD and d.reason is DecisionReason.INTERVAL_NOT_PASSED
    assert d.imbalance_now == pytest.approx(215.0 / 67.5) and d.imbalance_predicted is None
    # seconds passed, 3 steps (min 4): hold
    assert _decide(AUTO, w, t=200.0, step=13, last=Moment(100.0, 10)).reason is DecisionReason.INTERVAL_NOT_PASSED
    # both passed: rebalance
    d = _decide(AUTO, w, t=110.0, step=14, last=Moment(100.0, 10))
    assert d.action is DecisionAction.REBALANCE and d.reason is DecisionReason.GAIN


def test_byte_budget_is_respected():
    w = _window(SKEWED)
    need = _decide(AUTO, w).bytes
    over = AUTO.model_copy(update={"byte_budget": need - 1})
    d = _decide(over, w)
    assert d.action is DecisionAction.HOLD and d.reason is DecisionReason.OVER_BYTE_BUDGET and d.bytes == need
    exact = AUTO.model_copy(update={"byte_budget": need})
    assert _decide(exact, w).action is DecisionAction.REBALANCE


def test_periodic_mode_rebalances_every_n_steps_whatever_the_gain():
    pol = AutopilotPolicy(mode=EplbMode.PERIODIC, periodic_steps=5, min_window_steps=2)
    w = _window(BALANCED)  # no gain at all: periodic rebalances anyway
    taken: list[int] = []
    last = None
    for step in range(21):
        d = _decide(pol, w, t=float(step), step=step, last=last)
        if d.action is DecisionAction.REBALANCE:
            assert d.reason is DecisionReason.PERIODIC
            taken.append(step)
            last = Moment(float(step), step)
        else:
            assert d.reason is DecisionReason.INTERVAL_NOT_PASSED
    assert taken == [5, 10, 15, 20]
    # the byte budget still bounds a periodic rebalance
    skew = _window(SKEWED)
    tight = pol.model_copy(update={"byte_budget": 1})
    assert _decide(tight, skew, step=5).reason is DecisionReason.OVER_BYTE_BUDGET


def test_parse_eplb_flag():
    assert parse_eplb("off").mode is EplbMode.OFF
    assert parse_eplb("AUTO").mode is EplbMode.AUTO
    p = parse_eplb("periodic:32")
    assert p.mode is EplbMode.PERIODIC and p.periodic_steps == 32
    assert parse_eplb("auto", AUTO).min_interval_s == 10.0  # other fields kept
    for bad in ("sometimes", "auto:3", "periodic", "periodic:0", "periodic:x", ""):
        with pytest.raises(ValueError, match=f"eplb={bad!r}"):
            parse_eplb(bad)


def test_bad_config_refused_naming_field_and_value():
    with pytest.raises(ValidationError, match=r"threshold_gain[\s\S]*input_value=1.5"):
        AutopilotPolicy(mode=EplbMode.AUTO, threshold_gain=1.5)
    with pytest.raises(ValidationError, match=r"mode[\s\S]*input_value='sometimes'"):
        AutopilotPolicy(mode="sometimes")
    with pytest.raises(ValidationError, match=r"byte_budget[\s\S]*input_value=0"):
        AutopilotPolicy(byte_budget=0)
    with pytest.raises(ValidationError, match="periodic_steps=None: mode=periodic"):
        AutopilotPolicy(mode=EplbMode.PERIODIC)
    with pytest.raises(ValidationError, match=r"eplb\.tick_s[\s\S]*input_value=0"):
        RuntimeConfig(num_ranks=2, num_experts=4, hidden_size=8, ffn_size=8, top_k=2, slots_per_rank=2,
                      eplb={"mode": "auto", "tick_s": 0})
    with pytest.raises(ValidationError, match="eplb.min_window_steps=8 exceeds load_window=4"):
        RuntimeConfig(num_ranks=2, num_experts=4, hidden_size=8, ffn_size=8, top_k=2, slots_per_rank=2,
                      load_window=4, eplb={"mode": "auto"})
    with pytest.raises(ValueError, match="policy.mode=off"):
        _decide(AutopilotPolicy(), _window(SKEWED))
    # the default deployment does not rebalance by itself
    cfg = RuntimeConfig(num_ranks=2, num_experts=4, hidden_size=8, ffn_size=8, top_k=2, slots_per_rank=2)
    assert cfg.eplb.mode is EplbMode.OFF
    assert RuntimeConfig.model_validate_json(cfg.model_copy(update={"eplb": AUTO}).model_dump_json()).eplb == AUTO


def test_tick_over_a_control_plane_rebalances_once_then_holds():
    """``Autopilot.tick`` over a real ControlPlane (ShardCores in this process): a skewed window rebalances
    through ``propose_rebalance`` + ``apply``; the next ticks hold (the new placement leaves no gain); repeated
    holds fold into one event; a tick without new load steps decides nothing."""
    from ray_moe_dev.testing.inprocess import InProcessDeployment

    from ray_moe.control.autopilot import Autopilot

    cfg = RuntimeConfig(num_ranks=4, num_experts=E, hidden_size=8, ffn_size=8, top_k=2, slots_per_rank=S, seed=3,
                        eplb=AUTO.model_copy(update={"min_interval_s": 0.0}))
    dep = InProcessDeployment(cfg)
    plane = dep.plane
    clock = iter(float(t) for t in range(1000))
    pilot = Autopilot(cfg.eplb, clock=lambda: next(clock))
    taken: list[str] = []

    def rebalance(why: str):
        taken.append(why)
        rep = plane.apply(plane.propose_rebalance(), reason=why)
        pilot.rebalanced()
        return {"new_generation": rep.new_generation, "copied_bytes": 0, "publish_s": 0.01}

    def load(generation: int) -> None:
        plane.record_load(np.asarray([SKEWED]), phase="prefill", generation=generation)
        pilot.observe_step()

    assert pilot.tick(None, rebalance) is None  # no plane attached yet
    for _ in range(3):  # too short a window
        load(0)
    ev = pilot.tick(plane, rebalance)
    assert ev.decision.reason is DecisionReason.NOT_ENOUGH_WINDOW and not taken
    assert pilot.tick(plane, rebalance) is None  # no new step: nothing to decide
    load(0)
    ev = pilot.tick(plane, rebalance)
    assert ev.taken and ev.new_generation == 1 and ev.decision.reason is DecisionReason.GAIN
    assert plane.active_generation() == 1 and len(taken) == 1 and taken[0].startswith("autopilot (gain)")
    after, _ = imbalance(rank_loads(np.asarray([SKEWED], dtype=float), plane.manifest(), RANKS))
    assert after == pytest.approx(ev.decision.imbalance_predicted) and after < ev.decision.imbalance_now
    # the same skew keeps coming: within the interval, then no gain left; never a second rebalance
    reasons = []
    for _ in range(8):
        load(1)
        reasons.append(pilot.tick(plane, rebalance).decision.reason)
    assert len(taken) == 1
    assert reasons[:3] == [DecisionReason.INTERVAL_NOT_PASSED] * 3  # min_interval_steps=4
    assert set(reasons[3:]) == {DecisionReason.GAIN_BELOW_THRESHOLD}
    hist = pilot.history()
    assert [h["reason"] for h in hist] == ["not_enough_window", "gain", "interval_not_passed", "gain_below_threshold"]
    assert hist[2]["repeats"] == 2 and hist[3]["repeats"] == 4
    assert any(e.event == "autopilot" and e.generation == 1 for e in plane.timeline())
    # a rebalance that fails is recorded, the generation stays, and the interval restarts (no retry every step)
    plane.load.clear()
    for _ in range(4):
        plane.record_load(np.asarray([[10, 200, 10, 10, 10, 10, 10, 10]]), phase="prefill", generation=1)
        pilot.observe_step()

    def failing(why: str):
        raise RuntimeError("copy rank 2 -> rank 0 hung")

    ev = pilot.tick(plane, failing)
    assert not ev.taken and ev.error == "RuntimeError: copy rank 2 -> rank 0 hung"
    assert ev.decision.action is DecisionAction.REBALANCE and plane.active_generation() == 1
    assert pilot.last_rebalance.step == 16 and any(e.event == "autopilot-error" for e in plane.timeline())
    load(1)
    assert pilot.tick(plane, failing).decision.reason is DecisionReason.INTERVAL_NOT_PASSED
    st = pilot.status(2)
    assert st["mode"] == "auto" and st["load_steps"] == 17 and not st["running"]
    assert st["last_rebalance"]["step"] == 16 and len(st["decisions"]) == 2
    assert [d["reason"] for d in st["decisions"]] == ["gain", "interval_not_passed"]


def test_prometheus_points_count_what_happened():
    """The coordinator's autopilot metrics (``ray_moe.ray.prometheus``, no Ray): gauges carry the imbalance,
    counters grow by one decision / one rebalance / its measured bytes."""
    from ray_moe.control.autopilot import AutopilotEvent
    from ray_moe.ray.prometheus import (
        AUTOPILOT_METRICS,
        AutopilotExporter,
        PointKind,
        autopilot_points,
    )

    d = _decide(AUTO, _window(SKEWED))
    taken = AutopilotEvent(d, taken=True, new_generation=1, copied_bytes=4096, publish_s=0.25)
    pts = {(p.name, p.tags): p for p in autopilot_points("dep", taken)}
    dep = (("deployment", "dep"),)
    assert pts[("moe_eplb_imbalance_ratio", dep + (("estimate", "current"),))].value == d.imbalance_now
    assert pts[("moe_eplb_imbalance_ratio", dep + (("estimate", "predicted"),))].value == d.imbalance_predicted
    assert pts[("moe_eplb_decisions_total", dep + (("action", "rebalance"), ("reason", "gain")))].value == 1.0
    assert pts[("moe_eplb_rebalances_total", dep + (("reason", "gain"),))].kind is PointKind.COUNTER
    assert pts[("moe_eplb_migrated_bytes_total", dep)].value == 4096.0
    assert pts[("moe_eplb_time_to_publish_seconds", dep)].value == 0.25
    failed = {p.name for p in autopilot_points("dep", AutopilotEvent(d, error="RankDeadError: rank 2"))}
    assert "moe_eplb_rebalance_failures_total" in failed and "moe_eplb_rebalances_total" not in failed
    hold = autopilot_points("dep", AutopilotEvent(_decide(AUTO, _window(SKEWED, steps=2))))
    assert [(p.name, dict(p.tags)["reason"]) for p in hold] == [("moe_eplb_decisions_total", "not_enough_window")]
    with pytest.raises(ValueError, match="event=dict"):
        autopilot_points("dep", {})

    class Metric:
        def __init__(self, name, description="", tag_keys=()):
            self.name, self.tag_keys, self.calls = name, tag_keys, []

        def set(self, value, tags=None):
            self.calls.append(("set", value, tags))

        def inc(self, value=1.0, tags=None):
            self.calls.append(("inc", value, tags))

    class Module:
        Gauge = Counter = Metric

    exp = AutopilotExporter(metrics_module=Module())
    exp.record("dep", taken)
    exp.record("dep", taken)
    assert exp._metrics["moe_eplb_migrated_bytes_total"].name == "moe_eplb_migrated_bytes"  # Ray adds _total
    assert [c[1] for c in exp._metrics["moe_eplb_migrated_bytes_total"].calls] == [4096.0, 4096.0]
    assert len(exp._metrics) == len(AUTOPILOT_METRICS)


def test_serve_flag():
    from ray_moe.apps.cli import build_parser

    p = build_parser()
    assert p.parse_args(["serve", "--checkpoint", "x"]).eplb.mode is EplbMode.AUTO  # on by default for serve
    got = p.parse_args(["serve", "--checkpoint", "x", "--eplb", "periodic:12"]).eplb
    assert got.mode is EplbMode.PERIODIC and got.periodic_steps == 12
    assert p.parse_args(["serve", "--checkpoint", "x", "--eplb", "off"]).eplb.mode is EplbMode.OFF
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["serve", "--checkpoint", "x", "--eplb", "periodic:0"])
    assert exc.value.code == 2
