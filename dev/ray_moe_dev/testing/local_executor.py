"""A driver-side reference executor for transformers' ``ray_moe`` experts seam (tests only).

    bind(model, LocalExecutor(HFWeightSource(folder)))   # every routed expert in float64, one route at a time
"""

from __future__ import annotations

import torch

from ray_moe.core.errors import ConfigError
from ray_moe.moe.experts.reference import reference_moe
from ray_moe.moe.experts.weights import ExpertWeights, WeightSource


class LocalExecutor:
    """In-process reference executor: every routed expert from a WeightSource, one token and one route at
    a time (``ray_moe_dev.testing.reference.reference_moe``, float64 accumulation). For tests and as the
    semantic oracle of the distributed executors; not fast.

    source.expert(layer, e) is read once per (layer, e) and kept (``cache=True``)."""

    def __init__(self, source: WeightSource, *, cache: bool = True) -> None:
        self.source = source
        self.cache = cache
        self._weights: dict[tuple[int, int], ExpertWeights] = {}
        self.calls: list[tuple[int, int]] = []  # (layer, tokens) per call, for tests

    def _expert(self, layer: int, e: int) -> ExpertWeights:
        if not self.cache:
            return self.source.expert(layer, e)
        w = self._weights.get((layer, e))
        if w is None:
            w = self._weights[(layer, e)] = self.source.expert(layer, e)
        return w

    def moe_forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        if not 0 <= layer < self.source.num_layers:
            raise ConfigError(f"layer={layer} is out of range [0, {self.source.num_layers}) MoE layers")
        self.calls.append((layer, int(hidden.shape[0])))
        out = reference_moe(hidden.detach().cpu(), topk_ids.cpu(), topk_weights.detach().cpu(),
                            lambda e: self._expert(layer, e))
        return out.to(device=hidden.device, dtype=hidden.dtype)


def step_logits(hosts: list, chunks: list, token_ids: "torch.Tensor", executor: object) -> list:
    """Each host's logits [S, V] for one step of ``chunks`` (``SeqChunk``s; their positions reserved first) and
    their packed ``token_ids``, its MoE blocks through ``executor`` (an object with ``layer_entry``)."""
    out = []
    for host in hosts:
        for c in chunks:
            host.kv.reserve(c.seq_id, c.start + c.num_tokens)
        out.append(host.forward(chunks, token_ids, executor))
    return out
