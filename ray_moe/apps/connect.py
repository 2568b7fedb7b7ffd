"""Which Ray cluster a ``ray-moe`` command talks to, and how it gets in.

``ray-moe serve``: a private local Ray instance (started by the server, stopped with it) unless an address is
given: ``--address HOST:PORT`` or ``RAY_ADDRESS`` joins that cluster, ``--address auto`` the cluster ``ray start``
runs on this machine; ``--address local`` is the default said out loud. It never joins a cluster it merely finds.

``ray-moe status`` / ``scale`` / ``rebalance``: with ``--address`` (or ``RAY_ADDRESS``; ``auto`` as above), the
deployment on that cluster (``--name``, else the only one there). Without, the deployment a ``ray-moe serve`` of
this machine runs (its state file, ``apps/deployments.py``: ``--name``, else the only one): they reach its Ray
instance, in its namespace, never another cluster's. A process that already called ``ray.init`` (a notebook, a
test) uses its own cluster.

Token authentication (Ray 2.60): a command whose shell leaves ``RAY_AUTH_MODE`` unset turns it on when the
deployment's state file says its Ray instance runs with it, or, for an address, when this machine holds a token
(``~/.ray/auth_token``, ``RAY_AUTH_TOKEN_PATH``, ``RAY_AUTH_TOKEN``), which a cluster without authentication
ignores: the commands ``ray-moe serve`` prints work as pasted. ``RAY_AUTH_MODE`` set by the user is kept.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from ray_moe.core.env import EnvSettings, enable_ray_token_auth, read_env

PRIVATE = "local"  # --address local: a private instance (ray-moe serve's default)
DISCOVER = "auto"  # --address auto: the cluster `ray start` left on this machine


class BadInput(ValueError):
    """A command-line value names nothing that exists (exit code 2)."""


def use_token_auth() -> None:
    """Token authentication on for this process's Ray connection (and its children)."""
    enable_ray_token_auth()
    try:  # Ray caches its config: refresh it, as ray.init does when it turns the mode on itself
        from ray._raylet import Config

        Config.initialize("")
    except Exception:  # noqa: BLE001 - an older Ray reads the variable when it connects
        pass


def join(address: str, env: EnvSettings, *, namespace: str | None = None, token: bool | None = None) -> None:
    """Join the cluster at ``address`` (``auto``: this machine's) with one-line errors
    (``ray.connection.join_cluster``); ``token``: the cluster is known to need a token (True) or not (False),
    None: send one when this machine has one. Keeps a ``RAY_AUTH_MODE`` the shell set."""
    from ray_moe.ray.connection import join_cluster

    if env.ray_auth_mode is None and (token or (token is None and env.ray_token_available)):
        use_token_auth()
        env = read_env()
    join_cluster(address, env, namespace=namespace)


def serve_address(args: argparse.Namespace, env: EnvSettings) -> str | None:
    """The cluster ``ray-moe serve`` joins (``auto`` or HOST:PORT), or None for a private instance."""
    address = getattr(args, "address", None) or env.ray_address
    return None if address in (None, PRIVATE) else address


def deployments() -> list[str]:
    """The ray-moe deployments running on the connected cluster, in this namespace (their named coordinators)."""
    import ray

    from ray_moe.ray.coordinator import coordinator_name

    prefix, ns = coordinator_name(""), ray.get_runtime_context().namespace
    return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == ns and a["name"].startswith(prefix))


def _running(names: list[str]) -> str:
    return f"running: {', '.join(names)}" if names else "none runs on this cluster (start one: ray-moe serve MODEL)"


def _on_cluster(args: argparse.Namespace) -> Any:
    """The deployment ``--name`` names on the connected cluster, else the only one there."""
    from ray_moe.runtime import Runtime

    if args.name is None:
        names = deployments()
        if len(names) != 1:
            why = "several ray-moe deployments run, pick one" if names else "no deployment to show"
            raise BadInput(f"--name: {why} ({_running(names)})")
        args.name = names[0]
    try:
        return Runtime.connect(args.name)
    except ValueError as exc:
        if "no running ray-moe deployment" not in str(exc):
            raise
        raise BadInput(f"{exc}; {_running(deployments())}") from None


def started_here(env: EnvSettings, name: str | None):
    """The state file of the deployment ``name`` (else the only one) a ``ray-moe serve`` here runs, or BadInput
    saying what runs and how to look elsewhere."""
    from ray_moe.apps.deployments import live_records

    recs = live_records(env.state_dir)
    where = ("" if env.state_dir_default else f" (RAY_MOE_STATE_DIR={shlex.quote(env.state_dir)})")
    listing = ", ".join(f"{r.name} ({r.url}, pid {r.pid})" for r in recs) or "none"
    elsewhere = "a deployment on a cluster: --address HOST:PORT (or --address auto for this machine's `ray start`)"
    if name is not None:
        rec = next((r for r in recs if r.name == name), None)
        if rec is None:
            raise BadInput(f"--name={name!r}: no ray-moe serve on this machine runs a deployment of that name"
                           f"{where} (running here: {listing}); {elsewhere}")
        return rec
    if len(recs) == 1:
        return recs[0]
    if not recs:
        raise BadInput(f"no ray-moe serve runs on this machine{where} (start one: ray-moe serve MODEL); {elsewhere}")
    raise BadInput(f"--name: several ray-moe deployments run on this machine, pick one (running here: {listing})")


def connect_deployment(args: argparse.Namespace) -> Any:
    """The ``Runtime`` of the deployment a status / scale / rebalance command means (see the module docstring);
    sets ``args.name`` to its name."""
    import ray

    from ray_moe.runtime import Runtime

    env = read_env()
    if ray.is_initialized():  # this process's own cluster
        return _on_cluster(args)
    address = getattr(args, "address", None) or env.ray_address
    if address == PRIVATE:
        raise BadInput("--address local: a private instance has no deployment to show; leave --address out "
                       "for the deployments ray-moe serve runs on this machine")
    if address is not None:
        join(address, env)
        return _on_cluster(args)
    rec = started_here(env, args.name)
    join(rec.gcs_address, env, namespace=rec.namespace, token=rec.auth_mode == "token")
    args.name = rec.name
    try:
        return Runtime.connect(rec.name)
    except ValueError as exc:
        raise BadInput(f"{exc} (the ray-moe serve of pid {rec.pid} serves {rec.url} on the Ray instance at "
                       f"{rec.gcs_address})") from None


__all__ = ["BadInput", "DISCOVER", "PRIVATE", "connect_deployment", "deployments", "join", "serve_address",
           "started_here", "use_token_auth"]
