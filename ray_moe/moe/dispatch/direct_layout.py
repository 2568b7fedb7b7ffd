"""The direct path's host-side layout of one step (``DirectDispatcher``): chunk tables of the split vectors,
the slot maps of a snapshot on the host, and the send / receive block layout derived from the agreed slot
counts. numpy (and one device upload); no communication."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ray_moe.placement.snapshot import PlacementSnapshot


@dataclass(frozen=True)
class _Layout:
    """Host-side layout of one step, derived from the agreed slot counts (all int64 numpy)."""

    send_splits: np.ndarray  # [G] rows this rank sends to each peer (own included)
    recv_splits: np.ndarray  # [G] rows this rank receives from each peer (own included)
    send_chunks: np.ndarray  # [C, G] peer rows per chunk round (own column 0)
    recv_chunks: np.ndarray  # [C, G]
    expert_counts: np.ndarray  # [Q_local]
    em_shift: np.ndarray  # [G * Q_local] expert-major row minus source-major receive row, per (peer, slot)
    em_repeats: np.ndarray  # [G * Q_local] rows per (peer, slot) in source-major receive order
    sent_slot_counts: np.ndarray  # [Q] routes this rank sent to each physical slot


def chunk_bounds(n: int, chunks: int) -> np.ndarray:
    """[chunks + 1] row offsets splitting a segment of ``n`` rows into ``chunks`` near-equal ranges."""
    return (np.arange(chunks + 1, dtype=np.int64) * n) // chunks


def chunk_table(splits: np.ndarray, me: int, chunks: int) -> np.ndarray:
    """[C, G] rows of every peer segment in each chunk round; the own segment never travels (0)."""
    out = np.zeros((chunks, splits.size), dtype=np.int64)
    for g, n in enumerate(splits.tolist()):
        if g != me and n:
            out[:, g] = np.diff(chunk_bounds(int(n), chunks))
    return out


def chunk_major_blocks(splits: np.ndarray, me: int, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks (start row in the peer-major segment layout, length) of the peer rows in chunk-major order
    (chunk, then peer): the order chunk rounds put them on the wire."""
    seg = np.concatenate([[0], np.cumsum(splits)])
    starts, lens = [], []
    bounds = [chunk_bounds(int(n), chunks) for n in splits.tolist()]
    for c in range(chunks):
        for g in range(splits.size):
            if g == me:
                continue
            b = bounds[g]
            starts.append(seg[g] + b[c])
            lens.append(b[c + 1] - b[c])
    return np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)


@dataclass(frozen=True)
class _HostMaps:
    """Host-side maps of one snapshot for one rank (built once per generation and layer).

    slot_peer: [Q] peer slot hosting each physical slot; onehot: [Q, G] int64 (slot -> its peer);
    my_slots: [Q_local] this rank's global slot ids in local (expert-major) order; by_id: [Q_local] the
    local slots in ascending global id (the order they appear in inside every source segment).
    """

    slot_peer: np.ndarray
    onehot: np.ndarray
    my_slots: np.ndarray
    by_id: np.ndarray

    @staticmethod
    def build(snapshot: PlacementSnapshot, rank: int, g_count: int) -> "_HostMaps":
        slot_peer = snapshot.rank_to_peer[snapshot.slot_rank].numpy().astype(np.int64)
        onehot = np.zeros((slot_peer.size, g_count), dtype=np.int64)
        inside = slot_peer >= 0  # slots on ranks outside the group are never selected
        onehot[np.nonzero(inside)[0], slot_peer[inside]] = 1
        my_slots = snapshot.rank_slot_ids(rank).numpy().astype(np.int64)
        return _HostMaps(slot_peer, onehot, my_slots, np.argsort(my_slots, kind="stable"))


def build_layout(slot_counts: np.ndarray, maps: _HostMaps, me: int, chunks: int) -> _Layout:
    """Host layout of rank ``me`` from the agreed per-slot count matrix ``slot_counts`` [G, Q] (routes each
    peer sends to each physical slot). A source sends its rows for this rank sorted by global slot id (the
    send-order key), so within one source segment the local slots appear in ``maps.by_id`` order.
    """
    per_peer = slot_counts @ maps.onehot  # [src, dst]
    send_splits, recv_splits = per_peer[me], per_peer[:, me]
    m = slot_counts[:, maps.my_slots]  # [G, Q_local] rows from each source per local slot
    expert_counts = m.sum(axis=0)
    em_off = np.cumsum(expert_counts) - expert_counts
    base = em_off[None, :] + np.cumsum(m, axis=0) - m  # first expert-major row of (source, slot)
    m_id = m[:, maps.by_id]
    seg_start_in_src = np.cumsum(m_id, axis=1) - m_id  # offset of (source, slot) inside the segment
    recv_seg = np.cumsum(recv_splits) - recv_splits
    shift = base[:, maps.by_id] - seg_start_in_src - recv_seg[:, None]
    return _Layout(send_splits=send_splits, recv_splits=recv_splits,
                   send_chunks=chunk_table(send_splits, me, chunks), recv_chunks=chunk_table(recv_splits, me, chunks),
                   expert_counts=expert_counts, em_shift=shift.reshape(-1), em_repeats=m_id.reshape(-1),
                   sent_slot_counts=slot_counts[me])


def _blocks_index(starts: np.ndarray, lens: np.ndarray, total: int, device: torch.device) -> torch.Tensor:
    """[total] int64: the rows of the given blocks, concatenated (one repeat_interleave, no host sync)."""
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    out_start = np.concatenate([[0], np.cumsum(lens)[:-1]])
    shift = _to_device(starts - out_start, device)
    return torch.arange(total, device=device) + torch.repeat_interleave(shift, _to_device(lens, device),
                                                                        output_size=total)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ------------------------------------------------------------------------------------------------------
#  the dispatcher
# ------------------------------------------------------------------------------------------------------
