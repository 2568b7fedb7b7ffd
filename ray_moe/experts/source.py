"""Build the weight source a deployment's config names (each rank builds its own, loads only its experts)."""

from __future__ import annotations

from ray_moe.config import RuntimeConfig
from ray_moe.errors import ConfigError
from ray_moe.experts.weights import SeededWeightSource, WeightSource, parse_dtype


def weight_source(cfg: RuntimeConfig, *, validate: bool = False) -> WeightSource:
    """``cfg.checkpoint`` set: an ``HFWeightSource`` over that folder (a Hugging Face folder with
    config.json, or a legacy per-expert folder without one); else seeded random weights.

    The config's shape fields must match the checkpoint's (ConfigError names the field); ``num_layers``
    counts MoE layers. ``validate``: also check every expert tensor of every MoE layer from the safetensors
    headers (no tensor data read; ConfigError names the tensor and the file) — the driver does, once."""
    dtype = parse_dtype(cfg.dtype)
    if cfg.checkpoint:
        from ray_moe.models.source import HFWeightSource

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
                              ffn_size=cfg.ffn_size, seed=cfg.seed, dtype=dtype, tagged=cfg.tagged_weights)
