"""LayerStats: the compact wire form round-trips; the sub-steps of a multi-step decode request sum per layer."""

from __future__ import annotations

import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.moe.stats import LayerStats, merge_layer_stats


def _stats(layer: int, rng: np.random.Generator, path: str = "bucket-graph") -> LayerStats:
    counts = rng.integers(0, 9, size=6)
    routes = rng.integers(0, 9, size=3)
    rows = {int(k): int(rng.integers(1, 5)) for k in rng.choice(12, size=3, replace=False)}
    return LayerStats(layer, int(counts.sum()), int(routes[1:].sum()), 0, counts, routes, rows, path)


def test_wire_form_round_trips():
    ls = _stats(3, np.random.default_rng(0))
    back = pickle.loads(pickle.dumps(ls))
    assert (back.layer, back.accepted, back.remote, back.slot_rows, back.path) == (3, ls.accepted, ls.remote,
                                                                                    ls.slot_rows, ls.path)
    assert np.array_equal(back.expert_counts, ls.expert_counts) and np.array_equal(back.rank_routes, ls.rank_routes)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 1000))
def test_merge_sums_every_layer_over_the_sub_steps(layers, steps, seed):
    rng = np.random.default_rng(seed)
    subs = [[_stats(layer, rng) for layer in range(layers)] for _ in range(steps)]
    merged = merge_layer_stats([ls for sub in subs for ls in sub])
    assert [m.layer for m in merged] == list(range(layers))
    for m in merged:
        group = [sub[m.layer] for sub in subs]
        assert m.accepted == sum(g.accepted for g in group) and m.remote == sum(g.remote for g in group)
        assert np.array_equal(m.expert_counts, np.sum([g.expert_counts for g in group], axis=0))
        assert np.array_equal(m.rank_routes, np.sum([g.rank_routes for g in group], axis=0))
        for slot in set().union(*(g.slot_rows for g in group)):
            assert m.slot_rows[slot] == sum(g.slot_rows.get(slot, 0) for g in group)
        assert m.path == "bucket-graph"
