"""A paged KV cache that transformers' attention layers write and read through their ``cache.update`` seam.

One cache per rank, one block pool for every sequence on it. A sequence owns a list of fixed-size blocks;
token position ``p`` of a sequence lives in cache slot ``block[p // B] * B + p % B``. A step packs the new
tokens of every sequence into one ``[1, N]`` batch (prefill chunks and decode tokens side by side); each
attention layer calls ``cache.update(a [1, H_a, N, D_a], b [1, H_b, N, D_b], layer_idx, kwargs=...)``, which
writes the new tokens at their slots and returns every sequence's whole context ``[1, H, K, D]`` in packed
order; a block-diagonal causal mask ``[1, 1, N, K]`` (``StepLayout.mask``) keeps sequences apart. The two
tensors are whatever the layer caches (keys and values; DeepSeek's MLA caches its compressed latent and rotary
key), allocated at the first update with the shapes that arrive. No attention kernel is written here:
transformers' own SDPA attention runs on the gathered context with the mask (the MASKED backend), or the
varlen backend (``model/attention.py``) runs FlashAttention per sequence from the plan's ``cu_q`` / ``cu_k``
(no mask is built: ``plan(..., varlen=True)``).

Writes are positional, so a step that is rerun (a stale generation, an overflowed bucket) rewrites the same
slots with the same values: sequence bookkeeping only changes through ``reserve``, ``free``, ``attach`` and
``register``.

Prefix caching (``model/prefix_cache.py``): blocks are reference counted; a full block whose content is written
is named by a chained hash of its tokens (``register``), and a new sequence with the same leading tokens holds
those blocks instead of computing them (``attach``). A freed block that has a name stays cached (found by hash)
until the pool needs it (LRU): ``free_blocks`` counts it as available, so the budget is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ray_moe.core.errors import RayMoEError
from ray_moe.model.kv_host import HostChunks, pad, plan_decode_steps, send, staging, upload
from ray_moe.model.prefix_cache import BlockPool


class KVBudgetError(RayMoEError, ValueError):
    """A sequence needs more cache blocks than the rank's budget has (named sequence, tokens, budget)."""


@dataclass(frozen=True)
class SeqChunk:
    """The new tokens of one sequence in one step: positions ``start .. start + len(tokens) - 1``."""

    seq_id: str
    start: int
    num_tokens: int


class Chunk(Protocol):
    """What a step's plan reads of each chunk: a ``SeqChunk``, or any record with the same three (a shard's
    resolved work item: no ``SeqChunk`` built per sequence per step)."""

    @property
    def seq_id(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True, eq=False)
class StepLayout:
    """Where one step's tokens go and what they read (all int64 on the cache's device).

    write_index: [N] cache slot of each new token (packed order)
    read_index:  [K] cache slots of every sequence's context (positions 0 .. end), sequence after sequence;
                 or [B, K] for a batched decode step (one row per sequence, ``plan_batched``)
    positions:   [N] position of each new token in its sequence (rotary embeddings)
    mask:        [1, 1, N, K] additive float mask (0 attend, dtype min elsewhere): block-diagonal causal; None
                 for one sequence from position 0 (transformers builds its causal mask)
    last:        [S] packed index of each sequence's last new token (where its next token is sampled), or
                 None: every row is one sequence's only new token (a decode step)
    cu_q, cu_k:  [S' + 1] int32 query-row / context offsets of each sequence (a varlen plan; mask is then None;
                 a padded plan counts its padding sequences in S'), or None
    max_q, max_k: the longest query run and context of a varlen plan (host ints, upper bounds)
    single_rows: the leading query rows that are sequences of one row each (a varlen plan whose one-row
                 sequences come first: attention runs them in a decode-shaped call of their own, so a prefill
                 chunk's long query run does not size the kernel's grid for every decode row); 0: one call
    paged:       a varlen decode step (one row per sequence) whose attention reads the cache in place:
                 ``update`` writes the new tokens and returns the cache tensors themselves, ``read_index``
                 names each sequence's slots (``model/paged_decode.py``); nothing is gathered
    paged_keys:  a split varlen step (``single_rows`` > 0) with ``paged``: its one-row group reads the cache in
                 place through ``read_index[:paged_keys]`` (offsets ``cu_k[:single_rows + 1]``) and only the
                 other chunks' contexts, ``read_index[paged_keys:]``, are gathered (offsets
                 ``cu_k[single_rows + 1:]`` from 0); 0: the whole context is gathered
    k_end:       [S'] int32 (a paged decode step whose segments have room after them: ``plan_decode_steps``):
                 sequence i's context is ``read_index[cu_k[i]:k_end[i]]``; None: ``cu_k[i + 1]`` ends it
    """

    write_index: torch.Tensor
    read_index: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None
    last: torch.Tensor | None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    single_rows: int = 0
    paged: bool = False
    paged_keys: int = 0
    k_end: torch.Tensor | None = None


def leading_single_rows(chunks: Sequence[Chunk]) -> int:
    """How many chunks at the front of ``chunks`` have one new token each."""
    n = 0
    for c in chunks:
        if c.num_tokens != 1:
            break
        n += 1
    return n


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
        self.pool = BlockPool(self.num_blocks)  # free / held / cached blocks (``model/prefix_cache.py``)
        self._blocks: dict[str, list[int]] = {}
        # per sequence: the hashes of its leading blocks whose content is written and named (``register``,
        # ``attach``): they may be shared, and a rerun step need not compute them again
        self._valid: dict[str, list[int]] = {}
        self._slot_arr: dict[str, np.ndarray] = {}  # [held blocks * B] slot of each reserved position
        self._store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layout: StepLayout | None = None

    # ------------------------------------------------------------------ bookkeeping
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def allocated_bytes(self) -> int:
        """Bytes of the cache tensors allocated so far (each layer's at its first step)."""
        return sum(t.nbytes for pair in self._store.values() for t in pair)

    @property
    def free_blocks(self) -> int:
        """Blocks a reservation may take: free ones and cached ones (prefix caching evicts those on demand)."""
        return self.pool.available

    def blocks_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.block_size)

    def held(self, seq_id: str) -> int:
        """Blocks held by ``seq_id``."""
        return len(self._blocks.get(seq_id, ()))

    def can_reserve(self, seq_id: str, end: int) -> bool:
        return self.blocks_for(end) - self.held(seq_id) <= self.pool.available

    def reserve(self, seq_id: str, end: int) -> None:
        """Make positions ``0 .. end - 1`` of ``seq_id`` addressable (idempotent; never shrinks)."""
        arr = self._slot_arr.get(seq_id)  # [held blocks * B]: nothing to do when it covers ``end`` already
        if arr is not None and arr.size >= end:
            return
        need = self.blocks_for(end) - self.held(seq_id)
        if need <= 0:
            return
        if need > self.pool.available:
            raise KVBudgetError(f"sequence {seq_id!r}: {end} tokens need {self.blocks_for(end)} cache blocks of "
                                f"{self.block_size}; {self.pool.available} free of {self.num_blocks} on this rank")
        blocks = self._blocks.setdefault(seq_id, [])
        for _ in range(need):
            blocks.append(self.pool.take())
        self._index(seq_id, need)

    def _index(self, seq_id: str, new: int) -> None:
        """The slot of every reserved position, kept per sequence: the slots of its ``new`` last blocks appended."""
        blocks = self._blocks[seq_id]
        b = np.asarray(blocks[len(blocks) - new:], dtype=np.int64)
        add = (b[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
        old = self._slot_arr.get(seq_id)
        self._slot_arr[seq_id] = add if old is None else np.concatenate([old, add])

    def free(self, seq_id: str) -> None:
        """Drop ``seq_id``'s blocks: a block no other sequence holds becomes free, or cached when its content
        is named (findable by hash until the pool needs it)."""
        self.pool.release(self._blocks.pop(seq_id, ()))
        self._slot_arr.pop(seq_id, None)
        self._valid.pop(seq_id, None)

    # ------------------------------------------------------------------ prefix caching (bookkeeping)
    def valid_hashes(self, seq_id: str) -> list[int]:
        """The hashes of ``seq_id``'s leading blocks with written, named content (a copy)."""
        return list(self._valid.get(seq_id, ()))

    def valid_tokens(self, seq_id: str) -> int:
        """Positions ``0 .. n - 1`` of ``seq_id`` hold written, named content (n, a multiple of the block)."""
        return len(self._valid.get(seq_id, ())) * self.block_size

    def attach(self, seq_id: str, hashes: Sequence[int]) -> int:
        """Extend ``seq_id`` with the cached blocks named ``hashes`` (chained on from its valid blocks), in
        order up to the first one not cached: each attached block's reference count goes up instead of a block
        being allocated. Only while the sequence holds nothing past its valid blocks (else 0: its next
        positions have blocks of their own). Returns the blocks attached."""
        blocks = self._blocks.get(seq_id, [])
        valid = self._valid.get(seq_id, [])
        if len(blocks) != len(valid):
            return 0
        got = []
        for h in hashes:
            b = self.pool.find(h)
            if b is None:
                break
            self.pool.share(b)
            got.append(b)
        if got:
            self._blocks.setdefault(seq_id, []).extend(got)
            self._valid.setdefault(seq_id, []).extend(hashes[:len(got)])
            self._index(seq_id, len(got))
        return len(got)

    def register(self, seq_id: str, hashes: Sequence[int]) -> None:
        """``seq_id``'s next blocks after its valid ones now hold written content named ``hashes`` (chained):
        each is registered for sharing (unless another block already holds that content) and counts as valid."""
        blocks = self._blocks.get(seq_id, [])
        valid = self._valid.setdefault(seq_id, [])
        if len(valid) + len(hashes) > len(blocks):
            raise KVBudgetError(f"sequence {seq_id!r}: {len(valid) + len(hashes)} blocks registered, "
                                f"{len(blocks)} held")
        for h in hashes:
            self.pool.register(blocks[len(valid)], h)
            valid.append(h)

    def sequences(self) -> list[str]:
        return sorted(self._blocks)

    def slots(self, seq_id: str, start: int, stop: int) -> np.ndarray:
        """[stop - start] int64 cache slots of positions ``start .. stop - 1`` (host array)."""
        arr = self._slot_arr.get(seq_id)
        if stop > start and (arr is None or arr.size < stop):
            raise KVBudgetError(f"sequence {seq_id!r}: position {stop - 1} was never reserved")
        return np.zeros(0, dtype=np.int64) if stop <= start else arr[start:stop]

    # ------------------------------------------------------------------ one step
    @property
    def trash_slot(self) -> int:
        """A slot no sequence owns: padding tokens of a captured step write and read it."""
        return self.capacity_tokens

    def plan(self, chunks: Sequence[Chunk], mask_dtype: torch.dtype, *, varlen: bool = False,
             paged: bool = False) -> StepLayout:
        """The layout of one step (reserve every chunk's positions first): index vectors built on the host
        (numpy, no per-token Python), uploaded once; the mask is built on the device. ``varlen``: no mask, the
        per-sequence offsets instead (one sequence per chunk). ``paged`` (varlen): a step of one-token chunks
        only reads the cache in place (``StepLayout.paged``)."""
        v = self._host_plan(chunks, mask=not varlen)
        dev = self.device
        if varlen:
            lens, ends = v["lens"], v["ends"]
            up = upload({"write": v["write"], "read": v["read"], "q_pos": v["q_pos"], "last": v["last"],
                          "cu_q": np.concatenate([[0], np.cumsum(lens)]), "cu_k": np.concatenate([[0], np.cumsum(ends)])},
                         dev)
            single = leading_single_rows(chunks)
            layout = StepLayout(write_index=up["write"], read_index=up["read"], positions=up["q_pos"], mask=None,
                                last=up["last"], cu_q=up["cu_q"].to(torch.int32), cu_k=up["cu_k"].to(torch.int32),
                                max_q=int(lens.max(initial=1)), max_k=int(ends.max(initial=1)),
                                single_rows=single if 0 < single < len(chunks) else 0,
                                paged=paged and 0 < single == len(chunks))
            self.layout = layout
            return layout
        up = {k: torch.from_numpy(v[k]).to(dev) for k in ("write", "read", "q_seq", "q_pos", "k_seq", "k_pos", "last")}
        # one sequence from its first position: the plain causal case, left to transformers' own mask (SDPA
        # then runs its causal kernels instead of a dense additive mask)
        plain = len(chunks) == 1 and chunks[0].start == 0
        layout = StepLayout(write_index=up["write"], read_index=up["read"], positions=up["q_pos"],
                            mask=None if plain else _mask(up["q_seq"], up["q_pos"], up["k_seq"], up["k_pos"], mask_dtype),
                            last=up["last"])
        self.layout = layout
        return layout

    def plan_padded(self, chunks: Sequence[Chunk], rows: int, keys: int, mask_dtype: torch.dtype, *,
                    last_rows: int | None = None, plain: bool = False, varlen: bool = False,
                    single_rows: int = 0, paged_keys: int = 0,
                    extra: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
        """A step padded to ``rows`` tokens and ``keys`` context slots: the static shapes of a captured step.
        Padding tokens write the trash slot and attend only to key 0 (their outputs are never read; their
        routes are masked); padding keys read the trash slot and are masked.
        Returns device tensors: write_index [rows], read_index [keys], positions [rows], row_valid [rows] bool,
        and mask [1, 1, rows, keys] (absent when ``plain``: one sequence from position 0, keys == rows,
        transformers' causal mask; padding rows then come after every real one). ``last_rows``: also
        ``last`` [last_rows], the packed row of each sequence's last new token (padding entries row 0);
        None: one token per sequence, every row is sampled (a decode step). ``extra``: more int64 host vectors
        to upload with the plan (one host-to-device copy for all of them). ``varlen``: no mask; ``cu_q`` /
        ``cu_k`` [S' + 1] int32 instead, of a static sequence count S' (see ``varlen_offsets``). ``single_rows``
        (varlen prefill): the first ``single_rows`` rows are a group of one-row sequences (the chunks of one token
        at the front of ``chunks``, padded with one-row sequences of one trash key), the rest the other chunks
        padded to ``rows``; ``last_rows`` then counts both groups' sequences. ``paged_keys`` (with
        ``single_rows``): the one-row group's slots first, padded to ``paged_keys`` (read in place), then the
        other chunks' contexts padded to ``keys`` (gathered; ``StepLayout.paged_keys``)."""
        if single_rows:
            if not (varlen and last_rows is not None):
                raise ValueError("single_rows: a varlen prefill plan (last_rows given)")
            return self._plan_split_varlen(chunks, rows, keys, last_rows, single_rows, extra, paged_keys)
        if paged_keys:
            raise ValueError(f"paged_keys={paged_keys}: a split varlen plan (single_rows given)")
        c = self._chunks(chunks)
        n, k = int(c.lens.sum()), int(c.ends.sum())
        pad_keys = (rows - n) if (varlen and last_rows is None) else 0  # a decode row of padding reads one key
        if n > rows or k + pad_keys > keys or (last_rows is not None and len(chunks) > last_rows):
            raise ValueError(f"rows={rows}, keys={keys}, last_rows={last_rows}: the step has {n} tokens, {k} "
                             f"context slots{f' (+{pad_keys} padding keys)' if pad_keys else ''} and "
                             f"{len(chunks)} sequences")
        if varlen:
            return self._plan_padded_varlen(c, rows, keys, last_rows, extra)
        v = self._host_plan(chunks, gathered=c)
        if plain and not (len(chunks) == 1 and chunks[0].start == 0 and rows == keys):
            raise ValueError("plain: one sequence from position 0 with keys == rows")

        host = {"write_index": pad(v["write"], rows, self.trash_slot), "read_index": pad(v["read"], keys, self.trash_slot),
                "positions": pad(v["q_pos"], rows, 0)}
        if last_rows is not None:
            host["last"] = pad(v["last"], last_rows, 0)
        if not plain:
            # padding queries are sequence -1, padding keys sequence -2: they match nothing (the padding
            # queries get key 0 below); real queries never see a padding key
            host.update(q_seq=pad(v["q_seq"], rows, -1), k_seq=pad(v["k_seq"], keys, -2), k_pos=pad(v["k_pos"], keys, 0))
        else:  # padding rows continue the sequence's positions (a causal mask keeps them after the real ones)
            host["positions"] = np.arange(rows, dtype=np.int64)
        host.update(extra or {})
        dev = self.device
        up = upload(host, dev)
        row_valid = torch.arange(rows, device=dev) < n
        out = {"write_index": up["write_index"], "read_index": up["read_index"], "positions": up["positions"],
               "row_valid": row_valid, **{k: up[k] for k in extra or {}}}
        if last_rows is not None:
            out["last"] = up["last"]
        if not plain:
            allowed = _allowed(up["q_seq"], up["positions"], up["k_seq"], up["k_pos"])
            allowed[:, 0] |= ~row_valid  # a padding query attends key 0 only (no empty softmax row)
            out["mask"] = _additive(allowed, mask_dtype)[None, None]
        return out

    def _plan_padded_varlen(self, c: HostChunks, rows: int, keys: int, last_rows: int | None,
                            extra: dict[str, np.ndarray] | None) -> dict[str, torch.Tensor]:
        """``plan_padded`` for the varlen backend: padding tokens write and read the trash slot; the offsets
        come from ``varlen_offsets``; no mask. Every vector is written once, into the step's one upload buffer:
          1. the segments: write / read / positions, the offsets, ``last``, ``extra``
          2. the contexts concatenated into ``read_index``, then the token rows (write slots, positions)
          3. padding, offsets, one upload"""
        n, k, trash = int(c.lens.sum()), int(c.ends.sum()), self.trash_slot
        cu_q, cu_k = varlen_offsets(c.lens, c.ends, rows, keys, last_rows)
        sizes = {"write_index": rows, "read_index": keys, "positions": rows, "cu_q": cu_q.size, "cu_k": cu_k.size,
                 **({} if last_rows is None else {"last": last_rows}), **{x: v.size for x, v in (extra or {}).items()}}
        buf, host = staging(sizes, self.device)
        read = c.read_into(host["read_index"])
        host["read_index"][k:] = trash
        c.rows_into(read, host["write_index"], host["positions"])
        host["write_index"][n:], host["positions"][n:] = trash, 0
        host["cu_q"][:], host["cu_k"][:] = cu_q, cu_k
        if last_rows is not None:
            host["last"][:c.lens.size] = np.cumsum(c.lens) - 1
            host["last"][c.lens.size:] = 0
        for x, v in (extra or {}).items():
            host[x][:] = v
        up = send(buf, sizes, self.device)
        out = {"write_index": up["write_index"], "read_index": up["read_index"], "positions": up["positions"],
               "row_valid": torch.arange(rows, device=self.device) < n, "cu_q": up["cu_q"].to(torch.int32),
               "cu_k": up["cu_k"].to(torch.int32), **{k: up[k] for k in extra or {}}}
        if last_rows is not None:
            out["last"] = up["last"]
        return out

    def _plan_split_varlen(self, chunks: Sequence[Chunk], rows: int, keys: int, last_rows: int, single: int,
                           extra: dict[str, np.ndarray] | None, paged_keys: int = 0) -> dict[str, torch.Tensor]:
        """``plan_padded`` for a varlen prefill step in two groups (static shapes):

          rows:  [one-row sequences | their padding rows (to ``single``) | other chunks | padding (to ``rows``)]
          keys:  [their contexts | one trash key per padding row | the chunks' contexts | padding (to ``keys``)]
          1. the leading one-row chunks and ``single - nd`` one-row padding sequences: the decode group
             (``single`` sequences, each one row; ``varlen_offsets``' decode layout)
          2. the other chunks, one padding sequence with every padding row and no key, empty sequences up to
             ``last_rows - single`` (``varlen_offsets``' prefill layout), offsets shifted past group 1
        ``last`` [last_rows]: group 1's rows, then each chunk's last row (padding entries row 0).
        ``paged_keys``: group 1 reads the cache in place: keys = [its slots and padding keys (to ``paged_keys``) |
        the chunks' contexts (to ``keys``)], and group 2's key offsets start from 0 (``cu_k`` [single + 1 + S2 + 1])."""
        nd = leading_single_rows(chunks)
        c = self._chunks(chunks)
        lens, ends = c.lens, c.ends
        n, k, kd = int(lens.sum()), int(ends.sum()), int(ends[:nd].sum())
        pad1 = single - nd
        keys_fit = (kd + pad1 <= paged_keys and k - kd <= keys) if paged_keys else k + pad1 <= keys
        if (nd > single or n - nd > rows - single or len(chunks) - nd > last_rows - single
                or not keys_fit):
            raise ValueError(f"rows={rows}, keys={keys}, last_rows={last_rows}, single_rows={single}, "
                             f"paged_keys={paged_keys}: the step has {nd} one-row sequences first ({kd} context "
                             f"slots), {n} tokens, {k} context slots and {len(chunks)} sequences")
        trash = self.trash_slot
        cq1, ck1 = varlen_offsets(lens[:nd], ends[:nd], single, kd + pad1, None)
        cq2, ck2 = varlen_offsets(lens[nd:], ends[nd:], rows - single, keys - (0 if paged_keys else kd + pad1),
                                  last_rows - single)
        # group 2's keys start past group 1's (read in place: padded to ``paged_keys``; else its padding keys)
        off2 = paged_keys if paged_keys else kd + pad1
        cu_k = np.concatenate([ck1, ck2]) if paged_keys else np.concatenate([ck1, ck2[1:] + off2])
        cu_q = np.concatenate([cq1, cq2[1:] + single])
        sizes = {"write_index": rows, "read_index": paged_keys + keys if paged_keys else keys, "positions": rows,
                 "cu_q": cu_q.size, "cu_k": cu_k.size, "last": last_rows, "row_valid": rows,
                 **{x: v.size for x, v in (extra or {}).items()}}
        buf, host = staging(sizes, self.device)
        read, write, pos = host["read_index"], host["write_index"], host["positions"]
        read[:], write[:], pos[:] = trash, trash, 0  # padding everywhere, then each group's real entries
        for g, r0, k0 in ((c.part(0, nd), 0, 0), (c.part(nd, len(chunks)), single, off2)):
            g.rows_into(g.read_into(read[k0:]), write[r0:], pos[r0:])
        host["cu_q"][:], host["cu_k"][:] = cu_q, cu_k
        last = host["last"]
        last[:] = 0
        last[:nd] = np.arange(nd)
        last[nd:len(chunks)] = np.cumsum(lens)[nd:] - 1 + pad1
        real = host["row_valid"]
        real[:] = 0
        real[:nd] = 1
        real[single:single + n - nd] = 1
        for x, v in (extra or {}).items():
            host[x][:] = v
        up = send(buf, sizes, self.device)
        out = {"write_index": up["write_index"], "read_index": up["read_index"], "positions": up["positions"],
               "row_valid": up["row_valid"] != 0, "cu_q": up["cu_q"].to(torch.int32),
               "cu_k": up["cu_k"].to(torch.int32), "last": up["last"], **{x: up[x] for x in extra or {}}}
        return out

    def plan_decode_steps(self, chunks: Sequence[Chunk], rows: int, keys: int, steps: int, *,
                          extra: dict[str, np.ndarray] | None = None) -> list[dict[str, torch.Tensor]]:
        """A paged varlen decode step (one token per chunk, reserved ``steps - 1`` positions past it) and its
        ``steps - 1`` sub-steps, planned with one upload (``kv_host.plan_decode_steps``): one dict of device
        tensors per sub-step; each sequence's keys end at ``k_end`` (``StepLayout.k_end``)."""
        if any(c.num_tokens != 1 for c in chunks):
            raise ValueError(f"a decode plan takes one token per sequence, got {[c.num_tokens for c in chunks]}")
        c = self._chunks([SeqChunk(c.seq_id, c.start, steps) for c in chunks])
        return plan_decode_steps(c, steps, rows, keys, self.trash_slot, self.device, extra)

    def plan_batched(self, chunks: Sequence[Chunk], rows: int, keys: int, mask_dtype: torch.dtype, *,
                     extra: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
        """A decode step as a batch: one row per sequence (its one new token), each row reading its own
        context padded to ``keys`` slots, so attention runs per sequence (no cross-sequence mask over the
        packed context; grouped-query attention without repeating keys). Padding rows and keys read and write
        the trash slot; a padding row attends to its key 0 only. Returns device tensors: write_index [rows],
        read_index [rows, keys], positions [rows], mask [rows, 1, 1, keys], row_valid [rows], and ``extra``."""
        n = len(chunks)
        if n > rows or any(c.num_tokens != 1 for c in chunks):
            raise ValueError(f"rows={rows}: a batched decode step takes one token of each of at most {rows} "
                             f"sequences, got {[c.num_tokens for c in chunks]}")
        ends = [c.start + 1 for c in chunks]
        if ends and max(ends) > keys:
            raise ValueError(f"keys={keys}: a sequence of this step has {max(ends)} context slots")
        read = np.full((rows, keys), self.trash_slot, dtype=np.int64)
        write = np.full(rows, self.trash_slot, dtype=np.int64)
        pos = np.zeros(rows, dtype=np.int64)
        lens = np.ones(rows, dtype=np.int64)
        for i, c in enumerate(chunks):
            slots = self.slots(c.seq_id, 0, c.start + 1)
            read[i, : slots.size] = slots
            write[i], pos[i], lens[i] = slots[-1], c.start, c.start + 1
        host = {"write_index": write, "read_index": read.reshape(-1), "positions": pos, "lens": lens, **(extra or {})}
        up = upload(host, self.device)
        allowed = torch.arange(keys, device=self.device)[None, :] < up["lens"][:, None]
        return {"write_index": up["write_index"], "read_index": up["read_index"].view(rows, keys),
                "positions": up["positions"], "mask": _additive(allowed, mask_dtype)[:, None, None, :],
                "row_valid": torch.arange(rows, device=self.device) < n, **{k: up[k] for k in extra or {}}}

    def _chunks(self, chunks: Sequence[Chunk]) -> HostChunks:
        """The step's chunks as host arrays, each chunk's context slots looked up once (``slots``' check)."""
        s = len(chunks)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=s)
        lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=s)
        ends = starts + lens
        arrs, reads = self._slot_arr, []
        for c, e in zip(chunks, ends.tolist()):
            a = arrs.get(c.seq_id)
            reads.append(a[:e] if a is not None and a.size >= e else self.slots(c.seq_id, 0, e))
        return HostChunks(starts, lens, ends, reads)

    def _host_plan(self, chunks: Sequence[Chunk], *, mask: bool = True,
                   gathered: "HostChunks | None" = None) -> dict[str, np.ndarray]:
        """Host index vectors of a step: write [N], read [K], q_pos [N], last [S], lens / ends [S]; with ``mask``
        q_seq [N] and k_seq / k_pos [K] too (the masked backend's). ``gathered``: the chunks' ``_chunks``."""
        c = self._chunks(chunks) if gathered is None else gathered
        n, k = int(c.lens.sum()), int(c.ends.sum())
        read = c.read_into(np.empty(k, dtype=np.int64))
        write, q_pos = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        c.rows_into(read, write, q_pos)
        v = {"write": write, "read": read, "q_pos": q_pos, "last": np.cumsum(c.lens) - 1, "lens": c.lens,
             "ends": c.ends}
        if mask:
            seq = np.arange(c.lens.size, dtype=np.int64)
            k_off = np.cumsum(c.ends) - c.ends
            k_seq = np.repeat(seq, c.ends)
            v.update(q_seq=np.repeat(seq, c.lens), k_seq=k_seq, k_pos=np.arange(k, dtype=np.int64) - k_off[k_seq])
        return v

    def update(self, a: torch.Tensor, b: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' seam: a [1, H_a, N, D_a], b [1, H_b, N, D_b] new tokens -> the packed contexts
        [1, H_a, K, D_a], [1, H_b, K, D_b] (this step's tokens included); a paged layout: the whole cache
        tensors [1, H_a, C + 1, D_a], [1, H_b, C + 1, D_b] (views, trash slot last)."""
        lay = self.layout
        if lay is None:
            raise RuntimeError("PagedKVCache.update outside a planned step")
        store = self._store.get(layer_idx)
        if store is None:
            store = tuple(torch.zeros(self.capacity_tokens + 1, x.shape[1], x.shape[3], dtype=x.dtype,
                                      device=self.device) for x in (a, b))  # + the trash slot
            self._store[layer_idx] = store
        if lay.paged:  # the decode kernel reads each sequence's slots in place: the cache itself goes back
            for x, buf in zip((a, b), store):
                buf.index_copy_(0, lay.write_index, x.transpose(1, 2).reshape(-1, *buf.shape[1:]).to(buf.dtype))
            return store[0][None].transpose(1, 2), store[1][None].transpose(1, 2)
        out = []
        ri = lay.read_index
        rows = (1, *ri.shape) if ri.dim() == 1 else tuple(ri.shape)  # packed [1, K] or batched [B, K]
        for x, buf in zip((a, b), store):
            # [B, H, n, D] new tokens -> [B * n, H, D] in packed (batched: row) order
            buf.index_copy_(0, lay.write_index, x.transpose(1, 2).reshape(-1, *buf.shape[1:]).to(buf.dtype))
            out.append(buf.index_select(0, ri.reshape(-1)).view(*rows, *buf.shape[1:]).transpose(1, 2))
        return out[0], out[1]

    # transformers asks a cache for the mask geometry when no 4D mask is given (the plain causal case above:
    # one sequence from position 0, so the keys are exactly this step's queries)
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def bytes_per_token(self) -> int:
        return sum(t.shape[1] * t.shape[2] * t.element_size() for s in self._store.values() for t in s)


def kv_blocks_for_memory(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Cache blocks that ``budget_bytes`` hold at ``bytes_per_token`` (every layer's two tensors) -> >= 0."""
    if bytes_per_token < 1 or block_size < 1:
        raise ValueError(f"bytes_per_token={bytes_per_token}, block_size={block_size}: both must be >= 1")
    return max(0, int(budget_bytes) // (int(bytes_per_token) * int(block_size)))


def varlen_offsets(lens: np.ndarray, ends: np.ndarray, rows: int, keys: int,
                   last_rows: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence offsets of a padded varlen step with a static sequence count (a captured shape).

    lens / ends: [S] new tokens / context length of each real sequence (packed order); rows / keys: the padded
    query rows and gathered keys. Returns (cu_q, cu_k) int64 host arrays:
      1. the real sequences first, in packed order;
      2. decode (``last_rows`` None, one token per sequence): each padding row is a sequence of its own with one
         padding key (the trash slot): S' = rows, so the kernel's one-query-per-sequence shape holds;
      3. prefill (``last_rows`` = the padded sampled rows): one padding sequence takes every padding row and NO
         key (its queries come out zero at no attention cost; the padding keys past ``cu_k[-1]`` are never
         read), then empty sequences up to S' = last_rows + 1."""
    n = int(lens.sum())
    if last_rows is None:
        q = np.concatenate([lens, np.ones(rows - n, dtype=np.int64)])
        kk = np.concatenate([ends, np.ones(rows - n, dtype=np.int64)])
    else:
        fill = last_rows - lens.size
        q = np.concatenate([lens, [rows - n], np.zeros(fill, dtype=np.int64)])
        kk = np.concatenate([ends, [0], np.zeros(fill, dtype=np.int64)])
    return np.concatenate([[0], np.cumsum(q)]), np.concatenate([[0], np.cumsum(kk)])


def _allowed(q_seq: torch.Tensor, q_pos: torch.Tensor, k_seq: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[N, K] bool: query (sequence, position) sees key (sequence, position) of its own sequence, not later."""
    return (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask of ``allowed``'s shape: 0 where allowed, the dtype's minimum elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _mask(q_seq, q_pos, k_seq, k_pos, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N, K] additive mask built on the device (``_allowed`` pairs)."""
    return _additive(_allowed(q_seq, q_pos, k_seq, k_pos), dtype)[None, None]


__all__ = ["PagedKVCache", "StepLayout", "SeqChunk", "Chunk", "KVBudgetError", "varlen_offsets", "kv_blocks_for_memory",
           "leading_single_rows"]
