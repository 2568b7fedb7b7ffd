"""The expert-runner entry of FP8 slot weights: runners compute with the dequantized values of block-scaled
FP8 codes (``moe.experts.fp8``).

Why a runner wrapper (``Fp8Runner``) rather than FP8 branches in every runner: the slot buffers hold each
expert once, as codes plus scales (``SlotWeights.scales``); at the runner boundary (``moe.layer.run_experts``)
the wrapper dequantizes the weight operands of exactly the call it serves (the plain or buffer-order slot
weights the inner runner would read), into the activation dtype, and hands the inner runner ordinary
``SlotWeights``. Every runner (loop, grouped, padded, block) and every dispatch format (counts, device
offsets, capacity, row-mapped generations through ``moe.experts.slab``) then computes on the same values as
the dequantized model (float32(code) x block scale, then the activation dtype: exact in float32), with no
copy kept (the dequantized operands live for one call) and no extra work on the bf16 / fp32 paths (they never
reach this module). This is the CPU-correct reference path: every call dequantizes all the slots it is
handed ([N, f, d] x 3 in the activation dtype, a temporary), which is fine on CPU and for tests but wasteful
on a GPU; FP8 GEMM kernels (DeepGEMM, ``torch._scaled_mm`` / ``_scaled_grouped_mm``, Triton block-FP8) replace
the dequantize-then-GEMM later and must match it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from ray_moe.moe.experts.fp8 import dequantize
from ray_moe.moe.experts.runners.base import ExpertRunner, RunnerLedger
from ray_moe.moe.experts.weights import SlotWeights


def dense_slots(weights: SlotWeights, dtype: torch.dtype) -> SlotWeights:
    """The same slot weights (slot ids, experts, rows, digests) with w_gate / w_up / w_down dequantized into
    ``dtype`` (stacks [N, f, d] / [N, d, f] like the codes; a temporary: nothing is cached) and no scales."""
    if weights.scales is None or weights.block is None:
        raise ValueError(f"weights: layer {weights.layer} slot weights hold no FP8 scales")
    sg, su, sd = weights.scales
    b = weights.block
    return replace(weights, w_gate=dequantize(weights.w_gate, sg, b, dtype), w_up=dequantize(weights.w_up, su, b, dtype),
                   w_down=dequantize(weights.w_down, sd, b, dtype), scales=None, block=None, cache={})


class Fp8Runner(ExpertRunner):
    """An expert runner over FP8 slot weights: every entry dequantizes the weights it is handed (codes x block
    scales, float32, then the activation dtype of ``x``) and calls the same entry of ``inner`` on plain slot
    weights. ``takes_indexed`` is False (the skinny kernels read bf16 weights; the caller gathers the rows)."""

    def __init__(self, inner: ExpertRunner) -> None:
        self.inner = inner
        self.kind = inner.kind

    def run(self, x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> torch.Tensor:
        return self.inner.run(x, counts, dense_slots(weights, x.dtype))

    def run_capacity(self, x: torch.Tensor, weights: SlotWeights, valid: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.run_capacity(x, dense_slots(weights, x.dtype), valid)

    def run_offsets(self, x: torch.Tensor, offsets: torch.Tensor, weights: SlotWeights) -> torch.Tensor:
        return self.inner.run_offsets(x, offsets, dense_slots(weights, x.dtype))

    def takes_indexed(self, hidden: torch.Tensor, rows: int, weights: SlotWeights) -> bool:
        return False

    def ledger(self, counts: Sequence[int], d: int, f: int) -> RunnerLedger:
        return self.inner.ledger(counts, d, f)


__all__ = ["Fp8Runner", "dense_slots"]
