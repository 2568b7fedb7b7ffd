"""The step request and result cross Ray every step: their compact wire forms round-trip exactly."""

from __future__ import annotations

import pickle

import numpy as np
import ray.cloudpickle as cloudpickle
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.moe.stats import LayerStats
from ray_moe.shard.records import GenStepRequest, GenStepResult
from ray_moe.model.sampling import SampleSpec
from ray_moe.shard.records import WorkItem

_items = st.builds(
    WorkItem,
    st.text(min_size=1, max_size=12),
    st.lists(st.integers(0, 1 << 40), max_size=40).map(tuple),
    st.integers(0, 1 << 20),
    st.one_of(st.none(), st.builds(SampleSpec, st.floats(0, 100), st.floats(0.01, 1.0), st.integers(0, (1 << 63) - 1),
                                   st.integers(0, 1 << 20))),
    st.booleans(),
    st.booleans(),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(_items, max_size=20).map(tuple), st.lists(st.text(max_size=5), max_size=3).map(tuple),
       st.tuples(st.booleans(), st.booleans()), st.one_of(st.none(), st.text(max_size=8)), st.integers(1, 8))
def test_step_request_round_trips(items, free, units, after, steps):
    req = GenStepRequest("s7-abc", 3, items, free, units, after, steps)
    for dumps in (pickle.dumps, cloudpickle.dumps):
        back = pickle.loads(dumps(req))
        assert back == req
        assert all(type(it.tokens) is tuple and all(type(t) is int for t in it.tokens) for it in back.items)


def test_step_result_round_trips_tokens_and_statistics():
    ls = LayerStats(2, 9, 3, 1, np.arange(4), np.array([6, 3]), {5: 4, 9: 5}, "bucket-graph", None)
    for tokens in ({"a": (1, 2, 3), "b": (4, 5, 6)}, {"a": (7,)}, {}, {"a": (1,), "b": (2, 3)}):
        res = GenStepResult(1, "s1", 4, tokens, (ls,), 0.5, "bucket", None, queued_s=0.1, device_s=0.2, idle_s=0.3,
                            actor_s=0.6, cached_tokens={"a": 16}, prefix_lookup_tokens=40)
        back = pickle.loads(cloudpickle.dumps(res))
        assert (back.cached_tokens, back.prefix_lookup_tokens) == ({"a": 16}, 40)
        assert back.tokens == tokens and all(type(v) is tuple for v in back.tokens.values())
        assert (back.rank, back.step_id, back.generation, back.elapsed_s, back.decode_path, back.queued_s,
                back.device_s, back.idle_s, back.actor_s) == (1, "s1", 4, 0.5, "bucket", 0.1, 0.2, 0.3, 0.6)
        assert back.layers[0].slot_rows == {5: 4, 9: 5} and np.array_equal(back.layers[0].expert_counts, np.arange(4))


def test_a_request_of_no_sub_steps_is_refused_by_name():
    import pytest

    with pytest.raises(ValueError, match="steps=0"):
        GenStepRequest("s", 1, (), steps=0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.just(()), st.dictionaries(st.integers(0, 1 << 20), st.floats(-100, 100), max_size=6)
                          .map(lambda d: tuple(sorted(d.items())))), min_size=1, max_size=8))
def test_logit_bias_travels_per_item_in_the_columnar_form(biases):
    items = tuple(WorkItem(f"q{i}", (i, 2), i, SampleSpec(0.0, 1.0, i, i + 2, suppress=(i,) * (i % 3),
                                                         suppress_until=9, logit_bias=b), False)
                  for i, b in enumerate(biases))
    req = GenStepRequest("s", 1, items + (WorkItem("nosample", (1,), 0, None, True),))
    back = pickle.loads(pickle.dumps(req))
    assert back == req
    assert [it.sample.logit_bias for it in back.items[:-1]] == list(biases)
    assert all(type(t) is int and type(b) is float for it in back.items[:-1] for t, b in it.sample.logit_bias)
