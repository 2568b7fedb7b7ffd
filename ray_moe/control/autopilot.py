"""Automatic rebalance: the policy that decides, from the load window, whether an EPLB rebalance is worth it now.
Pure: no Ray. ``decide`` is the policy; ``Autopilot`` holds its state over one control plane (load steps seen,
the bounded decision history, the last rebalance) and its tick thread. The coordinator actor runs the tick and,
on REBALANCE, takes the path ``rt.rebalance()`` takes (``ControlPlane.propose_rebalance`` + ``apply``).

Imbalance is counted in routed rows (the load window's unit): an expert's rows split evenly over its copies
(round-robin replica selection), so a rank of layer ``l`` carries ``sum over its slots of W[l, e] / m[l, e]``.
Per layer the imbalance is ``max / mean`` over the ranks; overall it is ``sum_l max_l / sum_l mean_l`` (each
layer's exchange waits for its slowest rank, so the step waits for the sum of the per-layer maxima).

The configuration records (``EplbMode``, ``AutopilotPolicy``) live in ``ray_moe.model.config`` (the
``RuntimeConfig.eplb`` field group sits below this layer) and are re-exported here.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from ray_moe.model.config import AutopilotPolicy, EplbMode
from ray_moe.placement.floors import ReplicaFloors
from ray_moe.placement.load import LoadWindow
from ray_moe.placement.manifest import PlacementManifest, manifest_from_assignment
from ray_moe.placement.planner import PlacementPlanner

__all__ = ["Autopilot", "AutopilotEvent", "AutopilotPolicy", "Decision", "DecisionAction", "DecisionReason", "EplbMode", "Moment",
           "Prediction", "decide", "imbalance", "parse_eplb", "predict", "rank_loads"]


class DecisionAction(str, Enum):
    REBALANCE = "rebalance"
    HOLD = "hold"


class DecisionReason(str, Enum):
    """Why a decision went the way it did (REBALANCE: ``periodic`` or ``gain``; HOLD: the rest)."""

    NOT_ENOUGH_WINDOW = "not_enough_window"
    INTERVAL_NOT_PASSED = "interval_not_passed"
    GAIN_BELOW_THRESHOLD = "gain_below_threshold"
    OVER_BYTE_BUDGET = "over_byte_budget"
    PERIODIC = "periodic"
    GAIN = "gain"


@dataclass(frozen=True)
class Moment:
    """A point of the deployment's life: wall time ``t`` (seconds) and load ``step`` (observations recorded)."""

    t: float
    step: int


@dataclass(frozen=True)
class Prediction:
    """Routed-row imbalance now and after the EPLB solve the control plane would run, and what it would move.

    layer_now / layer_after: [L] max / mean per layer. bytes: analytical bytes the migration writes
    (every non-retained target copy: network copies, same-GPU copies and checkpoint loads).
    """

    now: float
    after: float
    layer_now: tuple[float, ...]
    layer_after: tuple[float, ...]
    bytes: int
    copies: int

    @property
    def gain(self) -> float:
        """``1 - after / now``: the fraction of the bottleneck rank's rows the solve takes away."""
        return 1.0 - self.after / self.now if self.now > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    """One evaluation of the policy. Numbers are None where the decision did not need them (the solve is
    skipped when the window is too short or the interval has not passed)."""

    action: DecisionAction
    reason: DecisionReason
    mode: EplbMode
    time: float
    step: int
    generation: int | None
    window_steps: int
    imbalance_now: float | None = None
    imbalance_predicted: float | None = None
    gain: float | None = None
    bytes: int | None = None
    layer_imbalance_now: tuple[float, ...] = field(default=())
    layer_imbalance_predicted: tuple[float, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(action=self.action.value, reason=self.reason.value, mode=self.mode.value)
        return out


@dataclass(frozen=True)
class AutopilotEvent:
    """One decision as the coordinator recorded it, with what came of it.

    taken: a rebalance was published (``new_generation``); ``error`` names why one that was decided failed.
    copied_bytes: bytes measured crossing between shards; publish_s: from the decision to the published
    generation (solve, plan, copy, verify, publish; not the drain). repeats: later identical HOLDs folded in.
    """

    decision: Decision
    taken: bool = False
    new_generation: int | None = None
    copied_bytes: int | None = None
    publish_s: float | None = None
    error: str | None = None
    repeats: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = self.decision.as_dict()
        out.update(taken=self.taken, new_generation=self.new_generation, copied_bytes=self.copied_bytes,
                   publish_s=self.publish_s, error=self.error, repeats=self.repeats)
        return out


def parse_eplb(text: str, base: AutopilotPolicy | None = None) -> AutopilotPolicy:
    """``off`` | ``auto`` | ``periodic:N`` (the ``--eplb`` flag) over ``base``'s other fields.
    Anything else raises ValueError naming the value."""
    base = base or AutopilotPolicy()
    raw = str(text).strip().lower()
    mode, sep, arg = raw.partition(":")
    expected = "expected off, auto or periodic:N (N >= 1 load steps)"
    if mode in (EplbMode.OFF.value, EplbMode.AUTO.value) and not sep:
        return AutopilotPolicy(**{**base.model_dump(), "mode": EplbMode(mode)})
    if mode == EplbMode.PERIODIC.value:
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"eplb={text!r}: periodic needs a step count N >= 1 (periodic:N); {expected}")
        return AutopilotPolicy(**{**base.model_dump(), "mode": EplbMode.PERIODIC, "periodic_steps": int(arg)})
    raise ValueError(f"eplb={text!r}: {expected}")


def rank_loads(weight: np.ndarray, placement: PlacementManifest, ranks: Sequence[int]) -> np.ndarray:
    """Routed rows per rank under ``placement``: weight [L, E] float -> [L, P] float64, P = len(ranks), columns
    in ``ranks`` order; an expert's rows split evenly over its copies. A slot on a rank not in ``ranks``
    raises ValueError naming it."""
    w = np.asarray(weight, dtype=np.float64)
    if w.shape != (placement.num_layers, placement.num_experts):
        raise ValueError(f"weight has shape {tuple(w.shape)}, expected [L, E] = "
                         f"[{placement.num_layers}, {placement.num_experts}]")
    col = {int(r): i for i, r in enumerate(ranks)}
    out = np.zeros((placement.num_layers, len(col)), dtype=np.float64)
    for l in range(placement.num_layers):
        slots = placement.layer_slots(l)
        copies = np.bincount([s.logical_expert_id for s in slots], minlength=placement.num_experts)
        for s in slots:
            if s.destination_rank not in col:
                raise ValueError(f"placement: slot q{s.physical_slot_id} of layer {l} is on rank "
                                 f"{s.destination_rank}, not one of ranks {sorted(col)}")
            out[l, col[s.destination_rank]] += w[l, s.logical_expert_id] / copies[s.logical_expert_id]
    return out


def imbalance(loads: np.ndarray) -> tuple[float, tuple[float, ...]]:
    """(overall, per layer) max / mean of loads [L, P]; a layer (or a whole matrix) with no load counts 1.0."""
    mx, mean = loads.max(axis=1), loads.mean(axis=1)
    layer = tuple(float(a / b) if b > 0 else 1.0 for a, b in zip(mx, mean))
    total = float(mean.sum())
    return (float(mx.sum()) / total if total > 0 else 1.0), layer


def predict(window: LoadWindow, current: PlacementManifest, planner: PlacementPlanner, live: Sequence[int], *,
            floors: ReplicaFloors | None = None, expert_bytes: int = 1) -> Prediction:
    """Imbalance under ``current`` and under the placement ``ControlPlane.propose_rebalance`` would publish.

    1. The demand: the window's matrix W [L, E] (its sum, or EMA).
    2. Now: routed rows per rank under ``current`` (live ranks and any rank still holding slots).
    3. The candidate: ``planner.rebalance`` with the plane's defaults (migration-aware, tolerance 0.05, no two
       copies of an expert on one GPU, replica floors kept), built into a manifest that is never registered
       (generation ``current + 1``, the current digests) so no generation id is spent.
    4. After: routed rows per rank under the candidate over the live ranks.
    5. The migration plan ``current -> candidate`` (``planner.admit`` without a memory budget): its bytes.
    """
    # 1.
    weight = window.snapshot().weight
    # 2.
    live = [int(r) for r in live]
    held = sorted(current.slots_ranks() - set(live))
    now, layer_now = imbalance(rank_loads(weight, current, live + held))
    # 3.
    a = planner.rebalance(current, live, window, floors, migration_aware=True)
    digests = {(s.layer, s.logical_expert_id): s.parameter_digest for s in current.slots}
    candidate = manifest_from_assignment(
        generation=current.generation + 1, phy2log=a.phy2log, slot_rank=a.slot_rank,
        num_experts=current.num_experts, topology=planner.topology, process_group_id=current.process_group_id,
        checkpoint_version=current.checkpoint_version, digests=digests)
    # 4.
    after, layer_after = imbalance(rank_loads(weight, candidate, live))
    # 5.
    plan = planner.admit(current, candidate, live, expert_bytes=expert_bytes)
    lg = plan.ledger
    return Prediction(now, after, layer_now, layer_after, int(lg.reserved_bytes),
                      lg.same_gpu_copies + lg.same_node_copies + lg.cross_node_copies + lg.checkpoint_loads)


def decide(policy: AutopilotPolicy, window: LoadWindow, current: PlacementManifest, planner: PlacementPlanner, *,
           live: Sequence[int], now: Moment, last: Moment | None, floors: ReplicaFloors | None = None,
           expert_bytes: int = 1) -> Decision:
    """Rebalance now, or hold, and why.

    ``last`` is the moment of the last rebalance (None: none yet; PERIODIC then counts from step 0).

    1. Refuse mode OFF (the coordinator does not evaluate then) and a policy that is not an AutopilotPolicy.
    2. Window: fewer than ``min_window_steps`` observations -> HOLD ``not_enough_window``.
    3. Interval (hysteresis). PERIODIC: fewer than ``periodic_steps`` steps since the last rebalance -> HOLD
       ``interval_not_passed``. AUTO: fewer than ``min_interval_s`` seconds or ``min_interval_steps`` steps
       since it -> HOLD ``interval_not_passed`` (with the imbalance now; no solve).
    4. Predict (``predict``): imbalance now, after the EPLB solve, the gain and the migration's bytes.
    5. AUTO: gain < ``threshold_gain`` -> HOLD ``gain_below_threshold``.
    6. Bytes over ``byte_budget`` -> HOLD ``over_byte_budget`` (both modes: the budget bounds every operation).
    7. REBALANCE: reason ``periodic`` (PERIODIC) or ``gain`` (AUTO).
    """
    # 1.
    if not isinstance(policy, AutopilotPolicy):
        raise ValueError(f"policy={type(policy).__name__} is not an AutopilotPolicy")
    if policy.mode is EplbMode.OFF:
        raise ValueError("policy.mode=off: the autopilot makes no decisions (set eplb.mode to auto or periodic)")
    base = {"mode": policy.mode, "time": float(now.t), "step": int(now.step), "generation": current.generation,
            "window_steps": len(window)}

    def hold(reason: DecisionReason, **numbers: Any) -> Decision:
        return Decision(DecisionAction.HOLD, reason, **base, **numbers)

    # 2.
    if len(window) < policy.min_window_steps:
        return hold(DecisionReason.NOT_ENOUGH_WINDOW)
    # 3.
    since_steps = now.step - (last.step if last is not None else 0)
    if policy.mode is EplbMode.PERIODIC:
        if since_steps < policy.periodic_steps:
            return hold(DecisionReason.INTERVAL_NOT_PASSED)
    elif last is not None and (now.t - last.t < policy.min_interval_s or since_steps < policy.min_interval_steps):
        live_now = [int(r) for r in live]
        held = sorted(current.slots_ranks() - set(live_now))
        imb, layer = imbalance(rank_loads(window.snapshot().weight, current, live_now + held))
        return hold(DecisionReason.INTERVAL_NOT_PASSED, imbalance_now=imb, layer_imbalance_now=layer)
    # 4.
    p = predict(window, current, planner, live, floors=floors, expert_bytes=expert_bytes)
    numbers = {"imbalance_now": p.now, "imbalance_predicted": p.after, "gain": p.gain, "bytes": p.bytes,
               "layer_imbalance_now": p.layer_now, "layer_imbalance_predicted": p.layer_after}
    # 5.
    if policy.mode is EplbMode.AUTO and p.gain < policy.threshold_gain:
        return hold(DecisionReason.GAIN_BELOW_THRESHOLD, **numbers)
    # 6.
    if policy.byte_budget is not None and p.bytes > policy.byte_budget:
        return hold(DecisionReason.OVER_BYTE_BUDGET, **numbers)
    # 7.
    reason = DecisionReason.PERIODIC if policy.mode is EplbMode.PERIODIC else DecisionReason.GAIN
    return Decision(DecisionAction.REBALANCE, reason, **base, **numbers)


class Autopilot:
    """The autopilot's state over one control plane: the policy, the bounded decision history and the moment
    of the last rebalance (manual ones included). No thread, no Ray: the coordinator calls ``tick``.

    ``clock``: wall seconds (``time.time``); intervals and ``Decision.time`` are read from it.
    """

    def __init__(self, policy: AutopilotPolicy, *, clock: Callable[[], float] = time.time) -> None:
        if not isinstance(policy, AutopilotPolicy):
            raise ValueError(f"policy={type(policy).__name__} is not an AutopilotPolicy")
        self.policy = policy
        self.steps = 0  # load steps observed (the coordinator's ``record_load`` calls)
        self.last_rebalance: Moment | None = None
        self._clock = clock
        self._events: deque[AutopilotEvent] = deque(maxlen=policy.history)
        self._evaluated_step: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def observe_step(self) -> None:
        """One more load observation reached the window."""
        with self._lock:
            self.steps += 1

    def rebalanced(self, step: int | None = None) -> None:
        """A rebalance was published now, at load step ``step`` (default: the steps observed so far); the
        interval counts from here."""
        self.last_rebalance = Moment(self._clock(), self.steps if step is None else int(step))

    def start(self, tick: Callable[[], Any], on_error: Callable[[BaseException], None]) -> None:
        """Run ``tick()`` every ``policy.tick_s`` seconds on a daemon thread until ``stop``; an exception goes to
        ``on_error`` and the loop goes on (the autopilot never takes its host down)."""
        if self._thread is not None:
            raise RuntimeError("the autopilot is already running")

        def loop() -> None:
            while not self._stop.wait(self.policy.tick_s):
                try:
                    tick()
                except Exception as exc:  # noqa: BLE001
                    try:
                        on_error(exc)
                    except Exception:  # noqa: BLE001
                        pass

        self._thread = threading.Thread(target=loop, name="ray-moe-autopilot", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def status(self, last: int = 8) -> dict[str, Any]:
        """JSON-able view: mode, policy, load steps, whether the loop runs, the last rebalance, the last decisions."""
        lr = self.last_rebalance
        return {"mode": self.policy.mode.value, "policy": self.policy.model_dump(mode="json"), "load_steps": self.steps,
                "running": self._thread is not None and not self._stop.is_set(),
                "last_rebalance": None if lr is None else asdict(lr), "decisions": self.history(last)}

    def history(self, last: int | None = None) -> list[dict[str, Any]]:
        """The recorded events, oldest first (the last ``last`` of them), as JSON-able dicts."""
        with self._lock:
            events = list(self._events)
        return [e.as_dict() for e in (events[-last:] if last else events)]

    def events(self) -> tuple[AutopilotEvent, ...]:
        with self._lock:
            return tuple(self._events)

    def tick(self, plane: Any, rebalance: Callable[[str], Mapping[str, Any]]) -> AutopilotEvent | None:
        """One evaluation over ``plane`` (a ``ControlPlane``) at the load steps observed so far;
        ``rebalance(reason)`` runs the rebalance path and returns its report (``new_generation``, ``copied_bytes``,
        ``publish_s``) and calls ``rebalanced``.

        1. Nothing to decide with mode OFF, without a plane or its ACTIVE generation, or when no load step
           arrived since the last evaluation (unless that one waited for its interval: time alone may pass it).
        2. ``decide`` on the plane's load window, active placement, planner, live ranks and replica floors.
        3. REBALANCE: ``rebalance``; a failure is recorded (the prior generation keeps serving) and restarts the
           interval too, so a rebalance that keeps failing is not retried every step. Taken or failed, the
           plane's timeline shows it.
        4. Record it: a HOLD identical in action, reason and generation to the last event is folded into that
           one (``repeats``), so a steady state does not push the history out.
        """
        # 1.
        if self.policy.mode is EplbMode.OFF or plane is None or plane.active_generation() is None:
            return None
        with self._lock:
            prior = self._events[-1] if self._events else None
            steps = self.steps
        waiting = prior is not None and prior.decision.reason is DecisionReason.INTERVAL_NOT_PASSED
        if steps == self._evaluated_step and not waiting:
            return None
        self._evaluated_step = steps
        # 2.
        d = decide(self.policy, plane.load, plane.manifest(), plane.planner, live=plane.live_ranks(),
                   now=Moment(self._clock(), int(steps)), last=self.last_rebalance, floors=plane.floors,
                   expert_bytes=max(1, int(plane.expert_bytes)))
        event = AutopilotEvent(d)
        # 3.
        if d.action is DecisionAction.REBALANCE:
            why = (f"autopilot ({d.reason.value}): imbalance {d.imbalance_now:.3f} -> {d.imbalance_predicted:.3f} "
                   f"predicted, {d.bytes} B")
            try:
                out = rebalance(why)
                event = AutopilotEvent(d, taken=True, new_generation=out["new_generation"],
                                       copied_bytes=out.get("copied_bytes"), publish_s=out.get("publish_s"))
                plane.log("autopilot", out["new_generation"], f"{why}; published in {out.get('publish_s', 0.0):.2f}s")
            except Exception as exc:  # noqa: BLE001 - recorded; the prior generation keeps serving
                event = AutopilotEvent(d, error=f"{type(exc).__name__}: {exc}")
                self.rebalanced(steps)
                plane.log("autopilot-error", d.generation, f"{why}: {event.error}")
        # 4.
        with self._lock:
            last = self._events[-1] if self._events else None
            if (last is not None and d.action is DecisionAction.HOLD and last.decision.action is DecisionAction.HOLD
                    and last.decision.reason is d.reason and last.decision.generation == d.generation):
                self._events[-1] = replace(event, repeats=last.repeats + 1)
            else:
                self._events.append(event)
        return event
