"""Data-path fault injection on one shard (the shard-side half of spec 0x0E), as wrappers.

Nothing of fault injection sits in the dispatchers' signatures or in the per-layer loop: a step that has
an armed fault runs with wrapped components, installed for that step only.

    count      FaultyExchange: the step's control records declare one route too many to the next peer
               -> every rank aborts before payload (peer-count-disagreement)
    scale      FaultyExchange: the control records declare one FP8 scale column too many
               -> every rank rejects the payload before it moves (fp8-scale-count-mismatch)
    graph_key  FaultyExchange: the decode step record carries another bucket key -> explicit eager fallback
    inverse    FaultyDispatcher: every handle's inverse map is corrupted -> output rejected before publish
    parity     FaultyRunner: the runner's output drifts by 1% -> found by shadow comparison, canary blocked
    crash      the step raises on this rank (a candidate that fails while serving)
    hang_copy  control path: the next expert copy into this rank stalls ``HANG_COPY_S`` seconds before its
               weights are stored (a migration copy that hangs past the copy stage's deadline, then lands)

A fault is armed for the next ``count`` steps (of one generation, when given); arming and taking are one
lock acquisition per step.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ray_moe.moe.dispatch.bucket import BucketHandle
from ray_moe.moe.dispatch.direct import DirectHandle
from ray_moe.moe.dispatch.local import LocalHandle, PlannedHandle
from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.dispatch.protocol import HEADER_FIELDS, Dispatcher
from ray_moe.moe.dispatch.records import DispatchHandle, Handle
from ray_moe.moe.experts.runners.base import ExpertRunner
from ray_moe.moe.decode.graphs import DECODE_TAG, KEY_FIELD

if TYPE_CHECKING:
    from ray_moe.shard.pipeline import DataPaths


class ShardFault(str, Enum):
    """Faults a shard can arm for its next steps (``ExpertShardActor.inject_fault``; the ten of 0x0E are composed
    from these and from control-path faults injected at the coordinator). The one definition: the release client
    and the rollback drill name these (``apps/release_client.py`` re-exports it)."""

    COUNT = "count"  # peer route counts disagree (abort before payload exchange)
    SCALE = "scale"  # FP8 scale count differs (reject payload before expert compute)
    INVERSE = "inverse"  # corrupt inverse permutation (reject output before publish)
    PARITY = "parity"  # runner output drifts from its reference (x1.01)
    CRASH = "crash"  # the step raises while serving the generation
    GRAPH_KEY = "graph_key"  # decode graph key differs (explicit eager fallback)
    HANG_COPY = "hang_copy"  # an expert copy stalls past its deadline (a control-path fault: ``CONTROL_FAULTS``)


#: faults of the control path: taken by the call they stall (``ShardFaults.stall``), never by a step
CONTROL_FAULTS = frozenset({ShardFault.HANG_COPY})
#: how long a ``hang_copy`` stalls the copy (far past a test's copy deadline, short enough to land in a test)
HANG_COPY_S = 6.0


_CTL_SUFFIX = "/ctl"
_COUNTS_AT = len(HEADER_FIELDS)
_SCALES_AT = HEADER_FIELDS.index("scale_cols")


class FaultyExchange(Exchange):
    """The exchange with perturbed control records (everything else delegates to the wrapped endpoint)."""

    def __init__(self, inner: Exchange, faults: frozenset[ShardFault]) -> None:
        self._inner = inner
        self._faults = faults
        self.rank = inner.rank
        self.group = inner.group
        self.device_async = inner.device_async

    def __getattr__(self, name: str) -> Any:  # post_all_to_all_v, wait, ... of the wrapped backend
        return getattr(self._inner, name)

    def all_gather(self, tag: str, vec: np.ndarray) -> np.ndarray:
        vec = np.array(vec, dtype=np.int64)
        if tag.endswith(_CTL_SUFFIX):
            if ShardFault.COUNT in self._faults and vec.size > _COUNTS_AT:
                vec[_COUNTS_AT + (self.peer + 1) % self.size] += 1
            if ShardFault.SCALE in self._faults:
                vec[_SCALES_AT] += 1
        if tag.endswith(DECODE_TAG) and ShardFault.GRAPH_KEY in self._faults:
            vec[KEY_FIELD] ^= 1
        return self._inner.all_gather(tag, vec)

    def all_to_all_v(self, tag, tensors, send_splits, recv_splits):
        return self._inner.all_to_all_v(tag, tensors, send_splits, recv_splits)


class FaultyRunner(ExpertRunner):
    """A runner whose output drifted from its reference by ``scale`` (runner parity mismatch)."""

    def __init__(self, inner: ExpertRunner, scale: float = 1.01) -> None:
        self._inner = inner
        self.kind = inner.kind
        self.scale = scale

    def run(self, x, counts, weights):
        return self._inner.run(x, counts, weights) * self.scale

    def run_capacity(self, x, weights, valid=None):
        return self._inner.run_capacity(x, weights, valid) * self.scale

    def run_offsets(self, x, offsets, weights):
        return self._inner.run_offsets(x, offsets, weights) * self.scale

    def ledger(self, counts, d, f):
        return self._inner.ledger(counts, d, f)


def corrupt_handle(handle: Handle) -> Handle:
    """The same handle with an inverse map that is no longer one-to-one (or is truncated)."""
    if isinstance(handle, DispatchHandle):
        inv = handle.source.inverse_send.clone()
        if inv.numel() >= 2:
            inv[[0, 1]] = inv[[1, 0]]
        else:
            inv = inv[:0]
        return dataclasses.replace(handle, source=dataclasses.replace(handle.source, inverse_send=inv))
    if isinstance(handle, DirectHandle):
        rs = handle.route_src.clone().reshape(-1)
        if rs.numel() >= 2 and bool(rs[0] != rs[1]):
            rs[1] = rs[0]
        else:
            rs = rs[:0]
        return dataclasses.replace(handle, route_src=rs.view(-1, max(handle.top_k, 1)))
    if isinstance(handle, PlannedHandle):
        src = handle.plan.src.clone()
        live = torch.nonzero(src >= 0).flatten()
        if live.numel() >= 2:
            src[live[1]] = src[live[0]]  # a live route reads another live route's row
        return dataclasses.replace(handle, plan=dataclasses.replace(handle.plan, src=src))
    if isinstance(handle, LocalHandle):
        dest = handle.dest.clone()
        if dest.numel() >= 2:
            dest[1] = dest[0]  # route 1 reads route 0's row
        return dataclasses.replace(handle, dest=dest)
    if isinstance(handle, BucketHandle):
        idx = handle.send_index.clone()
        if idx.numel() >= 2:
            idx[1] = idx[0]  # route 1 reads route 0's block row (token 0's routes are never padding)
        return dataclasses.replace(handle, send_index=idx)
    raise TypeError(f"handle: no corruption defined for {type(handle).__name__}")


class FaultyDispatcher(Dispatcher):
    """A dispatcher whose handles come back with a corrupt inverse map."""

    def __init__(self, inner: Dispatcher) -> None:
        self._inner = inner
        self.mode = inner.mode
        self.masks_rows = inner.masks_rows

    def __getattr__(self, name: str) -> Any:  # token_cap, shape, ... of the wrapped dispatcher
        return getattr(self._inner, name)

    def for_tokens(self, tokens: int) -> "FaultyDispatcher":
        return FaultyDispatcher(self._inner.for_tokens(tokens))

    def dispatch(self, batch, snapshot, *, tag, status=None):
        kw = {} if status is None else {"status": status}
        out = self._inner.dispatch(batch, snapshot, tag=tag, **kw)
        return dataclasses.replace(out, handle=corrupt_handle(out.handle))

    def combine(self, expert_rows, handle, snapshot, *, tag, out_dtype, checks=None):
        return self._inner.combine(expert_rows, handle, snapshot, tag=tag, out_dtype=out_dtype, checks=checks)

    def handle_ok(self, handle):
        return self._inner.handle_ok(handle)

    def sent_slot_counts(self, handle):
        return self._inner.sent_slot_counts(handle)

    def slot_rows(self, out):
        return self._inner.slot_rows(out)


def with_exchange(dispatcher: Dispatcher, exchange: Exchange) -> Dispatcher:
    """A shallow copy of ``dispatcher`` over another endpoint (its caches are shared, not rebuilt)."""
    d = copy.copy(dispatcher)
    d.exchange = exchange  # type: ignore[attr-defined]
    return d


class ShardFaults:
    """The armed faults of one shard: kind -> (steps left, generation filter or None)."""

    def __init__(self) -> None:
        self._armed: dict[ShardFault, tuple[int, int | None]] = {}
        self._lock = threading.Lock()
        self.fired: dict[str, int] = {}

    def arm(self, kind: ShardFault | str, count: int = 1, generation: int | None = None) -> None:
        try:
            kind = ShardFault(kind)
        except ValueError:
            raise ValueError(f"kind={kind!r} is not one of {sorted(f.value for f in ShardFault)}") from None
        if count < 0:
            raise ValueError(f"count={count}: must be >= 0 (0 disarms)")
        with self._lock:
            if count == 0:
                self._armed.pop(kind, None)
            else:
                self._armed[kind] = (int(count), generation)

    def take(self, generation: int) -> frozenset[ShardFault]:
        """The faults that fire in this step of ``generation`` (each armed one loses one step)."""
        if not self._armed:  # the common case: no lock, nothing armed
            return frozenset()
        out = set()
        with self._lock:
            for kind, (left, gen) in list(self._armed.items()):
                if kind in CONTROL_FAULTS or (gen is not None and gen != generation):
                    continue
                out.add(kind)
                self.fired[f"fault_{kind.value}"] = self.fired.get(f"fault_{kind.value}", 0) + 1
                if left <= 1:
                    del self._armed[kind]
                else:
                    self._armed[kind] = (left - 1, gen)
        return frozenset(out)

    def stall(self, kind: ShardFault, seconds: float = HANG_COPY_S) -> float:
        """A control-path call of ``kind`` (``CONTROL_FAULTS``): when one is armed, take it and sleep ``seconds``
        (the caller holds no lock); returns the seconds slept (0.0 when none was armed)."""
        if kind not in CONTROL_FAULTS:
            raise ValueError(f"kind={kind!r} is not a control-path fault ({sorted(f.value for f in CONTROL_FAULTS)})")
        if not self._armed:
            return 0.0
        with self._lock:
            left, gen = self._armed.get(kind, (0, None))
            if left <= 0:
                return 0.0
            if left <= 1:
                del self._armed[kind]
            else:
                self._armed[kind] = (left - 1, gen)
            self.fired[f"fault_{kind.value}"] = self.fired.get(f"fault_{kind.value}", 0) + 1
        time.sleep(seconds)
        return float(seconds)


def wrap_paths(faults: frozenset[ShardFault], paths: "DataPaths") -> "DataPaths":
    """The step's data paths with the fired faults installed; ``paths`` itself when none fired."""
    if not faults:
        return paths
    ex, normal, bucket, runner = paths.exchange, paths.normal, paths.bucket, paths.runner
    if faults & {ShardFault.COUNT, ShardFault.SCALE, ShardFault.GRAPH_KEY}:
        ex = FaultyExchange(ex, faults)
        normal = with_exchange(normal, ex)
        bucket = None if bucket is None else with_exchange(bucket, ex)
    if ShardFault.INVERSE in faults:
        normal = FaultyDispatcher(normal)
        bucket = None if bucket is None else FaultyDispatcher(bucket)
    if ShardFault.PARITY in faults:
        runner = FaultyRunner(runner)
    # a faulted step is never captured: a graph must not record a fault
    return dataclasses.replace(paths, exchange=ex, normal=normal, bucket=bucket, runner=runner, capture=False)


__all__ = ["CONTROL_FAULTS", "HANG_COPY_S", "ShardFault", "ShardFaults", "FaultyExchange", "FaultyRunner", "FaultyDispatcher", "corrupt_handle",
           "wrap_paths", "with_exchange"]
