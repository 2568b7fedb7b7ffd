"""Where the direct data path spends a step: host stage marks, bare control-round costs, torch profiler.

    python -m ray_moe_bench.direct_profile --world 2 --tokens 128,8192

Per rank and case: the mean host milliseconds between the stage marks of ``DirectDispatcher`` (plan
enqueued, counts on host, control rounds, layout, payload enqueued / done, combine enqueued / done),
the bare cost of one control all-gather and of one small device->host copy on an idle stream, and on
rank 0 the torch profiler's top operators by device and by host time for one step. Diagnostic output
(stdout + JSON); the speed comparison against raw NCCL is ``ray_moe_bench.dispatch_combine``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from ray_moe_bench import summary
from ray_moe_bench.common import add_output_argument, build_snapshot, host_kind, write_result
from ray_moe.moe.dispatch.direct import DirectDispatcher
from ray_moe.moe.dispatch.protocol import DeferredChecks
from ray_moe.core.routes import RouteBatch
from ray_moe.placement.selector import make_selector
from ray_moe_dev.testing.spmd import exchange_device, run_spmd


def _batch(rank: int, tokens: int, d: int, k: int, e: int, dev) -> RouteBatch:
    g = torch.Generator(device=dev).manual_seed(rank * 1000 + tokens)
    h = torch.randn(tokens, d, generator=g, device=dev).to(torch.bfloat16)
    ids = torch.rand(tokens, e, generator=g, device=dev).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(tokens, k, generator=g, device=dev), 1)
    return RouteBatch(rank, h, ids, w)


def profile_rank(exchange, rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    dev = exchange_device(exchange)
    cuda = dev.type == "cuda"
    snap = build_snapshot(exchange.size, cfg["experts"])
    sel = make_selector("round_robin")
    out: dict[str, Any] = {"rank": rank, "cases": []}
    # bare costs: one control all-gather, one small device->host copy
    vec = np.zeros(9 + exchange.size, dtype=np.int64)
    for i in range(5):
        exchange.all_gather(f"warm{i}", vec)
    t0 = time.perf_counter()
    for i in range(50):
        exchange.all_gather(f"ag{i}", vec)
    out["all_gather_ms"] = (time.perf_counter() - t0) / 50 * 1e3
    small = torch.zeros(300, dtype=torch.int64, device=dev)
    t0 = time.perf_counter()
    for _ in range(50):
        small.cpu()
    out["small_d2h_ms"] = (time.perf_counter() - t0) / 50 * 1e3
    for tokens in cfg["tokens"]:
        batch = _batch(rank, tokens, cfg["d"], cfg["k"], cfg["experts"], dev)
        case: dict[str, Any] = {"tokens": tokens}
        for chunks in cfg["chunks"]:
            dd = DirectDispatcher(exchange, sel, chunks=chunks)

            deferred = DeferredChecks()  # handle checks read after the step, as the runtime does

            def step(tag):
                o = dd.dispatch(batch, snap, tag=tag)
                return dd.combine(o.rows, o.handle, snap, tag=tag, out_dtype=torch.bfloat16, checks=deferred)

            for i in range(3):
                step(f"w{tokens}/{chunks}/{i}")
            deltas: dict[str, list[float]] = {}
            totals = []
            for i in range(cfg["iters"]):
                exchange.all_gather(f"b{tokens}/{chunks}/{i}", vec)
                dd.marks = []
                t0 = time.perf_counter()
                step(f"s{tokens}/{chunks}/{i}")
                totals.append((time.perf_counter() - t0) * 1e3)
                prev = t0
                for label, t in dd.marks:
                    deltas.setdefault(label, []).append((t - prev) * 1e3)
                    prev = t
                dd.marks = None
            case[f"c{chunks}"] = {"host_total_ms": statistics.median(totals),
                                  "marks_ms": {k: statistics.median(v) for k, v in deltas.items()}}
            if cuda and rank == 0 and chunks == cfg["chunks"][0]:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    step(f"p{tokens}")
                    torch.cuda.synchronize()
                ka = prof.key_averages()
                case["profile_cuda"] = ka.table(sort_by="cuda_time_total", row_limit=18)
                case["profile_cpu"] = ka.table(sort_by="self_cpu_time_total", row_limit=18)
            elif cuda and chunks == cfg["chunks"][0]:
                step(f"p{tokens}")  # the peer of the profiled step
        out["cases"].append(case)
        if cuda:
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", default="128,8192")
    ap.add_argument("--chunks", default="1,2")
    ap.add_argument("--d", type=int, default=7168)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backend", default="auto", choices=("auto", "nccl", "local"))
    add_output_argument(ap)
    a = ap.parse_args(argv)
    backend = a.backend if a.backend != "auto" else ("nccl" if torch.cuda.is_available() else "local")
    cfg = {"tokens": [int(t) for t in a.tokens.split(",")], "chunks": [int(c) for c in a.chunks.split(",")],
           "d": a.d, "k": a.k, "experts": a.experts, "iters": a.iters}
    ranks = run_spmd(profile_rank, a.world, args=(cfg,), backend=backend, timeout_s=400, exchange_timeout_s=60)
    for r in ranks:
        print(f"rank {r['rank']}: bare all_gather {r['all_gather_ms']:.3f} ms, small D2H {r['small_d2h_ms']:.3f} ms")
        for c in r["cases"]:
            for key, v in c.items():
                if key.startswith("c") and isinstance(v, dict):
                    marks = " ".join(f"{k}={x:.3f}" for k, x in v["marks_ms"].items())
                    print(f"  T={c['tokens']} {key}: host {v['host_total_ms']:.3f} ms | {marks}")
    for c in ranks[0]["cases"]:
        for key in ("profile_cuda", "profile_cpu"):
            if key in c:
                print(f"\n== rank 0, T={c['tokens']}: {key}\n{c[key]}")
    path = write_result("direct_profile", {"backend": backend, "config": cfg, "evidence": "measured (host clocks, "
                                           "torch profiler)", "ranks": ranks}, suffix=host_kind() if backend == "nccl"
                        else "cpu", out=a.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
