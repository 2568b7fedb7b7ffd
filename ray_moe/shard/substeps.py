# ======================================================================================================
#  MULTI-STEP DECODE: THE SUB-STEPS AFTER THE FIRST, ON ARRAYS (one rank, a group of one; pure: no Ray)
#
#   sub-step 0 (the normal launch): its plan covers every sub-step (``PagedKVCache.plan_decode_steps``:
#   each sequence's slots reserved and laid out with room for all of them, one upload) and its captured
#   decode graph is the one every sub-step replays
#   sub-step j >= 1: the tokens sub-step j - 1 sampled copied into j's input on the device (one copy, no
#   host wait) ──> replay ──> sample ──> (pinned) host copies queued behind it
#   no work item, resolution, reservation or plan per sequence per sub-step: the host does O(1) Python
#   plus the samplers' per-row work where a row needs it (seeded temperature, min_tokens masks)
# ======================================================================================================
"""The sub-steps of a multi-step decode request after the first, launched on arrays (``SubstepRun``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ray_moe.model.sampling import plain_greedy
from ray_moe.shard.pending import PendingStep
from ray_moe.shard.records import StepRequest, WorkItem


def runs_on_arrays(items: tuple[WorkItem, ...]) -> bool:
    """Whether a multi-step request's items can take the array path after their first sub-step: nothing per
    sequence is kept or counted on the host between sub-steps (no ``keep_tokens`` history, no expert
    statistics, no penalties reading the tokens)."""
    return all(not it.keep_tokens and not it.expert_stats and not it.sample.penalized for it in items)


@dataclass(eq=False)
class SubstepRun:
    """What the sub-steps after the first replay: ``staged`` [steps] (the plan's per-sub-step device inputs;
    entry 0 was sub-step 0's), ``launch(staged, specs, greedy) -> GraphPending`` (the graph step's replay,
    sampling (``greedy``: every row plain greedy, one argmax) and host copies over these inputs), the sampled
    items (sub-step 0's, in ``picked`` order) and their specs."""

    staged: list[dict[str, torch.Tensor]]
    launch: Callable[[dict[str, torch.Tensor], list], Any]
    want: tuple[WorkItem, ...]
    specs: list

    def __post_init__(self) -> None:
        # whether a spec reads its position (a seeded temperature draw, a min_tokens mask); if none does,
        # every sub-step samples with the first one's specs, and plain greedy rows with one argmax
        self.positional = any(sp.temperature > 0.0 or sp.suppress for sp in self.specs)
        self.greedy = not self.positional and plain_greedy(self.specs)

    def specs_at(self, j: int) -> list:
        """Sub-step j's sample specs: positions j on where a spec reads its position; the same specs otherwise."""
        return [sp.at(sp.position + j) for sp in self.specs] if self.positional else self.specs

    def substep(self, ex: Any, req: StepRequest, j: int, parts: list[PendingStep], *, last: bool) -> PendingStep:
        """Launch sub-step ``j`` (>= 1) of ``req`` on executor ``ex`` behind ``parts`` (sub-steps 0 .. j - 1):
        sub-step j - 1's samples fill this one's input tokens on the device. Returns a ``PendingStep`` over the
        first sub-step's items, their sample positions j on; the ``last`` sub-step's samples are the ones a
        step launched behind this request reads on the device (``StepBatcher.keep_picks``). Counts the tokens fed on the device
        (as a deferred decode item's are)."""
        t0 = ex.begin_step()
        staged = self.staged[j]
        n = len(self.want)
        staged["token_ids"][:n].copy_(parts[j - 1].graph.picked)  # queued behind the sub-step that sampled them
        ex.count("deferred_tokens", n)
        ex.count("deferred_on_device", n)
        ex.count("array_substeps")
        graph = self.launch(staged, self.specs_at(j), self.greedy)
        sub, first = req.revised(step_id=f"{req.step_id}/{j}"), parts[0]
        if last:
            ex.batcher.keep_picks(sub.step_id, graph.picked, graph.want, j)
        return PendingStep(ex, sub, first.generation, first.items, t0, first.path, first.reason, graph=graph,
                           decision=first.decision, shift=j)


__all__ = ["SubstepRun", "runs_on_arrays"]
