"""A paged KV cache that transformers' attention layers write and read through their ``cache.update`` seam.

One cache per rank, one block pool for every sequence on it. A sequence owns a list of fixed-size blocks;
token position ``p`` of a sequence lives in cache slot ``block[p // B] * B + p % B``. A step packs the new
tokens of every sequence into one ``[1, R]`` batch (prefill chunks and decode tokens side by side, padding rows
after the real ones); each attention layer calls ``cache.update(a [1, H_a, R, D_a], b [1, H_b, R, D_b],
layer_idx, ...)``, which writes every row at its slot (``StepRows.write_index``: padding rows write the trash
slot past the last block) and hands back the cache tensors themselves ``[1, H, C + 1, D]``; the step's
``AttentionPlan`` (``plan_step``) says which slots each sequence's queries read (``model/attention.py`` gathers
them, or reads them in place). The two tensors are whatever the layer caches (keys and values; DeepSeek's MLA
caches its compressed latent and rotary key): allocated at the first update with the shapes that arrive. A layer
that transforms what it caches before attending (MLA expands its latent) takes the step's contexts gathered by
the cache instead (``gathered``: the plan's ``gather`` slots, packed).

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
from ray_moe.core.types import AttentionBackend
from ray_moe.model import kv_write
from ray_moe.model.attention import EXPAND_KEYS, AttentionPlan, SequenceRun, runs_at
from ray_moe.model.dense_prefill import prefill_runs
from ray_moe.model.kv_host import HostChunks, plan_decode_steps, plan_token_step, send, staging
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
class StepRows:
    """The rows of one step, what a captured graph takes as its static inputs (tensors on the cache's device).

    token_ids:   [R] int64 the new tokens in packed order (padding rows 0)
    positions:   [R] int64 each row's position in its sequence (rotary embeddings; padding 0)
    write_index: [R] int64 each row's cache slot (padding rows: the trash slot)
    row_valid:   [R] bool, the real rows (the first ``n``); padding rows route nowhere
    last:        [L] int64 the row of each sequence's last new token (where its next token is sampled; padding
                 entries row 0), or None: the logits of every row (a decode step)
    n:           the real rows
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    write_index: torch.Tensor
    row_valid: torch.Tensor
    last: torch.Tensor | None
    n: int

    @property
    def rows(self) -> int:
        return int(self.token_ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The static inputs of a captured step, by name."""
        out = {"token_ids": self.token_ids, "positions": self.positions, "write_index": self.write_index,
               "row_valid": self.row_valid}
        if self.last is not None:
            out["last"] = self.last
        return out

    @staticmethod
    def of(inputs: dict[str, torch.Tensor], n: int) -> "StepRows":
        """The rows of a captured step's static inputs (``tensors``' names)."""
        return StepRows(inputs["token_ids"], inputs["positions"], inputs["write_index"], inputs["row_valid"],
                        inputs.get("last"), n)


def leading_single_rows(chunks: Sequence[Chunk]) -> int:
    """How many chunks at the front of ``chunks`` have one new token each."""
    n = 0
    for c in chunks:
        if c.num_tokens != 1:
            break
        n += 1
    return n


def leading_single_rows_of(lens: np.ndarray) -> int:
    """``leading_single_rows`` of the chunks' new-token counts [S]."""
    ones = np.flatnonzero(lens != 1)
    return int(lens.size if ones.size == 0 else ones[0])


def expand_groups(lens: np.ndarray, ends: np.ndarray, k_base: int,
                  bound: int = EXPAND_KEYS) -> tuple[SequenceRun, ...] | None:
    """``AttentionPlan.rest_groups``: runs of consecutive sequences (query lengths ``lens`` [S], contexts
    ``ends`` [S], host) whose contexts sum to at most ``bound`` keys (a longer context is a run alone), keys
    counted from ``k_base`` in the gathered keys; None where one run holds them all."""
    if lens.size < 2 or int(ends.sum()) <= bound:
        return None
    cuts = [0]
    keys = 0
    for i, e in enumerate(ends.tolist()):
        if i > cuts[-1] and keys + e > bound:
            cuts.append(i)
            keys = 0
        keys += e
    cuts.append(int(lens.size))
    return runs_at(cuts, lens, ends, k_base)


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
        # a step's rows written by one kernel for both tensors where it reproduces index_copy_ here (checked once a
        # process per device and dtype, at the first cache: at load, before any capture), else by index_copy_
        self.write_reason = kv_write.check(self.device, dtype)
        self.fused_write = self.write_reason is None
        self.pool = BlockPool(self.num_blocks)  # free / held / cached blocks (``model/prefix_cache.py``)
        self._blocks: dict[str, list[int]] = {}
        # per sequence: the hashes of its leading blocks whose content is written and named (``register``,
        # ``attach``): they may be shared, and a rerun step need not compute them again
        self._valid: dict[str, list[int]] = {}
        self._slot_arr: dict[str, np.ndarray] = {}  # [held blocks * B] slot of each reserved position (a view)
        self._slot_buf: dict[str, np.ndarray] = {}  # [capacity >= held blocks * B] what ``_slot_arr`` views
        self._offsets = np.arange(self.block_size, dtype=np.int64)  # a block's positions, from its first slot
        self._store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the step being run: where its rows are written, and (``gathered`` steps) the contexts handed back
        self.write_index: torch.Tensor | None = None
        self.gather: torch.Tensor | None = None

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

    def block_table(self, seq_id: str) -> list[int]:
        """The blocks ``seq_id`` holds, in position order (a copy)."""
        return list(self._blocks.get(seq_id, ()))

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
        """The slot of every reserved position, kept per sequence: the slots of its ``new`` last blocks appended.

        1. the sequence's buffer grows by doubling (``_slot_buf``: capacity past what is reserved), so a decoding
           sequence's next block is one add written in place, not a copy of its whole index;
        2. ``_slot_arr`` is the reserved prefix, a view (entries once written never change: views handed out
           earlier, e.g. a launched step's contexts, stay right when the buffer is replaced)."""
        blocks, bs = self._blocks[seq_id], self.block_size
        old = self._slot_arr.get(seq_id)
        n = 0 if old is None else old.size
        size = n + new * bs
        buf = self._slot_buf.get(seq_id)
        if buf is None or buf.size < size:  # 1.
            grown = np.empty(max(size, 2 * (0 if buf is None else buf.size)), dtype=np.int64)
            if n:
                grown[:n] = old
            buf = self._slot_buf[seq_id] = grown
        if new == 1:  # (a decoding sequence's next block: the usual case, one add)
            np.add(self._offsets, blocks[-1] * bs, out=buf[n:size])
        else:
            b = np.asarray(blocks[len(blocks) - new:], dtype=np.int64)
            np.add(b[:, None] * bs, self._offsets, out=buf[n:size].reshape(new, bs))
        self._slot_arr[seq_id] = buf[:size]  # 2.

    def free(self, seq_id: str) -> None:
        """Drop ``seq_id``'s blocks: a block no other sequence holds becomes free, or cached when its content
        is named (findable by hash until the pool needs it)."""
        self.pool.release(self._blocks.pop(seq_id, ()))
        self._slot_arr.pop(seq_id, None)
        self._slot_buf.pop(seq_id, None)
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

    @property
    def trash_slot(self) -> int:
        """A slot no sequence owns: padding tokens of a captured step write and read it."""
        return self.capacity_tokens

    # ------------------------------------------------------------------ one step
    def plan_step(self, chunks: "Sequence[Chunk] | HostChunks", token_ids: np.ndarray, backend: AttentionBackend, *,
                  paged: bool = False, rows: int | None = None, last_rows: int | None = None,
                  mask_dtype: torch.dtype = torch.float32,
                  expand_keys: int | None = None, dense_rows: int | None = None) -> tuple[StepRows, AttentionPlan]:
        """The rows and the exact attention plan of one step (every chunk's positions reserved first), host
        arrays built once (numpy, no per-token Python) and uploaded in one copy.

        chunks: the step's sequences in packed order (or their ``HostChunks``, e.g. a warm-up's over the trash
        slot); token_ids: [n] their new tokens; rows: pad the rows to this many (None: n); last_rows: the
        ``last`` entries (None: one per sequence); paged (VARLEN): the leading one-row sequences read their
        slots in place (``AttentionPlan.slots``), the other contexts are gathered; mask_dtype: MASKED's mask;
        expand_keys (VARLEN): the plan's ``rest_groups`` cut at this many gathered keys (a model that expands
        its contexts before attending; None: not cut); dense_rows (VARLEN): the plan's ``prefill_runs`` around
        each chunk of at least this many rows (``dense_prefill.prefill_runs``; None: not cut).
          1. host arrays: each chunk's context slots, the rows' write slots and positions
          2. the plan's vectors: gather / slots and offsets (VARLEN) or the mask's keys (MASKED)
          3. one upload; row_valid and the mask built on the device"""
        c = chunks if isinstance(chunks, HostChunks) else self._chunks(chunks)
        s, n, k = int(c.lens.size), int(c.lens.sum()), int(c.ends.sum())
        r = n if rows is None else int(rows)
        nl = s if last_rows is None else int(last_rows)
        if n > r or s > nl or token_ids.size != n:
            raise ValueError(f"rows={rows}, last_rows={last_rows}: the step has {n} tokens ({token_ids.size} ids) "
                             f"of {s} sequences")
        nd = leading_single_rows_of(c.lens)
        varlen = backend is AttentionBackend.VARLEN
        paged = paged and varlen and nd > 0
        kd = int(c.ends[:nd].sum()) if paged else 0
        # 1. the rows (real, then padding) and every context's slots in packed order
        sizes = {"write_index": r, "positions": r, "token_ids": r, "last": nl, "read": k}
        if varlen:
            sizes.update(cu_q=s + 1, cu_k=s + 1 + (1 if paged and nd < s else 0), cu_q_rest=s - nd + 1)
        else:
            sizes.update(q_seq=n, k_seq=k, k_pos=k)
        buf, host = staging(sizes, self.device)
        read = c.read_into(host["read"])
        write, pos = host["write_index"], host["positions"]
        c.rows_into(read, write, pos)
        write[n:], pos[n:] = self.trash_slot, 0
        host["token_ids"][:n], host["token_ids"][n:] = token_ids, 0
        host["last"][:s], host["last"][s:] = np.cumsum(c.lens) - 1, 0
        # 2. the plan's vectors
        if varlen:
            host["cu_q"][:] = np.concatenate([[0], np.cumsum(c.lens)])
            host["cu_q_rest"][:] = np.concatenate([[0], np.cumsum(c.lens[nd:])])
            if paged and nd < s:  # the one-row group's offsets into its slots, the others' into their gathered keys
                host["cu_k"][:] = np.concatenate([[0], np.cumsum(c.ends[:nd]), [0], np.cumsum(c.ends[nd:])])
            else:
                host["cu_k"][:] = np.concatenate([[0], np.cumsum(c.ends)])
        else:
            seq = np.arange(s, dtype=np.int64)
            k_off = np.cumsum(c.ends) - c.ends
            host["q_seq"][:], host["k_seq"][:] = np.repeat(seq, c.lens), np.repeat(seq, c.ends)
            host["k_pos"][:] = np.arange(k, dtype=np.int64) - k_off[host["k_seq"]]
        # 3. one upload
        up = send(buf, sizes, self.device)
        step = StepRows(up["token_ids"], up["positions"], up["write_index"], torch.arange(r, device=self.device) < n,
                        up["last"], n)
        if varlen:
            slots = up["read"][:kd] if paged else None
            gather = None if paged and nd == s else up["read"][kd:]
            k_base = 0 if paged else int(c.ends[:nd].sum())
            groups = None if expand_keys is None else expand_groups(c.lens[nd:], c.ends[nd:], k_base, expand_keys)
            runs = None if dense_rows is None else prefill_runs(c.lens[nd:], c.ends[nd:], k_base, dense_rows)
            plan = AttentionPlan(n, backend, gather=gather, cu_q=up["cu_q"].to(torch.int32),
                                 cu_k=up["cu_k"].to(torch.int32), max_q=int(c.lens.max(initial=1)),
                                 max_k=int(c.ends.max(initial=1)), single_rows=nd if (paged or nd < s) else 0,
                                 slots=slots, cu_q_rest=up["cu_q_rest"].to(torch.int32), rest_groups=groups,
                                 prefill_runs=runs)
            return step, plan
        plain = s == 1 and int(c.starts[0]) == 0  # one sequence from its first position: SDPA's causal kernel
        mask = None if plain else _mask(up["q_seq"], up["positions"][:n], up["k_seq"], up["k_pos"], mask_dtype)
        return step, AttentionPlan(n, backend, gather=up["read"], mask=mask)

    def plan_decode_graph(self, chunks: "Sequence[Chunk] | HostChunks", rows: int, steps: int,
                          token_ids: np.ndarray) -> list[dict[str, torch.Tensor]]:
        """The static inputs of a whole-step decode graph (one token per chunk, reserved ``steps - 1`` positions
        past it: a multi-step request's sub-steps) for each of its ``steps`` sub-steps, planned with one upload
        (``kv_host.plan_decode_steps``): token_ids, positions, write_index, row_valid [rows]; cu_k [rows + 1],
        k_end [rows] int32; read_index [used slots] (each sequence's context slots, then one trash key per
        padding row: a prefix of the graph's slot vector)."""
        if isinstance(chunks, HostChunks):
            c = chunks
        else:
            s = len(chunks)
            one = np.fromiter((x.num_tokens for x in chunks), dtype=np.int64, count=s)
            if (one != 1).any():
                raise ValueError(f"a decode plan takes one token per sequence, got {one.tolist()}")
            starts = np.fromiter((x.start for x in chunks), dtype=np.int64, count=s)
            c = self._host_chunks([x.seq_id for x in chunks], starts, np.full(s, steps, dtype=np.int64))
        used = int(c.ends.sum()) + rows - int(c.lens.size)
        ids = np.zeros(rows, dtype=np.int64)
        ids[:token_ids.size] = token_ids
        return plan_decode_steps(c, steps, rows, used, self.trash_slot, self.device, {"token_ids": ids})

    def plan_token_graph(self, chunks: "Sequence[Chunk] | HostChunks", token_ids: np.ndarray, rows: int,
                         last_rows: int, tables: tuple[int, int, int]) -> dict[str, torch.Tensor]:
        """The static inputs of a whole-step graph of a token size (``kv_host.plan_token_step``: rows, ``last``,
        the contexts' slots, offsets and the paged varlen kernel's work tables), one upload."""
        c = chunks if isinstance(chunks, HostChunks) else self._chunks(chunks)
        return plan_token_step(c, token_ids, rows, last_rows, tables, self.trash_slot, self.device)

    def _chunks(self, chunks: Sequence[Chunk]) -> HostChunks:
        """The step's chunks as host arrays, each chunk's context slots looked up once (``slots``' check)."""
        s = len(chunks)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=s)
        lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=s)
        return self._host_chunks([c.seq_id for c in chunks], starts, lens)

    def _host_chunks(self, seq_ids: list[str], starts: np.ndarray, lens: np.ndarray) -> HostChunks:
        """``HostChunks`` of sequences ``seq_ids`` [S] with ``starts`` / ``lens`` [S] int64: each one's context
        slots (positions 0 .. start + len - 1) looked up once (``slots``' check)."""
        ends = starts + lens
        arrs, reads = self._slot_arr, []
        for sid, e in zip(seq_ids, ends.tolist()):
            a = arrs.get(sid)
            reads.append(a[:e] if a is not None and a.size >= e else self.slots(sid, 0, e))
        return HostChunks(starts, lens, ends, reads)

    def update(self, a: torch.Tensor, b: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' seam: a [1, H_a, R, D_a], b [1, H_b, R, D_b] the step's rows, written at their slots
        (``write_index``) -> the cache tensors [1, H_a, C + 1, D_a], [1, H_b, C + 1, D_b] (views, trash slot
        last), or with ``gather`` set the contexts it names [1, H, K, D] (a layer that transforms its cache)."""
        if self.write_index is None:
            raise RuntimeError("PagedKVCache.update outside a step")
        store = self._store.get(layer_idx)
        if store is None:
            store = tuple(torch.zeros(self.capacity_tokens + 1, x.shape[1], x.shape[3], dtype=x.dtype,
                                      device=self.device) for x in (a, b))  # + the trash slot
            self._store[layer_idx] = store
        kv_write.write(a, b, self.write_index, store, fused=self.fused_write)  # both tensors in one kernel
        if self.gather is not None:
            return tuple(buf.index_select(0, self.gather)[None].transpose(1, 2) for buf in store)
        return store[0][None].transpose(1, 2), store[1][None].transpose(1, 2)

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


def _allowed(q_seq: torch.Tensor, q_pos: torch.Tensor, k_seq: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[N, K] bool: query (sequence, position) sees key (sequence, position) of its own sequence, not later."""
    return (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask of ``allowed``'s shape: 0 where allowed, the dtype's minimum elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _mask(q_seq, q_pos, k_seq, k_pos, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N, K] additive mask built on the device (``_allowed`` pairs)."""
    return _additive(_allowed(q_seq, q_pos, k_seq, k_pos), dtype)[None, None]


__all__ = ["PagedKVCache", "StepRows", "SeqChunk", "Chunk", "KVBudgetError", "kv_blocks_for_memory",
           "leading_single_rows"]
