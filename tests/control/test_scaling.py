"""The load-driven scaling policy (pure): a queue wait over the target adds a rank, an idle deployment loses one
after the idle time, the cooldown and the hysteresis of a reversing change hold, and the bounds (max_ranks,
min_ranks, replica floors, the ranks that hold every expert once) are never crossed; a bad config is refused
naming the field. Also the scaler's tick over injected hooks (no Ray): what it records and does."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ray_moe.control.scaling import (
    Change,
    ScaleAction,
    ScaleReason,
    ScalingPolicy,
    ScalingSignals,
    decide,
    rank_floor,
    ranks_to_hold_experts,
)
from ray_moe.driver.loop import LoopSignals
from ray_moe.model.config import RuntimeConfig

P = ScalingPolicy(enabled=True, min_ranks=2, max_ranks=5, target_wait_s=1.0, idle_s=10.0, cooldown_s=5.0,
                  hysteresis=0.5)
QUEUED = ScalingSignals(oldest_wait_s=1.2, waiting=3, running=4, steps_per_s=20.0, since_work_s=0.0)
IDLE = ScalingSignals(since_work_s=11.0)


def test_a_queue_wait_over_the_target_adds_a_rank():
    d = decide(QUEUED, 3, 100.0, None, policy=P, floor=2)
    assert (d.action, d.reason, d.ranks, d.target_ranks) == (ScaleAction.ADD, ScaleReason.QUEUE_WAIT, 3, 4)
    assert d.wait_threshold_s == 1.0 and d.as_dict()["oldest_wait_s"] == 1.2 and d.as_dict()["action"] == "add"
    # under the target, or nothing waiting: hold
    under = ScalingSignals(oldest_wait_s=0.9, waiting=3, running=4)
    assert decide(under, 3, 100.0, None, policy=P, floor=2).reason is ScaleReason.WITHIN_TARGET
    assert decide(ScalingSignals(oldest_wait_s=5.0, waiting=0, running=4), 3, 100.0, None, policy=P,
                  floor=2).action is ScaleAction.HOLD
    # at max_ranks the add is held, by name
    d = decide(QUEUED, 5, 100.0, None, policy=P, floor=2)
    assert (d.action, d.reason, d.target_ranks) == (ScaleAction.HOLD, ScaleReason.AT_MAX, 5)


def test_idle_removes_a_rank_only_after_the_idle_time():
    assert decide(ScalingSignals(since_work_s=9.9), 3, 100.0, None, policy=P, floor=2).reason \
        is ScaleReason.WITHIN_TARGET
    d = decide(IDLE, 3, 100.0, None, policy=P, floor=2)
    assert (d.action, d.reason, d.target_ranks) == (ScaleAction.REMOVE, ScaleReason.IDLE, 2)
    # work in flight is not idle, whatever the clock says
    busy = ScalingSignals(running=1, since_work_s=50.0)
    assert decide(busy, 3, 100.0, None, policy=P, floor=2).action is ScaleAction.HOLD
    # at the floor the removal is held
    d = decide(IDLE, 2, 100.0, None, policy=P, floor=2)
    assert (d.action, d.reason) == (ScaleAction.HOLD, ScaleReason.AT_FLOOR)


def test_cooldown_and_hysteresis():
    added = Change(t=100.0, action=ScaleAction.ADD)
    # within the cooldown: nothing, whichever way the load points
    for sig in (QUEUED, IDLE):
        assert decide(sig, 3, 104.9, added, policy=P, floor=2).reason is ScaleReason.COOLDOWN
    assert decide(QUEUED, 3, 105.0, added, policy=P, floor=2).action is ScaleAction.ADD  # same direction
    # reversing an add: idle must pass idle_s x 1.5 = 15 s
    d = decide(IDLE, 3, 200.0, added, policy=P, floor=2)
    assert (d.action, d.idle_threshold_s) == (ScaleAction.HOLD, 15.0)
    assert decide(ScalingSignals(since_work_s=15.0), 3, 200.0, added, policy=P, floor=2).action is ScaleAction.REMOVE
    # reversing a removal: the wait must pass target x 1.5 = 1.5 s
    removed = Change(t=100.0, action=ScaleAction.REMOVE)
    d = decide(QUEUED, 3, 200.0, removed, policy=P, floor=2)
    assert (d.action, d.wait_threshold_s) == (ScaleAction.HOLD, 1.5)
    more = ScalingSignals(oldest_wait_s=1.6, waiting=1)
    assert decide(more, 3, 200.0, removed, policy=P, floor=2).reason is ScaleReason.QUEUE_WAIT


def test_bounds_max_min_floors_and_every_expert_once():
    # above max_ranks: remove (cooldown or not); below the floor: add
    assert decide(QUEUED, 6, 100.0, Change(99.0, ScaleAction.ADD), policy=P, floor=2).reason is ScaleReason.ABOVE_MAX
    d = decide(IDLE, 2, 100.0, None, policy=P, floor=3)
    assert (d.action, d.reason) == (ScaleAction.ADD, ScaleReason.BELOW_FLOOR)
    # the ranks that hold every expert once: ceil(E * L / (S * L))
    assert ranks_to_hold_experts(8, 2, 3) == 3 and ranks_to_hold_experts(8, 1, 4) == 2
    assert ranks_to_hold_experts(256, 58, 40) == 7
    lo = ScalingPolicy(enabled=True, min_ranks=1, max_ranks=8)
    assert rank_floor(lo, num_experts=8, num_layers=2, slots_per_rank=3) == 3
    assert rank_floor(ScalingPolicy(enabled=True, min_ranks=4, max_ranks=8), num_experts=8, num_layers=2,
                      slots_per_rank=3) == 4
    # replica floors: 3 copies of expert 0 need 3 distinct ranks; 8 + 2 + 3 = 13 copies of layer 1 need 5 x 3 slots
    assert rank_floor(lo, num_experts=8, num_layers=2, slots_per_rank=4,
                      floors=[{"layer": 0, "expert": 0, "replicas": 3}]) == 3
    assert rank_floor(lo, num_experts=8, num_layers=2, slots_per_rank=3,
                      floors=[{"layer": 1, "expert": 0, "replicas": 3}, {"layer": 1, "expert": 5, "replicas": 4}]) == 5
    # the decision never goes under its floor
    assert decide(IDLE, 5, 100.0, None, policy=P, floor=5).action is ScaleAction.HOLD
    with pytest.raises(ValueError, match="floor="):
        rank_floor(lo, num_experts=8, num_layers=2, slots_per_rank=3, floors=[{"layer": 2, "expert": 0, "replicas": 2}])


def test_bad_config_and_bad_signals_are_refused_by_name():
    with pytest.raises(ValidationError, match="min_ranks=4 exceeds max_ranks=2"):
        ScalingPolicy(enabled=True, min_ranks=4, max_ranks=2)
    with pytest.raises(ValidationError, match="target_wait_s"):
        ScalingPolicy(target_wait_s=0)
    with pytest.raises(ValidationError, match="cooldown_s"):
        ScalingPolicy(cooldown_s=-1)
    with pytest.raises(ValidationError, match="hysteresis"):
        ScalingPolicy(hysteresis=-0.1)
    with pytest.raises(ValidationError, match="extra"):
        ScalingPolicy(min_rank=2)
    base = dict(num_experts=8, hidden_size=8, ffn_size=8, top_k=2, slots_per_rank=3)
    with pytest.raises(ValidationError, match=r"scaling.max_ranks=2: 3 ranks of slots_per_rank=3"):
        RuntimeConfig(num_ranks=3, **base, scaling=ScalingPolicy(enabled=True, max_ranks=2))
    with pytest.raises(ValidationError, match=r"num_ranks=6 is outside scaling \[min_ranks=1, max_ranks=5\]"):
        RuntimeConfig(num_ranks=6, **base, scaling=ScalingPolicy(enabled=True, max_ranks=5))
    assert RuntimeConfig(num_ranks=3, **base).scaling.enabled is False  # off by default
    with pytest.raises(ValueError, match="oldest_wait_s=-1"):
        ScalingSignals(oldest_wait_s=-1)
    with pytest.raises(ValueError, match="waiting=1.5"):
        ScalingSignals(waiting=1.5)
    with pytest.raises(ValueError, match="ranks=0"):
        decide(IDLE, 0, 1.0, None, policy=P, floor=1)


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_scaler_tick_acts_records_and_reports_missing_resources():
    from ray_moe.ray.scaler import RankScaler, ScalerHooks

    clock, live, calls, free = _Clock(), [0, 1], [], {"CPU": 0.0}
    load = {"sig": LoopSignals(waiting=0, running=0, oldest_wait_s=0.0, steps=0, since_work_s=None)}

    def add() -> int:
        live.append(max(live) + 1)
        calls.append(("add", live[-1]))
        return live[-1]

    def remove(r: int) -> None:
        live.remove(r)
        calls.append(("remove", r))

    asked: list = []
    hooks = ScalerHooks(sample=lambda: load["sig"], ranks=lambda: list(live), floor=lambda: 2, add_rank=add,
                        remove_rank=remove, bundle={"CPU": 0.5}, free=lambda: free, request=asked.append)
    pol = ScalingPolicy(enabled=True, min_ranks=2, max_ranks=3, target_wait_s=1.0, idle_s=4.0, cooldown_s=2.0,
                        hysteresis=0.0, tick_s=1.0)
    sc = RankScaler(pol, hooks, clock=clock, start=False)
    clock.t += 1.0
    assert sc.tick()["reason"] == "cooldown"  # the start counts as a change
    load["sig"] = LoopSignals(waiting=2, running=1, oldest_wait_s=3.0, steps=10, since_work_s=0.0)
    clock.t += 2.0
    ev = sc.tick()
    assert (ev["action"], ev["reason"], ev["done"], ev["requested"]) == ("add", "no_resources", False, True)
    assert ev["missing"] == {"CPU": 0.5} and asked == [[{"CPU": 0.5}]] and calls == []
    free["CPU"] = 4.0
    load["sig"] = LoopSignals(waiting=2, running=1, oldest_wait_s=3.0, steps=30, since_work_s=0.0)
    clock.t += 1.0
    ev = sc.tick()
    assert (ev["action"], ev["reason"], ev["done"], ev["rank"]) == ("add", "queue_wait", True, 2)
    assert ev["steps_per_s"] == 20.0 and live == [0, 1, 2]
    # the queue drains, the steps stop: idle counts from the last step the scaler saw move
    load["sig"] = LoopSignals(waiting=0, running=0, oldest_wait_s=0.0, steps=40, since_work_s=None)
    clock.t += 1.0
    assert sc.tick()["reason"] == "cooldown"
    for _ in range(3):
        clock.t += 1.0
        assert sc.tick()["action"] == "hold"
    clock.t += 1.0
    ev = sc.tick()
    assert (ev["action"], ev["reason"], ev["rank"]) == ("remove", "idle", 2) and live == [0, 1]
    assert asked[-1] == []  # the standing autoscaler request is dropped after a scale-in
    clock.t += 10.0
    assert sc.tick()["reason"] == "at_floor" and len(sc.events) == 9
