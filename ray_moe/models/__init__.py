"""Real MoE models in ray-moe: Hugging Face checkpoints (specs, tensor indexes, weight sources, runtime
configs) and the transformers experts seam.

* ``spec.build_spec(folder) -> ModelSpec``: MoE layers, expert shapes and checkpoint names from config.json
  and transformers' own model classes (meta device, no weights read).
* ``checkpoint.CheckpointIndex(folder, spec)``: tensor map, per-layer layout (per-expert / fused),
  header-only ``validate()``, ``read_expert`` / ``read_router`` reading only what is asked.
* ``source.HFWeightSource``: the ``WeightSource`` the shard actors load from.
* ``config.config_from_pretrained(folder, num_ranks=...) -> RuntimeConfig``.
* ``seam``: ``register`` / ``bind`` / ``unbind`` the ``"ray_moe"`` experts implementation,
  ``MoEExecutor`` protocol, ``LocalExecutor`` reference.

Importing this package does not import transformers; ``build_spec`` and the seam do.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "ModelSpec": "ray_moe.models.spec",
    "LayerNames": "ray_moe.models.spec",
    "build_spec": "ray_moe.models.spec",
    "CheckpointIndex": "ray_moe.models.checkpoint",
    "LayerLayout": "ray_moe.models.checkpoint",
    "HFWeightSource": "ray_moe.models.source",
    "config_from_pretrained": "ray_moe.models.config",
    "default_slots_per_rank": "ray_moe.models.config",
    "MoEExecutor": "ray_moe.models.seam",
    "LocalExecutor": "ray_moe.models.seam",
    "bind": "ray_moe.models.seam",
    "unbind": "ray_moe.models.seam",
    "register": "ray_moe.models.seam",
}


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)


__all__ = sorted(_EXPORTS)
