"""Generation throughput of a Qwen3-30B-A3B-shaped model: ray-moe (model inside the shard actor) against transformers' own generate on the same GPU.

    python -m ray_moe_bench.generate                  # one GPU, an 8-layer slice of Qwen3-30B-A3B, random bf16
    python -m ray_moe_bench.generate --quick          # CPU smoke: a tiny Qwen3-MoE

Model: Qwen3-30B-A3B's shapes (hidden 2048, 128 routed experts, top-8, expert FFN 768, 32/4 GQA heads with
head_dim 128, vocab 151936), ``--layers`` decoder layers (all MoE), random weights (transformers' own
initialisation for the non-expert modules in both; seeded random experts in ray-moe).
  transformers  AutoModelForCausalLM.from_config(..., dtype=bfloat16) on the GPU, experts implementation
                grouped_mm; ``generate(do_sample=False)`` timed with a host clock after a warm-up:
                prefill = generate(prompt of --prefill tokens, max_new_tokens=1); decode step = (time of
                max_new_tokens=N - time of max_new_tokens=1) / (N - 1) at batch B (B prompts of 32 tokens)
  ray-moe       a one-rank deployment (``Runtime.start``), ``rt.serving(random_model=config)``: prefill =
                ``rt.generate([prompt], max_new_tokens=1)``; decode = the same difference over
                ``rt.generate(B prompts, N)``. Wall clock in the driver: Ray calls, scheduling and sampling
                included. Decode steps are whole-step CUDA graphs after the first step of each shape; multi-step
                decode runs ``--decode-steps`` (the first value; the others are measured too, as
                ``decode_<B>_k<K>``) decode sub-steps per actor call.
tokens/s: prefill tokens / prefill time; decode: B / decode step time.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from ray_moe_bench.common import add_output_argument, write_result

QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                     rms_norm_eps=1e-6, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     tie_word_embeddings=False)
QUICK = dict(QWEN3_30B_A3B, vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=2048)


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def bench_transformers(conf: dict, device: str, dtype: torch.dtype, prefill: int, batches: list[int], new: int,
                       reps: int) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    c = dict(conf)
    config = AutoConfig.for_model(c.pop("model_type"), **c)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if device == "cuda":
        model.set_experts_implementation("grouped_mm")
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {}
    prompt = torch.randint(0, conf["vocab_size"], (1, prefill), generator=g).to(device)
    run = (lambda ids, n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False))
    with torch.no_grad():
        run(prompt, 1)
        t = _median([_timed(lambda: run(prompt, 1)) for _ in range(reps)])
        out["prefill"] = {"tokens": prefill, "seconds": t, "tokens_per_s": prefill / t}
        for b in batches:
            ids = torch.randint(0, conf["vocab_size"], (b, 32), generator=g).to(device)
            run(ids, 2)
            t1 = _median([_timed(lambda: run(ids, 1)) for _ in range(reps)])
            tn = _median([_timed(lambda: run(ids, new)) for _ in range(reps)])
            step = (tn - t1) / (new - 1)
            out[f"decode_{b}"] = {"batch": b, "step_ms": step * 1e3, "tokens_per_s": b / step}
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_ray_moe(conf: dict, device: str, dtype_name: str, prefill: int, batches: list[int], new: int,
                  reps: int, decode_steps: list[int]) -> dict[str, Any]:
    import ray

    import ray_moe

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    layers = conf["num_hidden_layers"]
    cfg = ray_moe.RuntimeConfig(num_ranks=1, num_experts=conf["num_experts"], hidden_size=conf["hidden_size"],
                                ffn_size=conf["moe_intermediate_size"], top_k=conf["num_experts_per_tok"],
                                slots_per_rank=conf["num_experts"], num_layers=layers, device=device,
                                dtype=dtype_name, seed=0, decode_token_capacity=max(batches), name="bench-generate")
    t0 = time.perf_counter()
    rt = ray_moe.Runtime.start(cfg)
    out: dict[str, Any] = {"deploy_s": time.perf_counter() - t0}
    try:
        kv = max(batches) * (32 + new + 16) + prefill + 1024
        # (no prefix caching: the same prompt is timed again and again, and its prefill must be computed each time)
        engine = rt.serving(kv_tokens=kv, block_size=16, step_tokens=max(prefill, 256), max_running=max(batches),
                            random_model=conf, decode_steps=decode_steps[0], prefix_caching=False)
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, conf["vocab_size"], (prefill,), generator=g).tolist()
        rt.generate([prompt], max_new_tokens=1)
        t = _median([_timed(lambda: rt.generate([prompt], max_new_tokens=1)) for _ in range(reps)])
        out["prefill"] = {"tokens": prefill, "seconds": t, "tokens_per_s": prefill / t,
                          "step_parts_ms_last": {k: [round(x, 3) for x in list(v)[-2 * reps:]]
                                                 for k, v in engine.timings.items()}}
        for b in batches:
            ids = [torch.randint(0, conf["vocab_size"], (32,), generator=g).tolist() for _ in range(b)]
            rt.generate(ids, max_new_tokens=3)  # captures this batch's decode graphs
            for k in decode_steps:
                engine.scheduler.decode_steps = k
                t1 = _median([_timed(lambda: rt.generate(ids, max_new_tokens=1)) for _ in range(reps)])
                calls = engine.steps
                tn = _median([_timed(lambda: rt.generate(ids, max_new_tokens=new)) for _ in range(reps)])
                calls = (engine.steps - calls) // reps
                step = (tn - t1) / (new - 1)
                key = f"decode_{b}" if k == decode_steps[0] else f"decode_{b}_k{k}"
                out[key] = {"batch": b, "decode_steps": k, "step_ms": step * 1e3, "tokens_per_s": b / step,
                            "calls_per_generate": calls, "call_parts_ms_p50": engine.timing_summary(last=calls * reps)}
            engine.scheduler.decode_steps = decode_steps[0]
        st = rt.stats()
        out["paths"] = {"bucket_layers": st["bucket_layers"], "graph_replays": st["graph_replays"],
                        "fallbacks": st["fallbacks"]}
        out["shard_counters"] = rt.shard_status()[0]["counters"]
        out["engine_steps"] = engine.steps
    finally:
        rt.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny Qwen3-MoE")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the Qwen3-30B-A3B slice")
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--new-tokens", type=int, default=17, help="N: decode steps measured per batch = N - 1")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--decode-steps", type=int, nargs="+", default=[4, 1],
                   help="multi-step decode sub-steps per call; the first is the headline, the others an ablation")
    p.add_argument("--skip-transformers", action="store_true")
    add_output_argument(p)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.quick
    device, dtype_name = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    conf = dict(QUICK if a.quick else QWEN3_30B_A3B, num_hidden_layers=2 if a.quick else a.layers)
    prefill = 64 if a.quick else a.prefill
    batches = [1, 4] if a.quick else a.batches
    new = 5 if a.quick else a.new_tokens
    res: dict[str, Any] = {"model": conf, "device": device, "dtype": dtype_name, "prefill_tokens": prefill,
                           "batches": batches, "new_tokens": new}
    if not a.skip_transformers:
        res["transformers"] = bench_transformers(conf, device, getattr(torch, dtype_name), prefill, batches, new,
                                                 a.reps)
        print("transformers:", {k: round(v["tokens_per_s"], 1) for k, v in res["transformers"].items()}, flush=True)
    res["decode_steps"] = a.decode_steps
    res["ray_moe"] = bench_ray_moe(conf, device, dtype_name, prefill, batches, new, a.reps, a.decode_steps)
    print("ray-moe:", {k: round(v["tokens_per_s"], 1) for k, v in res["ray_moe"].items() if isinstance(v, dict)
                       and "tokens_per_s" in v}, flush=True)
    if "transformers" in res:
        res["speedup"] = {k: res["ray_moe"][k]["tokens_per_s"] / v["tokens_per_s"]
                          for k, v in res["transformers"].items()}
        for b in batches:  # the ablation against the same baseline
            for k in a.decode_steps[1:]:
                res["speedup"][f"decode_{b}_k{k}"] = (res["ray_moe"][f"decode_{b}_k{k}"]["tokens_per_s"]
                                                      / res["transformers"][f"decode_{b}"]["tokens_per_s"])
        print("speedup (ray-moe / transformers):", {k: round(v, 2) for k, v in res["speedup"].items()}, flush=True)
    path = write_result("generate", res, suffix="cpu-quick" if a.quick else None, out=a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
