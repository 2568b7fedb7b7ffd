"""Streams, events and the measured timeline of the overlapped MoE layer (spec 0x03D4, 0x03D5, 0x09B-0x09F).

* ``StreamSet``: the five streams of one overlapped step (CUDA streams; all ``None`` on CPU, where the same
  code runs serially in issue order);
* ``Recorder``: issues each task on its stream after the completion events of its dependencies and records
  its completion event (CUDA) or host times (CPU);
* ``OverlapResult``: one rank's step (output, executed tasks, agreed per-chunk counts) whose ``timeline()``
  turns the executed DAG into an ``overlap_schedule.Schedule`` in MEASURED milliseconds, validated against
  dependencies, stream exclusion and last-reader buffer release (``lifetime_ledger.check_release``).

The step itself is ``ray_moe_dev.analysis.overlapped_layer``. Pure: no Ray.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from ray_moe.release.lifetimes import Buffer, BufferRole, ReleaseReport, check_release
from ray_moe.release.schedule import (
    BufferUse,
    Claim,
    Schedule,
    ScheduledTask,
    SchedulePolicy,
    Task,
    buffer_lifetimes,
    intersection_measure,
    schedule_operations,
    union_intervals,
)

MEASURED = "measured"
ROLES = ("compute", "communication", "expert", "shared", "output")
SERIAL = "serial"


# ------------------------------------------------------------------------------------------------------
#  records
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StreamSet:
    """The streams of one overlapped step (``torch.cuda.Stream`` on CUDA, all ``None`` on CPU).

    compute: route plan and packs;  comm: control round, dispatches, returns (every NCCL call);
    expert: repack + grouped experts;  shared: the shared expert;  output: scatter-adds and the reduce.
    ``serial``: every role is one stream (the serialized baseline); tasks are then labelled ``"serial"``.
    Build once with ``StreamSet.for_device`` and pass it to every step (streams are reusable).
    """

    compute: Any = None
    comm: Any = None
    expert: Any = None
    shared: Any = None
    output: Any = None
    serial: bool = False

    def __post_init__(self) -> None:
        streams = [self.compute, self.comm, self.expert, self.shared, self.output]
        present = [s is not None for s in streams]
        if any(present) and not all(present):
            missing = [r for r, p in zip(ROLES, present) if not p]
            raise ValueError(f"streams: roles {missing} have no stream; give a stream for every role or none (CPU)")
        if not isinstance(self.serial, bool):
            raise ValueError(f"serial={self.serial!r}: expected a bool")
        if self.serial and any(present) and any(s != self.compute for s in streams):
            raise ValueError("serial=True: every role must use the same stream")

    @staticmethod
    def for_device(device: torch.device | str, *, serialized: bool = False) -> "StreamSet":
        """Fresh streams on a CUDA ``device`` (the communication stream at high priority); on CPU all None.

        ``serialized``: every role uses the device's current stream (the baseline)."""
        device = torch.device(device)
        if device.type != "cuda":
            return StreamSet(serial=serialized)
        if serialized:
            s = torch.cuda.current_stream(device)
            return StreamSet(s, s, s, s, s, serial=True)
        return StreamSet(
            compute=torch.cuda.Stream(device=device),
            comm=torch.cuda.Stream(device=device, priority=-1),  # lower number = higher priority (clamped)
            expert=torch.cuda.Stream(device=device),
            shared=torch.cuda.Stream(device=device),
            output=torch.cuda.Stream(device=device),
        )

    @property
    def on_cuda(self) -> bool:
        return self.compute is not None

    def stream(self, role: str) -> Any:
        return {"compute": self.compute, "communication": self.comm, "expert": self.expert,
                "shared": self.shared, "output": self.output}[role]

    def label(self, role: str) -> str:
        return SERIAL if self.serial else role


@dataclass(frozen=True)
class ExecutedTask:
    """One task as it was issued (issue order = stream program order).

    stream: the stream label (a role name, or ``"serial"``); deps: tasks whose COMPLETION it waited for;
    kind: ``"communication"`` or ``"compute"``; rows: rows it moved or computed (for reading a timeline).
    """

    name: str
    stream: str
    deps: tuple[str, ...]
    kind: str
    rows: int


@dataclass(frozen=True)
class MeasuredTimeline:
    """The executed DAG of one step in MEASURED milliseconds since the step's entry event (0x09C, measured).

    schedule:  validated ``Schedule`` (dependencies complete before a task starts; one stream's tasks do
               not overlap); ``evidence = "measured"``
    release:   ``check_release`` of the step's buffers, released when the step's references drop (after the
               final event), against their last reader
    compute_ms / communication_ms: measure of the union of compute-task / communication-task intervals
    overlap_ms: measure of their intersection (compute and communication in flight together)
    task_sum_ms: sum of task durations; ``makespan_ms``: latest task end. ``task_sum_ms - makespan_ms`` is
               NOT a speedup (concurrent tasks slow each other, 0x09C, 0x09F)
    """

    schedule: Schedule
    release: ReleaseReport
    makespan_ms: float
    task_sum_ms: float
    compute_ms: float
    communication_ms: float
    overlap_ms: float
    stream_busy_ms: tuple[tuple[str, float], ...]
    tasks: tuple[ExecutedTask, ...]
    evidence: str = MEASURED

    def as_dict(self) -> dict[str, Any]:
        return {
            "evidence": self.evidence,
            "unit": "ms",
            "makespan_ms": self.makespan_ms,
            "task_sum_ms": self.task_sum_ms,
            "compute_ms": self.compute_ms,
            "communication_ms": self.communication_ms,
            "compute_comm_overlap_ms": self.overlap_ms,
            "stream_busy_ms": dict(self.stream_busy_ms),
            "tasks": [
                {"name": t.name, "stream": t.stream, "kind": t.kind, "rows": t.rows, "deps": list(t.deps),
                 "start_ms": self.schedule[t.name].start, "end_ms": self.schedule[t.name].end}
                for t in self.tasks
            ],
        }


@dataclass(frozen=True, eq=False)
class OverlapResult:
    """One rank's overlapped step.

    hidden:          [T, d] ``out_dtype`` combined output (+ shared expert) of this rank's tokens
    tasks:           executed tasks in issue order
    chunk_bounds:    n+1 token bounds; chunk c holds tokens [chunk_bounds[c], chunk_bounds[c+1])
    count_matrices:  [n, P, P] int64 (CPU) C_c[p, u] over global ranks, agreed in the control round
    expert_counts:   per chunk, rows per local slot of this rank
    marks:           task -> (start, end): CUDA events (start None unless ``timed``) or host seconds
    origin / final:  the step's entry mark and the final (reduce) completion event (None on CPU)
    """

    hidden: torch.Tensor
    tasks: tuple[ExecutedTask, ...]
    chunk_bounds: tuple[int, ...]
    count_matrices: torch.Tensor
    expert_counts: tuple[tuple[int, ...], ...]
    serialized: bool
    comm_order: str
    timed: bool
    marks: Mapping[str, tuple[Any, Any]] = field(repr=False)
    origin: Any = field(repr=False)
    final: Any = field(repr=False)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_bounds) - 1

    def dag(self) -> tuple[Task, ...]:
        """The executed DAG as ``overlap_schedule.Task`` records with measured durations (ms)."""
        return tuple(e.task for e in self.timeline().schedule.entries)

    def timeline(self) -> MeasuredTimeline:
        """Measured intervals of every task, validated (raises ValueError on a violated dependency, a
        stream collision or an early buffer release). On CUDA this waits for the step's final event and
        needs ``timed=True``."""
        # 1. task intervals in ms since the entry mark
        if self.final is not None:
            if not self.timed:
                raise ValueError("timed=False: this CUDA step recorded no timing events; run it with timed=True")
            self.final.synchronize()
            iv = {n: (self.origin.elapsed_time(s), self.origin.elapsed_time(e)) for n, (s, e) in self.marks.items()}
        else:
            iv = {n: ((s - self.origin) * 1e3, (e - self.origin) * 1e3) for n, (s, e) in self.marks.items()}
        # 2. the Schedule validates dependencies and stream exclusion
        entries = tuple(
            ScheduledTask(Task(t.name, iv[t.name][1] - iv[t.name][0], t.stream, t.deps), iv[t.name][0], iv[t.name][1])
            for t in self.tasks
        )
        schedule = Schedule(entries, SchedulePolicy.GIVEN, evidence=MEASURED)
        # 3. buffers: claimed by their producer, released when the step drops its references (the final event)
        uses = step_buffers(self.num_chunks, shared=any(t.name == "shared_path" for t in self.tasks))
        lifetimes = buffer_lifetimes(schedule, uses)
        release_at = schedule["reduce"].end
        held = tuple(Buffer(b.name, b.bytes, b.start, max(b.end, release_at), last_completion=b.last_completion,
                            role=b.role) for b in lifetimes.buffers)
        release = check_release(held, schedule_operations(schedule, uses))
        # 4. busy unions and their intersection
        comp = union_intervals(iv[t.name] for t in self.tasks if t.kind == "compute")
        comm = union_intervals(iv[t.name] for t in self.tasks if t.kind == "communication")
        labels = dict.fromkeys(t.stream for t in self.tasks)
        busy = tuple((s, _measure(union_intervals(iv[t.name] for t in self.tasks if t.stream == s))) for s in labels)
        return MeasuredTimeline(
            schedule=schedule, release=release, makespan_ms=schedule.makespan,
            task_sum_ms=sum(e - s for s, e in iv.values()), compute_ms=_measure(comp),
            communication_ms=_measure(comm), overlap_ms=intersection_measure(comp, comm), stream_busy_ms=busy,
            tasks=self.tasks,
        )


def step_buffers(num_chunks: int, *, shared: bool) -> tuple[BufferUse, ...]:
    """The buffers of the executed DAG (0x09D): send_c (filled by pack_c, read by dispatch_c), receive_c
    (dispatch_c -> expert_c), expert_out_c (expert_c -> combine_c, the return payload), returned_c
    (combine_c -> scatter_c), shared_out (shared_path -> reduce)."""
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks!r}: expected an integer >= 1")
    out: list[BufferUse] = []
    for c in range(num_chunks):
        out.append(BufferUse(f"send_{c}", f"pack_{c}", (f"dispatch_{c}",), Claim.PRODUCER_START, BufferRole.SEND))
        out.append(BufferUse(f"receive_{c}", f"dispatch_{c}", (f"expert_{c}",), role=BufferRole.RECEIVE))
        out.append(BufferUse(f"expert_out_{c}", f"expert_{c}", (f"combine_{c}",), role=BufferRole.EXPERT))
        out.append(BufferUse(f"returned_{c}", f"combine_{c}", (f"scatter_{c}",), role=BufferRole.RETURN))
    if shared:
        out.append(BufferUse("shared_out", "shared_path", ("reduce",), role=BufferRole.OUTPUT))
    return tuple(out)


def resolve_streams(streams: StreamSet | None, dev: torch.device, serialized: bool) -> StreamSet:
    """The ``StreamSet`` a step on device ``dev`` runs on: ``streams`` checked against ``dev``, or fresh
    streams (the device's current stream for every role when ``serialized``). ValueError on a mismatch."""
    if streams is not None and not isinstance(streams, StreamSet):
        raise ValueError(f"streams: expected a StreamSet, got {type(streams).__name__}")
    if serialized:
        if streams is not None and not streams.serial:
            raise ValueError("streams: serialized=True needs streams=None or a serial StreamSet")
        streams = streams or StreamSet.for_device(dev, serialized=True)
    elif streams is None:
        streams = StreamSet.for_device(dev)
    if dev.type == "cuda":
        if not streams.on_cuda:
            raise ValueError(f"streams: hidden is on {dev} but the StreamSet holds no CUDA stream")
        for role in ROLES:
            s = streams.stream(role)
            if s.device != dev:
                raise ValueError(f"streams.{role}: on {s.device}, hidden is on {dev}")
    elif streams.on_cuda:
        raise ValueError(f"streams: CUDA streams given but hidden is on {dev}")
    return streams


# ------------------------------------------------------------------------------------------------------
#  events and timing
# ------------------------------------------------------------------------------------------------------


class Recorder:
    """Issues tasks on their streams and records their completion events (CUDA) or host times (CPU).

    One per step; nothing is shared between steps. On CUDA every stream first waits for the entry event
    recorded on the caller's stream (the inputs are ready there), a task's stream waits for the
    completion event of every dependency issued on another stream, and the caller's stream finally waits
    for the reduce's completion event.
    """

    def __init__(self, streams: StreamSet, device: torch.device, timed: bool) -> None:
        self.streams = streams
        self.cuda = streams.on_cuda
        self.timed = timed
        self.tasks: list[ExecutedTask] = []
        self.ends: dict[str, Any] = {}
        self.marks: dict[str, tuple[Any, Any]] = {}
        self.stream_of: dict[str, Any] = {}
        if self.cuda:
            self.caller = torch.cuda.current_stream(device)
            self.origin = self._event(self.caller, timing=timed)
            waited: list[Any] = []
            for role in ROLES:
                s = streams.stream(role)
                if s != self.caller and all(s != w for w in waited):
                    s.wait_event(self.origin)
                    waited.append(s)
        else:
            self.caller = None
            self.origin = time.perf_counter()

    @staticmethod
    def _event(stream: Any, *, timing: bool) -> Any:
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(stream)
        return ev

    @contextlib.contextmanager
    def task(self, name: str, role: str, deps: tuple[str, ...], *, rows: int) -> Iterator[None]:
        """Run the body as task ``name`` on ``role``'s stream after ``deps`` complete."""
        stream = self.streams.stream(role)
        if self.cuda:
            # 1. wait for the completion (not the launch) of every dependency on another stream
            for d in deps:
                if self.stream_of[d] != stream:
                    stream.wait_event(self.ends[d])
            start = self._event(stream, timing=True) if self.timed else None
            with torch.cuda.stream(stream):
                yield
            end = self._event(stream, timing=self.timed)
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        kind = "communication" if role == "communication" else "compute"
        self.ends[name] = end
        self.marks[name] = (start, end)
        self.stream_of[name] = stream
        self.tasks.append(ExecutedTask(name, self.streams.label(role), tuple(deps), kind, int(rows)))

    def start_copy(self, t: torch.Tensor) -> torch.Tensor:
        """Queue the host copy of a small device vector on the current task's stream (pinned memory,
        non-blocking on CUDA); read it with ``finish_copy`` after that task's completion event."""
        if not self.cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def finish_copy(self, host: torch.Tensor, task: str) -> np.ndarray:
        """Wait (host) for ``task``'s completion event only, not for work queued behind it; -> numpy copy."""
        if self.cuda:
            self.ends[task].synchronize()
        return host.numpy().copy()

    def finish(self, out: torch.Tensor) -> Any:
        """The caller's stream waits for the reduce; ``out`` is handed to the caller's stream."""
        if not self.cuda:
            return None
        final = self.ends["reduce"]
        if self.streams.output != self.caller:
            self.caller.wait_event(final)
            out.record_stream(self.caller)
        return final


# ------------------------------------------------------------------------------------------------------
#  interval arithmetic
# ------------------------------------------------------------------------------------------------------


def _measure(intervals: Sequence[tuple[float, float]]) -> float:
    return float(sum(e - s for s, e in intervals))


