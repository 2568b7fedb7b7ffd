"""The driver's books: step counters with their denominators and the load window it feeds EPLB.

``StepBooks`` is pure (no Ray): the runtime hands it every served step's per-rank results and ships what it
returns (a due load flush) to the coordinator. Ratios carry numerators and denominators (spec 0x0D);
telemetry labels are bounded (0x0DB).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from ray_moe.core.telemetry.metrics import MetricName, Telemetry
from ray_moe.core.telemetry.quantiles import EvidenceClass, summarize
from ray_moe.core.types import Phase
from ray_moe.shard.records import StepKind

if TYPE_CHECKING:
    from ray_moe.shard.records import StepResult


@dataclass
class RuntimeStats:
    """Counters and ratios with their denominators (spec 0x0D), kept by the driver.

    attempted_routes: every route a caller handed in (T x k per layer), counted before validation;
    accepted_routes: routes the shards accepted and served; dropped_routes: attempted routes that were not
    served (the call raised: refused input, or a step that failed for good). The data paths never drop an
    accepted route (admission refusals rerun eagerly), so dropped = attempted - accepted.
    prefix_hit_tokens / prefix_lookup_tokens: prompt tokens generation steps served from cached KV blocks, and
    every prefill token of those steps (with prefix caching on; ``shard/prefix.py``).
    expert_layer_steps / experts_touched / expert_routes / expert_peak_routes: over every (step, MoE layer) with
    routes, summed over the ranks: how many, the logical experts given at least one route, the routes, and the
    busiest expert's routes (a multi-step decode request's sub-steps count as one step: their routes together).
    """

    steps: int = 0
    tokens: int = 0
    attempted_routes: int = 0
    accepted_routes: int = 0
    dropped_routes: int = 0
    remote_routes: int = 0
    inter_node_routes: int = 0
    stale_retries: int = 0
    failed_steps: int = 0
    rank_rows: dict[int, int] = field(default_factory=dict)
    step_ms: deque = field(default_factory=lambda: deque(maxlen=4096))  # last steps only: a server runs for days
    phase_steps: dict[str, int] = field(default_factory=dict)
    last_step: dict = field(default_factory=dict)  # wall/shard times and per-layer paths of the last step
    bucket_layers: int = 0  # decode (step, layer) units served by the fixed-capacity bucket path
    graph_replays: int = 0  # of those, units replayed from a captured CUDA graph
    fallbacks: dict[str, int] = field(default_factory=dict)  # decode units that took the variable path, by reason
    prefix_hit_tokens: int = 0
    prefix_lookup_tokens: int = 0
    num_experts: int = 0
    expert_layer_steps: int = 0
    experts_touched: int = 0
    expert_routes: int = 0
    expert_peak_routes: int = 0

    def ratios(self) -> dict[str, dict[str, float | int | None]]:
        def r(n: int, d: int) -> dict[str, float | int | None]:
            return {"numerator": n, "denominator": d, "value": (n / d) if d else None}

        return {
            "drop": r(self.dropped_routes, self.attempted_routes),
            "remote": r(self.remote_routes, self.accepted_routes),
            "inter_node": r(self.inter_node_routes, self.accepted_routes),
            # route classes of spec 0x07C: same GPU + same node (remote GPU) + different node = 1
            "same_gpu": r(self.accepted_routes - self.remote_routes, self.accepted_routes),
            "same_node_remote_gpu": r(self.remote_routes - self.inter_node_routes, self.accepted_routes),
            "different_node": r(self.inter_node_routes, self.accepted_routes),
            "prefix_cache_hit": r(self.prefix_hit_tokens, self.prefix_lookup_tokens),
            # of the experts a (step, layer) could route to, those it did
            "experts_touched": r(self.experts_touched, self.expert_layer_steps * self.num_experts),
        }

    def expert_use(self) -> dict[str, Any]:
        """How a step's routes spread over the experts (degenerate routing touches few of them): per (step, MoE
        layer) the mean experts touched of ``experts``, and the busiest expert's routes over the mean expert's."""
        n, routes = self.expert_layer_steps, self.expert_routes
        return expert_use(n, self.num_experts, self.experts_touched, routes, self.expert_peak_routes)

    def as_dict(self) -> dict[str, Any]:
        lat = summarize(self.step_ms, unit="ms", evidence=EvidenceClass.MEASURED) if self.step_ms else None
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "attempted_routes": self.attempted_routes,
            "accepted_routes": self.accepted_routes,
            "dropped_routes": self.dropped_routes,
            "ratios": self.ratios(),
            "stale_retries": self.stale_retries,
            "failed_steps": self.failed_steps,
            "rank_rows": dict(sorted(self.rank_rows.items())),
            "phase_steps": dict(self.phase_steps),
            "bucket_layers": self.bucket_layers,
            "graph_replays": self.graph_replays,
            "last_step": dict(self.last_step),
            "fallbacks": dict(self.fallbacks),
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_lookup_tokens": self.prefix_lookup_tokens,
            "expert_use": self.expert_use(),
            "step_ms": None if lat is None else {"p50": lat.p50, "p95": lat.p95, "max": lat.max, "n": lat.n},
        }


def expert_use(layer_steps: int, experts: int, touched: int, routes: int, peak_routes: int) -> dict[str, Any]:
    """The expert-use record (``RuntimeStats.expert_use``) of these sums; a difference of two records' sums (a
    benchmark pass) gives the pass's own."""
    return {"layer_steps": layer_steps, "experts": experts, "touched": touched, "routes": routes,
            "peak_routes": peak_routes, "touched_per_layer_step": touched / layer_steps if layer_steps else None,
            "peak_over_mean": peak_routes * experts / routes if routes else None}


@dataclass(frozen=True)
class LoadFlush:
    """Router load counts due for the coordinator's window: counts [L, E] int64 of ``generation``'s steps."""

    counts: np.ndarray
    phase: Phase
    generation: int


class StepBooks:
    """Counters, the pending load window and telemetry of one driver (thread-safe)."""

    def __init__(self, num_layers: int, num_experts: int, telemetry: Telemetry, release_id: str,
                 flush_every: int = 4) -> None:
        self.stats = RuntimeStats(num_experts=int(num_experts))
        self.telemetry = telemetry
        self.release_id = release_id
        self.flush_every = flush_every
        self._load = np.zeros((num_layers, num_experts), dtype=np.int64)
        self._load_steps = 0
        self._lock = threading.Lock()

    def attempted(self, phase: Phase, attempted: int, served: bool) -> None:
        """A forward call handed in ``attempted`` routes; none were served when ``served`` is False."""
        dropped = 0 if served else attempted
        with self._lock:
            self.stats.attempted_routes += attempted
            self.stats.dropped_routes += dropped
        self.telemetry.add_ratio(MetricName.ROUTE_DROP_RATIO, {"release": self.release_id, "phase": phase.value},
                                 dropped, attempted)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def record(self, results: Mapping[int, "StepResult"], ranks: Sequence[int], phase: Phase, tokens: int, ms: float,
               *, topology_version: str) -> LoadFlush | None:
        """Book one served step: counters, per-rank rows, decode paths, the load window and telemetry.
        Returns the load counts when ``flush_every`` steps have accumulated (the caller ships them)."""
        flush = None
        acc = rem = inter = 0  # this step's routes, over every rank and layer
        with self._lock:
            s = self.stats
            s.steps += 1
            s.tokens += tokens
            s.step_ms.append(ms)
            s.phase_steps[phase.value] = s.phase_steps.get(phase.value, 0) + 1
            gen = None
            step = np.zeros_like(self._load)  # [L, E] this step's routes per logical expert, every rank
            first = results[ranks[0]]
            s.last_step = {"wall_ms": ms, "phase": phase.value,
                           "shard_elapsed_ms": {r: results[r].elapsed_s * 1e3 for r in ranks},
                           "paths": [ls.path for ls in first.layers],
                           "fallback_reasons": [ls.fallback_reason for ls in first.layers if ls.fallback_reason]}
            if phase is Phase.DECODE:
                for ls in first.layers:  # every rank took the same path (admission is agreed)
                    if ls.path.startswith("bucket"):
                        s.bucket_layers += 1
                        s.graph_replays += ls.path == "bucket-graph"
                    else:
                        why = ls.fallback_reason or "bucket_disabled"
                        s.fallbacks[why] = s.fallbacks.get(why, 0) + 1
            for r in ranks:
                res = results[r]
                gen = res.generation
                if res.kind is StepKind.GENERATION:  # (an expert-only step prefills nothing)
                    s.prefix_hit_tokens += sum(res.output.cached_tokens.values())
                    s.prefix_lookup_tokens += res.output.prefix_lookup_tokens
                for ls in res.layers:
                    acc, rem, inter = acc + ls.accepted, rem + ls.remote, inter + ls.inter_node
                    step[ls.layer] += ls.expert_counts
                    for u, c in enumerate(ls.rank_routes.tolist()):
                        if c:
                            s.rank_rows[u] = s.rank_rows.get(u, 0) + int(c)
            s.accepted_routes += acc
            s.remote_routes += rem
            s.inter_node_routes += inter
            self._load += step
            self._expert_use(step)
            self._load_steps += 1
            if self._load_steps >= self.flush_every and gen is not None:
                flush = LoadFlush(self._load.copy(), phase, gen)
                self._load[:] = 0
                self._load_steps = 0
        base = {"release": self.release_id, "phase": phase.value}
        tel = self.telemetry
        tel.add_ratio(MetricName.REMOTE_ROUTE_RATIO, base, rem, acc)
        tel.add_ratio(MetricName.INTER_NODE_ROUTE_RATIO, {**base, "topology": topology_version}, inter, acc)
        tel.observe_step_latency(base, ms / 1e3)
        if phase is Phase.DECODE:
            units = first.layers
            replay = sum(1 for ls in units if ls.path == "bucket-graph")
            tel.add_ratio(MetricName.GRAPH_REPLAY_RATIO, {**base, "graph": "decode-bucket"}, replay, len(units))
            reasons = [ls.fallback_reason or "bucket_disabled" for ls in units if not ls.path.startswith("bucket")]
            tel.add_ratio(MetricName.FALLBACK_STEP_RATIO, {**base, "reason": reasons[0] if reasons else "none"},
                          1 if reasons else 0, 1)
        return flush

    def _expert_use(self, step: np.ndarray) -> None:
        """The step's routes per logical expert ([layers, E], summed over the ranks) into the expert-use counters
        (locked)."""
        routed = step[step.sum(axis=1) > 0]  # the layers with routes
        s = self.stats
        s.expert_layer_steps += int(routed.shape[0])
        s.experts_touched += int(np.count_nonzero(routed))
        s.expert_routes += int(routed.sum())
        s.expert_peak_routes += int(routed.max(axis=1).sum()) if routed.size else 0

    def take_load(self, generation: int | None) -> LoadFlush | None:
        """Whatever load is pending, now (before a rebalance reads the window)."""
        with self._lock:
            if not self._load_steps or generation is None:
                return None
            out = LoadFlush(self._load.copy(), Phase.PREFILL, generation)
            self._load[:] = 0
            self._load_steps = 0
            return out

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self.stats.as_dict()


__all__ = ["LoadFlush", "RuntimeStats", "StepBooks", "expert_use"]
