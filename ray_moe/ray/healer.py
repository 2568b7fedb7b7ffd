# ======================================================================================================
#  SELF-HEALING RANKS (the driver side of a deployment)
#
#   a step finds a shard dead ──> RayTransport.handle_dead: survivors regrouped, the dead rank's sequences
#   re-prefilled, a generation without it published (serving goes on one rank short)
#   ──> RankHealer.lost(rank): queued ──> its thread, between steps: Runtime.add_rank() (a new actor on a
#   fresh bundle, its experts loaded, a new process-group epoch, EPLB onto it once load is observed)
#   ──> back to full strength; a failed start is retried (bounded, with backoff); a lineage whose
#   replacements keep dying is left out with an event
# ======================================================================================================
"""RankHealer: replaces dead shards without an operator (``RuntimeConfig.heal_retries`` > 0)."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any, Callable


class RankHealer:
    """``add_rank() -> new rank id`` starts one replacement; ``retries``: start attempts per lost rank, and the
    replacements a lineage (a rank and the ranks that replaced it) may lose before it is left out;
    ``backoff_s``: the wait before attempt n is ``backoff_s * 2 ** (n - 1)``.

    ``events``: one dict per outcome: {"lost", "replacement", "attempts", "seconds"} (healed: seconds from the
    loss being handled to the replacement serving), {"lost", "attempt", "error"} (a failed start) or
    {"lost", "left_out": True, "reason"}."""

    def __init__(self, add_rank: Callable[[], int], *, retries: int, backoff_s: float = 0.5) -> None:
        if retries < 1:
            raise ValueError(f"retries={retries}: a healer needs at least one attempt")
        self.add_rank = add_rank
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.events: deque[dict[str, Any]] = deque(maxlen=256)
        self._lineage: dict[int, int] = {}  # rank -> the first rank of its line
        self._losses: dict[int, int] = {}  # lineage root -> replacements it lost
        self._todo: queue.Queue[tuple[int, float] | None] = queue.Queue()
        self._busy = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-moe-healer", daemon=True)
        self._thread.start()

    def lost(self, ranks: Any) -> None:
        """Ranks the transport just removed (called with the step lock held: only queued here)."""
        now = time.monotonic()
        for r in ranks:
            self._busy.set()
            self._todo.put((int(r), now))

    @property
    def healing(self) -> bool:
        """A loss is queued or a replacement is starting."""
        return self._busy.is_set()

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            self._heal(*item)
            if self._todo.empty():
                self._busy.clear()

    def _heal(self, rank: int, since: float) -> None:
        root = self._lineage.get(rank, rank)
        self._losses[root] = self._losses.get(root, 0) + 1
        if self._losses[root] > self.retries:
            self.events.append({"lost": rank, "left_out": True,
                                "reason": f"its line lost {self._losses[root]} shards (heal_retries={self.retries})"})
            return
        for attempt in range(1, self.retries + 1):
            if attempt > 1:
                time.sleep(self.backoff_s * 2 ** (attempt - 2))
            try:
                new = self.add_rank()
            except Exception as exc:  # noqa: BLE001 - retried, then left out with the reason
                self.events.append({"lost": rank, "attempt": attempt, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            self._lineage[new] = root
            self.events.append({"lost": rank, "replacement": new, "attempts": attempt,
                                "seconds": round(time.monotonic() - since, 3)})
            return
        self.events.append({"lost": rank, "left_out": True, "reason": f"{self.retries} start attempts failed"})


__all__ = ["RankHealer"]
