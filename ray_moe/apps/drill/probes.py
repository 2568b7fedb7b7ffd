"""The fault sweep of spec 0x0E on the live deployment: faults 1, 2, 9 (bundle and schedule), 5 (stale
handle), 3, 4, 7 (data path, each on one rank or, with ``all_faults``, on every rank) and 6 (graph key).
Faults 8 and 10 need a candidate release and run in the release phases (``scenario``).

Every probe that steps the runtime runs in the traffic thread between two live batches
(``TrafficStream.exclusive``), so its batch is accounted like any other and its retry must return the
reference output.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch

from ray_moe.apps.drill.context import DrillContext
from ray_moe.apps.drill.releases import admit, release_inputs
from ray_moe.apps.drill.traffic import Attempt, Batch, Role, TrafficStream, classify_failure, output_error
from ray_moe.apps.release_client import ShardFault
from ray_moe.core.errors import StaleGenerationError, root_cause
from ray_moe.release.schedule import Task
from ray_moe.release.build import build_release_bundle, check_step_schedule, process_group_generation, step_tasks
from ray_moe.release.faults import FaultKind, SafeOutcome, check_fault
from ray_moe.core.telemetry.metrics import MetricName
from ray_moe.core.types import Phase, ReleaseState

ABORT_WAIT_S = 5.0
"""How long a data-path probe waits for every rank's abort counter after the failed step."""


# ============================================================================================ fault inputs
def drift_report(reports: Sequence[Mapping[str, Any]], index: int = 2) -> tuple[dict[str, Any], ...]:
    """A copy of ``reports`` where report ``index`` changed after the build (one more observation recorded)."""
    if not 0 <= index < len(reports):
        raise ValueError(f"index={index} is outside the {len(reports)} reports")
    out = [dict(r) for r in reports]
    body = dict(out[index].get("body", {}))
    body["drift"] = int(body.get("drift", 0)) + 1
    out[index] = {**out[index], "body": body}
    return tuple(out)


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


# ============================================================================================ fault 5
def stale_handle(ctx: DrillContext) -> None:
    """Fault 5: a step pinned to the retired generation is refused; the same batch, unpinned, replans onto R0."""
    if ctx.initial is None or ctx.stale_generation is None:
        raise ValueError("stale_handle: needs the initial release and a retired generation")
    stale, r0 = ctx.stale_generation, ctx.initial

    def probe(s: TrafficStream) -> tuple[Attempt, tuple[torch.Tensor, Attempt, Role] | None, Batch]:
        batch = s.next_batch(Phase.PREFILL)
        first = s.attempt(batch, pin=stale, release=r0.release_id, role=Role.PROBE)
        if first.output is None:
            s.count_retry()
        else:
            s.count_served(*output_error(first.output, batch.reference))
            s.rt.telemetry.inc(MetricName.STALE_HANDLE_ACCEPT_TOTAL,
                               {"release": r0.release_id, "placement_generation": f"placement-v{stale}"}, 1)
            return first, None, batch
        return first, s.serve(batch), batch

    first, served, batch = ctx.stream.exclusive(probe, ctx.o.wait_timeout_s)
    state = ctx.rt.generations().get(stale)
    if first.output is not None:
        ctx.record(check_fault(FaultKind.STALE_HANDLE_ON_NEW_GENERATION, None,
                               f"a step pinned to placement-v{stale} ({state}) was accepted"))
        return
    refused = isinstance(first.cause, StaleGenerationError)
    replanned = served is not None and served[1].generation == r0.generation \
        and output_error(served[0], batch.reference)[0]
    observed = SafeOutcome.REJECT_HANDLE_AND_REPLAN if refused and replanned else None
    ctx.record(check_fault(
        FaultKind.STALE_HANDLE_ON_NEW_GENERATION, observed,
        f"pinned to placement-v{stale} ({state}) after placement-v{r0.generation} was published: "
        f"{type(first.cause).__name__}: {str(first.cause)[:140]}; the batch replanned unpinned onto "
        f"placement-v{r0.generation}: {'reference output' if replanned else 'NOT served correctly'}"))


# ============================================================================================ faults 1, 2, 9
def bundle_faults(ctx: DrillContext) -> None:
    """Fault 1 (a report drifts after build: reject build), 2 (a bundle for another process-group epoch:
    reject load, nothing staged), 9 (a schedule without a completion dependency: reject schedule)."""
    if ctx.initial is None or ctx.schedule is None:
        raise ValueError("bundle_faults: needs the initial release and the checked step schedule")
    r0, rt, client = ctx.initial, ctx.rt, ctx.client
    base = release_inputs(ctx, r0.generation, {"generation": r0.generation, "probe": "bundle faults"})
    # fault 1: an upstream report drifts after the build -> verify fails -> never VERIFIED
    b1, reports = build_release_bundle(base.model_copy(update={"name": f"{ctx.o.name}-drift-probe"}))
    ctx.roles["drift-probe"] = b1.release_id
    ok, why = admit(ctx, b1, drift_report(reports), r0.generation)
    path = client.record(b1.release_id).path()
    rejected = not ok and ReleaseState.VERIFIED not in path and path[-1] is ReleaseState.RETIRED
    ctx.record(check_fault(FaultKind.REPORT_HASH_DRIFT, SafeOutcome.REJECT_BUILD if rejected else None,
                           f"load-window report changed after build: {why[:160]}; lifecycle "
                           f"{' -> '.join(s.value for s in path)}"))
    # fault 2: the bundle names another process-group epoch -> refused before anything is staged
    other = process_group_generation(rt.group.group_id, rt.group.epoch + 1)
    b2, reports2 = build_release_bundle(base.model_copy(update={"name": f"{ctx.o.name}-pg-probe"}),
                                        process_group_override=other)
    ctx.roles["pg-probe"] = b2.release_id
    before = rt.generations()
    ok2, why2 = admit(ctx, b2, reports2, r0.generation)
    path2 = client.record(b2.release_id).path()
    unchanged = rt.generations() == before
    rejected2 = (not ok2 and path2[-1] is ReleaseState.RETIRED and ReleaseState.LOADED not in path2
                 and unchanged and "process_group_generation" in why2)
    ctx.record(check_fault(FaultKind.PROCESS_GROUP_GENERATION_MISMATCH,
                           SafeOutcome.REJECT_LOAD if rejected2 else None,
                           f"bundle for {other}, live {ctx.live_pg()}: {why2[:160]}; lifecycle "
                           f"{' -> '.join(s.value for s in path2)}; placement generations "
                           f"{'unchanged (nothing staged)' if unchanged else 'CHANGED'}"))
    # fault 9: the step schedule without combine_0's completion dependency on expert_0
    p = len(rt.group.peer_order)
    broken = check_step_schedule(without_dependency(step_tasks(p), "combine_0", "expert_0"), p)
    try:
        build_release_bundle(base.model_copy(update={"schedule": broken}))
        bound = "a release accepted it"
    except ValueError:
        bound = "no release binds it"
    rejected9 = ctx.schedule.ok and not broken.ok and "missing dependency" in broken.error \
        and bound == "no release binds it"
    ctx.record(check_fault(FaultKind.MISSING_COMPLETION_DEPENDENCY,
                           SafeOutcome.REJECT_SCHEDULE if rejected9 else None,
                           f"{broken.error[:160]}; {bound}; the valid schedule passes "
                           f"(makespan {ctx.schedule.makespan_units} analytical units)"))


# ============================================================================================ faults 3, 4, 7, 6
DATA_PATH_FAULTS = ((FaultKind.PEER_COUNT_DISAGREEMENT, ShardFault.COUNT),
                    (FaultKind.CORRUPT_INVERSE_PERMUTATION, ShardFault.INVERSE),
                    (FaultKind.FP8_SCALE_COUNT_MISMATCH, ShardFault.SCALE))


def data_path_faults(ctx: DrillContext) -> None:
    """Faults 3, 4, 7 (each rejected where declared, retried, reference output) and 6 (eager fallback)."""
    for kind, shard_kind in DATA_PATH_FAULTS:
        outcomes = [data_path_probe(ctx, shard_kind, r) for r in ctx.fault_ranks()]
        want = check_fault(kind, None).expected
        good = all(o is want for o, _ in outcomes)
        ctx.record(check_fault(kind, want if good else next((o for o, _ in outcomes if o is not want), None),
                               "; ".join(d for _, d in outcomes)))
    outcomes = [graph_key_probe(ctx, r) for r in ctx.fault_ranks()]
    good = all(o is SafeOutcome.EXPLICIT_EAGER_FALLBACK for o, _ in outcomes)
    ctx.record(check_fault(FaultKind.GRAPH_KEY_MISMATCH, SafeOutcome.EXPLICIT_EAGER_FALLBACK if good else None,
                           "; ".join(d for _, d in outcomes)))


def _aborted(ctx: DrillContext) -> dict[int, int]:
    return {r: int(s["counters"].get("aborted_steps", 0)) for r, s in ctx.rt.shard_status().items()}


def data_path_probe(ctx: DrillContext, shard_kind: ShardFault, rank: int) -> tuple[SafeOutcome | None, str]:
    """Arm ``shard_kind`` on ``rank`` for the active generation; one live batch hits it, then is retried."""
    if ctx.initial is None:
        raise ValueError("data_path_probe: needs the initial release")
    r0 = ctx.initial

    def probe(s: TrafficStream) -> tuple[SafeOutcome | None, str]:
        before = _aborted(ctx)
        ctx.arm(shard_kind, rank, 1, r0.generation)
        batch = s.next_batch(Phase.PREFILL)
        first = s.attempt(batch, pin=None, release=r0.release_id, role=Role.PROBE)
        if first.output is not None:
            ok, err = output_error(first.output, batch.reference)
            s.count_served(ok, err)
            return None, f"rank {rank}: {shard_kind.value} went through (output error {err:.3g})"
        s.count_retry()
        outcome = classify_failure(first.cause)
        deadline = time.monotonic() + ABORT_WAIT_S
        aborted: list[int] = []
        while time.monotonic() < deadline:
            now = _aborted(ctx)
            aborted = sorted(r for r in now if now[r] > before.get(r, 0))
            if len(aborted) == len(now) or (shard_kind is ShardFault.INVERSE and rank in aborted):
                break
            time.sleep(0.05)
        served = s.serve(batch)
        retried_ok = served is not None and output_error(served[0], batch.reference)[0]
        # count / scale faults abort every rank before payload; a corrupt inverse is caught where the
        # output is read for publishing: that rank rejects it and the driver publishes no output at all
        every = (rank in aborted) if shard_kind is ShardFault.INVERSE else len(aborted) == len(before)
        if not (retried_ok and every):
            outcome = None
        return outcome, (f"rank {rank}: {type(first.cause).__name__}: {str(first.cause)[:240]}; aborted on "
                         f"ranks {aborted}; retry {'equals the reference' if retried_ok else 'FAILED'}")

    return ctx.stream.exclusive(probe, ctx.o.wait_timeout_s)


def graph_key_probe(ctx: DrillContext, rank: int) -> tuple[SafeOutcome | None, str]:
    """Arm a graph-key mismatch on ``rank``; the next decode step must fall back eagerly, output unchanged."""
    if ctx.initial is None:
        raise ValueError("graph_key_probe: needs the initial release")
    r0, rt = ctx.initial, ctx.rt

    def probe(s: TrafficStream) -> tuple[SafeOutcome | None, str]:
        try:
            ctx.arm(ShardFault.GRAPH_KEY, rank, 1, r0.generation)
        except Exception as exc:  # noqa: BLE001 - a runtime without the fault kind reports it here
            cause = root_cause(exc)
            return None, f"rank {rank}: graph_key not injectable: {type(cause).__name__}: {str(cause)[:120]}"
        before = dict(rt.stats().get("fallbacks", {}) or {})
        batch = s.next_batch(Phase.DECODE)
        n_failed = len(s.failures())
        served = s.serve(batch)
        after = dict(rt.stats().get("fallbacks", {}) or {})
        delta = after.get("graph_key_mismatch", 0) - before.get("graph_key_mismatch", 0)
        ok = served is not None and output_error(served[0], batch.reference)[0]
        failed = any(f.batch == batch.index for f in s.failures()[n_failed:])
        outcome = SafeOutcome.EXPLICIT_EAGER_FALLBACK if ok and delta == 1 and not failed else None
        return outcome, (f"rank {rank}: decode step of {batch.hidden.shape[0]} tokens, graph_key_mismatch "
                         f"fallbacks +{delta}, output {'equals the reference' if ok else 'WRONG'}"
                         f"{', a step failed first' if failed else ''}")

    return ctx.stream.exclusive(probe, ctx.o.wait_timeout_s)


__all__ = ["drift_report", "without_dependency", "stale_handle", "bundle_faults", "data_path_faults",
           "data_path_probe", "graph_key_probe"]
