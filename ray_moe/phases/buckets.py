"""Decode buckets: a fixed captured shape with mutable valid state (spec 0x05C, 0x05D). Pure: no Ray.

A decode bucket is what a captured decode graph binds to:

* an immutable ``GraphKey`` K = (G, v, c, d, k, tau_x, tau_g, D_dispatch, D_runner, C_T, C_q) (0x05D);
* five stable buffers whose shapes follow from K (0x05C), reserved once and never re-addressed;
* per-step *valid state* (real tokens per rank, valid token mask, compact rank offsets, valid routes per
  physical slot) that changes on device while the addresses stay fixed.

Layout of the bucket's token axis: rank ``u`` owns the contiguous region
``[cap_offsets[u], cap_offsets[u] + C_T[u])``; its ``T_u`` real rows come first, the rest is padding.
Padding is physical state, not semantic input: a padding row carries route id ``-1`` and gate ``0`` and is
masked *before* it can acquire an expert identity (0x05C, 0x05H).

``graph.route_ids`` holds the **physical slot** of each route (placement-bound, which is why the placement
generation is part of K). The logical expert of a route is ``phy2log[slot]`` and never changes here.

Also defines ``ExecutionLedger``, the analytical row/unit ledger shared by the phase modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from fractions import Fraction
from typing import TYPE_CHECKING, Sequence

import torch

from ray_moe.types import ExchangeKind, RunnerKind

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ray_moe.placement.snapshot import PlacementSnapshot

ROUTE_ID_DTYPE = torch.int32
METADATA_DTYPE = torch.int32
METADATA_VALUES_PER_RANK = 3  # (real tokens, compact token offset, routes originated) per rank
PADDING_ROUTE_ID = -1

# The execution paths' declared host-submission schema (spec 0x05B/0x05C count *logical* host
# submissions, never kernels or time). The variable path submits the seven SPMD stages of one step;
# a captured decode graph is one logical replay submission.
VARIABLE_PATH_STAGES: tuple[str, ...] = (
    "plan",
    "count_exchange",
    "payload_exchange",
    "repack",
    "grouped_experts",
    "return_exchange",
    "combine",
)
GRAPH_PATH_STAGES: tuple[str, ...] = ("graph_replay",)


class BufferName(str, Enum):
    """The five stable buffers of the teaching decode graph (spec 0x05C)."""

    HIDDEN = "graph.hidden"
    ROUTE_IDS = "graph.route_ids"
    GATES = "graph.gates"
    EXPERT_OUTPUT = "graph.expert_output"
    STEP_METADATA = "graph.step_metadata"


class ExecutionPath(str, Enum):
    """How one execution unit runs: variable (uncaptured) dispatch + grouped runner, or graph replay."""

    VARIABLE = "variable"
    GRAPH = "graph"


def check_counts(name: str, values: Sequence[int], *, positive: bool = False) -> tuple[int, ...]:
    out = tuple(int(v) for v in values)
    if len(out) == 0:
        raise ValueError(f"{name}: empty, expected one entry per rank/slot")
    for i, v in enumerate(out):
        if v < 0 or (positive and v == 0):
            need = "> 0" if positive else ">= 0"
            raise ValueError(f"{name}[{i}]={v}: must be {need}")
    return out


def check_row_counts(rank_tokens: Sequence[int], slot_routes: Sequence[int], top_k: int,
                     context: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validated (T_u per rank, n_q per slot) with the conservation law sum n_q = k * sum T_u (0x05A)."""
    t = check_counts("rank_tokens", rank_tokens)
    n = check_counts("slot_routes", slot_routes)
    if sum(n) != top_k * sum(t):
        raise ValueError(f"slot_routes: sum {sum(n)} != k * sum(rank_tokens) = {top_k} * {sum(t)} ({context})")
    return t, n


class RowCounts:
    """Mixin for records carrying ``rank_tokens`` [P] and ``slot_routes`` [Q]."""

    rank_tokens: tuple[int, ...]
    slot_routes: tuple[int, ...]

    @property
    def input_rows(self) -> int:
        return sum(self.rank_tokens)

    @property
    def route_rows(self) -> int:
        return sum(self.slot_routes)


def exclusive_prefix(counts: Sequence[int]) -> tuple[int, ...]:
    """[n] -> [n+1] exclusive prefix sum with the total as sentinel."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return tuple(out)


@dataclass(frozen=True)
class GraphKey:
    """The immutable key of a captured decode graph (spec 0x05D).

    Any field that differs between a step and a graph refuses replay (``graph_key_mismatch``):
    replaying a placement-v17 graph against placement-v18 is stale state, not load balancing.

    rank_token_capacities:  C_T, [P] token slots reserved per rank
    slot_route_capacities:  C_q, [Q] route rows reserved per physical slot
    """

    process_group_id: str
    pg_epoch: int
    placement_generation: int
    checkpoint: str
    hidden_size: int
    top_k: int
    activation_dtype: torch.dtype
    gate_dtype: torch.dtype
    dispatch_backend: ExchangeKind
    runner_backend: RunnerKind
    rank_token_capacities: tuple[int, ...]
    slot_route_capacities: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.process_group_id:
            raise ValueError(f"process_group_id={self.process_group_id!r}: must be non-empty")
        if not self.checkpoint:
            raise ValueError(f"checkpoint={self.checkpoint!r}: must be non-empty")
        for name in ("pg_epoch", "placement_generation"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        for name in ("hidden_size", "top_k"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("activation_dtype", "gate_dtype"):
            dt = getattr(self, name)
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise ValueError(f"{name}={dt!r}: must be a floating torch.dtype")
        object.__setattr__(self, "dispatch_backend", ExchangeKind(self.dispatch_backend))
        object.__setattr__(self, "runner_backend", RunnerKind(self.runner_backend))
        object.__setattr__(
            self, "rank_token_capacities", check_counts("rank_token_capacities", self.rank_token_capacities, positive=True)
        )
        object.__setattr__(
            self, "slot_route_capacities", check_counts("slot_route_capacities", self.slot_route_capacities, positive=True)
        )

    @property
    def num_ranks(self) -> int:
        return len(self.rank_token_capacities)

    @property
    def num_slots(self) -> int:
        return len(self.slot_route_capacities)

    @property
    def token_slots(self) -> int:
        """sum C_T: executed dispatch token slots of one replay."""
        return sum(self.rank_token_capacities)

    @property
    def runner_rows(self) -> int:
        """sum C_q: executed (masked) runner route rows of one replay."""
        return sum(self.slot_route_capacities)

    @staticmethod
    def for_snapshot(
        snapshot: "PlacementSnapshot",
        *,
        hidden_size: int,
        top_k: int,
        activation_dtype: torch.dtype,
        gate_dtype: torch.dtype,
        dispatch_backend: ExchangeKind | str,
        runner_backend: RunnerKind | str,
        rank_token_capacities: Sequence[int],
        slot_route_capacities: Sequence[int],
    ) -> "GraphKey":
        """The key of a step planned under ``snapshot`` (G + epoch, v, c taken from the snapshot)."""
        if len(slot_route_capacities) != snapshot.num_slots:
            raise ValueError(
                f"slot_route_capacities: {len(slot_route_capacities)} entries, snapshot has {snapshot.num_slots} slots"
            )
        if len(rank_token_capacities) != snapshot.num_ranks:
            raise ValueError(
                f"rank_token_capacities: {len(rank_token_capacities)} entries, snapshot has {snapshot.num_ranks} ranks"
            )
        return GraphKey(
            process_group_id=snapshot.process_group_id,
            pg_epoch=snapshot.pg_epoch,
            placement_generation=snapshot.generation,
            checkpoint=snapshot.checkpoint_version,
            hidden_size=hidden_size,
            top_k=top_k,
            activation_dtype=activation_dtype,
            gate_dtype=gate_dtype,
            dispatch_backend=ExchangeKind(dispatch_backend),
            runner_backend=RunnerKind(runner_backend),
            rank_token_capacities=tuple(int(c) for c in rank_token_capacities),
            slot_route_capacities=tuple(int(c) for c in slot_route_capacities),
        )

    def diff(self, other: "GraphKey") -> tuple[str, ...]:
        """Names of the key fields that differ (empty when the keys are equal)."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))

    def replace(self, **changes: object) -> "GraphKey":
        """A new key with some fields changed (e.g. a new placement generation)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        if unknown:
            raise ValueError(f"changes: unknown GraphKey field(s) {sorted(unknown)}")
        values.update(changes)
        return GraphKey(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class BufferSpec:
    """One stable buffer: a name, a shape and a dtype. ``nbytes`` = numel * itemsize."""

    name: BufferName
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ReservedBytesLedger:
    """Reserved payload bytes of the named stable buffers (spec 0x05C), analytical.

    Not total graph memory: excludes allocator overhead, expert weights, collective and kernel workspace,
    graph runtime objects and every buffer not named by the bucket.
    """

    by_buffer: tuple[tuple[BufferName, int], ...]
    evidence: str = "analytical"

    @property
    def total(self) -> int:
        return sum(b for _, b in self.by_buffer)


@dataclass(frozen=True)
class ExecutionLedger:
    """Analytical row / unit ledger of one or more execution units (spec 0x05B, 0x05C, 0x05E, 0x05F).

    Rows are counted, not timed: host submissions are *logical* host orchestration boundaries (not GPU
    launches) and control items are a declared teaching schema (not FLOPs, bytes or microseconds).
    ``control_items`` is None when no schema value was declared for some unit.
    """

    useful_input_rows: int
    executed_dispatch_slots: int
    useful_route_rows: int
    executed_runner_rows: int
    host_submissions: int
    phase_units: int = 1
    graph_units: int = 0
    control_items: int | None = None
    evidence: str = "analytical"

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"{f.name}={v}: must be >= 0")
        if self.executed_dispatch_slots < self.useful_input_rows:
            raise ValueError(
                f"executed_dispatch_slots={self.executed_dispatch_slots} < useful_input_rows={self.useful_input_rows}"
            )
        if self.executed_runner_rows < self.useful_route_rows:
            raise ValueError(
                f"executed_runner_rows={self.executed_runner_rows} < useful_route_rows={self.useful_route_rows}"
            )

    @property
    def dispatch_padding_slots(self) -> int:
        return self.executed_dispatch_slots - self.useful_input_rows

    @property
    def runner_padding_rows(self) -> int:
        return self.executed_runner_rows - self.useful_route_rows

    @property
    def control_items_per_route(self) -> Fraction | None:
        """C_control / R: amortisation of a fixed planning schema, not a latency (spec 0x05B)."""
        if self.control_items is None or self.useful_route_rows == 0:
            return None
        return Fraction(self.control_items, self.useful_route_rows)

    def __add__(self, other: "ExecutionLedger") -> "ExecutionLedger":
        if not isinstance(other, ExecutionLedger):
            return NotImplemented
        control = (
            None if self.control_items is None or other.control_items is None
            else self.control_items + other.control_items
        )
        return ExecutionLedger(
            useful_input_rows=self.useful_input_rows + other.useful_input_rows,
            executed_dispatch_slots=self.executed_dispatch_slots + other.executed_dispatch_slots,
            useful_route_rows=self.useful_route_rows + other.useful_route_rows,
            executed_runner_rows=self.executed_runner_rows + other.executed_runner_rows,
            host_submissions=self.host_submissions + other.host_submissions,
            phase_units=self.phase_units + other.phase_units,
            graph_units=self.graph_units + other.graph_units,
            control_items=control,
        )


@dataclass(frozen=True, eq=False)
class MaskState:
    """The mutable valid state of one decode step (spec 0x05C). Device tensors, rewritten every step.

    real_tokens_by_rank:  [P] int32     T_u real rows of rank u
    valid_tokens:         [S] bool      token-slot mask over the bucket (S = sum C_T); padding False
    rank_token_offsets:   [P+1] int32   exclusive prefix of T_u (compact offset of rank u's first real row;
                                         sentinel = number of valid rows)
    valid_routes_by_slot: [Q] int32     n_q valid route rows of physical slot q
    valid_runner_rows:    [sum C_q] bool runner-row mask: row j of slot q is valid iff j < n_q
    """

    real_tokens_by_rank: torch.Tensor
    valid_tokens: torch.Tensor
    rank_token_offsets: torch.Tensor
    valid_routes_by_slot: torch.Tensor
    valid_runner_rows: torch.Tensor

    @property
    def num_valid_tokens(self) -> int:
        return int(self.valid_tokens.sum())

    @property
    def num_valid_routes(self) -> int:
        return int(self.valid_routes_by_slot.sum())


@dataclass(frozen=True, eq=False)
class BucketInputs:
    """One step's padded bucket tensors (S = sum C_T token slots).

    hidden:        [S, d]   activation dtype; padding rows zero
    route_ids:     [S, k]   int32 physical slot per route; padding rows -1 (no expert identity)
    gates:         [S, k]   gate dtype; padding rows 0
    step_metadata: [P, 3]   int32 (real tokens, compact token offset, routes originated) per rank
    mask:          the step's ``MaskState``
    """

    hidden: torch.Tensor
    route_ids: torch.Tensor
    gates: torch.Tensor
    step_metadata: torch.Tensor
    mask: MaskState


@dataclass(frozen=True, eq=False)
class StableBuffers:
    """The reserved tensors of one bucket and the addresses captured with them (spec 0x05C, 0x05H).

    ``tensors`` maps each ``BufferName`` to its tensor; ``captured_ptrs`` records ``data_ptr()`` at
    capture. A buffer whose address, shape or dtype drifted is not ready: replay would read or write
    unrelated storage.
    """

    tensors: dict[BufferName, torch.Tensor]
    captured_ptrs: dict[BufferName, int]

    def ready(self, bucket: "DecodeBucket") -> bool:
        """True iff every named buffer exists at its captured address with its spec shape and dtype."""
        for spec in bucket.buffers:
            t = self.tensors.get(spec.name)
            if t is None or spec.name not in self.captured_ptrs:
                return False
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype or t.data_ptr() != self.captured_ptrs[spec.name]:
                return False
        return True


@dataclass(frozen=True)
class DecodeBucket:
    """A captured decode graph's static description: id, immutable key, stable buffer specs.

    Build with ``DecodeBucket.build(key)``; the buffer shapes follow from the key:

    graph.hidden        [sum C_T, d]  activation dtype
    graph.route_ids     [sum C_T, k]  int32
    graph.gates         [sum C_T, k]  gate dtype
    graph.expert_output [sum C_T, d]  activation dtype
    graph.step_metadata [P, 3]        int32
    """

    graph_id: str
    key: GraphKey
    buffers: tuple[BufferSpec, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.graph_id:
            raise ValueError(f"graph_id={self.graph_id!r}: must be non-empty")
        expected = _buffer_specs(self.key)
        if not self.buffers:
            object.__setattr__(self, "buffers", expected)
        elif tuple(self.buffers) != expected:
            raise ValueError(f"buffers: {self.buffers} do not match the specs derived from the key {expected}")

    @staticmethod
    def build(key: GraphKey, graph_id: str | None = None) -> "DecodeBucket":
        return DecodeBucket(graph_id=graph_id or default_graph_id(key), key=key)

    @property
    def cap_offsets(self) -> tuple[int, ...]:
        """[P+1] start of each rank's region on the bucket token axis (fixed at capture)."""
        return exclusive_prefix(self.key.rank_token_capacities)

    @property
    def slot_offsets(self) -> tuple[int, ...]:
        """[Q+1] start of each physical slot's region among the runner rows (fixed at capture)."""
        return exclusive_prefix(self.key.slot_route_capacities)

    def buffer(self, name: BufferName | str) -> BufferSpec:
        name = BufferName(name)
        for b in self.buffers:
            if b.name == name:
                return b
        raise ValueError(f"name={name.value!r}: not a buffer of graph {self.graph_id!r}")

    def reserved_bytes(self) -> ReservedBytesLedger:
        """M_graph: reserved payload bytes of the five named buffers (analytical)."""
        return ReservedBytesLedger(tuple((b.name, b.nbytes) for b in self.buffers))

    def replay_ledger(
        self, rank_tokens: Sequence[int], slot_routes: Sequence[int], control_items: int | None = None
    ) -> ExecutionLedger:
        """Rows one replay executes for a step that was admitted (spec 0x05C): every reserved token slot
        and every reserved runner row runs, valid or masked. ``control_items`` is the declared schema
        value of the step, if any (spec 0x05C declares 12 for its decode fixture)."""
        t = check_counts("rank_tokens", rank_tokens)
        n = check_counts("slot_routes", slot_routes)
        for name, vals, caps in (("rank_tokens", t, self.key.rank_token_capacities),
                                 ("slot_routes", n, self.key.slot_route_capacities)):
            if len(vals) != len(caps):
                raise ValueError(f"{name}: {len(vals)} entries, graph {self.graph_id!r} has {len(caps)}")
            for i, (v, c) in enumerate(zip(vals, caps)):
                if v > c:
                    raise ValueError(f"{name}[{i}]={v}: over capacity {c} of {self.graph_id!r}; not replayable")
        return ExecutionLedger(
            useful_input_rows=sum(t),
            executed_dispatch_slots=self.key.token_slots,
            useful_route_rows=sum(n),
            executed_runner_rows=self.key.runner_rows,
            host_submissions=len(GRAPH_PATH_STAGES),
            phase_units=1,
            graph_units=1,
            control_items=control_items,
        )

    def allocate(self, device: torch.device | str = "cpu") -> StableBuffers:
        """Reserve the stable buffers once (zero-filled; route ids -1) and capture their addresses."""
        tensors: dict[BufferName, torch.Tensor] = {}
        for b in self.buffers:
            fill = PADDING_ROUTE_ID if b.name == BufferName.ROUTE_IDS else 0
            tensors[b.name] = torch.full(b.shape, fill, dtype=b.dtype, device=device)
        return StableBuffers(tensors=tensors, captured_ptrs={n: t.data_ptr() for n, t in tensors.items()})


def default_graph_id(key: GraphKey) -> str:
    """``decode.bucket{C}.v{generation}`` for uniform rank capacity C, else the capacities joined by 'x'."""
    caps = set(key.rank_token_capacities)
    size = str(next(iter(caps))) if len(caps) == 1 else "x".join(str(c) for c in key.rank_token_capacities)
    return f"decode.bucket{size}.v{key.placement_generation}"


def _buffer_specs(key: GraphKey) -> tuple[BufferSpec, ...]:
    s, d, k, p = key.token_slots, key.hidden_size, key.top_k, key.num_ranks
    return (
        BufferSpec(BufferName.HIDDEN, (s, d), key.activation_dtype),
        BufferSpec(BufferName.ROUTE_IDS, (s, k), ROUTE_ID_DTYPE),
        BufferSpec(BufferName.GATES, (s, k), key.gate_dtype),
        BufferSpec(BufferName.EXPERT_OUTPUT, (s, d), key.activation_dtype),
        BufferSpec(BufferName.STEP_METADATA, (p, METADATA_VALUES_PER_RANK), METADATA_DTYPE),
    )


def runner_row_mask(valid_routes_by_slot: torch.Tensor, slot_caps: Sequence[int]) -> torch.Tensor:
    """[Q] counts n_q, capacities C_q -> [sum C_q] bool: row j of slot q is valid iff j < n_q."""
    caps = torch.as_tensor([int(c) for c in slot_caps], dtype=torch.int64, device=valid_routes_by_slot.device)
    slot_of_row = torch.repeat_interleave(torch.arange(caps.numel(), device=caps.device), caps)
    starts = torch.cumsum(caps, 0) - caps
    j = torch.arange(int(caps.sum()), device=caps.device) - starts[slot_of_row]
    return j < valid_routes_by_slot.to(torch.int64)[slot_of_row]


def slot_route_counts(slot_ids: Sequence[torch.Tensor], num_slots: int) -> tuple[int, ...]:
    """n_q over every rank's routes: ``slot_ids[u]`` is [T_u, k] physical slots -> (n_0 .. n_{Q-1})."""
    flat = [s.reshape(-1).to(torch.int64).cpu() for s in slot_ids]
    allr = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int64)
    if allr.numel() and (int(allr.min()) < 0 or int(allr.max()) >= num_slots):
        bad = int(allr.min()) if int(allr.min()) < 0 else int(allr.max())
        raise ValueError(f"slot_ids: physical slot {bad} is out of range [0, {num_slots})")
    return tuple(int(c) for c in torch.bincount(allr, minlength=num_slots).tolist())


def build_bucket_inputs(
    bucket: DecodeBucket,
    hidden: Sequence[torch.Tensor],
    slot_ids: Sequence[torch.Tensor],
    gates: Sequence[torch.Tensor],
) -> BucketInputs:
    """Pad one decode step's per-rank inputs into the bucket layout; padding never gets an expert identity.

    hidden[u]:   [T_u, d] float   rank u's current rows
    slot_ids[u]: [T_u, k] int     physical slot of each route (after replica selection)
    gates[u]:    [T_u, k] float   combine gates

    Never clips: a rank over C_T[u] or a slot over C_q raises ``ValueError`` (admission must have
    refused such a step first, spec 0x05F).

    1. validate shapes, rank count and capacities
    2. concatenate the real rows and compute their bucket positions (rank region start + local index)
    3. build the valid-token mask and the compact offsets (the mutable valid state)
    4. write real rows into padding-initialised tensors: route ids -1, gates 0, hidden 0
    5. mask padding route ids again by the valid-token mask (padding masked before identity)
    6. count valid routes per slot from the masked ids; check slot capacities
    7. step metadata [P, 3] = (real tokens, compact offset, routes originated)
    """
    key = bucket.key
    p, k, d, q = key.num_ranks, key.top_k, key.hidden_size, key.num_slots
    # 1. validation
    for name, seq in (("hidden", hidden), ("slot_ids", slot_ids), ("gates", gates)):
        if len(seq) != p:
            raise ValueError(f"{name}: {len(seq)} ranks given, bucket {bucket.graph_id!r} has P={p}")
    real = []
    for u in range(p):
        h, s, g = hidden[u], slot_ids[u], gates[u]
        if h.dim() != 2 or h.shape[1] != d:
            raise ValueError(f"hidden[{u}]: shape {tuple(h.shape)}, expected [T, {d}]")
        t = int(h.shape[0])
        if tuple(s.shape) != (t, k):
            raise ValueError(f"slot_ids[{u}]: shape {tuple(s.shape)}, expected [{t}, {k}]")
        if tuple(g.shape) != (t, k):
            raise ValueError(f"gates[{u}]: shape {tuple(g.shape)}, expected [{t}, {k}]")
        if t > key.rank_token_capacities[u]:
            raise ValueError(
                f"hidden[{u}]: {t} rows exceed rank token capacity {key.rank_token_capacities[u]} of "
                f"{bucket.graph_id!r}; the step must fall back, never be clipped"
            )
        real.append(t)
    device = hidden[0].device
    s_total = key.token_slots
    # 2. positions of the real rows on the bucket token axis
    real_t = torch.tensor(real, dtype=torch.int64, device=device)
    caps = torch.tensor(key.rank_token_capacities, dtype=torch.int64, device=device)
    cap_start = torch.cumsum(caps, 0) - caps
    compact_start = torch.cumsum(real_t, 0) - real_t
    rank_of_row = torch.repeat_interleave(torch.arange(p, device=device), real_t)
    n_real = int(real_t.sum())
    local = torch.arange(n_real, device=device) - compact_start[rank_of_row]
    pos = cap_start[rank_of_row] + local
    # 3. mutable valid state
    slot_rank_of = torch.repeat_interleave(torch.arange(p, device=device), caps)
    slot_local = torch.arange(s_total, device=device) - cap_start[slot_rank_of]
    valid_tokens = slot_local < real_t[slot_rank_of]
    offsets = torch.zeros(p + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(real_t, 0)
    # 4. padding-initialised tensors, real rows written
    h_out = torch.zeros(s_total, d, dtype=key.activation_dtype, device=device)
    ids_out = torch.full((s_total, k), PADDING_ROUTE_ID, dtype=ROUTE_ID_DTYPE, device=device)
    g_out = torch.zeros(s_total, k, dtype=key.gate_dtype, device=device)
    if n_real:
        h_out[pos] = torch.cat([h.to(key.activation_dtype) for h in hidden])
        ids_cat = torch.cat([s.to(torch.int64) for s in slot_ids])
        lo, hi = int(ids_cat.min()), int(ids_cat.max())
        if lo < 0 or hi >= q:
            raise ValueError(f"slot_ids: physical slot {lo if lo < 0 else hi} is out of range [0, {q})")
        ids_out[pos] = ids_cat.to(ROUTE_ID_DTYPE)
        g_out[pos] = torch.cat([g.to(key.gate_dtype) for g in gates])
    # 5. mask padding before it can acquire an expert identity
    ids_out = torch.where(valid_tokens[:, None], ids_out, torch.full_like(ids_out, PADDING_ROUTE_ID))
    g_out = torch.where(valid_tokens[:, None], g_out, torch.zeros_like(g_out))
    # 6. valid routes per slot, from masked ids only
    valid_ids = ids_out[ids_out >= 0].to(torch.int64)
    by_slot = torch.bincount(valid_ids, minlength=q)
    slot_caps = torch.tensor(key.slot_route_capacities, dtype=torch.int64, device=device)
    over = by_slot > slot_caps
    if bool(over.any()):
        j = int(torch.nonzero(over)[0])
        raise ValueError(
            f"slot_ids: slot {j} has {int(by_slot[j])} routes, over its capacity {int(slot_caps[j])} of "
            f"{bucket.graph_id!r}; the step must fall back, never be clipped"
        )
    # 7. step metadata
    meta = torch.stack([real_t, offsets[:-1], real_t * k], dim=1).to(METADATA_DTYPE)
    mask = MaskState(
        real_tokens_by_rank=real_t.to(METADATA_DTYPE),
        valid_tokens=valid_tokens,
        rank_token_offsets=offsets.to(METADATA_DTYPE),
        valid_routes_by_slot=by_slot.to(METADATA_DTYPE),
        valid_runner_rows=runner_row_mask(by_slot, key.slot_route_capacities),
    )
    return BucketInputs(hidden=h_out, route_ids=ids_out, gates=g_out, step_metadata=meta, mask=mask)


def stage_step(buffers: StableBuffers, bucket: DecodeBucket, inputs: BucketInputs) -> None:
    """Write one admitted step into the stable buffers in place (addresses unchanged; spec 0x05D's
    ``update_device_validity_state`` + ``mask_graph_padding_routes``). The expert output buffer is
    zeroed so no previous step's rows survive replay.

    Raises ``ValueError`` if the buffers are not ready for ``bucket``.
    """
    if not buffers.ready(bucket):
        raise ValueError(f"buffers: stable buffers of {bucket.graph_id!r} are missing or were re-addressed")
    t = buffers.tensors
    t[BufferName.HIDDEN].copy_(inputs.hidden)
    t[BufferName.ROUTE_IDS].copy_(inputs.route_ids)
    t[BufferName.GATES].copy_(inputs.gates)
    t[BufferName.STEP_METADATA].copy_(inputs.step_metadata)
    t[BufferName.EXPERT_OUTPUT].zero_()
