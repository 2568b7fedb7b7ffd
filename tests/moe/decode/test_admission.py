"""Decode-graph admission: the exact predicate, in order, and semantic-preserving fallback (0x05D, 0x05F)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from ray_moe_dev.analysis.execution_ledger import fallback_plan
from ray_moe.moe.decode.admission import (
    AdmissionCounters,
    AdmissionStep,
    Fallback,
    FallbackReason,
    Replay,
    admit_decode_graph,
)
from ray_moe.moe.decode.shapes import BufferName, DecodeBucket, GraphKey
from ray_moe_dev.testing import fixtures
from ray_moe.core.types import ExchangeKind, Phase, RunnerKind


def decode_key(**changes) -> GraphKey:
    key = GraphKey(
        process_group_id="ep-group-0", pg_epoch=12, placement_generation=17, checkpoint=fixtures.CHECKPOINT,
        hidden_size=3, top_k=2, activation_dtype=torch.bfloat16, gate_dtype=torch.float32,
        dispatch_backend=ExchangeKind.NCCL, runner_backend=RunnerKind.GROUPED,
        rank_token_capacities=(4, 4, 4, 4), slot_route_capacities=(2, 2, 2, 2, 2, 2),
    )
    return key.replace(**changes) if changes else key


DECODE = ((3, 2, 0, 0), (2, 2, 2, 2, 1, 1))
OVERSIZE = ((5, 4, 2, 0), (5, 4, 4, 3, 3, 3))


@pytest.fixture
def graph() -> DecodeBucket:
    return DecodeBucket.build(decode_key())


@pytest.fixture
def buffers(graph):
    return graph.allocate()


def step(counts, phase=Phase.DECODE, **key_changes) -> AdmissionStep:
    return AdmissionStep(phase=phase, key=decode_key(**key_changes), rank_tokens=counts[0], slot_routes=counts[1])


def test_decode_step_replays(graph, buffers):
    assert admit_decode_graph(step(DECODE), graph, buffers) == Replay("decode.bucket4.v17")


def test_phase_not_decode(graph, buffers):
    out = admit_decode_graph(step(DECODE, phase=Phase.PREFILL), graph, buffers)
    assert isinstance(out, Fallback) and out.reason == FallbackReason.PHASE_NOT_DECODE


@pytest.mark.parametrize("change", [
    {"placement_generation": 18}, {"pg_epoch": 13}, {"process_group_id": "ep-group-1"},
    {"checkpoint": "checkpoint-0043"}, {"activation_dtype": torch.float16}, {"gate_dtype": torch.bfloat16},
    {"dispatch_backend": ExchangeKind.OBJECT_STORE}, {"runner_backend": RunnerKind.PADDED},
])
def test_any_key_field_change_is_a_mismatch(graph, buffers, change):
    out = admit_decode_graph(step(DECODE, **change), graph, buffers)
    assert out.reason == FallbackReason.GRAPH_KEY_MISMATCH
    assert next(iter(change)) in out.detail


def test_placement_generation_change_changes_the_key(graph, buffers):
    assert decode_key(placement_generation=18) != graph.key
    out = admit_decode_graph(step(DECODE, placement_generation=18), graph, buffers)
    assert out == Fallback(FallbackReason.GRAPH_KEY_MISMATCH, out.detail)
    assert "placement_generation" in out.detail


def test_oversize_decode_fails_first_at_rank_capacity_and_keeps_every_row(graph, buffers):
    s = step(OVERSIZE)
    out = admit_decode_graph(s, graph, buffers)
    # several slots also exceed capacity 2, but the predicate stops at its first failing clause
    assert out.reason == FallbackReason.RANK_TOKEN_CAPACITY_EXCEEDED
    assert "rank 0" in out.detail
    plan = fallback_plan(s, out)
    assert (plan.input_rows, plan.route_rows) == (11, 22)
    assert plan.rank_tokens == (5, 4, 2, 0) and plan.slot_routes == (5, 4, 4, 3, 3, 3)
    led = plan.ledger()
    assert (led.executed_dispatch_slots, led.executed_runner_rows) == (11, 22)
    assert (led.dispatch_padding_slots, led.runner_padding_rows) == (0, 0)
    assert (led.graph_units, led.host_submissions) == (0, 7)
    assert led.evidence == "analytical"


def test_expert_route_capacity(graph, buffers):
    out = admit_decode_graph(step(((2, 1, 0, 0), (3, 1, 1, 1, 0, 0))), graph, buffers)
    assert out.reason == FallbackReason.EXPERT_ROUTE_CAPACITY_EXCEEDED
    assert "slot 0" in out.detail


def test_stable_buffer_unavailable(graph, buffers):
    assert admit_decode_graph(step(DECODE), graph, None).reason == FallbackReason.STABLE_BUFFER_UNAVAILABLE
    buffers.tensors[BufferName.HIDDEN] = torch.zeros(16, 3, dtype=torch.bfloat16)  # re-addressed after capture
    assert admit_decode_graph(step(DECODE), graph, buffers).reason == FallbackReason.STABLE_BUFFER_UNAVAILABLE


def test_predicate_order(graph):
    # every clause fails: the first one in spec order wins
    s = AdmissionStep(phase=Phase.PREFILL, key=decode_key(placement_generation=18), rank_tokens=OVERSIZE[0],
                      slot_routes=OVERSIZE[1])
    assert admit_decode_graph(s, graph, None).reason == FallbackReason.PHASE_NOT_DECODE
    assert admit_decode_graph(step(OVERSIZE, placement_generation=18), graph, None).reason == \
        FallbackReason.GRAPH_KEY_MISMATCH
    assert admit_decode_graph(step(OVERSIZE), graph, None).reason == FallbackReason.RANK_TOKEN_CAPACITY_EXCEEDED
    assert admit_decode_graph(step(((2, 1, 0, 0), (3, 1, 1, 1, 0, 0))), graph, None).reason == \
        FallbackReason.EXPERT_ROUTE_CAPACITY_EXCEEDED


def test_counters(graph, buffers):
    c = AdmissionCounters()
    for s in (step(DECODE), step(OVERSIZE), step(DECODE, placement_generation=18), step(DECODE),
              step(OVERSIZE)):
        c.record(admit_decode_graph(s, graph, buffers))
    assert c.replays == 2 and c.steps == 5
    assert c.fallback_count(FallbackReason.RANK_TOKEN_CAPACITY_EXCEEDED) == 2
    assert c.fallback_count("graph_key_mismatch") == 1
    assert c.fallback_ratio() == (3, 5) and c.fallback_fraction() == Fraction(3, 5)
    assert c.as_dict()["stable_buffer_unavailable"] == 0
    with pytest.raises(ValueError, match="outcome"):
        c.record("replay")  # type: ignore[arg-type]


def test_step_validation():
    with pytest.raises(ValueError, match="conservation"):
        step(((3, 2, 0, 0), (2, 2, 2, 2, 1, 0)))
    with pytest.raises(ValueError, match="rank_tokens"):
        step(((3, 2, 0), (2, 2, 2, 2, 1, 1)))
    with pytest.raises(ValueError, match=r"rank_tokens\[1\]=-1"):
        step(((3, -1, 0, 0), (2, 2, 0, 0, 0, 0)))
