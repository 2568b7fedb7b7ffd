"""Two raylets on one machine (``ray.cluster_utils.Cluster``): place a deployment with a placement group
and report where every rank's actor actually runs. Run as ``python -m ray_moe_dev.testing.cluster_check``;
prints one JSON object (the test asserts on it). A subprocess, because a test session already owns a
local Ray instance and a Cluster needs its own.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import ray
    import torch
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    import ray_moe
    from ray_moe.model.source import weight_source
    from ray_moe_dev.testing.reference import reference_moe
    from ray_moe.core.types import ExchangeSchedule

    schedule = ExchangeSchedule(sys.argv[1]) if len(sys.argv) > 1 else ExchangeSchedule.FLAT
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict = {}
    try:
        names = {}
        for n in ray.nodes():
            if n["Alive"]:
                names[n["NodeID"]] = "node_a" if "node_a" in n["Resources"] else "node_b"
        cfg = ray_moe.RuntimeConfig(num_ranks=4, num_experts=8, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=3,
                                    actor_cpus=0.5, placement_strategy="SPREAD", name="cluster-check",
                                    exchange_schedule=schedule)
        rt = ray_moe.Runtime.start(cfg)
        pg_id = rt.members()["members"]["0"]["bundle"][0]  # the start's placement group: rank r in bundle r
        table = placement_group_table()[pg_id]
        bundle_nodes = {int(b): nid for b, nid in table["bundles_to_node_id"].items()}
        infos = ray.get([rt.shards[r].node_info.remote() for r in range(4)])
        out["actor_nodes"] = {i["rank"]: names[i["node_id"]] for i in infos}
        out["bundle_nodes"] = {r: names[n] for r, n in bundle_nodes.items()}
        out["topology"] = {
            r.rank: {"node": r.node_id, "local_rank": r.local_rank, "ray_node": names[r.ray_node_id]}
            for r in rt.topology.ranks
        }
        out["relays"] = {n.node_id: n.relay_rank for n in rt.topology.nodes}
        g = torch.Generator().manual_seed(0)
        h = torch.randn(48, 16, generator=g)
        ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(48)])
        w = torch.rand(48, 2, generator=g)
        y = rt.forward(h, ids, w)
        src = weight_source(cfg)
        ref = reference_moe(h.double(), ids, w, lambda e: src.expert(0, e))
        out["max_abs_err"] = float((y.double() - ref).abs().max())
        out["stats"] = rt.stats()
        rt.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("CLUSTER_CHECK " + json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
