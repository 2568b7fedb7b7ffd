"""Overlap benchmark: the chunked stream/event DAG of one MoE layer vs the serialized step (spec 0x09-0x09F).

    python -m ray_moe_bench.overlap --world 2      # GPUs: one process per GPU, NCCL (CuPy), prefill shapes, bf16
    python -m ray_moe_bench.overlap --quick        # CPU: threads over LocalExchangeGroup, tiny shapes

Every rank runs the same layer (SPMD, ``ray_moe_dev.testing.spmd.run_spmd``). Per shape and per shared-expert
setting the step is timed as:

* ``engine``:      ``engine.dispatch`` -> grouped runner -> ``engine.combine`` (+ shared SwiGLU), one stream
* ``serialized``:  ``overlapped_layer(serialized=True, chunks=1)``: every task on one stream (the baseline)
* ``c{n}-{order}``: ``overlapped_layer(chunks=n, comm_order=order)`` on five streams, n in 1, 2, 4, 8

Every number here is MEASURED (CUDA events on the caller's stream around one step, after a barrier; on
CPU ``perf_counter``): the median, min and p90 over ``--iters`` steps per rank, and the step time of the
group = the max over ranks of the per-rank median. ``speedup_vs_serialized`` is the ratio of two measured
medians from this run. Nothing is derived from the analytical ``analysis.overlap_schedule`` model.

The per-stream timeline of one extra step per config (``timed=True``: an event before and after every task)
is reported in milliseconds since the step's entry event: task intervals, stream busy time, the union of
compute-task and of communication-task intervals and their intersection (0x09C's overlap, measured).
Timeline overlap is NOT a speedup (0x09F): concurrent kernels slow each other down.

Every config's output is checked against the serialized output of the same inputs (max relative error);
a stream/event race would show up there, not only in the timing.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ray_moe_bench import summary
from ray_moe_bench.common import add_output_argument, host_kind, write_result
from ray_moe_dev.analysis.overlapped_layer import COMM_ORDERS, overlapped_layer
from ray_moe_dev.analysis.overlapped_streams import StreamSet
from ray_moe.moe.dispatch.engine import combine, dispatch
from ray_moe.moe.exchange.base import Exchange
from ray_moe.core.routes import RouteBatch
from ray_moe.moe.experts.runners import make_runner
from ray_moe.moe.experts.weights import ExpertWeights, SlotWeights, swiglu
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.selector import make_selector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe_dev.testing.spmd import exchange_device, run_spmd

MEASURED = "measured"


@dataclass(frozen=True)
class Shape:
    """One prefill layer per rank: tokens T, hidden d, expert FFN f, experts per rank, top-k, dtype name,
    shared-expert FFN width (0: no shared expert variant)."""

    name: str
    tokens: int
    d: int
    f: int
    experts_per_rank: int
    k: int
    dtype: str
    shared_f: int


@dataclass(frozen=True)
class Config:
    """One timed variant. kind: engine | serialized | overlapped."""

    name: str
    kind: str
    chunks: int
    comm_order: str
    shared: bool


@dataclass(frozen=True)
class Plan:
    """Everything a rank needs (picklable)."""

    shapes: tuple[Shape, ...]
    configs: tuple[Config, ...]
    warmup: int
    iters: int
    seed: int


GPU_SHAPES = (
    Shape("mixtral-like-prefill", tokens=4096, d=4096, f=2048, experts_per_rank=16, k=4, dtype="bfloat16",
          shared_f=2048),
    Shape("deepseek-like-prefill", tokens=2048, d=7168, f=2048, experts_per_rank=32, k=8, dtype="bfloat16",
          shared_f=2048),
)
QUICK_SHAPES = (
    Shape("tiny-a", tokens=128, d=64, f=128, experts_per_rank=4, k=2, dtype="float32", shared_f=128),
    Shape("tiny-b", tokens=64, d=96, f=64, experts_per_rank=8, k=4, dtype="float32", shared_f=64),
)


def configs(chunk_counts: tuple[int, ...], orders: tuple[str, ...]) -> tuple[Config, ...]:
    out: list[Config] = []
    for shared in (False, True):
        out.append(Config("serialized" + ("+shared" if shared else ""), "serialized", 1, "dispatch_first", shared))
        out.append(Config("engine" + ("+shared" if shared else ""), "engine", 1, "dispatch_first", shared))
        for n in chunk_counts:
            for order in orders:
                out.append(Config(f"c{n}-{order}" + ("+shared" if shared else ""), "overlapped", n, order, shared))
    return tuple(out)


# ------------------------------------------------------------------------------------------------ setup
def _snapshot(world: int, experts_per_rank: int) -> PlacementSnapshot:
    """E = world * experts_per_rank experts, expert e in slot e on rank e // experts_per_rank."""
    e = world * experts_per_rank
    topo = Topology.single_node(world)
    manifest = manifest_from_assignment(generation=0, phy2log=[list(range(e))],
                                        slot_rank=[[q // experts_per_rank for q in range(e)]], num_experts=e,
                                        topology=topo)
    return PlacementSnapshot.from_manifest(manifest, topo, ProcessGroupSpec.identity(world))


def _draw(g: torch.Generator, dev: torch.device, dtype: torch.dtype, *shape: int, fan_in: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) / math.sqrt(fan_in)).to(dtype)


def _layer(shape: Shape, world: int, rank: int, dev: torch.device, seed: int):
    """Inputs, weights and shared expert of one rank, drawn on ``dev``.

    hidden [T, d]; topk_ids [T, k] distinct uniform experts; gates [T, k] float32 (softmax of noise);
    slot weights [Q_local, f, d] / [Q_local, d, f]; shared expert w_gate/w_up [f_s, d], w_down [d, f_s].
    """
    dtype = getattr(torch, shape.dtype)
    g = torch.Generator(device=dev).manual_seed(seed * 7919 + rank)
    e = world * shape.experts_per_rank
    hidden = _draw(g, dev, dtype, shape.tokens, shape.d, fan_in=1)
    ids = torch.rand(shape.tokens, e, generator=g, device=dev).topk(shape.k, dim=1).indices.to(torch.int64)
    gates = torch.softmax(torch.rand(shape.tokens, shape.k, generator=g, device=dev), dim=1).to(torch.float32)
    q, d, f = shape.experts_per_rank, shape.d, shape.f
    slots = tuple(range(rank * q, (rank + 1) * q))
    weights = SlotWeights(layer=0, slot_ids=slots, experts=slots, w_gate=_draw(g, dev, dtype, q, f, d, fan_in=d),
                          w_up=_draw(g, dev, dtype, q, f, d, fan_in=d), w_down=_draw(g, dev, dtype, q, d, f, fan_in=f))
    fs = shape.shared_f
    shared = ExpertWeights(0, -1, _draw(g, dev, dtype, fs, d, fan_in=d), _draw(g, dev, dtype, fs, d, fan_in=d),
                           _draw(g, dev, dtype, d, fs, fan_in=fs))
    return RouteBatch(rank, hidden, ids, gates), weights, shared


# ------------------------------------------------------------------------------------------- rank side
def _barrier(exchange: Exchange, tag: str) -> None:
    """All ranks meet (the NCCL all-gather waits on the host until every rank's round completed)."""
    exchange.all_gather(tag, np.zeros(1, dtype=np.int64))


def _engine_step(batch, snap, exchange, selector, runner, weights, shared, tag):
    out = dispatch(batch, snap, exchange, selector=selector, tag=tag)
    rows = runner.run(out.rows, out.counts_list, weights)
    y = combine(rows, out.handle, snap, exchange, tag=tag, out_dtype=torch.float32)
    if shared is not None:
        y = y + swiglu(batch.hidden, shared.w_gate, shared.w_up, shared.w_down).to(torch.float32)
    return y.to(batch.hidden.dtype)


def _rank_worker(exchange: Exchange, rank: int, plan: Plan) -> dict[str, Any]:
    """Times every (shape, config) on this rank; returns per-config samples, one timeline, one error."""
    dev = exchange_device(exchange)
    cuda = dev.type == "cuda"
    world = exchange.size
    runner = make_runner("grouped")
    selector = make_selector("round_robin")
    streams = StreamSet.for_device(dev)  # built once, reused by every overlapped step
    out: dict[str, Any] = {"rank": rank, "device": str(dev), "shapes": {}}
    for s_i, shape in enumerate(plan.shapes):
        snap = _snapshot(world, shape.experts_per_rank)
        batch, weights, shared_w = _layer(shape, world, rank, dev, plan.seed + s_i)
        per_cfg: dict[str, Any] = {}
        reference: dict[bool, torch.Tensor] = {}
        for c_i, cfg in enumerate(plan.configs):
            shared = shared_w if cfg.shared else None
            base = f"s{s_i}c{c_i}"

            def step(i: int, *, timed: bool = False):
                tag = f"{base}/{i}"
                if cfg.kind == "engine":
                    return _engine_step(batch, snap, exchange, selector, runner, weights, shared, tag)
                return overlapped_layer(
                    batch, snap, exchange, selector=selector, runner=runner, weights=weights, tag=tag,
                    chunks=cfg.chunks, shared_expert=shared, streams=None if cfg.kind == "serialized" else streams,
                    serialized=cfg.kind == "serialized", comm_order=cfg.comm_order, timed=timed)

            # 1. correctness of this config against the serialized output of the same inputs
            res = step(-1)
            y = res if isinstance(res, torch.Tensor) else res.hidden
            if cfg.kind == "serialized":
                reference[cfg.shared] = y.float()
            ref = reference.get(cfg.shared)
            err = None
            if ref is not None:
                err = float((y.float() - ref).abs().max()) / (float(ref.abs().max()) or 1.0)
            del res, y
            # 2. warmup, then timed iterations, each after a barrier
            for i in range(plan.warmup):
                step(i)
            samples: list[float] = []
            for i in range(plan.iters):
                _barrier(exchange, f"{base}/bar{i}")
                if cuda:
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                    step(plan.warmup + i)
                    t1.record()
                    t1.synchronize()
                    samples.append(t0.elapsed_time(t1))
                else:
                    c0 = time.perf_counter()
                    step(plan.warmup + i)
                    samples.append((time.perf_counter() - c0) * 1e3)
            # 3. one extra step with timing events around every task: the measured per-stream timeline
            timeline: dict[str, Any] | None = None
            timeline_error = None
            if cfg.kind != "engine":
                _barrier(exchange, f"{base}/bar-timed")
                res = step(plan.warmup + plan.iters, timed=True)
                try:
                    timeline = res.timeline().as_dict()
                except ValueError as exc:  # a violated dependency / stream collision / early release
                    timeline_error = str(exc)
                del res
            per_cfg[cfg.name] = {"samples_ms": samples, "max_rel_err_vs_serialized": err, "timeline": timeline,
                                 "timeline_error": timeline_error}
        out["shapes"][shape.name] = per_cfg
        del batch, weights, shared_w, reference
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------- report
def _stats(samples: list[float]) -> dict[str, float]:
    xs = sorted(samples)
    return {"median_ms": statistics.median(xs), "min_ms": xs[0],
            "p90_ms": xs[max(0, math.ceil(0.9 * len(xs)) - 1)], "iters": len(xs)}


def summarize(plan: Plan, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape and config: per-rank stats, group step time (max over ranks of the medians), speedup vs
    the serialized config with the same shared setting, correctness, rank 0's timeline."""
    shapes = []
    for shape in plan.shapes:
        rows = []
        for cfg in plan.configs:
            per_rank = [r["shapes"][shape.name][cfg.name] for r in ranks]
            stats = [_stats(p["samples_ms"]) for p in per_rank]
            errs = [p["max_rel_err_vs_serialized"] for p in per_rank if p["max_rel_err_vs_serialized"] is not None]
            tl = per_rank[0]["timeline"]
            rows.append({
                "config": cfg.name, **asdict(cfg),
                "step_ms": max(s["median_ms"] for s in stats),
                "per_rank": stats,
                "max_rel_err_vs_serialized": max(errs) if errs else None,
                "timeline_rank0": tl,
                "timeline_errors": [p["timeline_error"] for p in per_rank if p["timeline_error"]],
                "timeline_summary_per_rank": [
                    None if p["timeline"] is None else {k: p["timeline"][k] for k in (
                        "makespan_ms", "task_sum_ms", "compute_ms", "communication_ms", "compute_comm_overlap_ms")}
                    for p in per_rank
                ],
            })
        base = {r["shared"]: r["step_ms"] for r in rows if r["kind"] == "serialized"}
        for r in rows:
            r["speedup_vs_serialized"] = base[r["shared"]] / r["step_ms"] if r["step_ms"] > 0 else None
        shapes.append({**asdict(shape), "configs": rows})
    return shapes


def _print(shapes: list[dict[str, Any]]) -> None:
    print(f"{'shape':24} {'config':30} {'step ms':>9} {'vs serial':>9} {'rel err':>9} | timeline rank 0 (ms): "
          f"makespan compute comm overlap")
    for s in shapes:
        for r in s["configs"]:
            tl = r["timeline_rank0"]
            cells = "-" if tl is None else (f"{tl['makespan_ms']:8.3f} {tl['compute_ms']:8.3f} "
                                            f"{tl['communication_ms']:8.3f} {tl['compute_comm_overlap_ms']:8.3f}")
            err = "-" if r["max_rel_err_vs_serialized"] is None else f"{r['max_rel_err_vs_serialized']:.1e}"
            bad = "  TIMELINE INVALID: " + r["timeline_errors"][0] if r["timeline_errors"] else ""
            print(f"{s['name']:24} {r['config']:30} {r['step_ms']:9.3f} {r['speedup_vs_serialized']:8.2f}x "
                  f"{err:>9} | {cells}{bad}")
        best = min((r for r in s["configs"] if r["kind"] == "overlapped" and r["timeline_rank0"]),
                   key=lambda r: r["step_ms"], default=None)
        if best is not None:
            print(f"  measured timeline of {best['config']} (rank 0, ms since the step's entry event):")
            for t in best["timeline_rank0"]["tasks"]:
                print(f"    {t['name']:16} {t['stream']:14} [{t['start_ms']:8.3f}, {t['end_ms']:8.3f})  "
                      f"rows={t['rows']}")


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--world", type=int, default=2, help="ranks (GPUs with NCCL; threads with --quick/CPU)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on CPU threads (backend local)")
    ap.add_argument("--backend", default="auto", choices=("auto", "nccl", "local"))
    ap.add_argument("--iters", type=int, default=None, help="timed steps per config (default 20; quick 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per config (default 5; quick 2)")
    ap.add_argument("--chunks", default="1,2,4,8", help="comma-separated chunk counts of the overlapped configs")
    ap.add_argument("--orders", default=",".join(COMM_ORDERS), help="comma-separated comm orders")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=580.0, help="limit of the whole SPMD run")
    add_output_argument(ap)
    args = ap.parse_args(argv)

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if (not args.quick and torch.cuda.is_available()
                             and torch.cuda.device_count() >= args.world) else "local"
    quick = args.quick or backend == "local"
    if backend == "local" and not args.quick:
        print("no CUDA GPUs for --world ranks: running the quick CPU profile (backend local)")
    chunk_counts = tuple(int(x) for x in args.chunks.split(",") if x)
    orders = tuple(x for x in args.orders.split(",") if x)
    for o in orders:
        if o not in COMM_ORDERS:
            raise ValueError(f"--orders: {o!r} is not one of {COMM_ORDERS}")
    plan = Plan(
        shapes=QUICK_SHAPES if quick else GPU_SHAPES,
        configs=configs(chunk_counts, orders),
        warmup=args.warmup if args.warmup is not None else (2 if quick else 5),
        iters=args.iters if args.iters is not None else (5 if quick else 20),
        seed=args.seed,
    )
    t0 = time.perf_counter()
    ranks = run_spmd(_rank_worker, args.world, args=(plan,), backend=backend, timeout_s=args.timeout_s,
                     exchange_timeout_s=120.0 if backend == "nccl" else 30.0)
    wall = time.perf_counter() - t0
    shapes = summarize(plan, ranks)
    _print(shapes)
    payload = {
        "evidence": MEASURED,
        "note": ("step_ms: measured median per rank (CUDA events around one step after a barrier; perf_counter on "
                 "CPU), max over ranks. speedup_vs_serialized: ratio of two measured medians of this run. "
                 "timeline: one extra step with an event before/after every task, ms since the step's entry event; "
                 "compute_comm_overlap_ms is measured interval overlap, NOT a speedup (spec 0x09F). Nothing here "
                 "comes from the analytical analysis.overlap_schedule units."),
        "mode": "quick" if quick else "full",
        "backend": backend, "world": args.world, "warmup": plan.warmup, "iters": plan.iters, "seed": plan.seed,
        "devices": [r["device"] for r in ranks],
        "baseline": "serialized: overlapped_layer(serialized=True, chunks=1), every task on one stream, measured "
                    "in this run; engine: engine.dispatch -> grouped runner -> engine.combine, measured in this run",
        "wall_s": wall,
        "shapes": shapes,
    }
    suffix = host_kind() if backend == "nccl" else f"cpu-w{args.world}"
    path = write_result("overlap", payload, suffix=suffix, out=args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
