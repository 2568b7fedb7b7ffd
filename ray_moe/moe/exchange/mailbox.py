"""A thread-safe mailbox keyed by (tag, source peer, destination peer), with a watchdog and abort.

Shared by the in-process backend and the Ray object-store backend (where peers ``deliver`` into the
receiving actor's mailbox through actor calls).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ray_moe.core.errors import ExchangeTimeoutError, RayMoEError


class ExchangeAborted(RayMoEError):
    """The step was aborted from outside (a peer died, or the driver cancelled it)."""


class Mailbox:
    def __init__(self) -> None:
        self._items: dict[tuple[str, int, int], Any] = {}
        self._aborted: dict[str, str] = {}  # step prefix -> reason
        self._cv = threading.Condition()

    def put(self, key: tuple[str, int, int], value: Any) -> None:
        with self._cv:
            if key in self._items:
                raise RuntimeError(f"exchange tag {key[0]!r} reused from peer {key[1]} to peer {key[2]}")
            self._items[key] = value
            self._cv.notify_all()

    def abort(self, prefix: str, reason: str) -> None:
        """Make every current and future wait on a tag starting with ``prefix`` raise ``ExchangeAborted``."""
        with self._cv:
            self._aborted[prefix] = reason
            for key in [k for k in self._items if k[0].startswith(prefix)]:
                del self._items[key]
            self._cv.notify_all()

    def forget(self, prefix: str) -> None:
        """Drop leftovers and the abort mark of a finished step."""
        with self._cv:
            self._aborted.pop(prefix, None)
            for key in [k for k in self._items if k[0].startswith(prefix)]:
                del self._items[key]

    def _aborted_reason(self, tag: str) -> str | None:
        for prefix, reason in self._aborted.items():
            if tag.startswith(prefix):
                return reason
        return None

    def take(self, keys: list[tuple[str, int, int]], timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        tag = keys[0][0]
        with self._cv:
            while True:
                reason = self._aborted_reason(tag)
                if reason is not None:
                    raise ExchangeAborted(f"exchange {tag!r} aborted: {reason}")
                if all(k in self._items for k in keys):
                    return [self._items.pop(k) for k in keys]
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [k[1] for k in keys if k not in self._items]
                    raise ExchangeTimeoutError(
                        f"exchange {tag!r}: no message from peer slot(s) {missing} within {timeout:.1f}s"
                    )
                self._cv.wait(timeout=left)
