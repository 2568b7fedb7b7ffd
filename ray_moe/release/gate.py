"""Promotion gate: a conjunction, not a score (spec 0x0DC). Pure: no Ray.

    Promote = HashOK and ManifestOK and FaultsOK and RollbackOK
              and N_shadow >= 100 and N_canary >= 200
              and r_drop <= 0.005 and r_fallback <= 0.15
              and N_route_mismatch = N_stale_accept = N_count_failure = 0

``evaluate`` checks every clause and lists every failed one (never stops at the first). Ratio clauses
compare exact fractions with exact decimal thresholds (``4/800 <= 0.005`` holds), and a ratio with a
zero denominator fails its clause: no observations is not evidence of a low ratio.

The fixture passing this gate proves the logical contract only; a real release adds named latency,
throughput, memory, parity, quality and SLO gates from measured artifacts.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from fractions import Fraction
from types import MappingProxyType
from typing import Callable, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_moe.release.bundle import BundleCheck
from ray_moe.release.faults import FaultReport
from ray_moe.release.rollback import RollbackReport
from ray_moe.core.telemetry.metrics import MetricName, TelemetrySnapshot
from ray_moe.core.telemetry.ratios import Ratio


class RatioCounts(BaseModel):
    """A ratio as evidence: both counts, value derived (None at denominator 0)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    numerator: int = Field(ge=0)
    denominator: int = Field(ge=0)

    @model_validator(mode="after")
    def _proportion(self) -> "RatioCounts":
        if self.numerator > self.denominator:
            raise ValueError(f"numerator={self.numerator} exceeds denominator={self.denominator}")
        return self

    @classmethod
    def of(cls, ratio: Ratio) -> "RatioCounts":
        return cls(numerator=ratio.numerator, denominator=ratio.denominator)

    @property
    def fraction(self) -> Fraction | None:
        return None if self.denominator == 0 else Fraction(self.numerator, self.denominator)

    def text(self) -> str:
        f = self.fraction
        return f"{self.numerator}/{self.denominator}" + ("" if f is None else f" = {float(f):.6g}")


class GateEvidence(BaseModel):
    """Everything the gate reads, for one release."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    release_id: str = Field(min_length=1)
    hash_ok: bool
    manifest_ok: bool
    faults_ok: bool
    rollback_ok: bool
    n_shadow: int = Field(ge=0)
    n_canary: int = Field(ge=0)
    drop: RatioCounts
    fallback: RatioCounts
    route_mismatches: int = Field(ge=0)
    stale_accepts: int = Field(ge=0)
    count_failures: int = Field(ge=0)


class GateThresholds(BaseModel):
    """The 0x0DC thresholds (defaults) — configurable per deployment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_shadow: int = Field(default=100, ge=0)
    min_canary: int = Field(default=200, ge=0)
    max_drop: Decimal = Field(default=Decimal("0.005"), ge=0, le=1)
    max_fallback: Decimal = Field(default=Decimal("0.15"), ge=0, le=1)
    max_route_mismatches: int = Field(default=0, ge=0)
    max_stale_accepts: int = Field(default=0, ge=0)
    max_count_failures: int = Field(default=0, ge=0)


class GateClause(str, Enum):
    HASH_OK = "HashOK"
    MANIFEST_OK = "ManifestOK"
    FAULTS_OK = "FaultsOK"
    ROLLBACK_OK = "RollbackOK"
    N_SHADOW = "N_shadow"
    N_CANARY = "N_canary"
    R_DROP = "r_drop"
    R_FALLBACK = "r_fallback"
    ROUTE_MISMATCH = "N_route_mismatch"
    STALE_ACCEPT = "N_stale_accept"
    COUNT_FAILURE = "N_count_failure"


Check = Callable[[GateEvidence, GateThresholds], tuple[bool, str, str]]


def _flag(field: str) -> Check:
    return lambda e, t: (bool(getattr(e, field)), str(getattr(e, field)), "True")


def _at_least(field: str, bound: str) -> Check:
    return lambda e, t: (getattr(e, field) >= getattr(t, bound), str(getattr(e, field)), f">= {getattr(t, bound)}")


def _at_most(field: str, bound: str) -> Check:
    return lambda e, t: (getattr(e, field) <= getattr(t, bound), str(getattr(e, field)), f"<= {getattr(t, bound)}")


def _ratio_at_most(field: str, bound: str) -> Check:
    def check(e: GateEvidence, t: GateThresholds) -> tuple[bool, str, str]:
        r: RatioCounts = getattr(e, field)
        limit = Fraction(getattr(t, bound))
        f = r.fraction
        observed = r.text() if f is not None else f"{r.numerator}/0 (no observations)"
        return (f is not None and f <= limit), observed, f"<= {getattr(t, bound)}"
    return check


@dataclass(frozen=True)
class ClauseSpec:
    clause: GateClause
    description: str
    check: Check


CLAUSES: Mapping[GateClause, ClauseSpec] = MappingProxyType(
    {
        c.clause: c
        for c in (
            ClauseSpec(GateClause.HASH_OK, "bundle and upstream report digests recompute", _flag("hash_ok")),
            ClauseSpec(GateClause.MANIFEST_OK, "bundle matches the placement manifest it binds", _flag("manifest_ok")),
            ClauseSpec(GateClause.FAULTS_OK, "all ten faults injected, each with its safe outcome", _flag("faults_ok")),
            ClauseSpec(GateClause.ROLLBACK_OK, "rollback drill completed in the 0x0EA order", _flag("rollback_ok")),
            ClauseSpec(GateClause.N_SHADOW, "shadow observations", _at_least("n_shadow", "min_shadow")),
            ClauseSpec(GateClause.N_CANARY, "canary observations", _at_least("n_canary", "min_canary")),
            ClauseSpec(GateClause.R_DROP, "dropped / attempted routes", _ratio_at_most("drop", "max_drop")),
            ClauseSpec(GateClause.R_FALLBACK, "fallback steps / all steps", _ratio_at_most("fallback", "max_fallback")),
            ClauseSpec(GateClause.ROUTE_MISMATCH, "route-output mismatches",
                       _at_most("route_mismatches", "max_route_mismatches")),
            ClauseSpec(GateClause.STALE_ACCEPT, "stale handles accepted", _at_most("stale_accepts", "max_stale_accepts")),
            ClauseSpec(GateClause.COUNT_FAILURE, "count-conservation failures",
                       _at_most("count_failures", "max_count_failures")),
        )
    }
)


class ClauseResult(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    clause: GateClause
    passed: bool
    observed: str
    required: str


class GateVerdict(BaseModel):
    """Every clause's result; ``passed`` is their conjunction (validated, never set independently)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    release_id: str
    passed: bool
    results: tuple[ClauseResult, ...]

    @model_validator(mode="after")
    def _conjunction(self) -> "GateVerdict":
        if [r.clause for r in self.results] != list(GateClause):
            raise ValueError(f"results cover {[r.clause.value for r in self.results]}, not every clause of 0x0DC")
        if self.passed != all(r.passed for r in self.results):
            raise ValueError(f"passed={self.passed} is not the conjunction of the clause results")
        return self

    @property
    def failed(self) -> tuple[GateClause, ...]:
        return tuple(r.clause for r in self.results if not r.passed)

    def describe(self) -> str:
        if self.passed:
            return f"release {self.release_id}: promote (all {len(self.results)} clauses hold)"
        lines = [f"release {self.release_id}: blocked by {len(self.failed)} clause(s)"]
        lines += [f"  {r.clause.value}: observed {r.observed}, required {r.required}"
                  for r in self.results if not r.passed]
        return "\n".join(lines)


class PromotionGate:
    """The 0x0DC conjunction with configurable thresholds."""

    def __init__(self, thresholds: GateThresholds | None = None):
        if thresholds is not None and not isinstance(thresholds, GateThresholds):
            raise ValueError(f"thresholds={type(thresholds).__name__} is not GateThresholds")
        self._t = thresholds or GateThresholds()

    @property
    def thresholds(self) -> GateThresholds:
        return self._t

    def evaluate(self, evidence: GateEvidence) -> GateVerdict:
        """1. Check every clause of the table in order. 2. Pass iff all hold; list every failure."""
        if not isinstance(evidence, GateEvidence):
            raise ValueError(f"evidence={type(evidence).__name__} is not GateEvidence")
        results = []
        for clause, spec in CLAUSES.items():
            ok, observed, required = spec.check(evidence, self._t)
            results.append(ClauseResult(clause=clause, passed=ok, observed=observed, required=required))
        return GateVerdict(release_id=evidence.release_id, passed=all(r.passed for r in results),
                           results=tuple(results))


def gather_evidence(
    *,
    release_id: str,
    bundle_check: BundleCheck,
    manifest_failures: tuple[str, ...],
    fault_report: FaultReport,
    rollback_report: RollbackReport,
    telemetry: TelemetrySnapshot,
    n_shadow: int,
    n_canary: int,
) -> GateEvidence:
    """Assemble gate evidence from the artifacts the coordinator holds (all for ``release_id``).

    1. HashOK / ManifestOK / FaultsOK / RollbackOK from their reports (a report for another release fails).
    2. r_drop and r_fallback pooled over every series labeled ``release=release_id``.
    3. The three zero-counters summed over every series of that release.
    """
    def counter(m: MetricName) -> int:
        return telemetry.counter(m, release=release_id)

    return GateEvidence(
        release_id=release_id,
        hash_ok=bundle_check.ok and bundle_check.release_id == release_id,
        manifest_ok=not manifest_failures,
        faults_ok=fault_report.passed and fault_report.release_id == release_id,
        rollback_ok=rollback_report.ok and rollback_report.candidate == release_id,
        n_shadow=n_shadow,
        n_canary=n_canary,
        drop=RatioCounts.of(telemetry.ratio(MetricName.ROUTE_DROP_RATIO, release=release_id)),
        fallback=RatioCounts.of(telemetry.ratio(MetricName.FALLBACK_STEP_RATIO, release=release_id)),
        route_mismatches=counter(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL),
        stale_accepts=counter(MetricName.STALE_HANDLE_ACCEPT_TOTAL),
        count_failures=counter(MetricName.COUNT_CONSERVATION_FAILURE_TOTAL),
    )
