"""Tiny seeded transformers MoE checkpoints, saved once per session (see ray_moe_dev.testing.hf_models)."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from ray_moe_dev.testing.hf_models import tiny_model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Callable[..., tuple[Any, str]]:
    """``hf_checkpoint(family, layout="per_expert", sharded=False) -> (model, folder)``, cached per session.
    Tests must not modify the returned folder (copy it first: ``copy_checkpoint``)."""
    cache: dict[tuple[str, str, bool], tuple[Any, str]] = {}

    def get(family: str, layout: str = "per_expert", sharded: bool = False) -> tuple[Any, str]:
        key = (family, layout, sharded)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{family}-{layout}-{'sharded' if sharded else 'single'}")
            cache[key] = tiny_model(family, folder, layout=layout, sharded=sharded)
        return cache[key]

    return get
