"""Python's cyclic garbage collector on a serving process: its pauses counted, the long-lived heap frozen.

A full (generation-2) collection walks every tracked object of the process: a shard or driver holding torch,
transformers and Ray has ~0.4 M of them after imports, and one full collection takes ~0.2 s on a CPU core
(measured on this project's 2-core CI VM). Run between two launches it leaves the GPU idle for that long.
``GcPauses.freeze`` moves the objects alive now (the model, its modules, captured graphs' Python state) into the
collector's permanent generation (``gc.freeze``, as vLLM and SGLang do after start): later collections walk only
what was allocated since. The pauses are counted through ``gc.callbacks`` (MEASURED: every collection of this
process, on whichever thread it ran, with its generation and wall time).

``GcPauses.defer_to_safe_points`` (with the freeze, on CUDA) moves the young collections off the launch path:
Python's own policy collects whenever 700 more tracked objects are alive, in the middle of whatever allocates,
and a step of ~1,000 sequences allocates many times that. Deferred, automatic collections wait for
``SAFETY_NET`` objects, and ``safe_point`` (called right after a step is launched, while the device runs it)
collects once ``YOUNG_AT_SAFE_POINT`` have accumulated, in the generation CPython's thresholds name.
"""

from __future__ import annotations

import gc
import time
from typing import Any


YOUNG_AT_SAFE_POINT = 20_000  # net new tracked objects that make a safe point collect
SAFETY_NET = 200_000  # automatic collections (between safe points) only past this many


class GcPauses:
    """This process's collections, counted while installed (``install`` / ``close``); ``freeze`` after start.

    counters(): ``gc_collections`` (all generations), ``gc_full_collections`` (generation 2), ``gc_pause_us`` (their
    summed wall time), ``gc_pause_max_us`` (the longest one), ``gc_frozen_objects`` (the permanent generation's size
    at the last ``freeze``), ``gc_freezes``, ``gc_safe_point_collections`` (those ``safe_point`` ran: the rest ran
    wherever Python's policy struck)."""

    def __init__(self) -> None:
        self._counts = {"gc_collections": 0, "gc_full_collections": 0, "gc_pause_us": 0, "gc_pause_max_us": 0,
                        "gc_frozen_objects": 0, "gc_freezes": 0, "gc_safe_point_collections": 0}
        self._began: float | None = None
        self._installed = False
        self._saved: tuple[int, int, int] | None = None  # the thresholds before ``defer_to_safe_points``
        self._young = 0

    def install(self) -> "GcPauses":
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def close(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False
        if self._saved is not None:  # Python's own policy again
            gc.set_threshold(*self._saved)
            self._saved, self._young = None, 0

    def defer_to_safe_points(self, young: int = YOUNG_AT_SAFE_POINT, safety: int = SAFETY_NET) -> None:
        """Young collections at ``safe_point`` once ``young`` tracked objects accumulated; automatic ones only past
        ``safety`` (a process that stops calling ``safe_point`` still collects). ``close`` restores the thresholds."""
        if young < 1 or safety < young:
            raise ValueError(f"young={young}, safety={safety}: need 1 <= young <= safety")
        if self._saved is None:
            self._saved = gc.get_threshold()
        gc.set_threshold(safety, *self._saved[1:])
        self._young = young

    def safe_point(self) -> int | None:
        """Collect here if ``defer_to_safe_points`` is on and ``young`` objects accumulated: the oldest generation
        whose count passed its threshold (CPython's own choice; a full collection's extra condition aside).
        Returns the generation collected, or None."""
        if not self._young:
            return None
        c0, c1, c2 = gc.get_count()
        if c0 < self._young:
            return None
        _, t1, t2 = gc.get_threshold()
        gen = 2 if c2 > t2 else 1 if c1 > t1 else 0
        self._counts["gc_safe_point_collections"] += 1
        gc.collect(gen)
        return gen

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # 1. "start": note the time; 2. "stop": count the collection and its pause
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:
            return
        us = int((time.perf_counter() - self._began) * 1e6)
        self._began = None
        c = self._counts
        c["gc_collections"] += 1
        c["gc_full_collections"] += int(info.get("generation") == 2)
        c["gc_pause_us"] += us
        c["gc_pause_max_us"] = max(c["gc_pause_max_us"], us)

    def freeze(self, collect: bool = True) -> int:
        """Collect once (``collect``: the start's garbage is not frozen), then freeze every object alive now.
        Returns the permanent generation's size."""
        if collect:
            gc.collect()
        gc.freeze()
        self._counts["gc_freezes"] += 1
        self._counts["gc_frozen_objects"] = gc.get_freeze_count()
        return self._counts["gc_frozen_objects"]

    def counters(self) -> dict[str, int]:
        return dict(self._counts)


__all__ = ["GcPauses"]
