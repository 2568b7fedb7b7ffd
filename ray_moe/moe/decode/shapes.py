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

This module holds what the serving path and the admission predicate use (the key, the buffer specs, the
stable buffers). The analytical half (reserved-bytes and execution ledgers, the padded-input model of the
valid state) lives in ``ray_moe_dev.analysis.execution_ledger`` and ``ray_moe_dev.analysis.bucket_inputs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Sequence

import torch

from ray_moe.core.types import ExchangeKind, RunnerKind

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ray_moe.placement.snapshot import PlacementSnapshot

ROUTE_ID_DTYPE = torch.int32
METADATA_DTYPE = torch.int32
METADATA_VALUES_PER_RANK = 3  # (real tokens, compact token offset, routes originated) per rank
PADDING_ROUTE_ID = -1


class BufferName(str, Enum):
    """The five stable buffers of the teaching decode graph (spec 0x05C)."""

    HIDDEN = "graph.hidden"
    ROUTE_IDS = "graph.route_ids"
    GATES = "graph.gates"
    EXPERT_OUTPUT = "graph.expert_output"
    STEP_METADATA = "graph.step_metadata"


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
