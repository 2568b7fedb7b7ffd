"""CPU exchange backends through the whole Ray runtime: Ray object store vs torch.distributed gloo.

Ray object store: one actor call per peer per round, the CPU default and the fallback everywhere;
gloo: one collective per round.

    python -m ray_moe_bench.cpu_exchange [--quick]

Same model, same routes, same steps; outputs checked against the float64 reference. Measured wall time
per step (driver to driver), nearest-rank p50/p95.
"""

from __future__ import annotations

import argparse
import time

import torch

from ray_moe_bench import summary
from ray_moe_bench.common import add_output_argument, nearest_rank, write_result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true")
    add_output_argument(ap)
    a = ap.parse_args(argv)
    if a.quick:
        a.steps = 8
    import ray

    import ray_moe
    from ray_moe.model.source import weight_source
    from ray_moe_dev.testing.reference_model import reference_forward

    ray.init(address="local", num_cpus=max(4, a.ranks + 2), include_dashboard=False, log_to_driver=False)
    out = {}
    try:
        for ex in ("object_store", "gloo"):
            cfg = ray_moe.RuntimeConfig(num_ranks=a.ranks, num_experts=16, hidden_size=64, ffn_size=128, top_k=2,
                                        slots_per_rank=5, num_layers=a.layers, residual=True, exchange=ex,
                                        name=f"bench-{ex}", decode_token_capacity=8)
            rt = ray_moe.Runtime.start(cfg)
            try:
                g = torch.Generator().manual_seed(0)
                res = {}
                for phase, tokens in (("prefill", 64 * a.ranks), ("decode", 2 * a.ranks)):
                    h = torch.randn(tokens, 64, generator=g)
                    ids = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(tokens)])
                    w = torch.rand(tokens, 2, generator=g)
                    y = rt.forward(h, ids, w, phase=phase)
                    ref = reference_forward(cfg, weight_source(cfg), h, routes=[(ids, w)] * a.layers).out
                    err = float((y.double() - ref).abs().max() / ref.abs().max())
                    ms = []
                    for _ in range(a.steps):
                        t0 = time.perf_counter()
                        rt.forward(h, ids, w, phase=phase)
                        ms.append((time.perf_counter() - t0) * 1e3)
                    res[phase] = {"tokens": tokens, "p50_ms": nearest_rank(ms, 0.5), "p95_ms": nearest_rank(ms, 0.95),
                                  "rel_err_vs_reference": err}
                out[ex] = res
            finally:
                rt.shutdown()
    finally:
        ray.shutdown()
    for phase in ("prefill", "decode"):
        out[f"speedup_gloo_{phase}"] = out["object_store"][phase]["p50_ms"] / out["gloo"][phase]["p50_ms"]
    print(f"{a.ranks} shard actors, {a.layers} layers, CPU (measured wall ms per step, p50 / p95)")
    for ex in ("object_store", "gloo"):
        r = out[ex]
        print(f"  {ex:13} prefill {r['prefill']['p50_ms']:7.1f} / {r['prefill']['p95_ms']:7.1f}   "
              f"decode {r['decode']['p50_ms']:7.1f} / {r['decode']['p95_ms']:7.1f}")
    print(f"  gloo speedup: prefill {out['speedup_gloo_prefill']:.2f}x, decode {out['speedup_gloo_decode']:.2f}x")
    path = write_result("cpu_exchange", {"config": vars(a), "results": out, "evidence": "measured"},
                        suffix="cpu-quick" if a.quick else None, out=a.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
