"""The semantic MoE reference (spec 0x01A): every route, one token and one route slot at a time, in float64.

The oracle every fast path is compared against in the tests, and the check the rollback drill applies to
every output it serves (``ray-moe drill rollback``). Plain loops on purpose: obviously correct by reading.
"""

from __future__ import annotations

from typing import Callable

import torch

from ray_moe.moe.experts.weights import ExpertWeights


def _swiglu_row(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """One SwiGLU expert on one row ``x`` [d] -> [d] (no gate)."""
    gate = torch.nn.functional.silu(w.w_gate @ x)
    up = w.w_up @ x
    return w.w_down @ (gate * up)


def reference_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_fn: Callable[[int], ExpertWeights],
    *,
    acc_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Direct semantic MoE: y_t = sum_j g_{t,j} * E_{e_{t,j}}(h_t) (spec 0x01A).

    hidden [T, d], topk_ids [T, k], topk_weights [T, k]; ``weight_fn(e)`` gives logical expert e's
    weights. Loops over tokens and route slots; each expert is evaluated in ``acc_dtype`` (float64 by
    default, so the reference is at least as precise as any fast path). Returns [T, d] in ``acc_dtype``.
    """
    t_count, d = int(hidden.shape[0]), int(hidden.shape[1])
    k = int(topk_ids.shape[1]) if topk_ids.dim() == 2 else 0
    cache: dict[int, ExpertWeights] = {}
    out = torch.zeros(t_count, d, dtype=acc_dtype)
    for t in range(t_count):
        x = hidden[t].to(acc_dtype)
        acc = torch.zeros(d, dtype=acc_dtype)
        for j in range(k):
            e = int(topk_ids[t, j])
            g = float(topk_weights[t, j])
            if e not in cache:
                cache[e] = weight_fn(e).to("cpu", acc_dtype)
            acc = acc + g * _swiglu_row(x, cache[e])
        out[t] = acc
    return out
