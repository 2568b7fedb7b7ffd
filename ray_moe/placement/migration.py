"""Migration plans: from the ACTIVE placement to a candidate generation (spec 0x08F, 0x08G, 0x0BB).

Pure control-plane code: no Ray, no tensors. A placement map names what the new generation should
contain; a migration plan names how each target slot gets its parameter state, what the old slots
become, what every step costs in bytes, and the order of publication. All byte figures are
*analytical* parameter payload (``expert_bytes`` per physical copy): they exclude allocator metadata,
checkpoint framing, transport protocol and temporary buffers (spec 0x08F).

Actions (one per target slot, plus one RETIRE per old slot that is not retained):

=================  =========================================================================  ===========
action             meaning                                                                    source
=================  =========================================================================  ===========
RETAIN             an old slot on the same rank already holds the same logical expert with    old slot
                   the same checkpoint and parameter digest; the new generation aliases it
SAME_GPU_COPY      duplicate a copy of the same expert already materialised on the target     new slot
                   rank in the *new* generation (a retained slot or an earlier copy)
SAME_NODE_COPY     network copy from an old slot on another rank of the same node             old slot
CROSS_NODE_COPY    network copy from an old slot on another node                              old slot
CHECKPOINT_LOAD    no old slot holds compatible state (new checkpoint or digest): load it     none
RETIRE             an old slot not retained; freed after the old generation drains            old slot
=================  =========================================================================  ===========

The ``source_generation`` field of an action says which namespace ``source_slot`` lives in (0x01A0:
a physical slot id is only unique inside one generation).
"""

from __future__ import annotations

from collections import defaultdict
from enum import Enum
from types import MappingProxyType
from typing import Final, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field

from ray_moe.core.errors import AdmissionError
from ray_moe.placement.layout import ParallelLayout, PhysicalUnit
from ray_moe.placement.manifest import PlacementManifest, SlotSpec
from ray_moe.placement.topology import Topology

__all__ = [
    "MigrationAction",
    "MigrationActionKind",
    "MigrationLedger",
    "MigrationPlan",
    "NEXT_PUBLICATION_STEP",
    "PUBLICATION_STEPS",
    "PublicationStep",
    "plan_migration",
]


class MigrationActionKind(str, Enum):
    RETAIN = "retain"
    SAME_GPU_COPY = "same_gpu_copy"
    SAME_NODE_COPY = "same_node_copy"
    CROSS_NODE_COPY = "cross_node_copy"
    CHECKPOINT_LOAD = "checkpoint_load"
    RETIRE = "retire"


class PublicationStep(str, Enum):
    """Ordered publication steps of a migration (spec 0x08G)."""

    RESERVE = "reserve"  # reserve storage for every non-retained target copy
    MATERIALIZE = "materialize"  # network, same-GPU and checkpoint copies
    VERIFY_DIGESTS = "verify_digests"  # logical expert, checkpoint and parameter digest of every target slot
    PUBLISH = "publish"  # the new generation becomes ACTIVE for new dispatches
    DRAIN = "drain"  # the old generation serves only its pinned handles until refcount 0
    RETIRE = "retire"  # retire old metadata and unreferenced old copies


#: The only legal successor of each step; RETIRE is terminal (``None``).
NEXT_PUBLICATION_STEP: Final[Mapping[PublicationStep, PublicationStep | None]] = MappingProxyType(
    {
        PublicationStep.RESERVE: PublicationStep.MATERIALIZE,
        PublicationStep.MATERIALIZE: PublicationStep.VERIFY_DIGESTS,
        PublicationStep.VERIFY_DIGESTS: PublicationStep.PUBLISH,
        PublicationStep.PUBLISH: PublicationStep.DRAIN,
        PublicationStep.DRAIN: PublicationStep.RETIRE,
        PublicationStep.RETIRE: None,
    }
)


def _ordered_steps() -> tuple[PublicationStep, ...]:
    steps = [PublicationStep.RESERVE]
    while (nxt := NEXT_PUBLICATION_STEP[steps[-1]]) is not None:
        steps.append(nxt)
    return tuple(steps)


PUBLICATION_STEPS: Final[tuple[PublicationStep, ...]] = _ordered_steps()


class MigrationAction(BaseModel):
    """One step of state movement for one physical slot of one layer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    action: MigrationActionKind
    layer: int = Field(ge=0)
    expert: int = Field(ge=0, description="logical expert id")
    target_slot: int | None = Field(default=None, description="new-generation slot id; None for RETIRE")
    target_rank: int | None = Field(default=None, description="None for RETIRE")
    source_rank: int | None = None
    source_slot: int | None = Field(default=None, description="slot id in source_generation's namespace")
    source_generation: int | None = None
    bytes: int = Field(ge=0, description="analytical parameter bytes of the copy (state bytes for RETAIN/RETIRE)")
    checkpoint_version: str = Field(description="checkpoint of the state this action leaves in place (VERIFY_DIGESTS)")
    parameter_digest: str = Field(description="digest the target slot must verify to (the old slot's, for RETIRE)")


class MigrationLedger(BaseModel):
    """Counts and analytical bytes of a plan (summed over the planned layers)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    evidence: Literal["analytical"] = "analytical"
    retained_copies: int
    retained_bytes: int
    same_gpu_copies: int
    same_gpu_bytes: int
    same_node_copies: int
    same_node_bytes: int
    cross_node_copies: int
    cross_node_bytes: int
    checkpoint_loads: int
    checkpoint_load_bytes: int
    retired_copies: int
    retired_bytes: int
    network_bytes: int = Field(description="same-node + cross-node transfer payload")
    reserved_bytes: int = Field(description="storage reserved for every non-retained target copy")
    resident_old_bytes: int = Field(description="M_old")
    resident_new_bytes: int = Field(description="M_new")
    peak_bytes: int = Field(description="M_old + M_new - M_retained: unique storage while both generations live")
    rank_peak_bytes: dict[int, int] = Field(description="per-rank M_old + M_new - M_retained")
    rank_reserved_bytes: dict[int, int]


class MigrationPlan(BaseModel):
    """Frozen plan from ``old_generation`` to ``new_generation``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    old_generation: int
    new_generation: int
    old_placement_version: str
    new_placement_version: str
    checkpoint_version: str
    topology_version: str
    layers: tuple[int, ...]
    expert_bytes: int = Field(gt=0)
    actions: tuple[MigrationAction, ...] = Field(description="target actions in (layer, target_slot) order, then RETIREs")
    ledger: MigrationLedger
    steps: tuple[PublicationStep, ...] = PUBLICATION_STEPS
    rank_budget_bytes: dict[int, int] | None = None

    def target_actions(self, layer: int | None = None) -> tuple[MigrationAction, ...]:
        return tuple(
            a for a in self.actions
            if a.action is not MigrationActionKind.RETIRE and (layer is None or a.layer == layer)
        )

    def retire_actions(self, layer: int | None = None) -> tuple[MigrationAction, ...]:
        return tuple(
            a for a in self.actions
            if a.action is MigrationActionKind.RETIRE and (layer is None or a.layer == layer)
        )

    def action_for(self, target_slot: int, layer: int = 0) -> MigrationAction:
        for a in self.target_actions(layer):
            if a.target_slot == target_slot:
                return a
        raise ValueError(f"target_slot={target_slot} has no action in layer {layer}")


# ---------------------------------------------------------------------------- planning
def _checkpoint(manifest: PlacementManifest, slot: SlotSpec) -> str:
    return slot.checkpoint_version or manifest.checkpoint_version


def _check_inputs(
    old: PlacementManifest,
    new: PlacementManifest,
    topology: Topology,
    expert_bytes: int,
    layer: int | None,
    rank_budget_bytes: dict[int, int] | None,
    old_layout: ParallelLayout | None,
    new_layout: ParallelLayout | None,
) -> tuple[int, ...]:
    """Validate everything before planning; return the layers to plan."""
    for name, m in (("old", old), ("new", new)):
        if not isinstance(m, PlacementManifest):
            raise ValueError(f"{name}={type(m).__name__} is not a PlacementManifest")
    if not isinstance(topology, Topology):
        raise ValueError(f"topology={type(topology).__name__} is not a Topology")
    if isinstance(expert_bytes, bool) or not isinstance(expert_bytes, int) or expert_bytes <= 0:
        raise ValueError(f"expert_bytes={expert_bytes!r} must be a positive int")
    # Layout checks come first so a same-generation layout change gets the specific 0x0BB message.
    for name, lay in (("old_layout", old_layout), ("new_layout", new_layout)):
        if lay is None:
            continue
        if not isinstance(lay, ParallelLayout):
            raise ValueError(f"{name}={type(lay).__name__} is not a ParallelLayout")
        outside = sorted(set(lay.ranks) - {r.rank for r in topology.ranks})
        if outside:
            raise ValueError(f"{name}.ranks: rank {outside[0]} is outside topology {topology.version!r}")
    if old_layout is not None and new_layout is not None:
        changed = old_layout.moe_ownership_changes(new_layout)
        if changed and new.generation == old.generation:
            detail = ", ".join(f"{f}={getattr(old_layout, f)!r}->{getattr(new_layout, f)!r}" for f in changed)
            raise AdmissionError(
                f"new.generation={new.generation}: the MoE layout changes ({detail}) under the same generation; "
                f"a physical slot id would change meaning, so the candidate needs a new generation (spec 0x0BB)"
            )
    for name, lay in (("old_layout", old_layout), ("new_layout", new_layout)):
        if lay is not None and lay.physical_unit() is not PhysicalUnit.COMPLETE_COPY:
            raise AdmissionError(
                f"{name}.etp={lay.etp}: the physical unit is {lay.physical_unit().value!r}; this planner moves "
                f"complete copies on one rank and needs a per-shard parameter manifest for ETP>1 (spec 0x0BB, 0x0BC)"
            )
    if new.generation == old.generation:
        raise AdmissionError(
            f"new.generation={new.generation} equals old.generation; a migration publishes a new generation "
            f"(manifests are immutable, spec 0x02B3)"
        )
    if new.num_experts != old.num_experts:
        raise AdmissionError(
            f"new.num_experts={new.num_experts} != old.num_experts={old.num_experts}: placement never changes the "
            f"router vocabulary (spec 0x00E)"
        )
    if new.num_layers != old.num_layers:
        raise AdmissionError(f"new.num_layers={new.num_layers} != old.num_layers={old.num_layers}")
    if new.topology_version != topology.version:
        raise ValueError(
            f"new.topology_version={new.topology_version!r} but the topology given is {topology.version!r}"
        )
    known = {r.rank for r in topology.ranks}
    for name, m in (("old", old), ("new", new)):
        for s in m.slots:
            if s.destination_rank not in known:
                raise ValueError(
                    f"{name}.slots[layer {s.layer} q{s.physical_slot_id}].destination_rank={s.destination_rank} is "
                    f"outside topology {topology.version!r}"
                )
    if layer is None:
        layers = tuple(range(new.num_layers))
    else:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < new.num_layers:
            raise ValueError(f"layer={layer!r} is outside 0..{new.num_layers - 1}")
        layers = (layer,)
    if rank_budget_bytes is not None:
        for r, b in rank_budget_bytes.items():
            if r not in known:
                raise ValueError(f"rank_budget_bytes: rank {r!r} is outside topology {topology.version!r}")
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                raise ValueError(f"rank_budget_bytes[{r}]={b!r} must be an int >= 0")
    return layers


def _plan_layer(
    old: PlacementManifest, new: PlacementManifest, topology: Topology, layer: int, expert_bytes: int
) -> tuple[list[MigrationAction], list[MigrationAction]]:
    """Targets in slot order, then RETIREs in old slot order, for one layer."""
    old_slots = old.layer_slots(layer)
    # 1. Index old slots by their compatible state: (expert, checkpoint, digest) -> slots, by (rank, slot).
    by_state: dict[tuple[int, str, str], list[SlotSpec]] = defaultdict(list)
    for s in sorted(old_slots, key=lambda s: (s.destination_rank, s.physical_slot_id)):
        by_state[(s.logical_expert_id, _checkpoint(old, s), s.parameter_digest)].append(s)
    retained: set[int] = set()
    # (rank, expert) -> lowest new slot id already materialised there in the new generation
    materialised: dict[tuple[int, int], int] = {}
    targets: list[MigrationAction] = []
    # 2. One action per target slot, in target slot order.
    for t in new.layer_slots(layer):
        e, u = t.logical_expert_id, t.destination_rank
        state = (e, _checkpoint(new, t), t.parameter_digest)
        candidates = by_state.get(state, [])
        base = dict(layer=layer, expert=e, target_slot=t.physical_slot_id, target_rank=u, bytes=expert_bytes,
                    checkpoint_version=state[1], parameter_digest=state[2])
        # 2a. RETAIN the lowest unretained compatible old slot on the target rank.
        keep = next((s for s in candidates if s.destination_rank == u and s.physical_slot_id not in retained), None)
        if keep is not None:
            retained.add(keep.physical_slot_id)
            act = MigrationAction(action=MigrationActionKind.RETAIN, source_rank=u, source_slot=keep.physical_slot_id,
                                  source_generation=old.generation, **base)
        # 2b. SAME_GPU_COPY from a copy already materialised on the target rank in the new generation.
        elif (u, e) in materialised:
            act = MigrationAction(action=MigrationActionKind.SAME_GPU_COPY, source_rank=u,
                                  source_slot=materialised[(u, e)], source_generation=new.generation, **base)
        # 2c. Network copy from an old compatible slot: same node first, then lowest (rank, slot).
        elif candidates:
            node = topology.node_of(u)
            src = min(candidates, key=lambda s: (topology.node_of(s.destination_rank) != node,
                                                 s.destination_rank, s.physical_slot_id))
            kind = (MigrationActionKind.SAME_NODE_COPY if topology.node_of(src.destination_rank) == node
                    else MigrationActionKind.CROSS_NODE_COPY)
            act = MigrationAction(action=kind, source_rank=src.destination_rank, source_slot=src.physical_slot_id,
                                  source_generation=old.generation, **base)
        # 2d. No compatible state anywhere in the old generation: load from the checkpoint.
        else:
            act = MigrationAction(action=MigrationActionKind.CHECKPOINT_LOAD, **base)
        materialised.setdefault((u, e), t.physical_slot_id)
        targets.append(act)
    # 3. RETIRE every old slot that no target retained.
    retires = [
        MigrationAction(action=MigrationActionKind.RETIRE, layer=layer, expert=s.logical_expert_id,
                        source_rank=s.destination_rank, source_slot=s.physical_slot_id,
                        source_generation=old.generation, bytes=expert_bytes,
                        checkpoint_version=_checkpoint(old, s), parameter_digest=s.parameter_digest)
        for s in old_slots
        if s.physical_slot_id not in retained
    ]
    return targets, retires


def _ledger(
    old: PlacementManifest, new: PlacementManifest, layers: tuple[int, ...], actions: list[MigrationAction],
    expert_bytes: int,
) -> MigrationLedger:
    k = MigrationActionKind
    count = {kind: 0 for kind in k}
    nbytes = {kind: 0 for kind in k}
    for a in actions:
        count[a.action] += 1
        nbytes[a.action] += a.bytes
    ranks = sorted({s.destination_rank for m in (old, new) for s in m.slots})
    rank_old = {r: 0 for r in ranks}
    rank_new = {r: 0 for r in ranks}
    rank_ret = {r: 0 for r in ranks}
    rank_res = {r: 0 for r in ranks}
    for s in old.slots:
        if s.layer in layers:
            rank_old[s.destination_rank] += expert_bytes
    for s in new.slots:
        if s.layer in layers:
            rank_new[s.destination_rank] += expert_bytes
    for a in actions:
        if a.action is k.RETAIN:
            rank_ret[a.target_rank] += a.bytes
        elif a.action is not k.RETIRE:
            rank_res[a.target_rank] += a.bytes
    m_old, m_new, m_ret = sum(rank_old.values()), sum(rank_new.values()), nbytes[k.RETAIN]
    return MigrationLedger(
        retained_copies=count[k.RETAIN],
        retained_bytes=m_ret,
        same_gpu_copies=count[k.SAME_GPU_COPY],
        same_gpu_bytes=nbytes[k.SAME_GPU_COPY],
        same_node_copies=count[k.SAME_NODE_COPY],
        same_node_bytes=nbytes[k.SAME_NODE_COPY],
        cross_node_copies=count[k.CROSS_NODE_COPY],
        cross_node_bytes=nbytes[k.CROSS_NODE_COPY],
        checkpoint_loads=count[k.CHECKPOINT_LOAD],
        checkpoint_load_bytes=nbytes[k.CHECKPOINT_LOAD],
        retired_copies=count[k.RETIRE],
        retired_bytes=nbytes[k.RETIRE],
        network_bytes=nbytes[k.SAME_NODE_COPY] + nbytes[k.CROSS_NODE_COPY],
        reserved_bytes=sum(rank_res.values()),
        resident_old_bytes=m_old,
        resident_new_bytes=m_new,
        peak_bytes=m_old + m_new - m_ret,
        rank_peak_bytes={r: rank_old[r] + rank_new[r] - rank_ret[r] for r in ranks},
        rank_reserved_bytes=rank_res,
    )


def plan_migration(
    old: PlacementManifest,
    new: PlacementManifest,
    topology: Topology,
    *,
    expert_bytes: int,
    layer: int | None = None,
    rank_budget_bytes: dict[int, int] | None = None,
    old_layout: ParallelLayout | None = None,
    new_layout: ParallelLayout | None = None,
) -> MigrationPlan:
    """Plan the state movement from ``old`` (the ACTIVE generation) to the candidate ``new``.

    Args:
        old, new: manifests of two different generations with the same ``num_experts``/``num_layers``.
        topology: decides same-node vs cross-node sources; ``new.topology_version`` must name it.
        expert_bytes: analytical parameter bytes of one physical copy (e.g. BF16 SwiGLU d=2, f=3: 36).
        layer: plan one layer, or every layer when ``None``.
        rank_budget_bytes: optional per-rank storage budget; a rank absent from the dict is unbudgeted.
        old_layout, new_layout: optional parallel layouts; an MoE ownership change needs a new
            generation and ETP>1 is refused (this planner moves complete copies).

    Steps:
        1. Validate the inputs and refusals (same generation, layout change, vocabulary change).
        2. Per layer, per target slot in slot order: RETAIN, else SAME_GPU_COPY, else a network copy
           (same node first, lowest (rank, slot)), else CHECKPOINT_LOAD.
        3. Per layer, RETIRE each old slot that was not retained.
        4. Ledgers: counts and bytes per action, M_old, M_new, peak = M_old + M_new - M_retained,
           per-rank peak and reservation.
        5. Admission: refuse (``AdmissionError``) if a budgeted rank's peak exceeds its budget.

    Raises ``ValueError``/``AdmissionError`` naming the field and value; nothing moves on refusal.
    """
    # 1.
    layers = _check_inputs(old, new, topology, expert_bytes, layer, rank_budget_bytes, old_layout, new_layout)
    # 2-3.
    targets: list[MigrationAction] = []
    retires: list[MigrationAction] = []
    for l in layers:
        t, r = _plan_layer(old, new, topology, l, expert_bytes)
        targets.extend(t)
        retires.extend(r)
    actions = targets + retires
    # 4.
    ledger = _ledger(old, new, layers, actions, expert_bytes)
    # 5.
    if rank_budget_bytes is not None:
        over = [
            (r, ledger.rank_peak_bytes.get(r, 0), b)
            for r, b in sorted(rank_budget_bytes.items())
            if ledger.rank_peak_bytes.get(r, 0) > b
        ]
        if over:
            detail = "; ".join(f"rank {r}: peak {p} B > budget {b} B" for r, p, b in over)
            raise AdmissionError(
                f"rank_budget_bytes: migration {old.placement_version} -> {new.placement_version} refused before "
                f"anything moves ({detail})"
            )
    return MigrationPlan(
        old_generation=old.generation,
        new_generation=new.generation,
        old_placement_version=old.placement_version,
        new_placement_version=new.placement_version,
        checkpoint_version=new.checkpoint_version,
        topology_version=topology.version,
        layers=layers,
        expert_bytes=expert_bytes,
        actions=tuple(actions),
        ledger=ledger,
        rank_budget_bytes=None if rank_budget_bytes is None else dict(rank_budget_bytes),
    )
