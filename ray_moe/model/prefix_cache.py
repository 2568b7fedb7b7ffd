"""The block pool of a paged KV cache, with prefix caching: full blocks shared by hash (pure Python).

A block of ``B`` token slots is in exactly one of three states:

    free    no content kept: handed out first (lowest id first)
    held    held by one or more sequences (``refs[block]`` >= 1)
    cached  held by none, its content still findable by hash: kept in LRU order and evicted (the hash dropped)
            only when the pool needs a block and none is free

so ``free + held + cached == num_blocks`` always, and ``available == free + cached`` (a cached block costs
nothing to keep: the budget is the same as without prefix caching).

A full block is named by a chained hash: ``block_hash(parent, tokens)`` of its ``B`` token ids and the hash of
the block before it (None for a sequence's first block), so equal hashes mean equal token prefixes up to and
including that block (a 64-bit BLAKE2b digest: stable across processes, so the driver computes the same names
for the prompts it routes). ``PagedKVCache`` keeps which leading blocks of each sequence hold valid content
(``register``) and attaches cached ones to a new sequence (``attach``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The chained hash of one full block: its token ids after the previous block's hash (None: the first)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"-" if parent is None else int(parent).to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(parent: int | None, tokens: Sequence[int], block_size: int) -> list[int]:
    """The hashes of every full block of ``tokens`` (a partial last block has none), chained from ``parent``."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    # ``block_hash`` of each block, the token ids converted to bytes once (not per block): one digest over the
    # parent's bytes and the block's, as its two updates
    n = len(tokens) // block_size
    data = np.asarray(tokens[:n * block_size], dtype=np.int64).tobytes() if n else b""
    step = 8 * block_size
    out: list[int] = []
    for i in range(n):
        head = b"-" if parent is None else int(parent).to_bytes(8, "little")
        parent = int.from_bytes(hashlib.blake2b(head + data[i * step:(i + 1) * step], digest_size=8).digest(), "little")
        out.append(parent)
    return out


class BlockPool:
    """The blocks of one cache: free, held (reference counted) and cached (LRU, findable by hash).

    ``evictions`` counts cached blocks whose content was dropped to hand the block out again."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 1")
        self.num_blocks = int(num_blocks)
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() gives the lowest id
        self.refs: dict[int, int] = {}
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently released first
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks a reservation may take: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._lru)

    def counts(self) -> dict[str, int]:
        """{"free", "held", "cached", "hashed"} block counts (free + held + cached == num_blocks)."""
        return {"free": len(self._free), "held": len(self.refs), "cached": len(self._lru),
                "hashed": len(self._by_hash)}

    def take(self) -> int:
        """A block for one sequence (reference count 1): a free one, else the least recently used cached one
        (its hash dropped). Raises ``RuntimeError`` when none is available (callers check ``available``)."""
        if self._free:
            b = self._free.pop()
        elif self._lru:
            b, _ = self._lru.popitem(last=False)
            del self._by_hash[self._hash_of.pop(b)]
            self.evictions += 1
        else:
            raise RuntimeError(f"no cache block available of {self.num_blocks}")
        self.refs[b] = 1
        return b

    def find(self, h: int) -> int | None:
        """The block holding the content named ``h`` (held or cached), or None."""
        return self._by_hash.get(h)

    def share(self, block: int) -> None:
        """One more sequence holds ``block`` (a cached block leaves the LRU list)."""
        if block in self._lru:
            del self._lru[block]
            self.refs[block] = 1
        elif block in self.refs:
            self.refs[block] += 1
        else:
            raise ValueError(f"block {block}: neither held nor cached (a free block has no content to share)")

    def release(self, blocks: Sequence[int]) -> None:
        """One sequence drops ``blocks`` (give them in the sequence's order: the later blocks of a chain are
        then evicted before the earlier ones, which keeps the earlier ones findable longest)."""
        freed = False
        for b in reversed(blocks):
            n = self.refs[b] - 1
            if n:
                self.refs[b] = n
                continue
            del self.refs[b]
            if b in self._hash_of:
                self._lru[b] = None
            else:
                self._free.append(b)
                freed = True
        if freed:
            self._free.sort(reverse=True)

    def register(self, block: int, h: int) -> bool:
        """Name a held block's (now written) content ``h``. False when ``h`` already names another block (that
        one stays the shared copy; this one stays private) or the block already has a name."""
        if h in self._by_hash or block in self._hash_of:
            return False
        if block not in self.refs:
            raise ValueError(f"block {block}: only a held block's content can be registered")
        self._by_hash[h] = block
        self._hash_of[block] = h
        return True


__all__ = ["BlockPool", "block_hash", "chain_hashes"]
