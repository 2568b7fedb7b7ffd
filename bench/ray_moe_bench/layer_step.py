"""Whole MoE layer steps through the Ray runtime: prefill throughput, decode latency per path, Ray overhead.

    python -m ray_moe_bench.layer_step                      # GPU: every rank count visible..1 GPUs (NCCL, bf16)
    python -m ray_moe_bench.layer_step --gpus 2             # one rank count
    python -m ray_moe_bench.layer_step --gpus 2 --models mixtral:1,4 --decode-tokens 1,8,32,128
    python -m ray_moe_bench.layer_step --quick              # CPU smoke (< 60 s): 2 ranks, object-store exchange, tiny shapes

What one step is: ``Runtime.forward`` on the driver -> one actor call per rank for ALL layers -> every
shard runs its layers SPMD (plan, exchange, experts, return, combine) -> outputs back to the driver.

Measured per step (wall clock, time.perf_counter):
  wall       driver time of ``rt.forward`` (validation, wire conversion, Ray submit/get, concat, accounting)
  shard      max over ranks of ``StepResult.elapsed_s`` (each shard's own step time, GPU work included: the
             shard copies its output to the host before it stops its clock)
  overhead   wall - shard: the Ray orchestration cost of the step. The runtime submits ONE actor call per
             rank per step whatever the layer count, so an L-layer model pays it once per step: the
             table "Ray overhead vs layers" compares num_layers=1 with num_layers=4 (overhead ~constant,
             shard time ~xL). ``actor_calls_per_rank_per_step`` (from the shards' own step counters)
             confirms one call per rank per step.

Cases (GPU defaults; every case is measured in this run):
  prefill   T = 2048, 8192 tokens per step (split evenly over the ranks), >= 10 timed steps after warmup;
            tokens/s = T / wall (and T / shard, Ray excluded). Baseline: the same number of routed rows
            through GroupedRunner in the driver process on one device holding all E experts (no Ray, no
            exchange, no routing: the expert GEMMs alone).
  decode    T = 1..128 tokens PER RANK, >= 50 timed steps each, p50/p99 nearest-rank, three paths:
              graph     decode buckets replayed as CUDA graphs (cuda_graphs=True; on CPU: eager bucket)
              eager     decode buckets without graphs (a second deployment with cuda_graphs=False)
              variable  the variable (non-bucket) path (``--dispatch-path``: engine, direct, or auto = direct
                        on NCCL). It is the exact code path of decode_buckets=False:
                        the same tokens submitted with phase="prefill" on the graph deployment (a shard only
                        takes the bucket path for phase=decode), so weights are not loaded a third time.
            The path every step actually took is recorded from the shards' per-layer stats
            (``paths``: bucket-graph / bucket / variable, with fallback reasons); the bucket capacity
            is C_T = max decode T (one deployment serves every T), C_q the runtime default.
Models: mixtral-like d=4096 f=14336 E=8 k=2 (num_layers 1 and 4); deepseek-like d=7168 f=2048 E=64 k=8
(E scaled from 256 to 64 so weight generation fits the time budget; num_layers 1). Experts are spread
evenly (slots_per_rank = ceil(E / ranks), no replicas). Routes are explicit, uniform: every token picks
k distinct experts uniformly at random (the same routes for every layer).

The result JSON is rewritten after every deployment (partial results survive a timeout); ``--budget-s``
stops starting new deployments once exceeded (the skipped ones are listed).
"""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from ray_moe_bench import summary
from ray_moe_bench.common import add_output_argument, host_kind, nearest_rank, time_fn, write_result

# ============================================================================ the runtime, recording results
try:
    import ray_moe
    from ray_moe.runtime import Runtime as _Runtime
except Exception:  # pragma: no cover - import errors surface in main()
    _Runtime = object  # type: ignore[assignment,misc]


class RecordingRuntime(_Runtime):  # type: ignore[misc,valid-type]
    """``ray_moe.Runtime`` that keeps each thread's last step results (per-rank ``StepResult``s), so a
    benchmark can read every shard's own elapsed time and the path each layer took. Nothing else changes
    (``Runtime.start`` builds this class through ``cls``)."""

    _last: dict[int, Any]

    def _account(self, results, *args, **kwargs):  # noqa: ANN001 - same signature as Runtime._account
        if not hasattr(self, "_last"):
            self._last = {}
        self._last[threading.get_ident()] = results
        return super()._account(results, *args, **kwargs)

    def last_results(self) -> dict[int, Any]:
        return dict(getattr(self, "_last", {}).get(threading.get_ident(), {}))


def step_record(rt: RecordingRuntime, wall_s: float) -> dict[str, Any]:
    """Per-step measurements from the last results of this thread."""
    res = rt.last_results()
    ranks = sorted(res)
    shard = {r: float(res[r].elapsed_s) for r in ranks}
    first = res[ranks[0]]
    paths = [ls.path for ls in first.layers]
    reasons = [ls.fallback_reason for ls in first.layers if ls.fallback_reason]
    smax = max(shard.values())
    marks = {}
    for r in ranks:  # per-stage milliseconds on each shard: device clock on CUDA, else host (mark deltas)
        prev, deltas = 0.0, {}
        for label, host, dev in res[r].output.marks:
            t = dev if dev >= 0 else host
            deltas[label] = (t - prev) * 1e3
            prev = t
        marks[r] = deltas
    return {"wall_ms": wall_s * 1e3, "shard_ms": smax * 1e3, "overhead_ms": (wall_s - smax) * 1e3,
            "shard_ms_by_rank": {r: v * 1e3 for r, v in shard.items()}, "paths": paths, "fallbacks": reasons,
            "stage_ms_by_rank": marks}


def timed_forward(rt: RecordingRuntime, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                  phase: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    rt.forward(h, ids, w, phase=phase)
    return step_record(rt, time.perf_counter() - t0)


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """p50/p99 nearest-rank of wall, shard and overhead; the paths taken (measured)."""
    def q(key: str) -> dict[str, float]:
        xs = [r[key] for r in records]
        return {"p50": nearest_rank(xs, 0.5), "p99": nearest_rank(xs, 0.99), "mean": statistics.fmean(xs),
                "min": min(xs), "max": max(xs)}

    paths: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for r in records:
        for p in r["paths"]:
            paths[p] = paths.get(p, 0) + 1
        for f in r["fallbacks"]:
            reasons[f] = reasons.get(f, 0) + 1
    stages: dict[str, dict[str, float]] = {}  # median host ms of each shard stage, per rank
    for r in records[0].get("stage_ms_by_rank", {}):
        labels = records[0]["stage_ms_by_rank"][r]
        stages[str(r)] = {k: statistics.median(rec["stage_ms_by_rank"][r].get(k, 0.0) for rec in records)
                          for k in labels}
    return {"n": len(records), "wall_ms": q("wall_ms"), "shard_ms": q("shard_ms"), "overhead_ms": q("overhead_ms"),
            "paths": paths, "fallback_reasons": reasons, "stage_ms": stages}


# ============================================================================ shapes and profiles
@dataclass(frozen=True)
class Model:
    name: str
    d: int
    f: int
    num_experts: int
    k: int

    def expert_bytes(self, elt: int) -> int:
        return 3 * self.d * self.f * elt


GPU_MODELS = {"mixtral": Model("mixtral-like", 4096, 14336, 8, 2),
              "deepseek": Model("deepseek-like", 7168, 2048, 64, 8)}
CPU_MODELS = {"mixtral": Model("mixtral-like-cpu", 512, 1024, 8, 2),
              "deepseek": Model("deepseek-like-cpu", 512, 128, 32, 8)}
QUICK_MODELS = {"mixtral": Model("mixtral-like-tiny", 64, 128, 8, 2),
                "deepseek": Model("deepseek-like-tiny", 64, 32, 16, 4)}


@dataclass(frozen=True)
class Profile:
    models: dict[str, Model]
    matrix: tuple[tuple[str, tuple[int, ...]], ...]  # (model key, layer counts)
    prefill_tokens: tuple[int, ...]
    decode_tokens: tuple[int, ...]
    paths: tuple[str, ...]
    prefill_steps: int
    decode_steps: int
    warmup: int
    baseline_iters: int


def profile(quick: bool, cuda: bool) -> Profile:
    if cuda:
        return Profile(GPU_MODELS, (("mixtral", (1, 4)), ("deepseek", (1,))), (2048, 8192),
                       (1, 2, 4, 8, 16, 32, 64, 128), ("graph", "eager", "variable"), 10, 50, 5, 10)
    if quick:
        # three deployments (mixtral L=1 graphs / eager, L=4): Ray actor start-up dominates on a small CPU box
        return Profile(QUICK_MODELS, (("mixtral", (1, 4)),), (64,), (1, 16),
                       ("graph", "eager", "variable"), 10, 50, 2, 3)
    return Profile(CPU_MODELS, (("mixtral", (1, 4)), ("deepseek", (1,))), (512, 2048), (1, 8, 32, 128),
                   ("graph", "eager", "variable"), 10, 50, 3, 5)


# ============================================================================ inputs
def uniform_routes(tokens: int, e: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] distinct experts uniformly at random, gates normalised per token."""
    ids = torch.rand(tokens, e, generator=g).argsort(dim=1)[:, :k].contiguous()
    w = torch.rand(tokens, k, generator=g) + 0.05
    return ids, (w / w.sum(1, keepdim=True)).to(torch.float32)


def make_batches(tokens: int, model: Model, dtype: torch.dtype, seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        h = torch.randn(tokens, model.d, generator=g).to(dtype)
        ids, w = uniform_routes(tokens, model.num_experts, model.k, g)
        out.append((h, ids, w))
    return out


def run_case(rt: RecordingRuntime, batches, phase: str, warmup: int, steps: int) -> list[dict[str, Any]]:
    for i in range(warmup):
        h, ids, w = batches[i % len(batches)]
        rt.forward(h, ids, w, phase=phase)
    recs = []
    for i in range(steps):
        h, ids, w = batches[i % len(batches)]
        recs.append(timed_forward(rt, h, ids, w, phase))
    return recs


def local_baseline(model: Model, tokens: int, device: torch.device, dtype: torch.dtype, warmup: int, iters: int,
                   seed: int) -> dict[str, Any]:
    """The expert GEMMs of one layer step alone: T*k routed rows through GroupedRunner on one device that
    holds all E experts (driver process; no Ray, no exchange, no routing, no combine)."""
    from ray_moe_bench.runners import ModelShape, make_weights
    from ray_moe.moe.experts.runners.grouped import GroupedRunner

    w = make_weights(ModelShape(model.name, model.d, model.f, model.num_experts, model.num_experts, model.k),
                     device, dtype, seed)
    g = torch.Generator().manual_seed(seed)
    ids, _ = uniform_routes(tokens, model.num_experts, model.k, g)
    counts = torch.bincount(ids.reshape(-1), minlength=model.num_experts).tolist()
    x = torch.randn(tokens * model.k, model.d, generator=g).to(device=device, dtype=dtype)
    runner = GroupedRunner()
    t = time_fn(lambda: runner.run(x, counts, w), warmup=warmup, iters=iters, cuda=device.type == "cuda")
    out = {"evidence": "measured", "what": "GroupedRunner, T*k rows, all experts on one device, driver process",
           "tokens": tokens, "rows": tokens * model.k, **t,
           "tokens_per_s": tokens / (t["median_ms"] * 1e-3) if t["median_ms"] > 0 else None,
           "backend": runner.backend(x, w)}
    del w, x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ============================================================================ one deployment
@dataclass(frozen=True)
class Deployment:
    ranks: int
    model_key: str
    layers: int
    cuda_graphs: bool
    prefill: bool
    decode_paths: tuple[str, ...]  # subset of graph / eager / variable

    @property
    def label(self) -> str:
        return f"g{self.ranks}-{self.model_key}-L{self.layers}-{'graphs' if self.cuda_graphs else 'eager'}"


def plan_deployments(ranks_list: Sequence[int], matrix, paths: Sequence[str], do_prefill: bool) -> list[Deployment]:
    out = []
    for n in ranks_list:
        for key, layer_counts in matrix:
            for i, L in enumerate(layer_counts):
                dp = tuple(p for p in ("graph", "variable") if p in paths)
                if do_prefill or dp:
                    out.append(Deployment(n, key, L, True, do_prefill, dp))
                if "eager" in paths and i == 0:
                    out.append(Deployment(n, key, L, False, False, ("eager",)))
    return out


def run_deployment(dep: Deployment, model: Model, prof: Profile, args: argparse.Namespace, device: str,
                   dtype_name: str, decode_capacity: int) -> dict[str, Any]:
    cfg = ray_moe.RuntimeConfig(
        num_ranks=dep.ranks, num_experts=model.num_experts, hidden_size=model.d, ffn_size=model.f, top_k=model.k,
        slots_per_rank=math.ceil(model.num_experts / dep.ranks), num_layers=dep.layers, device=device,
        dtype=dtype_name, seed=args.seed, name=f"bench-ls-{dep.label}", decode_token_capacity=decode_capacity,
        cuda_graphs=dep.cuda_graphs, decode_buckets=True, exchange_timeout_s=args.exchange_timeout_s,
        dispatch_path=args.dispatch_path,
    )
    t0 = time.perf_counter()
    rt = RecordingRuntime.start(cfg)
    rt.record_marks = True  # shard stage timestamps (host clock) in every StepResult's output
    deploy_s = time.perf_counter() - t0
    dtype = rt.dtype
    out: dict[str, Any] = {"label": dep.label, "ranks": dep.ranks, "model": asdict(model), "num_layers": dep.layers,
                           "dispatch_path": cfg.resolved_dispatch_path.value,
                           "cuda_graphs": dep.cuda_graphs, "config": cfg.model_dump(mode="json"),
                           "deploy_s": deploy_s, "prefill": [], "decode": []}
    mib = model.expert_bytes(torch.tensor([], dtype=dtype).element_size()) / 2**20
    print(f"[{dep.label}] deployed in {deploy_s:.1f}s ({dep.ranks} ranks x {cfg.slots_per_rank} slots, "
          f"{mib:.1f} MiB/expert)", flush=True)
    try:
        steps0 = rt.stats()["steps"]
        if dep.prefill:
            for t in prof.prefill_tokens:
                batches = make_batches(t, model, dtype, args.seed + t, n=2)
                recs = run_case(rt, batches, "prefill", max(2, prof.warmup // 2), prof.prefill_steps)
                s = summarize(recs)
                s.update(tokens=t, tokens_per_rank=t // dep.ranks,
                         tokens_per_s_wall=t / (s["wall_ms"]["p50"] * 1e-3),
                         tokens_per_s_shard=t / (s["shard_ms"]["p50"] * 1e-3),
                         layer_tokens_per_s_wall=t * dep.layers / (s["wall_ms"]["p50"] * 1e-3))
                out["prefill"].append({**s, "steps": recs if args.keep_steps else None})
                print(f"[{dep.label}] prefill T={t:5d}: wall p50 {s['wall_ms']['p50']:9.2f} ms  shard p50 "
                      f"{s['shard_ms']['p50']:9.2f} ms  overhead p50 {s['overhead_ms']['p50']:7.2f} ms  "
                      f"{s['tokens_per_s_wall']:12.0f} tok/s", flush=True)
                print(f"[{dep.label}]   shard stages (ms, p50, rank 0; device clock on CUDA): " + " ".join(
                    f"{k}={v:.2f}" for k, v in s["stage_ms"].get("0", {}).items()), flush=True)
        for path in dep.decode_paths:
            phase = "prefill" if path == "variable" else "decode"
            for t in prof.decode_tokens:
                total = t * dep.ranks
                batches = make_batches(total, model, dtype, args.seed + 7919 * t, n=4)
                before = rt.stats()
                recs = run_case(rt, batches, phase, prof.warmup, prof.decode_steps)
                after = rt.stats()
                s = summarize(recs)
                s.update(path=path, tokens_per_rank=t, tokens=total, phase_submitted=phase,
                         graph_replays=after["graph_replays"] - before["graph_replays"],
                         fallbacks={k: v - before["fallbacks"].get(k, 0) for k, v in after["fallbacks"].items()
                                    if v - before["fallbacks"].get(k, 0)})
                out["decode"].append({**s, "steps": recs if args.keep_steps else None})
                print(f"[{dep.label}] decode {path:8s} T/rank={t:4d}: wall p50 {s['wall_ms']['p50']:8.2f} "
                      f"p99 {s['wall_ms']['p99']:8.2f} ms  shard p50 {s['shard_ms']['p50']:8.2f} ms  "
                      f"overhead p50 {s['overhead_ms']['p50']:6.2f} ms  paths {s['paths']}", flush=True)
        steps = rt.stats()["steps"] - steps0
        shard_steps = [st["counters"]["steps"] for st in rt.shard_status().values()]
        out["driver_steps"] = steps
        out["shard_step_calls"] = shard_steps
        # warmup / measured steps plus nothing else went through the shards: one call per rank per step
        out["actor_calls_per_rank_per_step"] = (statistics.fmean(shard_steps) / rt.stats()["steps"]
                                               if rt.stats()["steps"] else None)
        out["refcounts_after"] = {str(k): v for k, v in rt.refcounts().items()}
        out["stats"] = rt.stats()
    finally:
        rt.shutdown()
    return out


# ============================================================================ report
def overhead_vs_layers(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every (ranks, model) measured with 1 and with more layers on the graph deployment: overhead and
    shard time side by side per case."""
    rows = []
    graph_runs = [r for r in runs if r.get("cuda_graphs") and "error" not in r]
    keyed: dict[tuple[int, str], dict[int, dict[str, Any]]] = {}
    for r in graph_runs:
        keyed.setdefault((r["ranks"], r["model"]["name"]), {})[r["num_layers"]] = r
    for (n, name), by_l in sorted(keyed.items()):
        if 1 not in by_l:
            continue
        for L, rl in sorted(by_l.items()):
            if L == 1:
                continue
            r1 = by_l[1]
            cases = [("prefill", c["tokens"], c, next((d for d in rl["prefill"] if d["tokens"] == c["tokens"]), None))
                     for c in r1["prefill"]]
            cases += [(f"decode/{c['path']}", c["tokens_per_rank"], c,
                       next((d for d in rl["decode"] if d["path"] == c["path"] and
                             d["tokens_per_rank"] == c["tokens_per_rank"]), None)) for c in r1["decode"]]
            for case, t, a, b in cases:
                if b is None:
                    continue
                o1, oL = a["overhead_ms"]["p50"], b["overhead_ms"]["p50"]
                s1, sL = a["shard_ms"]["p50"], b["shard_ms"]["p50"]
                rows.append({"ranks": n, "model": name, "case": case, "tokens": t, "layers": [1, L],
                             "overhead_p50_ms": [o1, oL], "overhead_ratio": oL / o1 if o1 > 0 else None,
                             "shard_p50_ms": [s1, sL], "shard_ratio": sL / s1 if s1 > 0 else None})
    return rows


def print_tables(runs: Sequence[dict[str, Any]], ovl: Sequence[dict[str, Any]]) -> None:
    print("\n== prefill (measured; T tokens per step over all ranks) ==")
    print(f"{'deployment':28} {'T':>6} | {'wall p50':>9} {'shard p50':>9} {'ovh p50':>8} ms | "
          f"{'tok/s wall':>11} {'tok/s shard':>11} | {'local expert GEMMs':>18}")
    for r in runs:
        for c in r.get("prefill", []):
            b = c.get("baseline")
            bl = f"{b['median_ms']:8.2f} ms" if b else "-"
            print(f"{r['label']:28} {c['tokens']:6d} | {c['wall_ms']['p50']:9.2f} {c['shard_ms']['p50']:9.2f} "
                  f"{c['overhead_ms']['p50']:8.2f}    | {c['tokens_per_s_wall']:11.0f} "
                  f"{c['tokens_per_s_shard']:11.0f} | "
                  f"{bl:>18}")
    print("\n== decode latency (measured, nearest-rank; T tokens per rank) ==")
    print(f"{'deployment':28} {'path':8} {'T/rank':>6} | {'wall p50':>8} {'p99':>8} | {'shard p50':>9} {'p99':>8} | "
          f"{'ovh p50':>7} ms | paths")
    for r in runs:
        for c in r.get("decode", []):
            print(f"{r['label']:28} {c['path']:8} {c['tokens_per_rank']:6d} | {c['wall_ms']['p50']:8.2f} "
                  f"{c['wall_ms']['p99']:8.2f} | {c['shard_ms']['p50']:9.2f} {c['shard_ms']['p99']:8.2f} | "
                  f"{c['overhead_ms']['p50']:7.2f}    | {c['paths']}")
    if ovl:
        print("\n== Ray overhead vs layers (measured p50; one actor call per rank per step) ==")
        print(f"{'ranks':>5} {'model':20} {'case':16} {'T':>6} | {'ovh L=1':>8} {'ovh L':>8} {'ratio':>6} | "
              f"{'shard L=1':>9} {'shard L':>9} {'ratio':>6}")
        for o in ovl:
            print(f"{o['ranks']:5d} {o['model']:20} {o['case']:16} {o['tokens']:6d} | {o['overhead_p50_ms'][0]:8.2f} "
                  f"{o['overhead_p50_ms'][1]:8.2f} {o['overhead_ratio'] or float('nan'):6.2f} | "
                  f"{o['shard_p50_ms'][0]:9.2f} {o['shard_p50_ms'][1]:9.2f} {o['shard_ratio'] or float('nan'):6.2f}"
                  f"   (L={o['layers'][1]})")


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def parse_matrix(specs: Sequence[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out = []
    for spec in specs:
        key, _, layers = spec.partition(":")
        out.append((key, _ints(layers) if layers else (1,)))
    return tuple(out)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--quick", action="store_true", help="CPU smoke: 2 ranks, tiny shapes (< 60 s)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--gpus", default=None,
                    help="rank counts, comma separated (one GPU per rank); default: visible..1 GPUs (CPU: 2)")
    ap.add_argument("--models", nargs="+", default=None,
                    help="model[:layer counts], e.g. mixtral:1,4 deepseek:1 (models: mixtral, deepseek)")
    ap.add_argument("--prefill-tokens", type=_ints, default=None)
    ap.add_argument("--decode-tokens", type=_ints, default=None, help="tokens per rank")
    ap.add_argument("--paths", default=None, help="decode paths: graph,eager,variable")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--decode-steps", type=int, default=None)
    ap.add_argument("--prefill-steps", type=int, default=None)
    ap.add_argument("--decode-capacity", type=int, default=None, help="C_T (default: max decode tokens per rank)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the local expert-GEMM baseline")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new deployment after this many seconds (default: 540 on GPU, none on CPU)")
    ap.add_argument("--exchange-timeout-s", type=float, default=120.0)
    ap.add_argument("--dispatch-path", default="auto", choices=("auto", "engine", "direct"),
                    help="normal-mode data path of the deployments (auto: direct on NCCL)")
    ap.add_argument("--keep-steps", action="store_true", help="keep every step's record in the JSON")
    ap.add_argument("--seed", type=int, default=0)
    add_output_argument(ap)
    args = ap.parse_args(argv)

    import ray

    cuda = not args.quick and (args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()))
    if args.device == "cuda" and args.quick:
        raise SystemExit("--quick runs on CPU; drop --device cuda")
    prof = profile(args.quick, cuda)
    matrix = parse_matrix(args.models) if args.models else prof.matrix
    for key, _ in matrix:
        if key not in prof.models:
            raise SystemExit(f"--models: {key!r} is not one of {sorted(prof.models)}")
    paths = tuple(p for p in (args.paths or ",".join(prof.paths)).split(",") if p)
    bad = set(paths) - {"graph", "eager", "variable"}
    if bad:
        raise SystemExit(f"--paths: {sorted(bad)} not in graph, eager, variable")
    prof = Profile(prof.models, matrix, args.prefill_tokens or prof.prefill_tokens,
                   args.decode_tokens or prof.decode_tokens, paths, args.prefill_steps or prof.prefill_steps,
                   args.decode_steps or prof.decode_steps, prof.warmup, prof.baseline_iters)
    visible = torch.cuda.device_count() if cuda else 0
    # every rank count, the largest first (the multi-GPU numbers survive a budget cut)
    default_ranks = tuple(range(visible, 0, -1)) if cuda else (2,)
    ranks_list = _ints(args.gpus) if args.gpus else default_ranks
    if cuda and max(ranks_list) > visible:
        raise SystemExit(f"--gpus {args.gpus}: only {visible} CUDA devices visible")
    device = "cuda" if cuda else "cpu"
    dtype_name = "bfloat16" if cuda else "float32"
    decode_capacity = args.decode_capacity or max(prof.decode_tokens)
    budget = args.budget_s if args.budget_s is not None else (540.0 if cuda else None)
    suffix = host_kind() + ("" if ranks_list == default_ranks else "-g" + "-".join(map(str, ranks_list))) + \
        ("-quick" if args.quick else "") + ("" if args.dispatch_path == "auto" else "-" + args.dispatch_path)

    deps = plan_deployments(ranks_list, matrix, paths, not args.no_prefill)
    t_start = time.perf_counter()
    base_dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    base_dtype = torch.bfloat16 if cuda else torch.float32
    baselines: dict[str, list[dict[str, Any]]] = {}
    # the local baselines first, before Ray and its workers compete for the host / the device
    for key in dict.fromkeys(d.model_key for d in deps if d.prefill):
        model = prof.models[key]
        if args.no_baseline:
            break
        try:
            baselines[model.name] = [local_baseline(model, t, base_dev, base_dtype, 3, prof.baseline_iters, args.seed)
                                     for t in prof.prefill_tokens]
            print(f"baseline {model.name}: " + ", ".join(
                f"T={b['tokens']} {b['median_ms']:.2f} ms ({b['backend']})" for b in baselines[model.name]), flush=True)
        except Exception as exc:  # noqa: BLE001 - the baseline must not sink the run
            baselines[model.name] = [{"error": f"{type(exc).__name__}: {exc}"}]
    if not ray.is_initialized():
        # address="local": always a fresh local instance (never join another process's cluster by accident)
        ray.init(address="local", num_cpus=max(4, 2 * max(ranks_list) + 2), include_dashboard=False,
                 log_to_driver=False, namespace="ray-moe-bench")
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    payload: dict[str, Any] = {}
    path = ""

    def flush() -> str:
        ovl = overhead_vs_layers(runs)
        payload.update({
            "mode": "quick" if args.quick else "full", "device": device, "dtype": dtype_name,
            "evidence": {
                "wall_ms / shard_ms / overhead_ms / tokens_per_s / baseline": "measured (time.perf_counter; "
                "baseline: CUDA events on GPU)",
                "overhead_ms": "measured: driver wall - max shard StepResult.elapsed_s of the same step",
                "expert bytes, slots": "analytical",
            },
            "config": {"ranks": list(ranks_list), "matrix": [[k, list(ls)] for k, ls in matrix],
                       "models": {k: asdict(m) for k, m in prof.models.items()},
                       "prefill_tokens": list(prof.prefill_tokens), "decode_tokens_per_rank": list(prof.decode_tokens),
                       "paths": list(paths), "decode_capacity_C_T": decode_capacity,
                       "warmup": prof.warmup, "prefill_steps": prof.prefill_steps, "decode_steps": prof.decode_steps,
                       "routing": "uniform, explicit, same routes every layer", "seed": args.seed},
            "baseline": {"prefill": "local expert GEMMs (GroupedRunner, one device, all experts, no Ray) measured "
                                    "in this run",
                         "decode": "eager buckets (cuda_graphs=False) and the variable path, measured in this run"},
            "local_baselines": baselines,
            "runs": runs, "overhead_vs_layers": ovl, "skipped": skipped,
            "elapsed_s": time.perf_counter() - t_start,
        })
        return write_result("layer_step", payload, suffix=suffix, out=args.out)

    try:
        for dep in deps:
            if budget is not None and time.perf_counter() - t_start > budget:
                skipped.append(dep.label)
                print(f"[{dep.label}] skipped: --budget-s {budget:.0f} exceeded", flush=True)
                continue
            model = prof.models[dep.model_key]
            try:
                run = run_deployment(dep, model, prof, args, device, dtype_name, decode_capacity)
            except Exception as exc:  # noqa: BLE001 - keep the other deployments' results
                import traceback

                traceback.print_exc()
                run = {"label": dep.label, "ranks": dep.ranks, "model": asdict(model), "num_layers": dep.layers,
                       "cuda_graphs": dep.cuda_graphs, "error": f"{type(exc).__name__}: {exc}"}
            for c in run.get("prefill", []):
                b = next((x for x in baselines.get(model.name, []) if x.get("tokens") == c["tokens"]), None)
                c["baseline"] = b
            runs.append(run)
            path = flush()
    finally:
        path = flush()
        ray.shutdown()
    print_tables([r for r in runs if "error" not in r], payload["overhead_vs_layers"])
    errs = [r for r in runs if "error" in r]
    for r in errs:
        print(f"ERROR {r['label']}: {r['error']}")
    if skipped:
        print(f"skipped (budget): {skipped}")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
