"""Token ids the tokenizer cannot decode: a model's padded vocabulary, handled as vLLM handles it (pure).

A checkpoint's embedding and ``lm_head`` often have more rows than its tokenizer has ids (Qwen's 151,936 rows for
151,665 ids: padded to a multiple of 64 for the GEMMs), so the model can sample an id the tokenizer has no entry
for (rarely with trained weights, often with random ones). ray-moe treats such an id the way vLLM does:

* it is a token id like any other: a prompt, ``logit_bias`` or ``/detokenize`` may hold any id below
  max(the tokenizer's size, the model's vocabulary) (vLLM's input processor checks the same bound), and a
  generated one is returned in ``token_ids`` and counted in ``usage``;
* its text is empty: the completion's text, the streamed text, ``echo`` and ``/detokenize`` decode it to ``''``
  (vLLM's detokenizer replaces the ``None`` such an id converts to by ``''``; Hugging Face's fast tokenizers
  skip it in ``decode``): ``PaddedVocabTokenizer`` drops it before every decode, whatever the tokenizer;
* in logprobs its token is spelled ``token_id:<id>`` (vLLM's spelling for a token shown by its id,
  ``--return-tokens-as-token-ids``; its chat ``bytes`` are empty), so distinct ids stay distinct. Where vLLM keys
  a completion's ``top_logprobs`` by token text and so merges ids that spell the same (every padded id spells
  ``''``), ``top_logprobs_dict`` keeps one entry per id: the chosen token keeps its own text, a later id whose
  text is already taken is keyed ``token_id:<id>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ID_PREFIX = "token_id:"  # a token shown by its id (no tokenizer, or an id the tokenizer lacks)


class PaddedVocabTokenizer:
    """A Hugging Face tokenizer whose ``decode`` drops the ids it has no entry for (``decodable``), so they decode
    to empty text; everything else is the tokenizer's own (``apply_chat_template``, ``__call__``, attributes)."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner = tokenizer
        self.size = len(tokenizer)

    def decodable(self, token: int) -> bool:
        return 0 <= int(token) < self.size

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return self.inner.decode([int(t) for t in ids if 0 <= int(t) < self.size], **kwargs)

    def __len__(self) -> int:
        return self.size

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def decodable(tokenizer: Any, token: int) -> bool:
    """Whether ``tokenizer`` has an entry for ``token`` (False without a tokenizer)."""
    if tokenizer is None:
        return False
    check = getattr(tokenizer, "decodable", None)
    return bool(check(token)) if check is not None else 0 <= int(token) < len(tokenizer)


def token_text(tokenizer: Any, token: int) -> str:
    """One token's text in logprobs: the id decoded alone (special tokens kept), or ``token_id:<id>`` for an id
    the tokenizer lacks (and for every id without a tokenizer)."""
    if not decodable(tokenizer, token):
        return f"{ID_PREFIX}{int(token)}"
    return tokenizer.decode([int(token)], skip_special_tokens=False)


def token_bytes(tokenizer: Any, token: int) -> list[int]:
    """The UTF-8 bytes of a token's text (chat logprobs' ``bytes``): none for an id the tokenizer lacks."""
    if tokenizer is not None and not decodable(tokenizer, token):
        return []
    return list(token_text(tokenizer, token).encode("utf-8"))


def top_logprobs_dict(tokenizer: Any, chosen: int, ids: Sequence[int], values: Sequence[float]) -> dict[str, float]:
    """A completion's ``top_logprobs`` entry ({token text: logprob}) with one key per distinct id: the chosen
    token keeps its own text; an id whose text an earlier (more likely) id or the chosen one already holds is
    keyed ``token_id:<id>``."""
    texts = [token_text(tokenizer, t) for t in ids]
    reserved = token_text(tokenizer, chosen) if int(chosen) in {int(t) for t in ids} else None
    out: dict[str, float] = {}
    for t, text, v in zip(ids, texts, values):
        key = text
        if key in out or (key == reserved and int(t) != int(chosen)):
            key = f"{ID_PREFIX}{int(t)}"
        out[key] = v
    return out


__all__ = ["ID_PREFIX", "PaddedVocabTokenizer", "decodable", "token_bytes", "token_text", "top_logprobs_dict"]
