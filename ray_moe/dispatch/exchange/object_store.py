"""Ray object-store exchange: actor-to-actor all-to-all-v on CPU (and the fallback everywhere).

Each rank's ExpertShardActor owns a ``Mailbox``; a peer sends a message by calling the receiving actor's
``deliver(tag, source_peer, payload)`` method (fire and forget). Payloads are dicts of NumPy arrays, so
large ones travel through the object store without pickling tensors. Every peer, zero-count ones
included, gets exactly one message per round: agreement about who sends what never depends on
whether a message happens to be empty.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ray_moe.dispatch.exchange.base import Exchange, check_splits, split_rows
from ray_moe.dispatch.exchange.mailbox import Mailbox
from ray_moe.placement.topology import ProcessGroupSpec

_VIEW_AS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def tensor_to_wire(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """Tensor -> (NumPy array, torch dtype name); dtypes NumPy lacks travel as same-width integer views."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    view = _VIEW_AS.get(t.dtype)
    arr = (t.view(view) if view is not None else t).numpy()
    return arr, str(t.dtype).removeprefix("torch.")


def wire_to_tensor(arr: np.ndarray, dtype: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse of ``tensor_to_wire`` (read-only object-store arrays are wrapped without a copy)."""
    want = getattr(torch, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    if t.dtype != want:
        t = t.view(want)
    return t.to(device) if str(device) != "cpu" else t


def pack(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    return {k: tensor_to_wire(v) for k, v in tensors.items()}


def unpack(payload: Mapping[str, tuple[np.ndarray, str]], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    return {k: wire_to_tensor(a, d, device) for k, (a, d) in payload.items()}


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
