"""ray-moe: a Ray actor runtime that serves Mixture-of-Experts expert layers across GPUs and keeps them
balanced, live, while it serves.

    import ray_moe
    rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig(num_ranks=4, num_experts=8, hidden_size=64,
                                                     ffn_size=128, top_k=2, slots_per_rank=3))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_moe.model.config import RuntimeConfig
from ray_moe.core.types import Phase

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from ray_moe.runtime import Runtime


def __getattr__(name: str):
    # Runtime imports Ray; keep ``import ray_moe`` light for the pure planning modules
    if name == "Runtime":
        from ray_moe.runtime import Runtime

        return Runtime
    raise AttributeError(name)


__all__ = ["Runtime", "RuntimeConfig", "Phase", "__version__"]
