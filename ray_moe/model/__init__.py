"""Real MoE models in ray-moe: Hugging Face checkpoints (specs, tensor indexes, weight sources, runtime
configs) and the transformers experts seam.

* ``spec.build_spec(folder) -> ModelSpec``: MoE layers, expert shapes and checkpoint names from config.json
  and transformers' own model classes (meta device, no weights read).
* ``checkpoint.CheckpointIndex(folder, spec)``: tensor map, per-layer layout (per-expert / fused),
  header-only ``validate()``, ``read_expert`` / ``read_router`` reading only what is asked.
* ``source.HFWeightSource``: the ``WeightSource`` the shard actors load from.
* ``config.config_from_pretrained(folder, num_ranks=...) -> RuntimeConfig``.
* ``seam``: ``register`` / ``bind`` / ``unbind`` the ``"ray_moe"`` experts implementation,
  ``MoEExecutor`` protocol (a float64 reference executor for tests: ``ray_moe_dev.testing.local_executor``).

Importing this package does not import transformers; ``build_spec`` and the seam do.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "ModelSpec": "ray_moe.model.spec",
    "LayerNames": "ray_moe.model.spec",
    "build_spec": "ray_moe.model.spec",
    "CheckpointIndex": "ray_moe.model.checkpoint",
    "LayerLayout": "ray_moe.model.checkpoint",
    "HFWeightSource": "ray_moe.model.source",
    "config_from_pretrained": "ray_moe.model.config",
    "default_slots_per_rank": "ray_moe.model.config",
    "MoEExecutor": "ray_moe.model.seam",
    "bind": "ray_moe.model.seam",
    "unbind": "ray_moe.model.seam",
    "register": "ray_moe.model.seam",
}


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)


__all__ = sorted(_EXPORTS)
