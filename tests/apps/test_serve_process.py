"""``ray-moe serve`` as a user runs it: its own process, its own private Ray instance, next to a foreign Ray
instance on the same machine (this test session's) that runs a deployment of the same name in the same
namespace. One server for the module:

* the commands it prints work as pasted, in a shell with nothing set but PATH and HOME (no RAY_AUTH_MODE, no
  RAY_ADDRESS: the state file says where the deployment is and that its Ray wants a token);
* ``status`` / ``scale`` / ``rebalance`` without ``--address`` reach the deployment the server runs, never the
  foreign cluster's;
* a second server on the same port (with its own Ray instance to be) exits non-zero before Ray or any shard
  starts, naming the address and who holds it, and the first keeps answering with its key enforced;
* SIGTERM to its process group (what ``timeout`` or a supervisor sends) stops it cleanly within 15 s.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")  # ray[serve]

import httpx  # noqa: E402

NAME = "mine"
KEY = "process-key-789"
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    """A shell with nothing set: this interpreter's bin first on PATH, HOME (Ray's token file lives there)."""
    return {"PATH": f"{BIN}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": os.environ.get("HOME", "/root"), **extra}


def _console() -> str:
    path = BIN / "ray-moe"
    if not path.exists():
        pytest.skip(f"no ray-moe console script beside {sys.executable} (pip install -e .)")
    return str(path)


@pytest.fixture(scope="module")
def foreign(ray_session):
    """The foreign cluster (this session's Ray instance) runs a deployment named like the server's, 2 ranks."""
    import ray_moe

    rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig(num_ranks=2, num_experts=4, hidden_size=16, ffn_size=32, top_k=2,
                                                     slots_per_rank=3, name=NAME))
    yield ray_session.get_runtime_context(), rt
    rt.shutdown()


@pytest.fixture(scope="module")
def served(foreign, tmp_path_factory):
    from ray_moe_dev.testing.hf_models import save_sentencepiece_tokenizer, tiny_model

    ctx, _ = foreign
    root = tmp_path_factory.mktemp("serve-process")
    _, folder = tiny_model("qwen3_moe", root / "tiny")
    save_sentencepiece_tokenizer(folder)
    state, port = root / "state", _free_port()
    env = _clean_env(RAY_MOE_STATE_DIR=str(state), RAY_MOE_NAMESPACE=ctx.namespace)
    proc = subprocess.Popen([_console(), "serve", str(folder), "--name", NAME, "--port", str(port), "--api-key", KEY,
                             "--data-parallel-size", "1", "--served-model-name", "tiny"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 420
    while not any("ray-moe rebalance" in ln for ln in lines):  # the last line it prints
        assert proc.poll() is None, "".join(lines)[-4000:]
        assert time.monotonic() < deadline, "".join(lines)[-4000:]
        time.sleep(0.5)
    info = {"proc": proc, "lines": lines, "port": port, "state": state, "folder": folder,
            "base": f"http://127.0.0.1:{port}"}
    try:
        yield info
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _printed_commands(lines: list[str]) -> list[str]:
    at = next(i for i, ln in enumerate(lines) if ln.strip() == "from another shell:")
    out = []
    for ln in lines[at + 1:]:
        if not ln.startswith("    "):
            break
        out.append(ln.strip())
    return out


def _run(cmd: list[str] | str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    argv = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.timeout(720)
def test_the_start_prints_the_kv_cache_against_the_running_limit(served):
    """What the engine's start says reaches the serve terminal (the replica's log does not): its KV cache (on CPU,
    8,192 tokens a rank) against the running limit (256 on CPU), before the commands."""
    lines = served["lines"]
    at = next(i for i, ln in enumerate(lines) if "KV cache:" in ln)
    assert at < next(i for i, ln in enumerate(lines) if ln.strip() == "from another shell:")
    assert "8,192 tokens a rank; 256 running sequences a rank get 32 tokens each" in lines[at], lines[at]
    # then how each step kind runs on the first rank (``status``'s paths): on CPU no graphs, the masked backend
    steps = [ln.strip() for ln in lines[at + 1:at + 7]]
    assert any(ln.startswith("decode steps: eager (CUDA graphs are off: the device is a CPU") for ln in steps), steps
    assert "long prompt chunks attend through: masked" in steps, steps
    # ... and the experts' kernels: on CPU no tiled kernels, and why
    assert any(ln.startswith("experts compute through: the skinny Triton kernels (CUDA) to 16 rows a slot, no tiled "
                             "kernels (device cpu") for ln in steps), steps


def test_the_printed_commands_work_as_pasted(served, foreign):
    cmds = _printed_commands(served["lines"])
    assert [c.split("ray-moe ")[1].split()[0] for c in cmds] == ["status", "scale"], served["lines"]
    status, scale = (_run(c, _clean_env()) for c in cmds)
    assert status.returncode == 0, status.stderr
    assert f"deployment {NAME!r}" in status.stdout and "rank 0:" in status.stdout
    assert "rank 1:" not in status.stdout  # the server's one rank, not the foreign deployment's two
    assert scale.returncode == 0, scale.stderr
    assert json.loads(scale.stdout)["new_generation"] >= 1
    # once it has served traffic, rebalance (no --name, no --address: the only deployment started here)
    for i in range(4):  # (the load reaches the coordinator every 4 steps)
        r = httpx.post(f"{served['base']}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"model": "tiny", "prompt": [1 + i, 2, 3], "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
    rebalance = _run([_console(), "rebalance"], _clean_env(RAY_MOE_STATE_DIR=str(served["state"])))
    assert rebalance.returncode == 0, rebalance.stderr
    assert json.loads(rebalance.stdout)["new_generation"] > json.loads(scale.stdout)["new_generation"]
    _, rt = foreign
    assert rt.placement().generation == 0 and rt.placement().num_ranks == 2  # the foreign one never moved


def test_status_reaches_the_deployment_started_here_never_the_foreign_clusters(served):
    env = _clean_env(RAY_MOE_STATE_DIR=str(served["state"]))
    res = _run([_console(), "status", "--json"], env)  # no --name, no --address: the one the server runs
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert body["deployment"] == NAME and list(body["slots_per_rank"]) == ["0"]
    res = _run([_console(), "status", "--name", "theirs"], env, timeout=60)
    assert res.returncode == 2
    err = res.stderr.strip()
    assert "--name='theirs': no ray-moe serve on this machine runs a deployment of that name" in err
    assert f"running here: {NAME} (http://127.0.0.1:{served['port']}/v1" in err


def test_a_second_server_on_the_same_port_is_refused_and_the_first_keeps_its_key(served):
    port, base = served["port"], served["base"]
    env = _clean_env(RAY_MOE_STATE_DIR=str(served["state"]))
    t0 = time.monotonic()
    res = _run([_console(), "serve", str(served["folder"]), "--name", "second", "--port", str(port)], env, timeout=120)
    assert res.returncode != 0 and time.monotonic() - t0 < 60, res.stderr
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith(f"ray-moe serve: error: --host 127.0.0.1 --port {port}: the address is already in use")
    if Path("/proc/net/tcp").exists():
        assert "ray::ProxyActor" in err and f"deployment {NAME!r}" in err, err
    assert "Started a local Ray instance" not in res.stderr and not (served["state"] / "second.json").exists()
    codes = [httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1},
                        timeout=60).status_code for _ in range(10)]
    assert codes == [401] * 10
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


def test_sigterm_to_the_process_group_stops_it_cleanly(served):
    from ray_moe.apps.deployments import read_record, record_path
    from ray_moe.apps.serve_run import gcs_alive

    proc, state = served["proc"], served["state"]
    rec = read_record(record_path(state, NAME))
    assert rec is not None and rec.pid == proc.pid and rec.ray == "private" and rec.auth_mode == "token"
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    rc = proc.wait(15)
    took = time.monotonic() - t0
    time.sleep(0.5)  # (the reader thread takes the last lines)
    out = "".join(served["lines"])
    assert rc == 0 and took < 15, (rc, took, out[-3000:])
    assert "ray-moe serve: stopped (SIGTERM)" in out and "Traceback" not in out and "GCS" not in out.split(
        "from another shell:")[-1], out[-3000:]
    assert not record_path(state, NAME).exists()
    assert not gcs_alive(rec.gcs_address)
