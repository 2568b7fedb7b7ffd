"""Expert-runner benchmark: grouped GEMM vs per-expert loop vs capacity-padded vs block-padded.

    python -m ray_moe_bench.runners            # full shapes (GPU: Mixtral / DeepSeek sizes; CPU: scaled, < 5 min)
    python -m ray_moe_bench.runners --quick    # small CPU shapes, < 60 s

Per case (model shape x phase x token count x routing) every runner runs the same rows and weights,
timed in alternating rounds (loop, grouped, grouped_mm, padded, block, loop, ...) so drift hits all alike.
Reported per runner: measured median/min/p90 ms, useful TFLOP/s (6 * useful rows * d * f / time) and
the fraction of the dense peak measured in the same run (one square matmul: 8192^3 on GPU, 2048^3 on
CPU), the backend taken, the max error against the loop baseline, and the analytical row ledger
(labeled analytical; no time is derived from it). ``speedup_grouped_vs_loop`` = loop ms / grouped ms.

Routing: T tokens each pick k distinct experts out of E, uniformly or with Zipf(s) popularity over a
seeded random permutation of the experts; the benchmarked rank hosts experts 0..Q_local-1 and its
per-slot counts are those experts' route counts (DeepSeek-like: 256 experts over 8 ranks -> 32 slots).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ray_moe_bench import summary
from ray_moe_bench.common import add_output_argument, host_kind, time_fn, time_interleaved, write_result
from ray_moe.moe.experts.runners import ExpertRunner, LoopRunner
from ray_moe.moe.experts.runners.block import BlockRunner
from ray_moe.moe.experts.runners.grouped import GroupedRunner
from ray_moe.moe.experts.runners.padded import PaddedRunner
from ray_moe.moe.experts.weights import SlotWeights

DECODE_TOKENS = (1, 8, 32, 64, 128, 256)


@dataclass(frozen=True)
class ModelShape:
    """One expert layer as seen by one rank. d: hidden, f: expert FFN width, num_experts: E (global),
    local_slots: Q_local on the benchmarked rank, k: routes per token."""

    name: str
    d: int
    f: int
    num_experts: int
    local_slots: int
    k: int


@dataclass(frozen=True)
class Profile:
    """The shape set of one run mode."""

    models: tuple[ModelShape, ...]
    prefill_tokens: int
    decode_tokens: tuple[int, ...]
    dense_n: int
    warmup: int
    iters: int


def profile(quick: bool, cuda: bool) -> Profile:
    """GPU: production shapes. CPU full: scaled (< 5 min on a few cores). CPU quick: small (< 60 s)."""
    if cuda:
        return Profile(
            models=(ModelShape("mixtral-like", 4096, 14336, 8, 8, 2),
                    ModelShape("deepseek-like", 7168, 2048, 256, 32, 8)),
            prefill_tokens=1024 if quick else 4096, decode_tokens=DECODE_TOKENS, dense_n=8192,
            warmup=3, iters=10 if not quick else 5,
        )
    if quick:
        return Profile(
            models=(ModelShape("mixtral-like", 512, 1024, 8, 8, 2), ModelShape("deepseek-like", 896, 256, 256, 32, 8)),
            prefill_tokens=512, decode_tokens=DECODE_TOKENS, dense_n=2048, warmup=2, iters=5,
        )
    return Profile(
        models=(ModelShape("mixtral-like", 1024, 3584, 8, 8, 2), ModelShape("deepseek-like", 1792, 512, 256, 32, 8)),
        prefill_tokens=1024, decode_tokens=DECODE_TOKENS, dense_n=2048, warmup=1, iters=5,
    )


def route_counts(model: ModelShape, tokens: int, routing: str, zipf_s: float, seed: int) -> list[int]:
    """Per-local-slot route counts of the benchmarked rank.

    1. expert popularity: uniform, or p_e proportional to rank_e^-s over a seeded permutation of ranks
    2. every token draws k distinct experts (multinomial without replacement)
    3. counts of experts 0..Q_local-1 (the rank's slots)
    """
    g = torch.Generator().manual_seed(seed)
    e = model.num_experts
    if routing == "uniform":
        p = torch.ones(e, dtype=torch.float64)
    elif routing == "zipf":
        ranks = torch.randperm(e, generator=g).to(torch.float64) + 1.0
        p = ranks.pow(-zipf_s)
    else:
        raise ValueError(f"routing={routing!r} is not 'uniform' or 'zipf'")
    ids = torch.multinomial(p.expand(tokens, e), model.k, replacement=False, generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    return [int(c) for c in counts[: model.local_slots]]


def make_weights(model: ModelShape, device: torch.device, dtype: torch.dtype, seed: int) -> SlotWeights:
    """Random SwiGLU weights of the rank's slots, drawn directly on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    q, d, f = model.local_slots, model.d, model.f

    def draw(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) / math.sqrt(fan_in)).to(dtype)

    return SlotWeights(layer=0, slot_ids=tuple(range(q)), experts=tuple(range(q)), w_gate=draw(q, f, d, fan_in=d),
                       w_up=draw(q, f, d, fan_in=d), w_down=draw(q, d, f, fan_in=f))


def dense_peak(n: int, device: torch.device, dtype: torch.dtype, warmup: int, iters: int) -> dict[str, Any]:
    """One n x n x n matmul, measured in this run: the dense reference throughput."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_fn(lambda: a @ b, warmup=warmup, iters=iters, cuda=device.type == "cuda")
    return {"shape": [n, n, n], "dtype": str(dtype), **t, "tflops": 2 * n**3 / (t["median_ms"] * 1e-3) / 1e12}


def runners(alignment: int, block_size: int) -> dict[str, ExpertRunner]:
    return {
        "loop": LoopRunner(),
        "grouped": GroupedRunner(),  # per-call kernel choice (grouped_mm or per-slot GEMMs)
        "grouped_mm": GroupedRunner(use_grouped_mm=True if torch.cuda.is_available() else None),
        "padded": PaddedRunner(alignment=alignment),
        "block": BlockRunner(block_size=block_size, column_block=block_size),
    }


def backend_of(runner: ExpertRunner, x: torch.Tensor, w: SlotWeights, counts=None) -> str:
    if isinstance(runner, (GroupedRunner, BlockRunner)):
        return runner.backend(x, w, counts) if isinstance(runner, GroupedRunner) else runner.backend(x, w)
    return "bmm" if isinstance(runner, PaddedRunner) else "loop"


def run_case(model: ModelShape, weights: SlotWeights, phase: str, tokens: int, routing: str, args: argparse.Namespace,
             prof: Profile, peak_tflops: float, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """All runners on one case: same rows, same weights, loop output as the correctness reference."""
    counts = route_counts(model, tokens, routing, args.zipf_s, args.seed + tokens)
    n = sum(counts)
    g = torch.Generator(device=device).manual_seed(args.seed)
    x = torch.randn(n, model.d, generator=g, device=device, dtype=torch.float32).to(dtype)
    useful_flops = 6 * n * model.d * model.f
    result: dict[str, Any] = {
        "model": model.name, "phase": phase, "tokens": tokens, "routing": routing, "rows": n,
        "counts": {"max": max(counts), "min": min(counts), "zero_slots": sum(1 for c in counts if c == 0),
                   "per_slot": counts if len(counts) <= 32 else None},
        "useful_gflop": useful_flops / 1e9, "runners": {},
    }
    ref = None
    errs: dict[str, float] = {}
    all_runners = runners(args.alignment, args.block_size)
    for name, runner in all_runners.items():
        out = runner.run(x, counts, weights)
        if ref is None:
            ref = out.float()
        errs[name] = float((out.float() - ref).abs().max()) / (float(ref.abs().max()) or 1.0) if n else 0.0
        del out
    # every runner timed in alternating rounds (loop, grouped, ... loop, grouped, ...): same conditions
    times = time_interleaved({name: (lambda r=runner: r.run(x, counts, weights)) for name, runner in all_runners.items()},
                             warmup=prof.warmup, iters=prof.iters, cuda=device.type == "cuda")
    for name, runner in all_runners.items():
        t = times[name]
        tflops = useful_flops / (t["median_ms"] * 1e-3) / 1e12 if t["median_ms"] > 0 else 0.0
        ledger = runner.ledger(counts, model.d, model.f)
        result["runners"][name] = {
            "backend": backend_of(runner, x, weights, counts),
            "measured": {**t, "useful_tflops": tflops, "fraction_of_dense_peak": tflops / peak_tflops},
            "max_rel_err_vs_loop": errs[name],
            "ledger": {**asdict(ledger), "kind": ledger.kind.value, "utilization": ledger.utilization},
        }
    r = result["runners"]
    result["speedup_grouped_vs_loop"] = r["loop"]["measured"]["median_ms"] / r["grouped"]["measured"]["median_ms"]
    result["speedup_grouped_mm_vs_loop"] = (r["loop"]["measured"]["median_ms"]
                                            / r["grouped_mm"]["measured"]["median_ms"])
    return result


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--quick", action="store_true", help="small shapes (CPU < 60 s)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--alignment", type=int, default=16, help="padded runner row alignment")
    ap.add_argument("--block-size", type=int, default=128, help="block runner row/column block (MegaBlocks: 128)")
    ap.add_argument("--zipf-s", type=float, default=1.2)
    ap.add_argument("--seed", type=int, default=0)
    add_output_argument(ap)
    args = ap.parse_args(argv)

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    prof = profile(args.quick, cuda)

    peak = dense_peak(prof.dense_n, device, dtype, prof.warmup, max(3, prof.iters))
    print(f"dense peak {prof.dense_n}^3 {dtype}: {peak['tflops']:.3f} TFLOP/s ({peak['median_ms']:.2f} ms)")
    cases = []
    header = f"{'model':14} {'phase':7} {'T':>5} {'routing':7} {'rows':>6} | " + " | ".join(
        f"{k:>7} ms  TF/s" for k in ("loop", "grouped", "padded", "block")) + " | grp/loop"
    print(header)
    for model in prof.models:
        weights = make_weights(model, device, dtype, args.seed)
        plan = [("prefill", prof.prefill_tokens)] + [("decode", t) for t in prof.decode_tokens]
        for phase, tokens in plan:
            for routing in ("uniform", "zipf"):
                case = run_case(model, weights, phase, tokens, routing, args, prof, peak["tflops"], device, dtype)
                cases.append(case)
                measured = {k: case["runners"][k]["measured"] for k in ("loop", "grouped", "padded", "block")}
                cells = " | ".join(f"{m['median_ms']:10.3f} {m['useful_tflops']:5.2f}" for m in measured.values())
                print(f"{model.name:14} {phase:7} {tokens:5d} {routing:7} {case['rows']:6d} | {cells} | "
                      f"{case['speedup_grouped_vs_loop']:.2f}x", flush=True)
        del weights
        if cuda:
            torch.cuda.empty_cache()

    payload = {
        "mode": "quick" if args.quick else "full",
        "device": str(device), "dtype": str(dtype),
        "config": {"alignment": args.alignment, "block_size": args.block_size, "zipf_s": args.zipf_s,
                   "seed": args.seed, "warmup": prof.warmup, "iters": prof.iters,
                   "models": [asdict(m) for m in prof.models], "prefill_tokens": prof.prefill_tokens,
                   "decode_tokens": list(prof.decode_tokens)},
        "baseline": "loop (per-expert SwiGLU, measured in this run)",
        "dense_peak": peak,
        "cases": cases,
        "speedup_grouped_vs_loop": {
            f"{c['model']}/{c['phase']}/T{c['tokens']}/{c['routing']}": c["speedup_grouped_vs_loop"] for c in cases
        },
    }
    path = write_result("runners", payload, suffix=host_kind(), out=args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
