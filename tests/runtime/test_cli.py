"""The ``ray-moe`` command against a running deployment (found through its named coordinator)."""

from __future__ import annotations

import json

import pytest
import torch

import ray_moe
from ray_moe.cli import main


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


def test_status_table(deployed, capsys):
    assert main(["status", "--name", "cli-test"]) == 0
    out = capsys.readouterr().out
    assert "ACTIVE" in out and "moe_remote_route_ratio" in out and "publish" in out


def test_scale_and_rebalance_commands(deployed, capsys):
    g0 = deployed.placement().generation
    assert main(["scale", "--name", "cli-test", "--expert", "2", "--replicas", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_generation"] > g0 and out["replica_counts"][2] == 3
    assert main(["rebalance", "--name", "cli-test"]) == 0
    out2 = json.loads(capsys.readouterr().out)
    assert out2["new_generation"] > out["new_generation"]
    # the driver that owns the deployment keeps serving on the new generation
    y = deployed.forward(torch.randn(5, 16))
    assert y.shape == (5, 16)
    assert deployed.generations()[g0] == "RETIRED"


def test_unknown_deployment_is_a_clear_error(ray_session, capsys):
    assert main(["status", "--name", "no-such-deployment"]) == 2
    assert "no-such-deployment" in capsys.readouterr().err


def test_bad_scale_is_refused_before_anything_moves(deployed, capsys):
    g = deployed.placement().generation
    assert main(["scale", "--name", "cli-test", "--expert", "99", "--replicas", "2"]) == 2
    assert "expert=99" in capsys.readouterr().err
    assert deployed.placement().generation == g


def test_demo_smoke(ray_session, tmp_path, capsys):
    rc = main(["demo", "--steps", "6", "--layers", "2", "--experts", "8", "--slots-per-rank", "3", "--quiet",
               "--json", str(tmp_path / "demo.json"), "--png", str(tmp_path / "demo.png")])
    assert rc == 0
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["mismatches"] == [] and report["steps"] == 6
    assert (tmp_path / "demo.png").stat().st_size > 1000
    assert "every output equal to the reference" in capsys.readouterr().out
