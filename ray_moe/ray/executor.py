"""LayerExecutor: transformers' ``ray_moe`` experts seam run through a Runtime (``Runtime.moe_executor``)."""

from __future__ import annotations

from typing import Any

import torch


class LayerExecutor:
    """``moe_forward(layer, hidden [T, d], topk_ids [T, k], topk_weights [T, k]) -> [T, d]`` through a Runtime
    (one actor call per rank per MoE layer: the integration path; serving keeps the model in the shards)."""

    def __init__(self, rt: Any) -> None:  # a ray_moe.Runtime
        self.rt = rt

    def moe_forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        y = self.rt.forward(hidden.detach().cpu(), topk_ids.detach().cpu(), topk_weights.detach().float().cpu(),
                            layer=layer)
        return y.to(device=hidden.device, dtype=hidden.dtype)


__all__ = ["LayerExecutor"]
