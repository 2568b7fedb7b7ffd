"""The request bodies (``ray_moe.apps.openai_protocol``) and the server's pure helpers, without Ray: unknown
fields ignored and named, the sampler fields checked and carried into ``SamplingParams`` (``logit_bias`` checked
by name), the logprobs forms, prompts in every shape,
``Choice`` (stop strings and stop token ids on the text, finish reasons), the bearer check and the key file, ids
beyond the tokenizer's vocabulary (empty text, ``token_id:<id>``, one top-list entry per id) and refusals naming
the client's field (``param``)."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("fastapi")  # ray[serve]: installed by the project; absent on the bare GPU machine

from pydantic import ValidationError  # noqa: E402
from ray_moe_dev.testing.hf_models import save_byte_level_tokenizer  # noqa: E402

from ray_moe.apps.openai_protocol import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from ray_moe.apps.server import (  # noqa: E402
    Choice,
    FinishReason,
    bearer_ok,
    chat_logprobs,
    completion_logprobs,
    read_api_key,
)
from ray_moe.model.sampling import TokenLogprobs  # noqa: E402
from ray_moe.core.env import EnvSettings  # noqa: E402
from ray_moe.core.errors import ConfigError  # noqa: E402


def test_unknown_fields_are_named_and_the_sampler_fields_reach_sampling_params():
    from ray_moe.model.sampling import SamplingParams

    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 2, "suffix": "", "user": "u",
                                            "presence_penalty": 0.5, "logprobs": 3, "ignore_eos": True,
                                            "min_tokens": 4, "repetition_penalty": 1.2, "seed": 5})
    assert req.ignored_fields() == ["best_of", "suffix"]
    params = SamplingParams(**req.sampling(16, 2, (7,)))
    assert (params.presence_penalty, params.repetition_penalty, params.logprobs, params.ignore_eos,
            params.min_tokens, params.seed, params.stop_token_ids) == (0.5, 1.2, 3, True, 4, 7, (7,))
    assert SamplingParams(**req.sampling(2, 0, ())).min_tokens == 2  # never beyond the choice's max_tokens
    biased = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logit_bias": {"3": 1.5, "10": -100}})
    assert SamplingParams(**biased.sampling(4, 0, ())).logit_bias == ((3, 1.5), (10, -100.0))
    assert SamplingParams(**req.sampling(4, 0, ())).logit_bias == ()
    for bias, why in (({"x": 1.0}, "key 'x' is not a token id"), ({"-1": 1.0}, "key '-1' is not a token id"),
                      ({"2": 100.5}, r"logit_bias\['2'\]=100.5 is outside \[-100, 100\]"),
                      ({"2": float("nan")}, "outside")):
        with pytest.raises(ValidationError, match=why):
            CompletionRequest.model_validate({"model": "m", "prompt": "x", "logit_bias": bias})
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0),
                         ("logprobs", 21), ("min_tokens", -1)):
        with pytest.raises(ValidationError, match=field):
            CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": False}).sampler_logprobs() is None
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True}).sampler_logprobs() == 0
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 4}).sampler_logprobs() == 4
    with pytest.raises(ValidationError, match="top_logprobs=2 needs logprobs=true"):
        ChatCompletionRequest.model_validate({**chat, "top_logprobs": 2})


def test_logprobs_forms_and_offsets(tmp_path):
    from transformers import AutoTokenizer

    from ray_moe.apps.server import chat_logprobs, completion_logprobs
    from ray_moe.model.sampling import TokenLogprobs

    save_byte_level_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = tok(" cat sat", add_special_tokens=False)["input_ids"]
    lps = [TokenLogprobs(-0.5 - i, (t, 3), (-0.5 - i, -2.0)) for i, t in enumerate(ids)]
    c = Choice(0, 0, [], 50, tokenizer=tok, stops=(), stop_ids=(), skip_special_tokens=True, echo="E:")
    for t, lp in zip(ids, lps):
        c.on_token(t, lp)
    c.on_end()
    out = completion_logprobs(tok, c.tokens, c.logprobs, c.offsets)
    assert "".join(out["tokens"]) == " cat sat" and out["token_logprobs"] == [lp.logprob for lp in lps]
    assert out["text_offset"][0] == 2 and out["text_offset"] == sorted(out["text_offset"])
    assert all(c.text[o - 2:].startswith(s) for o, s in zip(out["text_offset"], out["tokens"]))
    assert out["top_logprobs"][0] == {out["tokens"][0]: -0.5, tok.decode([3]): -2.0}
    chat = chat_logprobs(None, c.tokens, c.logprobs)["content"]
    assert chat[0]["token"] == f"token_id:{ids[0]}" and chat[0]["logprob"] == -0.5
    assert chat[0]["bytes"] == list(chat[0]["token"].encode()) and len(chat[0]["top_logprobs"]) == 2


def test_prompts_stops_and_limits():
    def req(**kw):
        return CompletionRequest.model_validate({"model": "m", **kw})

    assert req(prompt="a").prompts() == ["a"] and req(prompt=[1, 2]).prompts() == [[1, 2]]
    assert req(prompt=["a", "b"]).prompts() == ["a", "b"] and req(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert req(prompt="a", stop="x").stops() == ("x",) and req(prompt="a", stop=["x", "y"]).stops() == ("x", "y")
    for bad in ({"prompt": []}, {"prompt": ["a", ""]}, {"prompt": "a", "n": 17}, {"prompt": "a", "stop": ["s"] * 17}):
        with pytest.raises(ValidationError):
            req(**bad)
    chat = {"model": "m", "messages": [{"role": "system", "content": "s"},
                                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]}
    c = ChatCompletionRequest.model_validate({**chat, "max_completion_tokens": 7})
    assert c.limit() == 7 and c.template_messages() == [{"role": "system", "content": "s"},
                                                         {"role": "user", "content": "ab"}]
    with pytest.raises(ValidationError, match="disagree"):
        ChatCompletionRequest.model_validate({**chat, "max_tokens": 3, "max_completion_tokens": 4})
    with pytest.raises(ValidationError, match="role"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
    with pytest.raises(ValidationError, match="exactly one"):
        TokenizeRequest.model_validate({"prompt": "a", "messages": [{"role": "user", "content": "x"}]})


def test_choice_stop_strings_token_ids_and_finish(tmp_path):
    from transformers import AutoTokenizer

    save_byte_level_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = tok(" café end more", add_special_tokens=False)["input_ids"]
    c = Choice(0, 0, tok("x")["input_ids"], 50, tokenizer=tok, stops=("é e",), stop_ids=(), skip_special_tokens=True)
    out = "".join(c.on_token(t) for t in ids)
    assert out == c.text == " caf" and c.finish is FinishReason.STOP and c.stop_reason == "é e"
    assert c.on_end() == "" and c.finish is FinishReason.STOP
    n = len(tok(" café e", add_special_tokens=False)["input_ids"])
    assert len(c.tokens) == n  # tokens after the one completing the stop string are not taken
    c = Choice(0, 0, [], len(ids), tokenizer=tok, stops=("zzz",), stop_ids=(), skip_special_tokens=True)
    assert "".join(c.on_token(t) for t in ids) + c.on_end() == " café end more" and c.finish is FinishReason.LENGTH
    stop_id = ids[1]  # 'café' (the loop ends the request on it): its text is not part of the output
    assert ids.index(stop_id) == 1
    c = Choice(0, 0, [], 50, tokenizer=tok, stops=(), stop_ids=(stop_id,), skip_special_tokens=True)
    text = "".join(c.on_token(t) for t in ids[:2]) + c.on_end()
    assert text == " " and c.tokens == ids[:2] and c.stop_reason == stop_id and c.finish is FinishReason.STOP


def test_bearer_scheme_any_case_and_the_key_file(tmp_path):
    assert bearer_ok("Bearer k1", "k1") and bearer_ok("bearer k1", "k1") and bearer_ok("BEARER  k1 ", "k1")
    assert not bearer_ok("Bearer k2", "k1") and not bearer_ok("k1", "k1") and not bearer_ok("Basic k1", "k1")
    assert not bearer_ok("", "k1")
    env = EnvSettings(ray_address=None, results_dir="r", namespace="n", ci=False, api_key="from-env")
    f = tmp_path / "key"
    f.write_text("secret-1\n")
    ns = argparse.Namespace
    assert read_api_key(ns(api_key=None, api_key_file=str(f)), env) == "secret-1"
    assert read_api_key(ns(api_key="cli", api_key_file=None), env) == "cli"
    assert read_api_key(ns(api_key=None, api_key_file=None), env) == "from-env"
    with pytest.raises(ConfigError, match="pass one"):
        read_api_key(ns(api_key="cli", api_key_file=str(f)), env)
    with pytest.raises(ConfigError, match="api-key-file"):
        read_api_key(ns(api_key=None, api_key_file=str(tmp_path / "missing")), env)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="one key"):
        read_api_key(ns(api_key=None, api_key_file=str(tmp_path / "empty")), env)


def test_padded_vocabulary_ids_decode_to_empty_text_and_keep_their_own_keys(tmp_path):
    """Ids the tokenizer lacks (a model vocabulary padded beyond it): dropped from every decode (streamed and
    whole text alike), ``token_id:<id>`` in logprobs, and a top list keyed by text loses no id."""
    from transformers import AutoTokenizer

    from ray_moe.apps.detokenize import decode_completion
    from ray_moe.apps.vocab import PaddedVocabTokenizer, token_text, top_logprobs_dict

    save_byte_level_tokenizer(tmp_path)
    raw = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    tok = PaddedVocabTokenizer(raw)
    beyond = len(raw) + 3
    ids = raw(" cat sat", add_special_tokens=False)["input_ids"]
    mixed = [ids[0], beyond, *ids[1:], beyond + 1]
    assert tok.decode(mixed) == raw.decode(ids) == " cat sat"
    assert decode_completion(tok, [], mixed) == " cat sat"
    c = Choice(0, 0, [], 50, tokenizer=tok, stops=(), stop_ids=(), skip_special_tokens=True)
    assert "".join(c.on_token(t) for t in mixed) + c.on_end() == " cat sat"
    assert token_text(tok, beyond) == f"token_id:{beyond}" and token_text(tok, ids[0]) == raw.decode([ids[0]])
    # two lone bytes of one character spell alike ('\ufffd'), as every padded id would spell '': one key each
    b1, b2 = raw.convert_tokens_to_ids(["Ã", "©"])
    assert token_text(tok, b1) == token_text(tok, b2) == "\ufffd"
    top = top_logprobs_dict(tok, b2, [b1, b2, beyond, ids[0]], [-0.1, -0.2, -0.3, -0.4])
    assert top == {f"token_id:{b1}": -0.1, "\ufffd": -0.2, f"token_id:{beyond}": -0.3, raw.decode([ids[0]]): -0.4}
    lp = [TokenLogprobs(-0.2, (b1, b2, beyond), (-0.1, -0.2, -0.3))]
    out = completion_logprobs(tok, [b2], lp, [0])
    assert out["tokens"] == ["\ufffd"] and out["top_logprobs"][0]["\ufffd"] == -0.2 and len(out["top_logprobs"][0]) == 3
    chat = chat_logprobs(tok, [beyond], lp)["content"][0]
    assert chat["token"] == f"token_id:{beyond}" and chat["bytes"] == []
    assert [e["token"] for e in chat["top_logprobs"]] == ["\ufffd", "\ufffd", f"token_id:{beyond}"]


def test_refusals_name_the_clients_field():
    from ray_moe.apps.api_errors import client_message, client_param
    from ray_moe.apps.openai_protocol import field_path, validation_param

    assert field_path(("messages", 0, "content", 1, "type")) == "messages[0].content[1].type" and field_path(()) is None

    def refused(model, body):
        with pytest.raises(ValidationError) as info:
            model.model_validate(body)
        return validation_param(info.value.errors()[0])

    msgs = [{"role": "user", "content": "x"}]
    assert refused(ChatCompletionRequest, {"model": "m", "messages": msgs, "top_logprobs": 2}) == \
        ("top_logprobs", "top_logprobs=2 needs logprobs=true")
    param, msg = refused(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}]}]})
    assert param == "messages[0].content[1].type" and "'input_audio' is not supported" in msg
    assert refused(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": 3}]})[0] == \
        "messages[0].content"
    assert refused(ChatCompletionRequest, {"model": "m", "messages": msgs, "max_tokens": 3,
                                           "max_completion_tokens": 4})[0] == "max_completion_tokens"
    assert refused(CompletionRequest, {"model": "m", "prompt": "a", "temperature": 3})[0] == "temperature"
    assert client_param("max_new_tokens") == "max_tokens" and client_param("logprobs", chat=True) == "top_logprobs"
    assert client_message("prompt: 3 tokens + max_new_tokens=9 = 12 exceeds", "messages") == \
        "messages: 3 tokens + max_tokens=9 = 12 exceeds"
