"""Two raylets on this machine: one actor per rank, placed by the placement group, and topology labels
that match where the actors actually run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(schedule: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "ray_moe_dev.testing.cluster_check", schedule],
                          capture_output=True, text=True, timeout=240)
    line = [l for l in proc.stdout.splitlines() if l.startswith("CLUSTER_CHECK ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[0].removeprefix("CLUSTER_CHECK "))


@pytest.mark.timeout(300)
def test_two_node_placement_and_topology():
    out = _run("flat")
    actor_nodes = {int(k): v for k, v in out["actor_nodes"].items()}
    bundle_nodes = {int(k): v for k, v in out["bundle_nodes"].items()}
    # every rank's actor runs on the node its placement-group bundle was reserved on
    assert actor_nodes == bundle_nodes
    # SPREAD over two nodes of capacity two bundles each: two ranks per node
    assert sorted(list(actor_nodes.values()).count(n) for n in ("node_a", "node_b")) == [2, 2]
    topo = {int(k): v for k, v in out["topology"].items()}
    for r, t in topo.items():
        assert t["ray_node"] == actor_nodes[r]
    # ranks on one Ray node share one topology node and get local ranks 0, 1
    by_node: dict[str, list[int]] = {}
    for r in sorted(topo):
        by_node.setdefault(topo[r]["node"], []).append(r)
    assert len(by_node) == 2
    for node, ranks in by_node.items():
        assert [topo[r]["local_rank"] for r in ranks] == [0, 1]
        assert len({actor_nodes[r] for r in ranks}) == 1
        assert out["relays"][node] == ranks[0]
    assert out["max_abs_err"] < 1e-4
    inter = out["stats"]["ratios"]["inter_node"]
    assert inter["denominator"] == 96 and inter["numerator"] > 0


@pytest.mark.timeout(300)
def test_two_node_hierarchical_exchange_equals_reference():
    out = _run("hierarchical")
    assert out["max_abs_err"] < 1e-4
    assert out["stats"]["ratios"]["inter_node"]["numerator"] > 0
