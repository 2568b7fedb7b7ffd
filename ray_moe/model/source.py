"""HFWeightSource: a ``WeightSource`` over a Hugging Face safetensors checkpoint folder.

Layer ``l`` is the l-th MoE layer of the model (``spec.moe_layers[l]`` is its decoder layer). Each rank
builds its own source and reads only the experts it hosts (``expert(l, e)`` reads only that expert's
bytes, whether the checkpoint stores experts one by one or stacked). ``weight_source(cfg)`` builds the
source a deployment's config names (a checkpoint folder, or seeded random weights; ``quantization="fp8"``:
its experts quantized to block-scaled FP8 at load, ``OnlineFp8Source``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ray_moe.core.errors import ConfigError
from ray_moe.model.config import RuntimeConfig
from ray_moe.moe.experts.fp8 import check_block, quantize
from ray_moe.moe.experts.weights import ExpertWeights, SeededWeightSource, WeightSource, parse_dtype
from ray_moe.model.checkpoint import CheckpointIndex
from ray_moe.model.spec import ModelSpec


class HFWeightSource(WeightSource):
    """Expert weights and routers of a checkpoint folder.

    folder: with ``config.json`` (any transformers MoE family ray-moe accepts, see ``build_spec``) or
    without one (legacy per-expert folders; shapes come from the tensors). ``spec``: a ModelSpec already
    built (e.g. by the driver) to skip rebuilding it. ``dtype``: cast every expert tensor to it (None:
    the checkpoint's dtype). ``index``: an existing CheckpointIndex to reuse.

    expert(l, e) -> ExpertWeights(w_gate [f, d], w_up [f, d], w_down [d, f]); router(l) -> [E, d] float32.
    A block-scaled FP8 checkpoint's experts come as float8_e4m3fn codes with their float32 block scales
    (``ExpertWeights.scales``, ``fp8_block`` = the checkpoint's ``weight_block_size``; ``dtype`` casts dense
    experts only). Experts are read by several threads at once (safetensors reads of one memory-mapped file each).
    """

    concurrent_reads = True

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
        self.fp8_block = self.spec.fp8_block

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

class OnlineFp8Source(WeightSource):
    """``inner``'s experts quantized at read to block-scaled FP8 (``moe.experts.fp8.quantize``: e4m3 codes,
    float32 scale = block amax / 448 per ``block``), what ``RuntimeConfig.quantization="fp8"`` serves (vLLM's
    online FP8, in the block layout of FP8 checkpoints). Experts the inner source already returns in FP8 pass
    unchanged; routers are the inner source's."""

    def __init__(self, inner: WeightSource, block: tuple[int, int] = (128, 128)) -> None:
        self.inner = inner
        self.block = check_block(block, "block")
        self.fp8_block = inner.fp8_block or self.block
        self.num_experts, self.num_layers = inner.num_experts, inner.num_layers
        self.hidden_size, self.ffn_size = inner.hidden_size, inner.ffn_size
        self.concurrent_reads = inner.concurrent_reads

    def __getattr__(self, name: str) -> Any:  # spec, index, folder, top_k ... of the inner source
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        w = self.inner.expert(layer, expert)
        if w.quantized:
            return w
        q = [quantize(t, self.block) for t in (w.w_gate, w.w_up, w.w_down)]
        return ExpertWeights(layer, expert, *(c for c, _ in q), tuple(s for _, s in q), self.block)  # type: ignore[arg-type]

    def router(self, layer: int) -> torch.Tensor:
        return self.inner.router(layer)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "quantization": "fp8", "fp8_block": list(self.fp8_block)}


def weight_source(cfg: RuntimeConfig, *, validate: bool = False) -> WeightSource:
    """``weight_source_of(cfg)``, its experts quantized at load (``OnlineFp8Source``) when
    ``cfg.quantization == "fp8"``."""
    src = _weight_source(cfg, validate=validate)
    return OnlineFp8Source(src) if cfg.quantization == "fp8" else src


def _weight_source(cfg: RuntimeConfig, *, validate: bool = False) -> WeightSource:
    """``cfg.checkpoint`` set: an ``HFWeightSource`` over that folder (a Hugging Face folder with
    config.json, or a legacy per-expert folder without one); else seeded random weights.

    The config's shape fields must match the checkpoint's (ConfigError names the field); ``num_layers``
    counts MoE layers. ``validate``: also check every expert tensor of every MoE layer from the safetensors
    headers (no tensor data read; ConfigError names the tensor and the file) — the driver does, once."""
    dtype = parse_dtype(cfg.dtype)
    if cfg.checkpoint:
        src = HFWeightSource(cfg.checkpoint, dtype=dtype)
        for name, want, got in (("num_experts", cfg.num_experts, src.num_experts),
                                ("num_layers", cfg.num_layers, src.num_layers),
                                ("hidden_size", cfg.hidden_size, src.hidden_size),
                                ("ffn_size", cfg.ffn_size, src.ffn_size)):
            if want != got:
                what = " MoE layers" if name == "num_layers" else ""
                raise ConfigError(f"{name}={want} but checkpoint {cfg.checkpoint!r} has {got}{what}")
        if validate:
            src.validate()
        return src
    return SeededWeightSource(num_layers=cfg.num_layers, num_experts=cfg.num_experts, hidden_size=cfg.hidden_size,
                              ffn_size=cfg.ffn_size, seed=cfg.seed, dtype=dtype, tagged=cfg.tagged_weights,
                              device=cfg.device if cfg.seeded_on_device else "cpu")
