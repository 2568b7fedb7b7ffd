"""The only module that reads environment variables.

Every knob the process environment can turn is read here, once, into a frozen record. Other modules
take an ``EnvSettings`` (or the value they need) as an argument.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


DEFAULT_RESULTS_DIR = "ray-moe-results"


@dataclass(frozen=True)
class EnvSettings:
    """Process-level settings taken from the environment.

    ray_address: ``RAY_ADDRESS`` (join a running cluster) or None (start a local instance).
    results_dir: ``RAY_MOE_RESULTS_DIR``, where benchmarks write JSON unless told ``--out DIR``; default
        ``ray-moe-results`` (relative to the working directory; never the repository's tracked
        ``bench/results/`` unless named explicitly).
    namespace: ``RAY_MOE_NAMESPACE``, the Ray namespace that holds named coordinators.
    ci: ``CI`` is set (keeps demos and benchmarks short).
    api_key: ``RAY_MOE_API_KEY``, the bearer token ``ray-moe serve`` requires (None: no key).
    ray_auth_mode: ``RAY_AUTH_MODE`` as set in this shell (``token`` or ``disabled``), None when unset: Ray
        itself reads it (and the token: ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``);
        ray-moe reads it only to explain a refused connection.
    """

    ray_address: str | None
    results_dir: str
    namespace: str
    ci: bool
    api_key: str | None = None
    ray_auth_mode: str | None = None


def read_env() -> EnvSettings:
    """Read the environment now (call at process entry points, pass the result down)."""
    return EnvSettings(
        ray_address=os.environ.get("RAY_ADDRESS") or None,
        results_dir=os.environ.get("RAY_MOE_RESULTS_DIR") or DEFAULT_RESULTS_DIR,
        namespace=os.environ.get("RAY_MOE_NAMESPACE", "ray-moe"),
        ci=bool(os.environ.get("CI")),
        api_key=os.environ.get("RAY_MOE_API_KEY") or None,
        ray_auth_mode=os.environ.get("RAY_AUTH_MODE") or None,
    )


RAY_CONNECT_WAIT_VAR = "RAY_gcs_server_port_wait_time_s"


def cap_ray_connect_wait(seconds: int) -> None:
    """Let this process try to reach a cluster's GCS for about ``seconds`` (Ray retries about once a second,
    20 times by default), unless the operator set ``RAY_gcs_server_port_wait_time_s`` already. For short-lived
    clients (the ``ray-moe`` commands): a refused token then fails in a second, not after 20."""
    os.environ.setdefault(RAY_CONNECT_WAIT_VAR, str(int(seconds)))
