"""Exact streamed text: incremental detokenization and stop strings (pure; any Hugging Face tokenizer).

Decoding each new token alone loses what the tokenizer's decoder does across tokens: a SentencePiece-style
``Metaspace`` decoder turns ``▁`` into a space except at the start of the decoded text (so ``'▁machines'``
alone decodes to ``'machines'``), and a byte-level BPE splits one non-ASCII character over several tokens
(``café``: the ``é`` is two byte tokens, each alone an incomplete UTF-8 sequence, ``'\\ufffd'``).

``IncrementalDetokenizer`` uses the prefix-offset method of vLLM and TGI: it keeps ``prefix_offset`` (where
the decoded window starts) and ``read_offset`` (how far text was emitted); for a new token it decodes
``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]`` and emits only what the second adds, once it does
not end in the replacement character (the bytes of a character still incomplete). The window starts a few
prompt tokens back (``context``), so the first generated token's leading space is kept as in the full text.
Concatenated ``push`` results plus ``finish`` equal ``decode(context + tokens)[len(decode(context)):]`` (the
completion's text as the full decode spells it).

``StopMatcher`` finds stop strings in that text across token boundaries: text that could still be the start
of a stop string is held back until it is known not to be one; a match ends the text before the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 byte sequence decodes to
CONTEXT_TOKENS = 5  # prompt tokens the decoded window starts with (vLLM's initial offset)


class IncrementalDetokenizer:
    """Streams the text of generated tokens exactly as a decode of the whole sequence would spell it.

    tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``); prompt: the prompt's token
    ids (its last ``context`` tokens seed the window; their text is never emitted); skip_special_tokens: drop
    special tokens (``</s>``, ``<pad>``) from the text, as the non-streamed text does."""

    def __init__(self, tokenizer: Any, prompt: Sequence[int] = (), *, skip_special_tokens: bool = True,
                 context: int = CONTEXT_TOKENS) -> None:
        if context < 0:
            raise ValueError(f"context={context}: must be >= 0")
        self.tokenizer = tokenizer
        self.skip_special_tokens = bool(skip_special_tokens)
        self.ids: list[int] = [int(t) for t in prompt[len(prompt) - context:]] if context else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # the text emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, token: int) -> str:
        """Add one generated token id; returns the text it completes ("" while a character is incomplete)."""
        self.ids.append(int(token))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += new
            return new
        return ""

    def finish(self) -> str:
        """The text still held back at the end (an incomplete character decodes as the replacement character,
        as in the full decode)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        new = full[len(prefix):] if full.startswith(prefix) else ""
        self.text += new
        return new


def decode_completion(tokenizer: Any, prompt: Sequence[int], tokens: Sequence[int], *,
                      skip_special_tokens: bool = True) -> str:
    """The completion's whole text, exactly what streaming ``tokens`` through an ``IncrementalDetokenizer``
    yields (the non-streamed response's text)."""
    det = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    for t in tokens:
        det.push(t)
    det.finish()
    return det.text


@dataclass
class StopMatcher:
    """Stop strings matched on the streamed text, across token boundaries (the stop string is not emitted).

    ``feed(text)`` returns the text safe to emit now; after a match ``stopped`` is the matched string and
    further text is dropped. ``flush()`` (at the end of the request) returns what was held back."""

    stops: tuple[str, ...] = ()
    stopped: str | None = None
    _held: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        self.stops = tuple(s for s in self.stops if s)

    def feed(self, text: str) -> str:
        if self.stopped is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            at, stop = min(hits)
            self.stopped, self._held = stop, ""
            return buf[:at]
        keep = 0  # the longest suffix of buf that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped is not None else self._held), ""
        return out


__all__ = ["CONTEXT_TOKENS", "REPLACEMENT", "IncrementalDetokenizer", "StopMatcher", "decode_completion"]
