"""The driver's books (``driver/books.py``): how a step's routes spread over the experts, counted from the ranks'
per-layer expert counts (the experts each step touches: a degenerate router touches few)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.telemetry.metrics import Telemetry
from ray_moe.core.types import Phase
from ray_moe.driver.books import StepBooks
from ray_moe.moe.stats import LayerStats
from ray_moe.shard.records import GenerationOutput, StepResult

E = 8


def _result(rank: int, counts: dict[int, list[int]]) -> StepResult:
    layers = tuple(LayerStats(layer, int(sum(c)), 0, 0, np.asarray(c, dtype=np.int64), np.zeros(2, np.int64), {})
                   for layer, c in counts.items())
    return StepResult(rank, "s", 0, GenerationOutput(tokens={}), layers, 0.001)


def _books() -> StepBooks:
    return StepBooks(num_layers=2, num_experts=E, telemetry=Telemetry("driver"), release_id="r")


def test_touched_experts_are_counted_over_the_ranks_of_a_step():
    books = _books()
    # layer 0: rank 0 routes to experts 0, 1; rank 1 to 1, 7 -> 3 touched; layer 1: all to expert 2 -> 1
    books.record({0: _result(0, {0: [2, 1, 0, 0, 0, 0, 0, 0], 1: [0, 0, 3, 0, 0, 0, 0, 0]}),
                  1: _result(1, {0: [0, 4, 0, 0, 0, 0, 0, 1], 1: [0, 0, 5, 0, 0, 0, 0, 0]})},
                 [0, 1], Phase.DECODE, 2, 1.0, topology_version="t")
    books.record({0: _result(0, {0: [0] * E, 1: [1] * E})}, [0], Phase.DECODE, 1, 1.0, topology_version="t")
    snap = books.snapshot()
    use = snap["expert_use"]
    # (step 1, layer 0): 3 touched, 8 routes, peak 5; (1, 1): 1, 8, 8; (2, 1): 8, 8, 1; (2, 0) had no routes
    assert use["layer_steps"] == 3 and use["experts"] == E and use["routes"] == 24
    assert use["touched_per_layer_step"] == (3 + 1 + 8) / 3
    assert use["peak_over_mean"] == (5 + 8 + 1) * E / 24
    assert snap["ratios"]["experts_touched"] == {"numerator": 12, "denominator": 3 * E, "value": 12 / 24}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=E, max_size=E), min_size=1, max_size=6))
def test_touched_experts_never_exceed_the_experts_and_uniform_routes_have_no_peak(rows):
    books = _books()
    for c in rows:
        books.record({0: _result(0, {0: c})}, [0], Phase.PREFILL, 1, 1.0, topology_version="t")
    use = books.snapshot()["expert_use"]
    routed = [c for c in rows if sum(c)]
    assert use["layer_steps"] == len(routed)
    if routed:
        assert use["touched_per_layer_step"] == np.mean([np.count_nonzero(c) for c in routed])
        assert 1.0 <= use["peak_over_mean"] <= E
        if all(len(set(c)) == 1 for c in routed):
            assert use["peak_over_mean"] == 1.0
    else:
        assert use["touched_per_layer_step"] is None and use["peak_over_mean"] is None
