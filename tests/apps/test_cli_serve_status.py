"""``ray-moe`` serve and status without Ray: ``serve`` starts a private instance unless an address is given (it
never joins a cluster it merely finds), an address with no cluster fails in one line, and a command whose stdout
is a closed pipe (``ray-moe status | head``) ends quietly: no ``error: BrokenPipeError`` line, no traceback, exit
code 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ray_moe.apps import cli


def test_closed_stdout_ends_quietly():
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes
    try:
        p = subprocess.run([sys.executable, "-m", "ray_moe.apps.cli", "bench"], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    finally:
        os.close(w)
    assert p.returncode == 0 and "BrokenPipe" not in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_serve_starts_a_private_instance_unless_an_address_is_given(monkeypatch):
    """No --address and no RAY_ADDRESS: a private instance (never a cluster merely found on this machine);
    --address local says so; --address / RAY_ADDRESS / --address auto join."""
    from ray_moe.apps.connect import serve_address
    from ray_moe.core.env import read_env

    def addr(argv: list[str], env: dict | None = None) -> str | None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        return serve_address(cli.build_parser().parse_args(["serve", "/x", *argv]), read_env())

    assert addr([]) is None and addr(["--address", "local"]) is None
    assert addr(["--address", "auto"]) == "auto"
    assert addr(["--address", "10.0.0.9:6379"]) == "10.0.0.9:6379"
    assert addr([], {"RAY_ADDRESS": "10.0.0.7:6379"}) == "10.0.0.7:6379"
    assert addr(["--address", "local"], {"RAY_ADDRESS": "10.0.0.7:6379"}) is None


def test_serve_without_an_address_never_looks_for_a_cluster(monkeypatch, tmp_path):
    from ray_moe.apps import server
    from ray_moe.ray import connection

    seen: list = []
    monkeypatch.setattr(connection, "join_cluster", lambda *a, **k: pytest.fail("must not join a cluster"))
    monkeypatch.setattr(server, "run_server", lambda args, **kw: seen.append(args) or 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_MOE_STATE_DIR", str(tmp_path))
    assert cli.main(["serve", "/x", "--port", str(free_port())]) == 0
    assert seen[0].checkpoint == "/x" and seen[0].ranks == 2


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_at_an_address_with_no_cluster_fails_in_one_line(tmp_path):
    """The join path, as a user runs it: nothing listens at the address -> one line, exit 1, in seconds."""
    from ray_moe_dev.testing.hf_models import tiny_model

    _, folder = tiny_model("qwen3_moe", tmp_path / "tiny")
    ray_port = free_port()
    env = {**os.environ, "RAY_MOE_STATE_DIR": str(tmp_path / "state")}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, "-m", "ray_moe.apps.cli", "serve", str(folder), "--address",
                        f"127.0.0.1:{ray_port}", "--port", str(free_port())], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 1, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"ray-moe serve: error: no Ray cluster at 127.0.0.1:{ray_port} (connection refused)")
    assert "ray start --head" in lines[0]


def test_state_files_name_the_deployments_started_here_and_stale_ones_go(tmp_path, monkeypatch):
    """What status / scale / rebalance read without --address: the live servers' state files (a file whose
    process is gone is removed), by name, else the only one; none or an unknown name: BadInput saying what runs."""
    from ray_moe.apps.connect import BadInput, started_here
    from ray_moe.apps.deployments import live_records, new_record, record_path, write_record
    from ray_moe.core.env import read_env

    monkeypatch.setenv("RAY_MOE_STATE_DIR", str(tmp_path))
    env = read_env()
    with pytest.raises(BadInput, match=r"no ray-moe serve runs on this machine \(RAY_MOE_STATE_DIR="):
        started_here(env, None)
    mine = new_record(name="mine", gcs_address="127.0.0.1:1", namespace="ns", auth_mode="token",
                      url="http://127.0.0.1:8000/v1", model="m", ray="private")
    write_record(tmp_path, mine)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = type(mine)(**{**mine.__dict__, "name": "gone", "pid": int(gone.stdout)})
    write_record(tmp_path, dead)
    assert oct(record_path(tmp_path, "mine").stat().st_mode & 0o777) == "0o600"
    assert [r.name for r in live_records(tmp_path)] == ["mine"] and not record_path(tmp_path, "gone").exists()
    assert started_here(env, None) == mine and started_here(env, "mine") == mine
    with pytest.raises(BadInput, match=r"--name='theirs': no ray-moe serve on this machine .* \(running here: mine "
                                       r"\(http://127\.0\.0\.1:8000/v1, pid"):
        started_here(env, "theirs")
    write_record(tmp_path, type(mine)(**{**mine.__dict__, "name": "other"}))
    with pytest.raises(BadInput, match="several ray-moe deployments run on this machine, pick one"):
        started_here(env, None)


def test_sigint_and_sigterm_stop_a_serving_server_and_unwind_a_starting_one():
    """The server's handlers (``serve_run.SignalGuard``): while serving, SIGINT / SIGTERM ask it to stop (its loop
    then tears everything down); while starting, they unwind what started (KeyboardInterrupt); a second signal while
    stopping ends it at once; the handlers before are restored. (SIGTERM to a real server's process group:
    test_serve_process.py.)"""
    import signal
    import threading

    from ray_moe.apps.serve_run import SignalGuard

    before = signal.getsignal(signal.SIGINT)
    done = threading.Event()
    guard = SignalGuard(done)
    try:
        with pytest.raises(KeyboardInterrupt):  # starting
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(1)
        assert done.is_set() and guard.received == signal.SIGTERM
        done.clear()
        guard.received, guard.serving = None, True
        os.kill(os.getpid(), signal.SIGINT)  # serving: stop, no exception
        threading.Event().wait(0.2)
        assert done.is_set() and guard.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):  # a second one while it stops
            os.kill(os.getpid(), signal.SIGINT)
            threading.Event().wait(1)
    finally:
        guard.restore()
    assert signal.getsignal(signal.SIGINT) is before
