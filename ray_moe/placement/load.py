"""The load window that feeds EPLB: a demand matrix with provenance (spec 0x08A, 0x08I). Pure: no Ray.

Each serving step reports accepted-route counts per (layer, logical expert). ``LoadWindow`` keeps the
last ``window`` observations and turns them into a ``LoadMatrix``:

* ``aggregation="sum"`` (no smoothing): ``W = sum of the windowed counts``; ``W.sum()`` reconciles to
  the accepted routes of those steps.
* ``aggregation="ema"`` (``smoothing=beta``): ``W_t = beta * W_{t-1} + (1 - beta) * C_t`` over the
  windowed observations, oldest first, seeded with the oldest one (``W_first = C_first``). The unit is
  then accepted rows *per step*. Seeding inside the window keeps the provenance exact: the estimate
  depends on exactly the steps it names.

Load is counted in accepted rows: a row count is not kernel time (0x08K). The provenance names the
phase(s), checkpoint(s) and placement generation(s) that produced the observations, so a stale
workload cannot silently drive a solve.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from ray_moe.core.types import Phase

__all__ = ["LoadMatrix", "LoadObservation", "LoadProvenance", "LoadWindow"]


class LoadProvenance(BaseModel):
    """Where a load matrix came from (spec 0x08A)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unit: Literal["accepted_rows"] = "accepted_rows"
    aggregation: Literal["sum", "ema"]
    smoothing: float | None = Field(default=None, description="beta of the EMA; None for sum")
    window: int = Field(ge=1, description="capacity of the window (observations)")
    window_steps: int = Field(ge=1, description="observations that fed this matrix")
    phases: tuple[Phase, ...] = Field(description="distinct phases observed, in Phase declaration order")
    phase: Literal["prefill", "decode", "mixed"]
    checkpoints: tuple[str, ...] = Field(description="distinct checkpoint versions observed, sorted")
    generations: tuple[int, ...] = Field(description="distinct placement generations observed, ascending")
    first_step: int = Field(ge=0)
    last_step: int = Field(ge=0)
    total_rows: int = Field(ge=0, description="sum of the raw windowed counts (accepted routes)")


@dataclass(frozen=True)
class LoadObservation:
    """One recorded step. ``counts``: [L, E] int64, read-only."""

    step: int
    counts: np.ndarray
    phase: Phase
    generation: int
    checkpoint: str


@dataclass(frozen=True, eq=False)
class LoadMatrix:
    """EPLB input. ``weight``: [L, E] float64, read-only."""

    weight: np.ndarray
    provenance: LoadProvenance

    def as_tensor(self) -> torch.Tensor:
        """``weight`` as a fresh torch tensor, [L, E] float64."""
        return torch.from_numpy(self.weight.copy())

    def layer(self, layer: int) -> np.ndarray:
        """Row ``layer`` of ``weight``, [E] float64."""
        return self.weight[layer]


def _as_counts(step_counts: object, shape: tuple[int, int]) -> np.ndarray:
    """Validate ``step_counts`` ([L, E] integer, >= 0) and return a read-only int64 copy."""
    if isinstance(step_counts, torch.Tensor):
        if step_counts.is_floating_point() or step_counts.is_complex() or step_counts.dtype == torch.bool:
            raise ValueError(f"step_counts: expected an integer dtype, got {step_counts.dtype}")
        arr = step_counts.detach().cpu().numpy()
    else:
        arr = np.asarray(step_counts)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"step_counts: expected an integer dtype, got {arr.dtype}")
    if arr.shape != shape:
        raise ValueError(f"step_counts: expected shape [L={shape[0]}, E={shape[1]}], got {list(arr.shape)}")
    arr = arr.astype(np.int64, copy=True)
    if arr.size and arr.min() < 0:
        l, e = (int(i) for i in np.argwhere(arr < 0)[0])
        raise ValueError(f"step_counts[{l}, {e}]={int(arr[l, e])} is negative")
    arr.setflags(write=False)
    return arr


class LoadWindow:
    """Sliding window of per-step accepted-route counts (thread-safe).

    Args:
        num_layers: L >= 1.  num_experts: E >= 1.  window: observations kept (>= 1).
        smoothing: EMA ``beta`` in [0, 1), or ``None`` for a plain sum.
    """

    def __init__(self, num_layers: int, num_experts: int, window: int, smoothing: float | None = None) -> None:
        for name, v in (("num_layers", num_layers), ("num_experts", num_experts), ("window", window)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if smoothing is not None:
            if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing < 1.0:
                raise ValueError(f"smoothing={smoothing!r} must be a float in [0, 1) or None")
            smoothing = float(smoothing)
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window = window
        self.smoothing = smoothing
        self._lock = threading.Lock()
        self._obs: deque[LoadObservation] = deque(maxlen=window)
        self._next_step = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._obs)

    def record(
        self, step_counts: object, *, phase: Phase | str, generation: int, checkpoint: str, step: int | None = None
    ) -> int:
        """Add one step's counts ``[L, E]`` (int64, >= 0); return its step index.

        ``step`` defaults to one past the previous step; an explicit one must be larger than it.
        The oldest observation falls out once ``window`` are held. Nothing is stored on refusal.
        """
        counts = _as_counts(step_counts, (self.num_layers, self.num_experts))
        try:
            ph = Phase(phase)
        except ValueError:
            raise ValueError(f"phase={phase!r} is not one of {[p.value for p in Phase]}") from None
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise ValueError(f"generation={generation!r} must be an int >= 0")
        if not isinstance(checkpoint, str) or not checkpoint:
            raise ValueError(f"checkpoint={checkpoint!r} must be a non-empty string")
        with self._lock:
            if step is None:
                idx = self._next_step
            elif isinstance(step, bool) or not isinstance(step, int) or step < self._next_step:
                raise ValueError(f"step={step!r} must be an int >= {self._next_step} (steps increase)")
            else:
                idx = step
            self._obs.append(LoadObservation(idx, counts, ph, generation, checkpoint))
            self._next_step = idx + 1
            return idx

    def observations(self) -> tuple[LoadObservation, ...]:
        with self._lock:
            return tuple(self._obs)

    def clear(self) -> None:
        """Drop every observation (e.g. after a checkpoint change); step numbering continues."""
        with self._lock:
            self._obs.clear()

    def snapshot(self, phase: Phase | str | None = None) -> LoadMatrix:
        """Aggregate the window (optionally only observations of ``phase``) into a ``LoadMatrix``.

        Steps:
            1. Select the windowed observations (of ``phase`` if given); refuse an empty selection.
            2. Sum them, or run the EMA oldest first seeded with the oldest.
            3. Record provenance: phases, checkpoints, generations, first/last step, total rows.
        """
        try:
            want = None if phase is None else Phase(phase)
        except ValueError:
            raise ValueError(f"phase={phase!r} is not one of {[p.value for p in Phase]}") from None
        with self._lock:
            obs = [o for o in self._obs if want is None or o.phase is want]
        # 1.
        if not obs:
            raise ValueError(
                f"snapshot: the window holds no observations{'' if want is None else f' of phase={want.value!r}'}"
            )
        # 2.
        raw = np.stack([o.counts for o in obs]).astype(np.float64)  # [n, L, E]
        if self.smoothing is None:
            weight = raw.sum(axis=0)
        else:
            beta = self.smoothing
            weight = raw[0].copy()
            for c in raw[1:]:
                weight = beta * weight + (1.0 - beta) * c
        weight.setflags(write=False)
        # 3.
        seen = {o.phase for o in obs}
        phases = tuple(p for p in Phase if p in seen)  # Phase declaration order
        prov = LoadProvenance(
            aggregation="sum" if self.smoothing is None else "ema",
            smoothing=self.smoothing,
            window=self.window,
            window_steps=len(obs),
            phases=phases,
            phase=phases[0].value if len(phases) == 1 else "mixed",
            checkpoints=tuple(sorted({o.checkpoint for o in obs})),
            generations=tuple(sorted({o.generation for o in obs})),
            first_step=obs[0].step,
            last_step=obs[-1].step,
            total_rows=int(sum(int(o.counts.sum()) for o in obs)),
        )
        return LoadMatrix(weight=weight, provenance=prov)
