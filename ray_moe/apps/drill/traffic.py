"""The drill's live traffic: one thread that serves, mirrors, canaries and runs fault probes (spec 0x0D, 0x0E).

Every batch has explicit routes and a float64 reference output (``reference_moe`` over tagged weights, so a
route served by the wrong expert shows in the output). A step that fails (an injected fault) is retried until
it returns; the retried output must be the reference. Shadow steps are mirrored on the candidate and compared
with the active output (never returned); canary steps are pinned to the candidate, returned and checked.
Per-release telemetry (drop and fallback ratios with their denominators, mismatch, stale-accept and
count-conservation counters) is accounted from each step's ``rt.stats()`` delta, which is exact because only
this thread steps the runtime.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping

import torch

from ray_moe.apps.drill.report import DrillError, ReleaseTraffic, TrafficSummary
from ray_moe.model.config import RuntimeConfig
from ray_moe.core.errors import CountAgreementError, RouteValidationError, StaleGenerationError, root_cause
from ray_moe.model.source import weight_source
from ray_moe.release.build import process_group_generation
from ray_moe.release.faults import SafeOutcome
from ray_moe.core.telemetry.metrics import MetricName
from ray_moe.moe.experts.reference import reference_moe
from ray_moe.core.types import Phase


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
        self._counts: dict[str, Counter[str]] = {}  # release -> ReleaseTraffic field -> count
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
            self._counts.setdefault(release, Counter())

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
            c = self._counts.get(release, Counter())
            return ReleaseTraffic(release_id=release, **c)

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
                by_release=tuple(ReleaseTraffic(release_id=k, **v) for k, v in self._counts.items()),
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
        self._counts.setdefault(release, Counter()).update(deltas)

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


__all__ = ["Batch", "BatchSource", "output_error", "shadow_close", "classify_failure", "Role", "FailureEvent",
           "Attempt", "TrafficStream"]
