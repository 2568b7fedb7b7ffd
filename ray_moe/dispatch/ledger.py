"""Analytical row, byte and lifetime ledgers of one dispatch/combine step (spec 0x03C1, 0x03D-0x03D6,
0x0AB, 0x0AD). Pure: no Ray, no clocks.

Every ledger here is **analytical**: representation-level row slots, logical bytes and live-allocation
bytes COMPUTED from a count matrix, widths, dtypes and buffer declarations. None of them is a measured
fabric/HBM byte count and none is latency (spec 0x03D: five ledgers stay distinct; the last two are
deliberately unclaimed here). Each record carries ``evidence = "analytical"`` so a report can never
present it as a measurement.

Inputs
------
count matrix ``C``: [P, P] int, ``C[p, u]`` = routes from source rank p to destination rank u over
*global* ranks; the diagonal holds local (same-rank) routes, which stay in the staging layout but do not
traverse a link under the local-bypass policy (0x03D1).

Ledgers
-------
=========================  =========  =====================================================
record                     spec       question answered
=========================  =========  =====================================================
``RowSlotLedger``          0x03C1     useful all-to-all-v row slots vs uniform padded slots
``PayloadLedger``          0x03D1     staging payload vs remote row payload (bytes)
``TransportLedger``        0x03D2     transport metadata, handle state, control tables
``LifetimeLedger``         0x03D3     half-open live allocation bytes, peak, total
``check_release``          0x03D5     safe release as a last-reader property
``PaddingLedger``          0x03D6     uniform padding reservation per direction/round trip
``PrecisionPayloadLedger`` 0x0AB      BF16 vs FP8 + FP32 scale payload bytes
``AlignmentLedger``        0x0AD      local executed rows under runner row alignment
``StepLedger``             all        the above built together (``ledger_from_handles``)
=========================  =========  =====================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from fractions import Fraction
from numbers import Real
from typing import Any, Iterable, Sequence

import torch

from ray_moe.dispatch.precision import FP8_DTYPE, scales_per_row
from ray_moe.dispatch.records import DispatchHandle
from ray_moe.types import PayloadFormat

ANALYTICAL = "analytical"
MIB = 1 << 20

CountMatrix = tuple[tuple[int, ...], ...]


# ------------------------------------------------------------------------------------------------------
#  helpers
# ------------------------------------------------------------------------------------------------------


def _as_count_matrix(counts: Any, name: str = "counts") -> CountMatrix:
    """Normalise a [P, P] count matrix (tensor, ndarray or nested sequence) to a tuple of int tuples.

    Raises ValueError naming ``name`` for a non-square, non-integer or negative matrix.
    """
    if isinstance(counts, torch.Tensor):
        if counts.is_floating_point() or counts.is_complex():
            raise ValueError(f"{name}: expected an integer count matrix, got dtype {counts.dtype}")
        rows = counts.detach().cpu().tolist()
    else:
        rows = [list(r) for r in counts]
    p = len(rows)
    if p == 0:
        raise ValueError(f"{name}: empty count matrix")
    out: list[tuple[int, ...]] = []
    for i, r in enumerate(rows):
        if len(r) != p:
            raise ValueError(f"{name}: row {i} has {len(r)} entries, expected a square [{p}, {p}] matrix")
        vals: list[int] = []
        for j, v in enumerate(r):
            if isinstance(v, bool) or int(v) != v:
                raise ValueError(f"{name}[{i}][{j}]={v!r}: counts must be integers")
            if v < 0:
                raise ValueError(f"{name}[{i}][{j}]={v}: counts must be >= 0")
            vals.append(int(v))
        out.append(tuple(vals))
    return tuple(out)


def _positive_int(name: str, value: Any, *, allow_zero: bool = False) -> int:
    """An integer (or integer-valued real) that is > 0, or >= 0 with ``allow_zero``; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, Real) or not float(value).is_integer():
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    v = int(value)
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r}: must be {'>= 0' if allow_zero else '> 0'}")
    return v


def dtype_width(dtype: torch.dtype) -> int:
    """Element width in bytes of a torch dtype (BF16 -> 2, FP8 e4m3 -> 1, INT64 -> 8)."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
    return int(dtype.itemsize)


def _plain(v: Any) -> Any:
    """JSON-ready view: ledgers -> dicts, enums -> values, tuples -> lists."""
    if isinstance(v, _Ledger):
        return v.as_dict()
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


class _Ledger:
    """Mixin: ``as_dict`` lists the input fields and the derived values named in ``_DERIVED``."""

    _DERIVED: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]
        for name in self._DERIVED:
            out[name] = _plain(getattr(self, name))
        return out


# ------------------------------------------------------------------------------------------------------
#  representation (which widths the byte ledgers assume)
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Representation(_Ledger):
    """Declared element widths and the transport metadata schema (spec 0x03D, 0x03D2).

    Defaults are the spec's baseline: BF16 activations and expert outputs, INT64 count/offset
    coordinates, INT32 transport metadata, two metadata fields per remote dispatch row, one handle index
    per remote combine row, eight INT32-sized semantic/physical fields per useful route in the handle.
    This is one selectable schema, not a universal ABI.
    """

    activation_bytes: int = 2  # b_a
    output_bytes: int = 2  # b_o
    coord_bytes: int = 8  # b_c (INT64 counts, offsets, splits)
    meta_bytes: int = 4  # INT32 transport metadata field
    dispatch_meta_fields: int = 2
    combine_meta_fields: int = 1
    handle_fields: int = 8
    evidence: str = ANALYTICAL

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "evidence":
                _positive_int(f.name, getattr(self, f.name))

    @staticmethod
    def from_dtypes(activation: torch.dtype = torch.bfloat16, output: torch.dtype = torch.bfloat16,
                    coord: torch.dtype = torch.int64, meta: torch.dtype = torch.int32,
                    **schema: int) -> "Representation":
        """Widths from torch dtypes; ``schema`` overrides the field counts."""
        return Representation(activation_bytes=dtype_width(activation), output_bytes=dtype_width(output),
                              coord_bytes=dtype_width(coord), meta_bytes=dtype_width(meta), **schema)


BASELINE = Representation()


# ------------------------------------------------------------------------------------------------------
#  0x03C1 row slots
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSlotLedger(_Ledger):
    """Useful all-to-all-v row slots vs uniform padded all-to-all row slots (spec 0x03C1).

    counts: [P, P] count matrix over global ranks.
    padded = P^2 * max C (every source-destination cell padded to the hottest split).
    A row-slot comparison only: no bytes, no latency.
    """

    counts: CountMatrix
    evidence: str = ANALYTICAL
    _DERIVED = ("num_ranks", "useful_rows", "local_rows", "remote_rows", "max_split", "padded_rows",
                "padding_rows")

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", _as_count_matrix(self.counts))

    @property
    def num_ranks(self) -> int:
        return len(self.counts)

    @property
    def useful_rows(self) -> int:
        return sum(sum(r) for r in self.counts)

    @property
    def local_rows(self) -> int:
        return sum(self.counts[p][p] for p in range(self.num_ranks))

    @property
    def remote_rows(self) -> int:
        return self.useful_rows - self.local_rows

    @property
    def max_split(self) -> int:
        return max(max(r) for r in self.counts)

    @property
    def padded_rows(self) -> int:
        return self.num_ranks**2 * self.max_split

    @property
    def padding_rows(self) -> int:
        return self.padded_rows - self.useful_rows

    @property
    def send_rows(self) -> tuple[int, ...]:
        """Row sums R_p (routed rows of each source)."""
        return tuple(sum(r) for r in self.counts)

    @property
    def recv_rows(self) -> tuple[int, ...]:
        """Column sums (rows each destination receives)."""
        return tuple(sum(self.counts[p][u] for p in range(self.num_ranks)) for u in range(self.num_ranks))


# ------------------------------------------------------------------------------------------------------
#  0x03D1 / 0x03D6 payload bytes
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PayloadLedger(_Ledger):
    """Collective staging payload vs representation-level remote row payload (spec 0x03D1, 0x03D6).

    B_stage,dispatch = R d b_a;  B_stage,combine = R d b_o;  B_remote,payload = R_remote d (b_a + b_o).
    Local routes stay in the staging layout but cross no link (local-bypass policy). Excludes metadata,
    control tables, scales, padding, protocol and physical transactions.
    """

    rows: int  # R: all useful route rows
    remote_rows: int  # R_remote: rows whose destination differs from the source
    hidden_size: int  # d
    activation_bytes: int = 2  # b_a
    output_bytes: int = 2  # b_o
    evidence: str = ANALYTICAL
    _DERIVED = ("staging_dispatch_bytes", "staging_combine_bytes", "staging_round_trip_bytes",
                "remote_dispatch_bytes", "remote_combine_bytes", "remote_payload_bytes")

    def __post_init__(self) -> None:
        _positive_int("rows", self.rows, allow_zero=True)
        _positive_int("remote_rows", self.remote_rows, allow_zero=True)
        _positive_int("hidden_size", self.hidden_size)
        _positive_int("activation_bytes", self.activation_bytes)
        _positive_int("output_bytes", self.output_bytes)
        if self.remote_rows > self.rows:
            raise ValueError(f"remote_rows={self.remote_rows}: exceeds rows={self.rows}")

    @staticmethod
    def from_counts(counts: Any, hidden_size: int, rep: Representation = BASELINE) -> "PayloadLedger":
        """R = sum C, R_remote = sum of the off-diagonal of C."""
        rs = RowSlotLedger(counts)
        return PayloadLedger(rs.useful_rows, rs.remote_rows, hidden_size, rep.activation_bytes, rep.output_bytes)

    @staticmethod
    def from_shape(num_tokens: int, top_k: int, hidden_size: int, remote_fraction: float,
                   rep: Representation = BASELINE) -> "PayloadLedger":
        """R = T k; R_remote = f_remote R (must be a whole number of rows)."""
        t = _positive_int("num_tokens", num_tokens, allow_zero=True)
        k = _positive_int("top_k", top_k)
        if not isinstance(remote_fraction, Real) or not 0.0 <= float(remote_fraction) <= 1.0:
            raise ValueError(f"remote_fraction={remote_fraction!r}: must be a number in [0, 1]")
        r = t * k
        remote = Fraction(remote_fraction).limit_denominator(1 << 20) * r
        if remote.denominator != 1:
            raise ValueError(f"remote_fraction={remote_fraction!r}: gives {float(remote)} remote rows of {r}, "
                             f"not a whole number")
        return PayloadLedger(r, int(remote), hidden_size, rep.activation_bytes, rep.output_bytes)

    @property
    def staging_dispatch_bytes(self) -> int:
        return self.rows * self.hidden_size * self.activation_bytes

    @property
    def staging_combine_bytes(self) -> int:
        return self.rows * self.hidden_size * self.output_bytes

    @property
    def staging_round_trip_bytes(self) -> int:
        return self.staging_dispatch_bytes + self.staging_combine_bytes

    @property
    def remote_dispatch_bytes(self) -> int:
        return self.remote_rows * self.hidden_size * self.activation_bytes

    @property
    def remote_combine_bytes(self) -> int:
        return self.remote_rows * self.hidden_size * self.output_bytes

    @property
    def remote_payload_bytes(self) -> int:
        return self.remote_dispatch_bytes + self.remote_combine_bytes


@dataclass(frozen=True)
class PaddingLedger(_Ledger):
    """Uniform padded all-to-all reservation vs useful staging payload (spec 0x03D6).

    padded rows = P^2 max C per direction; bytes = rows * d * width. A reservation ratio, not a slowdown.
    """

    counts: CountMatrix
    hidden_size: int
    activation_bytes: int = 2
    output_bytes: int = 2
    evidence: str = ANALYTICAL
    _DERIVED = ("padded_rows", "useful_rows", "padded_dispatch_bytes", "padded_combine_bytes",
                "padded_round_trip_bytes", "useful_dispatch_bytes", "useful_round_trip_bytes",
                "reservation_ratio")

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", _as_count_matrix(self.counts))
        _positive_int("hidden_size", self.hidden_size)
        _positive_int("activation_bytes", self.activation_bytes)
        _positive_int("output_bytes", self.output_bytes)

    @staticmethod
    def from_counts(counts: Any, hidden_size: int, rep: Representation = BASELINE) -> "PaddingLedger":
        return PaddingLedger(counts, hidden_size, rep.activation_bytes, rep.output_bytes)

    @property
    def _rows(self) -> RowSlotLedger:
        return RowSlotLedger(self.counts)

    @property
    def padded_rows(self) -> int:
        return self._rows.padded_rows

    @property
    def useful_rows(self) -> int:
        return self._rows.useful_rows

    @property
    def padded_dispatch_bytes(self) -> int:
        return self.padded_rows * self.hidden_size * self.activation_bytes

    @property
    def padded_combine_bytes(self) -> int:
        return self.padded_rows * self.hidden_size * self.output_bytes

    @property
    def padded_round_trip_bytes(self) -> int:
        return self.padded_dispatch_bytes + self.padded_combine_bytes

    @property
    def useful_dispatch_bytes(self) -> int:
        return self.useful_rows * self.hidden_size * self.activation_bytes

    @property
    def useful_round_trip_bytes(self) -> int:
        return self.useful_dispatch_bytes + self.useful_rows * self.hidden_size * self.output_bytes

    @property
    def reservation_ratio(self) -> float:
        """padded / useful row slots (inf when nothing is useful)."""
        return self.padded_rows / self.useful_rows if self.useful_rows else math.inf


# ------------------------------------------------------------------------------------------------------
#  0x03D2 transport metadata, handle state, control tables
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransportLedger(_Ledger):
    """Transport metadata, origin handle state and count/split tables (spec 0x03D2).

    counts:         [P, P] count matrix
    slots_per_rank: [P] physical slots hosted on each destination (local expert offsets have
                    slots + 1 entries per destination, sentinel included)

    remote_logical_bytes = remote payload (dispatch + combine) + remote dispatch/combine metadata:
    logical remote bytes excluding protocol, scales, alignment and physical transactions. Table storage
    (count matrix, offsets, splits, local expert offsets) is storage, not a network claim.
    """

    counts: CountMatrix
    slots_per_rank: tuple[int, ...]
    hidden_size: int
    rep: Representation = BASELINE
    evidence: str = ANALYTICAL
    _DERIVED = ("dispatch_meta_bytes", "combine_meta_bytes", "route_handle_bytes", "count_matrix_bytes",
                "send_offsets_bytes", "recv_splits_bytes", "local_expert_offset_entries",
                "local_expert_offsets_bytes", "control_table_bytes", "remote_payload_bytes",
                "remote_logical_bytes")

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", _as_count_matrix(self.counts))
        spr = tuple(_positive_int(f"slots_per_rank[{i}]", s, allow_zero=True)
                    for i, s in enumerate(self.slots_per_rank))
        if len(spr) != len(self.counts):
            raise ValueError(f"slots_per_rank: {len(spr)} entries for a {len(self.counts)}-rank count matrix")
        object.__setattr__(self, "slots_per_rank", spr)
        _positive_int("hidden_size", self.hidden_size)

    @property
    def _rows(self) -> RowSlotLedger:
        return RowSlotLedger(self.counts)

    @property
    def dispatch_meta_bytes(self) -> int:
        return self._rows.remote_rows * self.rep.dispatch_meta_fields * self.rep.meta_bytes

    @property
    def combine_meta_bytes(self) -> int:
        return self._rows.remote_rows * self.rep.combine_meta_fields * self.rep.meta_bytes

    @property
    def route_handle_bytes(self) -> int:
        return self._rows.useful_rows * self.rep.handle_fields * self.rep.meta_bytes

    @property
    def count_matrix_bytes(self) -> int:
        p = self._rows.num_ranks
        return p * p * self.rep.coord_bytes

    @property
    def send_offsets_bytes(self) -> int:
        p = self._rows.num_ranks
        return p * (p + 1) * self.rep.coord_bytes

    @property
    def recv_splits_bytes(self) -> int:
        p = self._rows.num_ranks
        return p * p * self.rep.coord_bytes

    @property
    def local_expert_offset_entries(self) -> int:
        return sum(s + 1 for s in self.slots_per_rank)

    @property
    def local_expert_offsets_bytes(self) -> int:
        return self.local_expert_offset_entries * self.rep.coord_bytes

    @property
    def control_table_bytes(self) -> int:
        return (self.count_matrix_bytes + self.send_offsets_bytes + self.recv_splits_bytes
                + self.local_expert_offsets_bytes)

    @property
    def remote_payload_bytes(self) -> int:
        return PayloadLedger.from_counts(self.counts, self.hidden_size, self.rep).remote_payload_bytes

    @property
    def remote_logical_bytes(self) -> int:
        return self.remote_payload_bytes + self.dispatch_meta_bytes + self.combine_meta_bytes


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
class Buffer(_Ledger):
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
        _positive_int(f"{self.name}.bytes", self.bytes, allow_zero=True)
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
class LifetimeLedger(_Ledger):
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
class Operation(_Ledger):
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
class ReleaseReport(_Ledger):
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


# ------------------------------------------------------------------------------------------------------
#  the baseline step's fourteen buffers and eight completion events (spec 0x03D3-0x03D5)
# ------------------------------------------------------------------------------------------------------

#: The spec's serialized-epoch lifetime table (0x03D3): name -> (start, end, last completion, role,
#: alias group). Byte sizes are NOT here; ``baseline_step_buffers`` derives them from shapes.
BASELINE_LIFETIMES: tuple[tuple[str, int, int, str, BufferRole, str | None], ...] = (
    ("input_hidden", 0, 9, "handle_released", BufferRole.INPUT, None),
    ("route_handle", 0, 9, "handle_released", BufferRole.HANDLE, None),
    ("count_matrix", 1, 7, "combine_complete", BufferRole.CONTROL, None),
    ("send_offsets", 1, 7, "combine_complete", BufferRole.CONTROL, None),
    ("receive_splits", 1, 7, "combine_complete", BufferRole.CONTROL, None),
    ("packed_send_payload", 1, 3, "dispatch_complete", BufferRole.SEND, None),
    ("send_metadata", 1, 3, "dispatch_complete", BufferRole.SEND, None),
    ("source_major_receive", 2, 4, "expert_input_ready", BufferRole.RECEIVE, None),
    ("local_expert_offsets", 3, 5, "expert_complete", BufferRole.CONTROL, None),
    ("local_expert_input", 3, 5, "expert_complete", BufferRole.EXPERT, None),
    ("expert_output_return_payload", 4, 7, "combine_complete", BufferRole.RETURN, "expert_output_return_payload"),
    ("return_metadata", 4, 7, "combine_complete", BufferRole.RETURN, None),
    ("returned_source_order_rows", 6, 8, "output_ready", BufferRole.RETURN, None),
    ("output_hidden", 7, 10, "downstream_consumer", BufferRole.OUTPUT, None),
)


def baseline_buffer_bytes(counts: Any, hidden_size: int, num_tokens: int, slots_per_rank: Sequence[int],
                          rep: Representation = BASELINE) -> dict[str, int]:
    """Byte size of each baseline buffer, derived from shapes (spec 0x03D2, 0x03D3).

    input/output hidden  [T, d]            T d b_a / T d b_o
    route handle         [R, 8] INT32      R * handle_fields * meta_bytes
    count matrix         [P, P] INT64;  send offsets [P, P+1] INT64;  receive splits [P, P] INT64
    packed send / source-major receive / local expert input   [R, d] b_a   (staging layout)
    send metadata        [R, 2] INT32      (every staged row, local ones included)
    local expert offsets sum_u (slots_u + 1) INT64
    expert output / return payload / returned rows            [R, d] b_o
    return metadata      [R, 1] INT32
    """
    tl = TransportLedger(counts, tuple(slots_per_rank), hidden_size, rep)
    pl = PayloadLedger.from_counts(counts, hidden_size, rep)
    r = pl.rows
    t = _positive_int("num_tokens", num_tokens, allow_zero=True)
    return {
        "input_hidden": t * hidden_size * rep.activation_bytes,
        "route_handle": tl.route_handle_bytes,
        "count_matrix": tl.count_matrix_bytes,
        "send_offsets": tl.send_offsets_bytes,
        "receive_splits": tl.recv_splits_bytes,
        "packed_send_payload": pl.staging_dispatch_bytes,
        "send_metadata": r * rep.dispatch_meta_fields * rep.meta_bytes,
        "source_major_receive": pl.staging_dispatch_bytes,
        "local_expert_offsets": tl.local_expert_offsets_bytes,
        "local_expert_input": pl.staging_dispatch_bytes,
        "expert_output_return_payload": pl.staging_combine_bytes,
        "return_metadata": r * rep.combine_meta_fields * rep.meta_bytes,
        "returned_source_order_rows": pl.staging_combine_bytes,
        "output_hidden": t * hidden_size * rep.output_bytes,
    }


def baseline_step_buffers(counts: Any, hidden_size: int, num_tokens: int, slots_per_rank: Sequence[int],
                          rep: Representation = BASELINE) -> LifetimeLedger:
    """The fourteen baseline buffers with shape-derived bytes and the spec's epoch table (0x03D3)."""
    sizes = baseline_buffer_bytes(counts, hidden_size, num_tokens, slots_per_rank, rep)
    return LifetimeLedger(tuple(
        Buffer(name, sizes[name], start, end, alias_group=alias, last_completion=last, role=role)
        for name, start, end, last, role, alias in BASELINE_LIFETIMES
    ))


def baseline_step_operations() -> tuple[Operation, ...]:
    """The correctness DAG of spec 0x03D4 with completion epochs consistent with 0x03D3's table.

    route_ready -> dispatch_packed -> dispatch_complete -> expert_input_ready -> expert_complete
    -> combine_complete -> output_ready -> handle_released;  output_ready -> downstream_consumer.
    """
    return (
        Operation("route_ready", 1, (), ("input_hidden",), ("route_handle",)),
        Operation("dispatch_packed", 2, ("route_ready",), ("input_hidden", "route_handle"),
                  ("count_matrix", "send_offsets", "receive_splits", "packed_send_payload", "send_metadata")),
        Operation("dispatch_complete", 3, ("dispatch_packed",),
                  ("packed_send_payload", "send_metadata", "count_matrix", "send_offsets", "receive_splits"),
                  ("source_major_receive",)),
        Operation("expert_input_ready", 4, ("dispatch_complete",), ("source_major_receive", "receive_splits"),
                  ("local_expert_offsets", "local_expert_input")),
        Operation("expert_complete", 5, ("expert_input_ready",), ("local_expert_input", "local_expert_offsets"),
                  ("expert_output_return_payload", "return_metadata")),
        Operation("combine_complete", 7, ("expert_complete",),
                  ("expert_output_return_payload", "return_metadata", "count_matrix", "send_offsets",
                   "receive_splits"),
                  ("returned_source_order_rows",)),
        Operation("output_ready", 8, ("combine_complete",), ("returned_source_order_rows", "route_handle"),
                  ("output_hidden",)),
        Operation("handle_released", 9, ("output_ready",), ("route_handle",)),
        Operation("downstream_consumer", 10, ("output_ready",), ("output_hidden",)),
    )


# ------------------------------------------------------------------------------------------------------
#  0x0AB precision payload, 0x0AD alignment
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionPayloadLedger(_Ledger):
    """Logical payload of ``remote_rows`` rows of width d in one payload format (spec 0x0AB).

    NATIVE:       R d b_16                       (b_16 = native_bytes, BF16 = 2)
    FP8_ROW:      R d b_8 + R * 1 * b_s          (b_8 = 1, b_s = 4)
    FP8_BLOCK128: R d b_8 + R ceil(d/128) b_s
    The scale count per row is the one the runtime quantizer uses (``precision.scales_per_row``).
    Excludes alignment, route metadata, headers, packetization and link transactions.
    """

    remote_rows: int
    hidden_size: int
    fmt: PayloadFormat
    native_bytes: int = 2
    scale_bytes: int = 4
    evidence: str = ANALYTICAL
    _DERIVED = ("element_bytes", "scales_per_row", "data_bytes", "scale_total_bytes", "total_bytes")

    def __post_init__(self) -> None:
        _positive_int("remote_rows", self.remote_rows, allow_zero=True)
        _positive_int("hidden_size", self.hidden_size)
        _positive_int("native_bytes", self.native_bytes)
        _positive_int("scale_bytes", self.scale_bytes)
        try:
            object.__setattr__(self, "fmt", PayloadFormat(self.fmt))
        except ValueError:
            raise ValueError(f"fmt: unknown payload format {self.fmt!r}") from None

    @property
    def element_bytes(self) -> int:
        return self.native_bytes if self.fmt is PayloadFormat.NATIVE else dtype_width(FP8_DTYPE)

    @property
    def scales_per_row(self) -> int:
        return scales_per_row(self.fmt, self.hidden_size)

    @property
    def data_bytes(self) -> int:
        return self.remote_rows * self.hidden_size * self.element_bytes

    @property
    def scale_total_bytes(self) -> int:
        return self.remote_rows * self.scales_per_row * self.scale_bytes

    @property
    def total_bytes(self) -> int:
        return self.data_bytes + self.scale_total_bytes


def precision_table(remote_rows: int, widths: Iterable[int],
                    formats: Iterable[PayloadFormat] = tuple(PayloadFormat),
                    native_bytes: int = 2) -> dict[int, dict[PayloadFormat, PrecisionPayloadLedger]]:
    """The 0x0AB table: ``table[d][fmt]`` for each width and format."""
    fmts = tuple(formats)
    return {int(d): {f: PrecisionPayloadLedger(remote_rows, int(d), f, native_bytes) for f in fmts}
            for d in widths}


@dataclass(frozen=True)
class AlignmentLedger(_Ledger):
    """Local executed rows when the runner needs row alignment ``a`` (spec 0x0AD).

    slot_counts: [Q] rows per physical slot;  n~_q = a ceil(n_q / a);  R_executed = sum_q n~_q.
    The fringe rows are LOCAL runner work: they add nothing to remote or staging payload.
    """

    slot_counts: tuple[int, ...]
    alignment: int
    evidence: str = ANALYTICAL
    _DERIVED = ("useful_rows", "executed_rows", "align_waste_rows")

    def __post_init__(self) -> None:
        counts = tuple(_positive_int(f"slot_counts[{i}]", c, allow_zero=True)
                       for i, c in enumerate(self.slot_counts))
        object.__setattr__(self, "slot_counts", counts)
        _positive_int("alignment", self.alignment)

    @property
    def executed_per_slot(self) -> tuple[int, ...]:
        a = self.alignment
        return tuple(a * -(-n // a) for n in self.slot_counts)

    @property
    def useful_rows(self) -> int:
        return sum(self.slot_counts)

    @property
    def executed_rows(self) -> int:
        return sum(self.executed_per_slot)

    @property
    def align_waste_rows(self) -> int:
        return self.executed_rows - self.useful_rows


# ------------------------------------------------------------------------------------------------------
#  the whole step, from declared shapes or from real dispatch handles
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepLedger(_Ledger):
    """Every analytical ledger of one MoE layer step, built from one count matrix.

    counts:         [P, P] C over global ranks
    slot_counts:    [Q] rows received per physical slot, global slot-id order
    slots_per_rank: [P] physical slots hosted per rank
    """

    counts: CountMatrix
    slot_counts: tuple[int, ...]
    slots_per_rank: tuple[int, ...]
    num_tokens: int
    hidden_size: int
    rep: Representation = BASELINE
    row_alignment: int | None = None
    evidence: str = ANALYTICAL
    rows: RowSlotLedger = field(init=False)
    payload: PayloadLedger = field(init=False)
    transport: TransportLedger = field(init=False)
    padding: PaddingLedger = field(init=False)
    buffers: LifetimeLedger = field(init=False)
    alignment: AlignmentLedger | None = field(init=False)

    def __post_init__(self) -> None:
        c = _as_count_matrix(self.counts)
        object.__setattr__(self, "counts", c)
        object.__setattr__(self, "slot_counts", tuple(int(x) for x in self.slot_counts))
        object.__setattr__(self, "slots_per_rank", tuple(int(x) for x in self.slots_per_rank))
        rows = RowSlotLedger(c)
        if sum(self.slot_counts) != rows.useful_rows:
            raise ValueError(f"slot_counts: sum {sum(self.slot_counts)} != routes in the count matrix "
                             f"{rows.useful_rows} (conservation)")
        if sum(self.slots_per_rank) != len(self.slot_counts):
            raise ValueError(f"slots_per_rank: {list(self.slots_per_rank)} hosts {sum(self.slots_per_rank)} "
                             f"slots but slot_counts has {len(self.slot_counts)}")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "payload", PayloadLedger.from_counts(c, self.hidden_size, self.rep))
        object.__setattr__(self, "transport", TransportLedger(c, self.slots_per_rank, self.hidden_size, self.rep))
        object.__setattr__(self, "padding", PaddingLedger.from_counts(c, self.hidden_size, self.rep))
        object.__setattr__(self, "buffers", baseline_step_buffers(c, self.hidden_size, self.num_tokens,
                                                                  self.slots_per_rank, self.rep))
        object.__setattr__(self, "alignment", None if self.row_alignment is None
                           else AlignmentLedger(self.slot_counts, self.row_alignment))


def ledger_from_handles(handles: Sequence[DispatchHandle], *, hidden_size: int,
                        rep: Representation = BASELINE, row_alignment: int | None = None) -> StepLedger:
    """Build the step's analytical ledgers from the dispatch handles of ALL ranks of one step.

    Steps:
      1. one handle per global rank 0..P-1 (P from the count matrix)
      2. every handle carries the same count matrix C [P, P]
      3. each rank's source row agrees with C[rank, :]; its received expert counts sum to C[:, rank]
      4. slot counts in global slot-id order from (receive.slot_ids, receive.expert_counts);
         slots per rank from the local expert count vectors; tokens from the semantic routes
    ``hidden_size`` and ``rep`` declare the representation: a handle carries rows, not widths.
    """
    hs = list(handles)
    if not hs:
        raise ValueError("handles: empty; pass the dispatch handles of every rank of the step")
    # 1.-2.
    c = _as_count_matrix(hs[0].count_matrix, "handles[0].count_matrix")
    p = len(c)
    by_rank: dict[int, DispatchHandle] = {}
    for i, h in enumerate(hs):
        if h.rank in by_rank:
            raise ValueError(f"handles[{i}].rank={h.rank}: two handles for one rank")
        by_rank[h.rank] = h
        ci = _as_count_matrix(h.count_matrix, f"handles[{i}].count_matrix")
        if ci != c:
            raise ValueError(f"handles[{i}].count_matrix={[list(r) for r in ci]}: differs from rank "
                             f"{hs[0].rank}'s {[list(r) for r in c]}")
    if sorted(by_rank) != list(range(p)):
        raise ValueError(f"handles: ranks {sorted(by_rank)} do not cover the {p} ranks of the count matrix")
    if len({(h.generation, h.layer) for h in hs}) != 1:
        raise ValueError(f"handles: mixed (generation, layer) {sorted({(h.generation, h.layer) for h in hs})}")
    # 3.-4.
    slot_rows: dict[int, int] = {}
    slots_per_rank: list[int] = []
    tokens = 0
    for u in range(p):
        h = by_rank[u]
        sent = [int(x) for x in h.source.counts_by_rank.tolist()]
        if sent != list(c[u]):
            raise ValueError(f"handles[rank {u}].source.counts_by_rank={sent}: != count matrix row {list(c[u])}")
        got = [int(x) for x in h.receive.expert_counts.tolist()]
        want = sum(c[s][u] for s in range(p))
        if sum(got) != want:
            raise ValueError(f"handles[rank {u}].receive.expert_counts={got}: sum {sum(got)} != column sum {want}")
        for q, n in zip(h.receive.slot_ids.tolist(), got):
            slot_rows[int(q)] = n
        slots_per_rank.append(len(got))
        tokens += h.routes.num_tokens
    slot_counts = tuple(slot_rows[q] for q in sorted(slot_rows))
    return StepLedger(c, slot_counts, tuple(slots_per_rank), tokens, hidden_size, rep, row_alignment)
