"""Decode bucket inputs: padded layout, mask state, in-place staging into the stable buffers, and padding
that never gets an expert identity (spec 0x05C, 0x05F)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe_dev.analysis.bucket_inputs import build_bucket_inputs, runner_row_mask, slot_route_counts, stage_step
from ray_moe.moe.decode.shapes import BufferName, DecodeBucket
from tests.moe.decode.test_buckets import D, K, P, Q, bucket, decode_key  # noqa: F401 - bucket is a fixture


def decode_inputs():
    """The five-request decode: ranks [3, 2, 0, 0], slot counts [2, 2, 2, 2, 1, 1]."""
    hidden = [torch.arange(1, 10, dtype=torch.float32).view(3, 3), torch.arange(10, 16, dtype=torch.float32).view(2, 3),
              torch.zeros(0, D), torch.zeros(0, D)]
    slots = [torch.tensor([[0, 2], [1, 3], [0, 4]]), torch.tensor([[1, 2], [3, 5]]),
             torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K, dtype=torch.int64)]
    gates = [torch.full((3, K), 0.5), torch.full((2, K), 0.25), torch.zeros(0, K), torch.zeros(0, K)]
    return hidden, slots, gates


def test_padded_inputs_and_mask_state(bucket):
    hidden, slots, gates = decode_inputs()
    inp = build_bucket_inputs(bucket, hidden, slots, gates)
    m = inp.mask
    assert m.real_tokens_by_rank.tolist() == [3, 2, 0, 0]
    assert m.num_valid_tokens == 5 and m.valid_tokens.numel() == 16
    assert torch.nonzero(m.valid_tokens).flatten().tolist() == [0, 1, 2, 4, 5]
    assert m.rank_token_offsets.tolist() == [0, 3, 5, 5, 5]
    assert m.valid_routes_by_slot.tolist() == [2, 2, 2, 2, 1, 1]
    assert int(m.valid_runner_rows.sum()) == 10 and m.valid_runner_rows.numel() == 12
    assert m.valid_runner_rows.tolist() == [True] * 9 + [False, True, False]
    # all 11 padding slots carry no expert identity, no gate, no activation
    pad = ~m.valid_tokens
    assert int(pad.sum()) == 11
    assert bool((inp.route_ids[pad] == -1).all())
    assert bool((inp.gates[pad] == 0).all()) and bool((inp.hidden[pad] == 0).all())
    # real rows land at their rank region, unchanged
    assert inp.route_ids[[0, 1, 2, 4, 5]].tolist() == [[0, 2], [1, 3], [0, 4], [1, 2], [3, 5]]
    assert torch.equal(inp.hidden[4:6].float(), hidden[1])
    assert inp.route_ids.dtype == torch.int32 and inp.hidden.dtype == torch.bfloat16
    assert inp.step_metadata.tolist() == [[3, 0, 6], [2, 3, 4], [0, 5, 0], [0, 5, 0]]


def test_builder_never_clips(bucket):
    hidden, slots, gates = decode_inputs()
    hidden[0] = torch.zeros(5, D)
    slots[0] = torch.zeros(5, K, dtype=torch.int64)
    gates[0] = torch.zeros(5, K)
    with pytest.raises(ValueError, match=r"hidden\[0\]: 5 rows exceed"):
        build_bucket_inputs(bucket, hidden, slots, gates)
    hidden, slots, gates = decode_inputs()
    slots[1] = torch.tensor([[0, 0], [3, 5]])  # slot 0 gets 4 routes > capacity 2
    with pytest.raises(ValueError, match="slot 0 has 4 routes"):
        build_bucket_inputs(bucket, hidden, slots, gates)
    hidden, slots, gates = decode_inputs()
    slots[1] = torch.tensor([[1, 2], [3, 6]])
    with pytest.raises(ValueError, match="out of range"):
        build_bucket_inputs(bucket, hidden, slots, gates)
    with pytest.raises(ValueError, match="ranks given"):
        build_bucket_inputs(bucket, hidden[:3], slots[:3], gates[:3])


def test_stable_buffers_keep_addresses_and_drop_stale_rows(bucket):
    buffers = bucket.allocate()
    assert buffers.ready(bucket)
    ptrs = dict(buffers.captured_ptrs)
    stage_step(buffers, bucket, build_bucket_inputs(bucket, *decode_inputs()))
    assert {n: t.data_ptr() for n, t in buffers.tensors.items()} == ptrs
    assert int((buffers.tensors[BufferName.ROUTE_IDS] >= 0).sum()) == 10
    # the next step has one request: the valid-count tensors change, the previous rows do not survive
    nxt = build_bucket_inputs(
        bucket, [torch.ones(1, D), torch.zeros(0, D), torch.zeros(0, D), torch.zeros(0, D)],
        [torch.tensor([[4, 5]])] + [torch.zeros(0, K, dtype=torch.int64)] * 3,
        [torch.ones(1, K)] + [torch.zeros(0, K)] * 3,
    )
    stage_step(buffers, bucket, nxt)
    ids = buffers.tensors[BufferName.ROUTE_IDS]
    assert ids[0].tolist() == [4, 5] and bool((ids[1:] == -1).all())
    assert buffers.tensors[BufferName.STEP_METADATA][:, 0].tolist() == [1, 0, 0, 0]
    # a re-addressed buffer is not ready and cannot be staged into
    buffers.tensors[BufferName.GATES] = torch.zeros(16, K)
    assert not buffers.ready(bucket)
    with pytest.raises(ValueError, match="re-addressed"):
        stage_step(buffers, bucket, nxt)


def test_runner_mask_and_slot_counts():
    assert runner_row_mask(torch.tensor([2, 0, 1]), (2, 1, 3)).tolist() == [True, True, False, True, False, False]
    _, slots, _ = decode_inputs()
    assert slot_route_counts(slots, Q) == (2, 2, 2, 2, 1, 1)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=P, max_size=P), st.integers(0, 2**31 - 1))
def test_padding_never_gets_identity(real, seed):
    key = decode_key(slot_route_capacities=(16,) * Q)  # room for any assignment of <= 16 tokens
    bucket = DecodeBucket.build(key)
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(t, D, generator=g) for t in real]
    slots = [torch.randint(0, Q, (t, K), generator=g) for t in real]
    gates = [torch.rand(t, K, generator=g) for t in real]
    inp = build_bucket_inputs(bucket, hidden, slots, gates)
    valid = inp.mask.valid_tokens
    assert int(valid.sum()) == sum(real)
    assert bool((inp.route_ids[~valid] == -1).all()) and bool((inp.route_ids[valid] >= 0).all())
    assert int(inp.mask.valid_routes_by_slot.sum()) == K * sum(real)
    assert tuple(inp.mask.valid_routes_by_slot.tolist()) == slot_route_counts(slots, Q)
    assert torch.equal(inp.gates[valid], torch.cat(gates))
