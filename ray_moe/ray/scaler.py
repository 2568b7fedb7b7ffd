# ======================================================================================================
#  LOAD-DRIVEN SCALING: A POLICY OF THE COORDINATOR (ticked by its reconcile loop, ray/reconciler.py)
#
#   every tick_s: sample the signals (what the drivers' generation loops report: oldest wait, waiting / running;
#   steps/s; seconds since the last step with work) ──> control.scaling.decide (pure)
#     ADD    ──> room for one shard's bundle (a free bundle of the deployment, or free resources)? yes: a new target
#                (one more rank) the loop converges to now; no: on a cluster
#                ray.autoscaler.sdk.request_resources(bundles=[bundle]); locally recorded as no_resources
#     REMOVE ──> a new target without the highest live rank: its slots evacuated under traffic, then regrouped away
#     HOLD   ──> recorded
#   while the loop is not converged (a dead rank being replaced) the scaler holds its hand
# ======================================================================================================
"""RankScaler: adds and removes ranks from the serving load (``RuntimeConfig.scaling``)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import ray

from ray_moe.control.scaling import (
    Change,
    ScaleAction,
    ScaleReason,
    ScalingDecision,
    ScalingPolicy,
    ScalingSignals,
    decide,
    rank_floor,
)
from ray_moe.driver.loop import LoopSignals


@dataclass(frozen=True)
class ScalerHooks:
    """What the scaler reads and does, as callables (``RankScaler.for_reconciler`` binds them to the coordinator's
    loop; a test
    may inject its own). ``sample``: the load now; ``ranks``: live rank ids; ``floor``: the fewest ranks allowed
    (``control.scaling.rank_floor``); ``add_rank() -> new rank``; ``remove_rank(rank)``; ``bundle``: one new
    shard's resources ({"CPU": c, "GPU": 1}); ``free``: the cluster's available resources; ``request``: ask the
    autoscaler for bundles (None: a local instance, nothing to ask); ``busy``: another change is under way
    (the loop converging: a dead rank being replaced)."""

    sample: Callable[[], LoopSignals]
    ranks: Callable[[], list[int]]
    floor: Callable[[], int]
    add_rank: Callable[[], int]
    remove_rank: Callable[[int], Any]
    bundle: dict[str, float]
    free: Callable[[], dict[str, float]]
    request: Callable[[list[dict[str, float]]], None] | None = None
    busy: Callable[[], bool] = lambda: False


class RankScaler:
    """A daemon thread that samples ``hooks.sample`` every ``policy.tick_s``, decides (``control.scaling``) and
    acts. ``events``: one dict per decision (``ScalingDecision.as_dict``) plus its outcome: ``done`` (the change
    was made: ``rank`` added or removed, ``seconds`` it took), ``error`` (it failed), or ``reason`` =
    ``no_resources`` with ``requested`` (the autoscaler was asked for the bundle)."""

    def __init__(self, policy: ScalingPolicy, hooks: ScalerHooks, *, clock: Callable[[], float] = time.monotonic,
                 start: bool = True) -> None:
        self.policy = policy
        self.hooks = hooks
        self.clock = clock
        self.events: deque[dict[str, Any]] = deque(maxlen=policy.history)
        self.started = clock()
        # the start counts as a change: no scale-in (nor anything else) within the cooldown of it
        self.last_change: Change | None = Change(self.started, ScaleAction.HOLD)
        self._steps: tuple[int, float] | None = None  # (steps, when) at the last sample
        self._work_at = self.started  # when the step count last moved
        self._requested = False  # a standing autoscaler request is out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-moe-scaler", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def for_reconciler(cls, loop: Any, *, autoscale: bool = False) -> "RankScaler":
        """The scaler of a deployment's coordinator (``RuntimeConfig.scaling``), ticked by its reconcile loop: the
        signals are what the drivers' generation loops report (``DriverRoster.load``), a change asks the loop for a
        new target (``Reconciler.ask_add`` / ``ask_remove``); ``autoscale``: a cluster Ray did not start here is
        asked for the bundle when none is free."""
        cfg = loop.cfg

        def sample() -> LoopSignals:
            x = loop.roster.load()
            return LoopSignals(waiting=x.waiting, running=x.running, oldest_wait_s=x.oldest_wait_s, steps=x.steps,
                               since_work_s=x.since_work_s)

        def floor() -> int:
            return rank_floor(cfg.scaling, num_experts=cfg.num_experts, num_layers=cfg.num_layers,
                              slots_per_rank=cfg.slots_per_rank, floors=loop.hooks.plane().floor_list())

        bundle = {"CPU": float(cfg.actor_cpus), **({"GPU": 1.0} if cfg.device == "cuda" else {})}

        def free() -> dict[str, float]:  # a free bundle of the deployment's own counts as room
            return dict(bundle) if loop.free_bundle() is not None else ray.available_resources()

        hooks = ScalerHooks(sample=sample, ranks=lambda: list(loop.hooks.plane().group.peer_order), floor=floor,
                            add_rank=lambda: loop.ask_add(set_by="scaler"),
                            remove_rank=lambda r: loop.ask_remove(r, set_by="scaler"), bundle=bundle, free=free,
                            request=request_bundles if autoscale else None, busy=lambda: not loop.converged)
        return cls(cfg.scaling, hooks, start=False)

    def status(self) -> dict[str, Any]:
        """The policy and the decisions kept (``policy.history``) with their outcomes (JSON-able)."""
        return {"policy": self.policy.model_dump(mode="json"), "events": list(self.events)}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=120)  # (a change under way finishes first)

    # ------------------------------------------------------------------ one tick
    def signals(self) -> ScalingSignals:
        """Sample the load: steps/s since the last sample, idle time clamped to the scaler's own life."""
        raw = self.hooks.sample()
        now = self.clock()
        rate = 0.0
        if self._steps is not None and now > self._steps[1]:
            rate = max(0, raw.steps - self._steps[0]) / (now - self._steps[1])
        if self._steps is not None and raw.steps != self._steps[0]:
            self._work_at = now  # steps ran since the last sample
        self._steps = (raw.steps, now)
        since = now - self._work_at
        if raw.since_work_s is not None:
            since = min(since, raw.since_work_s)
        return ScalingSignals(oldest_wait_s=float(raw.oldest_wait_s), waiting=int(raw.waiting),
                              running=int(raw.running), steps_per_s=float(rate), since_work_s=max(0.0, since))

    def tick(self) -> dict[str, Any] | None:
        """Sample, decide, act; returns the event recorded (None: the healer is busy, nothing decided)."""
        if self.hooks.busy():
            return None
        sig = self.signals()
        ranks = self.hooks.ranks()
        d = decide(sig, len(ranks), self.clock(), self.last_change, policy=self.policy, floor=self.hooks.floor())
        event = d.as_dict()
        if d.action is ScaleAction.ADD:
            event.update(self._add(d))
        elif d.action is ScaleAction.REMOVE:
            event.update(self._remove(max(ranks)))
        self.events.append(event)
        return event

    def _add(self, d: ScalingDecision) -> dict[str, Any]:
        free = self.hooks.free()
        missing = {k: v for k, v in self.hooks.bundle.items() if free.get(k, 0.0) < v}
        if missing:
            requested = False
            if self.hooks.request is not None:
                try:
                    self.hooks.request([self.hooks.bundle])
                    requested = self._requested = True
                except Exception:  # noqa: BLE001 - recorded; the next tick asks again
                    pass
            return {"reason": ScaleReason.NO_RESOURCES.value, "done": False, "requested": requested,
                    "missing": missing}
        return self._change(ScaleAction.ADD, self.hooks.add_rank)

    def _remove(self, rank: int) -> dict[str, Any]:
        out = self._change(ScaleAction.REMOVE, lambda: (self.hooks.remove_rank(rank), rank)[1])
        if out["done"] and self._requested and self.hooks.request is not None:
            try:  # drop the standing request, so the autoscaler may take the freed node back
                self.hooks.request([])
                self._requested = False
            except Exception:  # noqa: BLE001 - best effort
                pass
        return out

    def _change(self, action: ScaleAction, fn: Callable[[], int]) -> dict[str, Any]:
        t0 = self.clock()
        try:
            rank = fn()
        except Exception as exc:  # noqa: BLE001 - recorded; the cooldown spaces the next attempt
            self.last_change = Change(self.clock(), action)
            return {"done": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        self.last_change = Change(self.clock(), action)
        self._work_at = max(self._work_at, self.last_change.t)  # a fresh rank is not idle from before it
        return {"done": True, "rank": int(rank), "seconds": round(self.clock() - t0, 3)}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.wait(self.policy.tick_s):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - a deployment shutting down; the thread keeps trying
                self.events.append({"error": f"{type(exc).__name__}: {exc}"[:300], "t": self.clock()})


def request_bundles(bundles: list[dict[str, float]]) -> None:
    """Ask a cluster's autoscaler for ``bundles`` (an empty list drops the standing request)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


__all__ = ["RankScaler", "ScalerHooks", "request_bundles"]
