"""The rollback drill's options, report records and text rendering (spec 0x0D-0x0EB).

``DrillOptions`` says what one drill runs (fault point, ranks, gate thresholds, timeouts); ``DrillReport`` is
everything it observed: the ten faults (``FaultResult``), both gate verdicts, every ordered rollback, the live
traffic with its reference checks and the merged state timeline. ``render_text`` is the human report that
``ray-moe drill rollback`` prints (``--json`` prints ``DrillReport.model_dump``).
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

from ray_moe.release.faults import FaultResult
from ray_moe.release.gate import GateThresholds, GateVerdict


class DrillError(RuntimeError):
    """A drill step could not complete (a wait timed out, a control call failed, the cluster lacks resources);
    the message names it."""


class FaultAt(str, Enum):
    """Where the candidate's crash fault is injected (``--fault-at``)."""

    CANARY = "canary"
    ACTIVE = "active"


class DrillOptions(BaseModel):
    """One rollback drill. The gate thresholds default to the spec's (0x0DC: N_shadow >= 100, N_canary >= 200)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="rollback-drill", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    fault_at: FaultAt = FaultAt.ACTIVE
    ranks: int = Field(default=4, ge=2, description="scaling a replica needs two ranks")
    steps: int = Field(default=24, ge=1, description="batches served before the first change and after rollback")
    device: str = Field(default="cpu", pattern="^(cpu|cuda)$")
    all_faults: bool = Field(default=False, description="inject each data-path fault on every rank, not one")
    thresholds: GateThresholds = Field(default_factory=GateThresholds)
    canary_fraction: float = Field(default=0.5, gt=0.0, le=1.0)
    rehearsal_steps: int = Field(default=4, ge=1, description="shadow and canary batches of the rehearsal")
    num_experts: int = Field(default=8, ge=3)
    hidden_size: int = Field(default=16, ge=1)
    ffn_size: int = Field(default=32, ge=1)
    top_k: int = Field(default=2, ge=1)
    slots_per_rank: int = Field(default=3, ge=1)
    seed: int = 11
    wait_timeout_s: float = Field(default=300.0, gt=0)
    drain_timeout_s: float = Field(default=60.0, gt=0)
    retry_deadline_s: float = Field(default=120.0, gt=0, description="a batch not served by then counts as lost")
    resource_wait_s: float = Field(default=60.0, ge=0, description="how long to wait for the cluster to have the "
                                                                  "CPUs / GPUs the deployment needs")


class TimelineEntry(BaseModel):
    """One event of the drill's merged timeline (wall-clock ``t``; ``source`` says who recorded it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    t: float
    source: str  # placement | release | rollback | drill
    subject: str
    event: str
    detail: str = ""


class ReleaseTraffic(BaseModel):
    """What one release served during the drill."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    release_id: str
    served: int = 0
    shadow: int = 0
    shadow_mismatches: int = 0
    shadow_failures: int = 0
    canary: int = 0
    failures: int = 0


class TrafficSummary(BaseModel):
    """The live stream: every submitted batch, its retries, and any output that differed from the reference."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    submitted: int
    served: int
    retried: int
    mismatches: int
    lost: int
    max_abs_error: float = Field(ge=0, description="largest |served - reference| over every returned output")
    failures_by_cause: dict[str, int]
    by_release: tuple[ReleaseTraffic, ...]

    @property
    def clean(self) -> bool:
        return self.mismatches == 0 and self.lost == 0 and self.served == self.submitted


class RollbackSummary(BaseModel):
    """One ordered rollback (0x0EA) as it ran against the live runtime."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    purpose: str
    candidate: str
    prior: str
    candidate_generation: int
    prior_generation: int
    steps: tuple[str, ...]
    refcount_trace: tuple[int, ...]
    ok: bool
    detected: str = ""


class DrillReport(BaseModel):
    """Everything one drill observed. ``ok``: every safe outcome held and every served output was the reference."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ok: bool
    failures: tuple[str, ...]
    options: DrillOptions
    deployment: str
    releases: dict[str, str]
    generations: dict[str, int]
    faults: tuple[FaultResult, ...]
    gate: GateVerdict | None
    parity_gate: GateVerdict | None
    rollbacks: tuple[RollbackSummary, ...]
    traffic: TrafficSummary
    timeline: tuple[TimelineEntry, ...]
    final_generations: dict[str, str]
    final_releases: dict[str, str]


# ============================================================================================ rendering
def render_text(report: DrillReport) -> str:
    """The human report: state timeline, fault table, gate verdicts with every clause, rollbacks, traffic."""
    o = report.options
    lines = [f"ray-moe drill rollback: deployment {report.deployment!r} ({o.ranks} ranks, {o.device}), "
             f"fault at {o.fault_at.value.upper()}, all-faults={o.all_faults}"]
    lines.append("")
    lines.append("state timeline (wall clock relative to the first event)")
    t0 = report.timeline[0].t if report.timeline else 0.0
    for e in report.timeline:
        lines.append(f"  +{e.t - t0:8.3f}s  {e.source:<9} {e.subject:<34} {e.event:<18} {e.detail}".rstrip())
    lines.append("")
    lines.append("fault table (spec 0x0E)")
    lines.append(f"  {'#':>2}  {'fault':<36} {'expected':<38} {'observed':<38} pass")
    for i, r in enumerate(report.faults, 1):
        obs = "nothing" if r.observed is None else r.observed.value
        lines.append(f"  {i:>2}  {r.fault.value:<36} {r.expected.value:<38} {obs:<38} "
                     f"{'yes' if r.passed else 'NO'}")
        if r.detail:
            lines.append(f"      {r.detail}")
    for title, verdict in (("gate verdict (healthy candidate, before its fault)", report.gate),
                           ("gate verdict (parity-faulted candidate)", report.parity_gate)):
        lines.append("")
        lines.append(title)
        if verdict is None:
            lines.append("  not evaluated")
            continue
        lines.append(f"  {verdict.release_id}: {'PROMOTE' if verdict.passed else 'BLOCKED'}")
        for c in verdict.results:
            lines.append(f"    {c.clause.value:<17} observed {c.observed:<28} required {c.required:<12} "
                         f"{'ok' if c.passed else 'FAILED'}")
    lines.append("")
    lines.append("rollbacks (spec 0x0EA)")
    for rb in report.rollbacks:
        lines.append(f"  {rb.purpose}: {rb.candidate} (gen {rb.candidate_generation}) -> {rb.prior} "
                     f"(gen {rb.prior_generation}) ok={rb.ok}")
        lines.append(f"    {' -> '.join(rb.steps)}; refcount trace {list(rb.refcount_trace)}")
        if rb.detected:
            lines.append(f"    detected: {rb.detected}")
    tr = report.traffic
    lines.append("")
    lines.append(f"traffic: submitted {tr.submitted}, served {tr.served}, retried {tr.retried}, "
                 f"mismatches {tr.mismatches}, lost {tr.lost}, max |output - reference| {tr.max_abs_error:.3g}")
    for rt in tr.by_release:
        lines.append(f"  {rt.release_id}: served {rt.served}, shadow {rt.shadow} (mismatch {rt.shadow_mismatches}, "
                     f"failed {rt.shadow_failures}), canary {rt.canary}, failed attempts {rt.failures}")
    if tr.failures_by_cause:
        lines.append("  failed attempts by cause: " + ", ".join(f"{k} x{v}" for k, v in sorted(tr.failures_by_cause.items())))
    lines.append("")
    lines.append("final placement generations: " + ", ".join(f"{g}={s}" for g, s in report.final_generations.items()))
    lines.append("final releases: " + ", ".join(f"{r}={s}" for r, s in report.final_releases.items()))
    lines.append("")
    lines.append("result: " + ("PASS" if report.ok else "FAIL"))
    for f in report.failures:
        lines.append(f"  - {f}")
    return "\n".join(lines)


__all__ = ["DrillError", "FaultAt", "DrillOptions", "TimelineEntry", "ReleaseTraffic", "TrafficSummary",
           "RollbackSummary", "DrillReport", "render_text"]
