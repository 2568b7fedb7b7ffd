"""CPU resident memory of the shard processes per expert slot byte: after the start, after a live scale + rebalance.

    python -m ray_moe_bench.cpu_memory              # 2 ranks, 2 MoE layers, 16 experts of d=512 at f=1024 and f=2048
    python -m ray_moe_bench.cpu_memory --quick      # smaller experts (a smoke run)

Two deployments on a local Ray instance that differ only in the experts' size (``ffn_size`` f and 2f): per shard,
the difference of their resident set (``/proc/<pid>/status`` of the shard's process, read from outside) divided by
the difference of their slot buffers' bytes (``status()["weight_bytes"]``: every slot row, held or staging) is the
resident growth per slot byte (1.0: each expert byte is resident once; the model, torch and Ray cancel out in the
difference). Measured after the start, after a live scale (one expert to 2 replicas) and an EPLB rebalance (through
the object store: expert copies actor to actor), and after ``malloc_trim(0)`` in each shard (what the C allocator
kept of freed buffers). RSS is split as the kernel reports it: anonymous pages (the process's own heap) and shared
memory pages (the object store's mapped buffers a shard has read). Writes JSON with hardware, versions and shapes.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from ray_moe_bench.common import add_output_argument, host_kind, write_result

SHAPE = {"num_experts": 16, "hidden_size": 512, "top_k": 2, "num_layers": 2, "slots_per_rank": 10}
QUICK = {"num_experts": 8, "hidden_size": 128, "top_k": 2, "num_layers": 2, "slots_per_rank": 5}


def rss(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem of a process (bytes), from ``/proc/<pid>/status``."""
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _trim(handles: dict[int, Any]) -> None:
    import ray

    ray.get([h.trim_memory.remote() for h in handles.values()])


def measure(ffn: int, shape: dict[str, Any], name: str) -> dict[str, Any]:
    """One deployment: per-rank slot bytes and RSS after the start, after scale + rebalance, after a trim."""
    import ray
    import torch

    import ray_moe

    cfg = ray_moe.RuntimeConfig(num_ranks=2, ffn_size=ffn, seed=0, name=name, **shape)
    rt = ray_moe.Runtime.start(cfg)
    try:
        pids = {r: ray.get(h.node_info.remote())["pid"] for r, h in rt.shards.items()}

        def snap() -> dict[int, dict[str, int]]:
            st = rt.shard_status()
            return {r: {"slot_bytes": int(st[r]["weight_bytes"]), **rss(pids[r])} for r in sorted(pids)}

        g = torch.Generator().manual_seed(1)
        for _ in range(4):  # a few steps: the exchange's buffers exist in both (they cancel in the difference)
            rt.forward(torch.randn(64, cfg.hidden_size, generator=g))
        out = {"ffn_size": ffn, "start": snap()}
        t0 = time.perf_counter()
        rt.scale(expert=1, replicas=2)
        for _ in range(8):  # load skewed to expert 1, then EPLB over it
            ids = torch.ones(64, cfg.top_k, dtype=torch.int64)
            ids[:, 1] = torch.randint(2, cfg.num_experts, (64,), generator=g)
            rt.forward(torch.randn(64, cfg.hidden_size, generator=g), ids, torch.rand(64, cfg.top_k, generator=g))
        rt.rebalance()
        out["elastic_s"] = round(time.perf_counter() - t0, 2)
        out["after_scale_rebalance"] = snap()
        _trim(rt.shards)
        out["after_trim"] = snap()
        return out
    finally:
        rt.shutdown()


def growth(small: dict[str, Any], big: dict[str, Any], stage: str, key: str = "VmRSS") -> list[float]:
    """Per rank: (RSS_big - RSS_small) / (slot_bytes_big - slot_bytes_small) at ``stage``."""
    out = []
    for r in sorted(small[stage]):
        a, b = small[stage][r], big[stage][r]
        out.append(round((b[key] - a[key]) / max(1, b["slot_bytes"] - a["slot_bytes"]), 3))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="cpu_memory", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller experts (a smoke run)")
    p.add_argument("--ffn", type=int, default=None, help="the smaller deployment's ffn_size (the other: twice it)")
    add_output_argument(p)
    args = p.parse_args(argv)
    import ray

    shape = QUICK if args.quick else SHAPE
    ffn = args.ffn or (256 if args.quick else 1024)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        small = measure(ffn, shape, "mem-small")
        big = measure(2 * ffn, shape, "mem-big")
    finally:
        ray.shutdown()
    body = {"shape": shape, "ffn_sizes": [ffn, 2 * ffn], "small": small, "big": big,
            "growth_per_slot_byte": {stage: {k: growth(small, big, stage, k) for k in ("VmRSS", "RssAnon", "RssShmem")}
                                     for stage in ("start", "after_scale_rebalance", "after_trim")},
            "evidence": "MEASURED (per-shard resident set, /proc/<pid>/status)"}
    path = write_result("cpu_memory", body, suffix="quick" if args.quick else None, out=args.out)
    for stage, g in body["growth_per_slot_byte"].items():
        print(f"{stage:>22}: RSS / slot byte per rank {g['VmRSS']}  (anon {g['RssAnon']}, shmem {g['RssShmem']})")
    print(f"wrote {path}")
    return body


if __name__ == "__main__":
    main()
