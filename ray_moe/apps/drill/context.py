"""What every part of a running drill shares: the runtime, the release client, the live stream, and the
records the report is assembled from (timeline notes, fault results, rollbacks, releases by role)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ray_moe.apps.drill.progress import Progress
from ray_moe.apps.drill.report import DrillOptions, RollbackSummary, TimelineEntry
from ray_moe.apps.drill.traffic import BatchSource, TrafficStream
from ray_moe.apps.release_client import ReleaseClient, ShardFault
from ray_moe.release.build import ScheduleCheck, process_group_generation
from ray_moe.release.bundle import ReleaseBundle
from ray_moe.release.faults import FaultKind, FaultResult
from ray_moe.release.gate import GateVerdict, PromotionGate


class StampedReleaseClient(ReleaseClient):
    """The release client, with each lifecycle event stamped with the driver's clock when it first saw it
    (after the registry call that made it), so the drill's timeline interleaves them with its own notes."""

    def __init__(self, coordinator: Any, clock: Callable[[], float] = time.time) -> None:
        super().__init__(coordinator)
        self._clock = clock
        self._stamps: dict[int, float] = {}
        self._events: dict[int, Any] = {}

    def _written(self) -> None:
        self._stamp()

    def _stamp(self) -> None:
        now = self._clock()
        for e in self.release_timeline():
            if e.seq not in self._stamps:
                self._stamps[e.seq] = now
                self._events[e.seq] = e

    def entries(self) -> list[TimelineEntry]:
        """Every lifecycle event seen so far, as timeline entries (``source="release"``), in registry order."""
        self._stamp()
        out = []
        for seq in sorted(self._events):
            e = self._events[seq]
            event = e.to_state.value if e.from_state is None else f"{e.from_state.value}->{e.to_state.value}"
            out.append(TimelineEntry(t=self._stamps[seq], source="release", subject=e.release_id,
                                     event=event, detail=e.reason))
        return out


@dataclass
class DrillRelease:
    """A release this drill registered: its bundle, the reports it binds and its placement generation."""

    bundle: ReleaseBundle
    reports: tuple[dict[str, Any], ...]
    generation: int

    @property
    def release_id(self) -> str:
        return self.bundle.release_id


class DrillContext:
    """State of one drill run. Only the main thread changes it; the traffic thread owns ``stream``'s counters."""

    def __init__(self, options: DrillOptions, rt: Any, *, progress: Progress | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.o = options
        self.rt = rt
        self.clock = clock
        self.progress = progress or Progress.silent()
        self.client = StampedReleaseClient(rt.coordinator, clock)
        self.stream = TrafficStream(rt, BatchSource(rt.cfg, options.seed), seed=options.seed,
                                    retry_deadline_s=options.retry_deadline_s, clock=clock)
        self.gate = PromotionGate(options.thresholds)
        self.notes: list[TimelineEntry] = []
        self.results: dict[FaultKind, FaultResult] = {}
        self.rollbacks: list[RollbackSummary] = []
        self.rel: dict[str, DrillRelease] = {}
        self.roles: dict[str, str] = {}
        self.failures: list[str] = []
        self.schedule: ScheduleCheck | None = None
        self.verdict: GateVerdict | None = None
        self.parity_verdict: GateVerdict | None = None
        self.rehearsal_fault: FaultResult | None = None
        self.initial: DrillRelease | None = None
        self.candidate: DrillRelease | None = None
        self.stale_generation: int | None = None
        self._armed: dict[int, set[tuple[ShardFault, int]]] = {}  # generation -> (kind, rank) armed for it
        n = options.num_experts
        self.hot = 1 % n
        self.parity_expert = n - 1
        self.rehearsal_expert = n - 2 if n - 2 != self.hot else n - 3

    # ---------------------------------------------------------------- records
    def note(self, subject: str, event: str, detail: str = "") -> None:
        self.notes.append(TimelineEntry(t=self.clock(), source="drill", subject=subject, event=event, detail=detail))

    def record(self, result: FaultResult) -> None:
        """A fault's result: into the report, the timeline and one progress line."""
        self.results[result.fault] = result
        observed = result.observed.value if result.observed else "nothing"
        self.note(result.fault.value, "fault-" + ("safe" if result.passed else "UNSAFE"), f"observed {observed}")
        number = list(FaultKind).index(result.fault) + 1
        self.progress(f"fault {number} {result.fault.value}: {observed} "
                      + ("(ok)" if result.passed else f"(FAILED: expected {result.expected.value})"))

    def register(self, role: str, rel: DrillRelease) -> None:
        self.rel[rel.release_id] = rel
        self.roles[role] = rel.release_id

    # ---------------------------------------------------------------- the deployment
    def fault_ranks(self) -> list[int]:
        ranks = list(self.rt.group.peer_order)
        return ranks if self.o.all_faults else [ranks[1 % len(ranks)]]

    def live_pg(self) -> str:
        return process_group_generation(self.rt.group.group_id, self.rt.group.epoch)

    def arm(self, kind: ShardFault, rank: int, count: int, generation: int) -> None:
        """Arm a shard fault for ``generation``; persistent ones are disarmed at that generation's stop fence."""
        self.client.inject_fault(kind, rank=rank, count=count, generation=generation)
        self._armed.setdefault(generation, set()).add((kind, rank))

    def disarm(self, generation: int) -> None:
        """Clear every fault still armed for ``generation`` (its stop fence completed: nothing may serve it).

        A shard checks an armed crash before it acts on a step's stale status, so a driver whose cached active
        generation is the fenced one would keep failing instead of being refused and replanning."""
        for kind, rank in sorted(self._armed.pop(generation, set())):
            self.client.inject_fault(kind, rank=rank, count=0, generation=generation)  # logged as "x0"
            self.note(f"placement-v{generation}", "fault-disarmed", f"{kind.value} on rank {rank}: stop fence done")

    # ---------------------------------------------------------------- waiting on the stream
    def wait(self, what: str, predicate: Callable[[TrafficStream], bool]) -> None:
        self.stream.wait_for(what, predicate, self.o.wait_timeout_s)

    def wait_served(self, release: str | None, n: int, what: str) -> None:
        if release is None:
            start = self.stream.served
            self.wait(what, lambda s: s.served >= start + n)
            return
        start = self.stream.counts(release).served
        self.wait(what, lambda s: s.counts(release).served >= start + n)


__all__ = ["DrillContext", "DrillRelease", "StampedReleaseClient"]
