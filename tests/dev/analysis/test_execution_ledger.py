"""Decode bucket ledgers: reserved bytes of the stable buffers and the rows one replay executes (spec 0x05C)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from ray_moe_dev.analysis.execution_ledger import replay_ledger, reserved_bytes
from ray_moe.moe.decode.shapes import BufferName, DecodeBucket
from tests.moe.decode.test_buckets import D, K, P, bucket, decode_key  # noqa: F401 - bucket is a fixture


def test_reserved_bytes_ledger(bucket):
    led = reserved_bytes(bucket)
    assert led.evidence == "analytical"
    assert dict(led.by_buffer) == {
        BufferName.HIDDEN: 16 * D * 2, BufferName.ROUTE_IDS: 16 * K * 4, BufferName.GATES: 16 * K * 4,
        BufferName.EXPERT_OUTPUT: 16 * D * 2, BufferName.STEP_METADATA: P * 3 * 4,
    }
    assert led.total == 496
    # computed from the key: a wider bucket reserves more
    assert reserved_bytes(DecodeBucket.build(decode_key(rank_token_capacities=(8, 8, 8, 8)))).total == 2 * 448 + 48


def test_replay_ledger(bucket):
    led = replay_ledger(bucket, (3, 2, 0, 0), (2, 2, 2, 2, 1, 1), control_items=12)
    assert (led.useful_input_rows, led.executed_dispatch_slots, led.dispatch_padding_slots) == (5, 16, 11)
    assert (led.useful_route_rows, led.executed_runner_rows, led.runner_padding_rows) == (10, 12, 2)
    assert (led.host_submissions, led.graph_units, led.phase_units) == (1, 1, 1)
    assert led.control_items_per_route == Fraction(12, 10) == Fraction(6, 5)
    assert led.evidence == "analytical"
    with pytest.raises(ValueError, match="rank_tokens"):
        replay_ledger(bucket, (5, 4, 2, 0), (5, 4, 4, 3, 3, 3))
