"""The only module that reads environment variables.

Every knob the process environment can turn is read here, once, into a frozen record. Other modules
take an ``EnvSettings`` (or the value they need) as an argument.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvSettings:
    """Process-level settings taken from the environment.

    ray_address: ``RAY_ADDRESS`` (join a running cluster) or None (start a local instance).
    results_dir: ``RAY_MOE_RESULTS_DIR``, where benchmarks write JSON.
    namespace: ``RAY_MOE_NAMESPACE``, the Ray namespace that holds named coordinators.
    ci: ``CI`` is set (keeps demos and benchmarks short).
    api_key: ``RAY_MOE_API_KEY``, the bearer token ``ray-moe serve`` requires (None: no key).
    """

    ray_address: str | None
    results_dir: str
    namespace: str
    ci: bool
    api_key: str | None = None


def read_env() -> EnvSettings:
    """Read the environment now (call at process entry points, pass the result down)."""
    return EnvSettings(
        ray_address=os.environ.get("RAY_ADDRESS") or None,
        results_dir=os.environ.get("RAY_MOE_RESULTS_DIR", "bench/results"),
        namespace=os.environ.get("RAY_MOE_NAMESPACE", "ray-moe"),
        ci=bool(os.environ.get("CI")),
        api_key=os.environ.get("RAY_MOE_API_KEY") or None,
    )
