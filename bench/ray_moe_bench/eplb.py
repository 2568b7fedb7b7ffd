"""EPLB solver benchmark: vectorised ``rebalance_experts`` vs the loop-form oracle, same run.

    python -m ray_moe_bench.eplb            # full run
    python -m ray_moe_bench.eplb --quick    # fewer repeats, fewer shapes

For every shape: wall time of ``ray_moe.placement.eplb.rebalance_experts`` (median and min of
repeats) and of ``ray_moe_dev.testing.eplb_reference.rebalance_experts_reference`` (the per-layer,
per-item transcription of the pinned public solver), and a check that the three outputs are
identical. Also measured on the target shape: option (a) (avoid same-GPU duplicates) and option
(b) (migration-aware, on a drifted load), with slots changed and ideal Gamma_rank. Gamma and slot
counts are analytical (ideal W_e / m_e loads); only the times are measurements.
Writes ``eplb-<host>.json`` (``eplb-<host>-quick.json`` with ``--quick``) to ``--out DIR`` (default
``$RAY_MOE_RESULTS_DIR``, else ``./ray-moe-results``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from ray_moe_bench import summary
from ray_moe_bench.common import add_output_argument, host_kind, time_fn, write_result
from ray_moe.placement.eplb import rebalance_experts
from ray_moe.placement.eplb_solver import ideal_rank_loads, slots_changed
from ray_moe_dev.testing.eplb_reference import rebalance_experts_reference

# name, layers, experts, replicas, groups, nodes, gpus; the first is the target shape.
SHAPES: tuple[tuple[str, int, int, int, int, int, int], ...] = (
    ("deepseek-v3-hierarchical", 58, 256, 288, 8, 4, 32),
    ("deepseek-v3-global", 58, 256, 288, 1, 4, 32),  # 1 % 4 != 0 selects the global policy
    ("deepseek-v2-lite-hierarchical", 26, 64, 80, 8, 2, 16),
    ("mixtral-8x7b-one-node", 32, 8, 16, 1, 1, 8),
)
QUICK_SHAPES = SHAPES[:2]


def _load(layers: int, experts: int, seed: int) -> np.ndarray:
    """A skewed, tie-free load matrix [L, E] float32 (log-normal token shares)."""
    rng = np.random.default_rng(seed)
    return (rng.lognormal(0.0, 1.0, (layers, experts)) * 1000.0).astype(np.float32)


def _time_once(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "iters": repeats}


def _gamma(weight: np.ndarray, phy2log: Any, gpus: int) -> dict[str, float]:
    loads = ideal_rank_loads(weight, phy2log, gpus)
    g = loads.max(axis=1) / loads.mean(axis=1)
    return {"gamma_rank_mean": float(g.mean()), "gamma_rank_worst": float(g.max())}


def bench_shape(shape: tuple, *, iters: int, ref_iters: int, seed: int) -> dict[str, Any]:
    name, L, E, Q, G, N, P = shape
    w = _load(L, E, seed)
    wt = torch.from_numpy(w)
    ours = rebalance_experts(wt, Q, G, N, P)
    ref = rebalance_experts_reference(w, Q, G, N, P)
    identical = {
        k: bool(np.array_equal(a.numpy(), b)) for k, a, b in zip(("phy2log", "log2phy", "logcnt"), ours, ref[:3])
    }
    t_ours = time_fn(lambda: rebalance_experts(wt, Q, G, N, P), warmup=3, iters=iters, cuda=False)
    t_ref = _time_once(lambda: rebalance_experts_reference(w, Q, G, N, P), ref_iters)
    return {
        "name": name,
        "shape": {"layers": L, "experts": E, "replicas": Q, "groups": G, "nodes": N, "gpus": P},
        "policy": "hierarchical" if G % N == 0 else "global",
        "identical_to_reference": identical,
        "ours": t_ours,
        "reference_loop": t_ref,
        "speedup_median": t_ref["median_ms"] / t_ours["median_ms"],
        "objective_ideal": _gamma(w, ours.phy2log, P),
    }


def bench_options(shape: tuple, *, iters: int, seed: int) -> dict[str, Any]:
    """Options (a) and (b) on one shape; (b) on a drifted load (x U(0.75, 1.25) per expert)."""
    name, L, E, Q, G, N, P = shape
    w0 = _load(L, E, seed)
    rng = np.random.default_rng(seed + 1)
    w1 = (w0 * rng.uniform(0.75, 1.25, w0.shape)).astype(np.float32)
    current = rebalance_experts(w0, Q, G, N, P).phy2log
    plain = rebalance_experts(w1, Q, G, N, P)
    avoid = rebalance_experts(w1, Q, G, N, P, avoid_same_gpu_duplicates=True)

    def dup_gpus(phy2log: torch.Tensor) -> int:
        p = phy2log.numpy().reshape(L, P, Q // P)
        return int(sum(len(row) - len(set(row.tolist())) for layer in p for row in layer))

    out: dict[str, Any] = {
        "name": name,
        "plain": {"time": time_fn(lambda: rebalance_experts(w1, Q, G, N, P), warmup=2, iters=iters, cuda=False),
                  "same_gpu_duplicate_copies": dup_gpus(plain.phy2log), **_gamma(w1, plain.phy2log, P)},
        "avoid_same_gpu_duplicates": {
            "time": time_fn(lambda: rebalance_experts(w1, Q, G, N, P, avoid_same_gpu_duplicates=True),
                            warmup=2, iters=iters, cuda=False),
            "same_gpu_duplicate_copies": dup_gpus(avoid.phy2log),
            **_gamma(w1, avoid.phy2log, P),
        },
        "migration_aware": {
            "total_slots": L * Q,
            "plain_slots_changed": int(slots_changed(current, plain.phy2log).sum()),
            "by_tolerance": [],
        },
    }
    for tol in (0.0, 0.02, 0.1):
        res = rebalance_experts(w1, Q, G, N, P, current_phy2log=current, migration_tolerance=tol)
        t = time_fn(lambda: rebalance_experts(w1, Q, G, N, P, current_phy2log=current, migration_tolerance=tol),
                    warmup=1, iters=max(3, iters // 5), cuda=False)
        out["migration_aware"]["by_tolerance"].append(
            {"tolerance": tol, "slots_changed": int(slots_changed(current, res.phy2log).sum()), "time": t,
             **_gamma(w1, res.phy2log, P)}
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--quick", action="store_true", help="fewer repeats and shapes")
    parser.add_argument("--seed", type=int, default=0)
    add_output_argument(parser)
    args = parser.parse_args(argv)
    iters, ref_iters = (10, 1) if args.quick else (50, 3)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    results = [bench_shape(s, iters=iters, ref_iters=ref_iters, seed=args.seed) for s in shapes]
    options = bench_options(SHAPES[0], iters=iters, seed=args.seed)
    payload = {
        "quick": args.quick,
        "seed": args.seed,
        "note": "times are measured wall clock on this host (median/min of repeats); gamma and slot counts "
        "are analytical (ideal W_e/m_e loads). Baseline = loop-form oracle of the pinned public solver, "
        "measured in the same run.",
        "target": {"shape": SHAPES[0][0], "budget_ms": 10.0, "ours_median_ms": results[0]["ours"]["median_ms"]},
        "shapes": results,
        "options": options,
    }
    path = write_result("eplb", payload, suffix=f"{host_kind()}-quick" if args.quick else None, out=args.out)
    for r in results:
        print(
            f"{r['name']:32s} ours {r['ours']['median_ms']:7.2f} ms (min {r['ours']['min_ms']:.2f})  "
            f"reference {r['reference_loop']['median_ms']:8.1f} ms  x{r['speedup_median']:.0f}  "
            f"identical={all(r['identical_to_reference'].values())}"
        )
    o = options
    plain, avoid = o["plain"], o["avoid_same_gpu_duplicates"]
    print(f"avoid duplicates: {avoid['time']['median_ms']:.2f} ms, duplicate copies "
          f"{plain['same_gpu_duplicate_copies']} -> {avoid['same_gpu_duplicate_copies']}")
    m = o["migration_aware"]
    print(f"migration-aware: plain changes {m['plain_slots_changed']}/{m['total_slots']} slots; " + "; ".join(
        f"tol {x['tolerance']}: {x['slots_changed']} ({x['time']['median_ms']:.0f} ms)" for x in m["by_tolerance"]))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
