"""The ``ray_moe`` request object and the per-choice ``ray_moe.expert_stats`` field (pure: no Ray, no HTTP)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ray_moe.apps.choices import expert_stats_field
from ray_moe.apps.openai_protocol import ChatCompletionRequest, CompletionRequest


def test_ray_moe_is_a_known_field_that_reaches_the_sampling_params():
    from ray_moe.model.sampling import SamplingParams

    req = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "ray_moe": {"expert_stats": True}})
    assert req.ignored_fields() == [] and req.wants_expert_stats
    assert SamplingParams(**req.sampling(4, 0, ())).expert_stats is True
    plain = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]})
    assert not plain.wants_expert_stats and SamplingParams(**plain.sampling(4, 0, ())).expert_stats is False
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "ray_moe": {}})
    assert not chat.wants_expert_stats


@pytest.mark.parametrize("body,names", [({"expert_stats": True, "colour": 1, "bogus": 2}, "bogus, colour"),
                                        ({"expertstats": True}, "expertstats")])
def test_unknown_keys_inside_ray_moe_are_refused_by_name(body, names):
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"model": "m", "prompt": [1], "ray_moe": body})
    err = exc.value.errors()[0]
    assert err["loc"] == ("ray_moe",) and names in err["msg"] and "expert_stats" in err["msg"]


def test_expert_stats_must_be_a_bool():
    with pytest.raises(ValidationError, match="expert_stats"):
        CompletionRequest.model_validate({"model": "m", "prompt": [1], "ray_moe": {"expert_stats": "yes"}})
    with pytest.raises(ValidationError, match="ray_moe"):
        CompletionRequest.model_validate({"model": "m", "prompt": [1], "ray_moe": [True]})


def test_the_field_is_sparse_per_layer():
    got = expert_stats_field({"generations": [3, 5], "prompt": [[0, 2, 0], [1, 0, 1]],
                              "generated": [[0, 0, 4], [0, 0, 0]]})
    assert got == {"expert_stats": {"generations": [3, 5], "layers": [
        {"layer": 0, "prompt": {"1": 2}, "generated": {"2": 4}},
        {"layer": 1, "prompt": {"0": 1, "2": 1}, "generated": {}}]}}
    assert expert_stats_field(None) == {"expert_stats": {"generations": [], "layers": []}}
