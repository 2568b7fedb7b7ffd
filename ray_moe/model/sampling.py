"""Next-token sampling: greedy, temperature, top-p; seeded and retry-safe (pure torch).

A sampled token depends only on the logits, the request's sampling parameters and the position it is
sampled for (the generator is seeded from (seed, position)), so a step that is rerun (a stale generation,
a requeued sequence) samples the same token again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How one request picks its tokens. temperature 0 is greedy (argmax)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(ge=1, le=1 << 20)
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SampleSpec:
    """What a rank needs to sample one sequence's next token at ``position`` (the wire form)."""

    temperature: float
    top_p: float
    seed: int
    position: int


def _generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    h = hashlib.sha256(f"{seed}:{position}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """logits [S, V] float32 -> one token per row (greedy rows in one argmax, sampled rows one by one)."""
    if not specs:
        return []
    return [int(t) for t in sample_tensor(logits, specs).tolist()]


def sample_tensor(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """``sample`` on the logits' device: [S] int64, no host wait (read it when the step is done)."""
    out = torch.argmax(logits, dim=-1)
    for i, sp in enumerate(specs):
        if sp.temperature <= 0.0:
            continue
        p = torch.softmax(logits[i] / sp.temperature, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, idx = torch.sort(p, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < sp.top_p  # the smallest prefix with mass >= top_p
            keep[0] = True
            p = torch.zeros_like(p).scatter_(0, idx[keep], sorted_p[keep])
        g = _generator(sp.seed, sp.position, p.device)
        out[i] = torch.multinomial(p / p.sum(), 1, generator=g)[0]
    return out


__all__ = ["SamplingParams", "SampleSpec", "sample", "sample_tensor"]
