"""Shared fixtures of the app tests. ``serve_port``: one HTTP port for every ``ray-moe serve`` the app tests start:
Serve keeps one HTTP address per Ray cluster (the tests share one), and ``run_server`` refuses a --host/--port the
running Serve instance would not honour. ``serve_running``: runs ``run_server(args, config_fields=...)`` on a thread until the API
answers ``/health`` (the replica started its generation loop), yields the base URL, then stops it. Every server
these tests start records itself in a temporary state directory (``RAY_MOE_STATE_DIR``), never ``~/.ray-moe``."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, Callable, ContextManager, Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def state_dir(tmp_path_factory) -> Iterator[str]:
    """``RAY_MOE_STATE_DIR`` for the session: where ``ray-moe serve`` records the deployments it runs."""
    import os

    folder = str(tmp_path_factory.mktemp("ray-moe-state"))
    before = os.environ.get("RAY_MOE_STATE_DIR")
    os.environ["RAY_MOE_STATE_DIR"] = folder
    yield folder
    if before is None:
        os.environ.pop("RAY_MOE_STATE_DIR", None)
    else:
        os.environ["RAY_MOE_STATE_DIR"] = before


# below the kernel's ephemeral ports (32768-60999) and above Ray's workers' (10002-19999)
SERVE_PORTS = range(20000, 32000)


@pytest.fixture(scope="session")
def serve_port() -> int:
    """A port free now, outside the ranges other processes take ports from on their own: an ephemeral port
    (bound to 0 and released) was later taken by an outgoing connection or a Ray process's gRPC server before
    Serve's proxy bound it ("Failed to bind to address", then "illegal request line" from every app test of a CI
    run)."""
    import random

    for port in random.Random().sample(SERVE_PORTS, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {SERVE_PORTS}")


@contextlib.contextmanager
def _serve_running(args: Any, config_fields: dict | None = None) -> Iterator[str]:
    import httpx

    from ray_moe.apps.server import run_server

    ready, stop = threading.Event(), threading.Event()
    errors: list = []

    def run():
        try:
            run_server(args, ready=ready, stop=stop, config_fields=config_fields)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            ready.set()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    assert ready.wait(240) and not errors, errors
    base = f"http://{args.host}:{args.port}"
    for _ in range(240):  # the replica starts the generation loop (every shard loads the model)
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        threading.Event().wait(0.5)
    try:
        yield base
    finally:
        stop.set()
        th.join(timeout=120)


@pytest.fixture(scope="session")
def serve_running() -> Callable[..., ContextManager[str]]:
    return _serve_running
