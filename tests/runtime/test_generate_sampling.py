"""The sampler's fields through the driver's real generation loop over in-process shards (``GenerationLoop``
over a ``LocalTransport``; pipelined steps, deferred tokens, multi-step decode, captured-shape steps): logprobs
equal transformers' own log-softmax of the chosen tokens, penalties equal transformers' generate with the same
logits processors, ``ignore_eos`` runs past the end-of-sequence id, ``min_tokens`` holds it back."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import ray_moe
from ray_moe.model.sampling import SamplingParams
from ray_moe_dev.testing.hf_models import tiny_model
from ray_moe_dev.testing.inprocess import InProcessDeployment, run_requests


def _prompts(seed: int, lens, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _run(dep: InProcessDeployment, requests: list[tuple[list[int], SamplingParams]], *, decode_steps: int = 1):
    return run_requests(dep, requests, decode_steps=decode_steps)[0]


def _deployment(folder: str, ranks: int, capture: bool) -> InProcessDeployment:
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=ranks, decode_token_capacity=8))
    for core in dep.cores.values():
        core.paths = dataclasses.replace(core.paths, capture=capture)
    return dep


class _OpenAIPenalties(LogitsProcessor):
    """presence / frequency penalties over the generated tokens (OpenAI's formula), for transformers' generate."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        gen = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, gen, torch.ones_like(gen, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.parametrize("family,ranks,decode_steps,capture", [("qwen3_moe", 2, 1, False), ("qwen3_moe", 1, 4, True),
                                                              ("deepseek_v3", 1, 1, True), ("mixtral", 2, 4, False)])
def test_logprobs_equal_transformers_log_softmax_of_the_chosen_tokens(tmp_path, eager_capture, family, ranks,
                                                                      decode_steps, capture):
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    dep = _deployment(folder, ranks, capture)
    prompts = _prompts(0, (5, 13, 2, 9))
    new = 7
    handles = _run(dep, [(p, SamplingParams(max_new_tokens=new, ignore_eos=True, logprobs=k))
                         for p, k in zip(prompts, (3, 0, 5, None))], decode_steps=decode_steps)
    for p, h, k in zip(prompts, handles, (3, 0, 5, None)):
        with torch.no_grad():
            logits = model(torch.tensor([p + h.tokens])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)[len(p) - 1:len(p) - 1 + new]
        assert h.tokens == ref.argmax(-1).tolist()  # greedy
        if k is None:
            assert h.logprobs == []
            continue
        assert len(h.logprobs) == new
        for i, (tok, lp) in enumerate(zip(h.tokens, h.logprobs)):
            assert abs(lp.logprob - float(ref[i, tok])) < 1e-4
            vals, ids = torch.topk(ref[i], k)
            assert lp.top_ids == tuple(ids.tolist())
            assert max(abs(a - b) for a, b in zip(lp.top_logprobs, vals.tolist())) < 1e-4 if k else lp.top_ids == ()


@pytest.mark.parametrize("ranks,decode_steps,capture", [(2, 1, False), (1, 4, True), (2, 3, False), (1, 1, True)])
def test_penalties_equal_transformers_generate_with_the_same_processors(tmp_path, eager_capture, ranks,
                                                                        decode_steps, capture):
    model, folder = tiny_model("qwen3_moe", tmp_path / "q3")
    model.eval()
    dep = _deployment(folder, ranks, capture)
    prompts = _prompts(2, (6, 11, 3))
    knobs = [(0.0, 0.0, 1.8), (1.5, 0.0, 1.0), (0.3, 1.2, 1.3)]  # (presence, frequency, repetition)
    new = 12
    reqs = [(p, SamplingParams(max_new_tokens=new, ignore_eos=True, presence_penalty=pr, frequency_penalty=fr,
                               repetition_penalty=rp)) for p, (pr, fr, rp) in zip(prompts, knobs)]
    plain = [(p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for p in prompts]
    handles = _run(dep, reqs + plain, decode_steps=decode_steps)
    got, base = [h.tokens for h in handles[:3]], [h.tokens for h in handles[3:]]
    for p, (pr, fr, rp), g, b in zip(prompts, knobs, got, base):
        procs = LogitsProcessorList([_OpenAIPenalties(len(p), pr, fr)])
        want = model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              repetition_penalty=rp, logits_processor=procs)[0, len(p):].tolist()
        assert g == want
        assert b == model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False)[0, len(p):].tolist()
    assert got != base  # the penalties changed what was generated
    kept = {sid for c in dep.cores.values() for sid in c.generator.batcher.history}
    assert kept <= {h.request_id for h in handles[:3]}  # only penalized sequences' tokens are kept


def _with_eos(folder: str, eos: int) -> None:
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as fh:
                conf = json.load(fh)
            conf["eos_token_id"] = eos
            with open(path, "w") as fh:
                json.dump(conf, fh)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_ignore_eos_runs_past_it_and_min_tokens_holds_it_back(tmp_path, decode_steps):
    model, folder = tiny_model("mixtral", tmp_path / "mx")
    model.eval()
    prompt = _prompts(7, (6,))[0]
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10,
                            do_sample=False)[0, len(prompt):].tolist()
    eos = greedy[2]  # the model's end-of-sequence id: the greedy continuation's third token
    first = greedy.index(eos)
    _with_eos(folder, eos)
    dep = _deployment(folder, 2, False)
    hs = _run(dep, [(prompt, SamplingParams(max_new_tokens=10)),
                    (prompt, SamplingParams(max_new_tokens=10, ignore_eos=True)),
                    (prompt, SamplingParams(max_new_tokens=10, min_tokens=first + 3))], decode_steps=decode_steps)
    assert hs[0].tokens == greedy[:first + 1]  # ends on the EOS id
    assert hs[1].tokens == greedy  # runs past it, to max_new_tokens
    held = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=first + 3, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
    assert hs[2].tokens == held and eos not in hs[2].tokens[:first + 3]
    assert len(hs[2].tokens) > first + 1


def test_array_sub_steps_sample_what_single_steps_sample(tmp_path, eager_capture, paged_references):
    """The H200's decode path (references as the kernels): a multi-step request's later sub-steps run on arrays
    with their specs at their own positions (seeded temperature / top-p draws keyed by position, min_tokens masks,
    logprobs) or one argmax for plain greedy rows: tokens and logprobs equal those of one-step decode."""
    from ray_moe.model.sampling import SampleSpec, plain_greedy

    _, folder = tiny_model("qwen3_moe", tmp_path / "m")
    prompts = _prompts(21, (5, 11, 3, 8))
    params = [SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=7),
              SamplingParams(max_new_tokens=9, min_tokens=6, ignore_eos=True, seed=3, temperature=0.5),
              SamplingParams(max_new_tokens=9, logprobs=2),
              SamplingParams(max_new_tokens=9)]
    runs = {}
    for steps in (1, 4):
        dep = _deployment(folder, 1, True)
        handles = _run(dep, list(zip(prompts, params)), decode_steps=steps)
        runs[steps] = [(h.tokens, [lp.logprob for lp in h.logprobs] if h.logprobs else None) for h in handles]
        counters = dep.cores[0].generator.counters
        assert dep.cores[0].generator.host.paged_decode
        if steps > 1:
            assert counters.get("array_substeps", 0) == counters["multi_step_substeps"] > 0, counters
    assert runs[4] == runs[1]
    assert plain_greedy([SampleSpec(0.0, 1.0, 0, 5)]) and not plain_greedy([SampleSpec(0.7, 1.0, 0, 5)])
    assert not plain_greedy([SampleSpec(0.0, 1.0, 0, 5, logprobs=0)])
    assert not plain_greedy([SampleSpec(0.0, 1.0, 0, 5, suppress=(1,), suppress_until=9)])
    assert plain_greedy([SampleSpec(0.0, 1.0, 0, 9, suppress=(1,), suppress_until=9)])  # (past min_tokens)
