"""The shards a control plane drives (``Fleet``), and ``LocalFleet``: ShardCores in this process (tests,
single-process tools). The Ray fleet is ``ray_moe.ray.fleet.RayFleet``. No Ray here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping, Sequence

Key = tuple[int, int]  # (layer, logical expert)


class Fleet(ABC):
    """The shards a control plane drives. ``call`` runs one method on several ranks concurrently."""

    @abstractmethod
    def call(self, method: str, args: Mapping[int, tuple]) -> dict[int, Any]:
        """Run ``method(*args[rank])`` on every listed rank; results by rank (first error re-raised)."""

    @abstractmethod
    def copy_experts(self, dst: int, src: int, keys: Sequence[Key]) -> dict[Key, str]:
        """Copy weights of ``keys`` from rank ``src`` to rank ``dst``; digests of what arrived."""

    def ranks(self) -> list[int]:
        raise NotImplementedError

    def call_within(self, method: str, args: Mapping[int, tuple], timeout_s: float | None) -> dict[int, Any]:
        """``call`` that raises ``RankTimeoutError`` naming the ranks that did not answer in ``timeout_s``
        seconds (None: no limit). A fleet that cannot time out a call (in-process cores) just calls."""
        return self.call(method, args)

    def copy_within(self, dst: int, src: int, keys: Sequence[Key], timeout_s: float | None) -> dict[Key, str]:
        """``copy_experts`` within ``timeout_s`` seconds (``RankTimeoutError`` naming ``dst`` otherwise)."""
        return self.copy_experts(dst, src, keys)


class LocalFleet(Fleet):
    """ShardCores in this process (tests, single-process tools)."""

    def __init__(self, cores: Mapping[int, Any]) -> None:
        self.cores = dict(cores)

    def ranks(self) -> list[int]:
        return sorted(self.cores)

    def call(self, method: str, args: Mapping[int, tuple]) -> dict[int, Any]:
        return {r: getattr(self.cores[r], method)(*a) for r, a in args.items()}

    def copy_experts(self, dst: int, src: int, keys: Sequence[Key]) -> dict[Key, str]:
        return self.cores[dst].import_experts(self.cores[src].export_experts(list(keys)))


__all__ = ["Fleet", "Key", "LocalFleet"]
