"""``ray-moe demo``: generation served inside the shard actors on a local Ray instance, with a live EPLB
rebalance the autopilot decides mid-stream, every output checked token-equal against transformers' own
``generate``.

A tiny random DeepSeek-V3-style model (sigmoid routing with a correction bias skewed so a few experts are hot,
grouped top-k, a shared expert, a dense first layer) is written by transformers into a temp folder and served
by ``Runtime.generate_stream``: each rank runs attention for its own sequences, the routed experts run
expert-parallel across the ranks. The coordinator's autopilot (``eplb`` mode auto, ``DEMO_POLICY``) watches the
router load and rebalances by itself while generation continues; the demo prints its decisions with their
reasons. Should it hold (no gain to take) until generation ends, the demo falls back to a scripted
``rt.rebalance()`` and says so. Prints the per-rank load before / after, the ratios and the step
latencies; writes a JSON report and a PNG. Exit code 1 on any token mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any


def _gamma(loads: list[int]) -> float:
    mean = sum(loads) / len(loads) if loads else 0
    return max(loads) / mean if mean else 1.0


def load_shares(rows: list[int]) -> list[float]:
    """Each rank's share (%) of one window's routed rows (all 0 for an empty window): the windows before and
    after the rebalance span different numbers of steps, so only shares compare. Gamma is the same either way."""
    total = sum(rows)
    return [100.0 * r / total if total else 0.0 for r in rows]


def demo_model(folder: str, *, layers: int, experts: int, hidden: int, skew: float, seed: int) -> Any:
    """A tiny DeepSeek-V3-style model saved with ``save_pretrained``; returns it (eval mode, float32)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=experts,
        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        max_position_embeddings=512, routed_scaling_factor=2.0, initializer_range=0.2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # Zipf-like popularity: the correction bias decides which experts are picked
        rank = torch.arange(1, experts + 1, dtype=torch.float32)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(-skew * torch.log(rank)[torch.randperm(experts)] * 0.25)
    model.save_pretrained(folder)
    return model


def demo_policy() -> Any:
    """The demo's autopilot: decide as soon as one load report arrived, rebalance when the solve predicts at least
    5% off the bottleneck rank, then hold for the rest of the run (the interval: one automatic rebalance)."""
    from ray_moe.model.config import AutopilotPolicy, EplbMode

    return AutopilotPolicy(mode=EplbMode.AUTO, threshold_gain=0.05, min_window_steps=1, min_interval_s=3600.0,
                           min_interval_steps=0, tick_s=0.1)


def run_demo(args: argparse.Namespace) -> int:
    import ray
    import torch
    from tqdm import tqdm

    import ray_moe
    from ray_moe.core.telemetry.quantiles import EvidenceClass, summarize

    t_start = time.perf_counter()
    folder = os.path.join(tempfile.mkdtemp(prefix="ray-moe-demo-"), "tiny-deepseek-v3")
    model = demo_model(folder, layers=args.layers, experts=args.experts, hidden=args.hidden, skew=args.skew,
                       seed=args.seed)
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=args.ranks, slots_per_rank=args.slots_per_rank,
                                                name=f"demo-{os.getpid()}", decode_token_capacity=16,
                                                exchange=args.exchange, eplb=demo_policy())
    print(f"ray-moe demo: tiny DeepSeek-V3-style model ({cfg.num_layers} MoE layers of {cfg.num_experts} experts, "
          f"top-{cfg.top_k}, a shared expert, a dense first layer), {cfg.num_ranks} shard actors x "
          f"{cfg.slots_per_rank} slots; {args.prompts} prompts x {args.new_tokens} new tokens", file=sys.stderr)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(4, cfg.num_ranks + 2), include_dashboard=False, log_to_driver=False)
    rt = ray_moe.Runtime.start(cfg)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 24, (args.prompts,), generator=g)]
    total = args.prompts * args.new_tokens
    outputs: list[list[int]] = [[] for _ in prompts]
    loads: dict[str, list[int]] = {}
    step_ms: list[float] = []
    rebalance: dict[str, Any] = {}
    decisions: list[dict[str, Any]] = []
    watch = _AutopilotWatch(rt, rebalance)
    try:
        engine = rt.serving(kv_tokens=2048, block_size=16, step_tokens=256)
        bar = tqdm(total=total, desc="generating", unit="tok", file=sys.stderr, disable=args.quiet)
        done = 0
        watch.start()
        t_gen = time.perf_counter()
        for i, tok in rt.generate_stream(prompts, max_new_tokens=args.new_tokens):
            outputs[i].append(tok)
            done += 1
            bar.update(1)
            if done == total // 2:  # mid-stream: the load so far reaches the autopilot's window now
                rt.flush_load()
        gen_s = time.perf_counter() - t_gen
        bar.close()
        total = sum(len(o) for o in outputs)  # a sequence that samples its end-of-sequence token stops early
        rt.flush_load()
        decisions = watch.finish(grace_s=10.0)
        if "generation" not in rebalance:  # the autopilot held: a scripted rebalance, so the demo still shows one
            rebalance.update(_rebalance(rt), decided_by="script (the autopilot held)")
        stats = rt.stats()
        loads["after"] = [stats["rank_rows"].get(r, 0) - rebalance.get("rows", {}).get(r, 0)
                          for r in range(cfg.num_ranks)]
        again: list[list[int]] | None = None
        if not any(loads["after"]):  # published after the last step (a late decision, or the scripted one): the same
            again = rt.generate(prompts, max_new_tokens=args.new_tokens)  # prompts once more, over the new placement
            stats = rt.stats()
            loads["after"] = [stats["rank_rows"].get(r, 0) - rebalance.get("rows", {}).get(r, 0)
                              for r in range(cfg.num_ranks)]
        loads["before"] = [rebalance.get("rows", {}).get(r, 0) for r in range(cfg.num_ranks)]
        step_ms = list(rt.books.stats.step_ms)
        replicas = rt.placement().replica_counts(0)  # [num_experts]: replicas of each expert, first MoE layer
        steps = engine.steps
    finally:
        rt.shutdown()
    want = [model.generate(torch.tensor([p]), max_new_tokens=args.new_tokens, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    mismatches = [i for i, (a, b) in enumerate(zip(outputs, want)) if a != b]
    mismatches += [i for i, (a, b) in enumerate(zip(again or [], want)) if a != b and i not in mismatches]
    print()
    print("rank  routed rows before rebalance (share)  after (share)")
    shares = {k: load_shares(v) for k, v in loads.items()}
    for r in range(cfg.num_ranks):
        print(f"{r:>4}  {loads['before'][r]:>28} ({shares['before'][r]:4.1f}%)  {loads['after'][r]:>5} "
              f"({shares['after'][r]:4.1f}%)")
    print(f"Gamma_rank (max/mean rows): before {_gamma(loads['before']):.3f}, after {_gamma(loads['after']):.3f}; "
          f"rebalance published generation {rebalance.get('generation')} in {rebalance.get('seconds', 0):.2f}s "
          f"{'after the last step (the prompts generated again over it)' if again else 'while generating'}, "
          f"decided by {rebalance.get('decided_by')}")
    from ray_moe.apps.status_lines import autopilot_lines

    for line in autopilot_lines(watch.eplb):
        print(line)
    print(replicas_line(replicas))
    print()
    print("ratio             numerator  denominator  value")
    for name, r in stats["ratios"].items():
        v = "n/a" if r["value"] is None else f"{r['value']:.4f}"
        print(f"{name:<16}  {r['numerator']:>9}  {r['denominator']:>11}  {v}")
    lat = summarize(step_ms, unit="ms", evidence=EvidenceClass.MEASURED) if step_ms else None
    print()
    print(f"{steps} generation steps (one actor call per rank each), {total} tokens in {gen_s:.1f}s "
          f"({total / gen_s:.0f} tokens/s on this CPU); step p50 {lat.p50:.1f} ms, p95 {lat.p95:.1f} ms (measured)"
          if lat else "")
    elapsed = time.perf_counter() - t_start
    report = {"config": cfg.model_dump(mode="json"), "prompts": prompts, "outputs": outputs, "reference": want,
              "mismatches": mismatches, "rank_rows_before_rebalance": loads["before"],
              "rank_rows_after_rebalance": loads["after"],
              "rank_share_pct_before_rebalance": shares["before"], "rank_share_pct_after_rebalance": shares["after"],
              "replicas_per_expert": replicas, "gamma_before": _gamma(loads["before"]),
              "gamma_after": _gamma(loads["after"]), "rebalance": {k: v for k, v in rebalance.items() if k != "rows"},
              "autopilot_decisions": decisions, "outputs_after_rebalance": again,
              "ratios": stats["ratios"], "steps": steps, "tokens": total, "generate_s": gen_s,
              "step_ms": None if lat is None else {"p50": lat.p50, "p95": lat.p95, "n": lat.n}, "elapsed_s": elapsed}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    _plot(args.png, loads["before"], loads["after"], cfg.num_ranks)
    print(f"report: {args.json}   plot: {args.png}   ({elapsed:.1f}s)")
    if mismatches:
        print(f"FAILED: prompts {mismatches} differ from transformers' generate")
        return 1
    print(f"OK: {len(prompts)} prompts, every generated token equal to transformers' generate (greedy), "
          f"across a live rebalance")
    return 0


class _AutopilotWatch:
    """Polls the coordinator's status while the demo generates (every 0.1 s, on a thread): the autopilot's
    decisions and the operation in flight. The first rebalance the autopilot took fills ``into`` (generation,
    seconds from decision to publish, reason, gain, the rank rows seen just before it was published)."""

    def __init__(self, rt: Any, into: dict[str, Any]) -> None:
        self.rt, self.into = rt, into
        self.decisions: list[dict[str, Any]] = []
        self.eplb: dict[str, Any] | None = None
        self.in_flight: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-moe-demo-autopilot", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import ray

        rows = dict(self.rt.stats()["rank_rows"])
        while not self._stop.is_set():
            try:
                st = ray.get(self.rt.coordinator.status.remote(), timeout=30)
                self.eplb = st["eplb"]
                self.decisions = st["eplb"]["decisions"]
                self.in_flight = st.get("operation", {}).get("in_flight")
            except Exception:  # noqa: BLE001 - the demo reports what it saw
                pass
            taken = [d for d in self.decisions if d["taken"]]
            if taken and "generation" not in self.into:
                d = taken[0]
                self.into.update(generation=d["new_generation"], seconds=d["publish_s"] or 0.0, rows=rows,
                                 reason=d["reason"], gain=d["gain"], imbalance_now=d["imbalance_now"],
                                 imbalance_predicted=d["imbalance_predicted"],
                                 decided_by=f"the autopilot (reason {d['reason']}, predicted gain {d['gain']:.2f})")
            if "generation" not in self.into:
                rows = dict(self.rt.stats()["rank_rows"])
            self._stop.wait(0.1)

    def finish(self, grace_s: float) -> list[dict[str, Any]]:
        """Wait up to ``grace_s`` seconds for the autopilot's rebalance (unless its last decision was to hold and
        no operation runs), stop polling; its decisions, oldest first."""
        deadline = time.monotonic() + grace_s
        time.sleep(0.3)  # a tick after the last load report
        while "generation" not in self.into and time.monotonic() < deadline:
            last = self.decisions[-1] if self.decisions else None
            if last is not None and last["action"] == "hold" and self.in_flight is None:
                break
            time.sleep(0.1)
        self._stop.set()
        self._thread.join(timeout=30)
        return list(self.decisions)


def _rebalance(rt) -> dict[str, Any]:
    rows = dict(rt.stats()["rank_rows"])
    t0 = time.perf_counter()
    g = rt.rebalance()
    return {"generation": g, "seconds": time.perf_counter() - t0, "rows": rows}


def replicas_line(counts: list[int]) -> str:
    """The demo's line of the placement after the rebalance: ``counts[e]`` replicas of expert e (first MoE layer)."""
    return (f"replicas per expert (MoE layer 0) after: {list(counts)} "
            f"({sum(counts)} slots for {len(counts)} experts)")


PLOT_TITLE = "ray-moe demo: per-rank share of routed rows\n(each window normalised to 100%: they span different steps)"


def _plot(path: str, before: list[int], after: list[int], num_ranks: int) -> list[list[float]]:
    """The PNG of both windows' per-rank load as shares (``load_shares``); returns the plotted bars
    ([before, after], % per rank)."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    x = np.arange(num_ranks)
    bars = [load_shares(before), load_shares(after)]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.bar(x - 0.2, bars[0], 0.4, label=f"before rebalance: {sum(before)} rows (Gamma {_gamma(before):.2f})")
    ax.bar(x + 0.2, bars[1], 0.4, label=f"after EPLB: {sum(after)} rows (Gamma {_gamma(after):.2f})")
    ax.axhline(100.0 / max(1, num_ranks), color="grey", linewidth=0.8, linestyle="--", label="even share")
    ax.set_xticks(x)
    ax.set_xlabel("expert-parallel rank")
    ax.set_ylabel("share of the window's routed rows (%)")
    ax.set_title(PLOT_TITLE, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return bars


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--layers", type=int, default=3, help="decoder layers (the first is dense)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--slots-per-rank", type=int, default=6)
    p.add_argument("--skew", type=float, default=1.5, help="Zipf exponent of the routers' correction bias")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exchange", default="object_store", choices=["object_store", "gloo"],
                   help="CPU exchange between shard actors (the Ray object store, or torch.distributed gloo)")
    p.add_argument("--json", default="reports/demo.json")
    p.add_argument("--png", default="reports/demo-rank-load.png")
    p.add_argument("--quiet", action="store_true")
