"""The sampler's penalties, min_tokens mask, logprobs and parameter checks against plain reference formulas
(HF's repetition penalty, OpenAI's presence / frequency penalties, raw log-softmax)."""

from __future__ import annotations

import pickle

import pytest
import torch
from pydantic import ValidationError

from ray_moe.model.sampling import (
    SampleSpec,
    SamplingParams,
    logprobs_tensor,
    process_logits,
    sample,
    sample_tensor,
)
from ray_moe.shard.records import GenerationInput, WorkItem


def _reference(row: list[float], prompt: list[int], generated: list[int], *, presence: float, frequency: float,
               repetition: float) -> list[float]:
    """The formulas written out one token id at a time (plain Python)."""
    out = list(row)
    for t in set(prompt + generated):  # Hugging Face RepetitionPenaltyLogitsProcessor
        out[t] = out[t] * repetition if out[t] < 0 else out[t] / repetition
    for t in set(generated):  # OpenAI: logit -= count * frequency + (count > 0) * presence
        out[t] -= generated.count(t) * frequency + presence
    return out


@pytest.mark.parametrize("presence,frequency,repetition", [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3),
                                                           (-0.4, 1.1, 0.8), (2.0, -2.0, 2.5)])
def test_penalties_equal_the_reference_formulas(presence, frequency, repetition):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 32, generator=g) * 3
    prompt, generated = [1, 5, 5, 9, 30], [5, 7, 7, 7, 2, 9]
    spec = SampleSpec(0.0, 1.0, 0, len(prompt) + len(generated), presence, frequency, repetition, len(prompt))
    plain = SampleSpec(0.0, 1.0, 0, 3)
    out = process_logits(logits, [spec, plain], [prompt + generated, None])
    want = _reference(logits[0].tolist(), prompt, generated, presence=presence, frequency=frequency,
                      repetition=repetition)
    assert torch.allclose(out[0], torch.tensor(want), atol=1e-6)
    assert torch.equal(out[1], logits[1])  # an unpenalized row is untouched
    assert torch.equal(logits, torch.randn(2, 32, generator=torch.Generator().manual_seed(0)) * 3)  # input kept
    assert sample(logits[:1], [spec], [prompt + generated]) == [int(torch.tensor(want).argmax())]


def test_a_strong_penalty_changes_the_greedy_pick_and_only_generated_tokens_count_for_presence():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    # token 1 was generated: presence 2 pushes it below token 2
    assert sample(logits, [SampleSpec(0.0, 1.0, 0, 3, 2.0, 0.0, 1.0, 2)], [[3, 3, 1]]) == [2]
    # token 1 only in the prompt: presence / frequency do not see it
    assert sample(logits, [SampleSpec(0.0, 1.0, 0, 3, 2.0, 2.0, 1.0, 3)], [[1, 1, 1]]) == [1]
    # the repetition penalty does (5 / 1.5 < 4)
    assert sample(logits, [SampleSpec(0.0, 1.0, 0, 3, 0.0, 0.0, 1.5, 3)], [[1, 1, 1]]) == [2]
    with pytest.raises(ValueError, match="penalties need"):
        sample(logits, [SampleSpec(0.0, 1.0, 0, 3, 1.0, 0.0, 1.0, 0)])


def test_min_tokens_masks_the_suppressed_ids_until_its_position():
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0]] * 2)  # id 1 (say EOS) is the argmax
    masked = SampleSpec(0.0, 1.0, 0, 4, suppress=(1,), suppress_until=5)
    past = SampleSpec(0.0, 1.0, 0, 5, suppress=(1,), suppress_until=5)
    assert sample(logits, [masked, past]) == [3, 1]
    # sampled rows: the masked id never comes up
    hot = SampleSpec(2.0, 1.0, 7, 0, suppress=(1, 3), suppress_until=10)
    assert all(sample(logits[:1], [SampleSpec(**{**hot.__dict__, "seed": s})])[0] in (0, 2) for s in range(50))
    assert process_logits(logits, [masked])[0, 1] == float("-inf")


def test_logprobs_are_the_raw_log_softmax_with_the_top_alternatives():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=g)
    specs = [SampleSpec(0.0, 1.0, 0, 1, logprobs=5), SampleSpec(0.0, 1.0, 0, 1),
             SampleSpec(0.9, 1.0, 4, 2, 1.0, 0.0, 1.0, 0, logprobs=0)]
    picked = sample_tensor(logits, specs, [None, None, [3, 4]])
    got = logprobs_tensor(logits, picked, specs).read()
    ref = torch.log_softmax(logits, dim=-1)
    assert set(got) == {0, 2}
    for i, lp in got.items():
        assert lp.logprob == pytest.approx(float(ref[i, picked[i]]), abs=1e-6)  # raw: before penalties
    vals, ids = torch.topk(ref[0], 5)
    assert got[0].top_ids == tuple(ids.tolist()) and got[0].top_logprobs == pytest.approx(vals.tolist(), abs=1e-6)
    assert got[0].top_ids[0] == int(picked[0])  # greedy: the sampled token is the most likely one
    assert got[2].top_ids == () and got[2].top_logprobs == ()
    assert logprobs_tensor(logits, picked, [SampleSpec(0.0, 1.0, 0, 1)] * 3) is None


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", float("nan")),
                                         ("logprobs", 21), ("logprobs", -1), ("min_tokens", -1),
                                         ("ignore_eos", "maybe")])
def test_bad_values_are_refused_naming_the_field_and_value(field, value):
    with pytest.raises(ValidationError) as exc:
        SamplingParams(max_new_tokens=8, **{field: value})
    assert field in str(exc.value) and str(value) in str(exc.value)


def test_min_tokens_beyond_max_new_tokens_is_refused_by_name():
    with pytest.raises(ValueError, match="min_tokens=9 exceeds max_new_tokens=8"):
        SamplingParams(max_new_tokens=8, min_tokens=9)
    p = SamplingParams(max_new_tokens=8, min_tokens=8, ignore_eos=True, logprobs=3, repetition_penalty=1.2)
    assert p.penalized and not SamplingParams(max_new_tokens=1).penalized


def test_the_wire_form_carries_every_sampling_field():
    spec = SampleSpec(0.7, 0.9, 11, 12, 0.5, -0.25, 1.5, 7, (2, 0, 9), 15, 4)
    items = (WorkItem("a", (1, 2), 10, spec, False, keep_tokens=True),
             WorkItem("b", (), 3, SampleSpec(0.0, 1.0, 1, 3), True, True),
             WorkItem("c", (5,), 0, None, False))
    req = GenerationInput(items, units=(True, True))
    back = pickle.loads(pickle.dumps(req))
    assert back == req and back.items[0].sample.suppress == (2, 0, 9) and back.items[1].sample.logprobs is None
