"""Pure orchestration helpers of the release drill (spec 0x0C-0x0EB). No Ray, no runtime handles.

What lives here, so the Ray-facing drill (``release/drill.py``) stays a sequence of steps:

* the release coordinates of a placement generation (``ReleaseInputs`` -> ``ReleaseBundle``): checkpoint
  digest from the expert digests, placement digest, process-group generation, ABIs, dtype roles, phase
  backends from the config, the graph manifest digest and the upstream reports it binds;
* the step schedule a release binds (``ray_moe.analysis.overlap_schedule``) and its validation (fault 9);
* the load check that refuses a bundle whose process group or topology is not the live one (fault 2);
* the classification of a failed step into a declared safe outcome (faults 3, 4, 5, 7);
* the drill's options and report records, and the text rendering of a report.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ray_moe.config import RuntimeConfig
from ray_moe.errors import CountAgreementError, RouteValidationError, StaleGenerationError
from ray_moe.analysis.overlap_schedule import buffer_lifetimes, moe_step_buffers, moe_step_tasks, schedule_overlapped, Task
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.release.bundle import (
    BackendManifest,
    PhasePath,
    PrecisionRole,
    ReleaseBundle,
    build_release,
    canonical_json,
    sha256_hex,
)
from ray_moe.release.faults import FaultResult, SafeOutcome
from ray_moe.release.gate import GateThresholds, GateVerdict

ROUTE_ABI = "ray-moe.route.v1:ids=int64[L,T,k];gates=float32[L,T,k];r=t*k+j;gate-applied-once-after-expert"
"""Route ABI string every release binds (0x0CB): layout, semantic route order and weighting owner."""

DISPATCH_HANDLE_ABI = "ray-moe.handle.v1:generation-pinned;split-vectors-by-peer-slot;inverse=send-order"
"""Dispatch-handle ABI string (0x0CB): the handle is pinned to one generation, splits are peer-slot indexed."""

UPSTREAM_REPORT_NAMES = ("placement-manifest", "runtime-config", "load-window-provenance", "migration-ledger",
                         "step-schedule")
"""The upstream reports a drill release binds, in ``upstream_report_digests`` order."""


# ============================================================================================ coordinates
def process_group_generation(group_id: str, epoch: int) -> str:
    """``ep-group-0-e<epoch>``: the process-group coordinate G of a release (0x0C)."""
    if not group_id:
        raise ValueError(f"group_id={group_id!r} must be a non-empty string")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch={epoch!r} must be an int >= 0")
    return f"{group_id}-e{epoch}"


def checkpoint_digest(manifest: PlacementManifest) -> str:
    """SHA-256 of the canonical JSON of every (layer, logical expert) parameter digest of the manifest."""
    digests: dict[str, str] = {}
    for s in manifest.slots:
        key = f"{s.layer}/{s.logical_expert_id}"
        prev = digests.setdefault(key, s.parameter_digest)
        if prev != s.parameter_digest:
            raise ValueError(f"slots[q{s.physical_slot_id}].parameter_digest={s.parameter_digest!r} differs from "
                             f"another replica of (layer, expert) {key} ({prev!r})")
    return sha256_hex(canonical_json(digests))


def precision_roles(cfg: RuntimeConfig) -> dict[str, str]:
    """dtype of each tensor role (0x0AE): activations in the config dtype, gate and accumulation in FP32."""
    payload = cfg.payload_format.value
    dispatch = cfg.dtype if payload == "native" else f"{payload}+{cfg.dtype}-scales"
    return {
        PrecisionRole.DISPATCH.value: dispatch,
        PrecisionRole.COMBINE.value: cfg.dtype,
        PrecisionRole.GATE.value: "float32",
        PrecisionRole.ACCUMULATION.value: "float32",
        PrecisionRole.ROUTER.value: "float32",
    }


def phase_backends(cfg: RuntimeConfig, generation: int) -> dict[str, BackendManifest]:
    """The three phase paths of 0x0CA, from the config: variable prefill, fixed-bucket decode, oversize decode."""
    exchange = cfg.exchange_kind.value
    schedule = cfg.exchange_schedule.value
    runner = cfg.runner.value
    buckets = bool(getattr(cfg, "decode_buckets", False))
    capacity = int(getattr(cfg, "decode_token_capacity", 0) or 0)
    graphs = bool(getattr(cfg, "cuda_graphs", False)) and cfg.device == "cuda"
    decode_state = (f"decode.bucket{capacity}.v{generation}" + (".cuda-graph" if graphs else ".eager-bucket")
                    if buckets else "disabled")
    return {
        PhasePath.VARIABLE_PREFILL.value: BackendManifest(dispatcher=f"throughput-variable/{exchange}/{schedule}",
                                                          runner=runner, graph_state="eager"),
        PhasePath.FIXED_BUCKET_DECODE.value: BackendManifest(dispatcher=f"low-latency/{exchange}",
                                                             runner="padded-masked" if buckets else runner,
                                                             graph_state=decode_state),
        PhasePath.OVERSIZE_DECODE.value: BackendManifest(dispatcher=f"low-latency-eager/{exchange}", runner=runner,
                                                         graph_state="explicit-fallback"),
    }


# ============================================================================================ schedule
class ScheduleCheck(BaseModel):
    """Validation of one step schedule: ``ok`` or the rejection (0x0E: completion dependency absent)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ok: bool
    error: str = ""
    makespan_units: float | None = None
    intervals: dict[str, tuple[float, float]] = Field(default_factory=dict)
    evidence: str = "analytical"


def step_tasks(num_chunks: int) -> tuple[Task, ...]:
    """The release's MoE step DAG over ``num_chunks`` peer segments (analytical units, 0x09B)."""
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks!r} must be an int >= 1")
    return moe_step_tasks(route_units=1, pack_units=[1] * num_chunks, dispatch_units=[2] * num_chunks,
                          shared_units=None, expert_units=[3] * num_chunks, combine_units=[2] * num_chunks,
                          reduce_units=1)


def without_dependency(tasks: Sequence[Task], task: str, dependency: str) -> tuple[Task, ...]:
    """``tasks`` with one completion edge removed (``task`` no longer waits for ``dependency``)."""
    out, hit = [], False
    for t in tasks:
        if t.name == task:
            if dependency not in t.deps:
                raise ValueError(f"tasks[{task!r}].deps={list(t.deps)} has no dependency {dependency!r}")
            t = Task(t.name, t.units, t.stream, tuple(d for d in t.deps if d != dependency))
            hit = True
        out.append(t)
    if not hit:
        raise ValueError(f"task={task!r} is not in the task list")
    return tuple(out)


def check_step_schedule(tasks: Sequence[Task], num_chunks: int) -> ScheduleCheck:
    """Validate a step schedule before a release may bind it.

    1. The DAG itself (names, declared dependencies, acyclicity) and the in-order stream schedule.
    2. Every buffer's consumers wait (transitively) for its producer's completion (0x09D): a consumer that
       does not is a missing completion dependency, and the schedule is rejected.
    """
    try:
        sched = schedule_overlapped(tasks)
        buffer_lifetimes(sched, moe_step_buffers(num_chunks, shared=any(t.name == "shared_path" for t in tasks)))
    except ValueError as exc:
        return ScheduleCheck(ok=False, error=str(exc))
    return ScheduleCheck(ok=True, makespan_units=float(sched.makespan),
                         intervals={k: (float(a), float(b)) for k, (a, b) in sched.intervals.items()})


# ============================================================================================ bundle
class ReleaseInputs(BaseModel):
    """Everything a release of one placement generation binds (the upstream reports among them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    config: RuntimeConfig
    manifest: PlacementManifest
    group_id: str
    group_epoch: int = Field(ge=0)
    topology_version: str
    load_provenance: dict[str, Any]
    migration_ledger: dict[str, Any]
    schedule: ScheduleCheck


def upstream_reports(inputs: ReleaseInputs) -> tuple[dict[str, Any], ...]:
    """The reports a release hashes, in ``UPSTREAM_REPORT_NAMES`` order (each a JSON mapping)."""
    return (
        {"report": UPSTREAM_REPORT_NAMES[0], "body": inputs.manifest.model_dump(mode="json",
                                                                               exclude={"state", "in_flight_refcount"})},
        {"report": UPSTREAM_REPORT_NAMES[1], "body": inputs.config.model_dump(mode="json")},
        {"report": UPSTREAM_REPORT_NAMES[2], "body": dict(inputs.load_provenance)},
        {"report": UPSTREAM_REPORT_NAMES[3], "body": dict(inputs.migration_ledger)},
        {"report": UPSTREAM_REPORT_NAMES[4], "body": inputs.schedule.model_dump(mode="json")},
    )


def graph_manifest_digest(inputs: ReleaseInputs) -> str:
    """Digest of the graph manifest Q: decode-bucket geometry, the placement it is keyed to, the step schedule."""
    cfg = inputs.config
    body = {
        "placement_generation": inputs.manifest.placement_version,
        "placement_digest": inputs.manifest.content_digest(),
        "decode_buckets": bool(getattr(cfg, "decode_buckets", False)),
        "decode_token_capacity": getattr(cfg, "decode_token_capacity", None),
        "decode_slot_capacity": getattr(cfg, "decode_slot_capacity", None),
        "cuda_graphs": bool(getattr(cfg, "cuda_graphs", False)) and cfg.device == "cuda",
        "step_schedule": inputs.schedule.model_dump(mode="json"),
    }
    return sha256_hex(canonical_json(body))


def build_release_bundle(inputs: ReleaseInputs, *, process_group_override: str | None = None
                         ) -> tuple[ReleaseBundle, tuple[dict[str, Any], ...]]:
    """The release bundle of ``inputs`` and the upstream reports it binds.

    1. Coordinates: C (checkpoint version + digest of the expert digests), P (placement generation + manifest
       content digest), T, G (``process_group_override`` names another epoch: the fault-2 probe), A, D, B, Q.
    2. ``build_release`` hashes the reports and the coordinates and derives ``name@digest[:12]``.
    """
    if not inputs.schedule.ok:
        raise ValueError(f"schedule: a release cannot bind a rejected step schedule ({inputs.schedule.error})")
    m = inputs.manifest
    reports = upstream_reports(inputs)
    bundle = build_release(
        inputs.name,
        checkpoint_version=m.checkpoint_version,
        checkpoint_digest=checkpoint_digest(m),
        placement_generation=m.placement_version,
        placement_digest=m.content_digest(),
        topology_version=inputs.topology_version,
        process_group_generation=process_group_override or process_group_generation(inputs.group_id,
                                                                                    inputs.group_epoch),
        route_abi=ROUTE_ABI,
        dispatch_handle_abi=DISPATCH_HANDLE_ABI,
        precision_roles=precision_roles(inputs.config),
        phase_backends=phase_backends(inputs.config, m.generation),
        graph_manifest_digest=graph_manifest_digest(inputs),
        upstream_reports=reports,
    )
    return bundle, reports


def drift_report(reports: Sequence[Mapping[str, Any]], index: int = 2) -> tuple[dict[str, Any], ...]:
    """A copy of ``reports`` where report ``index`` changed after the build (one more observation recorded)."""
    if not 0 <= index < len(reports):
        raise ValueError(f"index={index} is outside the {len(reports)} reports")
    out = [dict(r) for r in reports]
    body = dict(out[index].get("body", {}))
    body["drift"] = int(body.get("drift", 0)) + 1
    out[index] = {**out[index], "body": body}
    return tuple(out)


def load_refusals(bundle: ReleaseBundle, *, live_process_group: str, live_topology: str,
                  manifest: PlacementManifest | None) -> tuple[str, ...]:
    """Why a verified bundle may not be loaded on the live deployment (empty: loadable).

    1. Its process-group generation must be the live communicator's (a bundle built for another epoch would
       enter collectives with the wrong membership).
    2. Its topology version must be the live one.
    3. Its placement coordinates must match the manifest it binds (``manifest_failures``).
    """
    out: list[str] = []
    if bundle.process_group_generation != live_process_group:
        out.append(f"process_group_generation={bundle.process_group_generation} but the live group is "
                   f"{live_process_group}")
    if bundle.topology_version != live_topology:
        out.append(f"topology_version={bundle.topology_version} but the live topology is {live_topology}")
    if manifest is not None:
        out.extend(bundle.manifest_failures(manifest))
    return tuple(out)


# ============================================================================================ failures
def classify_failure(cause: BaseException) -> SafeOutcome | None:
    """The declared safe outcome a failed step shows (by error type and message), or None."""
    text = str(cause)
    if isinstance(cause, CountAgreementError):
        if "payload rejected before expert compute" in text:
            return SafeOutcome.REJECT_PAYLOAD_BEFORE_EXPERT_COMPUTE
        if "aborted before payload exchange" in text:
            return SafeOutcome.ABORT_BEFORE_PAYLOAD_EXCHANGE
        return None
    if isinstance(cause, RouteValidationError) and "output rejected" in text:
        return SafeOutcome.REJECT_OUTPUT_BEFORE_PUBLISH
    if isinstance(cause, StaleGenerationError):
        return SafeOutcome.REJECT_HANDLE_AND_REPLAN
    return None


# ============================================================================================ records
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


__all__ = [
    "ROUTE_ABI", "DISPATCH_HANDLE_ABI", "UPSTREAM_REPORT_NAMES", "process_group_generation", "checkpoint_digest",
    "precision_roles", "phase_backends", "ScheduleCheck", "step_tasks", "without_dependency",
    "check_step_schedule", "ReleaseInputs", "upstream_reports", "graph_manifest_digest", "build_release_bundle",
    "drift_report", "load_refusals", "classify_failure", "FaultAt", "DrillOptions", "TimelineEntry",
    "ReleaseTraffic", "TrafficSummary", "RollbackSummary", "DrillReport", "render_text",
]
