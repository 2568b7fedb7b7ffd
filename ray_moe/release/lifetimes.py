"""Half-open buffer lifetimes and safe release as a last-reader property (spec 0x03D3-0x03D5). Pure: no
Ray, no clocks. Live bytes are computed from declared buffers, never measured
(``ray_moe.release.ledger``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from numbers import Real
from typing import Sequence

from ray_moe.release.ledger import ANALYTICAL, LedgerRecord, positive_int


# ------------------------------------------------------------------------------------------------------
#  0x03D3 half-open buffer lifetimes
# ------------------------------------------------------------------------------------------------------


class BufferRole(str, Enum):
    """What a buffer holds; names the failure class of an early release (spec 0x03D5)."""

    INPUT = "input"
    HANDLE = "handle"
    CONTROL = "control"
    SEND = "send"
    RECEIVE = "receive"
    EXPERT = "expert"
    RETURN = "return"
    OUTPUT = "output"
    OTHER = "buffer"


@dataclass(frozen=True)
class Buffer(LedgerRecord):
    """One declared allocation live on the half-open interval [start, end) (spec 0x03D3).

    end == start is an empty lifetime (released where it was claimed); ``check_release`` then names the
    reader it would betray.

    alias_group: buffers of one group may reuse one allocation only if their lifetimes are disjoint.
    last_completion: name of the operation whose completion the release waits for ("" = undeclared).
    """

    name: str
    bytes: int
    start: float
    end: float
    alias_group: str | None = None
    last_completion: str = ""
    role: BufferRole = BufferRole.OTHER

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty buffer name, got {self.name!r}")
        positive_int(f"{self.name}.bytes", self.bytes, allow_zero=True)
        for attr in ("start", "end"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v):
                raise ValueError(f"{self.name}.{attr}={v!r}: expected a finite epoch")
        if self.end < self.start:
            raise ValueError(f"{self.name}.end={self.end}: must be >= start={self.start} (half-open [start, end))")
        object.__setattr__(self, "role", BufferRole(self.role))

    def live_at(self, tau: float) -> bool:
        return self.start <= tau < self.end

    def overlaps(self, other: "Buffer") -> bool:
        return self.start < other.end and other.start < self.end


@dataclass(frozen=True)
class LifetimeLedger(LedgerRecord):
    """Live allocation bytes of declared buffers (spec 0x03D3).

    M_live(tau) = sum_i B_i [a_i <= tau < z_i];  peak = max_tau M_live(tau), argmax = earliest epoch.
    ``total_bytes`` adds every declared allocation. Raises ValueError on duplicate names and on two
    buffers of one alias group that are live at the same time (naming both).
    """

    buffers: tuple[Buffer, ...]
    evidence: str = ANALYTICAL
    _DERIVED = ("total_bytes", "peak_bytes", "peak_epoch")

    def __post_init__(self) -> None:
        bufs = tuple(self.buffers)
        object.__setattr__(self, "buffers", bufs)
        # 1. unique names
        seen: set[str] = set()
        for b in bufs:
            if not isinstance(b, Buffer):
                raise ValueError(f"buffers: expected Buffer records, got {type(b).__name__}")
            if b.name in seen:
                raise ValueError(f"buffers: duplicate buffer name {b.name!r}")
            seen.add(b.name)
        # 2. alias rule: members of one group must have disjoint lifetimes
        for i, a in enumerate(bufs):
            if a.alias_group is None:
                continue
            for b in bufs[i + 1:]:
                if b.alias_group == a.alias_group and a.overlaps(b):
                    raise ValueError(
                        f"overlapping live alias: buffers {a.name!r} [{a.start},{a.end}) and {b.name!r} "
                        f"[{b.start},{b.end}) share alias group {a.alias_group!r} while both are live"
                    )

    def __getitem__(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def live_bytes(self, tau: float) -> int:
        """M_live(tau)."""
        return sum(b.bytes for b in self.buffers if b.live_at(tau))

    def live_names(self, tau: float) -> tuple[str, ...]:
        return tuple(b.name for b in self.buffers if b.live_at(tau))

    @property
    def epochs(self) -> tuple[float, ...]:
        """Breakpoints where M_live can change (every start and end), sorted."""
        return tuple(sorted({b.start for b in self.buffers} | {b.end for b in self.buffers}))

    def profile(self) -> tuple[tuple[float, int], ...]:
        """(epoch, M_live) at every breakpoint; M_live is constant until the next one."""
        return tuple((t, self.live_bytes(t)) for t in self.epochs)

    @property
    def total_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)

    @property
    def peak(self) -> tuple[int, float | None]:
        """(peak bytes, earliest epoch reaching it). M_live is right-continuous and piecewise constant,
        so the maximum is attained at some buffer start."""
        best, at = 0, None
        for t in sorted({b.start for b in self.buffers}):
            m = self.live_bytes(t)
            if m > best:
                best, at = m, t
        return best, at

    @property
    def peak_bytes(self) -> int:
        return self.peak[0]

    @property
    def peak_epoch(self) -> float | None:
        return self.peak[1]


# ------------------------------------------------------------------------------------------------------
#  0x03D5 safe release is a last-reader property
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Operation(LedgerRecord):
    """One completion event of the step's event graph (spec 0x03D4, 0x03D5).

    completes: epoch at which the operation is complete (its completion event fires)
    deps:      operations it waits for (events it consumes)
    reads:     buffers it may still read until ``completes``
    writes:    buffers whose contents it produces
    """

    name: str
    completes: float
    deps: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty operation name, got {self.name!r}")
        if isinstance(self.completes, bool) or not isinstance(self.completes, Real):
            raise ValueError(f"{self.name}.completes={self.completes!r}: expected an epoch")
        for attr in ("deps", "reads", "writes"):
            v = getattr(self, attr)
            if isinstance(v, str):
                raise ValueError(f"{self.name}.{attr}={v!r}: expected a tuple of names, not a string")
            object.__setattr__(self, attr, tuple(v))


def _find_cycle(graph: dict[str, tuple[str, ...]]) -> list[str] | None:
    """A cycle of ``graph`` (node -> predecessors) as a node list, or None. Iterative DFS."""
    white, grey, black = 0, 1, 2
    color = {n: white for n in graph}
    for root in graph:
        if color[root] != white:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = [root]
        color[root] = grey
        while stack:
            node, i = stack[-1]
            preds = graph[node]
            if i < len(preds):
                stack[-1] = (node, i + 1)
                nxt = preds[i]
                if color[nxt] == grey:
                    return path[path.index(nxt):] + [nxt]
                if color[nxt] == white:
                    color[nxt] = grey
                    stack.append((nxt, 0))
                    path.append(nxt)
            else:
                color[node] = black
                stack.pop()
                path.pop()
    return None


def _ancestors(graph: dict[str, tuple[str, ...]]) -> dict[str, frozenset[str]]:
    """Transitive predecessors of every node of an acyclic graph."""
    memo: dict[str, frozenset[str]] = {}

    def visit(n: str) -> frozenset[str]:
        if n not in memo:
            acc: set[str] = set()
            for d in graph[n]:
                acc.add(d)
                acc |= visit(d)
            memo[n] = frozenset(acc)
        return memo[n]

    for n in graph:
        visit(n)
    return memo


@dataclass(frozen=True)
class ReleaseReport(LedgerRecord):
    """Result of a passing ``check_release``: the last reader and its epoch for every buffer."""

    last_reader: tuple[tuple[str, str, float], ...]  # (buffer, operation, completion epoch)
    lifetimes: LifetimeLedger
    evidence: str = ANALYTICAL


def check_release(buffers: Sequence[Buffer], operations: Sequence[Operation]) -> ReleaseReport:
    """Check that every buffer outlives its last reader and that the event graph is sound (spec 0x03D5).

    Steps (each failure is a ValueError with a distinct message prefix):
      1. lifetimes: unique buffer names, no two live buffers of one alias group
         -> "overlapping live alias"
      2. every dependency names a declared operation; every read/write names a declared buffer; every
         ``last_completion`` names a declared operation -> "missing dependency" / "unknown buffer"
      3. the dependency graph is acyclic -> "cyclic event graph"
      4. no operation completes before one of its dependencies -> "epoch before dependency"
      5. every reader of a buffer waits (transitively) for every writer of it -> "missing dependency"
      6. a written buffer is allocated no later than its writer completes -> "write before allocation"
      7. z_U >= max completion over readers and the declared last completion
         -> "early <role> release" (e.g. "early send release", "early handle release")
    """
    ledger = LifetimeLedger(tuple(buffers))  # 1.
    ops = tuple(operations)
    by_name: dict[str, Operation] = {}
    for o in ops:
        if o.name in by_name:
            raise ValueError(f"operations: duplicate operation name {o.name!r}")
        by_name[o.name] = o
    names = {b.name for b in ledger.buffers}
    # 2. references
    for o in ops:
        for d in o.deps:
            if d not in by_name:
                raise ValueError(f"missing dependency: operation {o.name!r} waits for undeclared operation {d!r}")
        for attr in ("reads", "writes"):
            for b in getattr(o, attr):
                if b not in names:
                    raise ValueError(f"unknown buffer: {o.name}.{attr} names undeclared buffer {b!r}")
    for b in ledger.buffers:
        if b.last_completion and b.last_completion not in by_name:
            raise ValueError(f"missing dependency: buffer {b.name!r} is released after undeclared operation "
                             f"{b.last_completion!r}")
    # 3. acyclic
    graph = {o.name: o.deps for o in ops}
    cycle = _find_cycle(graph)
    if cycle is not None:
        raise ValueError(f"cyclic event graph: {' -> '.join(reversed(cycle))}")
    # 4. completion epochs respect dependencies
    for o in ops:
        for d in o.deps:
            if o.completes < by_name[d].completes:
                raise ValueError(f"epoch before dependency: operation {o.name!r} completes at epoch {o.completes} "
                                 f"before its dependency {d!r} completes at epoch {by_name[d].completes}")
    # 5. readers are ordered after writers
    anc = _ancestors(graph)
    writers: dict[str, list[str]] = {n: [] for n in names}
    readers: dict[str, list[str]] = {n: [] for n in names}
    for o in ops:
        for b in o.writes:
            writers[b].append(o.name)
        for b in o.reads:
            readers[b].append(o.name)
    for b in ledger.buffers:
        for r in readers[b.name]:
            for w in writers[b.name]:
                if r != w and w not in anc[r]:
                    raise ValueError(f"missing dependency: operation {r!r} reads buffer {b.name!r} written by "
                                     f"{w!r} without waiting for {w!r}")
    # 6. a writer's result must be allocated no later than the writer's completion publishes it
    for b in ledger.buffers:
        for w in writers[b.name]:
            if b.start > by_name[w].completes:
                raise ValueError(f"write before allocation: operation {w!r} completes at epoch "
                                 f"{by_name[w].completes} but buffer {b.name!r} is allocated at {b.start}")
    # 7. last-reader release
    out: list[tuple[str, str, float]] = []
    for b in ledger.buffers:
        waiters = list(readers[b.name]) + ([b.last_completion] if b.last_completion else [])
        if not waiters:
            continue
        last = max(waiters, key=lambda n: by_name[n].completes)
        tau = by_name[last].completes
        if b.end < tau:
            raise ValueError(f"early {b.role.value} release: buffer {b.name!r} is released at epoch {b.end} but "
                             f"{last!r} may read it until epoch {tau}")
        out.append((b.name, last, tau))
    return ReleaseReport(last_reader=tuple(out), lifetimes=ledger)
