"""Python's cyclic garbage collector on a serving process: its pauses counted, the long-lived heap frozen.

A full (generation-2) collection walks every tracked object of the process: a shard or driver holding torch,
transformers and Ray has ~0.4 M of them after imports, and one full collection takes ~0.2 s on a CPU core
(measured on this project's 2-core CI VM). Run between two launches it leaves the GPU idle for that long.
``GcPauses.freeze`` moves the objects alive now (the model, its modules, captured graphs' Python state) into the
collector's permanent generation (``gc.freeze``, as vLLM and SGLang do after start): later collections walk only
what was allocated since. The pauses are counted through ``gc.callbacks`` (MEASURED: every collection of this
process, on whichever thread it ran, with its generation and wall time).
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """This process's collections, counted while installed (``install`` / ``close``); ``freeze`` after start.

    counters(): ``gc_collections`` (all generations), ``gc_full_collections`` (generation 2), ``gc_pause_us`` (their
    summed wall time), ``gc_pause_max_us`` (the longest one), ``gc_frozen_objects`` (the permanent generation's size
    at the last ``freeze``), ``gc_freezes``."""

    def __init__(self) -> None:
        self._counts = {"gc_collections": 0, "gc_full_collections": 0, "gc_pause_us": 0, "gc_pause_max_us": 0,
                        "gc_frozen_objects": 0, "gc_freezes": 0}
        self._began: float | None = None
        self._installed = False

    def install(self) -> "GcPauses":
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def close(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

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
