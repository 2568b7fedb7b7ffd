"""Per-request expert statistics (``SamplingParams.expert_stats``) through the driver's real generation loop over
in-process shards (``GenerationLoop`` over a ``LocalTransport``; pipelined steps, multi-step decode, captured-shape
steps): the counts equal the experts transformers' own routers pick for the same tokens (the tiny model run
with a recording executor bound to its experts), prompt and generated apart; unmarked requests get nothing
and their steps record nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from ray_moe_dev.testing.hf_models import EXPERTS, TOP_K, tiny_model
from ray_moe_dev.testing.inprocess import InProcessDeployment, RouteSpy, run_requests
from ray_moe_dev.testing.local_executor import LocalExecutor

import ray_moe
from ray_moe.model.sampling import SamplingParams
from ray_moe.model.seam import bind
from ray_moe.model.source import HFWeightSource
from ray_moe.moe.layer import RouteRecorder, expert_counts
from ray_moe.shard.records import GenerationInput, GenerationOutput, StepResult, WorkItem


def _prompts(seed: int, lens, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _deployment(folder, ranks: int, capture: bool) -> InProcessDeployment:
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=ranks, decode_token_capacity=8))
    for core in dep.cores.values():
        core.paths = dataclasses.replace(core.paths, capture=capture)
    return dep


def _run(dep, requests, *, decode_steps: int):
    return run_requests(dep, requests, decode_steps=decode_steps)


def _histogram(ids: torch.Tensor) -> list[int]:
    return torch.bincount(ids.reshape(-1), minlength=EXPERTS).tolist()


@pytest.mark.parametrize("family,ranks,decode_steps,capture", [("qwen3_moe", 2, 1, False), ("qwen3_moe", 1, 4, True),
                                                              ("mixtral", 2, 4, False), ("deepseek_v3", 1, 1, False),
                                                              ("qwen2_moe", 1, 1, True)])
def test_counts_equal_what_transformers_routers_pick(tmp_path, eager_capture, monkeypatch, family, ranks,
                                                     decode_steps, capture):
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    dep = _deployment(folder, ranks, capture)
    recorded = []
    real = RouteRecorder.moe_forward
    monkeypatch.setattr(RouteRecorder, "moe_forward", lambda self, *a: (recorded.append(a[0]), real(self, *a))[1])
    prompts = _prompts(3, (5, 13, 2, 9))
    new = 6
    asks = (True, False, True, True)
    handles, _, overlapped = _run(dep, [(p, SamplingParams(max_new_tokens=new, ignore_eos=True, expert_stats=a))
                            for p, a in zip(prompts, asks)], decode_steps=decode_steps)
    assert recorded and overlapped > 0  # the marked requests' steps recorded routes; steps were pipelined
    gens = [dep.generation]
    for core in dep.cores.values():
        assert core.generator.counters["expert_stats_steps"] > 0
        if decode_steps > 1:  # multi-step decode requests merged their sub-steps' counts
            assert core.generator.counters.get("multi_step_requests", 0) > 0
        if capture:  # the captured path served marked steps (replayed graphs of their own key)
            assert core.generator.pipeline.counters.get("graph_replays", 0) > 0
    routes = RouteSpy(LocalExecutor(HFWeightSource(folder)))
    bind(model, routes)
    for p, h, asked in zip(prompts, handles, asks):
        if not asked:
            assert h.expert_stats() is None
            continue
        stats = h.expert_stats()
        assert stats["generations"] == gens
        with torch.no_grad():  # prompt + every generated token fed back (the last one never is)
            logits = model(torch.tensor([p + h.tokens[:-1]])).logits[0]
        assert h.tokens == logits[len(p) - 1:].argmax(-1).tolist()  # greedy: the same tokens
        layers = sorted(routes.ids)
        assert len(stats["prompt"]) == len(stats["generated"]) == len(layers)
        for layer in layers:
            ids = routes.ids[layer]  # [T, k]
            assert stats["prompt"][layer] == _histogram(ids[:len(p)]), f"layer {layer} prompt"
            assert stats["generated"][layer] == _histogram(ids[len(p):]), f"layer {layer} generated"
            assert sum(stats["prompt"][layer]) == len(p) * TOP_K
            assert sum(stats["generated"][layer]) == (new - 1) * TOP_K


@pytest.mark.parametrize("decode_steps,capture", [(1, False), (4, True)])
def test_unmarked_requests_record_nothing(tmp_path, eager_capture, monkeypatch, decode_steps, capture):
    _, folder = tiny_model("qwen3_moe", tmp_path / "m")
    dep = _deployment(folder, 1, capture)
    recorded, reduced = [], []
    real_rec, real_red = RouteRecorder.__init__, expert_counts
    monkeypatch.setattr(RouteRecorder, "__init__", lambda self, *a, **k: (recorded.append(1), real_rec(self, *a, **k))[1])
    from ray_moe.shard import token_steps as generation

    monkeypatch.setattr(generation, "expert_counts", lambda *a: (reduced.append(1), real_red(*a))[1])
    handles, steps, _ = _run(dep, [(p, SamplingParams(max_new_tokens=5, ignore_eos=True)) for p in _prompts(1, (4, 11))],
                          decode_steps=decode_steps)
    assert steps > 0 and all(len(h.tokens) == 5 for h in handles)
    # (a captured step records its routes in the graph whatever its items, one copy a layer, so that a marked
    # item replays the same graph; nothing is reduced or read unless an item asked)
    assert (recorded == []) is (not capture) and reduced == []
    assert all(h.expert_stats() is None for h in handles)
    assert "expert_stats_steps" not in dep.cores[0].generator.counters


def test_expert_counts_reduce_the_marked_rows_only():
    ids = torch.tensor([[[0, 1], [2, 3], [-1, -1], [1, 1]],
                        [[3, 3], [0, 2], [-1, -1], [2, 0]]])  # [L=2, T=4, k=2]; row 2 padding
    out = expert_counts(ids, [(0, 2), (3, 1)], 4)
    assert out.dtype == torch.int32 and out.shape == (2, 2, 4)
    np.testing.assert_array_equal(out[0].numpy(), [[1, 1, 1, 1], [1, 0, 1, 2]])
    np.testing.assert_array_equal(out[1].numpy(), [[0, 2, 0, 0], [1, 0, 1, 0]])
    assert expert_counts(ids, [(2, 1)], 4).sum() == 0  # padding rows route nowhere


def test_the_mark_crosses_the_wire():
    import pickle

    items = (WorkItem("a", (1, 2), 0, None, False, expert_stats=True), WorkItem("b", (3,), 4, None, True))
    back = pickle.loads(pickle.dumps(GenerationInput(items)))
    assert [it.expert_stats for it in back.items] == [True, False]
    assert back.items == items


def test_the_counts_cross_the_wire():
    import pickle

    counts = {"a": np.arange(6, dtype=np.int32).reshape(2, 3)}
    res = StepResult(0, "s", 4, GenerationOutput({"a": (1,), "b": (2,)}, expert_counts=counts), (), 0.1)
    back = pickle.loads(pickle.dumps(res))
    assert back.output.tokens == res.output.tokens and back.generation == 4
    np.testing.assert_array_equal(back.output.expert_counts["a"], counts["a"])
    assert pickle.loads(pickle.dumps(GenerationOutput({}))).expert_counts == {}


def test_expert_stats_is_validated():
    with pytest.raises(ValueError, match="expert_stats"):
        SamplingParams(max_new_tokens=1, expert_stats="yes")
    assert SamplingParams(max_new_tokens=1).expert_stats is False
