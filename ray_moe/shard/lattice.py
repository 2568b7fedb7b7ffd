# ======================================================================================================
#  THE STEP SHAPES OF A DEPLOYMENT, FIXED AT START (pure: no torch, no Ray)
#
#   deployment sizes (running sequences per rank, prefill tokens per step)
#     ──> decode sizes:  rows of a step of one-row sequences only (whole-step graphs: attention inside)
#     ──> token sizes:   rows of any other step: up to ``whole_rows`` whole-step graphs (attention inside, read
#                        in place by the paged varlen kernel), above piecewise graphs (attention between pieces)
#     ──> sampled rows:  the LM-head rows of a piecewise step (every sequence of a step is sampled at most once)
#   a step takes the smallest size that holds it (padding rows after the real ones); one beyond the largest
#   size runs eagerly. Every size is captured before the deployment serves (``StepGraphRunner.capture``).
# ======================================================================================================
"""The shape lattice of a deployment's generation steps (vLLM's and SGLang's capture sizes, chosen at start).

Why these sizes (one H200, the 48-layer Qwen3-30B-A3B shape; a step reads the weights of every expert its
routes touch, ~59 GB when it touches all of them, ~14 ms at the H200's ~4.3 TB/s):

* decode (``moe.dispatch.bucket.token_buckets``): fine below 64 rows (the experts touched still grow with the
  rows), coarse above (nearly every expert is read anyway; a padding row is one row of dense work): 17 sizes
  up to 256, 29 up to 1,024 (the CUDA default running limit, ``driver/defaults.py``).
* tokens: a step of N rows does ~6 GFLOP of matrix work per row (3 B active parameters), so it stays bound by
  its weight reads up to ~2k rows (6 GFLOP x 2k at ~790 TFLOP/s ~ 15 ms): powers of two up to 1024 (padding
  there costs almost no time), four sizes an octave to 2048, eight an octave above (at most 12.5% padding where
  rows cost compute), and the largest step exactly (``step_tokens`` prompt tokens beside a decode row of every
  running sequence): 28 sizes for 8,192 step tokens and 256 or 1,024 sequences, 36 for 16,384 (the CUDA default).
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_moe.moe.dispatch.bucket import token_buckets

MIN_TOKEN_ROWS = 16
DENSE_ROWS = 1024  # below: powers of two (weight-bound steps)
FINE_ROWS = 2048  # above: eight sizes an octave
WHOLE_ROWS = 2048  # token sizes up to this captured as whole-step graphs (the rest piecewise)


def token_sizes(max_rows: int, floor: int = MIN_TOKEN_ROWS) -> tuple[int, ...]:
    """The row counts of piecewise-captured steps up to ``max_rows`` (always included): powers of two from
    ``floor`` to ``DENSE_ROWS``, then m * 2**e with m of three significant bits (four an octave) to
    ``FINE_ROWS``, then of four (eight an octave)."""
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows}: must be >= 1")
    out: list[int] = []
    n = max(1, int(floor))
    while n < max_rows:
        out.append(n)
        if n < DENSE_ROWS:
            n *= 2
        else:
            e = n.bit_length() - (3 if n < FINE_ROWS else 4)
            n += 1 << e
    out.append(int(max_rows))
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class StepLattice:
    """The sizes a deployment captures (every rank alike).

    rank_running: sequences running on one rank at most (the scheduler's per-rank limit)
    step_tokens:  prompt tokens of one rank in one step at most (beyond: a cached prefix expected, an eager step)
    decode_sizes: rows of decode-only steps (``token_buckets(rank_running)``)
    token_sizes:  rows of the other steps, up to ``step_tokens + rank_running``
    whole_rows:   token sizes up to this run as whole-step graphs (attention inside), larger ones piecewise
    """

    rank_running: int
    step_tokens: int
    decode_sizes: tuple[int, ...]
    token_sizes: tuple[int, ...]
    whole_rows: int = WHOLE_ROWS

    @classmethod
    def build(cls, rank_running: int, step_tokens: int, whole_rows: int | None = None) -> "StepLattice":
        """The lattice of a deployment; ``ValueError`` naming the field for a size below 1 (``whole_rows``: 0
        or more, 0 for no whole-step token graph; None: ``WHOLE_ROWS``)."""
        whole_rows = WHOLE_ROWS if whole_rows is None else whole_rows
        for name, v, low in (("rank_running", rank_running, 1), ("step_tokens", step_tokens, 1),
                             ("whole_rows", whole_rows, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}={v!r}: must be an integer >= {low}")
        return cls(rank_running, step_tokens, token_buckets(rank_running), token_sizes(step_tokens + rank_running),
                   int(whole_rows))

    @property
    def max_decode(self) -> int:
        return self.decode_sizes[-1]

    @property
    def max_tokens(self) -> int:
        return self.token_sizes[-1]

    def decode_rows(self, n: int) -> int | None:
        """The decode size of a step of ``n`` one-row sequences (None: beyond the lattice)."""
        return next((c for c in self.decode_sizes if c >= max(1, n)), None)

    def token_rows(self, n: int) -> int | None:
        """The token size of a step of ``n`` rows (None: beyond the lattice)."""
        return next((c for c in self.token_sizes if c >= max(1, n)), None)

    def sampled_rows(self, rows: int) -> int:
        """The LM-head rows of a piecewise step of ``rows`` rows: one per sequence it can hold."""
        return min(int(rows), self.rank_running)

    def whole(self, rows: int) -> bool:
        """A token size captured as a whole-step graph (else piecewise)."""
        return rows <= self.whole_rows

    def describe(self) -> dict:
        return {"rank_running": self.rank_running, "step_tokens": self.step_tokens,
                "decode_sizes": list(self.decode_sizes), "token_sizes": list(self.token_sizes),
                "whole_rows": self.whole_rows}


__all__ = ["StepLattice", "token_sizes", "MIN_TOKEN_ROWS", "WHOLE_ROWS"]
