"""Several Ray nodes on one machine (``ray.cluster_utils.Cluster``, CPU): the multi-node scenarios of
``tests/runtime/test_multinode.py``, run in one subprocess against one cluster (a test session already owns a
local Ray instance, and a cluster costs seconds to start). Run as

    python -m ray_moe_dev.testing.multinode [SCENARIO ...]

Each scenario writes one JSON-able dict (an ``error`` key with the traceback when it failed; the others still
run); one line ``MULTINODE <json>`` is printed at the end with every scenario's result by name.

The cluster: a head node with no CPU for shards (the driver, the coordinator and Serve's proxy) and worker nodes
``node_a``, ``node_b`` (2 CPUs each; a custom resource of the same name tells them apart).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any, Callable

TINY = dict(num_experts=4, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=3, tagged_weights=True,
            exchange_timeout_s=20.0)


def node_names() -> dict[str, str]:
    """Ray node id -> ``head`` / ``node_a`` / ``node_b`` / ... (the custom resource it carries)."""
    import ray

    out = {}
    for n in ray.nodes():
        res = n.get("Resources", {})
        tags = [k for k in res if k.startswith("node_")]
        out[n["NodeID"]] = tags[0] if tags else "head"
    return out


def shard_topologies(handles: dict[int, Any]) -> dict[int, dict[str, Any]]:
    """Every shard's own topology, as its rank's view: {rank: {"ranks": {r: ray node}, "nodes": n}}."""
    import ray

    from ray_moe.placement.topology import Topology

    names = node_names()
    out = {}
    for r, h in sorted(handles.items()):
        topo = Topology.model_validate_json(ray.get(h.topology_json.remote(), timeout=60))
        out[r] = {"ranks": {ri.rank: names.get(ri.ray_node_id or "", ri.ray_node_id) for ri in topo.ranks},
                  "nodes": len(topo.nodes)}
    return out


def actor_nodes(handles: dict[int, Any]) -> dict[int, str]:
    import ray

    names = node_names()
    return {r: names[ray.get(h.node_info.remote(), timeout=60)["node_id"]] for r, h in sorted(handles.items())}


def expert_check(rt, seed: int = 0) -> float:
    """One expert-only step against the float64 reference: the max abs error."""
    import torch

    from ray_moe.model.source import weight_source
    from ray_moe_dev.testing.reference import reference_moe

    cfg = rt.cfg
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(24, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(24)])
    w = torch.rand(24, cfg.top_k, generator=g)
    y = rt.forward(h, ids, w)
    src = weight_source(cfg)
    return float((y.double() - reference_moe(h.double(), ids, w, lambda e: src.expert(0, e))).abs().max())


# ================================================================ scenarios
def connected_add_rank(cluster) -> dict[str, Any]:
    """Ranks on two nodes; a second driver (``Runtime.connect``, as a Serve replica's) adds a rank: every shard's
    topology must still hold every rank on the node its actor runs on."""
    import ray_moe

    cfg = ray_moe.RuntimeConfig(num_ranks=2, name="mn-connect", actor_cpus=1.0, placement_strategy="SPREAD", **TINY)
    rt = ray_moe.Runtime.start(cfg)
    try:
        before = actor_nodes(rt.shards)
        other = ray_moe.Runtime.connect("mn-connect")
        new = other.add_rank()
        out = {"before": before, "new": new, "actors": actor_nodes(other.shards),
               "topologies": shard_topologies(other.shards), "err": expert_check(other, 1)}
        other.close()
        return out
    finally:
        rt.shutdown()


SCENARIOS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "connected_add_rank": connected_add_rank,
}


def main(argv: list[str]) -> int:
    import ray
    from ray.cluster_utils import Cluster

    names = argv or list(SCENARIOS)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for tag in ("node_a", "node_b"):
        cluster.add_node(num_cpus=2, resources={tag: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, namespace="ray-moe-multinode")
    out: dict[str, Any] = {}
    try:
        for name in names:
            t0 = time.monotonic()
            try:
                out[name] = SCENARIOS[name](cluster)
            except BaseException as exc:  # noqa: BLE001 - reported; the next scenario runs
                out[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-4000:]}"}
            out[name]["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        print("MULTINODE " + json.dumps(out, default=str), flush=True)
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
