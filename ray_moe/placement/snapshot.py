"""PlacementSnapshot: the immutable tensor view of one (generation, layer) that the data path binds to
(spec 0x0CB). Pure: no Ray.

Built once per generation from a validated manifest; dispatch plans index it, never the manifest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from ray_moe.placement.manifest import PlacementManifest
from ray_moe.placement.topology import ProcessGroupSpec, Topology


class DeviceMaps(NamedTuple):
    """The snapshot's index tensors resident on one device (copied once per generation, not per step)."""

    phy2log: torch.Tensor
    slot_rank: torch.Tensor
    slot_local: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    rank_to_peer: torch.Tensor
    rank_node: torch.Tensor
    rank_slots: dict[int, torch.Tensor]  # global slot ids per rank in local order


@dataclass(frozen=True, eq=False)
class PlacementSnapshot:
    """Tensor view of one layer of one placement generation.

    phy2log:     [Q] int64   logical expert stored in physical slot q
    slot_rank:   [Q] int64   destination (global) rank of slot q
    slot_local:  [Q] int64   local slot index of q on its rank (manifest order)
    log2phy:     [E, M] int64 physical slots of expert e, padded with -1 (M = max replicas)
    logcnt:      [E] int64   number of valid entries of log2phy[e]
    peer_order:  [G] int64   global rank at each peer slot of the process group (G members)
    rank_to_peer:[P] int64   peer slot of each global rank (-1 for ranks outside the group)
    rank_node:   [P] int64   node index of each global rank
    rank_num_slots: tuple[int, ...]  slots hosted per rank
    map_digest:  56-bit digest of the maps, compared by peers in the control round
    """

    generation: int
    placement_version: str
    checkpoint_version: str
    process_group_id: str
    pg_epoch: int
    layer: int
    num_experts: int
    num_ranks: int
    phy2log: torch.Tensor
    slot_rank: torch.Tensor
    slot_local: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    peer_order: torch.Tensor
    rank_to_peer: torch.Tensor
    rank_node: torch.Tensor
    rank_num_slots: tuple[int, ...]
    release_id: str = ""
    map_digest: int = 0
    _device_cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.map_digest:
            h = hashlib.sha256()
            h.update(f"{self.generation}:{self.layer}:{self.pg_epoch}:{self.process_group_id}:"
                     f"{self.checkpoint_version}:{self.release_id}".encode())
            for t in (self.phy2log, self.slot_rank, self.slot_local, self.peer_order):
                h.update(t.cpu().numpy().tobytes())
            object.__setattr__(self, "map_digest", int.from_bytes(h.digest()[:7], "little"))

    @property
    def num_slots(self) -> int:
        return int(self.phy2log.numel())

    def on(self, device: torch.device | str) -> DeviceMaps:
        """Index tensors on ``device``, built once and cached (the snapshot is immutable)."""
        dev = torch.device(device)
        key = str(dev)
        maps = self._device_cache.get(key)
        if maps is None:
            ranks = {r: self.rank_slot_ids(r).to(dev) for r in range(self.num_ranks)}
            maps = DeviceMaps(self.phy2log.to(dev), self.slot_rank.to(dev), self.slot_local.to(dev),
                              self.log2phy.to(dev), self.logcnt.to(dev), self.rank_to_peer.to(dev),
                              self.rank_node.to(dev), ranks)
            self._device_cache[key] = maps
        return maps

    def cached(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` for this snapshot (a derived, immutable view: e.g. a dispatcher's
        device tables), then the kept value (None included)."""
        if key not in self._device_cache:
            self._device_cache[key] = build()
        return self._device_cache[key]

    def rank_slot_ids(self, rank: int) -> torch.Tensor:
        """Global physical slot ids hosted on ``rank`` in local slot order: [Q_local] int64."""
        ids = torch.nonzero(self.slot_rank == rank, as_tuple=False).flatten()
        return ids[torch.argsort(self.slot_local[ids], stable=True)]

    @staticmethod
    def from_manifest(
        manifest: PlacementManifest,
        topology: Topology,
        group: ProcessGroupSpec,
        layer: int = 0,
        release_id: str = "",
    ) -> "PlacementSnapshot":
        manifest.validate_against(topology, group)
        slots = manifest.layer_slots(layer)
        q = len(slots)
        phy2log = torch.tensor([s.logical_expert_id for s in slots], dtype=torch.int64)
        slot_rank = torch.tensor([s.destination_rank for s in slots], dtype=torch.int64)
        local = torch.zeros(q, dtype=torch.int64)
        per_rank = [0] * manifest.num_ranks
        for s in slots:
            local[s.physical_slot_id] = per_rank[s.destination_rank]
            per_rank[s.destination_rank] += 1
        counts = [0] * manifest.num_experts
        for s in slots:
            counts[s.logical_expert_id] += 1
        m = max(counts)
        log2phy = torch.full((manifest.num_experts, m), -1, dtype=torch.int64)
        fill = [0] * manifest.num_experts
        for s in slots:
            e = s.logical_expert_id
            log2phy[e, fill[e]] = s.physical_slot_id
            fill[e] += 1
        peer_order = torch.tensor(group.peer_order, dtype=torch.int64)
        rank_to_peer = torch.full((manifest.num_ranks,), -1, dtype=torch.int64)  # -1: not a member
        rank_to_peer[peer_order] = torch.arange(group.size, dtype=torch.int64)
        return PlacementSnapshot(
            generation=manifest.generation,
            placement_version=manifest.placement_version,
            checkpoint_version=manifest.checkpoint_version,
            process_group_id=group.group_id,
            pg_epoch=group.epoch,
            layer=layer,
            num_experts=manifest.num_experts,
            num_ranks=manifest.num_ranks,
            phy2log=phy2log,
            slot_rank=slot_rank,
            slot_local=local,
            log2phy=log2phy,
            logcnt=torch.tensor(counts, dtype=torch.int64),
            peer_order=peer_order,
            rank_to_peer=rank_to_peer,
            rank_node=torch.tensor(topology.node_index(), dtype=torch.int64),
            rank_num_slots=tuple(per_rank),
            release_id=release_id,
        )


def snapshots_for(
    manifest: PlacementManifest, topology: Topology, group: ProcessGroupSpec, release_id: str = ""
) -> tuple[PlacementSnapshot, ...]:
    """One snapshot per layer of a generation."""
    return tuple(
        PlacementSnapshot.from_manifest(manifest, topology, group, layer=l, release_id=release_id)
        for l in range(manifest.num_layers)
    )
