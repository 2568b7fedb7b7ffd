"""The start checks' one timing rule: the fastest of a few calls on CUDA events (``model.dense_prefill``'s dense
attention check and ``moe.experts.runners.tiled``'s expert kernel check time their candidates with it)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def best_ms(fn: Callable[[], object], reps: int = 5) -> float:
    """The fastest of ``reps`` timed calls of ``fn`` after one warm call (CUDA events on the current stream), in
    ms."""
    fn()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


__all__ = ["best_ms"]
