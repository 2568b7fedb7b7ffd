"""Elasticity on autopilot (CPU): time to full strength after a killed shard, and automatic rebalances under a shifting skew.

    python -m ray_moe_bench.elastic                   # CPU, local Ray: both parts (about 1.5 minutes)
    python -m ray_moe_bench.elastic --quick           # CPU smoke (< 60 s): shorter phases
    python -m ray_moe_bench.elastic --out bench/results

Both parts run a tiny synthetic deployment (tagged seeded experts, d=16, f=32, top-2) on a local Ray instance
and stream ``Runtime.forward`` steps from a driver thread the whole time; every output is checked against the
reference MoE of the same weights (a step served by the wrong expert counts as an error).

(a) heal: 3 ranks, E=6, slots_per_rank=3, ``heal_retries=2``. After ``--warm-s`` of traffic rank 2 is killed
    (``ray.kill``); the coordinator's healer starts a replacement (``ray_moe.control.healing``, ``ray_moe.ray.reconciler``). Reported (MEASURED, wall clock):
    seconds from the kill to full strength (the group has 3 live ranks again and the new rank hosts slots), the
    healer's own seconds (from the loss being handled to the replacement serving), steps/s before the kill
    (over ``--warm-s`` after the first 5 steps, which a fresh deployment serves slowly),
    between the kill and full strength, and after it; requests lost (forward calls that raised), routes
    dropped (the driver's books: attempted - served), wrong outputs. All three must be 0.
(b) skew: 4 ranks, E=8, slots_per_rank=3, the autopilot in ``auto`` mode (threshold 0.2, 0.5 s / 2 load steps
    minimum interval, 3-step window minimum). One hot expert is in every token; it changes every
    ``--shift-s`` seconds (``--phases`` phases: experts 4, 6, 1, ...). Reported: every rebalance the
    autopilot took (its reason, the imbalance it saw and the one it predicted, bytes, publish seconds), its
    holds by reason, and per phase the MEASURED routed-row imbalance (max / mean rows per rank, from the
    driver's books) over the first ``--probe-s`` seconds of the phase (before the autopilot could act) and
    over its last ``--probe-s`` seconds.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from typing import Any, Callable, Sequence

import ray
import torch

from ray_moe_bench import summary
from ray_moe_bench.common import add_output_argument, write_result

HEAL = dict(num_ranks=3, num_experts=6, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=3, seed=5,
            tagged_weights=True, exchange_timeout_s=20.0, heal_retries=2, name="bench-elastic-heal")
SKEW = dict(num_ranks=4, num_experts=8, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=3, seed=11,
            tagged_weights=True, exchange_timeout_s=20.0, load_window=6, name="bench-elastic-skew")
HOT_SEQUENCE = (4, 6, 1, 7, 2)


class Traffic:
    """A driver thread streaming ``rt.forward`` steps of ``tokens`` tokens; ``routes(step)`` gives the [T, 2]
    expert ids of a step. Every output is compared with the reference MoE (max abs deviation > 1e-4: wrong).
    ``done``: wall time (monotonic) each served step ended."""

    def __init__(self, rt: Any, routes: Callable[[int], torch.Tensor], tokens: int) -> None:
        from ray_moe.model.source import weight_source
        from ray_moe_dev.testing.reference import reference_moe

        self.rt, self.routes, self.tokens = rt, routes, tokens
        self._src, self._ref = weight_source(rt.cfg), reference_moe
        self.done: list[float] = []
        self.errors: list[str] = []
        self.wrong = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-traffic", daemon=True)

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def warm(self, steps: int = 5, timeout_s: float = 60.0) -> None:
        """Wait until ``steps`` steps were served (the first steps of a fresh deployment are slow)."""
        deadline = time.monotonic() + timeout_s
        while len(self.done) < steps and time.monotonic() < deadline and not self.errors:
            time.sleep(0.02)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            g = torch.Generator().manual_seed(1000 + i)
            h = torch.randn(self.tokens, self.rt.cfg.hidden_size, generator=g)
            ids = self.routes(i)
            w = torch.rand(self.tokens, 2, generator=g)
            try:
                y = self.rt.forward(h, ids, w)
            except BaseException as exc:  # noqa: BLE001 - a lost request: counted
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                i += 1
                continue
            ref = self._ref(h.double(), ids, w, lambda e: self._src.expert(0, e))
            self.wrong += float((y.double() - ref).abs().max()) > 1e-4
            self.done.append(time.monotonic())
            i += 1

    def rate(self, a: float, b: float) -> float | None:
        """Steps per second served in [a, b) (monotonic seconds)."""
        if b <= a:
            return None
        return round(sum(a <= t < b for t in self.done) / (b - a), 2)


def _uniform_routes(num_experts: int, tokens: int) -> Callable[[int], torch.Tensor]:
    def routes(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(7 + i)
        return torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(tokens)])

    return routes


def run_heal(warm_s: float, after_s: float, timeout_s: float = 120.0) -> dict[str, Any]:
    import ray_moe

    rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**HEAL), timeout_s=300)
    try:
        with Traffic(rt, _uniform_routes(HEAL["num_experts"], 12), 12) as tr:
            tr.warm()
            time.sleep(warm_s)
            t_kill = time.monotonic()
            ray.kill(rt.shards[2])
            full = None
            while time.monotonic() - t_kill < timeout_s and not tr.errors:
                healed = [e for e in rt.heal_events() if "replacement" in e]
                if healed and len(rt.group.peer_order) == HEAL["num_ranks"] \
                        and rt.placement().rank_slots(healed[0]["replacement"]):
                    full = time.monotonic()
                    break
                time.sleep(0.05)
            end_full = full if full is not None else time.monotonic()
            time.sleep(after_s)
            t_end = time.monotonic()
        stats = rt.stats()
        events = [dict(e) for e in rt.heal_events()]
        healed = [e for e in events if "replacement" in e]
        return {
            "config": {k: v for k, v in HEAL.items() if k != "name"},
            "killed_rank": 2,
            "replacement_rank": healed[0]["replacement"] if healed else None,
            "full_strength": full is not None,
            "seconds_to_full_strength": None if full is None else round(full - t_kill, 3),
            "healer_seconds": healed[0]["seconds"] if healed else None,
            "heal_attempts": healed[0]["attempts"] if healed else None,
            "steps_per_s": {"before": tr.rate(t_kill - warm_s, t_kill), "during": tr.rate(t_kill, end_full),
                            "after": tr.rate(end_full, t_end)},
            "steps_served": len(tr.done),
            "requests_lost": len(tr.errors),
            "routes_dropped": int(stats["dropped_routes"]),
            "wrong_outputs": tr.wrong,
            "errors": tr.errors[:5],
            "healer_events": events,
            "live_ranks_after": list(rt.group.peer_order),
        }
    finally:
        rt.shutdown()


def _rows(rt: Any) -> dict[int, int]:
    return {int(r): int(c) for r, c in rt.stats()["rank_rows"].items()}


def _imbalance(a: dict[int, int], b: dict[int, int], ranks: Sequence[int]) -> float | None:
    d = [b.get(r, 0) - a.get(r, 0) for r in ranks]
    mean = sum(d) / len(d)
    return None if mean <= 0 else round(max(d) / mean, 3)


def run_skew(phases: int, shift_s: float, probe_s: float, tick_s: float = 0.1) -> dict[str, Any]:
    import ray_moe
    from ray_moe.control.autopilot import AutopilotPolicy, EplbMode

    policy = AutopilotPolicy(mode=EplbMode.AUTO, threshold_gain=0.2, min_interval_s=0.5, min_interval_steps=2,
                             min_window_steps=3, tick_s=tick_s)
    rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**SKEW, eplb=policy), timeout_s=300)
    hot = {"e": HOT_SEQUENCE[0]}
    others = lambda e: [x for x in range(SKEW["num_experts"]) if x != e]  # noqa: E731

    def routes(i: int) -> torch.Tensor:
        e = hot["e"]
        return torch.tensor([(e, o) for o in others(e)] * 2, dtype=torch.int64)

    ranks = list(range(SKEW["num_ranks"]))
    per_phase = []
    try:
        with Traffic(rt, routes, 2 * (SKEW["num_experts"] - 1)) as tr:
            tr.warm()
            for p in range(phases):
                hot["e"] = HOT_SEQUENCE[p % len(HOT_SEQUENCE)]
                t0, g0, r0 = time.monotonic(), rt.placement().generation, _rows(rt)
                time.sleep(probe_s)
                r1 = _rows(rt)
                time.sleep(max(0.0, shift_s - 2 * probe_s))
                r2 = _rows(rt)
                time.sleep(probe_s)
                r3 = _rows(rt)
                per_phase.append({"phase": p, "hot_expert": hot["e"], "generation_at_start": g0,
                                  "generation_at_end": rt.placement().generation,
                                  "imbalance_first": _imbalance(r0, r1, ranks),
                                  "imbalance_last": _imbalance(r2, r3, ranks),
                                  "steps_per_s": tr.rate(t0, time.monotonic())})
        decisions = ray.get(rt.coordinator.autopilot_history.remote())  # every decision kept (holds folded)
        stats = rt.stats()
    finally:
        rt.shutdown()
    taken = [d for d in decisions if d.get("taken")]
    holds = collections.Counter()
    for d in decisions:
        if d["action"] == "hold":
            holds[d["reason"]] += 1 + int(d.get("repeats") or 0)
    return {
        "config": {k: v for k, v in SKEW.items() if k != "name"},
        "policy": policy.model_dump(mode="json"),
        "shift_s": shift_s, "probe_s": probe_s,
        "rebalances_taken": len(taken),
        "rebalances": [{k: d.get(k) for k in ("reason", "time", "step", "generation", "new_generation",
                                                "imbalance_now", "imbalance_predicted", "gain", "bytes",
                                                "copied_bytes", "publish_s")} for d in taken],
        "holds_by_reason": dict(holds),
        "phases": per_phase,
        "steps_served": len(tr.done), "requests_lost": len(tr.errors),
        "routes_dropped": int(stats["dropped_routes"]), "wrong_outputs": tr.wrong, "errors": tr.errors[:5],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--quick", action="store_true", help="CPU smoke preset (< 60 s)")
    ap.add_argument("--warm-s", type=float, default=None, help="(a) traffic before the kill (default 4, quick 2)")
    ap.add_argument("--after-s", type=float, default=None, help="(a) traffic after full strength (default 4, quick 2)")
    ap.add_argument("--phases", type=int, default=None, help="(b) skew phases (default 4, quick 2)")
    ap.add_argument("--shift-s", type=float, default=None, help="(b) seconds per phase (default 10, quick 6)")
    ap.add_argument("--probe-s", type=float, default=None, help="(b) imbalance probe at each end of a phase")
    ap.add_argument("--skip", choices=("heal", "skew"), default=None, help="leave one part out")
    add_output_argument(ap)
    args = ap.parse_args(argv)
    q = args.quick
    warm = args.warm_s if args.warm_s is not None else (2.0 if q else 4.0)
    after = args.after_s if args.after_s is not None else (2.0 if q else 4.0)
    phases = args.phases if args.phases is not None else (2 if q else 4)
    shift = args.shift_s if args.shift_s is not None else (6.0 if q else 10.0)
    probe = args.probe_s if args.probe_s is not None else (1.0 if q else 1.5)
    if min(warm, after, shift, probe) <= 0 or phases < 1 or shift < 2 * probe:
        raise SystemExit(f"--warm-s/--after-s/--shift-s/--probe-s > 0, --phases >= 1 and --shift-s >= 2 x --probe-s "
                         f"(got {warm}, {after}, {shift}, {probe}, {phases})")
    owns = not ray.is_initialized()
    if owns:
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="ray-moe-bench")
    try:
        payload: dict[str, Any] = {"quick": q, "device": "cpu", "dtype": "float32",
                                   "versions": {"ray": ray.__version__, "torch": torch.__version__}}
        if args.skip != "heal":
            payload["heal"] = run_heal(warm, after)
            h = payload["heal"]
            print(f"heal: full strength in {h['seconds_to_full_strength']} s (healer {h['healer_seconds']} s); "
                  f"steps/s {h['steps_per_s']}; lost {h['requests_lost']}, dropped {h['routes_dropped']}, "
                  f"wrong {h['wrong_outputs']}", flush=True)
        if args.skip != "skew":
            payload["skew"] = run_skew(phases, shift, probe)
            s = payload["skew"]
            print(f"skew: {s['rebalances_taken']} rebalances; phases "
                  f"{[(p['hot_expert'], p['imbalance_first'], p['imbalance_last']) for p in s['phases']]}", flush=True)
    finally:
        if owns:
            ray.shutdown()
    path = write_result("elastic", payload, out=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
