"""The eight-route fixture's count matrix and shapes shared by the ledger tests (spec 0x03B, 0x0AA)."""

from __future__ import annotations

from ray_moe_dev.testing import fixtures as fx

C = [[1, 2, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]  # spec 0x03B
D = 3
TOKENS = 4  # two origin ranks x two tokens
SLOTS_PER_RANK = (1, 2, 2, 1)  # six slots of placement-v17
SLOT_COUNTS = (2, 2, 1, 1, 1, 1)  # spec 0x0AA n


def fixture_count_matrix() -> list[list[int]]:
    """C computed from the fixture's route table, not copied from the spec."""
    c = [[0] * 4 for _ in range(4)]
    for _, src, _, _, _, _, _, dst in fx.EIGHT_ROUTES:
        c[src][dst] += 1
    return c
