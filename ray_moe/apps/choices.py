"""One choice of an OpenAI response as it is generated (``Choice``: tokens in, exact text out, stop strings and
stop token ids, logprobs), the two OpenAI forms of its logprobs (completions, chat) and its ``ray_moe`` field
(expert statistics). Pure: no Ray, no HTTP."""

from __future__ import annotations

from enum import Enum
from typing import Any

from ray_moe.apps.detokenize import IncrementalDetokenizer, StopMatcher
from ray_moe.apps.vocab import token_bytes, token_text, top_logprobs_dict


class FinishReason(str, Enum):
    STOP = "stop"      # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached


class Choice:
    """One sample being generated: its tokens in, its exact text out (stop token ids, stop strings).

    index: the choice's index in the response (prompt-major: prompt i, sample s -> i * n + s); sample: s;
    prompt: its prompt token ids; echo: text put before the completion's text (``echo``)."""

    def __init__(self, index: int, sample: int, prompt: list[int], max_tokens: int, *, tokenizer: Any,
                 stops: tuple[str, ...], stop_ids: tuple[int, ...], skip_special_tokens: bool, echo: str = "") -> None:
        self.index, self.sample, self.prompt, self.max_tokens, self.echo = index, sample, prompt, max_tokens, echo
        self.stop_ids = frozenset(stop_ids)
        self.detok = (None if tokenizer is None else
                      IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens))
        self.stops = StopMatcher(stops)
        self.tokens: list[int] = []
        self.text = ""
        self.stop_reason: str | int | None = None
        self.finish: FinishReason | None = None
        self.handle: Any = None
        self.wants_logprobs = False  # the request asked for logprobs
        self.wants_expert_stats = False  # the request asked for ``ray_moe.expert_stats``
        self.logprobs: list[Any] = []  # one TokenLogprobs per token in ``tokens`` (when the request asked)
        self.offsets: list[int] = []  # each token's text offset in echo + text

    def on_token(self, tok: int, logprobs: Any = None) -> str:
        """A generated token (and its ``TokenLogprobs``, when asked); returns the text it adds (after a stop
        string matched: finished, "")."""
        if self.finish is not None:
            return ""
        self.tokens.append(tok)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.offsets.append(len(self.echo) + len(self.text))
        if tok in self.stop_ids:  # its text is not part of the output (the loop ends the request on it)
            self.stop_reason = tok
            return ""
        if self.detok is None:
            return ""
        new = self.stops.feed(self.detok.push(tok))
        if self.stops.stopped is not None:
            self.stop_reason, self.finish = self.stops.stopped, FinishReason.STOP
        self.text += new
        return new

    def on_end(self) -> str:
        """The request ended (EOS, a stop token, max_tokens); returns the text still held back."""
        if self.finish is not None:
            return ""
        new = ""
        if self.detok is not None:
            new = self.stops.feed(self.detok.finish())
            if self.stops.stopped is not None:
                self.stop_reason = self.stops.stopped
            else:
                new += self.stops.flush()
        self.text += new
        self.finish = (FinishReason.LENGTH if self.stop_reason is None and len(self.tokens) >= self.max_tokens
                       else FinishReason.STOP)
        return new


def completion_logprobs(tokenizer: Any, tokens: list[int], logprobs: list[Any], offsets: list[int]) -> dict:
    """The completions form: {tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}; a token's
    text is its id decoded alone, ``token_id:<id>`` for an id the tokenizer lacks (or without a tokenizer), and
    every top list keeps one entry per id (``vocab.top_logprobs_dict``: the chosen token under its own text)."""
    return {"tokens": [token_text(tokenizer, t) for t in tokens],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [top_logprobs_dict(tokenizer, t, lp.top_ids, lp.top_logprobs)
                             for t, lp in zip(tokens, logprobs)],
            "text_offset": list(offsets)}


def chat_logprobs(tokenizer: Any, tokens: list[int], logprobs: list[Any]) -> dict:
    """The chat form: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]} (a list per
    token: distinct ids stay distinct entries; an id the tokenizer lacks is ``token_id:<id>`` with no bytes)."""
    def entry(tok: int, value: float) -> dict:
        return {"token": token_text(tokenizer, tok), "logprob": value, "bytes": token_bytes(tokenizer, tok)}

    return {"content": [{**entry(t, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                        for t, lp in zip(tokens, logprobs)]}


def expert_stats_field(stats: dict[str, list] | None) -> dict:
    """A choice's ``ray_moe`` field from ``RequestHandle.expert_stats()`` ({"generations", "prompt": [[count per
    expert] per layer], "generated"}): {"expert_stats": {"generations": [...], "layers": [{"layer": i,
    "prompt": {expert id: count}, "generated": {expert id: count}}]}}, non-zero counts only (JSON object keys:
    the expert ids as strings)."""
    stats = stats or {"generations": [], "prompt": [], "generated": []}
    prompt, generated = stats["prompt"], stats["generated"]

    def sparse(row: list[int]) -> dict[str, int]:
        return {str(e): int(n) for e, n in enumerate(row) if n}

    layers = [{"layer": i, "prompt": sparse(p), "generated": sparse(g)}
              for i, (p, g) in enumerate(zip(prompt, generated))]
    return {"expert_stats": {"generations": list(stats["generations"]), "layers": layers}}


__all__ = ["Choice", "FinishReason", "chat_logprobs", "completion_logprobs", "expert_stats_field"]
