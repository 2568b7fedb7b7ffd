"""Nearest-rank quantiles (spec 0x0DA). Pure: no Ray.

For sorted observations ``x_(1) <= ... <= x_(n)`` the convention is ``Q_q = x_(ceil(q n))`` for
``0 < q <= 1``: every quantile is an observed value (no interpolation), and ``Q_1`` is the maximum.
``q * n`` is computed exactly (``q`` is read through its decimal text, so ``q=0.07, n=100`` is rank 7,
not the rank 8 that binary floating point would give).

A summary names its unit and evidence class: the 0x0DA fixture's values are *analytical units*, not
milliseconds, TTFT, TPOT or GPU timing, and must not be published as latency.
"""

from __future__ import annotations

import math
from decimal import Decimal
from enum import Enum
from fractions import Fraction
from typing import Iterable, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

QuantileLevel = Union[float, int, str, Fraction, Decimal]


class EvidenceClass(str, Enum):
    """What produced the observations (0x0D, 0x0DA): only MEASURED may be called latency."""

    ANALYTICAL = "analytical"
    MEASURED = "measured"


def _exact_level(q: QuantileLevel) -> Fraction:
    if isinstance(q, bool):
        raise ValueError(f"q={q!r} must be a number in (0, 1]")
    try:
        f = Fraction(repr(q)) if isinstance(q, float) else Fraction(q)
    except (TypeError, ValueError):
        raise ValueError(f"q={q!r} must be a number in (0, 1]") from None
    if not (0 < f <= 1):
        raise ValueError(f"q={q!r} must be in (0, 1]")
    return f


def nearest_rank_index(q: QuantileLevel, n: int) -> int:
    """The 1-based rank ``ceil(q n)`` (exact arithmetic)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1")
    f = _exact_level(q) * n
    return -((-f.numerator) // f.denominator)


def _checked_sorted(sample: Iterable[float]) -> list[float]:
    xs = list(sample)
    if not xs:
        raise ValueError("sample=[] is empty: a quantile needs at least one observation")
    for i, x in enumerate(xs):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"sample[{i}]={x!r} must be a finite number")
    return sorted(xs)


def nearest_rank(sample: Iterable[float], q: QuantileLevel) -> float:
    """``Q_q = x_(ceil(q n))`` of the sample (an element of the sample)."""
    xs = _checked_sorted(sample)
    return xs[nearest_rank_index(q, len(xs)) - 1]


class QuantileSummary(BaseModel):
    """p50, p95 and max by nearest rank over ``n`` observations, with unit and evidence class."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n: int = Field(ge=1)
    p50: float
    p95: float
    max: float
    unit: str = Field(min_length=1)
    evidence: EvidenceClass
    convention: str = "nearest-rank ceil(q n)"

    @model_validator(mode="after")
    def _ordered(self) -> "QuantileSummary":
        if not (self.p50 <= self.p95 <= self.max):
            raise ValueError(f"p50={self.p50}, p95={self.p95}, max={self.max} are not ordered")
        return self

    @property
    def is_latency(self) -> bool:
        """Only measured observations may be labeled latency (0x0EB: 'synthetic units labeled latency')."""
        return self.evidence is EvidenceClass.MEASURED


def summarize(
    sample: Sequence[float] | Iterable[float],
    *,
    unit: str,
    evidence: EvidenceClass,
) -> QuantileSummary:
    """Nearest-rank summary of one sample.

    1. Reject an empty sample and non-finite values.
    2. Sort once; p50 = x_(ceil(n/2)), p95 = x_(ceil(0.95 n)), max = x_(n).
    """
    xs = _checked_sorted(sample)
    n = len(xs)
    return QuantileSummary(
        n=n,
        p50=xs[nearest_rank_index("0.5", n) - 1],
        p95=xs[nearest_rank_index("0.95", n) - 1],
        max=xs[n - 1],
        unit=unit,
        evidence=EvidenceClass(evidence),
    )
