"""NCCL exchange through CuPy (``cupy.cuda.nccl``): all-to-all-v as grouped send/recv on one communicator.

One communicator per process group; its unique id is created by one rank and handed out by the
coordinator. Tensors are exchanged as raw bytes (``ncclUint8``), so every dtype (bf16, fp8, int32)
travels unchanged. NCCL has no timeout: every host wait here polls a CUDA event against a deadline and
calls ``comm.abort()`` when a peer does not show up, so no rank is left inside a collective.
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

import numpy as np
import torch

from ray_moe.moe.exchange.base import Exchange, check_splits
from ray_moe.core.errors import ExchangeTimeoutError
from ray_moe.placement.topology import ProcessGroupSpec


def new_unique_id() -> bytes:
    """A fresh NCCL unique id (bytes in CuPy 14, a tuple of ints in older CuPy)."""
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()
    return bytes(uid) if not isinstance(uid, bytes) else uid


class NcclExchange(Exchange):
    """One rank's endpoint of an NCCL communicator over ``group`` (ranks in peer-slot order)."""

    device_async = True  # post_all_to_all_v enqueues on a stream without a host wait
    graph_capturable = True  # grouped send/recv on the current stream record into a CUDA graph

    def __init__(self, rank: int, group: ProcessGroupSpec, unique_id: bytes, *, timeout_s: float,
                 device: torch.device | str = "cuda") -> None:
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        self.rank = rank
        self.group = group
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uid = unique_id
        try:  # CuPy 14 takes bytes; older versions a tuple of ints
            with cupy.cuda.Device(idx):
                self.comm = nccl.NcclCommunicator(group.size, uid, group.peer_of(rank))
        except TypeError:
            with cupy.cuda.Device(idx):
                self.comm = nccl.NcclCommunicator(group.size, tuple(uid), group.peer_of(rank))
        self._aborted = False
        # wait for payload rounds (watchdog) unless a caller batches them (overlap) or a graph is captured
        self.sync_payload = True
        # NCCL connects peers lazily, on the host, inside the first collective / send-recv to each peer: a
        # peer that died before that would block this host forever, before any watchdog runs. Connect every
        # peer now, under the watchdog, so later rounds only ever wait on the device.
        self.all_gather("connect/control", np.zeros(1, dtype=np.int64))
        one = torch.zeros(self.size, 1, dtype=torch.uint8, device=self.device)
        self.all_to_all_v("connect/p2p", {"x": one}, [1] * self.size, [1] * self.size)

    # -------------------------------------------------------------- watchdog
    def wait(self, what: str) -> None:
        """Block the host until the current stream's work is done, or abort the communicator."""
        ev = torch.cuda.Event()
        ev.record()
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while not ev.query():
            if time.monotonic() > deadline:
                self.abort()
                raise ExchangeTimeoutError(
                    f"{what}: NCCL did not complete within {self.timeout_s:.1f}s on rank {self.rank}; communicator aborted"
                )
            spins += 1
            if spins > 2000:
                time.sleep(5e-5)

    def abort(self) -> None:
        if not self._aborted:
            self._aborted = True
            try:
                self.comm.abort()
            except Exception:  # noqa: BLE001 - best effort during failure handling
                pass

    def close(self) -> None:
        if not self._aborted:
            try:
                self.comm.destroy()
            except Exception:  # noqa: BLE001
                pass
            self._aborted = True

    # -------------------------------------------------------------- collectives
    def all_gather(self, tag: str, vec: np.ndarray) -> np.ndarray:
        arr = np.asarray(vec, dtype=np.int64)
        if self.size == 1:  # a one-rank group agrees with itself: no collective, no host wait
            return arr.reshape(1, -1).copy()
        n = arr.size
        send = torch.as_tensor(arr, device=self.device)
        recv = torch.empty(self.size * n, dtype=torch.int64, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.comm.allGather(send.data_ptr(), recv.data_ptr(), n, self._nccl.NCCL_INT64, stream)
        self.wait(f"exchange {tag!r} (control all-gather)")
        return recv.view(self.size, n).cpu().numpy()

    def all_to_all_v(
        self,
        tag: str,
        tensors: Mapping[str, torch.Tensor],
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        check_splits("send_splits", tensors, send_splits, self.size)
        if self.size == 1:  # every row stays on this rank: no network round, no host wait
            return {k: t.contiguous() for k, t in tensors.items()}
        out = self._enqueue(tensors, send_splits, recv_splits, torch.cuda.current_stream(self.device), None)
        if self.sync_payload and not torch.cuda.is_current_stream_capturing():
            self.wait(f"exchange {tag!r} (all-to-all-v)")  # a dead peer raises here, never hangs a later sync
        return out

    def post_all_to_all_v(
        self,
        tensors: Mapping[str, torch.Tensor],
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        *,
        stream: "torch.cuda.Stream",
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Enqueue one all-to-all-v on ``stream`` and return at once (no host wait: the caller orders
        readers with events and runs ``wait`` once at the end of its step). ``out`` (optional): receive
        buffers ``[sum(recv_splits), ...]`` per key, written in place."""
        check_splits("send_splits", tensors, send_splits, self.size)
        return self._enqueue(tensors, send_splits, recv_splits, stream, out)

    def _enqueue(self, tensors, send_splits, recv_splits, stream, out_buffers) -> dict[str, torch.Tensor]:
        nccl = self._nccl
        send_off = np.concatenate([[0], np.cumsum(np.asarray(send_splits, dtype=np.int64))])
        recv_off = np.concatenate([[0], np.cumsum(np.asarray(recv_splits, dtype=np.int64))])
        out: dict[str, torch.Tensor] = {}
        plans = []
        for key, t in tensors.items():
            t = t.contiguous()
            shape = (int(recv_off[-1]), *t.shape[1:])
            if out_buffers is not None:
                o = out_buffers[key]
                if tuple(o.shape) != shape or o.dtype != t.dtype or not o.is_contiguous():
                    raise ValueError(f"out[{key!r}]: {o.dtype}{tuple(o.shape)} cannot receive {t.dtype}{shape}")
            else:
                with torch.cuda.stream(stream):
                    o = torch.empty(shape, dtype=t.dtype, device=self.device)
            out[key] = o
            row_bytes = t.element_size() * int(np.prod(t.shape[1:], dtype=np.int64))
            plans.append((t, o, row_bytes))
        # one NCCL group per round; the self segment is a send/recv to self inside the group (measured
        # faster than a device copy queued ahead of the group)
        handle = stream.cuda_stream
        nccl.groupStart()
        for t, o, row_bytes in plans:
            if row_bytes == 0:
                continue
            for peer in range(self.size):
                ns = int(send_splits[peer])
                if ns:
                    self.comm.send(t.data_ptr() + int(send_off[peer]) * row_bytes, ns * row_bytes,
                                   nccl.NCCL_UINT8, peer, handle)
                nr = int(recv_splits[peer])
                if nr:
                    self.comm.recv(o.data_ptr() + int(recv_off[peer]) * row_bytes, nr * row_bytes,
                                   nccl.NCCL_UINT8, peer, handle)
        nccl.groupEnd()
        return out

    # -------------------------------------------------------------- point-to-point (weight migration)
    def send(self, tensors: Sequence[torch.Tensor], dest_rank: int) -> int:
        """Send ``tensors`` (in order) to ``dest_rank`` in one NCCL group; returns the bytes sent."""
        nccl = self._nccl
        peer = self.group.peer_of(dest_rank)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        total = 0
        tensors = [t.contiguous() for t in tensors]
        nccl.groupStart()
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                self.comm.send(t.data_ptr(), n, nccl.NCCL_UINT8, peer, stream)
            total += n
        nccl.groupEnd()
        self._keep = tensors  # alive until the caller waits
        return total

    def recv(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], source_rank: int) -> list[torch.Tensor]:
        """Receive tensors of the given (shape, dtype) from ``source_rank`` in one NCCL group."""
        nccl = self._nccl
        peer = self.group.peer_of(source_rank)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        out = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
        nccl.groupStart()
        for t in out:
            n = t.numel() * t.element_size()
            if n:
                self.comm.recv(t.data_ptr(), n, nccl.NCCL_UINT8, peer, stream)
        nccl.groupEnd()
        return out

