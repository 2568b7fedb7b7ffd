"""FP8 vs BF16 dispatch: payload bytes (analytical, from the real count matrix) and dispatch+combine time
(measured), plus the quantisation error of the rows that arrive.

    python -m bench.fp8_dispatch            # CPU: ranks as threads over the in-process exchange

The baseline (BF16 payload) is measured in the same run on the same routes. CPU only: with threads and
no link, the quantisation cost is all there is to see; the GPU timing (NCCL, where halving the bytes
pays) is not measured yet.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.common import write_result
from ray_moe.dispatch.engine import combine, dispatch
from ray_moe.dispatch.exchange.local import LocalExchangeGroup
from ray_moe.dispatch.ledger import PrecisionPayloadLedger
from ray_moe.dispatch.precision import dequantize
from ray_moe.dispatch.records import RouteBatch
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.selector import make_selector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.types import PayloadFormat


def _setup(world: int, experts: int, d: int, tokens: int, k: int, seed: int):
    topo = Topology.single_node(world)
    spr = experts // world
    man = manifest_from_assignment(generation=0, phy2log=[[q for q in range(experts)]],
                                   slot_rank=[[q // spr for q in range(experts)]], num_experts=experts, topology=topo)
    snap = PlacementSnapshot.from_manifest(man, topo, ProcessGroupSpec.identity(world))
    g = torch.Generator().manual_seed(seed)
    batches = {}
    for r in range(world):
        h = torch.randn(tokens, d, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        w = torch.rand(tokens, k, generator=g)
        batches[r] = RouteBatch(r, h, ids, w)
    return snap, batches


def run(world: int, experts: int, d: int, tokens: int, k: int, iters: int, seed: int) -> dict[str, Any]:
    snap, batches = _setup(world, experts, d, tokens, k, seed)
    group = LocalExchangeGroup(ProcessGroupSpec.identity(world))
    sel = make_selector("round_robin")
    out: dict[str, Any] = {}
    for fmt in (PayloadFormat.NATIVE, PayloadFormat.FP8_ROW, PayloadFormat.FP8_BLOCK128):
        times, errs, remote = [], [], []

        def step(ex, it):
            b = batches[ex.rank]
            t0 = time.perf_counter()
            o = dispatch(b, snap, ex, selector=sel, tag=f"{fmt.value}/{it}", payload_format=fmt)
            x = dequantize(o.rows, o.scales, fmt, torch.bfloat16)
            y = combine(x, o.handle, snap, ex, tag=f"{fmt.value}/{it}", out_dtype=torch.bfloat16)
            dt = time.perf_counter() - t0
            # identity experts: y = h * sum of gates; the error is the payload's quantisation only
            ref = b.hidden.double() * b.topk_weights.double().sum(1, keepdim=True)
            err = float((y.double() - ref).norm() / ref.norm())
            rem = int((o.handle.source.dest_rank != ex.rank).sum())
            return dt, err, rem

        for it in range(iters + 1):
            res = group.run(lambda ex: step(ex, it))
            if it:  # first iteration is warmup
                times.append(max(r[0] for r in res) * 1e3)
                errs.append(max(r[1] for r in res))
                remote.append(sum(r[2] for r in res))
        times.sort()
        ledger = PrecisionPayloadLedger(remote[0], d, fmt)
        out[fmt.value] = {
            "dispatch_combine_ms_median": times[len(times) // 2],
            "rel_error_vs_exact": max(errs),
            "remote_rows": remote[0],
            "dispatch_payload_bytes_analytical": ledger.total_bytes,
            "data_bytes": ledger.data_bytes,
            "scale_bytes": ledger.scale_total_bytes,
        }
    base = out["native"]
    for fmt in ("fp8_row", "fp8_block128"):
        out[fmt]["bytes_vs_bf16"] = out[fmt]["dispatch_payload_bytes_analytical"] / base["dispatch_payload_bytes_analytical"]
        out[fmt]["time_vs_bf16"] = out[fmt]["dispatch_combine_ms_median"] / base["dispatch_combine_ms_median"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--d", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        a.d, a.tokens, a.iters = 1024, 64, 3
    res = run(a.world, a.experts, a.d, a.tokens, a.k, a.iters, a.seed)
    print(f"world={a.world} (threads, CPU) d={a.d} tokens/rank={a.tokens} k={a.k} E={a.experts}")
    print(f"{'format':14} {'ms (measured)':>14} {'payload B (analytical)':>24} {'bytes/bf16':>10} {'rel err':>9}")
    for fmt, r in res.items():
        print(f"{fmt:14} {r['dispatch_combine_ms_median']:14.2f} {r['dispatch_payload_bytes_analytical']:24d} "
              f"{r.get('bytes_vs_bf16', 1.0):10.3f} {r['rel_error_vs_exact']:9.2e}")
    path = write_result("fp8_dispatch", {
        "shapes": {"world": a.world, "d": a.d, "tokens_per_rank": a.tokens, "k": a.k, "experts": a.experts},
        "backend": "local threads (CPU)", "evidence": {"time": "measured", "bytes": "analytical"},
        "results": res}, suffix="cpu-quick" if a.quick else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
