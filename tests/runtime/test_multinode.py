"""Several Ray nodes on one machine (``ray.cluster_utils.Cluster``, CPU; ``ray_moe_dev.testing.multinode``): one
subprocess, one cluster (a head node with no CPU for shards, ``node_a`` and ``node_b`` with 2 CPUs each), every
scenario in turn; each test asserts on its scenario's report.

* placement: ranks spread over the nodes by the placement group, topology labels that match where the actors run,
  exact outputs over the flat and the hierarchical exchange;
* a rank added from a second, connected driver (issue 42: its topology held the new node alone);
* ``ray job submit`` of ``jobs/serve.py`` (the README's cluster flow) answered over HTTP;
* a node removed under generation traffic: no request lost (token-equal), the rank healed on a surviving node, the
  topology right on every shard.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def multinode() -> dict:
    proc = subprocess.run([sys.executable, "-m", "ray_moe_dev.testing.multinode"], capture_output=True, text=True,
                          timeout=840)
    line = [l for l in proc.stdout.splitlines() if l.startswith("MULTINODE ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[0].removeprefix("MULTINODE "))


def _ok(report: dict, name: str) -> dict:
    out = report[name]
    assert "error" not in out, out["error"]
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["flat", "hierarchical"])
def test_ranks_spread_by_the_placement_group_with_topology_labels_where_they_run(multinode, schedule):
    out = _ok(multinode, f"placement_{schedule}")
    actor_nodes = {int(k): v for k, v in out["actor_nodes"].items()}
    bundle_nodes = {int(k): v for k, v in out["bundle_nodes"].items()}
    assert actor_nodes == bundle_nodes  # every rank's actor runs on the node its bundle was reserved on
    assert sorted(list(actor_nodes.values()).count(n) for n in ("node_a", "node_b")) == [2, 2]  # SPREAD: 2 each
    topo = {int(k): v for k, v in out["topology"].items()}
    by_node: dict[str, list[int]] = {}
    for r in sorted(topo):
        assert topo[r]["ray_node"] == actor_nodes[r]
        by_node.setdefault(topo[r]["node"], []).append(r)
    assert len(by_node) == 2
    for node, ranks in by_node.items():  # ranks on one Ray node share a topology node, local ranks 0, 1
        assert [topo[r]["local_rank"] for r in ranks] == [0, 1] and len({actor_nodes[r] for r in ranks}) == 1
        assert out["relays"][node] == ranks[0]
    assert out["err"] < 1e-4
    inter = out["stats"]["ratios"]["inter_node"]
    assert inter["denominator"] == 24 * 2 and inter["numerator"] > 0


@pytest.mark.timeout(900)
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


@pytest.mark.timeout(900)
def test_ray_job_submit_of_jobs_serve_answers_over_http(multinode):
    out = _ok(multinode, "job_submit")
    assert len(out["retried"]) <= 1, out["retried"]  # one resubmission, only after the working-dir import failure
    assert out["submit_rc"] == 0, out["submit"]
    body = out["completion"]
    assert body is not None, out.get("logs")
    assert body["choices"][0]["token_ids"] == out["want"] and body["choices"][0]["finish_reason"] == "length"
    assert "ray-moe serve: 'tiny-job' on http://127.0.0.1:" in out["logs"] and "(joined)" in out["logs"]
    assert out["stop_rc"] == 0  # ray job stop accepted


@pytest.mark.timeout(900)
def test_a_node_removed_under_generation_traffic_is_healed_on_the_survivors(multinode):
    out = _ok(multinode, "node_loss")
    before = {int(r): n for r, n in out["before"].items()}
    assert sorted(before.values()) == ["node_a", "node_b", "node_c"]  # STRICT_SPREAD: one rank per node
    victim = out["victim"]
    assert out["killed_during"] and out["tokens_equal"], out  # nothing lost: every request token-equal
    assert out["moved"] > 0  # the lost rank's sequences were re-prefilled on the survivors
    heal = [e for e in out["heal"] if "replacement" in e]
    assert heal and heal[0]["lost"] == victim, out["heal_events"]
    new = heal[0]["replacement"]
    assert sorted(out["group"]) == sorted([r for r in before if r != victim] + [new])
    actors = {int(r): n for r, n in out["actors"].items()}
    assert actors[new] in ("node_a", "node_b")  # on a surviving node
    members = out["members"]
    assert members[str(victim)]["state"] == "gone" and members[str(victim)]["died"]
    assert members[str(new)]["replaces"] == victim and members[str(new)]["lineage"] == victim
    # the topology right on every shard: every live rank where its actor runs, the same on every shard as the
    # coordinator's (the lost rank stays in it where it was: global ranks are never reused)
    coord = {int(r): n for r, n in out["coordinator"].items()}
    assert {r: coord[r] for r in actors} == actors and coord[victim] == "node_c"
    for rank, topo in out["topologies"].items():
        assert {int(r): n for r, n in topo["ranks"].items()} == coord, rank
    assert out["after_equal"]  # the healed group serves the same tokens
