"""The model-side pieces ray-moe serves with: the softmax top-k router and the Zipf router bias.

The router is upstream of placement (spec 0x00E): it emits logical experts and gates; nothing after it
may change them.
"""

from __future__ import annotations

import math

import torch


def zipf_bias(num_experts: int, skew: float, seed: int, layer: int = 0) -> torch.Tensor:
    """[E] float32 router bias that makes expert popularity Zipf-like (exponent ``skew``).

    The hottest expert differs per layer (a seeded permutation), as in real models.
    """
    if skew <= 0:
        return torch.zeros(num_experts, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed * 1000 + layer + 7)
    perm = torch.randperm(num_experts, generator=g)
    ranks = torch.empty(num_experts, dtype=torch.float32)
    ranks[perm] = torch.arange(1, num_experts + 1, dtype=torch.float32)
    return -skew * torch.log(ranks) * 2.0


def route(hidden: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, top_k: int,
          norm_topk: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing in FP32 (spec 0x0AE).

    hidden: [T, d] float; router: [E, d] float32; bias: [E] float32 or None
    returns (topk_ids [T, k] int64, topk_weights [T, k] float32)
    """
    logits = hidden.to(torch.float32) @ router.to(hidden.device, torch.float32).T
    if bias is not None:
        logits = logits + bias.to(hidden.device)
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids.to(torch.int64), w.to(torch.float32)


class Router:
    """The runtime's own per-layer router (for requests that carry no routes): softmax top-k over the weight
    source's router matrices [E, d] plus the seeded Zipf bias, on ``device``."""

    def __init__(self, routers: list[torch.Tensor], *, num_experts: int, top_k: int, norm_topk: bool, skew: float,
                 seed: int, device: torch.device) -> None:
        self.routers = [r.to(device, torch.float32) for r in routers]
        self.biases = [zipf_bias(num_experts, skew, seed, l).to(device) for l in range(len(routers))]
        self.top_k, self.norm_topk = top_k, norm_topk

    def __call__(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, d] -> (topk_ids [T, k] int64, topk_weights [T, k] float32)."""
        return route(hidden, self.routers[layer], self.biases[layer], self.top_k, self.norm_topk)


def routing_margin(hidden: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """[T] gap between the k-th and (k+1)-th router probability: small values are near-ties whose expert
    choice may flip under rounding differences (used by reference comparisons)."""
    logits = hidden.to(torch.float64) @ router.to(hidden.device, torch.float64).T
    if bias is not None:
        logits = logits + bias.to(hidden.device, torch.float64)
    probs = torch.softmax(logits, dim=-1)
    if probs.shape[1] <= top_k:
        return torch.full((probs.shape[0],), math.inf, dtype=torch.float64)
    top = torch.topk(probs, top_k + 1, dim=-1).values
    return top[:, top_k - 1] - top[:, top_k]
