"""``ray-moe`` serve and status without Ray: ``serve`` with no address and no cluster on this machine goes on to
start a local instance (a refused token still fails), and a command whose stdout is a closed pipe (``ray-moe
status | head``) ends quietly: no ``error: BrokenPipeError`` line, no traceback, exit code 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ray_moe.apps import cli
from ray_moe.core.errors import ClusterAuthError, ClusterConnectionError


def test_closed_stdout_ends_quietly():
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes
    try:
        p = subprocess.run([sys.executable, "-m", "ray_moe.apps.cli", "bench"], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    finally:
        os.close(w)
    assert p.returncode == 0 and "BrokenPipe" not in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("failure", [None, ClusterConnectionError("no running Ray cluster found on this machine")])
def test_serve_joins_this_machines_cluster_else_goes_local(monkeypatch, failure):
    from ray_moe.apps import server
    from ray_moe.ray import connection

    calls: list = []

    def join(address=None, *a, **kw):
        calls.append(address)
        if failure is not None and address is None:  # nothing found on this machine
            raise failure

    monkeypatch.setattr(connection, "join_cluster", join)
    monkeypatch.setattr(server, "run_server", lambda args, **kw: calls.append("run") or 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["serve", "--checkpoint", "/x"]) == 0
    assert calls == [None, "run"]  # joined (or not: run_server then starts a local instance)
    calls.clear()
    assert cli.main(["serve", "--checkpoint", "/x", "--address", "local"]) == 0 and calls == ["run"]
    calls.clear()
    assert cli.main(["serve", "--checkpoint", "/x", "--address", "10.0.0.9:6379"]) == 0
    assert calls == ["10.0.0.9:6379", "run"]


def test_serve_with_a_refused_token_still_fails(monkeypatch, capsys):
    from ray_moe.apps import server
    from ray_moe.ray import connection

    def join(address=None, *a, **kw):
        raise ClusterAuthError("this machine's Ray cluster requires token authentication")

    monkeypatch.setattr(connection, "join_cluster", join)
    monkeypatch.setattr(server, "run_server", lambda args: pytest.fail("must not start"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["serve", "--checkpoint", "/x"]) == 1
    assert "token authentication" in capsys.readouterr().err
