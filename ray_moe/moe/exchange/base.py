"""The exchange interface every backend implements (local threads, Ray object store, NCCL).

Two collectives, both over one process group in peer-slot order:

* ``all_gather(tag, vec)``: the control round. Every rank contributes an int64 vector; every rank
  receives the same [P, n] matrix. Counts are agreed here before any payload moves.
* ``all_to_all_v(tag, tensors, send_splits, recv_splits)``: the payload round. ``tensors`` share their
  first (row) axis; rows are sent in contiguous peer segments of ``send_splits``; the result holds
  ``sum(recv_splits)`` rows, source-major in peer order. Zero-count peers stay in both vectors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping, Sequence

import numpy as np
import torch

from ray_moe.placement.topology import ProcessGroupSpec


class Exchange(ABC):
    """One rank's endpoint of a process group."""

    rank: int
    group: ProcessGroupSpec
    # True when the backend can enqueue a payload round on a device stream and return before it completes
    # (``post_all_to_all_v`` + ``wait``: NCCL); False for backends whose rounds complete on return
    device_async: bool = False
    # True when payload rounds can be recorded into a CUDA graph and replayed (NCCL on CUDA)
    graph_capturable: bool = False

    @property
    def peer(self) -> int:
        """This rank's peer slot."""
        return self.group.peer_of(self.rank)

    @property
    def size(self) -> int:
        return self.group.size

    @abstractmethod
    def all_gather(self, tag: str, vec: np.ndarray) -> np.ndarray:
        """vec: [n] int64 -> [P, n] int64, row i from the rank at peer slot i."""

    @abstractmethod
    def all_to_all_v(
        self,
        tag: str,
        tensors: Mapping[str, torch.Tensor],
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        """Variable all-to-all over rows; splits in peer-slot order."""

    def wait(self, what: str) -> None:
        """Block until this endpoint's enqueued rounds completed (under a watchdog where the backend needs
        one); backends whose rounds complete on return have nothing to wait for."""

    def close(self) -> None:  # pragma: no cover - backends override when they hold resources
        """Release communicator resources."""


def split_rows(t: torch.Tensor, splits: Sequence[int]) -> list[torch.Tensor]:
    """Contiguous row segments of ``t`` for each peer."""
    return list(torch.split(t, [int(s) for s in splits], dim=0))


def check_splits(name: str, tensors: Mapping[str, torch.Tensor], splits: Sequence[int], size: int) -> None:
    if len(splits) != size:
        raise ValueError(f"{name}: {len(splits)} entries for a group of {size} peers")
    total = int(sum(int(s) for s in splits))
    for key, t in tensors.items():
        if t.shape[0] != total:
            raise ValueError(f"{name}: tensor {key!r} has {t.shape[0]} rows but splits sum to {total}")
