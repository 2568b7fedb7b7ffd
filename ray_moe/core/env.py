"""The only module that reads environment variables.

Every knob the process environment can turn is read here, once, into a frozen record. Other modules
take an ``EnvSettings`` (or the value they need) as an argument.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


DEFAULT_RESULTS_DIR = "ray-moe-results"
DEFAULT_STATE_DIR = "~/.ray-moe"  # where ``ray-moe serve`` records the deployments it runs (one file each)
RAY_TOKEN_FILE = "~/.ray/auth_token"  # Ray's own default token file


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
        itself reads it (and the token: ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``).
        The ``ray-moe`` commands read it to explain a refused connection and, when it is unset and this machine
        holds a token (``ray_token_available``), turn token authentication on for the connection they make
        (``enable_ray_token_auth``), as Ray itself does for a cluster it discovers on this machine.
    ray_token_available: a token Ray would send: ``RAY_AUTH_TOKEN`` set, or the file ``RAY_AUTH_TOKEN_PATH``
        names (else ``~/.ray/auth_token``) exists.
    state_dir: ``RAY_MOE_STATE_DIR``, else ``~/.ray-moe`` (expanded): where ``ray-moe serve`` writes one small
        file per deployment it runs (its Ray address, namespace, auth mode, API address), which ``status``,
        ``scale`` and ``rebalance`` read to find it; ``state_dir_default``: whether the variable was unset.
    """

    ray_address: str | None
    results_dir: str
    namespace: str
    ci: bool
    api_key: str | None = None
    ray_auth_mode: str | None = None
    ray_token_available: bool = False
    state_dir: str = os.path.expanduser(DEFAULT_STATE_DIR)
    state_dir_default: bool = True


def _ray_token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    return os.path.isfile(os.path.expanduser(os.environ.get("RAY_AUTH_TOKEN_PATH") or RAY_TOKEN_FILE))


def triton_interpreted() -> bool:
    """Whether Triton runs its CPU interpreter in this process (``TRITON_INTERPRET=1``, which Triton itself reads):
    kernels that serve CUDA only then also take CPU tensors (the tests' CPU path)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def read_env() -> EnvSettings:
    """Read the environment now (call at process entry points, pass the result down)."""
    state_dir = os.environ.get("RAY_MOE_STATE_DIR") or None
    return EnvSettings(
        ray_address=os.environ.get("RAY_ADDRESS") or None,
        results_dir=os.environ.get("RAY_MOE_RESULTS_DIR") or DEFAULT_RESULTS_DIR,
        namespace=os.environ.get("RAY_MOE_NAMESPACE", "ray-moe"),
        ci=bool(os.environ.get("CI")),
        api_key=os.environ.get("RAY_MOE_API_KEY") or None,
        ray_auth_mode=os.environ.get("RAY_AUTH_MODE") or None,
        ray_token_available=_ray_token_available(),
        state_dir=os.path.abspath(os.path.expanduser(state_dir or DEFAULT_STATE_DIR)),
        state_dir_default=state_dir is None,
    )


RAY_CONNECT_WAIT_VAR = "RAY_gcs_server_port_wait_time_s"


def cap_ray_connect_wait(seconds: int) -> None:
    """Let this process try to reach a cluster's GCS for about ``seconds`` (Ray retries about once a second,
    20 times by default), unless the operator set ``RAY_gcs_server_port_wait_time_s`` already. For short-lived
    clients (the ``ray-moe`` commands): a refused token then fails in a second, not after 20."""
    os.environ.setdefault(RAY_CONNECT_WAIT_VAR, str(int(seconds)))


def enable_ray_token_auth() -> None:
    """Turn Ray's token authentication on for this process and its children (``RAY_AUTH_MODE=token``), as
    ``ray.init`` does itself for a cluster it discovers on this machine; the caller refreshes Ray's cached
    config afterwards. Only for a process whose shell left ``RAY_AUTH_MODE`` unset."""
    os.environ["RAY_AUTH_MODE"] = "token"
