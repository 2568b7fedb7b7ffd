"""ExpertStore: the expert weights one rank holds, by (layer, logical expert), content-addressed by digest.

A weight is held once however many generations place that expert on the rank (a retained copy is never
duplicated); a generation's stacked slot tensors are built from the store (``stack``) and verified against
the manifest's parameter digests. Freeing is by liveness: whatever no prepared generation uses can go.
No Ray, no locking: the owner (``ShardCore``) serialises control calls.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from ray_moe.moe.experts.weights import ExpertWeights, SlotWeights, WeightSource
from ray_moe.placement.manifest import PlacementManifest

Key = tuple[int, int]  # (layer, logical expert id)


def _key(k: Sequence[int]) -> Key:
    return (int(k[0]), int(k[1]))


class ExpertStore:
    """Weights by (layer, logical expert) on one device and dtype."""

    def __init__(self, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.rank = rank
        self.device = device
        self.dtype = dtype
        self._weights: dict[Key, ExpertWeights] = {}
        self._digests: dict[Key, str] = {}

    def __len__(self) -> int:
        return len(self._weights)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._weights.values())

    def held(self) -> list[Key]:
        return sorted(self._weights)

    def get(self, key: Key) -> ExpertWeights | None:
        return self._weights.get(_key(key))

    # ---------------------------------------------------------------- in
    def _put(self, key: Key, w: ExpertWeights) -> str:
        w = w.to(self.device, self.dtype)
        self._weights[key] = w
        self._digests[key] = w.digest()
        return self._digests[key]

    def load(self, keys: Iterable[Sequence[int]], source: WeightSource) -> dict[Key, str]:
        """Read missing (layer, expert) weights from ``source``; returns every key's parameter digest."""
        out = {}
        for k in keys:
            key = _key(k)
            out[key] = self._digests[key] if key in self._weights else self._put(key, source.expert(*key))
        return out

    def put(self, weights: Mapping[Sequence[int], ExpertWeights]) -> dict[Key, str]:
        """Store copied weights; returns the digests computed from the bytes that arrived."""
        return {_key(k): self._put(_key(k), w) for k, w in weights.items()}

    # ---------------------------------------------------------------- out
    def export(self, keys: Sequence[Sequence[int]], *, device: bool = False) -> dict[Key, ExpertWeights]:
        """Held weights for an actor-to-actor copy (CPU tensors, or the device tensors for NCCL)."""
        missing = [_key(k) for k in keys if _key(k) not in self._weights]
        if missing:
            raise ValueError(f"keys: rank {self.rank} holds no weights for (layer, expert) {missing[0]}")
        return {_key(k): (self._weights[_key(k)] if device else self._weights[_key(k)].to("cpu")) for k in keys}

    def stack(self, manifest: PlacementManifest) -> tuple[tuple[SlotWeights | None, ...], frozenset[Key]]:
        """This rank's stacked slot weights per layer of ``manifest`` (None where it hosts no slot) and the keys
        they use. Raises ``ValueError`` naming the slot when a weight is missing or its digest differs from the
        manifest's (nothing is published from a mismatch)."""
        weights: list[SlotWeights | None] = []
        keys: set[Key] = set()
        mismatches = []
        for layer in range(manifest.num_layers):
            slots = manifest.rank_slots(self.rank, layer)
            if not slots:
                weights.append(None)
                continue
            experts = []
            for s in slots:
                key = (layer, s.logical_expert_id)
                if key not in self._weights:
                    raise ValueError(f"manifest: slot q{s.physical_slot_id} of layer {layer} needs expert "
                                     f"{s.logical_expert_id} which rank {self.rank} does not hold")
                if self._digests[key] != s.parameter_digest:
                    mismatches.append((layer, s.physical_slot_id, s.logical_expert_id))
                experts.append(self._weights[key])
                keys.add(key)
            weights.append(SlotWeights.stack(layer, [s.physical_slot_id for s in slots], experts,
                                             [s.parameter_digest for s in slots]))
        if mismatches:
            raise ValueError(f"parameter_digest: rank {self.rank} slots {mismatches} hold weights whose digest differs "
                             f"from the manifest of generation {manifest.generation}; not published")
        return tuple(weights), frozenset(keys)

    # ---------------------------------------------------------------- freeing
    def drop(self, keys: Iterable[Sequence[int]], live: set[Key]) -> None:
        """Free ``keys`` that no live generation uses (an aborted migration's staged copies)."""
        for k in keys:
            key = _key(k)
            if key not in live:
                self._weights.pop(key, None)
                self._digests.pop(key, None)

    def drop_unreferenced(self, live: set[Key]) -> int:
        """Free every weight outside ``live``; returns how many were freed."""
        stale = [k for k in self._weights if k not in live]
        self.drop(stale, live)
        return len(stale)
