"""``ray-moe serve`` with ``"ray_moe": {"expert_stats": true}`` through the official ``openai`` client
(``extra_body``): each choice's ``ray_moe.expert_stats`` holds the experts transformers' own routers pick for its
prompt and generated tokens (the tiny model run with a recording executor bound to its experts), per MoE layer,
sparse, with the placement generation that served it; streamed in the final chunk; a request that does not
ask gets no such field; an unknown key in ``ray_moe`` is a 400 naming it."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("fastapi")  # ray[serve]

import httpx
import torch
from ray_moe_dev.testing.hf_models import (
    TOP_K,
    save_byte_level_tokenizer,
    save_chat_template,
    tiny_model,
)
from ray_moe_dev.testing.inprocess import RouteSpy
from ray_moe_dev.testing.local_executor import LocalExecutor

from ray_moe.model.seam import bind
from ray_moe.model.source import HFWeightSource

KEY = "stats-key-789"
NAME = "tiny-stats"


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory, serve_port, serve_running):
    root = tmp_path_factory.mktemp("srv-stats")
    model, folder = tiny_model("qwen3_moe", root / NAME, seed=5)
    save_byte_level_tokenizer(folder)
    save_chat_template(folder)
    key_file = root / "api-key"
    key_file.write_text(KEY + "\n")
    args = argparse.Namespace(checkpoint=str(folder), ranks=2, device="cpu", dtype="float32", name="http-stats",
                              host="127.0.0.1", port=serve_port, api_key=None, api_key_file=str(key_file),
                              model_name=None, kv_tokens=256, block_size=8, step_tokens=64, max_running=64,
                              max_queued=128)
    model.eval()
    routes = RouteSpy(LocalExecutor(HFWeightSource(folder)))
    bind(model, routes)
    with serve_running(args) as base:
        yield model, routes, base


def _expected(model, routes, prompt: list[int], gen: list[int]) -> list[dict]:
    """The field's layers from transformers' routers over prompt + generated tokens fed back (not the last)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen[:-1]])).logits[0]
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == gen  # greedy: the same tokens

    def hist(ids):
        c = torch.bincount(ids.reshape(-1))
        return {str(e): int(n) for e, n in enumerate(c.tolist()) if n}

    return [{"layer": layer, "prompt": hist(routes.ids[layer][:len(prompt)]),
             "generated": hist(routes.ids[layer][len(prompt):])} for layer in sorted(routes.ids)]


def test_expert_stats_through_the_openai_client(server):
    from openai import OpenAI

    model, routes, base = server
    client = OpenAI(base_url=f"{base}/v1", api_key=KEY)
    prompt = [5, 17, 33, 2, 90, 61, 7]
    out = client.completions.create(model=NAME, prompt=[prompt, prompt[:3]], max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True, "ray_moe": {"expert_stats": True}})
    assert len(out.choices) == 2
    for ch, p in zip(out.choices, (prompt, prompt[:3])):
        d = ch.model_dump()
        stats = d["ray_moe"]["expert_stats"]
        assert len(stats["generations"]) == 1 and stats["generations"][0] >= 0
        assert stats["layers"] == _expected(model, routes, p, d["token_ids"])
        for layer in stats["layers"]:
            assert sum(layer["prompt"].values()) == len(p) * TOP_K
            assert sum(layer["generated"].values()) == (len(d["token_ids"]) - 1) * TOP_K
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert "ray_moe" not in plain.choices[0].model_dump()
    # chat, streamed: the final chunk carries the field; the other chunks do not
    messages = [{"role": "user", "content": "Route me."}]
    chunks = list(client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=4, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True, "ray_moe": {"expert_stats": True}}))
    dumped = [c.model_dump() for c in chunks if c.choices]
    finals = [c["choices"][0] for c in dumped if c["choices"][0].get("finish_reason")]
    assert len(finals) == 1 and "ray_moe" in finals[0]
    assert all("ray_moe" not in c["choices"][0] for c in dumped if not c["choices"][0].get("finish_reason"))
    gen = [t for c in dumped for t in (c["choices"][0].get("token_ids") or [])]
    chat_ids = httpx.post(f"{base}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": messages}, timeout=60).json()["tokens"]
    assert finals[0]["ray_moe"]["expert_stats"]["layers"] == _expected(model, routes, chat_ids, gen)


def test_unknown_keys_in_ray_moe_are_a_400_naming_them(server):
    _, _, base = server
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": NAME, "prompt": [1, 2], "max_tokens": 1,
                         "ray_moe": {"expert_stats": True, "per_token": True}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "per_token" in err["message"] and err["param"] == "ray_moe"
    assert "X-Ray-MoE-Ignored-Fields" not in r.headers
