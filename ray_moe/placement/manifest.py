"""Versioned placement manifest (spec 0x02B1, 0x02B2). Pure: no Ray.

A manifest is the immutable content of one placement generation: which physical slot stores which
logical expert replica on which destination rank, under which checkpoint. ``state`` and
``in_flight_refcount`` are report fields filled by the registry when it exports a view; they are not
part of the content digest. Physical slot ids are unique inside one (generation, layer) and run
``0..Q-1`` there.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from typing import Iterable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.core.types import GenerationState, placement_version


class SlotSpec(BaseModel):
    """One physical expert slot: ``(placement generation, layer, physical_slot_id)`` is its full key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    physical_slot_id: int = Field(ge=0)
    logical_expert_id: int = Field(ge=0)
    replica_id: str = Field(min_length=1)
    destination_rank: int = Field(ge=0)
    topology_domain_id: str = Field(min_length=1)
    parameter_digest: str = Field(min_length=1)
    checkpoint_version: str | None = Field(default=None, description="None means the manifest's checkpoint")
    layer: int = Field(default=0, ge=0)

    @property
    def label(self) -> str:
        return f"q{self.physical_slot_id}"


class PlacementManifest(BaseModel):
    """Content of one placement generation, for every MoE layer of the model.

    Validation rejects: duplicate slot ids, unknown experts, a logical expert with no slot, ranks
    outside the group, non-contiguous slot ids, replicas of one expert with different checkpoint or
    parameter digest. Errors name the field and the value.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    generation: int = Field(ge=0)
    placement_version: str = ""
    state: GenerationState = GenerationState.PENDING
    process_group_id: str = Field(min_length=1)
    checkpoint_version: str = Field(min_length=1)
    in_flight_refcount: int = Field(default=0, ge=0)
    num_experts: int = Field(ge=1)
    num_ranks: int = Field(ge=1)
    num_layers: int = Field(default=1, ge=1)
    topology_version: str = "topology-v0"
    slots: tuple[SlotSpec, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "PlacementManifest":
        if not self.placement_version:
            object.__setattr__(self, "placement_version", placement_version(self.generation))
        elif self.placement_version != placement_version(self.generation):
            raise ValueError(
                f"placement_version={self.placement_version!r} does not name generation={self.generation}"
            )
        seen: Counter[tuple[int, int]] = Counter((s.layer, s.physical_slot_id) for s in self.slots)
        for (layer, sid), c in seen.items():
            if c > 1:
                raise ValueError(f"slots: duplicate physical_slot_id={sid} in layer {layer}")
        by_layer: dict[int, list[SlotSpec]] = defaultdict(list)
        for s in self.slots:
            if s.layer >= self.num_layers:
                raise ValueError(f"slots[q{s.physical_slot_id}].layer={s.layer} >= num_layers={self.num_layers}")
            if s.logical_expert_id >= self.num_experts:
                raise ValueError(
                    f"slots[q{s.physical_slot_id}].logical_expert_id={s.logical_expert_id} is unknown "
                    f"(num_experts={self.num_experts})"
                )
            if s.destination_rank >= self.num_ranks:
                raise ValueError(
                    f"slots[q{s.physical_slot_id}].destination_rank={s.destination_rank} is outside the group "
                    f"of {self.num_ranks} ranks"
                )
            by_layer[s.layer].append(s)
        for layer in range(self.num_layers):
            slots = by_layer.get(layer, [])
            ids = sorted(s.physical_slot_id for s in slots)
            if ids != list(range(len(ids))):
                raise ValueError(f"slots: physical_slot_id in layer {layer} must be 0..{len(ids) - 1}, got {ids}")
            covered = {s.logical_expert_id for s in slots}
            missing = sorted(set(range(self.num_experts)) - covered)
            if missing:
                raise ValueError(f"slots: logical expert {missing[0]} has no slot in layer {layer}")
            state: dict[int, tuple[str, str, str]] = {}
            for s in slots:
                ck = s.checkpoint_version or self.checkpoint_version
                prev = state.setdefault(s.logical_expert_id, (ck, s.parameter_digest, s.replica_id))
                if prev[0] != ck:
                    raise ValueError(
                        f"slots[q{s.physical_slot_id}].checkpoint_version={ck!r} differs from replica "
                        f"{prev[2]!r} ({prev[0]!r}) of logical expert {s.logical_expert_id}"
                    )
                if prev[1] != s.parameter_digest:
                    raise ValueError(
                        f"slots[q{s.physical_slot_id}].parameter_digest={s.parameter_digest!r} differs from replica "
                        f"{prev[2]!r} ({prev[1]!r}) of logical expert {s.logical_expert_id}"
                    )
        return self

    # ------------------------------------------------------------------ views
    def layer_slots(self, layer: int = 0) -> list[SlotSpec]:
        """Slots of one layer in physical-slot order."""
        return sorted((s for s in self.slots if s.layer == layer), key=lambda s: s.physical_slot_id)

    def num_slots(self, layer: int = 0) -> int:
        return sum(1 for s in self.slots if s.layer == layer)

    def rank_slots(self, rank: int, layer: int = 0) -> list[SlotSpec]:
        """Slots on ``rank`` in the manifest's explicit local slot order (physical-slot order)."""
        return [s for s in self.layer_slots(layer) if s.destination_rank == rank]

    def replicas(self, expert: int, layer: int = 0) -> list[SlotSpec]:
        return [s for s in self.layer_slots(layer) if s.logical_expert_id == expert]

    def slots_ranks(self) -> set[int]:
        """Ranks that host at least one slot (any layer)."""
        return {s.destination_rank for s in self.slots}

    def replica_counts(self, layer: int = 0) -> list[int]:
        c = Counter(s.logical_expert_id for s in self.slots if s.layer == layer)
        return [c[e] for e in range(self.num_experts)]

    def content_digest(self) -> str:
        """SHA-256 of the canonical JSON of the content (state and refcount excluded)."""
        body = self.model_dump(mode="json", exclude={"state", "in_flight_refcount"})
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def with_state(self, state: GenerationState, refcount: int) -> "PlacementManifest":
        """A report view carrying the registry's state and refcount (content unchanged)."""
        return self.model_copy(update={"state": state, "in_flight_refcount": refcount})

    def validate_against(self, topology: Topology, group: ProcessGroupSpec) -> None:
        """Cross-check with a topology and a process group (spec 0x01D1 clauses 3 and 4)."""
        if group.group_id != self.process_group_id:
            raise ValueError(
                f"process_group_id={self.process_group_id!r} but the group given is {group.group_id!r}"
            )
        outside = [r for r in group.peer_order if r >= self.num_ranks]
        if outside:
            raise ValueError(
                f"process group {group.group_id!r} member rank {outside[0]} is outside num_ranks={self.num_ranks}"
            )
        for s in self.slots:
            if s.destination_rank not in group.members:
                raise ValueError(
                    f"slots[q{s.physical_slot_id}].destination_rank={s.destination_rank} is outside process group "
                    f"{group.group_id!r}"
                )
            node = topology.node_of(s.destination_rank)
            if s.topology_domain_id != node:
                raise ValueError(
                    f"slots[q{s.physical_slot_id}].topology_domain_id={s.topology_domain_id!r} does not own rank "
                    f"{s.destination_rank} (its node is {node!r})"
                )


def manifest_from_assignment(
    *,
    generation: int,
    phy2log: Iterable[Iterable[int]],
    slot_rank: Iterable[Iterable[int]],
    num_experts: int,
    topology: Topology,
    process_group_id: str = "ep-group-0",
    checkpoint_version: str = "checkpoint-0000",
    digests: dict[tuple[int, int], str] | None = None,
) -> PlacementManifest:
    """Build a manifest from per-layer ``phy2log[l][q]`` and ``slot_rank[l][q]``.

    Replica ids number the copies of each expert in slot order; parameter digests come from
    ``digests[(layer, expert)]`` or default to ``expert-{e}-layer-{l}@{checkpoint}``.
    """
    p2l = [list(map(int, row)) for row in phy2log]
    ranks = [list(map(int, row)) for row in slot_rank]
    if len(p2l) != len(ranks):
        raise ValueError(f"slot_rank has {len(ranks)} layers but phy2log has {len(p2l)}")
    slots: list[SlotSpec] = []
    for layer, (row, rrow) in enumerate(zip(p2l, ranks)):
        if len(row) != len(rrow):
            raise ValueError(f"slot_rank[{layer}] has {len(rrow)} slots but phy2log[{layer}] has {len(row)}")
        seen: Counter[int] = Counter()
        for q, (e, u) in enumerate(zip(row, rrow)):
            j = seen[e]
            seen[e] += 1
            digest = (digests or {}).get((layer, e), f"expert-{e}-layer-{layer}@{checkpoint_version}")
            slots.append(
                SlotSpec(
                    physical_slot_id=q,
                    logical_expert_id=e,
                    replica_id=f"e{e}-r{j}",
                    destination_rank=u,
                    topology_domain_id=topology.node_of(u),
                    parameter_digest=digest,
                    layer=layer,
                )
            )
    return PlacementManifest(
        generation=generation,
        process_group_id=process_group_id,
        checkpoint_version=checkpoint_version,
        num_experts=num_experts,
        num_ranks=topology.num_ranks,
        num_layers=len(p2l),
        topology_version=topology.version,
        slots=tuple(slots),
    )
