"""The drivers' roster and the fence a membership change raises (``control/drivers.py``), without Ray: which drivers
a fence waits for, acknowledgements, drivers quiesced by their own recovery, eviction past the lease, the long poll,
and the load the scaler reads (every driver's generation loop summed)."""

from __future__ import annotations

import threading
import time

from ray_moe.control.drivers import DriverLoad, DriverRoster


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_fence_waits_for_stepping_drivers_only_and_counts_a_quiesced_one():
    r = DriverRoster(lease_s=10.0)
    r.heard("a", stepping=True)
    r.heard("b", stepping=True)
    r.heard("status-cli")  # polls, never steps: never waited for
    r.quiesced("b", True)  # b recovers a dead rank, holding its step gate
    f = r.raise_fence()
    assert f.expected == {"a", "b"} and f.acked == {"b"}
    assert r.wait("a", 0, 1.0) == {"fence": f.fence_id, "epoch": 0}
    assert r.wait("status-cli", 0, 0.05)["timeout"]  # nothing for it to do
    threading.Timer(0.05, lambda: r.ack("a", f.fence_id)).start()
    t0 = time.monotonic()
    assert r.wait_acks(f, 5.0) == set() and time.monotonic() - t0 < 2.0
    r.lower(f, 3)
    assert r.wait("a", 0, 1.0) == {"fence": None, "epoch": 3}  # adopt epoch 3
    assert r.wait("a", 3, 0.0)["timeout"] and r.fence_status() is None


def test_a_silent_driver_is_evicted_and_a_driver_that_starts_stepping_mid_fence_is_waited_for():
    clock = Clock()
    r = DriverRoster(lease_s=5.0, clock=clock)
    r.heard("gone", stepping=True)
    clock.t = 6.0  # its process died: nothing heard for longer than the lease
    r.heard("live", stepping=True)
    f = r.raise_fence()
    assert f.expected == {"live"}
    r.heard("late", stepping=True)  # its first step comes while the fence is up: it must quiesce too
    assert f.expected == {"live", "late"}
    r.ack("live", f.fence_id)
    assert r.wait_acks(f, 0.0) == {"late"}  # the deadline passed: evicted (it recovers once it steps again)
    assert r.evictions[-1]["driver"] == "late" and not r.drivers()["late"]["stepping"]
    r.lower(f, 1)
    assert r.pending_fence("late") is None


def test_the_load_is_every_live_drivers_load_together():
    clock = Clock()
    r = DriverRoster(lease_s=5.0, clock=clock)
    r.heard("replica", load=DriverLoad(waiting=3, running=2, oldest_wait_s=1.5, steps=40, since_work_s=0.2))
    r.heard("user", load=DriverLoad(waiting=1, running=0, oldest_wait_s=4.0, steps=2, since_work_s=9.0))
    r.heard("cli")
    assert r.load() == DriverLoad(waiting=4, running=2, oldest_wait_s=4.0, steps=42, since_work_s=0.2)
    clock.t = 6.0
    r.heard("replica", load=DriverLoad(steps=41, since_work_s=3.0))
    assert r.load() == DriverLoad(waiting=0, running=0, oldest_wait_s=0.0, steps=41, since_work_s=3.0)  # user expired
    r.leave("replica")
    assert r.load() == DriverLoad()
