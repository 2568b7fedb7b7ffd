"""Per-MoE-layer time on one GPU: ray-moe's shard (decode buckets replayed as one CUDA graph per step, prefill on the direct path) against transformers' own MoE block on the same GPU.

    python -m ray_moe_bench.moe_layer                     # GPU: Mixtral- and DeepSeek-shaped, bf16
    python -m ray_moe_bench.moe_layer --quick             # CPU smoke: tiny shapes, object store

ray-moe side: a one-rank deployment (``Runtime.start``, one ExpertShardActor holding every expert: the
one-rank local path) with ``--layers`` MoE layers; each step runs every layer inside the shard. Per step the
shard records device timestamps (``Runtime.record_marks``): decode from "decode_round" (admission agreed,
inputs staged) to "replayed" (the whole-step graph's work done), prefill from "hidden_in" (the input is on
the device) to "layers" (every layer done, statistics read back); per layer = interval / L on the device
clock, so the driver's activation copies are not in it (as when the model lives in the shard). ``shard_ms_per_layer`` also gives the shard's
whole step time (host clock, input/output copies and the agreement round included) / L.
  decode   T = 1, 8, 32, 64 tokens per rank, phase=decode: the bucket path, whole step one CUDA graph
           (``bucket-graph`` checked on every step), 30 timed steps after the capture
  prefill  T = 4096, 8192 tokens: the direct path, 5 timed steps
Baseline (same run, same GPU, driver process): transformers' ``MixtralSparseMoeBlock`` / ``DeepseekV3MoE``
(experts implementation ``grouped_mm``, bf16, the same d, f, E, k), timed with CUDA events on the same T
(router included, shared experts off). Routes for ray-moe: uniform random top-k (the same per layer).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

from ray_moe_bench.common import add_output_argument, time_fn, write_result

MODELS = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2),
    "deepseek": dict(hidden=7168, ffn=2048, experts=64, top_k=8),
}
QUICK = {"tiny": dict(hidden=64, ffn=128, experts=8, top_k=2)}


def transformers_block(name: str, shape: dict, device: str, dtype: torch.dtype):
    """transformers' own MoE block of this shape (random weights), experts implementation grouped_mm."""
    import transformers

    torch.manual_seed(0)
    if name == "mixtral" or name == "tiny":
        cfg = transformers.MixtralConfig(hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                                         num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"])
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    else:
        cfg = transformers.DeepseekV3Config(hidden_size=shape["hidden"], moe_intermediate_size=shape["ffn"],
                                            n_routed_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                                            n_group=1, topk_group=1, n_shared_experts=0)
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    cfg._experts_implementation = "grouped_mm" if device == "cuda" else "eager"
    with torch.device(device):
        block = Block(cfg).to(dtype).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block  # DeepSeek: n_shared_experts=0 leaves a 0-wide shared MLP (no work)


def _routes(t: int, experts: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(t, experts, generator=g).argsort(dim=1)[:, :k].contiguous()
    w = torch.rand(t, k, generator=g) + 0.05
    return ids, w / w.sum(1, keepdim=True)


def _layer_ms(rt, h, ids, w, phase: str, layers: int, iters: int) -> dict[str, Any]:
    dev_ms, shard_ms, paths = [], [], set()
    for i in range(iters + 2):
        rt.forward(h, ids, w, phase=phase)
        res = rt.last_results
        r0 = next(iter(res.values()))
        marks = {m[0]: m for m in r0.output.marks}
        paths |= {ls.path for ls in r0.layers}
        if i >= 2:  # the first steps capture / warm up
            # decode replays: the graph's device work (from the agreed admission to the replay's end); else the
            # step's layers on the device clock (CPU: the host clock)
            a, b = ("decode_round", "replayed") if "replayed" in marks else ("hidden_in", "layers")
            col = 2 if marks[b][2] >= 0 else 1
            dev_ms.append((marks[b][col] - marks[a][col]) * 1e3 / layers)
            shard_ms.append(r0.elapsed_s * 1e3 / layers)
    return {"layer_ms_p50": statistics.median(dev_ms), "layer_ms_min": min(dev_ms),
            "shard_ms_per_layer_p50": statistics.median(shard_ms), "paths": sorted(paths), "steps": len(dev_ms)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    import ray_moe
    from ray_moe.runtime import Runtime

    class Recording(Runtime):
        last_results: dict = {}

        def _account(self, results, *a, **kw):
            self.last_results = results
            return super()._account(results, *a, **kw)

    cuda = not args.quick and torch.cuda.is_available()
    device, dtype_name = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    dtype = getattr(torch, dtype_name)
    models = QUICK if args.quick else {m: MODELS[m] for m in args.models}
    decode_t = [1, 8] if args.quick else [1, 8, 32, 64]
    prefill_t = [64] if args.quick else [4096, 8192]
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    out: dict[str, Any] = {"device": device, "dtype": dtype_name, "layers": args.layers, "models": {}}
    for name, shape in models.items():
        g = torch.Generator().manual_seed(1)
        row: dict[str, Any] = {"shape": shape, "transformers_block_ms": {}, "ray_moe": {}}
        block = transformers_block(name, shape, device, dtype)
        for t in decode_t + prefill_t:
            x = torch.randn(1, t, shape["hidden"], device=device, dtype=dtype)
            with torch.no_grad():
                row["transformers_block_ms"][t] = time_fn(lambda: block(x), warmup=3, iters=10 if t > 1000 else 30,
                                                          cuda=cuda)["median_ms"]
        del block
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        cfg = ray_moe.RuntimeConfig(num_ranks=1, num_experts=shape["experts"], hidden_size=shape["hidden"],
                                    ffn_size=shape["ffn"], top_k=shape["top_k"], slots_per_rank=shape["experts"],
                                    num_layers=args.layers, device=device, dtype=dtype_name, seed=0,
                                    decode_token_capacity=max(decode_t), name=f"moe-layer-{name}")
        t0 = time.perf_counter()
        rt = Recording.start(cfg)
        row["deploy_s"] = time.perf_counter() - t0
        rt.record_marks = True
        try:
            for t in decode_t:
                h = torch.randn(t, shape["hidden"], generator=g).to(dtype)
                ids, w = _routes(t, shape["experts"], shape["top_k"], g)
                row["ray_moe"][f"decode_{t}"] = _layer_ms(rt, h, ids, w, "decode", args.layers, args.iters)
            for t in prefill_t:
                h = torch.randn(t, shape["hidden"], generator=g).to(dtype)
                ids, w = _routes(t, shape["experts"], shape["top_k"], g)
                row["ray_moe"][f"prefill_{t}"] = _layer_ms(rt, h, ids, w, "prefill", args.layers, max(3, args.iters // 6))
        finally:
            rt.shutdown()
        for t in decode_t:
            r = row["ray_moe"][f"decode_{t}"]
            r["vs_transformers_block"] = r["layer_ms_p50"] / row["transformers_block_ms"][t]
        for t in prefill_t:
            r = row["ray_moe"][f"prefill_{t}"]
            r["vs_transformers_block"] = r["layer_ms_p50"] / row["transformers_block_ms"][t]
        out["models"][name] = row
        print(f"{name}: " + ", ".join(f"{k} {v['layer_ms_p50']:.3f} ms/layer ({v['vs_transformers_block']:.2f}x block)"
                                      for k, v in row["ray_moe"].items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moe_layer", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--layers", type=int, default=4, help="MoE layers per step (per-layer time = step / L)")
    p.add_argument("--iters", type=int, default=30)
    add_output_argument(p)
    args = p.parse_args(argv)
    res = run(args)
    path = write_result("moe_layer", res, suffix="cpu-quick" if args.quick else None, out=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
