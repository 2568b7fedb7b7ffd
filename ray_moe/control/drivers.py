# ======================================================================================================
#  THE DRIVERS THAT STEP A DEPLOYMENT, AND THE FENCE A MEMBERSHIP CHANGE RAISES (pure: no Ray)
#
#   every driver's follower thread polls the coordinator (watch) ──> heard(driver, its load, stepping?)
#   a membership change ──> raise_fence(): every stepping driver heard within the lease must quiesce:
#     its follower takes the driver's step gate (no step in flight), then ack()s; a driver recovering a dead rank
#     is quiesced already (quiesced())  ──> wait_acks(): all acked, or evicted (silent past the lease, or the
#     fence's deadline passed) ──> the group changes ──> lower(epoch): the drivers adopt the new membership
#   load(): the sum of what the drivers' generation loops report (the scaler's signals)
# ======================================================================================================
"""DriverRoster: the drivers of one deployment as the coordinator sees them (``ray_moe.ray.reconciler``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class DriverLoad:
    """What a driver's generation loop reports (its ``LoopSignals``; a driver without one: its forward steps):
    requests waiting / running, the oldest wait (seconds), steps so far, seconds since its last step with work."""

    waiting: int = 0
    running: int = 0
    oldest_wait_s: float = 0.0
    steps: int = 0
    since_work_s: float | None = None


@dataclass
class _Driver:
    heard: float
    stepping: bool = False
    load: DriverLoad | None = None
    quiesced: bool = False  # recovering a dead rank: holds its step gate until the change is done


@dataclass
class Fence:
    """One membership change's fence: the drivers expected to quiesce, those that did, those evicted."""

    fence_id: int
    expected: frozenset[str]
    acked: set[str] = field(default_factory=set)
    evicted: set[str] = field(default_factory=set)
    lowered: bool = False


class DriverRoster:
    """``lease_s``: a driver not heard from for this long is gone (no fence waits for it, its load no longer
    counts); ``clock``: monotonic seconds."""

    def __init__(self, *, lease_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = float(lease_s)
        self.clock = clock
        self._drivers: dict[str, _Driver] = {}
        self._cv = threading.Condition()
        self._fence: Fence | None = None
        self._fences = 0
        self.epoch = 0  # the membership epoch drivers follow (the process group's)
        self.evictions: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ drivers
    def heard(self, driver: str, *, load: DriverLoad | None = None, stepping: bool = False) -> None:
        with self._cv:
            d = self._drivers.setdefault(driver, _Driver(heard=self.clock()))
            d.heard = self.clock()
            if stepping and not d.stepping and self._fence is not None and not self._fence.lowered:
                self._fence.expected = self._fence.expected | {driver}  # it steps from now on: it quiesces too
            d.stepping = d.stepping or stepping
            if load is not None:
                d.load = load

    def leave(self, driver: str) -> None:
        with self._cv:
            self._drivers.pop(driver, None)
            if self._fence is not None:
                self._fence.acked.add(driver)
            self._cv.notify_all()

    def _alive(self, d: _Driver, now: float) -> bool:
        return now - d.heard <= self.lease_s

    def drivers(self) -> dict[str, dict[str, Any]]:
        now = self.clock()
        with self._cv:
            return {k: {"stepping": d.stepping, "heard_s_ago": round(now - d.heard, 3), "alive": self._alive(d, now)}
                    for k, d in self._drivers.items()}

    def load(self) -> DriverLoad:
        """The drivers' loads together: waiting, running and steps summed, the longest wait, the shortest idle."""
        now = self.clock()
        with self._cv:
            loads = [d.load for d in self._drivers.values() if d.load is not None and self._alive(d, now)]
        idle = [x.since_work_s for x in loads if x.since_work_s is not None]
        return DriverLoad(waiting=sum(x.waiting for x in loads), running=sum(x.running for x in loads),
                          oldest_wait_s=max((x.oldest_wait_s for x in loads), default=0.0),
                          steps=sum(x.steps for x in loads), since_work_s=min(idle) if idle else None)

    # ------------------------------------------------------------------ the fence
    def raise_fence(self) -> Fence:
        """A membership change begins: the stepping drivers heard within the lease must quiesce."""
        now = self.clock()
        with self._cv:
            self._fences += 1
            expected = frozenset(k for k, d in self._drivers.items() if d.stepping and self._alive(d, now))
            self._fence = Fence(self._fences, expected, {k for k in expected if self._drivers[k].quiesced})
            self._cv.notify_all()
            return self._fence

    def pending_fence(self, driver: str) -> int | None:
        """The fence ``driver`` must still acknowledge (None: none)."""
        with self._cv:
            f = self._fence
            return None if f is None or f.lowered or driver in f.acked else f.fence_id

    def ack(self, driver: str, fence_id: int) -> None:
        with self._cv:
            if self._fence is not None and self._fence.fence_id == fence_id:
                self._fence.acked.add(driver)
                self._cv.notify_all()

    def quiesced(self, driver: str, on: bool) -> None:
        """``driver`` holds its step gate while it waits for a change (a dead rank it reported): it counts as
        acknowledged for any fence raised meanwhile."""
        with self._cv:
            d = self._drivers.setdefault(driver, _Driver(heard=self.clock()))
            d.quiesced, d.heard = on, self.clock()
            if on and self._fence is not None:
                self._fence.acked.add(driver)
            self._cv.notify_all()

    def wait_acks(self, fence: Fence, timeout_s: float) -> set[str]:
        """Until every expected driver acknowledged ``fence`` or is evicted (not heard within the lease, or still
        silent at ``timeout_s``); returns the evicted (they recover by themselves once they step again)."""
        deadline = self.clock() + timeout_s
        with self._cv:
            while True:
                now = self.clock()
                missing = {k for k in fence.expected - fence.acked
                           if k in self._drivers and self._alive(self._drivers[k], now)}
                if not missing or now >= deadline:
                    break
                self._cv.wait(min(0.5, max(0.0, deadline - now)))
            fence.evicted = set(fence.expected) - fence.acked
            for k in fence.evicted:
                self.evictions.append({"driver": k, "fence": fence.fence_id, "t": now})
                d = self._drivers.get(k)
                if d is not None:
                    d.stepping = False  # waited for again once it steps (its next poll says so)
            return set(fence.evicted)

    def lower(self, fence: Fence, epoch: int) -> None:
        """The change is done (or abandoned): the drivers adopt membership ``epoch``."""
        with self._cv:
            fence.lowered = True
            self.epoch = max(self.epoch, int(epoch))
            if self._fence is fence:
                self._fence = None
            self._cv.notify_all()

    def wait(self, driver: str, known_epoch: int, timeout_s: float, *, fence_id: int | None = None) -> dict[str, Any]:
        """Block until ``driver`` has something to do: a fence to acknowledge (``{"fence": id}``), a membership past
        ``known_epoch`` (``{"epoch": e}``), or ``timeout_s`` passed. With ``fence_id``: until that fence is lowered."""
        deadline = self.clock() + timeout_s
        with self._cv:
            while True:
                f = self._fence
                if fence_id is None:
                    if f is not None and not f.lowered and driver not in f.acked and driver in f.expected:
                        return {"fence": f.fence_id, "epoch": self.epoch}
                    if self.epoch > known_epoch:
                        return {"fence": None, "epoch": self.epoch}
                elif f is None or f.fence_id != fence_id or f.lowered:
                    return {"fence": None, "epoch": self.epoch}
                left = deadline - self.clock()
                if left <= 0:
                    return {"fence": None, "epoch": self.epoch, "timeout": True}
                self._cv.wait(min(left, 1.0))

    def fence_status(self) -> dict[str, Any] | None:
        with self._cv:
            f = self._fence
            return None if f is None else {"fence": f.fence_id, "expected": sorted(f.expected),
                                           "acked": sorted(f.acked)}


__all__ = ["DriverLoad", "DriverRoster", "Fence"]
