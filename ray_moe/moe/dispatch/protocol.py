"""The dispatch protocol, written once: control record, agreement before payload, generation fence,
deferred handle checks, and the dispatcher contract every data path implements. Pure: no Ray.

Every data path (``engine.py``, the reference; ``direct.py``, the fast normal mode; ``bucket.py``, the
fixed-capacity decode mode) follows the same protocol:

  1. each rank plans its routes locally and builds one ``ControlRecord``;
  2. one all-gather of the records; ``agree`` checks them identically on every rank, so a stale
     generation, bad input or a count disagreement aborts EVERY rank before a payload byte moves;
  3. payload exchange, experts, return exchange;
  4. combine resolves exactly the generation its handle was planned under (``fence``); the handle's
     integrity check is a device flag read together with the output (``DeferredChecks``), not a sync.

The contract (DeepEP / SGLang shape)::

    out = dispatcher.dispatch(batch, snapshot, tag=...)      # expert-major rows, per-slot counts, handle
    y_rows = runner(out)                                      # the expert runner boundary (SwiGLU)
    y = dispatcher.combine(y_rows, out.handle, snapshot, tag=..., out_dtype=..., checks=checks)   # [T, d]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from ray_moe.moe.dispatch.records import DispatchOutput, Handle
from ray_moe.core.routes import RouteBatch
from ray_moe.core.errors import CountAgreementError, RouteValidationError, StaleGenerationError
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.core.types import DispatchMode


class ControlStatus(IntEnum):
    """What a rank reports in the control round before any payload moves."""

    OK = 0
    STALE_GENERATION = 1
    BAD_INPUT = 2
    FAULT = 3


HEADER_FIELDS = ("generation", "pg_epoch", "layer", "status", "num_routes", "map_digest", "hidden_width",
                 "dtype_code", "scale_cols")
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}


@dataclass(frozen=True)
class ControlRecord:
    """One rank's contribution to the control round (an int64 vector on the wire: the header fields in
    ``HEADER_FIELDS`` order, then the split vector in peer-slot order)."""

    generation: int
    pg_epoch: int
    layer: int
    status: ControlStatus
    num_routes: int
    map_digest: int
    hidden_width: int
    dtype_code: int
    scale_cols: int  # FP32 scales per payload row (0 for a native payload)
    send_counts: tuple[int, ...]  # peer-slot order

    def to_array(self) -> np.ndarray:
        head = [int(getattr(self, name)) for name in HEADER_FIELDS]
        return np.asarray(head + list(self.send_counts), dtype=np.int64)

    @staticmethod
    def from_array(a: np.ndarray) -> "ControlRecord":
        n = len(HEADER_FIELDS)
        head = {name: int(v) for name, v in zip(HEADER_FIELDS, a[:n])}
        head["status"] = ControlStatus(head["status"])
        return ControlRecord(**head, send_counts=tuple(int(x) for x in a[n:]))


def agree(records: list[ControlRecord], group_ranks: tuple[int, ...], tag: str) -> np.ndarray:
    """Check the all-gathered control records (identical on every rank, so every rank decides alike).

    Returns the peer-ordered count matrix [G, G] int64 (row = source peer, column = destination peer).
    Raises ``StaleGenerationError`` or ``CountAgreementError`` naming the offending ranks.
    """
    stale = [group_ranks[i] for i, r in enumerate(records) if r.status == ControlStatus.STALE_GENERATION]
    if stale:
        gens = sorted({r.generation for r in records})
        raise StaleGenerationError(
            f"{tag}: rank(s) {stale} refused generation(s) {gens} for new dispatch; step aborted on every rank "
            f"before payload exchange",
            requested=records[0].generation,
        )
    bad = [(group_ranks[i], r.status.name) for i, r in enumerate(records) if r.status != ControlStatus.OK]
    if bad:
        raise CountAgreementError(f"{tag}: rank(s) {bad} aborted the step before payload exchange")
    first = records[0]
    for i, r in enumerate(records):
        if r.scale_cols != first.scale_cols:
            raise CountAgreementError(
                f"{tag}: rank {group_ranks[i]} declares {r.scale_cols} FP8 scales per row but rank {group_ranks[0]} "
                f"declares {first.scale_cols}: scale count mismatch, payload rejected before expert compute "
                f"(before it moved)"
            )
        for name in ("generation", "pg_epoch", "layer", "map_digest", "hidden_width", "dtype_code"):
            if getattr(r, name) != getattr(first, name):
                raise CountAgreementError(
                    f"{tag}: rank {group_ranks[i]} reports {name}={getattr(r, name)} but rank {group_ranks[0]} "
                    f"reports {getattr(first, name)}; aborted before payload exchange"
                )
        if len(r.send_counts) != len(records):
            raise CountAgreementError(
                f"{tag}: rank {group_ranks[i]} sent a split vector of {len(r.send_counts)} peers for a group of "
                f"{len(records)}"
            )
        if sum(r.send_counts) != r.num_routes or min(r.send_counts, default=0) < 0:
            raise CountAgreementError(
                f"{tag}: rank {group_ranks[i]} declares split vector {list(r.send_counts)} (sum "
                f"{sum(r.send_counts)}) for {r.num_routes} accepted routes; aborted before payload exchange"
            )
    return np.asarray([r.send_counts for r in records], dtype=np.int64)


def control_round(exchange, record: ControlRecord, tag: str, *, local_error: Exception | None = None) -> np.ndarray:
    """Step 2 of the protocol: all-gather ``record`` and agree. Returns the peer count matrix [G, G].

    A rank that refused its own input (``local_error``) still takes part (its record says BAD_INPUT) and
    re-raises its own, more precise error when the group aborts."""
    gathered = exchange.all_gather(f"{tag}/ctl", record.to_array())
    try:
        return agree([ControlRecord.from_array(row) for row in gathered], exchange.group.peer_order, tag)
    except (CountAgreementError, StaleGenerationError):
        if local_error is not None:
            raise local_error from None
        raise


def global_counts(c_peer: np.ndarray, peer_order, num_ranks: int) -> torch.Tensor:
    """The agreed peer count matrix [G, G] as C[p, u] over global ranks [P, P] int64 (absent ranks zero)."""
    order = np.asarray(peer_order)
    c = np.zeros((num_ranks, num_ranks), dtype=np.int64)
    c[np.ix_(order, order)] = c_peer
    return torch.from_numpy(c)


# ------------------------------------------------------------------------------------------------------
#  the fence, deferred checks, the contract
# ------------------------------------------------------------------------------------------------------


def fence(handle: Handle, snapshot: PlacementSnapshot) -> None:
    """The generation fence (spec 0x02B3): combine must run under the handle's own generation and layer."""
    if snapshot.generation != handle.generation or snapshot.layer != handle.layer:
        raise StaleGenerationError(
            f"combine of {handle.handle_id}: handle generation {handle.generation} layer {handle.layer} but the "
            f"snapshot given is generation {snapshot.generation} layer {snapshot.layer}",
            requested=handle.generation,
        )


class DeferredChecks:
    """Handle integrity flags (device bools, no sync when added), read together with the step's output
    before it is published: one host read for every layer of a step (fault 4 of spec 0x0E)."""

    def __init__(self) -> None:
        self._items: list[tuple[str, torch.Tensor]] = []

    def add(self, handle_id: str, ok: torch.Tensor) -> None:
        self._items.append((handle_id, ok))

    def __len__(self) -> int:
        return len(self._items)

    def flags(self) -> torch.Tensor | None:
        """[n] bool, every added flag, stacked where they live (no sync; None when there are none)."""
        if not self._items:
            return None
        return torch.stack([f.reshape(()) for _, f in self._items])

    def verify(self, host_flags=None) -> None:
        """Raise ``RouteValidationError`` naming the first corrupt handle. ``host_flags``: ``flags()`` already
        copied to the host with other step results (one copy); else they are read here (one sync)."""
        if not self._items:
            return
        values = host_flags if host_flags is not None else self.flags().cpu().tolist()
        for (hid, _), ok in zip(self._items, values):
            reject_corrupt(hid, bool(ok))


def reject_corrupt(handle_id: str, ok: bool) -> None:
    if not ok:
        raise RouteValidationError(f"handle {handle_id}: its inverse route map is not a permutation of the "
                                   f"dispatched rows; output rejected before publish")


class Dispatcher(ABC):
    """One rank's endpoint of one dispatch mode over one exchange (the contract in the module docstring).

    ``status`` lets the caller refuse the step (a stale generation) while still taking part in the control
    round, so every peer aborts together. ``masks_rows``: whether ``dispatch`` honours a RouteBatch's
    ``row_valid`` itself (else the caller masks the padding rows' ids to -1 first)."""

    mode: DispatchMode
    masks_rows: bool = False

    @abstractmethod
    def dispatch(self, batch: RouteBatch, snapshot: PlacementSnapshot, *, tag: str,
                 status: ControlStatus = ControlStatus.OK) -> DispatchOutput:
        """batch.hidden [T, d], topk_ids [T, k] int64, topk_weights [T, k] float32 -> expert-major rows."""

    @abstractmethod
    def combine(self, expert_rows: torch.Tensor, handle: Handle, snapshot: PlacementSnapshot, *, tag: str,
                out_dtype: torch.dtype, checks: DeferredChecks | None = None) -> torch.Tensor:
        """Expert outputs (same layout as ``dispatch``'s rows, no gate applied) -> [T, d] ``out_dtype``.
        With ``checks`` the handle check is deferred into it; otherwise it is checked now (one sync)."""

    @abstractmethod
    def handle_ok(self, handle: Handle) -> torch.Tensor:
        """0-d bool device tensor: the handle's inverse map is intact (no host sync)."""

    def sent_slot_counts(self, handle: Handle) -> torch.Tensor | np.ndarray:
        """[Q] routes this rank sent to each physical slot (host array, or a device tensor read later)."""
        return handle.sent_slot_counts  # type: ignore[attr-defined]

    def slot_rows(self, out: DispatchOutput) -> torch.Tensor | tuple[int, ...]:
        """[Q_local] rows executed here per local slot (host counts, or a device tensor read later)."""
        return out.counts_list

    def _check(self, handle: Handle, checks: DeferredChecks | None) -> None:
        ok = self.handle_ok(handle)
        if checks is None:
            reject_corrupt(handle.handle_id, bool(ok))
        else:
            checks.add(handle.handle_id, ok)


__all__ = [
    "ControlStatus", "ControlRecord", "DTYPE_CODES", "HEADER_FIELDS", "agree", "control_round", "global_counts",
    "Handle", "DispatchOutput", "DeferredChecks", "Dispatcher", "fence", "reject_corrupt",
]
