"""Communication-compute overlap as a dependency schedule over tasks, streams and buffers (spec 0x09-0x09F).

Pure: no Ray, no clocks, no CUDA. A step is a DAG of ``Task`` records; each task runs on one stream
(a serialized resource: tasks of one stream never overlap) for a declared duration. Two schedules are
derived from the same DAG:

* ``schedule_serialized``: every task after the previous one, sum of durations (0x09C).
* ``schedule_overlapped``: in-order list scheduling per stream, the CUDA stream contract. A task starts
  at max(end of its dependencies, end of the previous task issued to its stream) (0x09B).

Durations here are **analytical units** (``evidence = "analytical"``): 25 -> 15 is the arithmetic of one
fixture, not a measured speedup. A GPU step can feed measured durations into the same records, but the
schedule still ignores contention for SMs, HBM, copy engines and network credits (0x09C, 0x09F).

Buffers (0x09D): a buffer is produced by one task and consumed by others; it is released when its
LAST consumer ends (the producer's launch or end is never a release fence). It is claimed either at its
producer's start (a staging buffer the producer fills in place, e.g. the pack writing the transport's
send buffer) or at its producer's completion event (a result that exists for consumers once completion
publishes it: a received segment, an expert output, the shared output, a combined segment).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from numbers import Real
from typing import Iterable, Sequence

from ray_moe.release.ledger import ANALYTICAL
from ray_moe.release.lifetimes import Buffer, BufferRole, LifetimeLedger, Operation

Interval = tuple[float, float]


class SchedulePolicy(str, Enum):
    """How a schedule was derived."""

    SERIALIZED = "serialized"  # one task at a time, in a stable topological order
    OVERLAPPED = "overlapped"  # in-order per stream, concurrent across streams
    GIVEN = "given"  # intervals supplied by the caller (validated, not derived)


class Claim(str, Enum):
    """When a buffer's lifetime opens relative to its producer (spec 0x09D)."""

    PRODUCER_START = "producer_start"  # staging filled in place: must exist while the producer writes
    PRODUCER_COMPLETION = "producer_completion"  # a result published by the producer's completion event


# ------------------------------------------------------------------------------------------------------
#  records
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One unit of work of the step DAG.

    name:   unique task name
    units:  duration (analytical units in the fixtures; >= 0, finite)
    stream: the serialized resource it runs on (tasks of one stream never overlap)
    deps:   names of the tasks whose COMPLETION it waits for (completion, not launch, owns readiness)
    """

    name: str
    units: float
    stream: str
    deps: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty task name, got {self.name!r}")
        if isinstance(self.units, bool) or not isinstance(self.units, Real) or not math.isfinite(self.units) \
                or self.units < 0:
            raise ValueError(f"{self.name}.units={self.units!r}: expected a finite duration >= 0")
        if not isinstance(self.stream, str) or not self.stream:
            raise ValueError(f"{self.name}.stream={self.stream!r}: expected a non-empty stream name")
        if isinstance(self.deps, str):
            raise ValueError(f"{self.name}.deps={self.deps!r}: expected a tuple of task names, not a string")
        object.__setattr__(self, "deps", tuple(self.deps))
        if self.name in self.deps:
            raise ValueError(f"cyclic dependency: task {self.name!r} depends on itself")


@dataclass(frozen=True)
class ScheduledTask:
    """A task placed on the half-open interval [start, end)."""

    task: Task
    start: float
    end: float

    @property
    def name(self) -> str:
        return self.task.name


def _index_tasks(tasks: Iterable[Task]) -> dict[str, Task]:
    out: dict[str, Task] = {}
    for t in tasks:
        if not isinstance(t, Task):
            raise ValueError(f"tasks: expected Task records, got {type(t).__name__}")
        if t.name in out:
            raise ValueError(f"tasks: duplicate task name {t.name!r}")
        out[t.name] = t
    for t in out.values():
        for d in t.deps:
            if d not in out:
                raise ValueError(f"missing dependency: task {t.name!r} waits for undeclared task {d!r}")
    return out


def _topological(order: Sequence[str], preds: dict[str, tuple[str, ...]], what: str) -> list[str]:
    """Stable Kahn order (ties broken by position in ``order``); ValueError naming a cycle's members."""
    pos = {n: i for i, n in enumerate(order)}
    indeg = {n: len(set(preds[n])) for n in order}
    succ: dict[str, list[str]] = {n: [] for n in order}
    for n in order:
        for p in set(preds[n]):
            succ[p].append(n)
    ready = sorted((n for n in order if indeg[n] == 0), key=pos.__getitem__)
    out: list[str] = []
    while ready:
        n = ready.pop(0)
        out.append(n)
        for s in succ[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
        ready.sort(key=pos.__getitem__)
    if len(out) != len(order):
        stuck = [n for n in order if n not in set(out)]
        raise ValueError(f"{what}: tasks {stuck} can never start")
    return out


def validate_tasks(tasks: Sequence[Task]) -> tuple[str, ...]:
    """Reject duplicate names, missing dependencies and cycles; return a stable topological order."""
    idx = _index_tasks(tasks)
    return tuple(_topological(list(idx), {n: t.deps for n, t in idx.items()}, "cyclic dependency"))


def _stream_predecessors(tasks: Sequence[Task]) -> dict[str, str | None]:
    """Previous task issued to the same stream, in the given (program) order."""
    last: dict[str, str] = {}
    out: dict[str, str | None] = {}
    for t in tasks:
        out[t.name] = last.get(t.stream)
        last[t.stream] = t.name
    return out


def union_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Merged, sorted union of half-open intervals (empty ones dropped)."""
    merged: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def intersection_measure(a: list[Interval], b: list[Interval]) -> float:
    """Total length where two sorted disjoint interval lists overlap."""
    i = j = 0
    total: float = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class Schedule:
    """Tasks placed on streams, validated on construction (spec 0x09B).

    Rejects: duplicate or missing tasks, cyclic dependencies, a duration that is not end - start,
    a task that starts before a dependency ends ("dependency violated": readiness is completion, not
    launch), and two tasks of one stream that overlap ("stream collision").
    """

    entries: tuple[ScheduledTask, ...]
    policy: SchedulePolicy = SchedulePolicy.GIVEN
    evidence: str = ANALYTICAL

    def __post_init__(self) -> None:
        entries = tuple(self.entries)
        object.__setattr__(self, "entries", entries)
        object.__setattr__(self, "policy", SchedulePolicy(self.policy))
        # 1. names, dependencies, acyclicity
        validate_tasks([e.task for e in entries])
        by = {e.name: e for e in entries}
        for e in entries:
            # 2. duration
            if e.start < 0 or not math.isclose(e.end - e.start, e.task.units, rel_tol=1e-12, abs_tol=1e-12):
                raise ValueError(f"{e.name}: interval [{e.start},{e.end}) does not match duration {e.task.units} "
                                 f"(start must be >= 0 and end - start = units)")
            # 3. dependencies complete before the task starts
            for d in e.task.deps:
                if e.start < by[d].end:
                    raise ValueError(f"dependency violated: {e.name!r} starts at {e.start} before its dependency "
                                     f"{d!r} completes at {by[d].end}")
        # 4. stream exclusion
        streams: dict[str, list[ScheduledTask]] = {}
        for e in entries:
            streams.setdefault(e.task.stream, []).append(e)
        for s, es in streams.items():
            es = sorted(es, key=lambda x: (x.start, x.end))
            for a, b in zip(es, es[1:]):
                if b.start < a.end and b.end > b.start and a.end > a.start:
                    raise ValueError(f"stream collision: {a.name!r} [{a.start},{a.end}) and {b.name!r} "
                                     f"[{b.start},{b.end}) overlap on serialized stream {s!r}")

    def __getitem__(self, name: str) -> ScheduledTask:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def interval(self, name: str) -> Interval:
        e = self[name]
        return (e.start, e.end)

    @property
    def intervals(self) -> dict[str, Interval]:
        return {e.name: (e.start, e.end) for e in self.entries}

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.entries), default=0)

    @property
    def total_units(self) -> float:
        return sum(e.task.units for e in self.entries)

    @property
    def streams(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.task.stream for e in self.entries))

    def busy(self, streams: Iterable[str]) -> list[Interval]:
        """Union of the intervals of the tasks on ``streams``, merged and sorted."""
        ss = set(streams)
        return union_intervals((e.start, e.end) for e in self.entries if e.task.stream in ss)

    def overlap_units(self, a_streams: Iterable[str], b_streams: Iterable[str]) -> float:
        """Measure of (union of a-stream intervals) intersected with (union of b-stream intervals)."""
        return intersection_measure(self.busy(a_streams), self.busy(b_streams))


# ------------------------------------------------------------------------------------------------------
#  schedulers
# ------------------------------------------------------------------------------------------------------


def schedule_serialized(tasks: Sequence[Task]) -> Schedule:
    """Every task after the previous one, in a stable topological order of the given list (0x09C).

    T_serialized = sum_i d_i.
    """
    tasks = tuple(tasks)
    idx = _index_tasks(tasks)
    order = validate_tasks(tasks)
    t: float = 0
    entries: dict[str, ScheduledTask] = {}
    for n in order:
        entries[n] = ScheduledTask(idx[n], t, t + idx[n].units)
        t = entries[n].end
    return Schedule(tuple(entries[x.name] for x in tasks), SchedulePolicy.SERIALIZED)


def schedule_overlapped(tasks: Sequence[Task]) -> Schedule:
    """In-order list scheduling per stream (0x09B, 0x09C).

    Steps:
      1. validate names, dependencies and acyclicity of the dependency DAG
      2. each task's stream predecessor is the previous task of the list on the same stream (program
         order: a stream executes its tasks in issue order, like a CUDA stream)
      3. order tasks topologically over dependency AND stream-predecessor edges; a cycle here means the
         issue order deadlocks (a task waits for one issued later to its own stream) -> ValueError
      4. s_i = max(e_j for j in deps(i), e_{stream predecessor}, 0);  e_i = s_i + d_i
    """
    tasks = tuple(tasks)
    idx = _index_tasks(tasks)
    validate_tasks(tasks)  # 1.
    spred = _stream_predecessors(tasks)  # 2.
    preds = {n: t.deps + ((spred[n],) if spred[n] else ()) for n, t in idx.items()}
    order = _topological(list(idx), preds, "stream order deadlock")  # 3.
    ends: dict[str, float] = {}
    entries: dict[str, ScheduledTask] = {}
    for n in order:  # 4.
        start = max((ends[p] for p in preds[n]), default=0)
        entries[n] = ScheduledTask(idx[n], start, start + idx[n].units)
        ends[n] = entries[n].end
    return Schedule(tuple(entries[x.name] for x in tasks), SchedulePolicy.OVERLAPPED)


@dataclass(frozen=True)
class OverlapReport:
    """Serialized vs overlapped schedules of one DAG (spec 0x09C).

    hidden_units = T_serialized - T_overlap (H_optimistic): NOT all of it is communication time, and it
    is NOT a measured speedup. compute_comm_overlap_units: measure of the intersection of the union of
    compute-stream intervals with the union of communication-stream intervals.
    """

    serialized: Schedule
    overlapped: Schedule
    compute_streams: tuple[str, ...]
    communication_streams: tuple[str, ...]
    evidence: str = ANALYTICAL

    @property
    def serialized_units(self) -> float:
        return self.serialized.makespan

    @property
    def overlapped_units(self) -> float:
        return self.overlapped.makespan

    @property
    def hidden_units(self) -> float:
        return self.serialized_units - self.overlapped_units

    @property
    def compute_comm_overlap_units(self) -> float:
        return self.overlapped.overlap_units(self.compute_streams, self.communication_streams)

    def as_dict(self) -> dict[str, object]:
        return {
            "evidence": self.evidence,
            "serialized_units": self.serialized_units,
            "overlapped_units": self.overlapped_units,
            "hidden_units": self.hidden_units,
            "compute_comm_overlap_units": self.compute_comm_overlap_units,
            "serialized": self.serialized.intervals,
            "overlapped": self.overlapped.intervals,
        }


def compare(tasks: Sequence[Task], *, compute_streams: Sequence[str] = ("compute",),
            communication_streams: Sequence[str] = ("communication",)) -> OverlapReport:
    """Both schedules of ``tasks`` and their analytical difference."""
    return OverlapReport(schedule_serialized(tasks), schedule_overlapped(tasks), tuple(compute_streams),
                         tuple(communication_streams))


# ------------------------------------------------------------------------------------------------------
#  buffers (0x09D)
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BufferUse:
    """A buffer's producer, consumers and claim point; its lifetime is derived from a schedule.

    bytes: declared size (0 when the fixture gives none)
    """

    name: str
    producer: str
    consumers: tuple[str, ...]
    claim: Claim = Claim.PRODUCER_COMPLETION
    role: BufferRole = BufferRole.OTHER
    bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty buffer name, got {self.name!r}")
        if isinstance(self.consumers, str):
            raise ValueError(f"{self.name}.consumers={self.consumers!r}: expected a tuple of task names")
        object.__setattr__(self, "consumers", tuple(self.consumers))
        if not self.consumers:
            raise ValueError(f"{self.name}.consumers: empty; a buffer without a consumer has no release point")
        object.__setattr__(self, "claim", Claim(self.claim))
        object.__setattr__(self, "role", BufferRole(self.role))


def _ancestors(schedule: Schedule) -> dict[str, set[str]]:
    by = {e.name: e.task for e in schedule.entries}
    memo: dict[str, set[str]] = {}
    for n in validate_tasks([e.task for e in schedule.entries]):  # topological: deps first
        acc: set[str] = set()
        for d in by[n].deps:
            acc.add(d)
            acc |= memo[d]
        memo[n] = acc
    return memo


def buffer_lifetimes(schedule: Schedule, uses: Sequence[BufferUse]) -> LifetimeLedger:
    """Half-open lifetimes of ``uses`` under ``schedule`` (spec 0x09D).

    Steps:
      1. producer and consumers must be scheduled tasks, and every consumer must (transitively) wait for
         the producer, else "missing dependency"
      2. start = producer start (Claim.PRODUCER_START) or producer end (Claim.PRODUCER_COMPLETION)
      3. end = max end over consumers (release at the LAST consumer's completion)
    """
    anc = _ancestors(schedule)
    out: list[Buffer] = []
    for u in uses:
        # 1.
        for n in (u.producer,) + u.consumers:
            if n not in anc:
                raise ValueError(f"{u.name}: task {n!r} is not in the schedule")
        for c in u.consumers:
            if u.producer not in anc[c]:
                raise ValueError(f"missing dependency: {c!r} consumes buffer {u.name!r} but does not wait for its "
                                 f"producer {u.producer!r}")
        prod = schedule[u.producer]
        # 2.
        start = prod.start if u.claim is Claim.PRODUCER_START else prod.end
        # 3.
        last = max(u.consumers, key=lambda c: schedule[c].end)
        out.append(Buffer(u.name, u.bytes, start, schedule[last].end, last_completion=last, role=u.role))
    return LifetimeLedger(tuple(out))


def schedule_operations(schedule: Schedule, uses: Sequence[BufferUse]) -> tuple[Operation, ...]:
    """The schedule as completion events for ``lifetime_ledger.check_release``: each task completes at its
    end, waits for its deps, writes the buffers it produces and reads the buffers it consumes."""
    writes: dict[str, list[str]] = {e.name: [] for e in schedule.entries}
    reads: dict[str, list[str]] = {e.name: [] for e in schedule.entries}
    for u in uses:
        writes[u.producer].append(u.name)
        for c in u.consumers:
            reads[c].append(u.name)
    return tuple(Operation(e.name, e.end, e.task.deps, tuple(reads[e.name]), tuple(writes[e.name]))
                 for e in schedule.entries)


# ------------------------------------------------------------------------------------------------------
#  the MoE step DAG (0x09B) for any number of route chunks
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepStreams:
    """Stream names of the MoE step (teaching streams of 0x09B by default)."""

    control: str = "control"
    pack: str = "pack"
    communication: str = "communication"
    compute: str = "compute"


def moe_step_tasks(*, route_units: float, pack_units: Sequence[float], dispatch_units: Sequence[float],
                   shared_units: float | None, expert_units: Sequence[float], combine_units: Sequence[float],
                   reduce_units: float, streams: StepStreams = StepStreams()) -> tuple[Task, ...]:
    """The MoE step as a DAG over ``n`` route chunks (peer segments, chunks or micro-batches).

    route_plan -> pack_j -> dispatch_j -> expert_j -> combine_j -> reduce;  route_plan -> shared_path
    -> reduce (omitted when ``shared_units`` is None). Issue order (= stream program order): route plan,
    packs, dispatches, shared path, experts, combines, reduce.
    """
    n = len(pack_units)
    for name, seq in (("dispatch_units", dispatch_units), ("expert_units", expert_units),
                      ("combine_units", combine_units)):
        if len(seq) != n:
            raise ValueError(f"{name}: {len(seq)} entries for {n} chunks (pack_units has {n})")
    if n == 0:
        raise ValueError("pack_units: at least one route chunk is required")
    tasks = [Task("route_plan", route_units, streams.control)]
    tasks += [Task(f"pack_{j}", pack_units[j], streams.pack, ("route_plan",)) for j in range(n)]
    tasks += [Task(f"dispatch_{j}", dispatch_units[j], streams.communication, (f"pack_{j}",)) for j in range(n)]
    if shared_units is not None:
        tasks.append(Task("shared_path", shared_units, streams.compute, ("route_plan",)))
    tasks += [Task(f"expert_{j}", expert_units[j], streams.compute, (f"dispatch_{j}",)) for j in range(n)]
    tasks += [Task(f"combine_{j}", combine_units[j], streams.communication, (f"expert_{j}",)) for j in range(n)]
    reduce_deps = tuple(f"combine_{j}" for j in range(n)) + (("shared_path",) if shared_units is not None else ())
    tasks.append(Task("reduce", reduce_units, streams.compute, reduce_deps))
    return tuple(tasks)


def moe_step_buffers(num_chunks: int, *, shared: bool = True) -> tuple[BufferUse, ...]:
    """The buffers of ``moe_step_tasks`` (0x09D): send_j (staging filled by pack_j, read by dispatch_j),
    receive_j, expert_out_j, shared_out, combined_j (results published by their producer's completion)."""
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks!r}: expected an integer >= 1")
    out: list[BufferUse] = []
    for j in range(num_chunks):
        out.append(BufferUse(f"send_{j}", f"pack_{j}", (f"dispatch_{j}",), Claim.PRODUCER_START, BufferRole.SEND))
    for j in range(num_chunks):
        out.append(BufferUse(f"receive_{j}", f"dispatch_{j}", (f"expert_{j}",), role=BufferRole.RECEIVE))
    for j in range(num_chunks):
        out.append(BufferUse(f"expert_out_{j}", f"expert_{j}", (f"combine_{j}",), role=BufferRole.EXPERT))
    if shared:
        out.append(BufferUse("shared_out", "shared_path", ("reduce",), role=BufferRole.OUTPUT))
    for j in range(num_chunks):
        out.append(BufferUse(f"combined_{j}", f"combine_{j}", ("reduce",), role=BufferRole.RETURN))
    return tuple(out)
