# ======================================================================================================
#  A DRIVER FOLLOWS THE DEPLOYMENT'S MEMBERSHIP (it never changes it)
#
#   its thread: coordinator.watch(driver, epoch, its load, stepping?) every poll_s (a long poll)
#     {"fence": f}  a membership change is under way ──> take the driver's step gate (a pipelined generation loop
#                   drains: no step in flight) ──> fence_ack (waits until the change is done) ──> adopt the view
#     {"view": v}   the membership moved on ──> adopt it (under the gate)
#   a step that finds a rank dead (the stepping thread holds the gate) ──> report_dead: coordinator.rank_lost
#   (waits until the dead are regrouped away) ──> adopt ──> the step runs again on the survivors
# ======================================================================================================
"""MembershipFollower: one per driver (``ray_moe.Runtime``), beside its ``RayTransport``."""

from __future__ import annotations

import atexit
import threading
import time
import uuid
import weakref
from typing import Any, Callable

import ray

from ray_moe.control.drivers import DriverLoad
from ray_moe.ray.remote import call

_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError,
         TimeoutError)
GIVE_UP_S = 120.0  # a coordinator that has not answered for this long is gone for good: the thread stops


class MembershipFollower:
    """``transport``: the driver's ``RayTransport`` (``gate``, ``epoch``, ``adopt``); ``load``: what the driver
    reports with every poll (its generation loop's signals, else its forward steps); ``poll_s``: the longest a poll
    waits (the load reaches the coordinator at least this often). It holds the driver weakly: a driver dropped
    without ``close`` stops its follower at the next poll (and leaves the coordinator's roster)."""

    def __init__(self, coordinator: Any, transport: Any, *, load: Callable[[], DriverLoad | None],
                 poll_s: float = 1.0) -> None:
        self.coordinator = coordinator
        self._transport = weakref.ref(transport)
        self._load_fn = weakref.WeakMethod(load) if hasattr(load, "__self__") else (lambda: load)
        self.poll_s = float(poll_s)
        self.id = f"driver-{uuid.uuid4().hex[:10]}"
        self.stepping = False  # told the coordinator it steps (then every fence waits for it)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-moe-follower", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a driver process that ends leaves the roster (before Ray's own exit hook)

    @property
    def transport(self) -> Any:
        tr = self._transport()
        if tr is None:
            raise ReferenceError("the driver is gone")
        return tr

    def _load(self) -> DriverLoad | None:
        try:
            fn = self._load_fn()
            return None if fn is None else fn()
        except Exception:  # noqa: BLE001 - a load that cannot be read is not reported this time
            return None

    def _run(self) -> None:
        backoff, since_ok = 0.05, time.monotonic()
        while not self._stop.is_set():
            if not ray.is_initialized():  # this process left Ray (a call now would start a fresh local instance)
                return
            try:
                epoch = self.transport.epoch
                # waited on as a future, not with ray.get: a process that shuts Ray down while a poll is in flight
                # must not have this thread touch the stopped core worker (Ray would end the process)
                ref = self.coordinator.watch.remote(self.id, epoch, self._load(), self.stepping, self.poll_s)
                out = ref.future().result(timeout=self.poll_s + 60)
                self._act(out, gated=False)
                backoff, since_ok = 0.05, time.monotonic()
            except ReferenceError:  # the driver was dropped without close
                self.close()
                return
            except _GONE:  # the coordinator restarts, or is gone for good (its deployment shut down)
                self.errors += 1
                if time.monotonic() - since_ok > GIVE_UP_S or _dead_for_good(self.coordinator):
                    return
                self._stop.wait(backoff)
                backoff = min(2.0, backoff * 2)
            except Exception:  # noqa: BLE001 - never let the thread die; the next poll tries again
                self.errors += 1
                self._stop.wait(backoff)

    def _act(self, out: dict[str, Any], *, gated: bool) -> None:
        if self._stop.is_set():
            return
        if out.get("fence") is not None:
            if gated:  # the caller holds the gate already
                self.transport.adopt(call(self.coordinator.fence_ack.remote(self.id, out["fence"])))
            else:
                with self.transport.gate:  # quiesced: no step in flight until the change is done
                    self.transport.adopt(call(self.coordinator.fence_ack.remote(self.id, out["fence"])))
        elif out.get("view") is not None:
            if gated:
                self.transport.adopt(out["view"])
            else:
                with self.transport.gate:
                    self.transport.adopt(out["view"])

    def join(self) -> None:
        """The driver is about to step for the first time (its stepping thread holds the gate): from now on every
        fence waits for it; a change under way is waited out first."""
        if self.stepping:
            return
        self.stepping = True
        out = call(self.coordinator.watch.remote(self.id, self.transport.epoch, self._load(), True, 0.0))
        self._act(out, gated=True)

    def report_dead(self, ranks: list[int]) -> None:
        """A step found ``ranks`` dead (the caller holds the gate): back once they are regrouped away."""
        self.transport.adopt(call(self.coordinator.rank_lost.remote(self.id, [int(r) for r in ranks])))

    def close(self) -> None:
        """Stop following; the coordinator forgets this driver (no fence waits for it)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():  # its poll in flight ends first (Ray may stop next)
            self._thread.join(timeout=self.poll_s + 5)
        if not ray.is_initialized():
            return
        try:
            ray.get(self.coordinator.leave.remote(self.id), timeout=5)
        except Exception:  # noqa: BLE001 - the deployment is gone already
            pass


def _dead_for_good(actor: Any) -> bool:
    """Whether the GCS says ``actor`` is DEAD (not restarting): its deployment was shut down."""
    try:
        from ray._private import state

        return (state.actors(actor._actor_id.hex()) or {}).get("State") == "DEAD"
    except Exception:  # noqa: BLE001 - private API: unknown, keep trying
        return False


__all__ = ["MembershipFollower"]
