"""The ``ray-moe`` command against a running deployment (found through its named coordinator).

In-process (``main([...])`` on the session's Ray instance) and as the installed console script in a
subprocess that joins the session's instance by its GCS address: errors are one line (no traceback, no
Ray banner, no ANSI codes) with exit code 2 for bad input and 1 for other failures.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ray_moe
from ray_moe.apps.cli import main, shown_generations

REPO = Path(__file__).resolve().parents[2]


def console_script() -> str:
    """The ``ray-moe`` entry point installed beside this interpreter (pip install -e . / pip install .)."""
    path = Path(sys.executable).parent / "ray-moe"
    if not path.exists():
        pytest.skip(f"no ray-moe console script beside {sys.executable} (pip install -e .)")
    return str(path)


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """The console script in a child process; this checkout first on its path, the session's env (the
    RAY_AUTH_MODE=token that the session's ray.init set, and the token file it made) unless ``env`` overrides."""
    child = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child.pop("RAY_ADDRESS", None)
    child.update(env or {})
    child = {k: v for k, v in child.items() if v is not None}
    return subprocess.run([console_script(), *args], capture_output=True, text=True, env=child, timeout=timeout,
                          cwd=cwd or REPO)


def assert_one_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    line = lines[0]
    assert "Traceback" not in line and "ray::" not in line and "\x1b[" not in line, line
    return line


def session(ray_session) -> tuple[str, dict]:
    """The session's GCS address and the child env that finds its deployments (their Ray namespace)."""
    ctx = ray_session.get_runtime_context()
    return ctx.gcs_address, {"RAY_MOE_NAMESPACE": ctx.namespace}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployed(ray_session):
    rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig(num_ranks=3, num_experts=6, hidden_size=16, ffn_size=32, top_k=2,
                                                     slots_per_rank=3, name="cli-test", router_skew=1.0))
    for _ in range(6):
        rt.forward(torch.randn(24, 16))
    rt.flush_load()
    yield rt
    rt.shutdown()


def test_status_json(deployed, capsys):
    assert main(["status", "--name", "cli-test", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    g = deployed.placement().generation
    assert body["active_generation"] == g
    assert body["generations"][str(g)]["state"] == "ACTIVE" and body["generations"][str(g)]["refcount"] == 0
    assert sum(body["replica_counts"]["0"]) == 9
    names = {r["metric"] for r in body["telemetry"]["ratios"]}
    assert "moe_remote_route_ratio" in names
    # every rank served the six steps; no generation, no failed capture
    assert set(body["shards"]) == {"0", "1", "2"}
    assert all(sh["steps"] >= 6 and sh["generate_steps"] == 0 and sh["capture_error"] is None
               for sh in body["shards"].values())
    # the coordinator's target and members: three live ranks, each in its bundle of the start's placement group
    m = body["members"]
    assert m["target"]["ranks"] == 3 and m["target"]["set_by"] == "start" and m["converged"]
    assert {r: x["state"] for r, x in m["members"].items()} == {"0": "live", "1": "live", "2": "live"}
    assert [x["bundle"][1] for x in m["members"].values()] == [0, 1, 2]
    assert m["healer"]["retries"] == 0 and m["scaler"] is None


def test_status_table(deployed, capsys):
    assert main(["status", "--name", "cli-test"]) == 0
    out = capsys.readouterr().out
    assert "ACTIVE" in out and "moe_remote_route_ratio" in out and "publish" in out
    assert "rank 2:" in out and "no generation" in out and "CAPTURE FAILED" not in out
    assert "target: 3 ranks (version 0, set by start: start); converged" in out
    assert "  rank 1: live, bundle 1 of " in out and "healing: off" in out


def test_scale_and_rebalance_commands(deployed, capsys):
    g0 = deployed.placement().generation
    assert main(["scale", "--name", "cli-test", "--expert", "2", "--replicas", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_generation"] > g0 and out["replica_counts"][2] == 3
    assert main(["rebalance", "--name", "cli-test"]) == 0
    out2 = json.loads(capsys.readouterr().out)
    assert out2["new_generation"] > out["new_generation"]
    assert out2["replica_counts"][2] == 3  # the manual scale is a floor the rebalance kept
    assert main(["status", "--name", "cli-test", "--json"]) == 0
    assert {"layer": 0, "expert": 2, "replicas": 3} in json.loads(capsys.readouterr().out)["replica_floors"]
    assert main(["status", "--name", "cli-test"]) == 0
    assert "expert 2 layer 0 >= 3" in capsys.readouterr().out
    # the driver that owns the deployment keeps serving on the new generation
    y = deployed.forward(torch.randn(5, 16))
    assert y.shape == (5, 16)
    assert deployed.generations()[g0] == "RETIRED"


def test_unknown_deployment_is_a_clear_error(ray_session, capsys):
    assert main(["status", "--name", "no-such-deployment"]) == 2
    line = assert_one_line(capsys.readouterr().err)
    assert line.startswith("ray-moe status: error: ") and "no-such-deployment" in line


def test_bad_scale_is_refused_before_anything_moves(deployed, capsys):
    g = deployed.placement().generation
    assert main(["scale", "--name", "cli-test", "--expert", "99", "--replicas", "2"]) == 2
    line = assert_one_line(capsys.readouterr().err)
    assert line == "ray-moe scale: error: expert=99 is out of range [0, 6)"
    assert deployed.placement().generation == g


def test_status_lists_live_and_last_three_retired_generations(deployed, capsys):
    for replicas in (2, 1, 2, 1):  # four more publications: four more RETIRED generations
        deployed.scale(expert=4, replicas=replicas)
    every = deployed.generations()
    retired = sorted(g for g, st in every.items() if st == "RETIRED")
    assert len(retired) > 3
    assert main(["status", "--name", "cli-test", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    shown = {int(g): v["state"] for g, v in body["generations"].items()}
    assert {g for g, st in shown.items() if st == "RETIRED"} == set(retired[-3:])
    assert {g for g, st in shown.items() if st != "RETIRED"} == {g for g, st in every.items() if st != "RETIRED"}
    assert body["generations_hidden"] == len(every) - len(shown)
    assert main(["status", "--name", "cli-test", "--all", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert len(body["generations"]) == len(every) and body["generations_hidden"] == 0
    assert main(["status", "--name", "cli-test"]) == 0
    out = capsys.readouterr().out
    assert f"({len(every) - len(shown)} older RETIRED generation(s) not shown; --all lists every generation)" in out


def test_shown_generations_keeps_live_ones_and_the_last_retired():
    gens = {0: "RETIRED", 1: "RETIRED", 2: "RETIRED", 3: "RETIRED", 4: "RETIRED", 5: "DRAINING", 6: "ACTIVE",
            7: "PENDING"}
    shown, hidden = shown_generations(gens)
    assert shown == {2: "RETIRED", 3: "RETIRED", 4: "RETIRED", 5: "DRAINING", 6: "ACTIVE", 7: "PENDING"}
    assert hidden == 2
    assert shown_generations(gens, show_all=True) == (dict(sorted(gens.items())), 0)
    assert shown_generations({0: "ACTIVE"}) == ({0: "ACTIVE"}, 0)


# ------------------------------------------------------------------ the console script, as a user runs it
def test_console_script_bad_scale_against_the_running_deployment(deployed, ray_session):
    g = deployed.placement().generation
    address, env = session(ray_session)
    res = run_cli("scale", "--address", address, "--name", "cli-test", "--expert", "99", "--replicas", "2", env=env)
    assert res.returncode == 2, res.stderr
    assert assert_one_line(res.stderr) == "ray-moe scale: error: expert=99 is out of range [0, 6)"
    assert res.stdout == ""
    assert deployed.placement().generation == g


def test_console_script_status_of_the_running_deployment(deployed, ray_session):
    address, env = session(ray_session)
    res = run_cli("status", "--address", address, "--name", "cli-test", "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["active_generation"] == deployed.placement().generation
    assert res.stderr.strip() == ""  # no Ray connection logs


def test_console_script_unknown_deployment(ray_session):
    address, env = session(ray_session)
    res = run_cli("status", "--address", address, "--name", "no-such-deployment", env=env)
    assert res.returncode == 2
    line = assert_one_line(res.stderr)
    assert "no-such-deployment" in line and "not found" in line


def test_console_script_no_cluster_at_the_address():
    port = free_port()
    t0 = time.monotonic()
    res = run_cli("status", "--address", f"127.0.0.1:{port}", "--name", "x")
    assert time.monotonic() - t0 < 30
    assert res.returncode == 1
    line = assert_one_line(res.stderr)
    assert line.startswith(f"ray-moe status: error: no Ray cluster at 127.0.0.1:{port} (connection refused)")
    assert "ray start --head" in line


def test_console_script_without_the_token(ray_session):
    """The session cluster runs with token authentication; a shell without RAY_AUTH_MODE=token is refused in one
    line that says what to export, within seconds (no 20 s of "Unauthenticated" retries)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        pytest.skip("the session's Ray instance runs without token authentication")
    address, env = session(ray_session)
    t0 = time.monotonic()
    res = run_cli("status", "--address", address, "--name", "cli-test", env={**env, "RAY_AUTH_MODE": "disabled"})
    assert time.monotonic() - t0 < 15
    assert res.returncode == 1
    line = assert_one_line(res.stderr)
    assert "requires token authentication" in line and "export RAY_AUTH_MODE=token" in line
    assert "ray get-auth-token" in line and "Unauthenticated" not in res.stderr
    res = run_cli("status", "--address", address, "--name", "cli-test",
                  env={**env, "RAY_AUTH_TOKEN": "not-the-cluster-token"})
    assert res.returncode == 1
    assert "refused this shell's authentication token" in assert_one_line(res.stderr)


def test_demo_smoke(ray_session, tmp_path, capsys):
    """The demo serves generation in the shards with a live rebalance and checks every token against
    transformers' generate (a small run here)."""
    rc = main(["demo", "--prompts", "6", "--new-tokens", "8", "--ranks", "3", "--experts", "8",
               "--slots-per-rank", "4", "--json", str(tmp_path / "demo.json"), "--png", str(tmp_path / "demo.png")])
    assert rc == 0
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["mismatches"] == [] and 6 <= report["tokens"] <= 48
    assert report["outputs"] == report["reference"]
    assert report["rebalance"]["generation"] >= 1  # published while generating
    assert sum(report["rank_rows_before_rebalance"]) > 0 and sum(report["rank_rows_after_rebalance"]) > 0
    assert (tmp_path / "demo.png").stat().st_size > 1000
    out = capsys.readouterr()
    assert "every generated token equal to transformers' generate" in out.out
    # the progress bar goes to stderr: a redirected stdout holds the report only, no carriage-return line
    assert "generating" in out.err and "\r" not in out.out and "generating:" not in out.out


def test_demo_rebalance_after_the_last_step_generates_again(ray_session, tmp_path, monkeypatch):
    """A rebalance published after the last step (the watch saw no decision: the scripted one runs after generation)
    leaves no rows after it; the demo then generates the prompts again over the new placement, checks them too, and
    reports that pass's load."""
    from ray_moe.apps import demo

    monkeypatch.setattr(demo._AutopilotWatch, "_run", lambda self: self._stop.wait())
    monkeypatch.setattr(demo._AutopilotWatch, "finish", lambda self, grace_s: (self._stop.set(), [])[1])
    rc = main(["demo", "--prompts", "4", "--new-tokens", "6", "--ranks", "2", "--experts", "8", "--quiet",
               "--slots-per-rank", "5", "--json", str(tmp_path / "demo.json"), "--png", str(tmp_path / "demo.png")])
    report = json.loads((tmp_path / "demo.json").read_text())
    assert rc == 0 and report["mismatches"] == [] and report["rebalance"]["decided_by"].startswith("script")
    assert report["outputs_after_rebalance"] == report["reference"] == report["outputs"]
    assert sum(report["rank_rows_before_rebalance"]) > 0 and sum(report["rank_rows_after_rebalance"]) > 0


def test_status_shard_lines_name_a_failed_capture():
    from ray_moe.apps.cli import shard_lines

    out = shard_lines({1: {"counters": {"steps": 7, "generate_steps": 5, "graph_replays": 3, "deferred_tokens": 4,
                                        "multi_step_requests": 2, "device_busy_us": 1_500_000},
                           "capture_error": "decode: RuntimeError: x"}, 0: {"counters": {}}})
    assert list(out) == ["0", "1"]
    assert out["1"] == {"steps": 7, "generate_steps": 5, "graph_replays": 3, "deferred_tokens": 4,
                        "multi_step_requests": 2, "device_busy_s": 1.5, "capture_error": "decode: RuntimeError: x",
                        "fused_kernels": None, "prefix_hit_tokens": 0, "prefix_lookup_tokens": 0, "kv_blocks": None}
    assert out["0"]["steps"] == 0 and out["0"]["capture_error"] is None


def test_status_prints_the_prefix_cache_share_and_the_block_pool():
    from ray_moe.apps.cli import prefix_line, shard_lines

    kv = {"free": 50, "held": 10, "cached": 4, "hashed": 9, "evictions": 2}
    out = shard_lines({0: {"counters": {"prefix_hit_tokens": 48, "prefix_lookup_tokens": 160}, "kv_blocks": kv},
                       1: {"counters": {}}})
    assert prefix_line(out["0"]) == ("; prefix cache 48 of 160 prompt tokens (30.0%), blocks 10 held / 4 cached / "
                                     "50 free, 2 evicted")
    assert prefix_line(out["1"]) == ""  # no prefill yet: nothing to say


def test_serve_fused_kernels_flag_parses():
    from ray_moe.apps.cli import build_parser

    base = ["serve", "--checkpoint", "/tmp/x", "--ranks", "2"]
    assert build_parser().parse_args(base).fused_kernels is True
    assert build_parser().parse_args(base + ["--no-fused-kernels"]).fused_kernels is False


def test_serve_prefix_caching_flag_parses():
    from ray_moe.apps.cli import build_parser

    base = ["serve", "--checkpoint", "/tmp/x", "--ranks", "2"]
    assert build_parser().parse_args(base).prefix_caching is True
    assert build_parser().parse_args(base + ["--no-prefix-caching"]).prefix_caching is False


def test_fused_line_says_what_took_the_kernels_and_what_kept_its_own():
    from ray_moe.apps.cli import fused_line

    assert fused_line(None) == ""
    assert fused_line({"norm_layers": 0, "rotary_modules": [], "skipped": {}}) == ""  # CPU: nothing tried
    full = {"norm_layers": 33, "rotary_modules": ["transformers.models.qwen3_moe.modeling_qwen3_moe"], "skipped": {}}
    assert fused_line(full) == "; fused kernels: 33 norm layers, rotary"
    assert fused_line({**full, "router_layers": 48, "qkv_modules": 48}) == \
        "; fused kernels: 33 norm layers, rotary, 48 routers, 48 qkv"
    part = {"norm_layers": 0, "rotary_modules": [],
            "skipped": {"GemmaRMSNorm": "another formula: x", "transformers.models.x.modeling_x": "another signature"}}
    line = fused_line(part)
    assert line.startswith("; fused kernels: none (transformers' own kept for ")
    assert "GemmaRMSNorm: another formula: x" in line and "modeling_x: another signature" in line
