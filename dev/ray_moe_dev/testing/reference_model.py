"""Reference for whole-model steps served by the runtime: every layer routed and computed naively in
float64 from the same weight source (per-token loops via ``reference_moe``).

Routing is discrete: where the k-th and (k+1)-th router probabilities are closer than ``tie_margin``,
float32 rounding in the runtime may legitimately pick the other expert. Those near-tie tokens (only)
take the runtime's choice; every other token must route identically, and ``ReferenceResult`` counts
both so a test can assert there are no real routing mismatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ray_moe.model.config import RuntimeConfig
from ray_moe.moe.experts.weights import WeightSource
from ray_moe.moe.router import routing_margin, zipf_bias
from ray_moe_dev.testing.reference import reference_moe


@dataclass(frozen=True)
class ReferenceResult:
    """out: [T, d] float64; near_ties: tokens that took the runtime's routes; route_mismatches: tokens
    whose routes differ from the runtime's although they are not near-ties (must be 0)."""

    out: torch.Tensor
    near_ties: int
    route_mismatches: int


def route64(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k in float64 ([T, d] -> ([T, k] int64, [T, k] float64))."""
    logits = h.to(torch.float64) @ router.to(torch.float64).T + bias.to(torch.float64)
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


def reference_forward(
    cfg: RuntimeConfig,
    source: WeightSource,
    hidden: torch.Tensor,
    *,
    routes: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    runtime_routes: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    tie_margin: float = 1e-4,
) -> ReferenceResult:
    """Naive float64 forward of the deployment's model.

    routes: explicit per-layer ([T, k] ids, [T, k] gates), as given to ``Runtime.forward``; else the
    model's router runs. runtime_routes: the routes the runtime reported (``return_routes=True``), used
    only for near-tie tokens.
    """
    h = hidden.to(torch.float64)
    ties = mismatches = 0
    for layer in range(cfg.num_layers):
        if routes is not None:
            ids, w = routes[layer]
            ids, w = ids.to(torch.int64), w.to(torch.float64)
        else:
            bias = zipf_bias(cfg.num_experts, cfg.router_skew, cfg.seed, layer)
            router = source.router(layer)
            ids, w = route64(h, router, bias, cfg.top_k, cfg.norm_topk)
            if runtime_routes is not None:
                rid, rw = runtime_routes[layer]
                near = routing_margin(h, router, bias, cfg.top_k) < tie_margin
                same = (torch.sort(ids, 1).values == torch.sort(rid.to(torch.int64), 1).values).all(1)
                mismatches += int((~same & ~near).sum())
                ties += int(near.sum())
                ids = torch.where(near[:, None], rid.to(torch.int64), ids)
                w = torch.where(near[:, None], rw.to(torch.float64), w)
        y = reference_moe(h, ids, w, lambda e, _l=layer: source.expert(_l, e))
        h = h + y if cfg.residual else y
    return ReferenceResult(h, ties, mismatches)
