"""In-process exchange: every rank of the group lives in this process (one thread per rank).

Used by unit tests and the single-process reference runs; it runs the same SPMD protocol as the
Ray and NCCL backends, through a shared mailbox keyed by (tag, source peer, destination peer).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ray_moe.moe.exchange.base import Exchange, check_splits, split_rows
from ray_moe.moe.exchange.mailbox import Mailbox
from ray_moe.placement.topology import ProcessGroupSpec


class LocalExchangeGroup:
    """A process group whose ranks are threads of this process."""

    def __init__(self, group: ProcessGroupSpec, timeout_s: float = 30.0) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self._mailbox = Mailbox()

    def endpoint(self, rank: int) -> "LocalExchange":
        return LocalExchange(self, rank)

    def run(self, fn: Callable[[Exchange], Any]) -> list[Any]:
        """Run ``fn(endpoint)`` once per member rank concurrently; results in ascending member-rank order.

        The first exception of any rank is re-raised after all ranks finish or time out.
        """
        ranks = sorted(self.group.peer_order)
        with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
            futures = {r: pool.submit(fn, self.endpoint(r)) for r in ranks}
            results: dict[int, Any] = {}
            errors: list[BaseException] = []
            for r in ranks:
                try:
                    results[r] = futures[r].result()
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)
        if errors:
            raise errors[0]
        return [results[r] for r in ranks]


class LocalExchange(Exchange):
    def __init__(self, owner: LocalExchangeGroup, rank: int) -> None:
        self._owner = owner
        self.group = owner.group
        self.rank = rank
        self.group.peer_of(rank)  # validates membership

    @property
    def graph_capturable(self) -> bool:  # type: ignore[override]
        """A group of one exchanges no payload (its dispatcher is local): a step can be captured on CUDA."""
        return self.size == 1

    def all_gather(self, tag: str, vec: np.ndarray) -> np.ndarray:
        me = self.peer
        box = self._owner._mailbox
        for dst in range(self.size):
            box.put((tag, me, dst), np.asarray(vec, dtype=np.int64).copy())
        rows = box.take([(tag, src, me) for src in range(self.size)], self._owner.timeout_s)
        return np.stack(rows)

    def all_to_all_v(
        self,
        tag: str,
        tensors: Mapping[str, torch.Tensor],
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        check_splits("send_splits", tensors, send_splits, self.size)
        me = self.peer
        box = self._owner._mailbox
        chunks = {k: split_rows(t, send_splits) for k, t in tensors.items()}
        for dst in range(self.size):
            box.put((tag, me, dst), {k: c[dst] for k, c in chunks.items()})
        got = box.take([(tag, src, me) for src in range(self.size)], self._owner.timeout_s)
        out: dict[str, torch.Tensor] = {}
        for k, t in tensors.items():
            parts = [g[k] for g in got]
            for src, (part, want) in enumerate(zip(parts, recv_splits)):
                if part.shape[0] != int(want):
                    raise RuntimeError(
                        f"exchange {tag!r}: peer slot {src} sent {part.shape[0]} rows of {k!r}, expected {int(want)}"
                    )
            out[k] = torch.cat(parts, 0) if parts else t[:0]
        return out
