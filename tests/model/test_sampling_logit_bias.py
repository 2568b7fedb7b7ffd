"""``logit_bias`` in the sampler (``model/sampling.py``): OpenAI's {token id: bias in [-100, 100]} added to the
logits before penalties and sampling; +100 forces a token under greedy, -100 bans it; logprobs stay raw;
``SamplingParams`` validates and normalises it, the scheduler checks ids against the vocabulary."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from ray_moe.driver.scheduler import Scheduler
from ray_moe.model.sampling import (
    SampleSpec,
    SamplingParams,
    logprobs_tensor,
    process_logits,
    sample,
)


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 32, generator=g)


def test_plus_100_forces_a_token_and_minus_100_bans_it_under_greedy():
    logits = _logits()
    top = logits.argmax(-1).tolist()
    specs = [SampleSpec(0.0, 1.0, 0, 5, logit_bias=((7, 100.0),)),
             SampleSpec(0.0, 1.0, 0, 5, logit_bias=((top[1], -100.0),)),
             SampleSpec(0.0, 1.0, 0, 5)]
    got = sample(logits, specs)
    second = logits[1].clone()
    second[top[1]] = float("-inf")
    assert got == [7, int(second.argmax()), top[2]]
    assert got[1] != top[1]
    # sampled rows too: +100 leaves the rest no mass worth drawing
    hot = [SampleSpec(1.0, 1.0, s, 3, logit_bias=((11, 100.0),)) for s in range(3)]
    assert sample(logits, hot) == [11, 11, 11]


def test_the_bias_is_added_before_the_penalties_and_logprobs_stay_raw():
    logits = _logits()[:1]
    spec = SampleSpec(0.0, 1.0, 0, 4, repetition_penalty=2.0, prompt_len=2, logit_bias=((3, 1.5), (9, -0.5)))
    out = process_logits(logits, [spec], [[3, 4]])
    want = logits[0].clone()
    want[3] += 1.5
    want[9] -= 0.5
    want[3] = want[3] / 2.0 if want[3] > 0 else want[3] * 2.0  # then the repetition penalty over [3, 4]
    want[4] = want[4] / 2.0 if want[4] > 0 else want[4] * 2.0
    assert torch.allclose(out[0], want)
    picked = torch.tensor([3])
    lp = logprobs_tensor(logits, picked, [SampleSpec(0.0, 1.0, 0, 4, logprobs=0, logit_bias=((3, 100.0),))]).read()
    assert lp[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[3]))  # the raw one
    with pytest.raises(ValueError, match=r"logit_bias: token id 40 is outside the vocabulary \[0, 32\)"):
        process_logits(logits, [SampleSpec(0.0, 1.0, 0, 4, logit_bias=((40, 1.0),))])


def test_sampling_params_normalise_and_validate_the_bias():
    p = SamplingParams(max_new_tokens=2, logit_bias={9: 1, 2: -100.0, 5: 0.5})
    assert p.logit_bias == ((2, -100.0), (5, 0.5), (9, 1.0))
    assert SamplingParams(max_new_tokens=2, logit_bias=[(4, 2.0)]).logit_bias == ((4, 2.0),)
    assert SamplingParams(max_new_tokens=2).logit_bias == ()
    for bad, why in (({-1: 1.0}, "key -1 is not a token id"), ({"3": 1.0}, "key '3' is not a token id"),
                     ({3: 100.5}, r"logit_bias\[3\]: 100.5 is not a bias in \[-100, 100\]"),
                     ({3: float("inf")}, "not a bias"), ({3: True}, "not a bias")):
        with pytest.raises(ValidationError, match=why):
            SamplingParams(max_new_tokens=2, logit_bias=bad)
    s = Scheduler([0], kv_blocks=16, block_size=4, max_context=64)
    with pytest.raises(ValueError, match=r"logit_bias: token id 128 is outside the vocabulary \[0, 128\)"):
        s.submit([1, 2], SamplingParams(max_new_tokens=2, logit_bias={128: 1.0}), vocab_size=128)
    rid = s.submit([1, 2], SamplingParams(max_new_tokens=2, logit_bias={127: 1.0}), vocab_size=128)
    (it,) = s.plan().items[0]
    assert it.seq_id == rid and it.sample.logit_bias == ((127, 1.0),)  # carried to the rank's spec
