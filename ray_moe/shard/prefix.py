"""Prefix caching on one shard (pure: no Ray): a step's prefill chunks skip the positions whose KV content the
rank's cache already holds, and the full blocks a step wrote are named for later sequences.

    trim (before the step's KV is reserved)
      1. a prefill chunk that starts where its sequence's valid blocks end (a new sequence: position 0) looks up
         the chained hashes of its full blocks (``model/prefix_cache.py``) and attaches the cached ones: never
         the block holding a sampled chunk's last token (at least that token is computed, its KV written to a
         block of the sequence's own, and its next token sampled from it)
      2. the chunk's positions below the sequence's valid blocks are cut (start moved past them); a chunk cut
         whole that samples nothing runs no rows (dropped from the step)
    commit (after the step's forward was launched: its writes are queued before any later step's)
      3. every full block of prompt tokens the sequence now has written is registered under its hash, except
         the block of a sampled chunk's last token (decode tokens follow in it); the hashes step 1 computed
         for the same blocks are reused (``PrefixTrim.hashed``: a prompt's blocks are hashed once a step)

A step that is rerun (a stale generation, a recovered rank) finds its attached and registered blocks valid and
cuts the same positions or more: what it reports as cached (``cached_tokens``: positions of attached blocks
only) is the same in every run, and no shared block is written again. A chunk from position 0 whose sequence
holds valid blocks that are not its own leading blocks (a reused id) drops them first (``_restart``). Expert statistics of a cut chunk
(``WorkItem.expert_stats``) count only the rows it computed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ray_moe.model.kv import PagedKVCache
from ray_moe.model.prefix_cache import chain_hashes
from ray_moe.shard.records import WorkItem
from ray_moe.shard.step_rows import single_rows_order


@dataclasses.dataclass(frozen=True)
class PrefixTrim:
    """One step's trim: ``items`` (cut; dropped ones gone, one-row items first), ``fills`` re-indexed to them,
    ``cached``: {sequence id: its chunk's tokens served from attached blocks}, ``looked_up``: prefill tokens
    of the step (what the cached ones are a share of), ``hashed``: {sequence id: (the first block looked up,
    the chained hashes of its chunk's blocks from there)} for ``commit``."""

    items: tuple[WorkItem, ...]
    fills: list
    cached: dict[str, int]
    looked_up: int
    hashed: dict[str, tuple[int, list[int]]] = dataclasses.field(default_factory=dict)


def _prefill(it: WorkItem) -> bool:
    return not it.decode and not it.deferred and bool(it.tokens)


class ShardPrefixes:
    """The rank's prefix caching state beside its ``PagedKVCache`` (``enabled`` False: every call is a no-op).

    tail: per sequence in prefill, the token ids of its positions from its valid blocks' end to its prefill's
    end (a block that two chunks fill is named once both are written); attached: per sequence, the indices of
    the blocks it took from the cache."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)
        self._tail: dict[str, list[int]] = {}
        self._attached: dict[str, set[int]] = {}

    def forget(self, seq_id: str) -> None:
        self._tail.pop(seq_id, None)
        self._attached.pop(seq_id, None)

    def trim(self, kv: PagedKVCache, items: Sequence[WorkItem], fills: list) -> PrefixTrim:
        """Steps 1 and 2 for the step's (resolved) ``items``; ``fills``: (item index, tensor, index) of deferred
        tokens still on the device (``TokenStepExecutor._resolve``), re-indexed to the cut items."""
        if not self.enabled or not any(_prefill(it) for it in items):
            return PrefixTrim(tuple(items), fills, {}, 0)
        B = kv.block_size
        out: list[WorkItem | None] = []
        cached: dict[str, int] = {}
        hashed: dict[str, tuple[int, list[int]]] = {}
        looked = 0
        for it in items:
            if not _prefill(it):
                out.append(it)
                continue
            sid, n = it.seq_id, len(it.tokens)
            looked += n
            keep = 1 if it.sample is not None else 0  # a sampled chunk computes its last token
            if it.start == 0 and kv.held(sid):
                self._restart(kv, it)
            v = kv.valid_tokens(sid)
            if it.start == v and kv.held(sid) * B == v:  # its next positions have no blocks yet: look up
                full = (it.start + n - keep) // B - v // B
                if full > 0:
                    parent = kv.valid_hashes(sid)[-1] if v else None
                    hs = chain_hashes(parent, it.tokens[:full * B], B)
                    hashed[sid] = (v // B, hs)  # (blocks of the uncut chunk: it starts at v)
                    got = kv.attach(sid, hs)
                    if got:
                        self._attached.setdefault(sid, set()).update(range(v // B, v // B + got))
                    v = kv.valid_tokens(sid)
            skip = max(0, min(v - it.start, n - keep))
            if skip:
                a, b = it.start, it.start + skip
                hit = sum(max(0, min(b, (j + 1) * B) - max(a, j * B)) for j in self._attached.get(sid, ()))
                if hit:
                    cached[sid] = hit
            if skip == n:
                out.append(None)  # nothing to compute, nothing to sample
            elif skip:
                out.append(dataclasses.replace(it, tokens=it.tokens[skip:], start=it.start + skip))
            else:
                out.append(it)
        kept = [k for k, it in enumerate(out) if it is not None]  # then one-row items first again (cut chunks)
        order = [kept[i] for i in single_rows_order([out[k] for k in kept])]
        where = {k: i for i, k in enumerate(order)}
        return PrefixTrim(tuple(out[k] for k in order), [(where[k], *rest) for k, *rest in fills], cached, looked,
                          hashed)

    def _restart(self, kv: PagedKVCache, it: WorkItem) -> None:
        """A chunk from position 0 of a sequence that already holds blocks: a rerun when its valid blocks are
        this chunk's own (their names equal the chunk's leading blocks'); else the id names other content (a
        driver that restarted reuses ids its predecessor never freed here): the old blocks are dropped, so a
        shared block is never cut past or written with other tokens."""
        valid = kv.valid_hashes(it.seq_id)
        if valid and (len(valid) > len(it.tokens) // kv.block_size
                      or chain_hashes(None, it.tokens[:len(valid) * kv.block_size], kv.block_size) != valid):
            kv.free(it.seq_id)
            self.forget(it.seq_id)

    def commit(self, kv: PagedKVCache, items: Sequence[WorkItem],
               hashed: dict[str, tuple[int, list[int]]] | None = None) -> None:
        """Step 3 for the step's (resolved, uncut) ``items``, once its forward was launched; ``hashed``: the
        trim's hashes of the same items' blocks (``PrefixTrim.hashed``), reused where they cover the blocks."""
        if not self.enabled:
            return
        B = kv.block_size
        for it in items:
            sid = it.seq_id
            if not _prefill(it):
                self._tail.pop(sid, None)  # decoding: no more prompt blocks
                continue
            v = kv.valid_tokens(sid)
            tail = self._tail.get(sid, [])
            end = it.start + len(it.tokens)
            if end <= v:
                continue  # a rerun of positions already named
            if it.start > v + len(tail):  # a gap: the tokens before this chunk are unknown here
                self._tail.pop(sid, None)
                continue
            known = tail[:max(0, it.start - v)] + list(it.tokens[max(0, v - it.start):])  # positions v .. end
            full = len(known) // B
            if it.sample is not None:  # never the block of the last token
                full = min(full, (end - 1) // B - v // B)
            if full > 0:
                b0, hs = (hashed or {}).get(sid, (-1, []))
                i = v // B - b0
                if b0 >= 0 and b0 * B == it.start <= v and i + full <= len(hs):  # the same blocks' content
                    kv.register(sid, hs[i:i + full])
                else:
                    parent: Any = kv.valid_hashes(sid)[-1] if v else None
                    kv.register(sid, chain_hashes(parent, known[:full * B], B))
            if it.sample is not None:
                self._tail.pop(sid, None)
            else:
                self._tail[sid] = known[full * B:]


__all__ = ["PrefixTrim", "ShardPrefixes"]
