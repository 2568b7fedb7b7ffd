"""Next-token sampling: greedy, temperature, top-p, penalties, min_tokens masking, logprobs; seeded and
retry-safe (pure torch).

A sampled token depends only on the logits, the request's sampling parameters, the tokens before it (for the
penalties) and the position it is sampled for (the generator is seeded from (seed, position)), so a step that
is rerun (a stale generation, a requeued sequence) samples the same token again.

The logits are processed in vLLM's order before the token is picked: the logit bias (OpenAI's ``logit_bias``:
a bias in [-100, 100] added to a token's logit), the repetition penalty (Hugging Face
semantics, over prompt + generated tokens: a positive logit divided by it, a negative one multiplied), then the
frequency and presence penalties (OpenAI semantics, over the generated tokens only: ``logit -= frequency *
count + presence * (count > 0)``), then the min_tokens mask (end-of-sequence and stop ids at -inf while fewer
than ``min_tokens`` tokens were generated), then temperature and top-p.

Logprobs are the RAW ones (vLLM's default ``raw_logprobs``): ``log_softmax`` of the model's logits before any
bias, penalty, mask or temperature, in float32; the sampled token's logprob and the ``logprobs`` most likely
alternatives (ids and logprobs, most likely first).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20  # top alternatives per sampled token
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's bound)


class SamplingParams(BaseModel):
    """How one request picks its tokens. temperature 0 is greedy (argmax).

    ignore_eos: generate past the model's end-of-sequence ids (stop_token_ids still stop); min_tokens: the first
    ``min_tokens`` tokens are never an end-of-sequence or stop id (masked on the shard); presence_penalty /
    frequency_penalty in [-2, 2] (OpenAI, over generated tokens); repetition_penalty > 0 (Hugging Face, over
    prompt + generated; 1: off); logprobs: None (none), or 0..20 alternatives per sampled token (the sampled
    token's own logprob always comes with them); expert_stats: the request's routed experts per MoE layer (counts
    of (token, expert) pairs, prompt and generated apart) and the placement generations that served it come
    back with it (``RequestHandle.expert_stats``; off: no step does any extra work); logit_bias: {token id: bias
    in [-100, 100]} added to those logits before the penalties (a mapping, kept as sorted (id, bias) pairs; the
    ids are checked against the vocabulary at submission). A bad value raises a ``ValidationError`` (a
    ``ValueError``) naming the field and the value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(ge=1, le=1 << 20)
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=1 << 20)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    expert_stats: bool = Field(default=False, strict=True)
    logit_bias: tuple[tuple[int, float], ...] = ()

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_pairs(cls, v):
        """{id: bias} or (id, bias) pairs -> sorted pairs; ids >= 0, biases finite in [-100, 100]."""
        pairs = list(v.items()) if isinstance(v, dict) else list(v or ())
        out = {}
        for pair in pairs:
            tok, bias = pair
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias: key {tok!r} is not a token id (an integer >= 0)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{tok}]: {bias!r} is not a bias in [-100, 100]")
            out[int(tok)] = float(bias)
        return tuple(sorted(out.items()))

    @model_validator(mode="after")
    def _consistent(self) -> "SamplingParams":
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_new_tokens={self.max_new_tokens}")
        bad = [t for t in self.stop_token_ids if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is not a token id (>= 0)")
        return self

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the sequence's tokens (the rank keeps them: ``WorkItem.keep_tokens``)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass(frozen=True)
class SampleSpec:
    """What a rank needs to sample one sequence's next token at ``position`` (the wire form).

    presence_penalty / frequency_penalty / repetition_penalty: as ``SamplingParams`` (the rank reads the
    sequence's tokens before ``position``; the first ``prompt_len`` are the prompt); suppress: token ids masked
    to -inf while ``position < suppress_until`` (min_tokens: end-of-sequence and stop ids); logprobs: None, or
    how many alternatives to return with the sampled token's logprob; logit_bias: (token id, bias) pairs added to
    the logits first."""

    temperature: float
    top_p: float
    seed: int
    position: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_len: int = 0
    suppress: tuple[int, ...] = ()
    suppress_until: int = 0
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def at(self, position: int) -> "SampleSpec":
        """This spec at ``position`` (``dataclasses.replace(self, position=position)``, built directly at half
        the cost: a multi-step decode request makes one per sequence per sub-step)."""
        return SampleSpec(self.temperature, self.top_p, self.seed, position, self.presence_penalty,
                          self.frequency_penalty, self.repetition_penalty, self.prompt_len, self.suppress,
                          self.suppress_until, self.logprobs, self.logit_bias)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def masked(self) -> bool:
        """Whether ``suppress`` applies at this position."""
        return bool(self.suppress) and self.position < self.suppress_until


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's raw logprob and its ``len(top_ids)`` most likely alternatives (most likely first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, eq=False)
class LogprobsPending:
    """The logprobs of a step's sampled rows, still on the device: ``read`` them once the step is done.
    rows: indices (in the step's sampled rows) that asked; ks: alternatives each asked for; chosen: [R] float32;
    top_values: [R, K] float32; top_ids: [R, K] int64 (K = max(ks))."""

    rows: tuple[int, ...]
    ks: tuple[int, ...]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def read(self) -> dict[int, TokenLogprobs]:
        """{sampled row index: its logprobs} (a host read)."""
        chosen = self.chosen.cpu().tolist()
        vals, ids = self.top_values.cpu().tolist(), self.top_ids.cpu().tolist()
        return {r: TokenLogprobs(float(c), tuple(int(x) for x in i[:k]), tuple(float(v) for v in vs[:k]))
                for r, k, c, vs, i in zip(self.rows, self.ks, chosen, vals, ids)}


def _generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    h = hashlib.sha256(f"{seed}:{position}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))


def process_logits(logits: torch.Tensor, specs: Sequence[SampleSpec],
                   contexts: Sequence[Sequence[int] | None] | None = None) -> torch.Tensor:
    """logits [S, V] float -> the logits the token is picked from: the logit bias, penalties and the min_tokens
    mask applied (a copy when any row changes; the input itself otherwise). contexts[i]: row i's tokens before
    its position (prompt + generated; needed when its spec is ``penalized``). A bias of an id outside the
    vocabulary raises ``ValueError`` (submission refuses it first)."""
    todo = [i for i, sp in enumerate(specs) if sp.penalized or sp.masked or sp.logit_bias]
    if not todo:
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    for i in todo:
        sp, row = specs[i], out[i]
        if sp.logit_bias:
            ids, bias = zip(*sp.logit_bias)
            if max(ids) >= vocab:
                raise ValueError(f"logit_bias: token id {max(ids)} is outside the vocabulary [0, {vocab})")
            row[torch.as_tensor(ids, dtype=torch.int64, device=out.device)] += torch.as_tensor(
                bias, dtype=row.dtype, device=out.device)
        if sp.penalized:
            ctx = None if contexts is None else contexts[i]
            if ctx is None:
                raise ValueError(f"sampled row {i} (position {sp.position}): penalties need the sequence's tokens")
            ids = torch.as_tensor(list(ctx), dtype=torch.int64, device=out.device)
            if sp.repetition_penalty != 1.0 and ids.numel():
                seen = torch.unique(ids)
                s = row[seen]
                row[seen] = torch.where(s < 0, s * sp.repetition_penalty, s / sp.repetition_penalty)
            gen = ids[sp.prompt_len:]
            if (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0) and gen.numel():
                counts = torch.bincount(gen, minlength=vocab)[:vocab].to(row.dtype)
                row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)
        if sp.masked:
            ids = torch.as_tensor([t for t in sp.suppress if 0 <= t < vocab], dtype=torch.int64, device=out.device)
            row[ids] = float("-inf")
    return out


def sample(logits: torch.Tensor, specs: list[SampleSpec],
           contexts: Sequence[Sequence[int] | None] | None = None) -> list[int]:
    """logits [S, V] float32 -> one token per row (greedy rows in one argmax, sampled rows one by one)."""
    if not specs:
        return []
    return [int(t) for t in sample_tensor(logits, specs, contexts).tolist()]


def plain_greedy(specs: Sequence[SampleSpec]) -> bool:
    """Whether every row takes the argmax of its raw logits and asks for nothing else: no temperature, penalty,
    logit bias, min_tokens mask at its position or logprobs (``sample_tensor`` is then one argmax)."""
    return all(sp.temperature <= 0.0 and not sp.penalized and not sp.masked and not sp.logit_bias
               and sp.logprobs is None for sp in specs)


def sample_tensor(logits: torch.Tensor, specs: list[SampleSpec],
                  contexts: Sequence[Sequence[int] | None] | None = None) -> torch.Tensor:
    """``sample`` on the logits' device: [S] int64, no host wait (read it when the step is done)."""
    logits = process_logits(logits, specs, contexts)
    out = torch.argmax(logits, dim=-1)
    for i, sp in enumerate(specs):
        if sp.temperature <= 0.0:
            continue
        p = torch.softmax(logits[i].float() / sp.temperature, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, idx = torch.sort(p, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < sp.top_p  # the smallest prefix with mass >= top_p
            keep[0] = True
            p = torch.zeros_like(p).scatter_(0, idx[keep], sorted_p[keep])
        g = _generator(sp.seed, sp.position, p.device)
        out[i] = torch.multinomial(p / p.sum(), 1, generator=g)[0]
    return out


def logprobs_tensor(logits: torch.Tensor, picked: torch.Tensor, specs: Sequence[SampleSpec]) -> LogprobsPending | None:
    """The raw logprobs of the rows whose spec asks (``logprobs`` not None), on the logits' device (no host
    wait): logits [S, V] (the model's, unprocessed), picked [S] int64. None when no row asks."""
    rows = [i for i, sp in enumerate(specs) if sp.logprobs is not None]
    if not rows:
        return None
    ks = tuple(int(specs[i].logprobs) for i in rows)
    idx = torch.tensor(rows, dtype=torch.int64).to(logits.device)
    lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
    chosen = lp.gather(1, picked.index_select(0, idx).to(torch.int64).unsqueeze(1)).squeeze(1)
    k = min(max(ks), lp.shape[-1])
    top = torch.topk(lp, k, dim=-1) if k > 0 else None
    empty = lp.new_zeros((len(rows), 0))
    return LogprobsPending(tuple(rows), ks, chosen, empty if top is None else top.values,
                           empty.to(torch.int64) if top is None else top.indices)


__all__ = ["MAX_LOGPROBS", "LogprobsPending", "SamplingParams", "SampleSpec", "TokenLogprobs", "logprobs_tensor",
           "plain_greedy", "process_logits", "sample", "sample_tensor"]
