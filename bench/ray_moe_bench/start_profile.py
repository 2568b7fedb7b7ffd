"""Start and first traffic at the product's defaults: the start (model load + the step lattice's captures), what
each capture took, and two workloads of fresh lengths through the generation loop, with the captures in each.

    python -m ray_moe_bench.start_profile --quick                 # CPU smoke: tiny Qwen3-MoE (no graphs on CPU)
    python -m ray_moe_bench.start_profile --layers 48             # CUDA: the whole Qwen3-30B-A3B shape, random

Everything runs in this process (no Ray worker per system): ``Runtime.start`` + ``rt.serving()`` with no
argument (the defaults ``ray-moe serve`` and ``rt.generate`` use), then a warm-up workload and a timed one whose
prompt lengths are disjoint (other seeds, shifted), every request to its own output budget (lognormal, EOS
ignored). Reports: start seconds (the lattice capture's part), each rank's capture report and step paths, the
allocator's memory after start, output tokens/s of the timed pass, and the graph counters' deltas over each pass
(``graphs_captured_serving`` must stay 0)."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

from ray_moe_bench.common import add_output_argument, write_result
from ray_moe_bench.generate import QUICK, QWEN3_30B_A3B

COUNTERS = ("graphs_captured_start", "graphs_captured_serving", "decode_graph_steps", "token_graph_steps",
            "piecewise_steps", "eager_steps", "graph_replays")


def lengths(seed: int, n: int, mean: float, lo: int, hi: int, avoid: set[int] = frozenset()) -> list[int]:
    """``n`` seeded lognormal lengths (sigma 0.8) of mean ~``mean`` clipped to [lo, hi], none in ``avoid``."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - 0.32
    out = []
    for x in np.clip(np.rint(rng.lognormal(mu, 0.8, n)), lo, hi).astype(int).tolist():
        while x in avoid:
            x = x + 1 if x < hi else lo + (x * 7919) % (hi - lo)
        out.append(int(x))
    return out


def counters(rt: Any) -> dict[int, dict[str, int]]:
    return {r: {k: int(st["counters"].get(k, 0)) for k in COUNTERS} for r, st in rt.shard_status().items()}


def delta(a: dict, b: dict) -> dict:
    return {r: {k: b[r][k] - a[r][k] for k in COUNTERS} for r in b}


def one_pass(engine: Any, prompts: list[list[int]], new: list[int], timeout_s: float) -> dict[str, Any]:
    from ray_moe.model.sampling import SamplingParams

    t = time.perf_counter()
    handles = engine.submit_many([(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), None)
                                  for p, n in zip(prompts, new)])
    outs = [h.result(timeout_s) for h in handles]
    wall = time.perf_counter() - t
    got = sum(len(o) for o in outs)
    if [len(o) for o in outs] != list(new):
        raise RuntimeError("a request did not get its own token budget")
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": got, "wall_s": wall,
            "output_tokens_per_s": got / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="start_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--warm-requests", type=int, default=48)
    p.add_argument("--prompt-mean", type=int, default=480)
    p.add_argument("--new-mean", type=int, default=128)
    p.add_argument("--timeout", type=float, default=900.0)
    add_output_argument(p)
    a = p.parse_args(argv)
    import torch

    import ray_moe

    device = "cpu" if a.quick or not torch.cuda.is_available() else "cuda"
    conf = dict(QUICK if a.quick else QWEN3_30B_A3B, num_hidden_layers=2 if a.quick else a.layers)
    if a.quick:
        a.requests, a.warm_requests, a.prompt_mean, a.new_mean = 12, 6, 24, 6
    ranks = 1
    cfg = ray_moe.RuntimeConfig(num_ranks=ranks, num_experts=conf["num_experts"], hidden_size=conf["hidden_size"],
                                ffn_size=conf["moe_intermediate_size"], top_k=conf["num_experts_per_tok"],
                                slots_per_rank=conf["num_experts"], num_layers=conf["num_hidden_layers"], device=device,
                                dtype="bfloat16" if device == "cuda" else "float32", seed=0, name="start-profile",
                                seeded_on_device=device == "cuda")
    res: dict[str, Any] = {"device": device, "model": conf, "settings": "product defaults (rt.serving())"}
    t0 = time.perf_counter()
    rt = ray_moe.Runtime.start(cfg)
    try:
        t1 = time.perf_counter()
        engine = rt.serving(random_model=conf)
        t2 = time.perf_counter()
        res["start_s"] = {"runtime": t1 - t0, "serving": t2 - t1, "total": t2 - t0, "lattice_capture": engine.capture_s}
        res["warnings"] = engine.warnings
        res["steps"] = {str(r["rank"]): {k: r.get(k) for k in ("capture", "lattice", "paths", "shared_bytes")}
                        for r in engine.steps_report}
        st = rt.shard_status()
        res["memory_after_start"] = {str(r): s.get("memory") for r, s in st.items()}
        vocab, hi = conf["vocab_size"], 3200 if not a.quick else 64
        rng = np.random.default_rng(7)
        warm_len = lengths(11, a.warm_requests, a.prompt_mean * 0.8, 16, hi)
        timed_len = lengths(12, a.requests, a.prompt_mean, 16, hi, avoid=set(warm_len))
        warm_new = lengths(13, a.warm_requests, a.new_mean // 2, 4, 4 * a.new_mean)
        timed_new = lengths(14, a.requests, a.new_mean, 4, 4 * a.new_mean)
        res["workload"] = {"timed_prompt_lengths": [min(timed_len), sum(timed_len) / len(timed_len), max(timed_len)],
                           "timed_new_tokens": [min(timed_new), sum(timed_new) / len(timed_new), max(timed_new)],
                           "disjoint_prompt_lengths": not set(warm_len) & set(timed_len)}
        warm = [rng.integers(0, vocab, n).tolist() for n in warm_len]
        timed = [rng.integers(0, vocab, n).tolist() for n in timed_len]
        c0 = counters(rt)
        res["warmup"] = one_pass(engine, warm, warm_new, a.timeout)
        c1 = counters(rt)
        for dq in engine.timings.values():
            dq.clear()
        res["timed"] = one_pass(engine, timed, timed_new, a.timeout)
        c2 = counters(rt)
        res["graphs"] = {"warmup": delta(c0, c1), "timed": delta(c1, c2), "after": c2}
        res["step_timings_ms"] = engine.timing_summary()
        host, dev = sum(engine.timings["host"]), sum(engine.timings["device"])
        res["host_over_device"] = host / dev if dev else None
        print(f"start {res['start_s']['total']:.1f} s (lattice capture {engine.capture_s:.1f} s); timed "
              f"{res['timed']['output_tokens_per_s']:.0f} output tok/s; graphs in the timed pass "
              f"{res['graphs']['timed']}", flush=True)
    finally:
        rt.shutdown()
    path = write_result("start_profile", res, suffix="cpu-quick" if a.quick else f"{a.layers}l", out=a.out)
    print(f"wrote {path}")
    bad = any(v["graphs_captured_serving"] for v in res["graphs"]["timed"].values())
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
