"""HFWeightSource: a ``WeightSource`` over a Hugging Face safetensors checkpoint folder.

Layer ``l`` is the l-th MoE layer of the model (``spec.moe_layers[l]`` is its decoder layer). Each rank
builds its own source and reads only the experts it hosts (``expert(l, e)`` reads only that expert's
bytes, whether the checkpoint stores experts one by one or stacked).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ray_moe.experts.weights import ExpertWeights, WeightSource
from ray_moe.models.checkpoint import CheckpointIndex
from ray_moe.models.spec import ModelSpec


class HFWeightSource(WeightSource):
    """Expert weights and routers of a checkpoint folder.

    folder: with ``config.json`` (any transformers MoE family ray-moe accepts, see ``build_spec``) or
    without one (legacy per-expert folders; shapes come from the tensors). ``spec``: a ModelSpec already
    built (e.g. by the driver) to skip rebuilding it. ``dtype``: cast every expert tensor to it (None:
    the checkpoint's dtype). ``index``: an existing CheckpointIndex to reuse.

    expert(l, e) -> ExpertWeights(w_gate [f, d], w_up [f, d], w_down [d, f]); router(l) -> [E, d] float32.
    """

    def __init__(self, folder: str | None = None, *, dtype: torch.dtype | None = None, spec: ModelSpec | None = None,
                 index: CheckpointIndex | None = None) -> None:
        if index is None:
            if folder is None:
                raise ValueError("HFWeightSource needs a folder or an index")
            index = CheckpointIndex(os.fspath(folder), spec)
        self.index = index
        self.spec = index.spec
        self.folder = index.folder
        self.dtype = dtype
        self.num_experts = self.spec.num_experts
        self.num_layers = self.spec.num_moe_layers
        self.hidden_size = self.spec.hidden_size
        self.ffn_size = self.spec.ffn_size

    @property
    def top_k(self) -> int | None:
        return self.spec.top_k

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        return self.index.read_expert(layer, expert, self.dtype)

    def router(self, layer: int) -> torch.Tensor:
        return self.index.read_router(layer)

    def validate(self) -> dict[str, Any]:
        """Header-only check of every expert tensor (see ``CheckpointIndex.validate``)."""
        return self.index.validate()

    def describe(self) -> dict[str, Any]:
        return {"kind": "hf", "dtype": str(self.dtype) if self.dtype is not None else None, **self.index.describe()}
