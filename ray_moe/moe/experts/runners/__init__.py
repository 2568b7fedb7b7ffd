"""Expert runners, one file per backend: padded (capacity-padded dense), grouped (grouped GEMM),
block (MegaBlocks-style block-padded), plus the per-expert loop baseline in ``base``."""

from __future__ import annotations

from ray_moe.moe.experts.runners.base import ExpertRunner, LoopRunner, RunnerLedger
from ray_moe.core.types import RunnerKind


def make_runner(kind: RunnerKind | str, **options) -> ExpertRunner:
    """Runner of one kind; ``options`` go to its constructor (e.g. ``alignment``, ``block_size``)."""
    kind = RunnerKind(kind)
    if kind is RunnerKind.LOOP:
        return LoopRunner(**options)
    if kind is RunnerKind.GROUPED:
        from ray_moe.moe.experts.runners.grouped import GroupedRunner

        return GroupedRunner(**options)
    if kind is RunnerKind.PADDED:
        from ray_moe.moe.experts.runners.padded import PaddedRunner

        return PaddedRunner(**options)
    if kind is RunnerKind.BLOCK:
        from ray_moe.moe.experts.runners.block import BlockRunner

        return BlockRunner(**options)
    raise ValueError(f"kind={kind!r} is not a runner kind")


__all__ = ["ExpertRunner", "LoopRunner", "RunnerLedger", "make_runner"]
