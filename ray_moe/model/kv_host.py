"""The host side of a paged KV step's plan (``model/kv.py``): the chunks' arrays and each chunk's context slots
(``HostChunks``), and ONE int64 buffer per step for every index vector it uploads (``staging`` / ``send``):
written in place (the contexts concatenated straight into it), pinned on CUDA, copied to the device once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class HostChunks:
    """A step's chunks on the host: starts / lens / ends [S] int64 (ends = starts + lens) and ``reads``, each
    chunk's context slots (positions 0 .. end - 1: views of the cache's per-sequence slot arrays)."""

    starts: np.ndarray
    lens: np.ndarray
    ends: np.ndarray
    reads: list[np.ndarray]

    def part(self, a: int, b: int) -> "HostChunks":
        """Chunks ``a .. b - 1``."""
        return HostChunks(self.starts[a:b], self.lens[a:b], self.ends[a:b], self.reads[a:b])

    def read_into(self, out: np.ndarray) -> np.ndarray:
        """The contexts concatenated into ``out[:K]`` (K = the ends' sum); returns that view."""
        view = out[:int(self.ends.sum())]
        if self.reads:
            np.concatenate(self.reads, out=view)
        return view

    def rows_into(self, read: np.ndarray, write: np.ndarray, positions: np.ndarray) -> None:
        """Each new token's position and cache slot (looked up in ``read``, the concatenated contexts) into
        ``positions[:N]`` / ``write[:N]`` (N = the lens' sum, packed order)."""
        n = int(self.lens.sum())
        q_off = np.cumsum(self.lens) - self.lens
        k_off = np.cumsum(self.ends) - self.ends
        pos = np.repeat(self.starts - q_off, self.lens) + np.arange(n, dtype=np.int64)
        positions[:n] = pos
        np.take(read, pos + np.repeat(k_off, self.lens), out=write[:n])


def pad(x: np.ndarray, size: int, fill: int) -> np.ndarray:
    """[size] int64: ``x`` [n <= size] then ``fill``."""
    out = np.full(size, fill, dtype=np.int64)
    out[: x.size] = x
    return out


def staging(sizes: dict[str, int], device: torch.device) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """ONE int64 host buffer for a step's vectors of ``sizes`` (pinned on CUDA, so the upload reads it as it
    is) and a NumPy view of each one's segment, uninitialised: the caller writes every entry."""
    buf = torch.empty(sum(sizes.values()), dtype=torch.int64, pin_memory=device.type == "cuda")
    flat, views, o = buf.numpy(), {}, 0
    for name, size in sizes.items():
        views[name] = flat[o:o + size]
        o += size
    return buf, views


def send(buf: torch.Tensor, sizes: dict[str, int], device: torch.device) -> dict[str, torch.Tensor]:
    """A ``staging`` buffer on ``device`` (one copy, non-blocking from pinned memory), split by ``sizes``."""
    if device.type == "cuda":
        buf = buf.to(device, non_blocking=True)
    else:
        buf = buf.to(device)
    return dict(zip(sizes, torch.split(buf, list(sizes.values()))))


def upload(host: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Int64 host vectors -> device tensors through ONE copy (pinned and non-blocking on CUDA)."""
    sizes = {k: int(np.size(x)) for k, x in host.items()}
    buf, views = staging(sizes, device)
    for k, x in host.items():
        views[k][:] = x
    return send(buf, sizes, device)


__all__ = ["HostChunks", "pad", "send", "staging", "upload"]
