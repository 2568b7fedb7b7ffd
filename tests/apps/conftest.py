"""One HTTP port for every ``ray-moe serve`` the app tests start: Serve keeps one HTTP address per Ray cluster
(the tests share one), and ``run_server`` refuses a --host/--port the running Serve instance would not honour."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture(scope="session")
def serve_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
