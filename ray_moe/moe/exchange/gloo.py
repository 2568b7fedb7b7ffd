"""Gloo exchange (torch.distributed) between CPU shard actors: one collective per round instead of one
Ray actor call per peer, for CPU deployments that want speed (``RuntimeConfig(exchange="gloo")``).

Rows travel as raw bytes (``uint8`` views), so every dtype (bf16, fp8, int32) crosses unchanged; uneven
splits use ``all_to_all_single``. The process group is rebuilt when the group changes (a new epoch).
Gloo collectives time out after ``timeout_s``: a dead peer becomes an error, not a hang.
"""

from __future__ import annotations

import datetime
import socket
from typing import Mapping, Sequence

import numpy as np
import torch

from ray_moe.moe.exchange.base import Exchange, check_splits
from ray_moe.core.errors import ExchangeTimeoutError
from ray_moe.placement.topology import ProcessGroupSpec


def free_endpoint() -> tuple[str, int]:
    """(this node's address, a free TCP port) for the rendezvous store hosted by peer slot 0."""
    host = socket.gethostbyname(socket.gethostname())
    with socket.socket() as s:
        s.bind(("", 0))
        return host, int(s.getsockname()[1])


class GlooExchange(Exchange):
    """One rank's endpoint of a gloo process group over ``group`` (peer slot = gloo rank)."""

    def __init__(self, rank: int, group: ProcessGroupSpec, endpoint: tuple[str, int], *, timeout_s: float) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = rank
        self.group = group
        self.timeout_s = timeout_s
        me = group.peer_of(rank)
        if dist.is_initialized():
            dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=timeout_s)
        host, port = endpoint
        self._store = dist.TCPStore(host, int(port), group.size, me == 0, timeout=timeout)
        dist.init_process_group("gloo", store=self._store, rank=me, world_size=group.size, timeout=timeout)

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()

    def _guard(self, what: str, fn):
        try:
            return fn()
        except RuntimeError as exc:  # gloo reports a timed-out or broken peer as a RuntimeError
            raise ExchangeTimeoutError(f"{what}: gloo collective failed on rank {self.rank}: {exc}") from None

    def all_gather(self, tag: str, vec: np.ndarray) -> np.ndarray:
        t = torch.as_tensor(np.asarray(vec, dtype=np.int64))
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._guard(f"exchange {tag!r} (control all-gather)", lambda: self._dist.all_gather(out, t))
        return torch.stack(out).numpy()

    def all_to_all_v(
        self,
        tag: str,
        tensors: Mapping[str, torch.Tensor],
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        check_splits("send_splits", tensors, send_splits, self.size)
        out: dict[str, torch.Tensor] = {}
        n_out = int(sum(int(s) for s in recv_splits))
        for key, t in tensors.items():
            row_shape = tuple(t.shape[1:])
            row_bytes = t.element_size() * int(np.prod(row_shape, dtype=np.int64))
            src = t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)
            dst = torch.empty(n_out, row_bytes, dtype=torch.uint8)
            if row_bytes:
                self._guard(f"exchange {tag!r} ({key})", lambda: self._dist.all_to_all_single(
                    dst, src, output_split_sizes=[int(s) for s in recv_splits],
                    input_split_sizes=[int(s) for s in send_splits]))
            out[key] = dst.view(t.dtype).reshape(n_out, *row_shape)
        return out
