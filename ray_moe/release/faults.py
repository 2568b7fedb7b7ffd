"""The ten injected faults and their declared safe outcomes (spec 0x0E). Pure: no Ray.

This module holds the oracle only: the fault table, the per-fault result record and the report that
FaultsOK of the promotion gate (0x0DC) reads. Injecting the faults into the live runtime happens
elsewhere; an injector reports which ``SafeOutcome`` it observed (or ``None`` when the fault went
through unhandled) and ``check_fault`` compares it with the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, model_validator


class FaultKind(str, Enum):
    """The ten injected faults of 0x0E, in the spec's order."""

    REPORT_HASH_DRIFT = "report-hash-drift"
    PROCESS_GROUP_GENERATION_MISMATCH = "process-group-generation-mismatch"
    PEER_COUNT_DISAGREEMENT = "peer-count-disagreement"
    CORRUPT_INVERSE_PERMUTATION = "corrupt-inverse-permutation"
    STALE_HANDLE_ON_NEW_GENERATION = "stale-handle-on-new-generation"
    GRAPH_KEY_MISMATCH = "graph-key-mismatch"
    FP8_SCALE_COUNT_MISMATCH = "fp8-scale-count-mismatch"
    RUNNER_PARITY_MISMATCH = "runner-parity-mismatch"
    MISSING_COMPLETION_DEPENDENCY = "missing-completion-dependency"
    ACTIVE_CANDIDATE_FAULT = "active-candidate-fault"


class SafeOutcome(str, Enum):
    """The declared safe results of 0x0E."""

    REJECT_BUILD = "reject build"
    REJECT_LOAD = "reject load"
    ABORT_BEFORE_PAYLOAD_EXCHANGE = "abort before payload exchange"
    REJECT_OUTPUT_BEFORE_PUBLISH = "reject output before publish"
    REJECT_HANDLE_AND_REPLAN = "reject handle and replan"
    EXPLICIT_EAGER_FALLBACK = "explicit eager fallback"
    REJECT_PAYLOAD_BEFORE_EXPERT_COMPUTE = "reject payload before expert compute"
    BLOCK_CANARY = "block canary"
    REJECT_SCHEDULE = "reject schedule"
    ROLL_BACK_TO_PRIOR_GENERATION = "roll back to prior generation"


@dataclass(frozen=True)
class FaultSpec:
    """One row of the 0x0E table: the injected fault in words and its one safe outcome."""

    kind: FaultKind
    injected: str
    outcome: SafeOutcome


FAULT_TABLE: Mapping[FaultKind, FaultSpec] = MappingProxyType(
    {
        spec.kind: spec
        for spec in (
            FaultSpec(FaultKind.REPORT_HASH_DRIFT, "Loop 2-10 report hash drifts", SafeOutcome.REJECT_BUILD),
            FaultSpec(FaultKind.PROCESS_GROUP_GENERATION_MISMATCH, "process-group generation differs",
                      SafeOutcome.REJECT_LOAD),
            FaultSpec(FaultKind.PEER_COUNT_DISAGREEMENT, "peer route counts disagree",
                      SafeOutcome.ABORT_BEFORE_PAYLOAD_EXCHANGE),
            FaultSpec(FaultKind.CORRUPT_INVERSE_PERMUTATION, "inverse permutation is corrupt",
                      SafeOutcome.REJECT_OUTPUT_BEFORE_PUBLISH),
            FaultSpec(FaultKind.STALE_HANDLE_ON_NEW_GENERATION, "stale handle reaches new active generation",
                      SafeOutcome.REJECT_HANDLE_AND_REPLAN),
            FaultSpec(FaultKind.GRAPH_KEY_MISMATCH, "graph key differs", SafeOutcome.EXPLICIT_EAGER_FALLBACK),
            FaultSpec(FaultKind.FP8_SCALE_COUNT_MISMATCH, "FP8 scale count differs",
                      SafeOutcome.REJECT_PAYLOAD_BEFORE_EXPERT_COMPUTE),
            FaultSpec(FaultKind.RUNNER_PARITY_MISMATCH, "runner parity differs", SafeOutcome.BLOCK_CANARY),
            FaultSpec(FaultKind.MISSING_COMPLETION_DEPENDENCY, "completion dependency is absent",
                      SafeOutcome.REJECT_SCHEDULE),
            FaultSpec(FaultKind.ACTIVE_CANDIDATE_FAULT, "active candidate faults",
                      SafeOutcome.ROLL_BACK_TO_PRIOR_GENERATION),
        )
    }
)


def expected_outcome(fault: FaultKind | str) -> SafeOutcome:
    try:
        kind = FaultKind(fault)
    except ValueError:
        raise ValueError(f"fault={fault!r} is not one of the ten faults ({[k.value for k in FaultKind]})") from None
    return FAULT_TABLE[kind].outcome


class FaultResult(BaseModel):
    """One injected fault: what the table requires, what the runtime did, and whether they agree.

    ``observed=None`` means no safe outcome was observed (the fault went through). ``passed`` is derived.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    fault: FaultKind
    expected: SafeOutcome
    observed: SafeOutcome | None
    detail: str = ""

    @model_validator(mode="after")
    def _expected_from_table(self) -> "FaultResult":
        want = FAULT_TABLE[self.fault].outcome
        if self.expected is not want:
            raise ValueError(
                f"expected={self.expected.value!r} but the 0x0E table requires {want.value!r} for {self.fault.value}"
            )
        return self

    @property
    def passed(self) -> bool:
        return self.observed is self.expected


def check_fault(fault: FaultKind | str, observed: SafeOutcome | str | None, detail: str = "") -> FaultResult:
    """Compare one observed outcome with the table."""
    want = expected_outcome(fault)  # validates ``fault``
    kind = FaultKind(fault)
    if observed is not None:
        try:
            observed = SafeOutcome(observed)
        except ValueError:
            raise ValueError(f"observed={observed!r} is not a safe outcome ({[o.value for o in SafeOutcome]})") from None
    return FaultResult(fault=kind, expected=want, observed=observed, detail=detail)


class FaultReport(BaseModel):
    """All fault results of one release's drill. FaultsOK = ``passed``: all ten covered, all safe."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    release_id: str
    results: tuple[FaultResult, ...]

    @model_validator(mode="after")
    def _one_per_fault(self) -> "FaultReport":
        seen: set[FaultKind] = set()
        for i, r in enumerate(self.results):
            if r.fault in seen:
                raise ValueError(f"results[{i}].fault={r.fault.value!r} is reported twice")
            seen.add(r.fault)
        return self

    @property
    def missing(self) -> tuple[FaultKind, ...]:
        got = {r.fault for r in self.results}
        return tuple(k for k in FaultKind if k not in got)

    @property
    def failed(self) -> tuple[FaultResult, ...]:
        return tuple(r for r in self.results if not r.passed)

    @property
    def passed(self) -> bool:
        return not self.missing and not self.failed

    def describe(self) -> tuple[str, ...]:
        """One line per missing or failed fault (empty when passed)."""
        out = [f"{k.value}: not injected" for k in self.missing]
        out += [
            f"{r.fault.value}: expected {r.expected.value!r}, observed "
            f"{'nothing' if r.observed is None else repr(r.observed.value)}" + (f" ({r.detail})" if r.detail else "")
            for r in self.failed
        ]
        return tuple(out)


def fault_report(release_id: str, results: Iterable[FaultResult]) -> FaultReport:
    return FaultReport(release_id=release_id, results=tuple(results))
