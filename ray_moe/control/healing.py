# ======================================================================================================
#  SELF-HEALING RANKS: THE POLICY (pure: the coordinator's loop acts on it)
#
#   a rank found dead ──> lost(rank): healing on and its line not exhausted? a replacement is wanted (the target
#   keeps its rank count) : left out (the loop lowers the target by one, with the reason)
#   ──> due(now): lost ranks whose next attempt may start ──> the loop starts one (the lost rank's bundle while its
#   node lives) ──> started(lost, new) | failed(lost, error): retried with backoff, left out after ``retries``
# ======================================================================================================
"""HealPolicy: which dead ranks get a replacement, when the next attempt may start, and when a line is left out
(``RuntimeConfig.heal_retries``). No thread and no Ray: ``ray_moe.ray.reconciler`` asks it and acts."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class _Pending:
    since: float  # when the loss was taken in
    attempts: int = 0
    next_at: float = 0.0


class HealPolicy:
    """``retries``: start attempts per lost rank, and the replacements a line (a rank and the ranks that replaced
    it) may lose before it is left out; 0: healing off (every loss is left out). ``backoff_s``: the wait after
    failed attempt n is ``backoff_s * 2 ** (n - 1)``.

    ``events``: one dict per outcome: {"lost", "replacement", "attempts", "seconds"} (healed: seconds from the loss
    to the replacement serving), {"lost", "attempt", "error"} (a failed start) or {"lost", "left_out": True,
    "reason"}."""

    def __init__(self, retries: int, *, backoff_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 history: int = 256) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries={retries!r}: an integer >= 0 (0: healing off)")
        if backoff_s < 0:
            raise ValueError(f"backoff_s={backoff_s!r}: must be >= 0")
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.clock = clock
        self.events: deque[dict[str, Any]] = deque(maxlen=history)
        self._lineage: dict[int, int] = {}  # rank -> the first rank of its line
        self._losses: dict[int, int] = {}  # line root -> replacements it lost
        self._pending: dict[int, _Pending] = {}  # lost rank -> its replacement's progress

    @property
    def enabled(self) -> bool:
        return self.retries > 0

    @property
    def healing(self) -> bool:
        """A replacement is wanted and not started yet."""
        return bool(self._pending)

    def lineage(self, rank: int) -> int:
        return self._lineage.get(rank, rank)

    def lost(self, rank: int) -> bool:
        """``rank`` was found dead. True: a replacement is wanted (``due`` names it); False: it is left out (an
        event says why; the caller lowers the target)."""
        rank = int(rank)
        if rank in self._pending:
            return True
        if not self.enabled:
            self.events.append({"lost": rank, "left_out": True, "reason": "healing is off (heal_retries=0)"})
            return False
        root = self.lineage(rank)
        self._losses[root] = self._losses.get(root, 0) + 1
        if self._losses[root] > self.retries:
            self.events.append({"lost": rank, "left_out": True,
                                "reason": f"its line lost {self._losses[root]} shards (heal_retries={self.retries})"})
            return False
        now = self.clock()
        self._pending[rank] = _Pending(since=now, next_at=now)
        return True

    def due(self) -> tuple[int, ...]:
        """Lost ranks whose next attempt may start now, the oldest loss first."""
        now = self.clock()
        return tuple(r for r, p in sorted(self._pending.items(), key=lambda kv: kv[1].since) if p.next_at <= now)

    def attempt(self, rank: int) -> int:
        """The number of the attempt about to start for ``rank`` (1 first)."""
        return self._pending[rank].attempts + 1

    def started(self, rank: int, new: int) -> None:
        """The replacement ``new`` of ``rank`` serves."""
        p = self._pending.pop(rank)
        self._lineage[int(new)] = self.lineage(rank)
        self.events.append({"lost": rank, "replacement": int(new), "attempts": p.attempts + 1,
                            "seconds": round(self.clock() - p.since, 3)})

    def failed(self, rank: int, error: str) -> bool:
        """An attempt for ``rank`` failed: True when it is retried later (``due`` after its backoff), False when
        the line is left out now (the caller lowers the target)."""
        p = self._pending[rank]
        p.attempts += 1
        self.events.append({"lost": rank, "attempt": p.attempts, "error": str(error)[:300]})
        if p.attempts >= self.retries:
            del self._pending[rank]
            self.events.append({"lost": rank, "left_out": True, "reason": f"{self.retries} start attempts failed"})
            return False
        p.next_at = self.clock() + self.backoff_s * 2 ** (p.attempts - 1)
        return True

    def forget(self, rank: int) -> None:
        """``rank``'s replacement is no longer wanted (the target lowered meanwhile)."""
        self._pending.pop(rank, None)

    def status(self) -> dict[str, Any]:
        return {"retries": self.retries, "healing": sorted(self._pending), "events": list(self.events)}


__all__ = ["HealPolicy"]
