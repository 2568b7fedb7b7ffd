"""Replica floors: a manual ``scale`` of (layer, expert) to n replicas is kept by every later EPLB
rebalance until a later ``scale`` lowers it. Pure: the control plane owns one ``ReplicaFloors`` and
persists its triples (``recovery.PlaneState.floors``).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

Key = tuple[int, int]  # (layer, logical expert)


class ReplicaFloors:
    """Floors by (layer, expert), in set order (newest last)."""

    def __init__(self, num_layers: int, num_experts: int, triples: Iterable[tuple[int, int, int]] = ()) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self._floors: dict[Key, int] = {(int(l), int(e)): int(n) for l, e, n in triples}

    def set(self, expert: int, replicas: int, layer: int | None = None) -> None:
        """Record ``replicas`` as the floor of ``expert`` (every layer, or ``layer``); 1 removes the floor."""
        for l in (range(self.num_layers) if layer is None else (layer,)):
            self._floors.pop((int(l), int(expert)), None)
            if replicas > 1:
                self._floors[(int(l), int(expert))] = int(replicas)

    def triples(self) -> list[tuple[int, int, int]]:
        """(layer, expert, replicas) in set order (the durable form)."""
        return [(l, e, n) for (l, e), n in dict(self._floors).items()]

    def as_list(self) -> list[dict[str, int]]:
        return [{"layer": l, "expert": e, "replicas": n} for (l, e), n in sorted(dict(self._floors).items())]

    def effective(self, num_slots: int) -> tuple[dict[Key, int], list[str]]:
        """The floors EPLB gets with ``num_slots`` physical slots per layer. They always fit while the slots
        that existed when they were set still do; when ranks were lost since, the newest floors are kept
        whole and older ones are lowered until they fit (the recorded floors are unchanged and come back
        with the capacity). Returns (floors, notes naming each lowered floor)."""
        out: dict[Key, int] = {}
        notes: list[str] = []
        budget = {l: num_slots - self.num_experts for l in range(self.num_layers)}
        for (l, e), n in reversed(list(dict(self._floors).items())):  # newest first
            take = max(0, min(n - 1, budget[l]))
            budget[l] -= take
            if take + 1 < n:
                notes.append(f"expert {e} of layer {l}: floor {n} lowered to {take + 1} ({num_slots} slots per layer)")
            if take:
                out[(l, e)] = take + 1
        return out, notes

    def matrix(self, num_slots: int) -> tuple[np.ndarray | None, list[str]]:
        """Effective floors as EPLB's ``min_replicas`` [L, E] int64 (None when there are none), and notes."""
        floors, notes = self.effective(num_slots)
        if not floors:
            return None, notes
        m = np.ones((self.num_layers, self.num_experts), dtype=np.int64)
        for (l, e), n in floors.items():
            m[l, e] = n
        return m, notes


__all__ = ["ReplicaFloors"]
