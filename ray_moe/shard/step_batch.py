# ======================================================================================================
#  A STEP'S BATCH ON ONE SHARD: FROM THE REQUEST'S ITEMS TO THE ROWS IT RUNS (pure: no Ray)
#
#   StepRequest (GENERATION) ──> 1. free the sequences the driver finished
#     ──> 2. one-row items first ──> 3. deferred decode items resolved: the token this rank sampled for them,
#            from the host or (a step still on the device) as a fill copied on the device
#     ──> 4. penalized sequences' tokens kept by position ──> 5. prefill chunks cut past their cached blocks
#     ──> 6. KV reserved for every row (and a multi-step request's later sub-steps)
#     ──> StepBatch (its items, fills, prefix figures; the rank's own refusal, if any)
#   after the step's tokens are known: their samples kept for the deferred items of later steps
# ======================================================================================================
"""The sequences a shard holds between steps (sampled tokens, penalty histories, prefix blocks, device samples
of launched steps) and a step's batch stage over them: ``StepBatcher`` -> ``StepBatch``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ray_moe.core.errors import RayMoEError
from ray_moe.model.kv import KVBudgetError, PagedKVCache
from ray_moe.shard.prefix import ShardPrefixes
from ray_moe.shard.records import StepRequest, WorkItem
from ray_moe.shard.step_rows import read_fills, single_rows_first

# (item index, the sampling step's token tensor [S] on the device, index in it)
Fill = tuple[int, torch.Tensor, int]


class DeferredTokenError(RayMoEError, ValueError):
    """A deferred decode item names a position this rank never sampled (the step is refused on every rank)."""


@dataclass(frozen=True, eq=False)
class StepBatch:
    """One rank's work of one step after its batch stage.

    items:  the resolved, cut items in row order (one-row items first); () when the rank refused its input
    fills:  deferred tokens still on the device, by item index (``step_rows.fill_rows``)
    whole:  the resolved items before the prefix cut (the prompt blocks they write are named after the launch)
    prefix: (cached tokens per sequence, prefill tokens looked up); hashed: the cut's block hashes (reused)
    error:  the rank's own refusal (a KV budget, a deferred token it never sampled), raised after the step's
            collectives so every peer aborts together
    """

    items: tuple[WorkItem, ...]
    fills: list[Fill]
    whole: tuple[WorkItem, ...] = ()
    prefix: tuple[dict[str, int], int] = ({}, 0)
    hashed: dict[str, Any] = field(default_factory=dict)
    error: Exception | None = None

    @property
    def rows(self) -> int:
        return sum(it.num_tokens for it in self.items)

    @property
    def decode_rows(self) -> int:
        return sum(it.decode for it in self.items)


class StepBatcher:
    """The rank's per-sequence state between steps over its KV cache, and the batch stage (module banner).
    ``count(key, n)``: the executor's counters."""

    def __init__(self, kv: Callable[[], PagedKVCache], prefix_caching: bool, count: Callable[[str, int], None]) -> None:
        self._kv = kv  # (the host's cache: re-made when it is sized from memory)
        self.count = count
        # the tokens this rank sampled, by sequence and position (the last two): a deferred decode item feeds
        # the one at its start position; a rerun step finds its input again
        self.sampled: dict[str, dict[int, int]] = {}
        # the token ids of sequences whose penalties read them (``WorkItem.keep_tokens``), index = position
        self.history: dict[str, list[int]] = {}
        # prefix caching: prefill chunks skip the cached blocks of their prompt (``shard/prefix.py``)
        self.prefixes = ShardPrefixes(prefix_caching)
        # launched steps not completed yet: step id -> (sampled tokens [S] on the device, {(seq, position): i})
        self._picks: dict[str, tuple[torch.Tensor, dict[tuple[str, int], int]]] = {}

    # ------------------------------------------------------------------ the batch stage
    def build(self, req: StepRequest, ahead: int = 1) -> tuple[StepRequest, StepBatch]:
        """Steps 1-6 (banner) for one (sub-)step; ``ahead`` > 1: a multi-step request's first sub-step whose
        later ones run on arrays (its decode items reserve ``ahead - 1`` more positions). Returns the request
        with its items in row order and the batch."""
        kv = self._kv()
        for sid in req.input.free:  # 1.
            kv.free(sid)
            self.sampled.pop(sid, None)
            self.history.pop(sid, None)
            self.prefixes.forget(sid)
        ordered = single_rows_first(req.input.items)  # 2.
        if ordered is not req.input.items:
            req = req.revised(items=ordered)
        try:
            resolved, fills = self._resolve(req.input.items)  # 3.
            resolved, fills = self._keep_tokens(resolved, fills)  # 4.
            cut = self.prefixes.trim(kv, resolved, fills)  # 5.
            self.count("prefix_lookup_tokens", cut.looked_up)
            self.count("prefix_hit_tokens", sum(cut.cached.values()))
            for it in cut.items:  # 6.
                kv.reserve(it.seq_id, it.start + len(it.tokens) + (ahead - 1 if it.decode else 0))
        except (KVBudgetError, DeferredTokenError) as exc:
            return req, StepBatch((), [], error=exc)
        return req, StepBatch(cut.items, cut.fills, resolved, (cut.cached, cut.looked_up), cut.hashed)

    def commit(self, batch: StepBatch) -> None:
        """The prompt blocks the launched step writes, named for later sequences (``ShardPrefixes.commit``)."""
        self.prefixes.commit(self._kv(), batch.whole, batch.hashed)

    def _resolve(self, items: tuple[WorkItem, ...]) -> tuple[tuple[WorkItem, ...], list[Fill]]:
        """Deferred decode items get the token this rank sampled for them (at their start position): from the
        host when that step is complete, else ``fills`` to copy on the device, the item holding a placeholder
        token meanwhile."""
        deferred = [k for k, it in enumerate(items) if it.deferred]
        if not deferred:
            return items, []
        out, fills = list(items), []
        self.count("deferred_tokens", len(deferred))
        sampled, picks = self.sampled, list(self._picks.values())
        for k in deferred:
            it = items[k]
            tok = sampled.get(it.seq_id, {}).get(it.start)
            if tok is None:
                key = (it.seq_id, it.start)
                for t, ix in picks:
                    if key in ix:
                        fills.append((k, t, ix[key]))
                        break
                else:
                    raise DeferredTokenError(f"sequence {it.seq_id!r}: this rank sampled no token for "
                                             f"position {it.start} (a deferred decode item needs one)")
                self.count("deferred_on_device", 1)
                tok = 0
            out[k] = it.resolved(tok)
        return tuple(out), fills

    def _keep_tokens(self, items: tuple[WorkItem, ...], fills: list[Fill]) -> tuple[tuple[WorkItem, ...], list[Fill]]:
        """Sequences whose penalties read their tokens (``keep_tokens``): a deferred token of theirs still on
        the device is read to the host (waits for the step that sampled it: such steps do not overlap), and every
        item's tokens are written into ``history`` at their positions (a rerun or a re-prefill overwrites)."""
        held = [k for k, it in enumerate(items) if it.keep_tokens]
        if not held:
            return items, fills
        mine = {k for k, _, _ in fills} & set(held)
        if mine:
            items = read_fills(items, [f for f in fills if f[0] in mine])
            fills = [f for f in fills if f[0] not in mine]
            self.count("penalty_token_reads", len(mine))
        for k in held:
            it = items[k]
            h = self.history.setdefault(it.seq_id, [])
            if len(h) < it.start:
                raise DeferredTokenError(f"sequence {it.seq_id!r}: this rank holds {len(h)} of its tokens, "
                                         f"not the {it.start} before position {it.start} (its penalties read them)")
            del h[it.start:]
            h.extend(it.tokens)
        return items, fills

    # ------------------------------------------------------------------ after a step
    def contexts(self, items: list[WorkItem]) -> list[list[int] | None]:
        """Each sampled item's tokens before its sample position (penalized sequences; None for the others)."""
        return [self.history.get(it.seq_id, [])[:it.sample.position] if it.sample.penalized else None
                for it in items]

    def keep_picks(self, step_id: str, picked: torch.Tensor | None, want: tuple[WorkItem, ...], shift: int = 0) -> None:
        """A launched step's device samples ``picked`` [S] (of ``want``, in order) by (sequence, position +
        ``shift``), for later steps' deferred items until the step completes (``drop_picks``)."""
        if picked is not None:
            self._picks[step_id] = (picked, {(it.seq_id, it.sample.position + shift): i for i, it in enumerate(want)})

    def drop_picks(self, step_id: str) -> None:
        self._picks.pop(step_id, None)

    def remember(self, items: tuple[WorkItem, ...], tokens: dict[str, int], shift: int = 0) -> None:
        """A step's tokens known on the host: kept for deferred items (the last two positions of a sequence;
        ``shift``: a multi-step request's sub-step on its first sub-step's items, positions that many on)."""
        for it in items:
            if it.sample is not None and it.seq_id in tokens:
                seen, pos = self.sampled.setdefault(it.seq_id, {}), it.sample.position + shift
                seen[pos] = tokens[it.seq_id]
                if min(seen) < pos - 1:  # (the last two positions kept: usually all there is)
                    for p in [p for p in seen if p < pos - 1]:
                        del seen[p]


__all__ = ["StepBatch", "StepBatcher", "DeferredTokenError", "Fill"]
