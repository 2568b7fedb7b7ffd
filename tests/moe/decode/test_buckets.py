"""Decode bucket: key, graph id and stable buffer specs (spec 0x05C, 0x05D)."""

from __future__ import annotations

import pytest
import torch

from ray_moe.moe.decode.shapes import BufferName, DecodeBucket, GraphKey
from ray_moe_dev.testing import fixtures
from ray_moe.core.types import ExchangeKind, RunnerKind

D, K, P, Q = 3, 2, 4, 6


def decode_key(**changes) -> GraphKey:
    key = GraphKey(
        process_group_id="ep-group-0", pg_epoch=12, placement_generation=17, checkpoint=fixtures.CHECKPOINT,
        hidden_size=D, top_k=K, activation_dtype=torch.bfloat16, gate_dtype=torch.float32,
        dispatch_backend=ExchangeKind.NCCL, runner_backend=RunnerKind.GROUPED,
        rank_token_capacities=(4, 4, 4, 4), slot_route_capacities=(2, 2, 2, 2, 2, 2),
    )
    return key.replace(**changes) if changes else key


@pytest.fixture
def bucket() -> DecodeBucket:
    return DecodeBucket.build(decode_key())


def test_graph_id_and_buffers(bucket):
    assert bucket.graph_id == "decode.bucket4.v17"
    shapes = {b.name: (b.shape, b.dtype) for b in bucket.buffers}
    assert shapes == {
        BufferName.HIDDEN: ((16, 3), torch.bfloat16),
        BufferName.ROUTE_IDS: ((16, 2), torch.int32),
        BufferName.GATES: ((16, 2), torch.float32),
        BufferName.EXPERT_OUTPUT: ((16, 3), torch.bfloat16),
        BufferName.STEP_METADATA: ((4, 3), torch.int32),
    }


def test_key_validation_and_diff():
    with pytest.raises(ValueError, match="rank_token_capacities"):
        decode_key(rank_token_capacities=(4, 0, 4, 4))
    with pytest.raises(ValueError, match="activation_dtype"):
        decode_key(activation_dtype=torch.int32)
    with pytest.raises(ValueError, match="top_k"):
        decode_key(top_k=0)
    with pytest.raises(ValueError, match="unknown"):
        decode_key(generation=18)
    assert decode_key().diff(decode_key(placement_generation=18)) == ("placement_generation",)
    assert decode_key() == decode_key() and hash(decode_key()) == hash(decode_key())


def test_key_for_snapshot_binds_placement_generation():
    common = dict(hidden_size=D, top_k=K, activation_dtype=torch.bfloat16, gate_dtype=torch.float32,
                  dispatch_backend="nccl", runner_backend="grouped", rank_token_capacities=(4, 4, 4, 4),
                  slot_route_capacities=(2,) * Q)
    k17 = GraphKey.for_snapshot(fixtures.snapshot(fixtures.permuted_group()), **common)
    assert k17 == decode_key()
    k18 = GraphKey.for_snapshot(fixtures.snapshot(fixtures.permuted_group(), generation=18), **common)
    assert k18.diff(k17) == ("placement_generation",)
    with pytest.raises(ValueError, match="slot_route_capacities"):
        GraphKey.for_snapshot(fixtures.snapshot(), **{**common, "slot_route_capacities": (2,) * 5})
