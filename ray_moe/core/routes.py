"""The routes a router produced, as the stages after it see them (spec 0x01A0): ``RouteBatch`` (one origin
rank's router output for one MoE layer) and ``SemanticRoutes`` (its accepted routes in semantic order).
Placement selectors and dispatchers both read them; nothing after the router may change a route's logical
expert or gate (spec 0x00E).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ray_moe.core.errors import RouteValidationError


@dataclass(frozen=True, eq=False)
class RouteBatch:
    """One origin rank's router output for one MoE layer.

    hidden:       [T, d] float (fp32/bf16/fp16)
    topk_ids:     [T, k] int64  logical expert ids
    topk_weights: [T, k] float32 combine gates
    row_valid:    [T] bool or None: rows marked False route nowhere (padding of a static-shape step); only
                  a dispatcher with ``masks_rows`` takes it (``MoEStep`` masks the ids for the others)
    """

    origin_rank: int
    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    row_valid: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1])

    def validate(self, num_experts: int, hidden_size: int | None = None) -> None:
        """Reject malformed input before any state changes or any exchange starts."""
        h, ids, w = self.hidden, self.topk_ids, self.topk_weights
        if h.dim() != 2:
            raise RouteValidationError(f"hidden: expected [T, d], got shape {tuple(h.shape)}")
        if not h.is_floating_point():
            raise RouteValidationError(f"hidden: expected a floating dtype, got {h.dtype}")
        if hidden_size is not None and h.shape[1] != hidden_size:
            raise RouteValidationError(f"hidden: width {h.shape[1]} != hidden_size={hidden_size}")
        if ids.dim() != 2 or ids.shape[0] != h.shape[0]:
            raise RouteValidationError(
                f"topk_ids: expected [T={h.shape[0]}, k], got shape {tuple(ids.shape)}"
            )
        if ids.dtype not in (torch.int64, torch.int32):
            raise RouteValidationError(f"topk_ids: expected int64, got {ids.dtype}")
        if w.shape != ids.shape:
            raise RouteValidationError(
                f"topk_weights: shape {tuple(w.shape)} != topk_ids shape {tuple(ids.shape)}"
            )
        if not w.is_floating_point():
            raise RouteValidationError(f"topk_weights: expected float32, got {w.dtype}")
        if ids.numel():
            lo, hi, gates_finite, gates_nonneg, hidden_finite = self._value_flags()
            if lo < 0 or hi >= num_experts:
                bad = int(lo) if lo < 0 else int(hi)
                raise RouteValidationError(
                    f"topk_ids: expert id {bad} is out of range [0, {num_experts})"
                )
            if not gates_finite:
                raise RouteValidationError("topk_weights: NaN or infinite gate")
            if not gates_nonneg:
                raise RouteValidationError(f"topk_weights: negative gate {float(w.min())}")
            if not hidden_finite:
                raise RouteValidationError("hidden: NaN or infinite value")


    def _value_flags(self) -> list:
        """[min id, max id, gates finite, gates >= 0, hidden finite] with one host sync."""
        ids, w, h = self.topk_ids, self.topk_weights, self.hidden
        vals = torch.stack([ids.min().to(torch.float64), ids.max().to(torch.float64),
                            torch.isfinite(w).all().to(torch.float64), (w >= 0).all().to(torch.float64),
                            torch.isfinite(h).all().to(torch.float64)])
        return vals.tolist()


@dataclass(frozen=True, eq=False)
class SemanticRoutes:
    """Columnar semantic identity of one origin rank's accepted routes, in semantic order r = t*k + j.

    origin_token:   [R] int64  token row on the origin rank
    route_slot:     [R] int64  j in [0, k)
    logical_expert: [R] int64
    gate:           [R] float32
    """

    origin_rank: int
    num_tokens: int
    top_k: int
    origin_token: torch.Tensor
    route_slot: torch.Tensor
    logical_expert: torch.Tensor
    gate: torch.Tensor
    dense: bool = False  # True when r = t*k + j for every route (the router's layout; from_batch)

    @property
    def num_routes(self) -> int:
        return int(self.logical_expert.numel())

    @staticmethod
    def from_batch(batch: RouteBatch) -> "SemanticRoutes":
        t, k = batch.topk_ids.shape
        dev = batch.topk_ids.device
        return SemanticRoutes(
            origin_rank=batch.origin_rank,
            num_tokens=int(t),
            top_k=int(k),
            origin_token=torch.arange(t, device=dev, dtype=torch.int64).repeat_interleave(k),
            route_slot=torch.arange(k, device=dev, dtype=torch.int64).repeat(t),
            logical_expert=batch.topk_ids.reshape(-1).to(torch.int64),
            gate=batch.topk_weights.reshape(-1).to(torch.float32),
            dense=True,
        )

    def digest(self) -> str:
        """SHA-256 over the semantic columns (spec 0x01A0: a mutated expert or gate changes it)."""
        h = hashlib.sha256()
        h.update(f"{self.origin_rank}:{self.num_tokens}:{self.top_k}".encode())
        for t in (self.origin_token, self.route_slot, self.logical_expert, self.gate):
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()
