"""RuntimeConfig from a Hugging Face checkpoint folder."""

from __future__ import annotations

import math
import os
from typing import Any

from pydantic import ValidationError

from ray_moe.config import RuntimeConfig
from ray_moe.errors import ConfigError
from ray_moe.models.spec import ModelSpec, build_spec


def default_slots_per_rank(num_experts: int, num_ranks: int) -> int:
    """Slots per rank when the caller gives none: every expert once, spread evenly, plus about a quarter
    more for replicas (at least one per rank):

        base = ceil(E / P);  slots_per_rank = base + max(1, ceil(base / 4))

    e.g. E=8, P=4 -> 2 + 1 = 3 (12 slots, 4 replicas); E=256, P=8 -> 32 + 8 = 40 (320 slots, 64 replicas).
    """
    if num_experts < 1 or num_ranks < 1:
        raise ConfigError(f"num_experts={num_experts} / num_ranks={num_ranks} must be >= 1")
    base = math.ceil(num_experts / num_ranks)
    return base + max(1, math.ceil(base / 4))


def config_from_pretrained(folder: str, *, num_ranks: int, device: str = "cpu", dtype: str = "float32",
                           spec: ModelSpec | None = None, validate: bool = True, **overrides: Any) -> RuntimeConfig:
    """RuntimeConfig of a checkpoint folder.

    num_experts, hidden_size, ffn_size (the MoE intermediate size), top_k and num_layers (= number of MoE
    layers) come from the folder's ModelSpec, ``checkpoint=folder``; ``slots_per_rank`` defaults to
    ``default_slots_per_rank``. ``overrides`` (any RuntimeConfig field) win. ``validate=True`` also checks
    every expert tensor of the checkpoint from the file headers (no tensor data read), so a broken folder
    fails here, in the driver, before any actor starts. Every problem raises ConfigError naming the field,
    file or tensor.
    """
    folder = os.fspath(folder)
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ConfigError(f"num_ranks={num_ranks!r}: must be an integer >= 1")
    spec = spec if spec is not None else build_spec(folder)
    if validate:
        from ray_moe.models.checkpoint import CheckpointIndex

        CheckpointIndex(folder, spec).validate()
    if spec.top_k is None:
        raise ConfigError(f"checkpoint={folder!r}: the config has no num_experts_per_tok; pass top_k=")
    fields: dict[str, Any] = {
        "num_ranks": num_ranks,
        "num_experts": spec.num_experts,
        "hidden_size": spec.hidden_size,
        "ffn_size": spec.ffn_size,
        "top_k": spec.top_k,
        "num_layers": spec.num_moe_layers,
        "device": device,
        "dtype": dtype,
        "checkpoint": folder,
    }
    fields["slots_per_rank"] = default_slots_per_rank(spec.num_experts, num_ranks)
    fields.update(overrides)
    unknown = sorted(set(fields) - set(RuntimeConfig.model_fields))
    if unknown:
        raise ConfigError(f"{unknown[0]}={fields[unknown[0]]!r}: not a RuntimeConfig field")
    try:
        return RuntimeConfig(**fields)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()))
            msg = str(err.get("msg", "")).removeprefix("Value error, ")  # model checks name their fields
            parts.append(f"{loc}={fields[loc]!r}: {msg}" if loc in fields else f"{loc}: {msg}" if loc else msg)
        raise ConfigError(f"RuntimeConfig from {folder!r}: " + "; ".join(parts)) from exc
