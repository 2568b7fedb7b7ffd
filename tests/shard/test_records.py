"""The step request and result cross Ray every step: their compact wire forms round-trip exactly, for either
step kind, and a request whose declared kind is unknown or names another kind's payload is refused by name."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import ray.cloudpickle as cloudpickle
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.errors import RequestError
from ray_moe.core.types import Phase
from ray_moe.moe.stats import LayerStats
from ray_moe.model.sampling import SampleSpec
from ray_moe.shard.records import (ExpertOnlyInput, ExpertOnlyOutput, GenerationInput, GenerationOutput, StepKind,
                                   StepRequest, StepResult, WorkItem)

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
_DUMPS = (pickle.dumps, cloudpickle.dumps)


def _ls() -> LayerStats:
    return LayerStats(2, 9, 3, 1, np.arange(4), np.array([6, 3]), {5: 4, 9: 5}, "bucket-graph", None)


@settings(max_examples=80, deadline=None)
@given(st.lists(_items, max_size=20).map(tuple), st.lists(st.text(max_size=5), max_size=3).map(tuple),
       st.tuples(st.booleans(), st.booleans()), st.one_of(st.none(), st.text(max_size=8)), st.integers(1, 8))
def test_a_generation_request_round_trips(items, free, units, after, steps):
    req = StepRequest("s7-abc", 3, StepKind.GENERATION, GenerationInput(items, free, units, steps), after)
    for dumps in _DUMPS:
        back = pickle.loads(dumps(req))
        assert back == req and back.kind is StepKind.GENERATION and type(back.input) is GenerationInput
        assert all(type(it.tokens) is tuple and all(type(t) is int for t in it.tokens) for it in back.input.items)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 9), st.integers(1, 16), st.booleans(), st.sampled_from(list(Phase)),
       st.one_of(st.none(), st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple)), st.booleans())
def test_an_expert_only_request_round_trips_with_its_arrays_out_of_band(t, d, routed, phase, layers, marks):
    """The hidden states (and routes) are NumPy arrays inside the request: pickle protocol 5 hands them over as
    out-of-band buffers (Ray's object store then maps them zero-copy), never copied into the pickle stream."""
    rng = np.random.default_rng(t * 31 + d)
    hidden = (rng.standard_normal((t, d)).astype(np.float32), "float32")
    ids = rng.integers(0, 8, (2, t, 2)) if routed else None
    gates = rng.random((2, t, 2), dtype=np.float32) if routed else None
    req = StepRequest("s1", 5, StepKind.EXPERT_ONLY,
                      ExpertOnlyInput(hidden, ids, gates, phase, routed, marks, layers))
    for dumps in _DUMPS:
        buffers: list = []
        back = pickle.loads(dumps(req, protocol=5, buffer_callback=buffers.append), buffers=buffers)
        assert len(buffers) == (3 if routed else 1)
        assert back.kind is StepKind.EXPERT_ONLY and back.input.hidden[1] == "float32"
        assert np.array_equal(back.input.hidden[0], hidden[0])
        assert (back.input.phase, back.input.return_routes, back.input.marks, back.input.layers) == (phase, routed,
                                                                                                     marks, layers)
        if routed:
            assert np.array_equal(back.input.topk_ids, ids) and np.array_equal(back.input.topk_weights, gates)


def test_a_generation_result_round_trips_tokens_and_statistics():
    for tokens in ({"a": (1, 2, 3), "b": (4, 5, 6)}, {"a": (7,)}, {}, {"a": (1,), "b": (2, 3)}):
        res = StepResult(1, "s1", 4, GenerationOutput(tokens, "bucket", None, cached_tokens={"a": 16}, prefix_lookup_tokens=40), (_ls(),), 0.5, 4, queued_s=0.1,
                         device_s=0.2, idle_s=0.3, actor_s=0.6)
        back = pickle.loads(cloudpickle.dumps(res))
        assert back.kind is StepKind.GENERATION
        assert (back.output.cached_tokens, back.output.prefix_lookup_tokens) == ({"a": 16}, 40)
        assert back.output.tokens == tokens and all(type(v) is tuple for v in back.output.tokens.values())
        assert (back.rank, back.step_id, back.generation, back.elapsed_s, back.output.decode_path, back.queued_s,
                back.device_s, back.idle_s, back.actor_s, back.active_generation) == (1, "s1", 4, 0.5, "bucket", 0.1,
                                                                                      0.2, 0.3, 0.6, 4)
        assert back.layers[0].slot_rows == {5: 4, 9: 5} and np.array_equal(back.layers[0].expert_counts, np.arange(4))


def test_an_expert_only_result_round_trips_its_hidden_states_out_of_band():
    hidden = np.arange(12, dtype=np.int16).reshape(3, 4)  # a bf16 output's wire view
    routes = ((np.zeros((3, 2), dtype=np.int64), np.ones((3, 2), dtype=np.float32)),)
    res = StepResult(0, "s2", 1, ExpertOnlyOutput(hidden, "bfloat16", routes, (("layers", 0.1, -1.0),)), (_ls(),),
                     0.25, 1, queued_s=0.01)
    buffers: list = []
    back = pickle.loads(cloudpickle.dumps(res, protocol=5, buffer_callback=buffers.append), buffers=buffers)
    assert len(buffers) == 3 and back.kind is StepKind.EXPERT_ONLY
    assert np.array_equal(back.output.hidden, hidden) and back.output.hidden_dtype == "bfloat16"
    assert np.array_equal(back.output.routes[0][1], routes[0][1]) and back.output.marks == (("layers", 0.1, -1.0),)
    assert (back.elapsed_s, back.queued_s, back.active_generation) == (0.25, 0.01, 1)


def test_a_request_of_no_sub_steps_is_refused_by_name():
    with pytest.raises(ValueError, match="steps=0"):
        GenerationInput((), steps=0)


def test_the_kind_is_taken_by_value_and_kept_as_the_enum():
    req = StepRequest("s", 1, "generation", GenerationInput(()))
    assert req.kind is StepKind.GENERATION and pickle.loads(pickle.dumps(req)).kind is StepKind.GENERATION
    assert req.revised(step_id="s/1", steps=2).input.steps == 2 and req.revised(step_id="t").input is req.input


@pytest.mark.parametrize("kind, payload, match", [
    ("bogus", GenerationInput(()), r"kind='bogus' is not a step kind"),
    (None, ExpertOnlyInput(None), r"kind=None is not a step kind"),
    (StepKind.EXPERT_ONLY, GenerationInput(()), r"kind='expert_only' but input is a GenerationInput"),
    (StepKind.GENERATION, ExpertOnlyInput(None), r"kind='generation' but input is a ExpertOnlyInput"),
    (StepKind.GENERATION, (), r"kind='generation' but input is a tuple \(kind None\)"),
])
def test_an_unknown_or_mismatched_kind_is_refused_naming_the_field(kind, payload, match):
    with pytest.raises(RequestError, match=match):
        StepRequest("s9", 1, kind, payload)


def test_a_forged_kind_is_refused_when_it_arrives():
    """A request whose kind was changed after it was built is refused when it is unpickled (its wire form goes
    through the constructor), and by ``check`` wherever it is held."""
    req = StepRequest("s3", 1, StepKind.GENERATION, GenerationInput(()))
    object.__setattr__(req, "kind", StepKind.EXPERT_ONLY)
    with pytest.raises(RequestError, match="kind='expert_only' but input is a GenerationInput"):
        req.check()
    with pytest.raises(RequestError, match="kind='expert_only'"):
        pickle.loads(pickle.dumps(req))
    assert dataclasses.replace(req, kind=StepKind.GENERATION).check() is StepKind.GENERATION


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.just(()), st.dictionaries(st.integers(0, 1 << 20), st.floats(-100, 100), max_size=6)
                          .map(lambda d: tuple(sorted(d.items())))), min_size=1, max_size=8))
def test_logit_bias_travels_per_item_in_the_columnar_form(biases):
    items = tuple(WorkItem(f"q{i}", (i, 2), i, SampleSpec(0.0, 1.0, i, i + 2, suppress=(i,) * (i % 3),
                                                         suppress_until=9, logit_bias=b), False)
                  for i, b in enumerate(biases))
    req = StepRequest("s", 1, StepKind.GENERATION, GenerationInput(items + (WorkItem("nosample", (1,), 0, None, True),)))
    back = pickle.loads(pickle.dumps(req))
    assert back == req
    assert [it.sample.logit_bias for it in back.input.items[:-1]] == list(biases)
    assert all(type(t) is int and type(b) is float for it in back.input.items[:-1] for t, b in it.sample.logit_bias)


def test_a_thousand_decode_items_travel_inline_and_floats_bit_for_bit():
    """1,000 decode items (what a rank runs at ``ray-moe serve``'s running limit) pickle under Ray's 100 KB limit
    for arguments passed inline (past it a call goes through the object store: ~1 ms more, measured on this
    project's CI VM); the float columns travel as distinct rows, bit for bit (-0.0 stays -0.0), and a column past
    int32 (63-bit seeds) travels in int64."""
    import math
    import random

    r = random.Random(0)
    specs = [SampleSpec(0.7, 0.95, r.getrandbits(63), 501 + i, -0.0 if i % 2 else 0.0, 0.5, 1.1, 480)
             for i in range(1000)]
    items = tuple(WorkItem(f"req-{100_000 + i}", (), 500 + i, specs[i], True, True) for i in range(1000))
    req = StepRequest("s9", 4, StepKind.GENERATION, GenerationInput(items, ("req-7",), (False, True), 2), "s8")
    wire = pickle.dumps(req)
    assert len(wire) < 100_000, len(wire)
    back = pickle.loads(wire)
    assert back == req
    assert [math.copysign(1.0, it.sample.presence_penalty) for it in back.input.items[:4]] == [1.0, -1.0, 1.0, -1.0]
    assert [it.sample.seed for it in back.input.items] == [s.seed for s in specs]


_big = st.integers(-(1 << 40), 1 << 40)
_layer_stats = st.builds(
    LayerStats, st.integers(0, 200), _big, _big, _big,
    st.lists(_big, max_size=9).map(lambda xs: np.asarray(xs, dtype=np.int64)),
    st.lists(st.integers(0, 1 << 20), max_size=4).map(lambda xs: np.asarray(xs, dtype=np.int64)),
    st.dictionaries(st.integers(0, 1 << 33), _big, max_size=6),
    st.sampled_from(["engine", "direct", "bucket", "bucket-graph"]), st.one_of(st.none(), st.text(max_size=6)))


@settings(max_examples=80, deadline=None)
@given(st.lists(_layer_stats, max_size=6).map(tuple))
def test_a_results_layers_round_trip_exactly_in_their_columnar_form(layers):
    """Any number of layers, arrays of any length (empty too), values past int32, slot rows of any keys."""
    res = StepResult(2, "s3", 1, GenerationOutput({"a": (1,)}), layers, 0.5)
    for dumps in _DUMPS:
        back = pickle.loads(dumps(res)).layers
        assert len(back) == len(layers)
        for x, y in zip(back, layers):
            assert (x.layer, x.accepted, x.remote, x.inter_node, x.path, x.fallback_reason) == (
                y.layer, y.accepted, y.remote, y.inter_node, y.path, y.fallback_reason)
            assert x.slot_rows == y.slot_rows and list(x.slot_rows) == list(y.slot_rows)  # (order kept)
            for a, b in ((x.expert_counts, y.expert_counts), (x.rank_routes, y.rank_routes)):
                assert a.dtype == np.int64 and a.flags.writeable and np.array_equal(a, b)


def test_a_48_layer_result_travels_inline():
    """The whole Qwen3-30B-A3B shape's result (48 layers of 128 experts' counts and 130 slots' rows) pickles under
    Ray's 100 KB limit for values returned inline (it took ~158 KB as LayerStats one by one)."""
    rng = np.random.default_rng(0)
    layers = tuple(LayerStats(l, 2048, 0, 0, rng.integers(0, 2048, 128), np.array([2048]),
                              {s: int(rng.integers(0, 300)) for s in range(130)}, "bucket-graph", None)
                   for l in range(48))
    tokens = {f"req-{i}": (int(rng.integers(0, 151_936)), int(rng.integers(0, 151_936))) for i in range(1024)}
    wire = pickle.dumps(StepResult(0, "s1", 0, GenerationOutput(tokens), layers, 0.01))
    assert len(wire) < 100_000, len(wire)
