"""``ray-moe serve`` over a folder with a byte-level BPE tokenizer and a chat template, the key read from
``--api-key-file``: chat completions (non-streamed and streamed, the official ``openai`` client), streamed text
equal to the non-streamed text with non-ASCII, ``stop`` (truncated across tokens, the request ended there),
``stop_token_ids``, ``n`` (seeds seed+i), ``echo``, a list of prompts (indices), ``usage``, ``/tokenize``,
``/detokenize``, ``/v1/models/{id}``, prefix caching (hits on /metrics, greedy tokens unchanged), the lowercase
bearer scheme, the --host/--port refusal while a Serve instance listens elsewhere, and ``ray-moe status``
finding the deployment without --name."""

from __future__ import annotations

import argparse
import json
import threading

import pytest

pytest.importorskip("fastapi")  # ray[serve]

import httpx
import torch
from ray_moe_dev.testing.hf_models import (
    save_byte_level_tokenizer,
    save_chat_template,
    tiny_model,
)

from ray_moe.apps.server import run_server
from ray_moe.core.errors import ConfigError

KEY = "file-key-456"
NAME = "tiny-bl"


def _args(folder, port: int, key_file: str) -> argparse.Namespace:
    return argparse.Namespace(checkpoint=str(folder), ranks=2, device="cpu", dtype="float32", name="http-bl",
                              host="127.0.0.1", port=port, api_key=None, api_key_file=key_file, model_name=None,
                              kv_tokens=256, block_size=8, step_tokens=64, max_running=64, max_queued=128)


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory, serve_port, serve_running):
    root = tmp_path_factory.mktemp("srv-bl")
    model, folder = tiny_model("qwen3_moe", root / NAME, seed=3)
    save_byte_level_tokenizer(folder)
    save_chat_template(folder)
    key_file = root / "api-key"
    key_file.write_text(KEY + "\n")
    args = _args(folder, serve_port, str(key_file))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model.eval()
    with serve_running(args) as base:
        yield model, base, tok, args


def _post(base: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{base}{path}", headers={"Authorization": f"bearer {KEY}"}, json=body, timeout=120, **kw)


def _greedy(model, ids, n):
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def _complete(base: str, **body) -> dict:
    r = _post(base, "/v1/completions", {"model": NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                      json={"model": NAME, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_key_from_a_file_and_the_bearer_scheme(server):
    _, base, _, _ = server
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"bearer {KEY}"}, timeout=30).status_code == 200
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer file-key"}, timeout=30).status_code == 401
    r = httpx.get(f"{base}/v1/models/{NAME}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["id"] == NAME and r.json()["max_model_len"] > 0
    r = httpx.get(f"{base}/v1/models/gpt-x", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 404 and "gpt-x" in r.json()["error"]["message"]


def test_byte_level_streamed_text_equals_non_streamed_text_non_ascii(server):
    _, base, tok, _ = server
    body = {"prompt": "hi café", "max_tokens": 16, "temperature": 1.0, "seed": 1, "n": 4, "echo": True}
    whole = {c["index"]: c for c in _complete(base, **body)["choices"]}
    texts: dict[int, str] = {}
    for ch in _streamed(base, "/v1/completions", body):
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert sorted(texts) == sorted(whole) == [0, 1, 2, 3]
    for i, c in whole.items():
        assert c["text"].startswith("hi café")  # echo: the prompt's text first
        assert texts[i] == c["text"] == "hi café" + tok.decode(c["token_ids"], skip_special_tokens=True)
    # the tiny vocabulary holds lone bytes of é, € and 日: some sample split a character over tokens
    assert any(t in (1, 2, 3, 4, 5, 6, 7, 8) for c in whole.values() for t in c["token_ids"]), whole


def test_stop_strings_cut_the_text_and_end_the_request(server):
    _, base, tok, _ = server
    full = _complete(base, prompt="hello", max_tokens=16, temperature=0)["choices"][0]
    text = full["text"]
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = _complete(base, prompt="hello", max_tokens=16, temperature=0, stop=[stop, "never-there"])
    ch = cut["choices"][0]
    assert ch["text"] == text[:text.index(stop)] and ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    # the request ended at the token completing the stop string; usage counts what was generated
    n = len(ch["token_ids"])
    assert ch["token_ids"] == full["token_ids"][:n] and n < 16
    assert stop in tok.decode(ch["token_ids"], skip_special_tokens=True)
    assert stop not in tok.decode(ch["token_ids"][:-1], skip_special_tokens=True)
    assert cut["usage"]["completion_tokens"] == n
    streamed = "".join(c["text"] for chunk in _streamed(base, "/v1/completions",
                                                        {"prompt": "hello", "max_tokens": 16, "temperature": 0,
                                                         "stop": stop}) for c in chunk["choices"])
    assert streamed == ch["text"]
    # stop_token_ids: the request ends on the token, whose text is not part of the output
    t = full["token_ids"][4]
    k = full["token_ids"].index(t)
    st = _complete(base, prompt="hello", max_tokens=16, temperature=0, stop_token_ids=[t])["choices"][0]
    assert st["token_ids"] == full["token_ids"][:k + 1] and st["finish_reason"] == "stop" and st["stop_reason"] == t
    assert st["text"] == tok.decode(full["token_ids"][:k], skip_special_tokens=True)


def test_n_samples_use_seed_plus_i_and_list_prompts_index_prompt_major(server):
    model, base, tok, _ = server
    out = _complete(base, prompt=[5, 6, 7], max_tokens=8, temperature=1.0, seed=11, n=3)
    got = [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for i in range(3):
        single = _complete(base, prompt=[5, 6, 7], max_tokens=8, temperature=1.0, seed=11 + i)
        assert single["choices"][0]["token_ids"] == got[i]
    assert len({tuple(g) for g in got}) >= 2  # independent samples
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 24, "total_tokens": 27}
    # a list of prompts, n=2: choice 2 * prompt + sample; prompt tokens counted once per prompt
    prompts = [[9, 10], [11, 12, 13]]
    many = _complete(base, prompt=prompts, max_tokens=4, temperature=0, n=2, return_token_ids=True)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    for c in many["choices"]:
        p = prompts[c["index"] // 2]
        assert c["prompt_token_ids"] == p and c["token_ids"] == _greedy(model, p, 4)
    assert many["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
    texts = _complete(base, prompt=["hi", "café"], max_tokens=3, temperature=0, echo=True)["choices"]
    assert texts[0]["text"].startswith("hi") and texts[1]["text"].startswith("café")
    assert texts[1]["token_ids"] == _greedy(model, tok("café")["input_ids"], 3)


def test_chat_completions_with_the_openai_client(server):
    model, base, tok, _ = server
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    assert ids == tok("<system>be brief\n<user>hello\n<assistant>")["input_ids"]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"return_token_ids": True})
    want = _greedy(model, ids, 6)
    ch = out.choices[0]
    assert ch.model_extra["token_ids"] == want and out.model_extra["prompt_token_ids"] == ids
    assert ch.message.role == "assistant" and ch.message.content == tok.decode(want, skip_special_tokens=True)
    assert ch.finish_reason == "length" and out.object == "chat.completion"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 6)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ch.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(ids) and all(c.object == "chat.completion.chunk" for c in chunks)
    # the template's tokens through /tokenize; text back through /detokenize
    r = _post(base, "/tokenize", {"messages": messages})
    assert r.status_code == 200 and r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    r = _post(base, "/tokenize", {"model": NAME, "prompt": "café"})
    assert r.json()["tokens"] == tok("café")["input_ids"] and r.json()["max_model_len"] > 0
    assert _post(base, "/detokenize", {"tokens": r.json()["tokens"]}).json() == {"prompt": "café"}
    assert _post(base, "/detokenize", {"tokens": [10 ** 6]}).status_code == 400
    r = _post(base, "/v1/chat/completions", {"model": NAME, "messages": messages, "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "top_logprobs"
    image = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    r = _post(base, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": image}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages[0].content[1].type", err
    assert "'image_url' is not supported" in err["message"] and "text only" in err["message"]
    r = _post(base, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 4096})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "max_new_tokens" not in r.json()["error"]["message"]


def _ref_logprobs(model, ids, gen):
    with torch.no_grad():
        logits = model(torch.tensor([ids + gen])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(ids) - 1:len(ids) - 1 + len(gen)]


def test_logprobs_through_the_openai_client_equal_the_models_log_softmax(server):
    from openai import OpenAI

    model, base, tok, _ = server
    client = OpenAI(base_url=f"{base}/v1", api_key=KEY)
    ids = tok("the experts route tokens", add_special_tokens=True)["input_ids"]
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    ch = out.choices[0]
    gen = ch.model_dump()["token_ids"]
    ref = _ref_logprobs(model, ids, gen)
    assert gen == ref.argmax(-1).tolist() and len(gen) == 6 and ch.finish_reason == "length"
    lp = ch.logprobs
    assert max(abs(a - float(ref[i, t])) for i, (a, t) in enumerate(zip(lp.token_logprobs, gen))) < 1e-4
    assert all(len(d) == 3 for d in lp.top_logprobs)  # one entry per id (ids that spell alike stay apart)
    assert all(max(d.values()) == pytest.approx(a, abs=1e-6) for d, a in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.tokens == [tok.decode([t]) for t in gen] and lp.text_offset == sorted(lp.text_offset)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=NAME, prompt=ids, max_tokens=6, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    # (the same prompt again: it is served from the prefix cache, its KV computed in another step's batch, so
    # its logprobs equal to float rounding, not bit for bit; the tokens are the same)
    assert [x for s in streamed for x in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    # chat: content entries with top_logprobs, streamed and not
    messages = [{"role": "user", "content": "Name an expert."}]
    chat_ids = _post(base, "/tokenize", {"messages": messages}).json()["tokens"]
    res = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    c0 = res.choices[0]
    gen = c0.model_dump()["token_ids"]
    ref = _ref_logprobs(model, chat_ids, gen)
    content = c0.logprobs.content
    assert len(content) == len(gen) == 5 and all(len(e.top_logprobs) == 2 for e in content)
    assert max(abs(e.logprob - float(ref[i, t])) for i, (e, t) in enumerate(zip(content, gen))) < 1e-4
    assert content[0].bytes == list(content[0].token.encode())
    chunks = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    got = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert got == pytest.approx([e.logprob for e in content], abs=1e-5)  # (prefix-cached, as above)
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_penalties_change_the_output_as_transformers_does_and_ignore_eos_runs_to_max_tokens(server):
    from openai import OpenAI

    model, base, tok, _ = server
    client = OpenAI(base_url=f"{base}/v1", api_key=KEY)
    ids = tok("one two one two", add_special_tokens=True)["input_ids"]
    n = 10

    def run(**kw):
        r = client.completions.create(model=NAME, prompt=ids, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True, **kw.pop("extra", {})}, **kw)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n  # ignore_eos: to max_tokens
        return r.choices[0].model_dump()["token_ids"]

    plain = run()
    assert plain == model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False)[0, len(ids):].tolist()
    rep = run(extra={"repetition_penalty": 1.8})
    assert rep == model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 repetition_penalty=1.8)[0, len(ids):].tolist()
    pen = run(presence_penalty=2.0, frequency_penalty=2.0)
    assert rep != plain and pen != plain
    r = _post(base, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 3, "min_tokens": 3,
                                        "ignore_eos": True, "frequency_penalty": 0.5})
    assert r.status_code == 200 and "x-ray-moe-unsupported-fields" not in r.headers


def test_serve_refuses_a_host_port_the_running_serve_would_not_honour(server):
    import socket

    _, _, _, args = server
    with socket.socket() as s:  # a free port (port + 1 may be anyone's on a shared machine)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    other = argparse.Namespace(**{**vars(args), "port": port, "name": "http-bl-2"})
    with pytest.raises(ConfigError, match=rf"listening on 127\.0\.0\.1:{args.port}.*--port {port}"):
        run_server(other, ready=threading.Event(), stop=threading.Event())
    bad = argparse.Namespace(**{**vars(args), "api_key_file": "/nonexistent/key", "name": "http-bl-3"})
    with pytest.raises(ConfigError, match="api-key-file"):
        run_server(bad, ready=threading.Event(), stop=threading.Event())


def test_status_finds_the_deployment_without_a_name(server, capsys):
    from ray_moe.apps.cli import main

    code = main(["status", "--json"])
    out, err = capsys.readouterr()
    if code == 0:  # the only deployment running
        assert json.loads(out)["deployment"] == "http-bl"
    else:  # several: the error lists them
        assert code == 2 and "http-bl" in err and "several" in err
    assert main(["status", "--name", "nope"]) == 2
    assert "http-bl" in capsys.readouterr().err


def test_a_repeated_prefix_is_served_from_the_cache_with_the_same_greedy_tokens(server):
    """Prefix caching through the server: a prompt sharing another's first full blocks (block size 8) finds them
    cached (the hit-token counter on /metrics grows by whole blocks) and its greedy tokens still equal the
    model's own ``generate`` on the whole prompt (the uncached reference)."""
    from prometheus_client.parser import text_string_to_metric_families

    model, base, tok, _ = server

    def hits() -> float:
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=60).text)}
        return sum(s.value for s in fams["ray_moe_server_prefix_cache_hit_tokens"].samples
                   if s.name.endswith("_total"))

    shared = tok("mixture of experts models route every token to a few experts and the runtime keeps them "
                 "balanced while it serves", add_special_tokens=True)["input_ids"]
    assert len(shared) >= 24
    first, second = shared + tok(" first")["input_ids"], shared + tok(" second one")["input_ids"]
    before = hits()
    a = _complete(base, prompt=first, max_tokens=5, temperature=0, ignore_eos=True, return_token_ids=True)
    mid = hits()
    b = _complete(base, prompt=second, max_tokens=5, temperature=0, ignore_eos=True, return_token_ids=True)
    after = hits()
    assert a["choices"][0]["token_ids"] == _greedy(model, first, 5)
    assert b["choices"][0]["token_ids"] == _greedy(model, second, 5)
    # the second prompt's full blocks of the shared part came from the cache (it may share a block with an
    # earlier test's prompt too, so at least, in whole blocks)
    gained = after - mid
    assert gained >= 8 * (len(shared) // 8) - 8 and gained % 8 == 0, (before, mid, after)


def test_serve_hands_its_start_timeout_to_the_deployments_start(server, monkeypatch):
    """--start-timeout (default 300 s) bounds Runtime.start's wait for resources and shard actors: a node that
    first sets up a job's runtime environment and imports torch in a fresh worker can take past a minute."""
    from ray_moe.apps.cli import build_parser
    from ray_moe.core.errors import DeploymentStartError
    from ray_moe.runtime import Runtime

    assert build_parser().parse_args(["serve", "/tmp/m"]).start_timeout == 300.0
    seen: list[float] = []

    def fake_start(cls, cfg, **kw):
        seen.append(kw["timeout_s"])
        raise DeploymentStartError(f"Runtime.start({cfg.name!r}) failed while starting the shard actors: timed out",
                                   stage="starting the shard actors")

    monkeypatch.setattr(Runtime, "start", classmethod(fake_start))
    _, _, _, args = server
    other = argparse.Namespace(**{**vars(args), "name": "http-bl-4", "start_timeout": 7.5})
    with pytest.raises(DeploymentStartError, match="http-bl-4"):
        run_server(other, ready=threading.Event(), stop=threading.Event())
    assert seen == [7.5]
