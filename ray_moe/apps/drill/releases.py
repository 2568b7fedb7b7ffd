"""The drill's releases on the live deployment: build and admit them (BUILT -> VERIFIED -> LOADED or the
rejection), stage candidates under traffic, gather gate evidence, and roll a faulted candidate back in the
0x0EA order through ``RuntimeRollbackPort``."""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from ray_moe.apps.drill.context import DrillContext, DrillRelease
from ray_moe.apps.drill.report import DrillError, RollbackSummary, TimelineEntry
from ray_moe.apps.drill.traffic import TrafficStream
from ray_moe.apps.release_client import ReleaseClient, ShardFault, StageKind
from ray_moe.core.errors import root_cause
from ray_moe.release.build import ReleaseInputs, build_release_bundle, load_refusals
from ray_moe.release.bundle import ReleaseBundle
from ray_moe.release.faults import FaultReport
from ray_moe.release.gate import GateEvidence, RatioCounts
from ray_moe.release.rollback import RollbackExecution, RollbackPlan, RollbackStep, RollbackTarget
from ray_moe.core.telemetry.metrics import MetricName
from ray_moe.core.types import Phase, ReleaseState

CRASH_COUNT = 1_000_000
"""An armed crash (or parity) fault that keeps firing until its generation's stop fence disarms it."""

DRAIN_POLL_S = 0.005

ROLE_TITLES = {"parity": "parity-faulted candidate", "rehearsal": "rehearsal candidate",
               "candidate": "healthy candidate"}


# ============================================================================================ admission
def release_inputs(ctx: DrillContext, generation: int, ledger: Mapping[str, Any],
                   name: str | None = None) -> ReleaseInputs:
    """What a release of ``generation`` binds: manifest, config, live group and topology, load window, ledger."""
    rt = ctx.rt
    manifest = rt.placement(generation)
    try:
        prov = ctx.client.load_provenance()
    except Exception as exc:  # noqa: BLE001 - an empty window is recorded as such
        prov = {"observations": 0, "error": f"{type(root_cause(exc)).__name__}: {root_cause(exc)}"[:200]}
    if ctx.schedule is None:
        raise DrillError("release inputs: the step schedule was not checked yet")
    return ReleaseInputs(name=name or f"{ctx.o.name}-{manifest.placement_version}", config=rt.cfg,
                         manifest=manifest, group_id=rt.group.group_id, group_epoch=rt.group.epoch,
                         topology_version=rt.topology.version, load_provenance=prov,
                         migration_ledger=dict(ledger), schedule=ctx.schedule)


def admit(ctx: DrillContext, bundle: ReleaseBundle, reports: Sequence[Mapping[str, Any]],
          generation: int | None) -> tuple[bool, str]:
    """BUILT -> VERIFIED -> LOADED, or the rejection (reject build / reject load) with its reason.

    1. register (BUILT); 2. recompute every digest against the reports (drift: BUILT -> RETIRED);
    3. load check against the live process group, topology and the staged manifest (VERIFIED -> RETIRED);
    4. LOADED: the placement generation is resident and verified on every shard.
    """
    rid = bundle.release_id
    client = ctx.client
    client.register(bundle, "built")
    try:
        bundle.require_verified(reports)
    except ValueError as exc:
        client.transition(rid, ReleaseState.RETIRED, f"reject build: {exc}"[:300])
        return False, str(exc)
    client.transition(rid, ReleaseState.VERIFIED, "bundle and upstream report digests recomputed")
    manifest = ctx.rt.placement(generation) if generation is not None else None
    refusals = load_refusals(bundle, live_process_group=ctx.live_pg(), live_topology=ctx.rt.topology.version,
                             manifest=manifest)
    if refusals:
        why = "reject load: " + "; ".join(refusals)
        client.transition(rid, ReleaseState.RETIRED, why[:300])
        return False, why
    client.transition(rid, ReleaseState.LOADED, f"placement-v{generation} resident and verified on every shard")
    return True, ""


def register_series(ctx: DrillContext, release: str, generation: int) -> None:
    """Zero-valued counters for a release, so the gate reads an observed 0 (and status shows it)."""
    tel = ctx.rt.telemetry
    for phase in (Phase.PREFILL.value, Phase.DECODE.value):
        tel.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": release, "phase": phase}, 0)
    tel.inc(MetricName.STALE_HANDLE_ACCEPT_TOTAL,
            {"release": release, "placement_generation": f"placement-v{generation}"}, 0)
    tel.inc(MetricName.COUNT_CONSERVATION_FAILURE_TOTAL,
            {"release": release, "process_group_generation": ctx.live_pg()}, 0)


def stage_candidate(ctx: DrillContext, role: str, kind: StageKind, *, expert: int | None = None,
                    replicas: int | None = None) -> DrillRelease:
    """Stage a candidate generation under traffic, build its release and admit it to LOADED."""
    t0 = time.monotonic()
    ctx.rt.flush_load()  # the plan (EPLB for a rebalance) sees every load count this driver observed
    rep = ctx.client.stage(kind, expert=expert, replicas=replicas)
    g = rep.new_generation
    bundle, reports = build_release_bundle(release_inputs(ctx, g, rep.ledger or {"kind": kind.value}))
    rel = DrillRelease(bundle, reports, g)
    ctx.register(role, rel)
    ok, why = admit(ctx, bundle, reports, g)
    if not ok:
        raise DrillError(f"{role} candidate {bundle.release_id} was not admitted: {why}")
    register_series(ctx, bundle.release_id, g)
    what = kind.value if expert is None else f"{kind.value} expert {expert} to {replicas} replicas"
    ctx.note(bundle.release_id, "staged", f"{role}: {what} -> placement-v{g}")
    title = ROLE_TITLES.get(role, f"{role} candidate")
    ctx.progress(f"{title}: {what} staged as placement-v{g}, LOADED ({time.monotonic() - t0:.1f}s)")
    return rel


# ============================================================================================ the gate
def evidence(ctx: DrillContext, rel: DrillRelease, fault_report: FaultReport, rollback_ok: bool) -> GateEvidence:
    """GateEvidence for one release, from its bundle, its manifest, this drill's reports and its telemetry."""
    rid = rel.release_id
    snap = ctx.rt.telemetry.snapshot()
    check = rel.bundle.verify(rel.reports)
    counts = ctx.stream.counts(rid)
    return GateEvidence(
        release_id=rid,
        hash_ok=check.ok and check.release_id == rid,
        manifest_ok=not rel.bundle.manifest_failures(ctx.rt.placement(rel.generation)),
        faults_ok=fault_report.passed and fault_report.release_id == rid,
        rollback_ok=rollback_ok,
        n_shadow=counts.shadow,
        n_canary=counts.canary,
        drop=RatioCounts.of(snap.ratio(MetricName.ROUTE_DROP_RATIO, release=rid)),
        fallback=RatioCounts.of(snap.ratio(MetricName.FALLBACK_STEP_RATIO, release=rid)),
        route_mismatches=snap.counter(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, release=rid),
        stale_accepts=snap.counter(MetricName.STALE_HANDLE_ACCEPT_TOTAL, release=rid),
        count_failures=snap.counter(MetricName.COUNT_CONSERVATION_FAILURE_TOTAL, release=rid),
    )


# ============================================================================================ rollback
class RuntimeRollbackPort:
    """``RollbackPort`` against the live deployment and the coordinator's release registry (0x0EA).

    stop_new_dispatch: driver selection fence, shard fence (``stop_dispatch``), the generation's armed faults
                       cleared, lifecycle stop.
    activate:          ``activate(prior)`` (re-publish a loaded prior), lifecycle activate, driver routing.
    refcount:          exact in-flight pins of the candidate's generation on every shard.
    release_graphs:    ``release_graphs``; retire: ``drain_and_retire`` then lifecycle retire.
    """

    def __init__(self, ctx: DrillContext, generation_of: Mapping[str, int], *, drain_timeout_s: float) -> None:
        self._ctx = ctx
        self._client: ReleaseClient = ctx.client
        self._stream: TrafficStream = ctx.stream
        self._gen = dict(generation_of)
        self._drain_timeout_s = drain_timeout_s
        self.graphs_freed = 0

    def _generation(self, release_id: str) -> int:
        if release_id not in self._gen:
            raise ValueError(f"release_id={release_id!r} has no placement generation in this drill")
        return self._gen[release_id]

    def stop_new_dispatch(self, release_id: str) -> None:
        g = self._generation(release_id)
        self._stream.stop_selecting(g)
        self._client.stop_dispatch(g)
        self._ctx.disarm(g)
        self._stream.mark_fenced(g)
        self._client.stop_new_dispatch(release_id)

    def activate(self, release_id: str) -> None:
        g = self._generation(release_id)
        self._client.activate(g)
        self._client.activate_release(release_id)
        self._stream.set_active(g, release_id)

    def refcount(self, release_id: str) -> int:
        return self._client.shard_refcount(self._generation(release_id))

    def release_graphs(self, release_id: str) -> None:
        self.graphs_freed += self._client.release_graphs(self._generation(release_id))

    def retire(self, release_id: str) -> None:
        g = self._generation(release_id)
        if not self._client.drain_and_retire(g, self._drain_timeout_s):
            raise DrillError(f"generation={g}: drain_and_retire did not retire it within {self._drain_timeout_s:.0f}s")
        self._client.retire_release(release_id)


def rollback(ctx: DrillContext, purpose: str, candidate: DrillRelease, prior: DrillRelease,
             detected: str) -> RollbackSummary:
    """0x0EA over the live deployment, one public step at a time (each stamped on the timeline)."""
    t0 = time.monotonic()
    plan = RollbackPlan(RollbackTarget.from_record(ctx.client.record(candidate.release_id)),
                        RollbackTarget.from_record(ctx.client.record(prior.release_id)))
    port = RuntimeRollbackPort(ctx, {r.release_id: r.generation for r in (candidate, prior)},
                               drain_timeout_s=ctx.o.drain_timeout_s)
    polls = max(1, int(ctx.o.drain_timeout_s / DRAIN_POLL_S))
    ex = RollbackExecution(plan, port, max_drain_polls=polls, wait=lambda: time.sleep(DRAIN_POLL_S))
    steps = ((RollbackStep.STOP_NEW_DISPATCH, ex.stop_new_dispatch), (RollbackStep.ACTIVATE_PRIOR, ex.activate_prior),
             (RollbackStep.DRAIN_CANDIDATE, ex.drain_candidate), (RollbackStep.RELEASE_GRAPHS, ex.release_graphs),
             (RollbackStep.RETIRE_CANDIDATE, ex.retire_candidate), (RollbackStep.COMPLETE, ex.complete))
    stamps: list[float] = []
    error = ""
    for _, fn in steps:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the report shows where the rollback stopped
            error = f"{type(root_cause(exc)).__name__}: {root_cause(exc)}"
            break
        stamps.append(ctx.clock())
    rep = ex.report()
    for t, ev in zip(stamps, rep.events):
        ctx.notes.append(TimelineEntry(t=t, source="rollback", subject=candidate.release_id,
                                       event=ev.step.value, detail=ev.detail))
    summary = RollbackSummary(
        purpose=purpose, candidate=candidate.release_id, prior=prior.release_id,
        candidate_generation=candidate.generation, prior_generation=prior.generation,
        steps=tuple(s.value for s in rep.steps), refcount_trace=rep.refcount_trace, ok=rep.ok and not error,
        detected=detected + (f"; rollback stopped: {error}" if error else ""),
    )
    ctx.rollbacks.append(summary)
    ctx.progress(f"rollback ({purpose}): placement-v{candidate.generation} -> placement-v{prior.generation} "
                 f"{'in the 0x0EA order' if summary.ok else 'FAILED: ' + (error or 'out of order')} "
                 f"({time.monotonic() - t0:.1f}s)")
    return summary


def rolled_back(ctx: DrillContext, summary: RollbackSummary, candidate: DrillRelease,
                prior: DrillRelease) -> tuple[bool, str]:
    """Did the rollback land: prior ACTIVE (placement and lifecycle), candidate RETIRED, prior serving?"""
    gens = ctx.rt.generations()
    ok = (summary.ok and gens.get(prior.generation) == "ACTIVE" and gens.get(candidate.generation) == "RETIRED"
          and ctx.client.state(prior.release_id) is ReleaseState.ACTIVE
          and ctx.client.state(candidate.release_id) is ReleaseState.RETIRED)
    ctx.wait_served(prior.release_id, 2, f"traffic served on {prior.release_id} after the rollback")
    detail = (f"{summary.detected}; {' -> '.join(summary.steps)}; refcount {list(summary.refcount_trace)}; "
              f"placement-v{prior.generation} {gens.get(prior.generation)}, "
              f"placement-v{candidate.generation} {gens.get(candidate.generation)}")
    return ok, detail


def crash_and_detect(ctx: DrillContext, rel: DrillRelease) -> str:
    """Arm a crash on ``rel``'s generation; wait until a step served by it fails."""
    start = len(ctx.stream.failures())
    rank = ctx.fault_ranks()[0]
    ctx.arm(ShardFault.CRASH, rank, CRASH_COUNT, rel.generation)
    ctx.note(rel.release_id, "fault-armed", f"crash on rank {rank} for placement-v{rel.generation}")

    def failed(s: TrafficStream) -> bool:
        return any(f.generation == rel.generation for f in s.failures()[start:])

    ctx.wait(f"a step on placement-v{rel.generation} fails", failed)
    ev = next(f for f in ctx.stream.failures()[start:] if f.generation == rel.generation)
    detected = f"{ev.role.value} step on placement-v{rel.generation} failed: {ev.error}: {ev.message[:120]}"
    ctx.note(rel.release_id, "fault-detected", detected)
    return detected


__all__ = ["CRASH_COUNT", "release_inputs", "admit", "register_series", "stage_candidate", "evidence",
           "RuntimeRollbackPort", "rollback", "rolled_back", "crash_and_detect"]
