"""The first placement of a deployment, before any load has been observed. Pure."""

from __future__ import annotations


def spread_assignment(num_layers: int, num_experts: int, num_ranks: int, slots_per_rank: int,
                      ranks: list[int] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Slot q holds expert ``q mod E`` and lives on the ``q // slots_per_rank``-th rank: every expert gets
    one slot before any gets a replica, and the replicas of one expert land on different ranks whenever
    ``slots_per_rank <= E``. Returns (phy2log [L][Q], slot_rank [L][Q])."""
    members = list(range(num_ranks)) if ranks is None else list(ranks)
    q = slots_per_rank * len(members)
    if q < num_experts:
        raise ValueError(f"slots_per_rank={slots_per_rank} x {len(members)} ranks = {q} < num_experts={num_experts}")
    phy2log = [[s % num_experts for s in range(q)] for _ in range(num_layers)]
    slot_rank = [[members[s // slots_per_rank] for s in range(q)] for _ in range(num_layers)]
    return phy2log, slot_rank
