"""Phase profiles, unit ledgers and mixed-batch splitting with provenance (spec 0x05A-0x05F)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from ray_moe_dev.analysis.execution_ledger import ExecutionPath
from ray_moe_dev.analysis.phase_split import (
    LabeledRows,
    PhaseProfile,
    aggregate_ledger,
    plan_unit,
    split_mixed,
    variable_ledger,
)
from ray_moe.moe.decode.admission import FallbackReason, Replay
from ray_moe.moe.decode.shapes import DecodeBucket, GraphKey
from ray_moe_dev.testing import fixtures
from ray_moe.core.types import ExchangeKind, Phase, RunnerKind

# spec 0x05A; control items are declared by 0x05B / 0x05C (a teaching schema, not derived)
PREFILL = PhaseProfile("prefill", Phase.PREFILL, (32, 24, 0, 0), (28, 22, 18, 16, 14, 14), control_items=34)
DECODE = PhaseProfile("decode", Phase.DECODE, (3, 2, 0, 0), (2, 2, 2, 2, 1, 1), control_items=12)
MIXED = PhaseProfile("mixed outer batch", None, (8, 7, 0, 0), (7, 6, 5, 4, 4, 4))
OVERSIZE = PhaseProfile("oversize decode", Phase.DECODE, (5, 4, 2, 0), (5, 4, 4, 3, 3, 3))


def decode_key() -> GraphKey:
    return GraphKey(
        process_group_id="ep-group-0", pg_epoch=12, placement_generation=17, checkpoint=fixtures.CHECKPOINT,
        hidden_size=3, top_k=2, activation_dtype=torch.bfloat16, gate_dtype=torch.float32,
        dispatch_backend=ExchangeKind.NCCL, runner_backend=RunnerKind.GROUPED,
        rank_token_capacities=(4, 4, 4, 4), slot_route_capacities=(2, 2, 2, 2, 2, 2),
    )


@pytest.fixture
def bucket() -> DecodeBucket:
    return DecodeBucket.build(decode_key())


@pytest.mark.parametrize("profile,routes", [(PREFILL, 112), (DECODE, 10), (MIXED, 30), (OVERSIZE, 22)])
def test_four_profiles_conserve_routes(profile, routes):
    assert profile.route_rows == routes == profile.top_k * profile.input_rows


def test_profile_rejects_broken_conservation():
    with pytest.raises(ValueError, match="slot_routes: sum 11"):
        PhaseProfile("bad", Phase.DECODE, (3, 2, 0, 0), (2, 2, 2, 2, 2, 1))
    with pytest.raises(ValueError, match=r"rank_tokens\[0\]=-1"):
        PhaseProfile("bad", Phase.DECODE, (-1, 2, 0, 0), (2, 2, 0, 0, 0, 0))


def test_prefill_ledger():
    led = plan_unit(PREFILL).ledger
    assert (led.useful_input_rows, led.executed_dispatch_slots) == (56, 56)
    assert (led.useful_route_rows, led.executed_runner_rows) == (112, 112)
    assert (led.host_submissions, led.control_items) == (7, 34)
    assert led.control_items_per_route == Fraction(34, 112)
    assert round(float(led.control_items_per_route), 3) == 0.304
    assert led.evidence == "analytical"


def test_decode_ledger(bucket):
    plan = plan_unit(DECODE, bucket, buffers=bucket.allocate())
    assert plan.path == ExecutionPath.GRAPH and plan.admission == Replay("decode.bucket4.v17")
    led = plan.ledger
    assert (led.useful_input_rows, led.executed_dispatch_slots) == (5, 16)
    assert (led.useful_route_rows, led.executed_runner_rows) == (10, 12)
    assert (led.host_submissions, led.control_items) == (1, 12)
    assert led.control_items_per_route == Fraction(12, 10)
    # observation, not a rule: decode's declared 12 equals the P x 3 step-metadata cells of the bucket
    assert bucket.buffer("graph.step_metadata").numel == 12


def test_oversize_decode_falls_back_unchanged(bucket):
    plan = plan_unit(OVERSIZE, bucket, buffers=bucket.allocate())
    assert plan.path == ExecutionPath.VARIABLE
    assert plan.admission.reason == FallbackReason.RANK_TOKEN_CAPACITY_EXCEEDED
    led = plan.ledger
    assert (led.useful_input_rows, led.executed_dispatch_slots, led.useful_route_rows, led.executed_runner_rows) == (
        11, 11, 22, 22)


def test_decode_without_buffers_falls_back(bucket):
    plan = plan_unit(DECODE, bucket, buffers=None)
    assert plan.admission.reason == FallbackReason.STABLE_BUFFER_UNAVAILABLE
    assert plan.ledger == variable_ledger(DECODE)


def test_mixed_profile_must_be_split(bucket):
    with pytest.raises(ValueError, match="split"):
        plan_unit(MIXED, bucket)


def _mixed_rows():
    """Outer batch [8, 7, 0, 0]: rank 0 has one decode row (index 5), rank 1 two (indices 0 and 4)."""
    rows = []
    labels = {0: ["prefill"] * 8, 1: ["prefill"] * 7, 2: [], 3: []}
    labels[0][5] = "decode"
    labels[1][0] = labels[1][4] = "decode"
    for u in range(4):
        t = len(labels[u])
        hidden = torch.arange(t * 3, dtype=torch.float32).view(t, 3) + 100 * u
        ids = torch.arange(t * 2, dtype=torch.int64).view(t, 2) % 4
        w = torch.full((t, 2), 0.5)
        rows.append(LabeledRows.from_labels(u, hidden, ids, w, labels[u]))
    return rows


def test_split_mixed_preserves_provenance():
    rows = _mixed_rows()
    split = split_mixed(rows)
    assert split.prefill.phase == Phase.PREFILL and split.decode.phase == Phase.DECODE
    assert split.prefill.rank_tokens == (7, 5, 0, 0)
    assert split.decode.rank_tokens == (1, 2, 0, 0)
    assert split.decode.ranks[0].original_index.tolist() == [5]
    assert split.decode.ranks[1].original_index.tolist() == [0, 4]
    assert split.prefill.ranks[1].original_index.tolist() == [1, 2, 3, 5, 6]
    assert torch.equal(split.decode.ranks[1].hidden, rows[1].hidden[[0, 4]])
    assert torch.equal(split.decode.ranks[1].topk_ids, rows[1].topk_ids[[0, 4]])
    # outputs scatter back to the outer order exactly
    pre = [u.hidden * 2 for u in split.prefill.ranks]
    dec = [u.hidden * 2 for u in split.decode.ranks]
    back = split.scatter_back(pre, dec)
    for u in range(4):
        assert torch.equal(back[u], rows[u].hidden * 2)
    with pytest.raises(ValueError, match=r"decode_out\[1\]"):
        split.scatter_back(pre, [dec[0], dec[1][:1], dec[2], dec[3]])


def test_mixed_aggregate_ledger(bucket):
    split = split_mixed(_mixed_rows())
    # slot counts after replica selection: the units partition the outer [7,6,5,4,4,4]
    pre = split.prefill.profile((6, 5, 4, 3, 3, 3))
    dec = split.decode.profile((1, 1, 1, 1, 1, 1))
    assert tuple(a + b for a, b in zip(pre.slot_routes, dec.slot_routes)) == MIXED.slot_routes
    assert (pre.route_rows, dec.route_rows) == (24, 6)
    plans = [plan_unit(pre, bucket, buffers=bucket.allocate()), plan_unit(dec, bucket, buffers=bucket.allocate())]
    assert [p.path for p in plans] == [ExecutionPath.VARIABLE, ExecutionPath.GRAPH]
    led = aggregate_ledger(plans)
    assert led.useful_input_rows == 15
    assert led.executed_dispatch_slots == 12 + 16 == 28
    assert led.dispatch_padding_slots == 13
    assert led.useful_route_rows == 30
    assert led.executed_runner_rows == 24 + 12 == 36
    assert led.runner_padding_rows == 6
    assert (led.phase_units, led.graph_units) == (2, 1)
    assert led.host_submissions == 7 + 1 == 8
    assert led.control_items is None  # no schema value declared for the units
    assert led.evidence == "analytical"


def test_labeled_rows_validation():
    with pytest.raises(ValueError, match="decode_mask"):
        LabeledRows(0, torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2),
                    torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="'mixed'"):
        LabeledRows.from_labels(0, torch.zeros(1, 3), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2), ["mixed"])
    rows = _mixed_rows()
    with pytest.raises(ValueError, match="order"):
        split_mixed([rows[1], rows[0]])
