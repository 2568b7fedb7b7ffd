"""Drive synthetic expert-layer traffic through a ray-moe deployment on a Ray cluster:  ray job submit --working-dir . -- python jobs/expert_traffic.py ...

Starts the deployment (coordinator + one ExpertShardActor per GPU), then serves a synthetic stream of
prefill and decode batches until --duration-s elapses (or forever with --duration-s 0), rebalancing with
EPLB every --rebalance-every steps. While it runs, from any machine attached to the cluster:

    ray-moe status --name NAME            generations, refcounts, placement, telemetry, timeline
    ray-moe scale --name NAME --expert 3 --replicas 2
    ray-moe rebalance --name NAME

Checks a sample of steps against the naive reference (--check-every) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="default")
    p.add_argument("--ranks", type=int, default=None, help="default: one per GPU in the cluster (or 4 on CPU)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--slots-per-rank", type=int, default=None)
    p.add_argument("--checkpoint", default=None, help="HF-style safetensors folder (Mixtral expert names)")
    p.add_argument("--skew", type=float, default=1.0)
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--rebalance-every", type=int, default=200)
    p.add_argument("--check-every", type=int, default=50)
    p.add_argument("--strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    args = p.parse_args(argv)

    import ray

    import ray_moe
    from ray_moe.core.env import read_env
    from ray_moe.model.source import weight_source
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))  # the reference lives in the checkout
    from ray_moe_dev.testing.reference_model import reference_forward

    env = read_env()
    ray.init(address=env.ray_address or "auto", namespace=env.namespace, log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    device = ("cuda" if gpus else "cpu") if args.device == "auto" else args.device
    ranks = args.ranks or (gpus if device == "cuda" else 4)
    spr = args.slots_per_rank or max(1, -(-args.experts // ranks)) + 1
    cfg = ray_moe.RuntimeConfig(
        num_ranks=ranks, num_experts=args.experts, hidden_size=args.hidden, ffn_size=args.ffn, top_k=args.top_k,
        slots_per_rank=spr, num_layers=args.layers, device=device,
        dtype="bfloat16" if device == "cuda" else "float32", residual=True, router_skew=args.skew,
        checkpoint=args.checkpoint, name=args.name, placement_strategy=args.strategy,
    )
    rt = ray_moe.Runtime.start(cfg)
    src = weight_source(cfg)
    print(json.dumps({"deployment": args.name, "ranks": ranks, "device": device,
                      "topology": [r.model_dump() for r in rt.topology.ranks]}), flush=True)
    gen = torch.Generator().manual_seed(0)
    t_end = time.time() + args.duration_s if args.duration_s > 0 else float("inf")
    step = bad = 0
    try:
        while time.time() < t_end:
            decode = step % 4 != 0
            tokens = int(torch.randint(1, 8 * ranks, (1,), generator=gen)) if decode else 512 * ranks
            h = torch.randn(tokens, cfg.hidden_size, generator=gen)
            check = args.check_every and step % args.check_every == 0
            if check:
                y, routes = rt.forward(h, phase="decode" if decode else "prefill", return_routes=True)
                used = [(i[:16], w[:16]) for i, w in routes]
                # a checkpoint routes with its own router (model/routers.py, checked against transformers' MoE
                # block in tests/model/test_routers.py): the reference takes the routes it chose and checks the
                # experts' math; a synthetic deployment's router is re-run in float64 (near ties from the runtime)
                ref = (reference_forward(cfg, src, h[: min(tokens, 16)], routes=used) if cfg.checkpoint else
                       reference_forward(cfg, src, h[: min(tokens, 16)], runtime_routes=used))
                err = float((y[:16].double() - ref.out).abs().max() / (ref.out.abs().max() + 1e-9))
                tol = 5e-2 if cfg.dtype == "bfloat16" else 1e-4
                if err > tol or ref.route_mismatches:
                    bad += 1
                    print(f"step {step}: MISMATCH rel err {err:.2e}", file=sys.stderr, flush=True)
            else:
                rt.forward(h, phase="decode" if decode else "prefill")
            step += 1
            if args.rebalance_every and step % args.rebalance_every == 0:
                g = rt.rebalance()
                print(json.dumps({"step": step, "rebalanced_to": g, "stats": rt.stats()}), flush=True)
    finally:
        print(json.dumps({"steps": step, "mismatches": bad, "stats": rt.stats()}), flush=True)
        rt.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
