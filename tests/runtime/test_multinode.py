"""Several Ray nodes on one machine (``ray.cluster_utils.Cluster``, CPU; ``ray_moe_dev.testing.multinode``): one
subprocess, one cluster, every scenario; each test asserts on its scenario's report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def multinode() -> dict:
    proc = subprocess.run([sys.executable, "-m", "ray_moe_dev.testing.multinode"], capture_output=True, text=True,
                          timeout=600)
    line = [l for l in proc.stdout.splitlines() if l.startswith("MULTINODE ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[0].removeprefix("MULTINODE "))


def _ok(report: dict, name: str) -> dict:
    out = report[name]
    assert "error" not in out, out["error"]
    return out


@pytest.mark.timeout(660)
def test_add_rank_from_a_connected_runtime_keeps_every_rank_in_the_topology(multinode):
    """Issue 42: a ``Runtime.connect``-ed driver's ``add_rank`` rebuilt the topology from the new node alone and
    pushed it to every shard. Ranks on two nodes, a rank added from the second driver: every shard holds every
    rank, each on the node its actor runs on."""
    out = _ok(multinode, "connected_add_rank")
    before = {int(r): n for r, n in out["before"].items()}
    assert sorted(before.values()) == ["node_a", "node_b"]  # SPREAD: one rank per node
    actors = {int(r): n for r, n in out["actors"].items()}
    assert sorted(actors) == [0, 1, out["new"]] and {actors[r] for r in (0, 1)} == set(before.values())
    for rank, topo in out["topologies"].items():
        ranks = {int(r): n for r, n in topo["ranks"].items()}
        assert ranks == actors, (rank, ranks, actors)
        assert topo["nodes"] == 2
    assert out["err"] < 1e-4
