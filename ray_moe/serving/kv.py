"""A paged KV cache that transformers' attention layers write and read through their ``cache.update`` seam.

One cache per rank, one block pool for every sequence on it. A sequence owns a list of fixed-size blocks;
token position ``p`` of a sequence lives in cache slot ``block[p // B] * B + p % B``. A step packs the new
tokens of every sequence into one ``[1, N]`` batch (prefill chunks and decode tokens side by side); each
attention layer calls ``cache.update(a [1, H_a, N, D_a], b [1, H_b, N, D_b], layer_idx, kwargs=...)``, which
writes the new tokens at their slots and returns every sequence's whole context ``[1, H, K, D]`` in packed
order; a block-diagonal causal mask ``[1, 1, N, K]`` (``StepLayout.mask``) keeps sequences apart. The two
tensors are whatever the layer caches (keys and values; DeepSeek's MLA caches its compressed latent and rotary
key), allocated at the first update with the shapes that arrive. No attention kernel is written here:
transformers' own eager / SDPA attention runs on the gathered context.

Writes are positional, so a step that is rerun (a stale generation, an overflowed bucket) rewrites the same
slots with the same values: sequence bookkeeping only changes through ``reserve`` and ``free``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ray_moe.errors import RayMoEError


class KVBudgetError(RayMoEError, ValueError):
    """A sequence needs more cache blocks than the rank's budget has (named sequence, tokens, budget)."""


@dataclass(frozen=True)
class SeqChunk:
    """The new tokens of one sequence in one step: positions ``start .. start + len(tokens) - 1``."""

    seq_id: str
    start: int
    num_tokens: int


@dataclass(frozen=True, eq=False)
class StepLayout:
    """Where one step's tokens go and what they read (all int64 on the cache's device).

    write_index: [N] cache slot of each new token (packed order)
    read_index:  [K] cache slots of every sequence's context (positions 0 .. end), sequence after sequence
    positions:   [N] position of each new token in its sequence (rotary embeddings)
    mask:        [1, 1, N, K] additive float mask (0 attend, dtype min elsewhere): block-diagonal causal
    last:        [S] packed index of each sequence's last new token (where its next token is sampled), or
                 None: every row is one sequence's only new token (a decode step)
    """

    write_index: torch.Tensor
    read_index: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    last: torch.Tensor | None


class PagedKVCache:
    """Per-rank paged cache: ``num_blocks`` blocks of ``block_size`` token slots, shared by every layer's
    two tensors. ``update`` is the transformers ``Cache.update`` seam (duck-typed: the model only calls
    ``update`` with a 4D mask given)."""

    is_compileable = False

    def __init__(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: both must be >= 1")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.device = torch.device(device)
        self.dtype = dtype
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() gives the lowest id
        self._blocks: dict[str, list[int]] = {}
        self._store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layout: StepLayout | None = None

    # ------------------------------------------------------------------ bookkeeping
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.block_size)

    def held(self, seq_id: str) -> int:
        """Blocks held by ``seq_id``."""
        return len(self._blocks.get(seq_id, ()))

    def can_reserve(self, seq_id: str, end: int) -> bool:
        return self.blocks_for(end) - self.held(seq_id) <= len(self._free)

    def reserve(self, seq_id: str, end: int) -> None:
        """Make positions ``0 .. end - 1`` of ``seq_id`` addressable (idempotent; never shrinks)."""
        need = self.blocks_for(end) - self.held(seq_id)
        if need <= 0:
            return
        if need > len(self._free):
            raise KVBudgetError(f"sequence {seq_id!r}: {end} tokens need {self.blocks_for(end)} cache blocks of "
                                f"{self.block_size}; {len(self._free)} free of {self.num_blocks} on this rank")
        blocks = self._blocks.setdefault(seq_id, [])
        for _ in range(need):
            blocks.append(self._free.pop())

    def free(self, seq_id: str) -> None:
        for b in self._blocks.pop(seq_id, ()):
            self._free.append(b)
        self._free.sort(reverse=True)

    def sequences(self) -> list[str]:
        return sorted(self._blocks)

    def slots(self, seq_id: str, start: int, stop: int) -> torch.Tensor:
        """[stop - start] int64 cache slots of positions ``start .. stop - 1`` (host tensor)."""
        blocks = torch.tensor(self._blocks.get(seq_id, ()), dtype=torch.int64)
        pos = torch.arange(start, stop, dtype=torch.int64)
        if stop > start and (blocks.numel() * self.block_size) < stop:
            raise KVBudgetError(f"sequence {seq_id!r}: position {stop - 1} was never reserved")
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    # ------------------------------------------------------------------ one step
    @property
    def trash_slot(self) -> int:
        """A slot no sequence owns: padding tokens of a captured step write and read it."""
        return self.capacity_tokens

    def plan(self, chunks: Sequence[SeqChunk], mask_dtype: torch.dtype) -> StepLayout:
        """The layout of one step (reserve every chunk's positions first). Host work, one upload."""
        write, read, positions, allowed, last = self._host_plan(chunks)
        mask = torch.zeros(allowed.shape, dtype=mask_dtype)
        mask.masked_fill_(~allowed, torch.finfo(mask_dtype).min)
        dev = self.device
        layout = StepLayout(write_index=write.to(dev), read_index=read.to(dev), positions=positions.to(dev),
                            mask=mask[None, None].to(dev), last=last.to(dev))
        self.layout = layout
        return layout

    def plan_padded(self, chunks: Sequence[SeqChunk], rows: int, keys: int, mask_dtype: torch.dtype
                    ) -> dict[str, torch.Tensor]:
        """A one-token-per-sequence (decode) step padded to ``rows`` tokens and ``keys`` context slots: the
        static shapes of a captured step. Padding tokens write the trash slot and attend only to key 0 (their
        outputs are never read; their routes are masked); padding keys read the trash slot and are masked.
        Returns device tensors: write_index [rows], read_index [keys], positions [rows], mask [1, 1, rows,
        keys], row_valid [rows] bool."""
        write, read, positions, allowed, _ = self._host_plan(chunks)
        n, k = int(write.numel()), int(read.numel())
        if n > rows or k > keys:
            raise ValueError(f"rows={rows}, keys={keys}: the step has {n} tokens and {k} context slots")
        pad_w = torch.full((rows,), self.trash_slot, dtype=torch.int64)
        pad_w[:n] = write
        pad_r = torch.full((keys,), self.trash_slot, dtype=torch.int64)
        pad_r[:k] = read
        pos = torch.zeros(rows, dtype=torch.int64)
        pos[:n] = positions
        ok = torch.zeros(rows, keys, dtype=torch.bool)
        ok[:n, :k] = allowed
        ok[n:, 0] = True
        mask = torch.zeros(rows, keys, dtype=mask_dtype)
        mask.masked_fill_(~ok, torch.finfo(mask_dtype).min)
        valid = torch.arange(rows) < n
        dev = self.device
        return {"write_index": pad_w.to(dev), "read_index": pad_r.to(dev), "positions": pos.to(dev),
                "mask": mask[None, None].to(dev), "row_valid": valid.to(dev)}

    def _host_plan(self, chunks: Sequence[SeqChunk]):
        """(write [N], read [K], positions [N], allowed [N, K] bool, last [S]) on the host."""
        writes, reads, positions, q_seq, k_seq, q_pos, k_pos, last = [], [], [], [], [], [], [], []
        n = 0
        for i, c in enumerate(chunks):
            end = c.start + c.num_tokens
            writes.append(self.slots(c.seq_id, c.start, end))
            reads.append(self.slots(c.seq_id, 0, end))
            pos = torch.arange(c.start, end, dtype=torch.int64)
            positions.append(pos)
            q_seq.append(torch.full((c.num_tokens,), i, dtype=torch.int64))
            q_pos.append(pos)
            k_seq.append(torch.full((end,), i, dtype=torch.int64))
            k_pos.append(torch.arange(end, dtype=torch.int64))
            n += c.num_tokens
            last.append(n - 1)
        cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64))
        qs, qp, ks, kp = cat(q_seq), cat(q_pos), cat(k_seq), cat(k_pos)
        allowed = (qs[:, None] == ks[None, :]) & (kp[None, :] <= qp[:, None])
        return cat(writes), cat(reads), cat(positions), allowed, torch.tensor(last, dtype=torch.int64)

    def update(self, a: torch.Tensor, b: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' seam: a [1, H_a, N, D_a], b [1, H_b, N, D_b] new tokens -> the packed contexts
        [1, H_a, K, D_a], [1, H_b, K, D_b] (this step's tokens included)."""
        lay = self.layout
        if lay is None:
            raise RuntimeError("PagedKVCache.update outside a planned step")
        store = self._store.get(layer_idx)
        if store is None:
            store = tuple(torch.zeros(self.capacity_tokens + 1, x.shape[1], x.shape[3], dtype=x.dtype,
                                      device=self.device) for x in (a, b))  # + the trash slot
            self._store[layer_idx] = store
        out = []
        for x, buf in zip((a, b), store):
            buf.index_copy_(0, lay.write_index, x[0].transpose(0, 1).to(buf.dtype))
            out.append(buf.index_select(0, lay.read_index).transpose(0, 1).unsqueeze(0))
        return out[0], out[1]

    # transformers may ask a cache for its length (only when positions are not given: never here)
    def get_seq_length(self, layer_idx: int = 0) -> int:  # pragma: no cover - positions are always given
        return 0

    def bytes_per_token(self) -> int:
        return sum(t.shape[1] * t.shape[2] * t.element_size() for s in self._store.values() for t in s)


__all__ = ["PagedKVCache", "StepLayout", "SeqChunk", "KVBudgetError"]
