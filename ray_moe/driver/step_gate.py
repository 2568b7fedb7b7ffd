"""The driver's step lock: held across steps by a pipelined generation loop, taken by operations that need
no step in flight (rank changes, expert-only steps)."""

from __future__ import annotations

import threading
from typing import Any


class StepGate:
    """The step lock (re-entrant) with a signal that another thread waits for it: a pipelined generation loop
    holds it across consecutive steps and drains (no step in flight) as soon as ``contended``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._meta = threading.Lock()
        self._waiting = 0

    @property
    def contended(self) -> bool:
        return self._waiting > 0

    def __enter__(self) -> "StepGate":
        with self._meta:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._meta:
                self._waiting -= 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


__all__ = ["StepGate"]
