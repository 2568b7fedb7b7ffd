"""``ray_moe.apps.detokenize``: streamed text equals the whole decode for a SentencePiece-style tokenizer
(Metaspace: spaces) and a byte-level BPE (a character split over tokens), special tokens skipped, and stop
strings matched across token boundaries and held back until they are known not to match."""

from __future__ import annotations

import random

import pytest
from ray_moe_dev.testing.hf_models import (
    save_byte_level_tokenizer,
    save_sentencepiece_tokenizer,
)

from ray_moe.apps.detokenize import (
    IncrementalDetokenizer,
    StopMatcher,
    decode_completion,
)


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("sp")
    save_sentencepiece_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def bl_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("bl")
    save_byte_level_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _stream(tok, prompt, tokens, **kw) -> list[str]:
    det = IncrementalDetokenizer(tok, prompt, **kw)
    return [det.push(t) for t in tokens] + [det.finish()]


def test_sentencepiece_spaces_survive_streaming(sp_tok):
    prompt = sp_tok("the model")["input_ids"]
    tokens = sp_tok("experts machines serve tokens", add_special_tokens=False)["input_ids"]
    pieces = _stream(sp_tok, prompt, tokens)
    # each word's piece carries its space: the first keeps it after the prompt, as the full text spells it
    assert pieces[:4] == [" experts", " machines", " serve", " tokens"] and pieces[-1] == ""
    assert "".join(pieces) == " experts machines serve tokens"
    full = sp_tok.decode(prompt + tokens, skip_special_tokens=True)
    assert full == "the model experts machines serve tokens"
    assert "".join(pieces) == full[len(sp_tok.decode(prompt, skip_special_tokens=True)):]
    # one token at a time decoded alone loses the spaces (what the server used to do)
    assert "".join(sp_tok.decode([t]) for t in tokens) == "expertsmachinesservetokens"
    # without a prompt the text starts as decode() starts it: no leading space
    assert "".join(_stream(sp_tok, [], tokens)) == sp_tok.decode(tokens) == "experts machines serve tokens"


def test_byte_level_non_ascii_is_never_split(bl_tok):
    tokens = bl_tok(" café €日 hello", add_special_tokens=False)["input_ids"]
    euro = bl_tok("€", add_special_tokens=False)["input_ids"]
    assert len(euro) == 3  # one character over three byte tokens
    pieces = _stream(bl_tok, bl_tok("hi")["input_ids"], tokens)
    assert "".join(pieces) == " café €日 hello" == bl_tok.decode(tokens)
    assert all("\ufffd" not in p for p in pieces)
    assert "€" in pieces and "日" in pieces  # emitted whole, once their last byte arrived
    # a character left incomplete at the end decodes as the full decode does
    cut = tokens[:-8]  # ... '€' then the first byte of '日'
    assert decode_completion(bl_tok, [], cut) == bl_tok.decode(cut)


@pytest.mark.parametrize("which", ["sp", "bl"])
def test_random_token_streams_equal_the_full_decode(which, sp_tok, bl_tok):
    tok = sp_tok if which == "sp" else bl_tok
    rng = random.Random(7)
    prompt = tok("hello world")["input_ids"]
    for _ in range(40):
        tokens = [rng.randrange(128) for _ in range(rng.randrange(1, 30))]
        text = "".join(_stream(tok, prompt, tokens))
        head = tok.decode(prompt[-5:], skip_special_tokens=True)
        assert text == tok.decode(prompt[-5:] + tokens, skip_special_tokens=True)[len(head):]
        assert text == decode_completion(tok, prompt, tokens)


def test_special_tokens_are_skipped_by_default(sp_tok):
    tokens = [*sp_tok("hello", add_special_tokens=False)["input_ids"], sp_tok.eos_token_id]
    assert "".join(_stream(sp_tok, [], tokens)) == "hello"
    assert "".join(_stream(sp_tok, [], tokens, skip_special_tokens=False)) == "hello</s>"


def test_stop_strings_across_chunks_and_held_back_text():
    m = StopMatcher(("END", "\n\n"))
    assert [m.feed(x) for x in ("abc E", "N", "xyz")] == ["abc ", "", "ENxyz"]  # "E", "EN" held, then let go
    assert m.stopped is None and m.flush() == ""
    m = StopMatcher(("END",))
    assert [m.feed(x) for x in ("one E", "N", "D two")] == ["one ", "", ""]
    assert m.stopped == "END" and m.feed("more") == "" and m.flush() == ""
    m = StopMatcher(("op", "stop"))
    assert m.feed("a stop op") == "a " and m.stopped == "stop"  # the earliest match wins
    m = StopMatcher(("xyz",))
    assert m.feed("ab x") == "ab " and m.flush() == "x"  # held back text comes out at the end
    assert StopMatcher(()).feed("anything") == "anything"
