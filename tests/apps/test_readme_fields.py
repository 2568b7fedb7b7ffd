"""The README's table of the OpenAI surface cannot rot: every field the request models of
``apps/openai_protocol.py`` accept (nested ones as ``stream_options.include_usage`` and ``messages[].role``) has a
row in the "Serving over HTTP" section's field table with a known status, no row names a field the models do not
accept, and every endpoint the server routes (``apps.metrics.ApiRoute``) is in its endpoint table."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from ray_moe.apps.metrics import ApiRoute
from ray_moe.apps.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)

README = Path(__file__).resolve().parents[2] / "README.md"
STATUSES = ("supported", "accepted, no effect", "refused (400)")
NESTED: dict[str, tuple[str, type[BaseModel]]] = {"stream_options": ("stream_options.", StreamOptions),
                                                   "messages": ("messages[].", ChatMessage)}
MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


def _section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("### Serving over HTTP\n")
    end = text.index("\n##", start + 1)
    return text[start:end]


def _rows(section: str) -> list[list[str]]:
    """The table rows (cells stripped), header and separator rows left out."""
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("field", "endpoint"):
            continue
        rows.append(cells)
    return rows


def _field_rows() -> dict[str, list[str]]:
    """{field name: its row} of the field table (the rows whose first cell is one backticked name)."""
    out = {}
    for cells in _rows(_section()):
        m = re.fullmatch(r"`([a-z_]+(?:\.[a-z_]+|\[\]\.[a-z_]+)?)`", cells[0])
        if m and len(cells) == 4:
            assert m.group(1) not in out, f"README: {m.group(1)} has two rows"
            out[m.group(1)] = cells
    return out


def accepted_fields() -> set[str]:
    """Every field name the request models accept, nested ones with their parent's prefix."""
    names: set[str] = set()
    for model in MODELS:
        for name in model.model_fields:
            if name in NESTED:
                prefix, inner = NESTED[name]
                names |= {prefix + n for n in inner.model_fields}
                if name == "messages":
                    names.add(name)
            else:
                names.add(name)
    return names


def test_every_accepted_field_has_a_row_with_a_known_status():
    rows = _field_rows()
    want = accepted_fields()
    assert {"logprobs", "top_logprobs", "n", "echo", "stop", "stop_token_ids", "logit_bias", "min_tokens",
            "ignore_eos", "presence_penalty", "user", "return_token_ids", "stream_options.include_usage",
            "messages[].role", "tokens"} <= want  # the models themselves (a rename shows up here first)
    missing = sorted(want - set(rows))
    assert not missing, f"README.md 'Serving over HTTP' lacks rows for {missing}"
    extra = sorted(set(rows) - want)
    assert not extra, f"README.md rows name fields the request models do not accept: {extra}"
    for name, cells in rows.items():
        assert cells[2] in STATUSES, f"README row {name}: status {cells[2]!r} is not one of {STATUSES}"
        assert cells[3], f"README row {name}: no notes"


def test_the_statuses_match_the_models():
    rows = _field_rows()
    assert rows["logit_bias"][2] == "supported"
    # it is real: the bias reaches the sampling parameters the shard's sampler adds to the logits
    assert CompletionRequest(model="m", prompt="x", logit_bias={"1": 2.0}).sampling(4, 0, ())["logit_bias"] == {1: 2.0}
    # a field the README does not list is ignored and named (the header), not refused
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 2, "suffix": "!"})
    assert req.ignored_fields() == ["best_of", "suffix"]
    assert "X-Ray-MoE-Ignored-Fields" in _section()
    # the "in" column names the endpoints whose model accepts the field
    letters = {"C": CompletionRequest, "Ch": ChatCompletionRequest, "T": TokenizeRequest, "D": DetokenizeRequest}
    for name, cells in rows.items():
        top = name.split(".")[0].removesuffix("[]")
        have = {k for k, model in letters.items() if top in model.model_fields}
        assert set(cells[1].split()) == have, f"README row {name}: in {cells[1]!r}, the models say {sorted(have)}"


def test_every_endpoint_is_in_the_endpoint_table():
    section = _section()
    firsts = [cells[0] for cells in _rows(section)]
    for route in ApiRoute:
        if route is ApiRoute.OTHER:
            continue
        assert any(c.startswith("`") and c.endswith(f" {route.value}`") for c in firsts), \
            f"README.md 'Serving over HTTP' has no endpoint row for {route.value}"
