"""The rollback drill's scenario: ten steps over a started deployment (spec 0x0C-0x0EB).

    report = Drill(options, rt, progress=Progress()).run()      # run.run_drill starts and stops rt

The drill, in order:

 1. Warm up, then publish one placement change under traffic (``scale``): the load window fills and there is
    a retired generation for the stale-handle probe.
 2. Register the deployed generation as the initial release R0 (BUILT -> VERIFIED -> LOADED -> ACTIVE).
 3. Fault 5: a step pinned to the retired generation is refused; the same batch unpinned replans onto R0.
 4. Faults 1, 2, 9: a report that drifts after build (reject build), a bundle for another process-group epoch
    (reject load, nothing staged), a step schedule missing a completion dependency (reject schedule).
 5. Faults 3, 4, 7, 6 on the active generation: count disagreement, corrupt inverse, FP8 scale count (each
    rejected, retried, reference output), graph key (explicit eager fallback, reference output).
 6. Fault 8: candidate A with runner parity off in SHADOW: the shadow comparison finds it, the canary is
    blocked (A never enters CANARY) and A is rolled back; its gate verdict lists the failed clauses.
 7. Rehearsal candidate R: SHADOW -> CANARY, crash while serving canary traffic, ordered rollback. This is
    the gate's RollbackOK evidence and fault 10's result for the gate (the gate needs all ten before B).
 8. Candidate B (EPLB rebalance): SHADOW (N_shadow) -> CANARY (N_canary) -> promotion gate (0x0DC).
 9. ``--fault-at canary``: crash B during further canary steps; ``--fault-at active``: promote B, then crash
    it. Either way: detect, then ordered rollback (0x0EA) to R0 while traffic continues.
10. Serve on R0 again, stop the stream, check the final states and assemble the report.

The ten-fault sweep runs on every drill because the gate's FaultsOK clause needs it; ``all_faults`` widens
it to inject each data-path fault on every rank instead of one.
"""

from __future__ import annotations

import time
from typing import Callable

from ray_moe.apps.drill.probes import bundle_faults, data_path_faults, stale_handle
from ray_moe.apps.drill.context import DrillContext, DrillRelease
from ray_moe.apps.drill.progress import Progress
from ray_moe.apps.drill.releases import (
    CRASH_COUNT,
    admit,
    crash_and_detect,
    evidence,
    register_series,
    release_inputs,
    rollback,
    rolled_back,
    stage_candidate,
)
from ray_moe.apps.drill.report import DrillError, DrillOptions, DrillReport, FaultAt, TimelineEntry
from ray_moe.apps.release_client import ShardFault, StageKind
from ray_moe.core.errors import root_cause
from ray_moe.release.build import build_release_bundle, check_step_schedule, step_tasks
from ray_moe.release.faults import FaultKind, FaultReport, SafeOutcome, check_fault
from ray_moe.core.types import ReleaseState


class Drill:
    """One drill over a started deployment ``rt``: ``run()`` executes the ten steps and returns the report."""

    def __init__(self, options: DrillOptions, rt, *, progress: Progress | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.ctx = DrillContext(options, rt, progress=progress, clock=clock)

    # ================================================================ the steps
    def steps(self) -> tuple[tuple[str, Callable[[], None]], ...]:
        return (
            ("warm up and publish under traffic", self.step_warmup),
            ("register the initial release", self.step_initial_release),
            ("stale handle (fault 5)", lambda: stale_handle(self.ctx)),
            ("bundle and schedule faults (1, 2, 9)", lambda: bundle_faults(self.ctx)),
            ("data-path faults (3, 4, 7, 6)", lambda: data_path_faults(self.ctx)),
            ("parity-faulted candidate (fault 8)", self.step_parity_candidate),
            ("rollback rehearsal (fault 10 for the gate)", self.step_rehearsal),
            ("healthy candidate: shadow, canary, gate", self.step_candidate),
            (f"fault at {self.ctx.o.fault_at.value} and rollback", self.step_fault_and_rollback),
            ("serve on the prior again", self.step_after),
        )

    def run(self) -> DrillReport:
        ctx = self.ctx
        steps = self.steps()
        ctx.stream.start()
        try:
            for i, (title, fn) in enumerate(steps, 1):
                name = f"{i} {title}"
                ctx.note("drill", "step", name)
                ctx.progress(f"step {i}/{len(steps)} {title}")
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - the report names the step that failed
                    cause = root_cause(exc)
                    ctx.failures.append(f"step {name!r} failed: {type(cause).__name__}: {cause}"[:600])
                    ctx.note("drill", "step-failed", f"{name}: {type(cause).__name__}")
                    ctx.progress(f"step {i}/{len(steps)} FAILED: {type(cause).__name__}: {str(cause)[:160]}")
                    break
        finally:
            try:
                ctx.stream.stop()
            except DrillError as exc:
                ctx.failures.append(str(exc))
        return self.report()

    # 1.
    def step_warmup(self) -> None:
        ctx, o = self.ctx, self.ctx.o
        t0 = time.monotonic()
        ctx.wait_served(None, o.steps, f"{o.steps} warm-up batches served")
        ctx.stale_generation = ctx.rt.placement().generation
        g = ctx.rt.scale(expert=ctx.hot, replicas=2)
        ctx.note(f"placement-v{g}", "published", f"scale expert {ctx.hot} to 2 replicas under traffic")
        ctx.wait_served(None, 4, "traffic on the published generation")
        ctx.progress(f"warm-up: {o.steps} batches served, placement-v{g} published under traffic (scale expert "
                     f"{ctx.hot} to 2 replicas) ({time.monotonic() - t0:.1f}s)")

    # 2.
    def step_initial_release(self) -> None:
        ctx, rt = self.ctx, self.ctx.rt
        p = len(rt.group.peer_order)
        ctx.schedule = check_step_schedule(step_tasks(p), p)
        if not ctx.schedule.ok:
            raise DrillError(f"the release step schedule is invalid: {ctx.schedule.error}")
        g = rt.placement().generation
        plan = [e["detail"] for e in rt.timeline() if e["generation"] == g and e["event"] == "plan"]
        bundle, reports = build_release_bundle(release_inputs(ctx, g, {"generation": g, "plan": plan}))
        rel = DrillRelease(bundle, reports, g)
        ctx.register("initial", rel)
        ok, why = admit(ctx, bundle, reports, g)
        if not ok:
            raise DrillError(f"initial release {bundle.release_id} was not admitted: {why}")
        ctx.client.transition(bundle.release_id, ReleaseState.ACTIVE, "bootstrap: the deployed generation")
        register_series(ctx, bundle.release_id, g)
        ctx.stream.set_active(g, bundle.release_id)
        ctx.initial = rel
        ctx.progress(f"initial release {bundle.release_id} ACTIVE on placement-v{g}")

    # 6.
    def step_parity_candidate(self) -> None:
        ctx = self.ctx
        if ctx.initial is None:
            raise DrillError("parity candidate: no initial release")
        r0 = ctx.initial
        a = stage_candidate(ctx, "parity", StageKind.SCALE, expert=ctx.parity_expert, replicas=2)
        rid = a.release_id
        ctx.client.transition(rid, ReleaseState.SHADOW, "serve mirrored traffic, outputs compared")
        for rank in ctx.fault_ranks():
            ctx.arm(ShardFault.PARITY, rank, CRASH_COUNT, a.generation)
        ctx.note(rid, "fault-armed", f"runner parity x1.01 on ranks {ctx.fault_ranks()}")
        ctx.stream.begin_shadow(a.generation, rid)
        need = max(1, ctx.o.thresholds.min_shadow)
        ctx.wait(f"shadow of {rid}", lambda s: (c := s.counts(rid)).shadow_mismatches > 0
                 or c.shadow_failures > 0 or c.shadow >= need)
        counts = ctx.stream.counts(rid)
        partial = FaultReport(release_id=rid, results=tuple(ctx.results.values()))
        ctx.parity_verdict = ctx.gate.evaluate(evidence(ctx, a, partial, rollback_ok=False))
        failed = ", ".join(c.value for c in ctx.parity_verdict.failed)
        ctx.note(rid, "gate", "blocked: " + failed if not ctx.parity_verdict.passed else "passed")
        ctx.progress(f"gate on the parity candidate: {'BLOCKED on ' + failed if failed else 'PROMOTE'}")
        found = counts.shadow_mismatches > 0
        detected = f"shadow comparison: {counts.shadow_mismatches} mismatch(es) in {counts.shadow} mirrored batches"
        summary = rollback(ctx, "block canary (runner parity)", a, r0, detected)
        path = ctx.client.record(rid).path()
        blocked = (found and ReleaseState.CANARY not in path and not ctx.parity_verdict.passed
                   and summary.ok and path[-1] is ReleaseState.RETIRED)
        ctx.record(check_fault(
            FaultKind.RUNNER_PARITY_MISMATCH, SafeOutcome.BLOCK_CANARY if blocked else None,
            f"{detected}; gate blocked by {[c.value for c in ctx.parity_verdict.failed]}; lifecycle "
            f"{' -> '.join(s.value for s in path)}"))

    # 7.
    def step_rehearsal(self) -> None:
        ctx = self.ctx
        if ctx.initial is None:
            raise DrillError("rehearsal: no initial release")
        r0 = ctx.initial
        rr = stage_candidate(ctx, "rehearsal", StageKind.SCALE, expert=ctx.rehearsal_expert, replicas=2)
        rid = rr.release_id
        n = ctx.o.rehearsal_steps
        ctx.client.transition(rid, ReleaseState.SHADOW, "rehearsal: mirrored traffic")
        ctx.stream.begin_shadow(rr.generation, rid)
        ctx.wait(f"rehearsal shadow of {rid}", lambda s: s.counts(rid).shadow >= n
                 or s.counts(rid).shadow_mismatches > 0)
        if ctx.stream.counts(rid).shadow_mismatches:
            raise DrillError(f"rehearsal candidate {rid} differs from the active output in shadow")
        ctx.client.begin_canary(rid, ctx.o.canary_fraction, "rehearsal: shadow clean")
        ctx.stream.begin_canary(ctx.o.canary_fraction)
        ctx.wait(f"rehearsal canary of {rid}", lambda s: s.counts(rid).canary >= n)
        detected = crash_and_detect(ctx, rr)
        summary = rollback(ctx, "rehearsal (candidate faults while serving canary)", rr, r0, detected)
        ok, detail = rolled_back(ctx, summary, rr, r0)
        ctx.rehearsal_fault = check_fault(FaultKind.ACTIVE_CANDIDATE_FAULT,
                                          SafeOutcome.ROLL_BACK_TO_PRIOR_GENERATION if ok else None,
                                          "rehearsal: " + detail)

    # 8.
    def step_candidate(self) -> None:
        ctx = self.ctx
        if ctx.initial is None or ctx.rehearsal_fault is None:
            raise DrillError("healthy candidate: needs the initial release and the rehearsal's result")
        b = stage_candidate(ctx, "candidate", StageKind.REBALANCE)
        ctx.candidate = b
        rid = b.release_id
        t = ctx.o.thresholds
        t0 = time.monotonic()
        ctx.client.transition(rid, ReleaseState.SHADOW, "serve mirrored traffic, outputs compared")
        ctx.stream.begin_shadow(b.generation, rid)
        ctx.wait(f"{t.min_shadow} shadow comparisons of {rid}", lambda s: (c := s.counts(rid)).shadow >= t.min_shadow
                 or c.shadow_mismatches > 0 or c.shadow_failures > 0)
        c = ctx.stream.counts(rid)
        if c.shadow_mismatches or c.shadow_failures:
            raise DrillError(f"healthy candidate {rid}: {c.shadow_mismatches} shadow mismatches, "
                             f"{c.shadow_failures} shadow failures")
        ctx.progress(f"shadow: {c.shadow} mirrored batches equal to the active output ({time.monotonic() - t0:.1f}s)")
        t0 = time.monotonic()
        ctx.client.begin_canary(rid, ctx.o.canary_fraction, f"shadow clean over {c.shadow} batches")
        ctx.stream.begin_canary(ctx.o.canary_fraction)
        ctx.wait(f"{t.min_canary} canary steps of {rid}", lambda s: s.counts(rid).canary >= t.min_canary
                 or s.counts(rid).failures > 0)
        ctx.progress(f"canary: {ctx.stream.counts(rid).canary} steps at fraction {ctx.o.canary_fraction} "
                     f"({time.monotonic() - t0:.1f}s)")
        results = {k: v for k, v in ctx.results.items() if k is not FaultKind.ACTIVE_CANDIDATE_FAULT}
        results[FaultKind.ACTIVE_CANDIDATE_FAULT] = ctx.rehearsal_fault
        report = FaultReport(release_id=rid, results=tuple(results[k] for k in FaultKind if k in results))
        rehearsal = next((r for r in ctx.rollbacks if r.purpose.startswith("rehearsal")), None)
        ctx.verdict = ctx.gate.evaluate(evidence(ctx, b, report, rollback_ok=rehearsal is not None and rehearsal.ok))
        failed = ", ".join(x.value for x in ctx.verdict.failed)
        ctx.note(rid, "gate", "promote" if ctx.verdict.passed else "blocked: " + failed)
        ctx.progress(f"gate on the healthy candidate: {'PROMOTE' if ctx.verdict.passed else 'BLOCKED on ' + failed}")

    # 9.
    def step_fault_and_rollback(self) -> None:
        ctx = self.ctx
        if ctx.initial is None or ctx.candidate is None or ctx.verdict is None:
            raise DrillError("fault and rollback: needs the initial release, the candidate and its gate verdict")
        r0, b = ctx.initial, ctx.candidate
        if ctx.o.fault_at is FaultAt.ACTIVE:
            if not ctx.verdict.passed:
                raise DrillError(f"candidate {b.release_id} did not pass the gate; it cannot go ACTIVE")
            ctx.client.promote(b.generation, retire_prior=False)
            ctx.client.promote_release(b.release_id, ctx.verdict)
            ctx.stream.promote(b.generation, b.release_id)
            deadline = time.monotonic() + ctx.o.drain_timeout_s
            while ctx.client.shard_refcount(r0.generation) and time.monotonic() < deadline:
                time.sleep(0.005)
            ctx.client.transition(r0.release_id, ReleaseState.LOADED,
                                  "drained to refcount 0; kept resident as rollback fallback")
            ctx.progress(f"candidate {b.release_id} ACTIVE on placement-v{b.generation}; "
                         f"{r0.release_id} LOADED as the fallback")
            ctx.wait_served(b.release_id, ctx.o.steps, f"{ctx.o.steps} batches served by ACTIVE {b.release_id}")
        else:
            start = ctx.stream.counts(b.release_id).canary
            ctx.wait("canary continues after the gate", lambda s: s.counts(b.release_id).canary > start)
        detected = crash_and_detect(ctx, b)
        ctx.progress(f"candidate fault detected: {detected[:100]}")
        summary = rollback(ctx, f"fault at {ctx.o.fault_at.value}", b, r0, detected)
        ok, detail = rolled_back(ctx, summary, b, r0)
        ctx.record(check_fault(FaultKind.ACTIVE_CANDIDATE_FAULT,
                               SafeOutcome.ROLL_BACK_TO_PRIOR_GENERATION if ok else None, detail))

    # 10.
    def step_after(self) -> None:
        ctx = self.ctx
        if ctx.initial is None:
            raise DrillError("after the rollback: no initial release")
        ctx.wait_served(ctx.initial.release_id, ctx.o.steps,
                        f"{ctx.o.steps} batches served by {ctx.initial.release_id} after rollback")
        ctx.rt.publish_telemetry()

    # ================================================================ report
    def report(self) -> DrillReport:
        ctx, rt = self.ctx, self.ctx.rt
        faults_ = [ctx.results[k] if k in ctx.results else check_fault(k, None, "not reached") for k in FaultKind]
        failures = list(ctx.failures)
        failures += [f"fault {r.fault.value}: expected {r.expected.value!r}, observed "
                     f"{r.observed.value if r.observed else 'nothing'}" for r in faults_ if not r.passed]
        if ctx.verdict is None or not ctx.verdict.passed:
            failures.append("gate: the healthy candidate did not pass" if ctx.verdict else "gate: not evaluated")
        if ctx.parity_verdict is None or ctx.parity_verdict.passed:
            failures.append("gate: the parity-faulted candidate was not blocked")
        failures += [f"rollback {r.purpose}: not in the 0x0EA order or not complete" for r in ctx.rollbacks if not r.ok]
        traffic = ctx.stream.summary()
        if not traffic.clean:
            failures.append(f"traffic: {traffic.mismatches} mismatches, {traffic.lost} lost, "
                            f"{traffic.served}/{traffic.submitted} served")
        gens = {str(g): s for g, s in sorted(rt.generations().items())}
        recs = {r.release_id: r.state.value for r in ctx.client.records()}
        if ctx.initial is not None and recs.get(ctx.initial.release_id) != ReleaseState.ACTIVE.value:
            failures.append(f"final: initial release {ctx.initial.release_id} is "
                            f"{recs.get(ctx.initial.release_id)}, not ACTIVE")
        timeline = [TimelineEntry(t=float(e["t"]), source="placement",
                                  subject="-" if e["generation"] is None else f"placement-v{e['generation']}",
                                  event=str(e["event"]), detail=str(e["detail"])) for e in rt.timeline()]
        timeline += ctx.client.entries() + ctx.notes
        timeline.sort(key=lambda e: e.t)
        return DrillReport(
            ok=not failures, failures=tuple(failures), options=ctx.o, deployment=rt.cfg.name,
            releases=dict(ctx.roles),
            generations={k: ctx.rel[v].generation for k, v in ctx.roles.items() if v in ctx.rel},
            faults=tuple(faults_), gate=ctx.verdict, parity_gate=ctx.parity_verdict,
            rollbacks=tuple(ctx.rollbacks), traffic=traffic, timeline=tuple(timeline),
            final_generations=gens, final_releases=recs,
        )


__all__ = ["Drill"]
