"""EPLB: expert replication and placement (spec 0x08B-0x08E, 0x08I-0x08K). Pure: no Ray.

:func:`rebalance_experts` is the entry point. Plain, it reproduces the pinned public solver
(deepseek-ai/EPLB ``eplb.py`` at d52c72d5b2f2fb4c41afbf8eb21366820239913d) exactly, with every layer
solved at once: hierarchical policy when ``num_groups % num_nodes == 0``, else the global policy (one
group on one node). The vectorised solver and its arithmetic contract are in
:mod:`ray_moe.placement.eplb_solver`; the loop-form oracle it must match bit for bit is
:mod:`ray_moe_dev.testing.eplb_reference`.

Two options go beyond the source; both are OFF by default and change nothing when off:

* ``avoid_same_gpu_duplicates`` (option (a)): no two copies of one expert on a GPU where the
  placement domain allows it; a variant of the GPU packing, see :mod:`ray_moe.placement.eplb_solver`.
* ``current_phy2log`` with ``migration_tolerance`` (option (b)): keep copies where the live placement
  has them, within ``(1 + tolerance)`` x the plain solution's ideal max GPU load; see
  :mod:`ray_moe.placement.eplb_migration`.

:func:`validate_result` checks that an :class:`EPLBResult` describes one placement.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from ray_moe.placement.eplb_migration import as_current_placement, migration_aware_phy2log
from ray_moe.placement.eplb_solver import (
    as_load_matrix,
    expert_counts,
    padded_inverse,
    ranks_in_slot_order,
    solve_layers,
    validate_shape,
)


class EPLBResult(NamedTuple):
    """Output of :func:`rebalance_experts` (CPU torch tensors, int64).

    phy2log: [L, Q] logical expert of each physical slot; slot q lives on GPU q // (Q / num_gpus).
    log2phy: [L, E, M] physical slots of each logical expert, padded with -1 (M = max logcnt over
        all layers). Only the first ``logcnt[l, e]`` entries of a row are slots (spec 0x08C3).
    logcnt: [L, E] number of physical copies of each logical expert (>= 1, sums to Q per layer).
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor


def rebalance_experts(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    avoid_same_gpu_duplicates: bool = False,
    current_phy2log: Any = None,
    migration_tolerance: float = 0.0,
    min_replicas: Any = None,
) -> EPLBResult:
    """EPLB entry point (source ``rebalance_experts``), vectorised over layers.

    weight: [L, E] load per layer and logical expert (torch tensor or array-like, >= 0, finite).
    num_replicas: Q physical slots per layer, a multiple of ``num_gpus`` and >= E.
    num_groups: expert groups (contiguous, E / num_groups experts each); hierarchical policy iff
        ``num_groups % num_nodes == 0`` (then it must divide E), else global (one group, one node;
        ``num_groups`` is then ignored and need not divide E).
    num_nodes, num_gpus: topology; ``num_gpus`` a multiple of ``num_nodes``.
    avoid_same_gpu_duplicates: option (a), see :mod:`ray_moe.placement.eplb_solver`. Off: the source's
        semantics.
    current_phy2log: [L, Q] int, the live placement; turns on option (b), see
        :mod:`ray_moe.placement.eplb_migration`. None: the source's semantics.
    migration_tolerance: >= 0; allowed relative increase of the ideal max GPU load for keeping slots
        (used only with ``current_phy2log``).
    min_replicas: optional [L, E] int replica floors (a manual ``scale`` records them): every expert gets
        at least that many copies; the remaining slots are replicated as the source does. None (or every
        floor <= 1) is the source's solve, bit for bit. A floor that cannot be met with the slots of its
        layer (or node, on the hierarchical path) raises ValueError naming the expert and the floor.
    Returns EPLBResult(phy2log [L, Q], log2phy [L, E, M], logcnt [L, E]), int64 CPU tensors.
    """
    # Step 1: validate.
    w = as_load_matrix(weight)
    shape = validate_shape(w.shape[0], w.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    if not isinstance(avoid_same_gpu_duplicates, bool):
        raise ValueError(f"avoid_same_gpu_duplicates={avoid_same_gpu_duplicates!r} must be a bool")
    if isinstance(migration_tolerance, bool) or not isinstance(migration_tolerance, (int, float)):
        raise ValueError(f"migration_tolerance={migration_tolerance!r} must be a real number")
    if not math.isfinite(migration_tolerance) or migration_tolerance < 0:
        raise ValueError(f"migration_tolerance={migration_tolerance} must be finite and >= 0")
    current = None if current_phy2log is None else as_current_placement(current_phy2log, shape)
    floor = _as_floors(min_replicas, shape)
    # Step 2: the source's solve, all layers at once (replica floors, if any, are met first).
    phy2log, phyrank, logcnt = solve_layers(w, shape, avoid_same_gpu_duplicates, None, floor)
    # Step 3: optional migration awareness; replica ranks are then numbered in slot order.
    if current is not None:
        phy2log = migration_aware_phy2log(w, phy2log, current, shape, float(migration_tolerance),
                                          avoid_same_gpu_duplicates, floor)
        phyrank, logcnt = ranks_in_slot_order(phy2log, shape.num_experts)
    # Step 4: padded inverse map.
    log2phy = padded_inverse(phy2log, phyrank, logcnt)
    return EPLBResult(torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt))


def _as_floors(min_replicas: Any, shape: Any) -> np.ndarray | None:
    """Replica floors as [L, E] int64 (None when absent or all <= 1); the global capacity check names the
    first expert whose floor does not fit its layer's slots."""
    if min_replicas is None:
        return None
    f = np.asarray(min_replicas.cpu() if isinstance(min_replicas, torch.Tensor) else min_replicas)
    if f.shape != (shape.num_layers, shape.num_experts):
        raise ValueError(f"min_replicas has shape {tuple(f.shape)}, expected [L, E] = "
                         f"[{shape.num_layers}, {shape.num_experts}]")
    if f.size and not np.issubdtype(f.dtype, np.integer):
        raise ValueError(f"min_replicas must hold integer replica counts, got dtype {f.dtype}")
    f = f.astype(np.int64)
    if not (f > 1).any():
        return None
    need = np.maximum(f, 1).sum(axis=1)
    for l in np.flatnonzero(need > shape.num_replicas):
        e = int(np.argmax(f[l]))
        raise ValueError(
            f"min_replicas: expert {e} of layer {int(l)} has a floor of {int(f[l, e])} replicas, but the floors of "
            f"layer {int(l)} need {int(need[l])} slots and only {shape.num_replicas} physical slots exist")
    return f


def validate_result(result: EPLBResult) -> None:
    """Check that phy2log, log2phy and logcnt describe one placement (spec 0x08C3, 0x08K).

    phy2log [L, Q] ids in 0..E-1; logcnt [L, E] equals the copies counted in phy2log and is >= 1;
    log2phy [L, E, M] with M = max logcnt lists exactly the slots of each expert in its first
    logcnt entries and -1 after them. Raises ValueError naming the field.
    """
    phy2log, log2phy, logcnt = (np.asarray(t.cpu() if isinstance(t, torch.Tensor) else t) for t in result)
    if phy2log.ndim != 2 or logcnt.ndim != 2 or log2phy.ndim != 3:
        raise ValueError(
            f"result shapes phy2log {phy2log.shape}, log2phy {log2phy.shape}, logcnt {logcnt.shape} are not "
            "[L, Q], [L, E, M], [L, E]"
        )
    L, Q = phy2log.shape
    E = logcnt.shape[1]
    if logcnt.shape[0] != L or log2phy.shape[:2] != (L, E):
        raise ValueError(f"result: layer/expert dims disagree: phy2log {phy2log.shape}, log2phy {log2phy.shape}, "
                         f"logcnt {logcnt.shape}")
    if phy2log.min() < 0 or phy2log.max() >= E:
        raise ValueError(f"phy2log holds an expert id outside 0..{E - 1}")
    counts = expert_counts(phy2log.astype(np.int64), E)
    if not np.array_equal(counts, logcnt):
        l, e = np.argwhere(counts != logcnt)[0]
        raise ValueError(f"logcnt[{l}, {e}]={logcnt[l, e]} but phy2log has {counts[l, e]} copies")
    if (logcnt < 1).any():
        l, e = np.argwhere(logcnt < 1)[0]
        raise ValueError(f"logcnt[{l}, {e}]=0: every logical expert needs a physical copy")
    if log2phy.shape[2] != logcnt.max():
        raise ValueError(f"log2phy width {log2phy.shape[2]} != max logcnt {logcnt.max()}")
    valid = np.arange(log2phy.shape[2])[None, None, :] < logcnt[:, :, None]
    if (log2phy[~valid] != -1).any():
        raise ValueError("log2phy: padding past logcnt must be -1")
    slots = np.where(valid, log2phy, 0)
    if (slots < 0).any() or (slots >= Q).any():
        raise ValueError(f"log2phy holds a slot outside 0..{Q - 1} within logcnt")
    owner = np.take_along_axis(phy2log, slots.reshape(L, -1), axis=1).reshape(slots.shape)
    if (valid & (owner != np.arange(E)[None, :, None])).any():
        raise ValueError("log2phy lists a slot whose phy2log expert differs")
    seen = np.zeros((L, Q), dtype=np.int64)
    np.add.at(seen, (np.broadcast_to(np.arange(L)[:, None, None], slots.shape)[valid], slots[valid]), 1)
    if (seen != 1).any():
        raise ValueError("log2phy must list every physical slot exactly once")
