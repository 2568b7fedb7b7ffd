"""``ray-moe serve``: the OpenAI-compatible endpoint on 127.0.0.1 with a real client (httpx and the ``openai``
package), over a folder with a SentencePiece-style tokenizer (Metaspace: spaces) and no chat template:
completions from text (BOS added as the tokenizer adds it) and token ids equal transformers' greedy generate,
streaming as server-sent events with the streamed text equal to the non-streamed text, bad requests (400 naming
the field), unknown fields ignored (named in a header), chat without a template (400), a missing or wrong API key
(401; the bearer scheme in any case), an unknown model, and a bounded load test (a few hundred concurrent
requests: every one answered, none lost). The tokenizer has fewer ids than the model's vocabulary (a padded
vocabulary, as Qwen's): those ids decode to empty text, are ``token_id:<id>`` in logprobs, stay distinct in
``top_logprobs`` and are accepted by ``/detokenize``; every refusal is OpenAI's error object with the client's field
in ``param`` (``--max-model-len`` here: ``max_tokens``), unknown routes and wrong methods too. The byte-level
tokenizer, chat and the other fields: test_openai_api.py."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

pytest.importorskip("fastapi")  # ray[serve]: installed by the project; absent on the bare GPU machine

import httpx  # noqa: E402
import torch  # noqa: E402

from ray_moe.apps.detokenize import CONTEXT_TOKENS
from ray_moe_dev.testing.hf_models import save_sentencepiece_tokenizer, tiny_model

KEY = "test-key-123"


TOKENIZER_IDS = 100  # the tokenizer's ids; the model's vocabulary is 128: ids 100-127 are a padded vocabulary
MAX_MODEL_LEN = 100  # --max-model-len (the model has 128 positions)


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory, serve_port, serve_running):
    model, folder = tiny_model("qwen3_moe", tmp_path_factory.mktemp("srv") / "tiny-qwen3")
    save_sentencepiece_tokenizer(folder, vocab_size=TOKENIZER_IDS)
    model.eval()
    port = serve_port
    args = argparse.Namespace(checkpoint=str(folder), ranks=2, device="cpu", dtype="float32", name="http-test",
                              host="127.0.0.1", port=port, api_key=KEY, model_name=None, kv_tokens=256,
                              block_size=8, step_tokens=64, max_running=64, max_queued=128,
                              max_model_len=MAX_MODEL_LEN)
    with serve_running(args) as base:
        yield model, base, "tiny-qwen3", str(folder)


def _auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def _greedy(model, ids, n):
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def test_completions_from_token_ids_and_text_equal_greedy_generate(server):
    model, base, name, _ = server
    ids = [5, 17, 40, 2, 9]
    r = httpx.post(f"{base}/v1/completions", headers=_auth(), timeout=60,
                   json={"model": name, "prompt": ids, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6,
                                                                       "total_tokens": 11}
    assert body["choices"][0]["token_ids"] == _greedy(model, ids, 6)
    assert body["choices"][0]["finish_reason"] == "length"
    # text prompt through the folder's tokenizer, with the openai package
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY)
    out = client.completions.create(model=name, prompt="hello world", max_tokens=5, temperature=0)
    text_ids = [1, 7, 8]  # BOS <s>, then the pieces '▁hello' and '▁world'
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server[3], local_files_only=True)
    assert tok("hello world")["input_ids"] == text_ids
    want = _greedy(model, text_ids, 5)
    assert out.choices[0].model_extra["token_ids"] == want
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 5
    # the completion's text as the whole sequence spells it after the prompt (special tokens skipped)
    head = tok.decode(text_ids, skip_special_tokens=True)
    assert out.choices[0].text == tok.decode(text_ids + want, skip_special_tokens=True)[len(head):]
    assert [m.id for m in client.models.list().data] == [name]


def test_logit_bias_forces_and_bans_tokens_through_the_openai_client(server):
    model, base, name, _ = server
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY)
    ids = [5, 17, 40, 2, 9]
    plain = _greedy(model, ids, 4)
    forced = client.completions.create(model=name, prompt=ids, max_tokens=4, temperature=0, logit_bias={"33": 100})
    assert forced.choices[0].model_extra["token_ids"] == [33] * 4
    banned = client.completions.create(model=name, prompt=ids, max_tokens=4, temperature=0,
                                       logit_bias={str(plain[0]): -100})
    got = banned.choices[0].model_extra["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    logits[plain[0]] -= 100
    assert got[0] == int(logits.argmax()) != plain[0]  # the next-best token, as transformers' logits rank it
    r = httpx.post(f"{base}/v1/completions", headers=_auth(), timeout=30,
                   json={"model": name, "prompt": ids, "max_tokens": 2, "logit_bias": {"99999": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert "99999 is outside the vocabulary" in r.json()["error"]["message"]


def test_streaming_sends_events_then_done(server):
    model, base, name, _ = server
    ids = [3, 3, 7]
    with httpx.stream("POST", f"{base}/v1/completions", headers=_auth(), timeout=60,
                      json={"model": name, "prompt": ids, "max_tokens": 5, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert tokens == _greedy(model, ids, 5)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5,
                                                                   "total_tokens": 8}


def _stream_texts(base: str, body: dict) -> tuple[dict[int, str], dict[int, list[int]]]:
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    with httpx.stream("POST", f"{base}/v1/completions", headers=_auth(), timeout=120,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for ln in r.iter_lines():
            if ln.startswith("data: ") and ln != "data: [DONE]":
                for ch in json.loads(ln[6:])["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
                    tokens.setdefault(ch["index"], []).extend(ch["token_ids"])
    return texts, tokens


def test_sentencepiece_streamed_text_equals_the_non_streamed_text(server):
    _, base, name, folder = server
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    body = {"model": name, "prompt": "the model", "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 4}
    r = httpx.post(f"{base}/v1/completions", headers=_auth(), json=body, timeout=120)
    assert r.status_code == 200, r.text
    whole = {c["index"]: c for c in r.json()["choices"]}
    texts, tokens = _stream_texts(base, body)
    assert sorted(whole) == sorted(texts) == [0, 1, 2, 3]
    prompt = tok("the model")["input_ids"]
    tail = prompt[-CONTEXT_TOKENS:]
    head = tok.decode(tail, skip_special_tokens=True)
    for i, c in whole.items():
        assert tokens[i] == c["token_ids"]  # same seed, same samples
        assert texts[i] == c["text"] == tok.decode(tail + c["token_ids"], skip_special_tokens=True)[len(head):]
    # the Metaspace pieces put spaces between words: decoding token by token (the old stream) lost them
    spaced = [i for i, c in whole.items() if " " in c["text"].strip()]
    assert spaced, whole
    assert any("".join(tok.decode([t]) for t in whole[i]["token_ids"]) != whole[i]["text"] for i in spaced)


@pytest.mark.parametrize("body,field", [
    ({"prompt": [1, 2]}, "model"),
    ({"model": "tiny-qwen3", "prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny-qwen3", "prompt": [1, 2], "temperature": -1}, "temperature"),
    ({"model": "tiny-qwen3", "prompt": []}, "prompt"),
    ({"model": "tiny-qwen3", "prompt": [1] * 200, "max_tokens": 4}, "prompt"),  # longer than the context
    ({"model": "tiny-qwen3", "prompt": [999], "max_tokens": 4}, "prompt"),     # outside the vocabulary
    ({"model": "tiny-qwen3", "prompt": [1], "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "tiny-qwen3", "prompt": [1], "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "tiny-qwen3", "prompt": [1], "logprobs": 21}, "logprobs"),
    ({"model": "tiny-qwen3", "prompt": [1], "max_tokens": 2, "min_tokens": -1}, "min_tokens"),
    ({"model": "tiny-qwen3", "prompt": [1], "logit_bias": {"five": 3}}, "logit_bias"),      # not a token id
    ({"model": "tiny-qwen3", "prompt": [1], "logit_bias": {"5": 101}}, "logit_bias"),       # beyond 100
    ({"model": "tiny-qwen3", "prompt": [1], "logit_bias": {"99999": 1}}, "logit_bias"),     # outside the vocabulary
    ({"model": "tiny-qwen3", "prompt": [1], "n": 0}, "n"),
    ({"model": "tiny-qwen3", "prompt": [[1, 2], []]}, "prompt"),
])
def test_bad_requests_get_400_naming_the_field(server, body, field):
    _, base, _, _ = server
    r = httpx.post(f"{base}/v1/completions", headers=_auth(), json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_unknown_fields_are_ignored_and_named_in_a_header(server):
    _, base, name, _ = server
    r = httpx.post(f"{base}/v1/completions", headers=_auth(), timeout=60,
                   json={"model": name, "prompt": [1, 2], "max_tokens": 2, "temperature": 0, "bogus": 1,
                         "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None,
                         "user": "u-1", "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.headers["x-ray-moe-ignored-fields"] == "best_of,bogus"
    assert "x-ray-moe-unsupported-fields" not in r.headers  # ignore_eos is honoured
    assert r.json()["usage"]["completion_tokens"] == 2


def test_chat_without_a_template_is_400_naming_it(server):
    _, base, name, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", headers=_auth(), timeout=30,
                   json={"model": name, "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "no chat template" in msg and "tiny-qwen3" in msg and r.json()["error"]["param"] == "messages"


def test_malformed_json_unknown_model_and_api_key(server):
    _, base, name, _ = server
    r = httpx.post(f"{base}/v1/completions", headers={**_auth(), "content-type": "application/json"},
                   content=b"{not json", timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", headers=_auth(), json={"model": "gpt-x", "prompt": [1]}, timeout=30)
    assert r.status_code == 404 and "gpt-x" in r.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(f"{base}/v1/completions", headers=headers, json={"model": name, "prompt": [1]}, timeout=30)
        assert r.status_code == 401
    for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive
        r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"{scheme} {KEY}"}, timeout=30,
                       json={"model": name, "prompt": [1], "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200


def test_a_few_hundred_concurrent_requests_are_all_answered(server):
    model, base, name, _ = server

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(headers=_auth(), timeout=300, limits=limits) as client:
            jobs = [client.post(f"{base}/v1/completions",
                                json={"model": name, "prompt": [1 + i % 50, 2, 3], "max_tokens": 3, "temperature": 0})
                    for i in range(300)]
            return await asyncio.gather(*jobs)

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert len(codes) == 300 and set(codes) <= {200, 503}, set(codes)
    assert codes.count(200) >= 128  # max_queued=128 in flight at once; the rest may be told to retry
    for i, r in enumerate(responses):
        if r.status_code == 200:
            assert r.json()["choices"][0]["token_ids"] == _greedy(model, [1 + i % 50, 2, 3], 3)
        else:
            assert r.headers.get("retry-after") == "1"


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    return err


def test_ids_beyond_the_tokenizer_decode_to_empty_text_and_stay_distinct(server):
    """Padded vocabulary (ids 100-127 have no tokenizer entry), as vLLM handles it: valid ids, empty text,
    ``token_id:<id>`` in logprobs; every top list keeps one entry per id, the chosen token among them."""
    model, base, name, folder = server
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(tok) == TOKENIZER_IDS < model.config.vocab_size
    ids = [1, 7, 8]  # <s> hello world
    forced = httpx.post(f"{base}/v1/completions", headers=_auth(), timeout=60,
                        json={"model": name, "prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 2,
                              "logit_bias": {"120": 100}}).json()["choices"][0]
    assert forced["token_ids"] == [120] * 3 and forced["text"] == ""
    assert forced["logprobs"]["tokens"] == ["token_id:120"] * 3
    # greedy, 20 alternatives a token: a quarter of them are padded ids, all spelled '' by the tokenizer
    body = {"model": name, "prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": 20, "ignore_eos": True}
    out = httpx.post(f"{base}/v1/completions", headers=_auth(), json=body, timeout=60).json()["choices"][0]
    lp = out["logprobs"]
    assert out["token_ids"] == _greedy(model, ids, 12)
    padded = 0
    for tok_text, chosen, value, top in zip(lp["tokens"], out["token_ids"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 20  # no two ids merged under one text
        assert top[tok_text] == pytest.approx(value) == pytest.approx(max(top.values()))  # the greedy token is there
        assert (tok_text == f"token_id:{chosen}") == (chosen >= TOKENIZER_IDS)
        padded += sum(k.startswith("token_id:") for k in top)
    assert padded >= 12  # the collisions were there to merge
    assert out["text"] == tok.decode([t for t in out["token_ids"] if t < TOKENIZER_IDS], skip_special_tokens=True)
    # /detokenize takes every id a completion returns (the model's vocabulary), padded ones as empty text
    r = httpx.post(f"{base}/detokenize", headers=_auth(), timeout=30, json={"tokens": [7, 120, 8, 127]})
    assert r.status_code == 200 and r.json() == {"prompt": "hello world"}
    r = httpx.post(f"{base}/detokenize", headers=_auth(), timeout=30, json={"tokens": out["token_ids"]})
    assert r.status_code == 200
    err = _error(httpx.post(f"{base}/detokenize", headers=_auth(), timeout=30, json={"tokens": [128]}), 400)
    assert err["param"] == "tokens" and "[0, 128)" in err["message"]


def test_every_refusal_is_openais_error_object_naming_the_clients_field(server):
    _, base, name, _ = server
    url = f"{base}/v1/completions"
    # --max-model-len: a prompt that fits, max_tokens that does not -> max_tokens (never max_new_tokens)
    err = _error(httpx.post(url, headers=_auth(), timeout=30,
                            json={"model": name, "prompt": [5] * 60, "max_tokens": 50}), 400)
    assert err["param"] == "max_tokens" and "max_tokens=50" in err["message"] and "max_new_tokens" not in err["message"]
    assert f"context of {MAX_MODEL_LEN} tokens" in err["message"]
    err = _error(httpx.post(url, headers=_auth(), timeout=30,
                            json={"model": name, "prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1}), 400)
    assert err["param"] == "prompt"
    models = httpx.get(f"{base}/v1/models", headers=_auth(), timeout=30).json()
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert _error(httpx.post(url, headers=_auth(), timeout=30, json={"model": name, "prompt": [1], "n": 0}),
                  400)["param"] == "n"
    err = _error(httpx.post(url, json={"model": name, "prompt": [1]}, timeout=30), 401)
    assert err["code"] == "invalid_api_key"
    err = _error(httpx.post(url, headers=_auth(), json={"model": "gpt-x", "prompt": [1]}, timeout=30), 404)
    assert (err["param"], err["code"]) == ("model", "model_not_found")
    err = _error(httpx.get(url, headers=_auth(), timeout=30), 405)
    assert err["message"].startswith("GET /v1/completions: method not allowed") and "POST" in err["message"]
    err = _error(httpx.get(f"{base}/v1/nope", headers=_auth(), timeout=30), 404)
    assert err["message"].startswith("GET /v1/nope: no such route") and "/v1/completions" in err["message"]
