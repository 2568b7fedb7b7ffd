"""Load-driven scaling: the policy that decides, from the serving signals, whether to add a rank, remove one or
hold. Pure: no Ray. ``decide`` is the policy; the scaler that samples the signals (what the drivers' generation
loops report to the coordinator) and acts on a decision (a new target for the coordinator's reconcile loop) is
``ray_moe.ray.scaler.RankScaler``, ticked by that loop.

    floor = rank_floor(policy, num_experts=8, num_layers=2, slots_per_rank=3, floors=rt.floors())
    d = decide(signals, ranks=4, now=time.monotonic(), last_change=None, policy=policy, floor=floor)
    d.action          # ScaleAction.ADD | REMOVE | HOLD, d.reason why, d.target_ranks the ranks after it

Rules, in order (the first that applies decides):
  1. above ``max_ranks`` -> REMOVE (``above_max``); below the floor (the largest of ``min_ranks``, the replica
     floors' ranks and the ranks that hold every expert once) -> ADD (``below_floor``), unless at max_ranks
  2. within ``cooldown_s`` of the last change -> HOLD (``cooldown``)
  3. the oldest waiting request waited more than ``target_wait_s`` -> ADD (``queue_wait``), or HOLD
     (``at_max``) at max_ranks
  4. nothing waiting or running for ``idle_s`` -> REMOVE (``idle``), or HOLD (``at_floor``) at the floor
  5. otherwise HOLD (``within_target``)
A change that reverses the last one (ADD after a REMOVE, REMOVE after an ADD) needs its threshold passed by
the ``hysteresis`` fraction more: wait > target_wait_s x (1 + h), idle >= idle_s x (1 + h).

The configuration record (``ScalingPolicy``) lives in ``ray_moe.model.config`` (the ``RuntimeConfig.scaling``
field group sits below this layer) and is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from ray_moe.model.config import ScalingPolicy

__all__ = ["Change", "ScaleAction", "ScaleReason", "ScalingDecision", "ScalingPolicy", "ScalingSignals", "decide",
           "rank_floor", "ranks_to_hold_experts"]


class ScaleAction(str, Enum):
    ADD = "add"
    REMOVE = "remove"
    HOLD = "hold"


class ScaleReason(str, Enum):
    """Why a decision went the way it did (ADD: ``queue_wait`` / ``below_floor``; REMOVE: ``idle`` /
    ``above_max``; HOLD: the rest). ``no_resources`` is recorded by the scaler when an ADD found no resources
    for the new shard's bundle."""

    QUEUE_WAIT = "queue_wait"
    BELOW_FLOOR = "below_floor"
    IDLE = "idle"
    ABOVE_MAX = "above_max"
    COOLDOWN = "cooldown"
    AT_MAX = "at_max"
    AT_FLOOR = "at_floor"
    WITHIN_TARGET = "within_target"
    NO_RESOURCES = "no_resources"


@dataclass(frozen=True)
class ScalingSignals:
    """What the scaler samples each tick.

    oldest_wait_s: how long the oldest waiting request has waited (0 when none waits); waiting / running:
    requests queued / in flight; steps_per_s: generation (or forward) steps per second since the last sample;
    since_work_s: seconds since the last step that had work."""

    oldest_wait_s: float = 0.0
    waiting: int = 0
    running: int = 0
    steps_per_s: float = 0.0
    since_work_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("oldest_wait_s", "steps_per_s", "since_work_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and not math.isnan(v)):
                raise ValueError(f"{name}={v!r}: must be a number >= 0")
        for name in ("waiting", "running"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r}: must be an integer >= 0")


@dataclass(frozen=True)
class Change:
    """The last rank change: when (``t``, the clock ``decide`` is given) and which way."""

    t: float
    action: ScaleAction


@dataclass(frozen=True)
class ScalingDecision:
    """One decision: ``action`` on ``ranks`` live ranks (``target_ranks`` after it), ``reason`` why, the
    ``floor`` / ``ceiling`` it kept to, the thresholds it compared (``wait_threshold_s``, ``idle_threshold_s``:
    hysteresis included) and the signals it saw, at ``t``."""

    action: ScaleAction
    reason: ScaleReason
    ranks: int
    target_ranks: int
    floor: int
    ceiling: int
    wait_threshold_s: float
    idle_threshold_s: float
    signals: ScalingSignals
    t: float

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "signals"}
        out.update(action=self.action.value, reason=self.reason.value, **asdict(self.signals))
        return out


def ranks_to_hold_experts(num_experts: int, num_layers: int, slots_per_rank: int) -> int:
    """The fewest ranks whose slots hold every expert of every layer once: ``ceil(E * L / (S * L))`` (a rank
    has ``slots_per_rank`` slots in each of the ``num_layers`` layers)."""
    for name, v in (("num_experts", num_experts), ("num_layers", num_layers), ("slots_per_rank", slots_per_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: must be an integer >= 1")
    return math.ceil(num_experts * num_layers / (slots_per_rank * num_layers))


def rank_floor(policy: ScalingPolicy, *, num_experts: int, num_layers: int, slots_per_rank: int,
               floors: Iterable[Mapping[str, int]] = ()) -> int:
    """The fewest live ranks a decision may leave: the largest of ``policy.min_ranks``, the ranks that hold
    every expert once, and what the replica floors (``[{layer, expert, replicas}]``, as ``Runtime.floors()``)
    need: every copy of a layer in its slots (an expert without a floor keeps one copy) and the copies of one
    expert on distinct ranks."""
    floor = max(policy.min_ranks, ranks_to_hold_experts(num_experts, num_layers, slots_per_rank))
    per_layer: dict[int, dict[int, int]] = {}
    for f in floors:
        layer, expert, replicas = int(f["layer"]), int(f["expert"]), int(f["replicas"])
        if not 0 <= expert < num_experts or not 0 <= layer < num_layers or replicas < 1:
            raise ValueError(f"floor={dict(f)!r}: layer / expert out of range or replicas < 1")
        per_layer.setdefault(layer, {})[expert] = max(replicas, per_layer.get(layer, {}).get(expert, 1))
    for by_expert in per_layer.values():
        copies = num_experts + sum(r - 1 for r in by_expert.values())
        floor = max(floor, math.ceil(copies / slots_per_rank), max(by_expert.values()))
    return floor


def decide(signals: ScalingSignals, ranks: int, now: float, last_change: Change | None, *,
           policy: ScalingPolicy, floor: int) -> ScalingDecision:
    """The decision for ``ranks`` live ranks at ``now`` (seconds, any monotonic clock that ``last_change``
    shares); ``floor``: ``rank_floor``'s answer. Rules: the module docstring."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks={ranks!r}: must be an integer >= 1")
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
        raise ValueError(f"floor={floor!r}: must be an integer >= 1")
    ceiling = policy.max_ranks
    last = None if last_change is None else last_change.action
    h = 1.0 + policy.hysteresis
    wait_at = policy.target_wait_s * (h if last is ScaleAction.REMOVE else 1.0)
    idle_at = policy.idle_s * (h if last is ScaleAction.ADD else 1.0)

    def out(action: ScaleAction, reason: ScaleReason) -> ScalingDecision:
        step = {ScaleAction.ADD: 1, ScaleAction.REMOVE: -1}.get(action, 0)
        return ScalingDecision(action, reason, ranks, ranks + step, floor, ceiling, wait_at, idle_at, signals, now)

    if ranks > ceiling and ranks - 1 >= floor:
        return out(ScaleAction.REMOVE, ScaleReason.ABOVE_MAX)
    if ranks < floor and ranks < ceiling:
        return out(ScaleAction.ADD, ScaleReason.BELOW_FLOOR)
    if last_change is not None and now - last_change.t < policy.cooldown_s:
        return out(ScaleAction.HOLD, ScaleReason.COOLDOWN)
    if signals.waiting > 0 and signals.oldest_wait_s > wait_at:
        if ranks >= ceiling:
            return out(ScaleAction.HOLD, ScaleReason.AT_MAX)
        return out(ScaleAction.ADD, ScaleReason.QUEUE_WAIT)
    if signals.waiting == 0 and signals.running == 0 and signals.since_work_s >= idle_at:
        if ranks <= floor:
            return out(ScaleAction.HOLD, ScaleReason.AT_FLOOR)
        return out(ScaleAction.REMOVE, ScaleReason.IDLE)
    return out(ScaleAction.HOLD, ScaleReason.WITHIN_TARGET)
