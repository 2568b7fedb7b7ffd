"""The rollback drill: a release promoted, faulted and rolled back under live traffic (spec 0x0C-0x0EB).

    report = run_drill(DrillOptions(fault_at=FaultAt.ACTIVE))     # or: ray-moe drill rollback [--json]

A background thread streams explicit-route batches through ``Runtime.forward`` for the whole drill and
checks every returned output against ``reference_moe`` (tagged weights, so a route served by the wrong
expert shows in the output). A step that fails (an injected fault) is retried; the retried output must be
the reference. Shadow steps (mirrored on a candidate, compared with the active output, never returned) and
canary steps (pinned to the candidate, returned and checked) run in the same stream.

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

import argparse
import json
import queue
import random
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping, Sequence

import ray
import torch

from ray_moe.config import RuntimeConfig
from ray_moe.errors import StaleGenerationError, root_cause
from ray_moe.experts.source import weight_source
from ray_moe.release.bundle import ReleaseBundle
from ray_moe.release.faults import FaultKind, FaultReport, FaultResult, SafeOutcome, check_fault
from ray_moe.release.gate import GateEvidence, GateVerdict, PromotionGate, RatioCounts
from ray_moe.release.rollback import RollbackExecution, RollbackPlan, RollbackStep, RollbackTarget
from ray_moe.release.service import (
    DrillOptions,
    DrillReport,
    FaultAt,
    ReleaseInputs,
    ReleaseTraffic,
    RollbackSummary,
    ScheduleCheck,
    TimelineEntry,
    TrafficSummary,
    build_release_bundle,
    check_step_schedule,
    classify_failure,
    drift_report,
    load_refusals,
    process_group_generation,
    render_text,
    step_tasks,
    without_dependency,
)
from ray_moe.telemetry.metrics import MetricName
from ray_moe.testing.reference import reference_moe
from ray_moe.types import Phase, ReleaseState

CRASH_COUNT = 1_000_000
"""An armed crash (or parity) fault that keeps firing until its generation is fenced."""


class DrillError(RuntimeError):
    """A drill step could not complete (a wait timed out, a control call failed); the message names it."""


# ============================================================================================ traffic
@dataclass(frozen=True)
class Batch:
    """One live batch: explicit routes and its reference output (float64)."""

    index: int
    phase: Phase
    hidden: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    reference: torch.Tensor


class BatchSource:
    """Deterministic batches: prefill with a hot expert (so EPLB has work), small uniform decode batches."""

    def __init__(self, cfg: RuntimeConfig, seed: int) -> None:
        src = weight_source(cfg)
        self._cfg = cfg
        self._seed = seed
        self._weights = {e: src.expert(0, e) for e in range(cfg.num_experts)}
        self.hot_expert = 1 % cfg.num_experts

    def make(self, index: int, phase: Phase | None = None) -> Batch:
        cfg = self._cfg
        g = torch.Generator().manual_seed(self._seed * 100_003 + index)
        phase = phase or (Phase.DECODE if index % 3 == 2 else Phase.PREFILL)
        e, k, p = cfg.num_experts, cfg.top_k, cfg.num_ranks
        if phase is Phase.DECODE:
            t = int(torch.randint(1, p + 1, (1,), generator=g))
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        else:
            t = int(torch.randint(2 * p, max(2 * p + 1, 33), (1,), generator=g))
            rows = []
            for _ in range(t):
                rest = [x for x in torch.randperm(e, generator=g).tolist() if x != self.hot_expert]
                rows.append([self.hot_expert, *rest[: k - 1]])
            ids = torch.tensor(rows, dtype=torch.int64)
        h = torch.randn(t, cfg.hidden_size, generator=g)
        w = torch.rand(t, k, generator=g) + 0.05
        ref = reference_moe(h.double(), ids, w, self._weights.__getitem__)
        return Batch(index, phase, h, ids, w, ref)


def output_error(y: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """(matches, max abs error): |y - ref| <= 1e-4 * (1 + max |ref|) (float32 path vs float64 reference)."""
    if ref.numel() == 0:
        return True, 0.0
    err = float((y.double() - ref).abs().max())
    return err <= 1e-4 * (1.0 + float(ref.abs().max())), err


def shadow_close(candidate: torch.Tensor, active: torch.Tensor) -> tuple[bool, float]:
    """Shadow comparison of a candidate's output with the active output (relative 1e-4)."""
    if active.numel() == 0:
        return True, 0.0
    err = float((candidate.double() - active.double()).abs().max())
    return err <= 1e-4 * (1.0 + float(active.double().abs().max())), err


class Role(str, Enum):
    SERVE = "serve"  # unpinned: the active generation
    CANARY = "canary"  # pinned to the candidate, returned
    SHADOW = "shadow"  # pinned to the candidate, compared, never returned
    PROBE = "probe"  # a fault probe's deliberate attempt


class RouteMode(str, Enum):
    SERVE = "serve"
    SHADOW = "shadow"
    CANARY = "canary"


@dataclass
class _Routing:
    """Driver-side dispatch selection (guarded by the stream's lock)."""

    active_gen: int | None = None
    active_release: str | None = None
    candidate_gen: int | None = None
    candidate_release: str | None = None
    mode: RouteMode = RouteMode.SERVE
    fraction: float = 0.0
    fenced: dict[int, float] = field(default_factory=dict)  # generation -> time its shard fence completed


@dataclass(frozen=True)
class FailureEvent:
    """One failed attempt of the stream."""

    t: float
    batch: int
    phase: str
    generation: int | None
    release: str | None
    role: Role
    error: str
    message: str
    outcome: SafeOutcome | None


@dataclass
class _ReleaseCounts:
    served: int = 0
    shadow: int = 0
    shadow_mismatches: int = 0
    shadow_failures: int = 0
    canary: int = 0
    failures: int = 0


@dataclass(frozen=True)
class Attempt:
    """One attempt's result: the output or the root cause of its failure."""

    output: torch.Tensor | None
    cause: BaseException | None
    generation: int | None
    release: str | None


class TrafficStream:
    """The live stream: one thread that serves, mirrors, canaries and runs fault probes, in that order.

    Everything that steps the runtime runs in this thread (probes are queued to it), so per-step accounting
    from ``rt.stats()`` deltas is exact. The main thread changes the routing and waits on the counters.
    """

    def __init__(self, rt: Any, source: BatchSource, *, seed: int, retry_deadline_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.rt = rt
        self.source = source
        self._retry_deadline_s = retry_deadline_s
        self._clock = clock
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._routing = _Routing()
        self._counts: dict[str, _ReleaseCounts] = {}
        self._failures: list[FailureEvent] = []
        self._probes: "queue.Queue[tuple[Callable[[TrafficStream], Any], Future]]" = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._crash: BaseException | None = None
        self._index = 0
        self.submitted = 0
        self.served = 0
        self.retried = 0
        self.mismatches = 0
        self.lost = 0
        self.max_error = 0.0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="drill-traffic", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                raise DrillError(f"traffic thread still running {timeout_s:.0f}s after stop")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    fn, fut = self._probes.get_nowait()
                except queue.Empty:
                    self._serve_next()
                    continue
                try:
                    fut.set_result(fn(self))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    fut.set_exception(exc)
                self._notify()
        except BaseException as exc:  # noqa: BLE001 - surfaced by every wait
            with self._cond:
                self._crash = exc
                self._cond.notify_all()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---------------------------------------------------------------- routing (main thread)
    def set_active(self, generation: int | None, release: str | None) -> None:
        with self._lock:
            self._routing.active_gen = generation
            self._routing.active_release = release

    def begin_shadow(self, generation: int, release: str) -> None:
        with self._lock:
            r = self._routing
            r.candidate_gen, r.candidate_release, r.mode, r.fraction = generation, release, RouteMode.SHADOW, 0.0
            self._counts.setdefault(release, _ReleaseCounts())

    def begin_canary(self, fraction: float) -> None:
        with self._lock:
            if self._routing.candidate_gen is None:
                raise DrillError("begin_canary: no candidate is in shadow")
            self._routing.mode = RouteMode.CANARY
            self._routing.fraction = float(fraction)

    def promote(self, generation: int, release: str) -> None:
        """The candidate becomes the active generation: unpinned steps now go to it, no canary pinning."""
        with self._lock:
            r = self._routing
            r.candidate_gen, r.candidate_release, r.mode, r.fraction = None, None, RouteMode.SERVE, 0.0
            r.active_gen, r.active_release = generation, release

    def stop_selecting(self, generation: int) -> None:
        """Driver-side stop fence: no new step selects ``generation`` (candidate or active)."""
        with self._lock:
            r = self._routing
            if r.candidate_gen == generation:
                r.candidate_gen, r.candidate_release, r.mode, r.fraction = None, None, RouteMode.SERVE, 0.0
            if r.active_gen == generation:
                r.active_gen, r.active_release = None, None

    def mark_fenced(self, generation: int) -> None:
        """The shard fence of ``generation`` completed now: a pinned step submitted later must be refused."""
        with self._lock:
            self._routing.fenced[generation] = self._clock()

    # ---------------------------------------------------------------- observation (main thread)
    def counts(self, release: str) -> ReleaseTraffic:
        with self._lock:
            c = self._counts.get(release, _ReleaseCounts())
            return ReleaseTraffic(release_id=release, **c.__dict__)

    def failures(self) -> list[FailureEvent]:
        with self._lock:
            return list(self._failures)

    def wait_for(self, what: str, predicate: Callable[["TrafficStream"], bool], timeout_s: float) -> None:
        """Block until ``predicate(self)`` holds (checked after every batch); ``DrillError`` naming ``what``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._crash is not None:
                raise DrillError(f"{what}: traffic thread failed: {type(self._crash).__name__}: {self._crash}")
            if predicate(self):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise DrillError(f"{what}: not reached within {timeout_s:.0f}s")
            with self._cond:
                self._cond.wait(timeout=min(0.5, left))

    def exclusive(self, fn: Callable[["TrafficStream"], Any], timeout_s: float) -> Any:
        """Run ``fn(stream)`` in the traffic thread between two batches; return its result (or raise its error)."""
        fut: Future = Future()
        self._probes.put((fn, fut))
        deadline = time.monotonic() + timeout_s
        while not fut.done():
            if self._crash is not None:
                raise DrillError(f"probe: traffic thread failed: {type(self._crash).__name__}: {self._crash}")
            if time.monotonic() > deadline:
                raise DrillError(f"probe {getattr(fn, '__name__', fn)!r} did not run within {timeout_s:.0f}s")
            time.sleep(0.01)
        return fut.result()

    def summary(self) -> TrafficSummary:
        with self._lock:
            causes: dict[str, int] = {}
            for f in self._failures:
                key = f.error if f.outcome is None else f"{f.error} ({f.outcome.value})"
                causes[key] = causes.get(key, 0) + 1
            return TrafficSummary(
                submitted=self.submitted, served=self.served, retried=self.retried, mismatches=self.mismatches,
                lost=self.lost, max_abs_error=self.max_error, failures_by_cause=causes,
                by_release=tuple(ReleaseTraffic(release_id=k, **v.__dict__) for k, v in self._counts.items()),
            )

    # ---------------------------------------------------------------- in-thread helpers (also used by probes)
    def next_batch(self, phase: Phase | None = None) -> Batch:
        with self._lock:
            self._index += 1
            i = self._index
            self.submitted += 1
        return self.source.make(i, phase)

    def count_retry(self) -> None:
        """A failed attempt of a batch that will be (or was) retried."""
        with self._lock:
            self.retried += 1

    def count_served(self, ok: bool, err: float) -> None:
        """A probe's batch returned on its first attempt (``ok``: it equals the reference; ``err``: max error)."""
        with self._cond:
            self.served += 1
            self.max_error = max(self.max_error, err)
            if not ok:
                self.mismatches += 1
            self._cond.notify_all()

    def _bump(self, release: str | None, **deltas: int) -> None:
        if release is None:
            return
        c = self._counts.setdefault(release, _ReleaseCounts())
        for k, v in deltas.items():
            setattr(c, k, getattr(c, k) + v)

    def attempt(self, batch: Batch, *, pin: int | None, release: str | None, role: Role) -> Attempt:
        """One step of ``batch`` (pinned to ``pin`` when given); accounts telemetry for ``release`` on success
        and records a ``FailureEvent`` on failure. Never raises for a step failure."""
        rt = self.rt
        with self._lock:
            gen = pin if pin is not None else self._routing.active_gen
            fenced_at = self._routing.fenced.get(pin) if pin is not None else None
        t_submit = self._clock()
        before = rt.stats()
        try:
            y = rt.forward(batch.hidden, batch.ids, batch.weights, phase=batch.phase, generation=pin)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and retried by the caller
            cause = root_cause(exc)
            ev = FailureEvent(self._clock(), batch.index, batch.phase.value, gen, release, role,
                              type(cause).__name__, str(cause)[:400], classify_failure(cause))
            with self._cond:
                self._failures.append(ev)
                self._bump(release, failures=1)
                self._cond.notify_all()
            return Attempt(None, cause, gen, release)
        after = rt.stats()
        self._account(batch, release, gen, before, after,
                      stale=pin is not None and fenced_at is not None and t_submit > fenced_at)
        return Attempt(y, None, gen, release)

    def _account(self, batch: Batch, release: str | None, gen: int | None, before: Mapping[str, Any],
                 after: Mapping[str, Any], *, stale: bool) -> None:
        """Per-release telemetry with numerators and denominators (0x0D, 0x0DB) from this step's stats delta."""
        if release is None:
            return
        rt = self.rt
        tel = rt.telemetry
        base = {"release": release, "phase": batch.phase.value}
        attempted = after["attempted_routes"] - before["attempted_routes"]
        accepted = after["accepted_routes"] - before["accepted_routes"]
        dropped = after["ratios"]["drop"]["numerator"] - before["ratios"]["drop"]["numerator"]
        tel.add_ratio(MetricName.ROUTE_DROP_RATIO, base, dropped, attempted)
        fb_before = before.get("fallbacks", {}) or {}
        fb_after = after.get("fallbacks", {}) or {}
        reasons = [k for k in fb_after if fb_after[k] > fb_before.get(k, 0)]
        tel.add_ratio(MetricName.FALLBACK_STEP_RATIO, {**base, "reason": reasons[0] if reasons else "none"},
                      1 if reasons else 0, 1)
        expected = int(batch.ids.numel()) * rt.cfg.num_layers
        conserved = attempted == expected and accepted + dropped == attempted
        pg = process_group_generation(rt.group.group_id, rt.group.epoch)
        tel.inc(MetricName.COUNT_CONSERVATION_FAILURE_TOTAL, {"release": release, "process_group_generation": pg},
                0 if conserved else 1)
        tel.inc(MetricName.STALE_HANDLE_ACCEPT_TOTAL,
                {"release": release, "placement_generation": f"placement-v{gen}"}, 1 if stale else 0)

    def _mismatch(self, release: str | None, phase: Phase) -> None:
        if release is not None:
            self.rt.telemetry.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": release, "phase": phase.value})

    def _select(self) -> tuple[int | None, str | None, Role]:
        with self._lock:
            r = self._routing
            if r.mode is RouteMode.CANARY and r.candidate_gen is not None and self._rng.random() < r.fraction:
                return r.candidate_gen, r.candidate_release, Role.CANARY
            return None, r.active_release, Role.SERVE

    def serve(self, batch: Batch) -> tuple[torch.Tensor, Attempt, Role] | None:
        """Serve ``batch`` until a step returns (re-selecting each attempt); check it against the reference.

        Returns (output, the successful attempt, its role) or None when the retry deadline passed (lost)."""
        deadline = time.monotonic() + self._retry_deadline_s
        while True:
            pin, release, role = self._select()
            at = self.attempt(batch, pin=pin, release=release, role=role)
            if at.output is not None:
                ok, err = output_error(at.output, batch.reference)
                with self._cond:
                    self.served += 1
                    self.max_error = max(self.max_error, err)
                    self._bump(release, served=1, canary=1 if role is Role.CANARY else 0)
                    if not ok:
                        self.mismatches += 1
                    self._cond.notify_all()
                if not ok:
                    self._mismatch(release, batch.phase)
                return at.output, at, role
            if time.monotonic() > deadline:
                with self._lock:
                    self.lost += 1
                return None
            self.count_retry()
            time.sleep(0.01)

    def _serve_next(self) -> None:
        batch = self.next_batch()
        res = self.serve(batch)
        if res is None:
            return
        y, at, role = res
        with self._lock:
            r = self._routing
            mirror = (r.mode is RouteMode.SHADOW and r.candidate_gen is not None and role is Role.SERVE)
            cand_gen, cand_rel = r.candidate_gen, r.candidate_release
        if mirror:
            self.shadow(batch, y, cand_gen, cand_rel)

    def shadow(self, batch: Batch, active_out: torch.Tensor, gen: int, release: str) -> None:
        """Mirror ``batch`` on the candidate and compare with the active output (never returned)."""
        at = self.attempt(batch, pin=gen, release=release, role=Role.SHADOW)
        if at.output is None:
            with self._cond:
                self._bump(release, shadow_failures=1)
                self._cond.notify_all()
            return
        ok, _ = shadow_close(at.output, active_out)
        with self._cond:
            self._bump(release, shadow=1, shadow_mismatches=0 if ok else 1)
            self._cond.notify_all()
        if not ok:
            self._mismatch(release, batch.phase)


# ============================================================================================ control-side clients
class ReleaseClient:
    """The coordinator's release registry, with each lifecycle event stamped when the driver saw it."""

    def __init__(self, coordinator: Any, clock: Callable[[], float] = time.time) -> None:
        self._coord = coordinator
        self._clock = clock
        self._stamps: dict[int, float] = {}
        self._events: dict[int, Any] = {}

    def call(self, method: str, *args: Any) -> Any:
        out = ray.get(self._coord.release.remote(method, *args))
        self._stamp()
        return out

    def _stamp(self) -> None:
        now = self._clock()
        for e in ray.get(self._coord.release.remote("timeline")):
            if e.seq not in self._stamps:
                self._stamps[e.seq] = now
                self._events[e.seq] = e

    def state(self, release_id: str) -> ReleaseState:
        return ray.get(self._coord.release.remote("get", release_id)).state

    def path(self, release_id: str) -> tuple[ReleaseState, ...]:
        return ray.get(self._coord.release.remote("get", release_id)).path()

    def entries(self) -> list[TimelineEntry]:
        self._stamp()
        out = []
        for seq in sorted(self._events):
            e = self._events[seq]
            event = e.to_state.value if e.from_state is None else f"{e.from_state.value}->{e.to_state.value}"
            out.append(TimelineEntry(t=self._stamps[seq], source="release", subject=e.release_id,
                                     event=event, detail=e.reason))
        return out


class RuntimeRollbackPort:
    """``RollbackPort`` against the live runtime and the coordinator's release registry (0x0EA).

    stop_new_dispatch: driver selection fence, shard fence (``rt.stop_dispatch``), lifecycle stop.
    activate:          ``rt.activate(prior)`` (re-publish a loaded prior), lifecycle activate, driver routing.
    refcount:          exact in-flight pins of the candidate's generation on every shard.
    release_graphs:    ``rt.release_graphs``; retire: ``rt.drain_and_retire`` then lifecycle retire.
    """

    def __init__(self, rt: Any, releases: ReleaseClient, generation_of: Mapping[str, int], stream: TrafficStream,
                 *, drain_timeout_s: float) -> None:
        self._rt = rt
        self._releases = releases
        self._gen = dict(generation_of)
        self._stream = stream
        self._drain_timeout_s = drain_timeout_s
        self.graphs_freed = 0

    def _generation(self, release_id: str) -> int:
        if release_id not in self._gen:
            raise ValueError(f"release_id={release_id!r} has no placement generation in this drill")
        return self._gen[release_id]

    def stop_new_dispatch(self, release_id: str) -> None:
        g = self._generation(release_id)
        self._stream.stop_selecting(g)
        self._rt.stop_dispatch(g)
        self._stream.mark_fenced(g)
        self._releases.call("stop_new_dispatch", release_id)

    def activate(self, release_id: str) -> None:
        g = self._generation(release_id)
        self._rt.activate(g)
        self._releases.call("activate", release_id)
        self._stream.set_active(g, release_id)

    def refcount(self, release_id: str) -> int:
        return int(self._rt.shard_refcount(self._generation(release_id)))

    def release_graphs(self, release_id: str) -> None:
        self.graphs_freed += int(self._rt.release_graphs(self._generation(release_id)))

    def retire(self, release_id: str) -> None:
        g = self._generation(release_id)
        if not self._rt.drain_and_retire(g, self._drain_timeout_s):
            raise DrillError(f"generation={g}: drain_and_retire did not retire it within {self._drain_timeout_s:.0f}s")
        self._releases.call("retire", release_id)


# ============================================================================================ the drill
@dataclass
class _Release:
    """A release this drill registered: its bundle, the reports it binds and its placement generation."""

    bundle: ReleaseBundle
    reports: tuple[dict[str, Any], ...]
    generation: int

    @property
    def release_id(self) -> str:
        return self.bundle.release_id


class _Drill:
    def __init__(self, options: DrillOptions, rt: Any, *, clock: Callable[[], float] = time.time) -> None:
        self.o = options
        self.rt = rt
        self.clock = clock
        self.releases = ReleaseClient(rt.coordinator, clock)
        self.stream = TrafficStream(rt, BatchSource(rt.cfg, options.seed), seed=options.seed,
                                    retry_deadline_s=options.retry_deadline_s, clock=clock)
        self.gate = PromotionGate(options.thresholds)
        self.notes: list[TimelineEntry] = []
        self.results: dict[FaultKind, FaultResult] = {}
        self.rollbacks: list[RollbackSummary] = []
        self.rel: dict[str, _Release] = {}
        self.roles: dict[str, str] = {}
        self.failures: list[str] = []
        self.schedule: ScheduleCheck | None = None
        self.verdict: GateVerdict | None = None
        self.parity_verdict: GateVerdict | None = None
        self.rehearsal_fault: FaultResult | None = None
        self.initial: _Release | None = None
        self.candidate: _Release | None = None
        self.stale_generation: int | None = None
        n = options.num_experts
        self.hot = 1 % n
        self.parity_expert = n - 1
        self.rehearsal_expert = n - 2 if n - 2 != self.hot else n - 3

    # ---------------------------------------------------------------- small helpers
    def note(self, subject: str, event: str, detail: str = "") -> None:
        self.notes.append(TimelineEntry(t=self.clock(), source="drill", subject=subject, event=event, detail=detail))

    def record(self, result: FaultResult) -> None:
        self.results[result.fault] = result
        self.note(result.fault.value, "fault-" + ("safe" if result.passed else "UNSAFE"),
                  f"observed {result.observed.value if result.observed else 'nothing'}")

    def fault_ranks(self) -> list[int]:
        ranks = list(self.rt.group.peer_order)
        return ranks if self.o.all_faults else [ranks[1 % len(ranks)]]

    def wait(self, what: str, predicate: Callable[[TrafficStream], bool]) -> None:
        self.stream.wait_for(what, predicate, self.o.wait_timeout_s)

    def wait_served(self, release: str | None, n: int, what: str) -> None:
        if release is None:
            start = self.stream.served
            self.wait(what, lambda s: s.served >= start + n)
            return
        start = self.stream.counts(release).served
        self.wait(what, lambda s: s.counts(release).served >= start + n)

    def live_pg(self) -> str:
        return process_group_generation(self.rt.group.group_id, self.rt.group.epoch)

    # ---------------------------------------------------------------- releases
    def inputs(self, generation: int, ledger: Mapping[str, Any], name: str | None = None) -> ReleaseInputs:
        rt = self.rt
        manifest = rt.placement(generation)
        try:
            prov = dict(ray.get(rt.coordinator.load_matrix.remote())["provenance"])
        except Exception as exc:  # noqa: BLE001 - an empty window is recorded as such
            prov = {"observations": 0, "error": f"{type(root_cause(exc)).__name__}: {root_cause(exc)}"[:200]}
        assert self.schedule is not None
        return ReleaseInputs(name=name or f"{self.o.name}-{manifest.placement_version}", config=rt.cfg,
                             manifest=manifest, group_id=rt.group.group_id, group_epoch=rt.group.epoch,
                             topology_version=rt.topology.version, load_provenance=prov,
                             migration_ledger=dict(ledger), schedule=self.schedule)

    def admit(self, bundle: ReleaseBundle, reports: Sequence[Mapping[str, Any]], generation: int | None,
              ) -> tuple[bool, str]:
        """BUILT -> VERIFIED -> LOADED, or the rejection (reject build / reject load) with its reason.

        1. register (BUILT); 2. recompute every digest against the reports (drift: BUILT -> RETIRED);
        3. load check against the live process group, topology and the staged manifest (VERIFIED -> RETIRED);
        4. LOADED: the placement generation is resident and verified on every shard.
        """
        rid = bundle.release_id
        self.releases.call("register", bundle, "built")
        try:
            bundle.require_verified(reports)
        except ValueError as exc:
            self.releases.call("transition", rid, ReleaseState.RETIRED, f"reject build: {exc}"[:300])
            return False, str(exc)
        self.releases.call("transition", rid, ReleaseState.VERIFIED, "bundle and upstream report digests recomputed")
        manifest = self.rt.placement(generation) if generation is not None else None
        refusals = load_refusals(bundle, live_process_group=self.live_pg(), live_topology=self.rt.topology.version,
                                 manifest=manifest)
        if refusals:
            why = "reject load: " + "; ".join(refusals)
            self.releases.call("transition", rid, ReleaseState.RETIRED, why[:300])
            return False, why
        self.releases.call("transition", rid, ReleaseState.LOADED,
                           f"placement-v{generation} resident and verified on every shard")
        return True, ""

    def stage_candidate(self, role: str, kind: str, **kw: Any) -> _Release:
        """Stage a candidate generation under traffic, build its release and admit it to LOADED."""
        rep = self.rt.stage(kind, **kw)
        g = int(rep["new_generation"])
        bundle, reports = build_release_bundle(self.inputs(g, rep.get("ledger") or {"kind": kind}))
        rel = _Release(bundle, reports, g)
        self.rel[bundle.release_id] = rel
        self.roles[role] = bundle.release_id
        ok, why = self.admit(bundle, reports, g)
        if not ok:
            raise DrillError(f"{role} candidate {bundle.release_id} was not admitted: {why}")
        self.register_series(bundle.release_id, g)
        self.note(bundle.release_id, "staged", f"{role}: {kind} {kw or ''} -> placement-v{g}")
        return rel

    def register_series(self, release: str, generation: int) -> None:
        """Zero-valued counters for a release, so the gate reads an observed 0 (and status shows it)."""
        tel = self.rt.telemetry
        for phase in (Phase.PREFILL.value, Phase.DECODE.value):
            tel.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": release, "phase": phase}, 0)
        tel.inc(MetricName.STALE_HANDLE_ACCEPT_TOTAL,
                {"release": release, "placement_generation": f"placement-v{generation}"}, 0)
        tel.inc(MetricName.COUNT_CONSERVATION_FAILURE_TOTAL,
                {"release": release, "process_group_generation": self.live_pg()}, 0)

    def evidence(self, rel: _Release, fault_report: FaultReport, rollback_ok: bool) -> GateEvidence:
        """GateEvidence for one release, from its bundle, its manifest, this drill's reports and its telemetry."""
        rid = rel.release_id
        snap = self.rt.telemetry.snapshot()
        check = rel.bundle.verify(rel.reports)
        counts = self.stream.counts(rid)
        return GateEvidence(
            release_id=rid,
            hash_ok=check.ok and check.release_id == rid,
            manifest_ok=not rel.bundle.manifest_failures(self.rt.placement(rel.generation)),
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

    def rollback(self, purpose: str, candidate: _Release, prior: _Release, detected: str) -> RollbackSummary:
        """0x0EA over the live runtime, one public step at a time (each stamped on the timeline)."""
        c_rec = self.releases.call("get", candidate.release_id)
        p_rec = self.releases.call("get", prior.release_id)
        plan = RollbackPlan(RollbackTarget.from_record(c_rec), RollbackTarget.from_record(p_rec))
        port = RuntimeRollbackPort(self.rt, self.releases, {r.release_id: r.generation for r in (candidate, prior)},
                                   self.stream, drain_timeout_s=self.o.drain_timeout_s)
        polls = max(1, int(self.o.drain_timeout_s / 0.005))
        ex = RollbackExecution(plan, port, max_drain_polls=polls, wait=lambda: time.sleep(0.005))
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
            stamps.append(self.clock())
        rep = ex.report()
        for t, ev in zip(stamps, rep.events):
            self.notes.append(TimelineEntry(t=t, source="rollback", subject=candidate.release_id,
                                            event=ev.step.value, detail=ev.detail))
        summary = RollbackSummary(
            purpose=purpose, candidate=candidate.release_id, prior=prior.release_id,
            candidate_generation=candidate.generation, prior_generation=prior.generation,
            steps=tuple(s.value for s in rep.steps), refcount_trace=rep.refcount_trace, ok=rep.ok and not error,
            detected=detected + (f"; rollback stopped: {error}" if error else ""),
        )
        self.rollbacks.append(summary)
        return summary

    def rolled_back(self, summary: RollbackSummary, candidate: _Release, prior: _Release) -> tuple[bool, str]:
        """Did the rollback land: prior ACTIVE (placement and lifecycle), candidate RETIRED, prior serving?"""
        gens = self.rt.generations()
        ok = (summary.ok and gens.get(prior.generation) == "ACTIVE" and gens.get(candidate.generation) == "RETIRED"
              and self.releases.state(prior.release_id) is ReleaseState.ACTIVE
              and self.releases.state(candidate.release_id) is ReleaseState.RETIRED)
        self.wait_served(prior.release_id, 2, f"traffic served on {prior.release_id} after the rollback")
        detail = (f"{summary.detected}; {' -> '.join(summary.steps)}; refcount {list(summary.refcount_trace)}; "
                  f"placement-v{prior.generation} {gens.get(prior.generation)}, "
                  f"placement-v{candidate.generation} {gens.get(candidate.generation)}")
        return ok, detail

    def crash_and_detect(self, rel: _Release) -> str:
        """Arm a crash on ``rel``'s generation; wait until a step served by it fails."""
        start = len(self.stream.failures())
        rank = self.fault_ranks()[0]
        self.rt.inject_fault("crash", rank=rank, count=CRASH_COUNT, generation=rel.generation)
        self.note(rel.release_id, "fault-armed", f"crash on rank {rank} for placement-v{rel.generation}")

        def failed(s: TrafficStream) -> bool:
            return any(f.generation == rel.generation for f in s.failures()[start:])

        self.wait(f"a step on placement-v{rel.generation} fails", failed)
        ev = next(f for f in self.stream.failures()[start:] if f.generation == rel.generation)
        detected = f"{ev.role.value} step on placement-v{rel.generation} failed: {ev.error}: {ev.message[:120]}"
        self.note(rel.release_id, "fault-detected", detected)
        return detected

    # ================================================================ the steps
    def run(self) -> DrillReport:
        steps: tuple[tuple[str, Callable[[], None]], ...] = (
            ("1 warm up and publish under traffic", self.step_warmup),
            ("2 register the initial release", self.step_initial_release),
            ("3 stale handle (fault 5)", self.step_stale_handle),
            ("4 bundle and schedule faults (1, 2, 9)", self.step_bundle_faults),
            ("5 data-path faults (3, 4, 7, 6)", self.step_data_path_faults),
            ("6 parity-faulted candidate (fault 8)", self.step_parity_candidate),
            ("7 rollback rehearsal (fault 10 for the gate)", self.step_rehearsal),
            ("8 healthy candidate: shadow, canary, gate", self.step_candidate),
            (f"9 fault at {self.o.fault_at.value} and rollback", self.step_fault_and_rollback),
            ("10 serve on the prior again", self.step_after),
        )
        self.stream.start()
        try:
            for name, fn in steps:
                self.note("drill", "step", name)
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - the report names the step that failed
                    cause = root_cause(exc)
                    self.failures.append(f"step {name!r} failed: {type(cause).__name__}: {cause}"[:600])
                    self.note("drill", "step-failed", f"{name}: {type(cause).__name__}")
                    break
        finally:
            try:
                self.stream.stop()
            except DrillError as exc:
                self.failures.append(str(exc))
        return self.report()

    # 1.
    def step_warmup(self) -> None:
        self.wait_served(None, self.o.steps, f"{self.o.steps} warm-up batches served")
        self.stale_generation = self.rt.placement().generation
        g = self.rt.scale(expert=self.hot, replicas=2)
        self.note(f"placement-v{g}", "published", f"scale expert {self.hot} to 2 replicas under traffic")
        self.wait_served(None, 4, "traffic on the published generation")

    # 2.
    def step_initial_release(self) -> None:
        rt = self.rt
        p = len(rt.group.peer_order)
        self.schedule = check_step_schedule(step_tasks(p), p)
        if not self.schedule.ok:
            raise DrillError(f"the release step schedule is invalid: {self.schedule.error}")
        g = rt.placement().generation
        plan = [e["detail"] for e in rt.timeline() if e["generation"] == g and e["event"] == "plan"]
        bundle, reports = build_release_bundle(self.inputs(g, {"generation": g, "plan": plan}))
        rel = _Release(bundle, reports, g)
        self.rel[bundle.release_id] = rel
        self.roles["initial"] = bundle.release_id
        ok, why = self.admit(bundle, reports, g)
        if not ok:
            raise DrillError(f"initial release {bundle.release_id} was not admitted: {why}")
        self.releases.call("transition", bundle.release_id, ReleaseState.ACTIVE, "bootstrap: the deployed generation")
        self.register_series(bundle.release_id, g)
        self.stream.set_active(g, bundle.release_id)
        self.initial = rel

    # 3.
    def step_stale_handle(self) -> None:
        assert self.initial is not None
        stale, r0 = self.stale_generation, self.initial

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

        first, served, batch = self.stream.exclusive(probe, self.o.wait_timeout_s)
        state = self.rt.generations().get(stale)
        if first.output is not None:
            self.record(check_fault(FaultKind.STALE_HANDLE_ON_NEW_GENERATION, None,
                                    f"a step pinned to placement-v{stale} ({state}) was accepted"))
            return
        refused = isinstance(first.cause, StaleGenerationError)
        replanned = served is not None and served[1].generation == r0.generation \
            and output_error(served[0], batch.reference)[0]
        observed = SafeOutcome.REJECT_HANDLE_AND_REPLAN if refused and replanned else None
        self.record(check_fault(
            FaultKind.STALE_HANDLE_ON_NEW_GENERATION, observed,
            f"pinned to placement-v{stale} ({state}) after placement-v{r0.generation} was published: "
            f"{type(first.cause).__name__}: {str(first.cause)[:140]}; the batch replanned unpinned onto "
            f"placement-v{r0.generation}: {'reference output' if replanned else 'NOT served correctly'}"))

    # 4.
    def step_bundle_faults(self) -> None:
        assert self.initial is not None and self.schedule is not None
        r0 = self.initial
        base = self.inputs(r0.generation, {"generation": r0.generation, "probe": "bundle faults"})
        # fault 1: an upstream report drifts after the build -> verify fails -> never VERIFIED
        b1, reports = build_release_bundle(base.model_copy(update={"name": f"{self.o.name}-drift-probe"}))
        self.roles["drift-probe"] = b1.release_id
        ok, why = self.admit(b1, drift_report(reports), r0.generation)
        path = self.releases.path(b1.release_id)
        rejected = not ok and ReleaseState.VERIFIED not in path and path[-1] is ReleaseState.RETIRED
        self.record(check_fault(FaultKind.REPORT_HASH_DRIFT, SafeOutcome.REJECT_BUILD if rejected else None,
                                f"load-window report changed after build: {why[:160]}; lifecycle "
                                f"{' -> '.join(s.value for s in path)}"))
        # fault 2: the bundle names another process-group epoch -> refused before anything is staged
        other = process_group_generation(self.rt.group.group_id, self.rt.group.epoch + 1)
        b2, reports2 = build_release_bundle(base.model_copy(update={"name": f"{self.o.name}-pg-probe"}),
                                            process_group_override=other)
        self.roles["pg-probe"] = b2.release_id
        before = self.rt.generations()
        ok2, why2 = self.admit(b2, reports2, r0.generation)
        path2 = self.releases.path(b2.release_id)
        unchanged = self.rt.generations() == before
        rejected2 = (not ok2 and path2[-1] is ReleaseState.RETIRED and ReleaseState.LOADED not in path2
                     and unchanged and "process_group_generation" in why2)
        self.record(check_fault(FaultKind.PROCESS_GROUP_GENERATION_MISMATCH,
                                SafeOutcome.REJECT_LOAD if rejected2 else None,
                                f"bundle for {other}, live {self.live_pg()}: {why2[:160]}; lifecycle "
                                f"{' -> '.join(s.value for s in path2)}; placement generations "
                                f"{'unchanged (nothing staged)' if unchanged else 'CHANGED'}"))
        # fault 9: the step schedule without combine_0's completion dependency on expert_0
        p = len(self.rt.group.peer_order)
        broken = check_step_schedule(without_dependency(step_tasks(p), "combine_0", "expert_0"), p)
        try:
            build_release_bundle(base.model_copy(update={"schedule": broken}))
            bound = "a release accepted it"
        except ValueError:
            bound = "no release binds it"
        rejected9 = self.schedule.ok and not broken.ok and "missing dependency" in broken.error \
            and bound == "no release binds it"
        self.record(check_fault(FaultKind.MISSING_COMPLETION_DEPENDENCY,
                                SafeOutcome.REJECT_SCHEDULE if rejected9 else None,
                                f"{broken.error[:160]}; {bound}; the valid schedule passes "
                                f"(makespan {self.schedule.makespan_units} analytical units)"))

    # 5.
    def step_data_path_faults(self) -> None:
        plan = ((FaultKind.PEER_COUNT_DISAGREEMENT, "count"), (FaultKind.CORRUPT_INVERSE_PERMUTATION, "inverse"),
                (FaultKind.FP8_SCALE_COUNT_MISMATCH, "scale"))
        for kind, shard_kind in plan:
            outcomes = [self.data_path_probe(shard_kind, r) for r in self.fault_ranks()]
            want = check_fault(kind, None).expected
            good = all(o is want for o, _ in outcomes)
            self.record(check_fault(kind, want if good else next((o for o, _ in outcomes if o is not want), None),
                                    "; ".join(d for _, d in outcomes)))
        outcomes = [self.graph_key_probe(r) for r in self.fault_ranks()]
        good = all(o is SafeOutcome.EXPLICIT_EAGER_FALLBACK for o, _ in outcomes)
        self.record(check_fault(FaultKind.GRAPH_KEY_MISMATCH, SafeOutcome.EXPLICIT_EAGER_FALLBACK if good else None,
                                "; ".join(d for _, d in outcomes)))

    def _aborted(self) -> dict[int, int]:
        return {r: int(s["counters"].get("aborted_steps", 0)) for r, s in self.rt.shard_status().items()}

    def data_path_probe(self, shard_kind: str, rank: int) -> tuple[SafeOutcome | None, str]:
        """Arm ``shard_kind`` on ``rank`` for the active generation; one live batch hits it, then is retried."""
        assert self.initial is not None
        r0 = self.initial

        def probe(s: TrafficStream) -> tuple[SafeOutcome | None, str]:
            before = self._aborted()
            self.rt.inject_fault(shard_kind, rank=rank, count=1, generation=r0.generation)
            batch = s.next_batch(Phase.PREFILL)
            first = s.attempt(batch, pin=None, release=r0.release_id, role=Role.PROBE)
            if first.output is not None:
                ok, err = output_error(first.output, batch.reference)
                s.count_served(ok, err)
                return None, f"rank {rank}: {shard_kind} went through (output error {err:.3g})"
            s.count_retry()
            outcome = classify_failure(first.cause)
            deadline = time.monotonic() + 5.0
            aborted: list[int] = []
            while time.monotonic() < deadline:
                now = self._aborted()
                aborted = sorted(r for r in now if now[r] > before.get(r, 0))
                if len(aborted) == len(now) or (shard_kind == "inverse" and rank in aborted):
                    break
                time.sleep(0.05)
            served = s.serve(batch)
            retried_ok = served is not None and output_error(served[0], batch.reference)[0]
            # count / scale faults abort every rank before payload; a corrupt inverse is caught where the
            # output is read for publishing: that rank rejects it and the driver publishes no output at all
            every = (rank in aborted) if shard_kind == "inverse" else len(aborted) == len(before)
            if not (retried_ok and every):
                outcome = None
            return outcome, (f"rank {rank}: {type(first.cause).__name__}: {str(first.cause)[:240]}; aborted on "
                             f"ranks {aborted}; retry {'equals the reference' if retried_ok else 'FAILED'}")

        return self.stream.exclusive(probe, self.o.wait_timeout_s)

    def graph_key_probe(self, rank: int) -> tuple[SafeOutcome | None, str]:
        """Arm a graph-key mismatch on ``rank``; the next decode step must fall back eagerly, output unchanged."""
        assert self.initial is not None
        r0 = self.initial

        def probe(s: TrafficStream) -> tuple[SafeOutcome | None, str]:
            try:
                self.rt.inject_fault("graph_key", rank=rank, count=1, generation=r0.generation)
            except Exception as exc:  # noqa: BLE001 - a runtime without the fault kind reports it here
                cause = root_cause(exc)
                return None, f"rank {rank}: graph_key not injectable: {type(cause).__name__}: {str(cause)[:120]}"
            before = dict(self.rt.stats().get("fallbacks", {}) or {})
            batch = s.next_batch(Phase.DECODE)
            n_failed = len(s.failures())
            served = s.serve(batch)
            after = dict(self.rt.stats().get("fallbacks", {}) or {})
            delta = after.get("graph_key_mismatch", 0) - before.get("graph_key_mismatch", 0)
            ok = served is not None and output_error(served[0], batch.reference)[0]
            failed = any(f.batch == batch.index for f in s.failures()[n_failed:])
            outcome = SafeOutcome.EXPLICIT_EAGER_FALLBACK if ok and delta == 1 and not failed else None
            return outcome, (f"rank {rank}: decode step of {batch.hidden.shape[0]} tokens, graph_key_mismatch "
                             f"fallbacks +{delta}, output {'equals the reference' if ok else 'WRONG'}"
                             f"{', a step failed first' if failed else ''}")

        return self.stream.exclusive(probe, self.o.wait_timeout_s)

    # 6.
    def step_parity_candidate(self) -> None:
        assert self.initial is not None
        r0 = self.initial
        a = self.stage_candidate("parity", "scale", expert=self.parity_expert, replicas=2)
        rid = a.release_id
        self.releases.call("transition", rid, ReleaseState.SHADOW, "serve mirrored traffic, outputs compared")
        for rank in self.fault_ranks():
            self.rt.inject_fault("parity", rank=rank, count=CRASH_COUNT, generation=a.generation)
        self.note(rid, "fault-armed", f"runner parity x1.01 on ranks {self.fault_ranks()}")
        self.stream.begin_shadow(a.generation, rid)
        need = max(1, self.o.thresholds.min_shadow)
        self.wait(f"shadow of {rid}", lambda s: (c := s.counts(rid)).shadow_mismatches > 0
                  or c.shadow_failures > 0 or c.shadow >= need)
        counts = self.stream.counts(rid)
        partial = FaultReport(release_id=rid, results=tuple(self.results.values()))
        self.parity_verdict = self.gate.evaluate(self.evidence(a, partial, rollback_ok=False))
        self.note(rid, "gate", "blocked: " + ", ".join(c.value for c in self.parity_verdict.failed)
                  if not self.parity_verdict.passed else "passed")
        found = counts.shadow_mismatches > 0
        detected = f"shadow comparison: {counts.shadow_mismatches} mismatch(es) in {counts.shadow} mirrored batches"
        summary = self.rollback("block canary (runner parity)", a, r0, detected)
        path = self.releases.path(rid)
        blocked = (found and ReleaseState.CANARY not in path and not self.parity_verdict.passed
                   and summary.ok and path[-1] is ReleaseState.RETIRED)
        self.record(check_fault(
            FaultKind.RUNNER_PARITY_MISMATCH, SafeOutcome.BLOCK_CANARY if blocked else None,
            f"{detected}; gate blocked by {[c.value for c in self.parity_verdict.failed]}; lifecycle "
            f"{' -> '.join(s.value for s in path)}"))

    # 7.
    def step_rehearsal(self) -> None:
        assert self.initial is not None
        r0 = self.initial
        rr = self.stage_candidate("rehearsal", "scale", expert=self.rehearsal_expert, replicas=2)
        rid = rr.release_id
        n = self.o.rehearsal_steps
        self.releases.call("transition", rid, ReleaseState.SHADOW, "rehearsal: mirrored traffic")
        self.stream.begin_shadow(rr.generation, rid)
        self.wait(f"rehearsal shadow of {rid}", lambda s: s.counts(rid).shadow >= n
                  or s.counts(rid).shadow_mismatches > 0)
        if self.stream.counts(rid).shadow_mismatches:
            raise DrillError(f"rehearsal candidate {rid} differs from the active output in shadow")
        self.releases.call("begin_canary", rid, self.o.canary_fraction, "rehearsal: shadow clean")
        self.stream.begin_canary(self.o.canary_fraction)
        self.wait(f"rehearsal canary of {rid}", lambda s: s.counts(rid).canary >= n)
        detected = self.crash_and_detect(rr)
        summary = self.rollback("rehearsal (candidate faults while serving canary)", rr, r0, detected)
        ok, detail = self.rolled_back(summary, rr, r0)
        self.rehearsal_fault = check_fault(FaultKind.ACTIVE_CANDIDATE_FAULT,
                                           SafeOutcome.ROLL_BACK_TO_PRIOR_GENERATION if ok else None,
                                           "rehearsal: " + detail)

    # 8.
    def step_candidate(self) -> None:
        assert self.initial is not None and self.rehearsal_fault is not None
        b = self.stage_candidate("candidate", "rebalance")
        self.candidate = b
        rid = b.release_id
        t = self.o.thresholds
        self.releases.call("transition", rid, ReleaseState.SHADOW, "serve mirrored traffic, outputs compared")
        self.stream.begin_shadow(b.generation, rid)
        self.wait(f"{t.min_shadow} shadow comparisons of {rid}", lambda s: (c := s.counts(rid)).shadow >= t.min_shadow
                  or c.shadow_mismatches > 0 or c.shadow_failures > 0)
        c = self.stream.counts(rid)
        if c.shadow_mismatches or c.shadow_failures:
            raise DrillError(f"healthy candidate {rid}: {c.shadow_mismatches} shadow mismatches, "
                             f"{c.shadow_failures} shadow failures")
        self.releases.call("begin_canary", rid, self.o.canary_fraction, f"shadow clean over {c.shadow} batches")
        self.stream.begin_canary(self.o.canary_fraction)
        self.wait(f"{t.min_canary} canary steps of {rid}", lambda s: s.counts(rid).canary >= t.min_canary
                  or s.counts(rid).failures > 0)
        results = {k: v for k, v in self.results.items() if k is not FaultKind.ACTIVE_CANDIDATE_FAULT}
        results[FaultKind.ACTIVE_CANDIDATE_FAULT] = self.rehearsal_fault
        report = FaultReport(release_id=rid, results=tuple(results[k] for k in FaultKind if k in results))
        rehearsal = next((r for r in self.rollbacks if r.purpose.startswith("rehearsal")), None)
        self.verdict = self.gate.evaluate(self.evidence(b, report, rollback_ok=rehearsal is not None and rehearsal.ok))
        self.note(rid, "gate", "promote" if self.verdict.passed else
                  "blocked: " + ", ".join(x.value for x in self.verdict.failed))

    # 9.
    def step_fault_and_rollback(self) -> None:
        assert self.initial is not None and self.candidate is not None and self.verdict is not None
        r0, b = self.initial, self.candidate
        if self.o.fault_at is FaultAt.ACTIVE:
            if not self.verdict.passed:
                raise DrillError(f"candidate {b.release_id} did not pass the gate; it cannot go ACTIVE")
            self.rt.promote(b.generation, retire_prior=False)
            self.releases.call("promote", b.release_id, self.verdict)
            self.stream.promote(b.generation, b.release_id)
            deadline = time.monotonic() + self.o.drain_timeout_s
            while self.rt.shard_refcount(r0.generation) and time.monotonic() < deadline:
                time.sleep(0.005)
            self.releases.call("transition", r0.release_id, ReleaseState.LOADED,
                               "drained to refcount 0; kept resident as rollback fallback")
            self.wait_served(b.release_id, self.o.steps, f"{self.o.steps} batches served by ACTIVE {b.release_id}")
        else:
            start = self.stream.counts(b.release_id).canary
            self.wait("canary continues after the gate", lambda s: s.counts(b.release_id).canary > start)
        detected = self.crash_and_detect(b)
        summary = self.rollback(f"fault at {self.o.fault_at.value}", b, r0, detected)
        ok, detail = self.rolled_back(summary, b, r0)
        self.record(check_fault(FaultKind.ACTIVE_CANDIDATE_FAULT,
                                SafeOutcome.ROLL_BACK_TO_PRIOR_GENERATION if ok else None, detail))

    # 10.
    def step_after(self) -> None:
        assert self.initial is not None
        self.wait_served(self.initial.release_id, self.o.steps,
                         f"{self.o.steps} batches served by {self.initial.release_id} after rollback")
        self.rt.publish_telemetry()

    # ================================================================ report
    def report(self) -> DrillReport:
        rt = self.rt
        faults = []
        for k in FaultKind:
            if k in self.results:
                faults.append(self.results[k])
            else:
                faults.append(check_fault(k, None, "not reached"))
        failures = list(self.failures)
        failures += [f"fault {r.fault.value}: expected {r.expected.value!r}, observed "
                     f"{r.observed.value if r.observed else 'nothing'}" for r in faults if not r.passed]
        if self.verdict is None or not self.verdict.passed:
            failures.append("gate: the healthy candidate did not pass" if self.verdict else "gate: not evaluated")
        if self.parity_verdict is None or self.parity_verdict.passed:
            failures.append("gate: the parity-faulted candidate was not blocked")
        failures += [f"rollback {r.purpose}: not in the 0x0EA order or not complete" for r in self.rollbacks if not r.ok]
        traffic = self.stream.summary()
        if not traffic.clean:
            failures.append(f"traffic: {traffic.mismatches} mismatches, {traffic.lost} lost, "
                            f"{traffic.served}/{traffic.submitted} served")
        gens = {str(g): s for g, s in sorted(rt.generations().items())}
        recs = {r.release_id: r.state.value for r in ray.get(rt.coordinator.release.remote("records"))}
        if self.initial is not None and recs.get(self.initial.release_id) != ReleaseState.ACTIVE.value:
            failures.append(f"final: initial release {self.initial.release_id} is "
                            f"{recs.get(self.initial.release_id)}, not ACTIVE")
        timeline = [TimelineEntry(t=float(e["t"]), source="placement",
                                  subject="-" if e["generation"] is None else f"placement-v{e['generation']}",
                                  event=str(e["event"]), detail=str(e["detail"])) for e in rt.timeline()]
        timeline += self.releases.entries() + self.notes
        timeline.sort(key=lambda e: e.t)
        return DrillReport(
            ok=not failures, failures=tuple(failures), options=self.o, deployment=rt.cfg.name,
            releases=dict(self.roles), generations={k: self.rel[v].generation for k, v in self.roles.items() if v in self.rel},
            faults=tuple(faults), gate=self.verdict, parity_gate=self.parity_verdict,
            rollbacks=tuple(self.rollbacks), traffic=traffic, timeline=tuple(timeline),
            final_generations=gens, final_releases=recs,
        )


# ============================================================================================ entry points
def drill_config(options: DrillOptions) -> RuntimeConfig:
    """The deployment a drill runs on: small, tagged weights (a wrong expert shows in the output)."""
    return RuntimeConfig(num_ranks=options.ranks, num_experts=options.num_experts, hidden_size=options.hidden_size,
                         ffn_size=options.ffn_size, top_k=options.top_k, slots_per_rank=options.slots_per_rank,
                         device=options.device, dtype="float32", seed=options.seed, name=options.name,
                         tagged_weights=True, exchange_timeout_s=20.0)


def run_drill(options: DrillOptions, *, address: str | None = None) -> DrillReport:
    """Start a deployment (joins the Ray cluster when one is reachable), run the drill, shut the deployment down."""
    from ray_moe.runtime import Runtime

    if not isinstance(options, DrillOptions):
        raise ValueError(f"options={type(options).__name__} is not DrillOptions")
    rt = Runtime.start(drill_config(options), address=address)
    try:
        return _Drill(options, rt).run()
    finally:
        rt.shutdown()


def options_from_args(args: argparse.Namespace) -> DrillOptions:
    """``ray-moe drill rollback`` / ``jobs/rollback_drill.py`` arguments -> DrillOptions (spec thresholds)."""
    name = getattr(args, "name", None) or f"rollback-drill-{uuid.uuid4().hex[:6]}"
    return DrillOptions(name=name, fault_at=FaultAt(args.fault_at), ranks=args.ranks, steps=args.steps,
                        device=args.device, all_faults=bool(args.all_faults))


def run_drill_cli(args: argparse.Namespace) -> int:
    """Run the drill, print the report (text, or one JSON object with ``--json``); 0 iff it passed."""
    report = run_drill(options_from_args(args), address=getattr(args, "address", None))
    if getattr(args, "json", False):
        print(json.dumps(report.model_dump(mode="json")))
    else:
        print(render_text(report))
    return 0 if report.ok else 1


__all__ = ["run_drill", "run_drill_cli", "drill_config", "options_from_args", "DrillOptions", "DrillReport",
           "FaultAt", "TrafficStream", "RuntimeRollbackPort", "ReleaseClient", "BatchSource", "DrillError"]
