"""The spec's executable fixtures as objects (spec 0x02B1, 0x03A1, 0x07A, 0x07G).

Four logical experts, four ranks on two nodes, six physical slots (placement-v17, checkpoint-0042),
eight accepted routes from two origin partitions, hidden width three.
"""

from __future__ import annotations

import torch

from ray_moe.placement.manifest import PlacementManifest, SlotSpec
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import NodeInfo, ProcessGroupSpec, RankInfo, Topology

CHECKPOINT = "checkpoint-0042"
SCALES = (1.0, 2.0, 3.0, 4.0)  # the teaching expert E_e(x) = s_e * x

# (slot, logical expert, replica, rank, domain)
SIX_SLOTS = (
    (0, 0, "e0-r0", 0, "node-0"),
    (1, 0, "e0-r1", 1, "node-0"),
    (2, 1, "e1-r0", 1, "node-0"),
    (3, 1, "e1-r1", 2, "node-1"),
    (4, 2, "e2-r0", 2, "node-1"),
    (5, 3, "e3-r0", 3, "node-1"),
)

# route id, source rank, token, route slot, logical expert, gate, physical slot, destination rank
EIGHT_ROUTES = (
    ("r00", 0, 0, 0, 0, 0.65, 0, 0),
    ("r01", 0, 0, 1, 1, 0.35, 2, 1),
    ("r02", 0, 1, 0, 0, 0.70, 1, 1),
    ("r03", 0, 1, 1, 2, 0.30, 4, 2),
    ("r04", 1, 0, 0, 3, 0.58, 5, 3),
    ("r05", 1, 0, 1, 0, 0.42, 0, 0),
    ("r06", 1, 1, 0, 1, 0.55, 3, 2),
    ("r07", 1, 1, 1, 0, 0.45, 1, 1),
)

HIDDEN = {
    0: [[1.0, 10.0, 100.0], [2.0, 20.0, 200.0]],
    1: [[3.0, 30.0, 300.0], [4.0, 40.0, 400.0]],
}

EXPECTED_OUTPUT = {
    0: [[1.35, 13.5, 135.0], [3.20, 32.0, 320.0]],
    1: [[8.22, 82.2, 822.0], [6.20, 62.0, 620.0]],
}


def topology() -> Topology:
    """Two nodes, relays rank 0 and rank 2 (spec 0x07A)."""
    ranks = (
        RankInfo(rank=0, node_id="node-0", local_rank=0, intra_domain="nvlink-domain-0", nic="nic-0"),
        RankInfo(rank=1, node_id="node-0", local_rank=1, intra_domain="nvlink-domain-0", nic="nic-0", nic_via_rank=0),
        RankInfo(rank=2, node_id="node-1", local_rank=0, intra_domain="nvlink-domain-1", nic="nic-1"),
        RankInfo(rank=3, node_id="node-1", local_rank=1, intra_domain="nvlink-domain-1", nic="nic-1", nic_via_rank=2),
    )
    nodes = (
        NodeInfo(node_id="node-0", ranks=(0, 1), relay_rank=0),
        NodeInfo(node_id="node-1", ranks=(2, 3), relay_rank=2),
    )
    return Topology(version="topology-v3", ranks=ranks, nodes=nodes)


def flat_group(epoch: int = 12) -> ProcessGroupSpec:
    return ProcessGroupSpec(group_id="ep-group-0", peer_order=(0, 1, 2, 3), epoch=epoch)


def permuted_group(epoch: int = 12) -> ProcessGroupSpec:
    """The 0x07B peer-slot order [2, 0, 3, 1]."""
    return ProcessGroupSpec(group_id="ep-group-0", peer_order=(2, 0, 3, 1), epoch=epoch)


def process_groups(epoch: int = 12) -> dict[str, ProcessGroupSpec]:
    """The four groups of spec 0x07G."""
    return {
        "ep-group-0": permuted_group(epoch),
        "ep-node-0": ProcessGroupSpec(group_id="ep-node-0", peer_order=(1, 0), epoch=epoch, kind="node-local"),
        "ep-node-1": ProcessGroupSpec(group_id="ep-node-1", peer_order=(3, 2), epoch=epoch, kind="node-local"),
        "ep-relays": ProcessGroupSpec(group_id="ep-relays", peer_order=(2, 0), epoch=epoch, kind="relays"),
    }


def six_slot_manifest(generation: int = 17) -> PlacementManifest:
    return PlacementManifest(
        generation=generation,
        process_group_id="ep-group-0",
        checkpoint_version=CHECKPOINT,
        num_experts=4,
        num_ranks=4,
        topology_version="topology-v3",
        slots=tuple(
            SlotSpec(
                physical_slot_id=q, logical_expert_id=e, replica_id=rep, destination_rank=u,
                topology_domain_id=dom, parameter_digest=f"expert-{e}-state-v42",
            )
            for q, e, rep, u, dom in SIX_SLOTS
        ),
    )


def snapshot(group: ProcessGroupSpec | None = None, generation: int = 17) -> PlacementSnapshot:
    return PlacementSnapshot.from_manifest(six_slot_manifest(generation), topology(), group or flat_group())


def route_tensors(origin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [2,3] f64, topk_ids [2,2], topk_weights [2,2] f32, physical slots [4]) of one origin rank;
    empty tensors for ranks 2 and 3, which own no input partition."""
    if origin not in HIDDEN:
        return (torch.zeros(0, 3, dtype=torch.float64), torch.zeros(0, 2, dtype=torch.int64),
                torch.zeros(0, 2, dtype=torch.float32), torch.zeros(0, dtype=torch.int64))
    rows = [r for r in EIGHT_ROUTES if r[1] == origin]
    ids = torch.tensor([[r[4] for r in rows if r[2] == t] for t in range(2)], dtype=torch.int64)
    gates = torch.tensor([[r[5] for r in rows if r[2] == t] for t in range(2)], dtype=torch.float32)
    slots = torch.tensor([r[6] for r in rows], dtype=torch.int64)
    return torch.tensor(HIDDEN[origin], dtype=torch.float64), ids, gates, slots


def route_name(origin: int, semantic_index: int) -> str:
    """Spec route id of semantic route ``semantic_index`` (t*k + j) of ``origin``."""
    return [r[0] for r in EIGHT_ROUTES if r[1] == origin][semantic_index]
