"""Placement manifests and the ideal-load objective from EPLB output (spec 0x08C3, 0x08D). Pure: no Ray.

Slot layout contract: the ``Q`` physical slots of a layer are laid out ``Q / P`` per GPU in order, so
slot ``q`` lives on global rank ``q // (Q / P)``, and EPLB's node ``n`` is ranks
``[n * P / N, (n + 1) * P / N)``: the layout :meth:`Topology.uniform` builds.

The objective report is the ideal rank-load coordinate of spec 0x08D: a copy of logical expert ``e``
carries ``W_e / m_e`` (a replica selector that splits evenly), rank load ``L_p`` sums its copies, and
``Gamma_rank = max_p L_p / mean_p L_p``. It omits route-to-replica policy, locality, migration and
kernel time (the spec's "what the number omits"); it is analytical, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from ray_moe.placement.eplb import EPLBResult, validate_result
from ray_moe.placement.manifest import PlacementManifest, manifest_from_assignment
from ray_moe.placement.topology import Topology


@dataclass(frozen=True)
class ObjectiveReport:
    """Ideal per-rank loads of one EPLB result (spec 0x08D), per layer.

    replica_counts: [L][E] copies per logical expert (``logcnt``).
    rank_loads: [L][P] exact ideal rank loads (Fraction; exact for integer and for float weights).
    rank_loads_float: [L][P] the same as floats.
    gamma_rank: [L] max rank load / mean rank load (Fraction); 1 for an all-zero layer.
    gamma_rank_float: [L] the same as floats.
    """

    num_gpus: int
    slots_per_gpu: int
    replica_counts: tuple[tuple[int, ...], ...]
    rank_loads: tuple[tuple[Fraction, ...], ...]
    rank_loads_float: tuple[tuple[float, ...], ...]
    gamma_rank: tuple[Fraction, ...]
    gamma_rank_float: tuple[float, ...]

    @property
    def num_layers(self) -> int:
        return len(self.replica_counts)

    @property
    def worst_gamma(self) -> float:
        """Largest Gamma_rank over layers."""
        return max(self.gamma_rank_float)


def _to_nested(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _exact(x: Any, where: str) -> Fraction:
    if isinstance(x, bool) or not isinstance(x, (int, float, Fraction)):
        raise ValueError(f"weight{where}={x!r} is not a real number")
    f = Fraction(x)
    if f < 0:
        raise ValueError(f"weight{where}={x!r} is negative")
    return f


def objective_report(weight: Any, result: EPLBResult, num_gpus: int) -> ObjectiveReport:
    """Replica counts, ideal rank loads and Gamma_rank of ``result`` under ``weight``.

    weight: [E] or [L, E] load (ints, floats, numpy or torch); result: EPLBResult with phy2log [L, Q];
    num_gpus: P, dividing Q. Slot q lives on rank q // (Q / P).
    """
    # Step 1: shapes.
    validate_result(result)
    phy2log = _to_nested(result.phy2log)
    counts = _to_nested(result.logcnt)
    rows = _to_nested(weight)
    if not isinstance(rows, (list, tuple)) or not rows:
        raise ValueError(f"weight must be [E] or [L, E], got {weight!r}")
    if not isinstance(rows[0], (list, tuple)):
        rows = [rows]
    L, E = len(counts), len(counts[0])
    if len(rows) != L or any(not isinstance(r, (list, tuple)) or len(r) != E for r in rows):
        raise ValueError(f"weight must be [{L}, {E}] (or [{E}] for one layer) to match result.logcnt")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus!r} must be a positive int")
    Q = len(phy2log[0])
    if Q % num_gpus != 0:
        raise ValueError(f"num_gpus={num_gpus} must divide the slot count Q={Q}")
    spg = Q // num_gpus
    loads_all, gammas = [], []
    for l in range(L):
        # Step 2: exact per-copy loads W_e / m_e summed per rank.
        w = [_exact(x, f"[{l}][{e}]") for e, x in enumerate(rows[l])]
        loads = [Fraction(0)] * num_gpus
        for q, e in enumerate(phy2log[l]):
            loads[q // spg] += w[e] / counts[l][e]
        # Step 3: Gamma_rank = max / mean (1 for an all-zero layer).
        total = sum(loads, Fraction(0))
        gamma = Fraction(1) if total == 0 else max(loads) / (total / num_gpus)
        loads_all.append(tuple(loads))
        gammas.append(gamma)
    return ObjectiveReport(
        num_gpus=num_gpus,
        slots_per_gpu=spg,
        replica_counts=tuple(tuple(int(c) for c in row) for row in counts),
        rank_loads=tuple(loads_all),
        rank_loads_float=tuple(tuple(float(x) for x in row) for row in loads_all),
        gamma_rank=tuple(gammas),
        gamma_rank_float=tuple(float(g) for g in gammas),
    )


def manifest_from_eplb(
    result: EPLBResult,
    *,
    topology: Topology,
    generation: int,
    num_experts: int,
    checkpoint_version: str,
    process_group_id: str = "ep-group-0",
    digests: dict[tuple[int, int], str] | None = None,
) -> PlacementManifest:
    """The placement manifest of an EPLB result: slot q of layer l -> rank q // (Q / P), P = topology ranks.

    result: EPLBResult (phy2log [L, Q]); num_experts must equal E of the result. Replica ids number an
    expert's copies in slot order (``e{e}-r{j}``); digests as in :func:`manifest_from_assignment`.
    """
    # Step 1: the result and the shapes agree.
    validate_result(result)
    phy2log = _to_nested(result.phy2log)
    E = len(_to_nested(result.logcnt)[0])
    if num_experts != E:
        raise ValueError(f"num_experts={num_experts} but the EPLB result has {E} logical experts")
    P = topology.num_ranks
    Q = len(phy2log[0])
    if Q % P != 0:
        raise ValueError(f"topology has {P} ranks, which does not divide the slot count Q={Q}")
    # Step 2: slots laid out Q / P per rank in order.
    spg = Q // P
    slot_rank = [[q // spg for q in range(Q)] for _ in phy2log]
    return manifest_from_assignment(
        generation=generation,
        phy2log=phy2log,
        slot_rank=slot_rank,
        num_experts=num_experts,
        topology=topology,
        process_group_id=process_group_id,
        checkpoint_version=checkpoint_version,
        digests=digests,
    )
