"""Ray object-store exchange: actor-to-actor all-to-all-v on CPU (and the fallback everywhere).

Each rank's ExpertShardActor owns a ``Mailbox``; a peer sends a message by calling the receiving actor's
``deliver(tag, source_peer, payload)`` method (fire and forget). Payloads are dicts of NumPy arrays, so
large ones travel through the object store without pickling tensors. Every peer, zero-count ones
included, gets exactly one message per round: agreement about who sends what never depends on
whether a message happens to be empty.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ray_moe.moe.exchange.base import Exchange, check_splits, split_rows
from ray_moe.moe.exchange.mailbox import Mailbox
from ray_moe.placement.topology import ProcessGroupSpec
from ray_moe.core.wire import pack, wire_to_tensor

class ObjectStoreExchange(Exchange):
    """One rank's endpoint. ``peers`` maps global rank -> actor handle exposing ``deliver``."""

    def __init__(self, rank: int, group: ProcessGroupSpec, peers: Mapping[int, Any], mailbox: Mailbox,
                 *, timeout_s: float, device: torch.device | str = "cpu") -> None:
        self.rank = rank
        self.group = group
        self.peers = dict(peers)
        self.mailbox = mailbox
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        group.peer_of(rank)
        for r in group.peer_order:
            if r != rank and r not in self.peers:
                raise ValueError(f"peers: no actor handle for rank {r} of group {group.group_id!r}")

    def _send(self, tag: str, dst_peer: int, payload: Any) -> None:
        dst = self.group.rank_at(dst_peer)
        me = self.peer
        if dst == self.rank:
            self.mailbox.put((tag, me, dst_peer), payload)
        else:
            self.peers[dst].deliver.remote(tag, me, dst_peer, payload)

    def all_gather(self, tag: str, vec: np.ndarray) -> np.ndarray:
        arr = np.asarray(vec, dtype=np.int64)
        for dst in range(self.size):
            self._send(tag, dst, arr)
        rows = self.mailbox.take([(tag, src, self.peer) for src in range(self.size)], self.timeout_s)
        return np.stack([np.asarray(r, dtype=np.int64) for r in rows])

    def all_to_all_v(
        self,
        tag: str,
        tensors: Mapping[str, torch.Tensor],
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        check_splits("send_splits", tensors, send_splits, self.size)
        chunks = {k: split_rows(t, send_splits) for k, t in tensors.items()}
        me = self.peer
        for dst in range(self.size):
            part = {k: c[dst] for k, c in chunks.items()}
            # the local segment stays a tensor; remote ones travel as NumPy through the object store
            self._send(tag, dst, part if dst == me else pack(part))
        got = self.mailbox.take([(tag, src, me) for src in range(self.size)], self.timeout_s)
        out: dict[str, torch.Tensor] = {}
        for k, t in tensors.items():
            parts = []
            for src, (msg, want) in enumerate(zip(got, recv_splits)):
                part = msg[k] if src == me else wire_to_tensor(*msg[k])
                if part.shape[0] != int(want):
                    raise RuntimeError(
                        f"exchange {tag!r}: peer slot {src} sent {part.shape[0]} rows of {k!r}, expected {int(want)}"
                    )
                parts.append(part)
            out[k] = torch.cat(parts, 0).to(self.device) if parts else t[:0]
        return out
