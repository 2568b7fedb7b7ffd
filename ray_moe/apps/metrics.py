"""``GET /metrics`` of ``ray-moe serve``: Prometheus text exposition (``prometheus_client``) on the API port.

One ``CollectorRegistry`` per Serve replica (``ServerMetrics.registry``; never the process-global one), holding:

=============================================================  =========  ==========================================
series                                                         type       from
=============================================================  =========  ==========================================
``ray_moe_server_requests_total{endpoint, status}``            counter    every HTTP answer but ``/metrics`` (the
                                                                          route template: ``/v1/models/{id}``,
                                                                          unknown paths as ``other``)
``ray_moe_server_prompt_tokens_total``                         counter    prompt tokens of the generation requests,
``ray_moe_server_generation_tokens_total``                                generated tokens, as ``usage`` counts them
``ray_moe_server_time_to_first_token_seconds``                 histogram  per choice: from the request's arrival to
                                                                          its first token
``ray_moe_server_time_per_output_token_seconds``               histogram  per choice of 2+ tokens: (last token -
                                                                          first token) / (tokens - 1)
``ray_moe_server_requests_running`` / ``_waiting``             gauge      the generation loop's scheduler (one
                                                                          sequence per choice)
``ray_moe_server_kv_cache_blocks_used{rank}`` / ``_total``,    gauge      KV blocks the running sequences reserve
``ray_moe_server_kv_cache_usage_ratio``                                   (prompt + max_tokens), over every rank
``ray_moe_server_prefix_cache_hit_tokens_total`` /            counter    prompt tokens served from cached KV blocks
``ray_moe_server_prefix_cache_lookup_tokens_total``                       / every prefill token (committed steps)
``ray_moe_server_prefix_cache_hit_ratio``                      gauge      hit tokens / lookup tokens (0 before any)
``ray_moe_server_oom_steps_total``                             counter    steps that ran out of device memory
``ray_moe_server_preemptions_total``                           counter    sequences such a step gave back
``ray_moe_*`` (``ray.prometheus.exported_metrics``)            as there   the deployment's telemetry, read when
                                                                          scraped (``TelemetryCollector``)
``ray_moe_server_telemetry_up``                                gauge      1: that read succeeded
=============================================================  =========  ==========================================

The ``ray_moe_*`` telemetry series are the ones Ray's metrics agent serves (same names, types, labels and help,
``export_points`` of ``ray/prometheus.py``), read from the deployment's merged snapshot at every scrape: they
carry cumulative values, so they stay when the server idles. ``/metrics`` needs no API key (as vLLM serves it):
it names no request content.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ray_moe.core.telemetry.metrics import TelemetrySnapshot
from ray_moe.ray.prometheus import PointKind, export_points, exported_metrics

PREFIX = "ray_moe_server_"
# vLLM's buckets (seconds): TTFT from 1 ms to 43 min, TPOT from 10 ms to 80 s
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
PREFIX_CACHE_HELP = ("prefix cache hit rate: prompt tokens served from cached KV blocks over every prefill token "
                     "(prefix_cache_hit_tokens_total / prefix_cache_lookup_tokens_total; 0 before any prefill)")


class ApiRoute(str, Enum):
    """The ``endpoint`` label of ``ray_moe_server_requests_total`` (bounded: unknown paths are ``other``)."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    MODELS = "/v1/models"
    MODEL = "/v1/models/{id}"
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"
    HEALTH = "/health"
    METRICS = "/metrics"
    OTHER = "other"

    @classmethod
    def of(cls, path: str) -> "ApiRoute":
        """The route of a request path (``/v1/models/x`` -> ``MODEL``; a trailing slash is dropped)."""
        p = path.rstrip("/") or "/"
        if p.startswith("/v1/models/"):
            return cls.MODEL
        for r in cls:
            if r.value == p:
                return r
        return cls.OTHER


@dataclass(frozen=True)
class EngineState:
    """What the generation loop's scheduler holds at one instant (read-only): sequences running and waiting,
    KV blocks reserved and held per rank, the out-of-memory steps and the sequences they preempted, and the
    prompt tokens served from cached KV blocks over every prefill token (prefix caching's counters)."""

    running: int
    waiting: int
    blocks_used: dict[int, int]
    blocks_total: dict[int, int]
    oom_steps: int
    preempted: int
    prefix_hit_tokens: int = 0
    prefix_lookup_tokens: int = 0

    @classmethod
    def read(cls, engine: Any) -> "EngineState":
        """From a ``GenerationLoop``. ``list(seqs.values())`` copies the live sequences atomically (one C call
        under the GIL), so the loop thread is never blocked; a sequence's reservation is
        ``blocks(prompt + max_new_tokens)``, as the scheduler books it at admission."""
        from ray_moe.driver.scheduler import SeqState

        sched = engine.scheduler
        ranks = list(sched.ranks)
        seqs = list(sched.seqs.values())
        used = {r: 0 for r in ranks}
        running = waiting = 0
        for s in seqs:
            if s.state is SeqState.RUNNING:
                running += 1
                if s.rank in used:
                    used[s.rank] += sched.blocks(s.reserve_tokens)
            elif s.state is SeqState.WAITING:
                waiting += 1
        # every out-of-memory step halves the budgets once (``memory_backoff``): ``backoffs`` counts them all,
        # ``memory_events`` keeps the last 64 only
        oom = max(int(getattr(sched, "backoffs", 0)), len(getattr(engine, "memory_events", ())))
        return cls(running, waiting, used, {r: int(sched.kv_blocks) for r in ranks}, oom, int(sched.preempted),
                   int(getattr(engine, "prefix_hit_tokens", 0)), int(getattr(engine, "prefix_lookup_tokens", 0)))


class EngineCollector:
    """The generation loop's gauges and counters, read from ``engine()`` at every scrape (None: not started)."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine

    def describe(self) -> list[Metric]:
        return []  # nothing read at registration

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        st = None if engine is None else EngineState.read(engine)
        running = GaugeMetricFamily(PREFIX + "requests_running",
                                    "sequences generating now (one per choice: a request with n=2 counts 2)")
        waiting = GaugeMetricFamily(PREFIX + "requests_waiting",
                                    "sequences queued for KV blocks or a running slot (one per choice)")
        used = GaugeMetricFamily(PREFIX + "kv_cache_blocks_used", "KV cache blocks the running sequences reserve "
                                 "(prompt + max_tokens, at admission), per rank", labels=["rank"])
        total = GaugeMetricFamily(PREFIX + "kv_cache_blocks_total", "KV cache blocks per rank", labels=["rank"])
        ratio = GaugeMetricFamily(PREFIX + "kv_cache_usage_ratio",
                                  "KV cache blocks reserved over all blocks, every rank (0..1)")
        prefix = GaugeMetricFamily(PREFIX + "prefix_cache_hit_ratio", PREFIX_CACHE_HELP)
        hits = CounterMetricFamily(PREFIX + "prefix_cache_hit_tokens", "prompt tokens served from cached KV "
                                   "blocks (prefix caching: computed once, shared within a rank)")
        looked = CounterMetricFamily(PREFIX + "prefix_cache_lookup_tokens", "prefill tokens of the generation "
                                     "steps, each looked up in the prefix cache (0 with prefix caching off)")
        oom = CounterMetricFamily(PREFIX + "oom_steps", "generation steps that ran out of device memory "
                                  "(contained: their sequences preempted, the step budgets halved)")
        pre = CounterMetricFamily(PREFIX + "preemptions",
                                  "sequences given back to the queue by out-of-memory steps (recomputed)")
        if st is not None:
            hits.add_metric([], st.prefix_hit_tokens)
            looked.add_metric([], st.prefix_lookup_tokens)
            prefix.add_metric([], st.prefix_hit_tokens / st.prefix_lookup_tokens if st.prefix_lookup_tokens else 0.0)
            running.add_metric([], st.running)
            waiting.add_metric([], st.waiting)
            for r in st.blocks_total:
                used.add_metric([str(r)], st.blocks_used[r])
                total.add_metric([str(r)], st.blocks_total[r])
            all_blocks = sum(st.blocks_total.values())
            ratio.add_metric([], sum(st.blocks_used.values()) / all_blocks if all_blocks else 0.0)
            oom.add_metric([], st.oom_steps)
            pre.add_metric([], st.preempted)
        yield from (running, waiting, used, total, ratio, prefix, hits, looked, oom, pre)


class TelemetryCollector:
    """The deployment's ``ray_moe_*`` telemetry series, as Ray's metrics agent serves them, from ``read()`` at
    every scrape (a ``TelemetrySnapshot``, its JSON dict, or None before any step). Every exported metric is
    described even without values; a failed read gives ``ray_moe_server_telemetry_up 0`` and no values."""

    def __init__(self, read: Callable[[], TelemetrySnapshot | dict | None]) -> None:
        self._read = read

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(PREFIX + "telemetry_up", "1: the deployment's telemetry was read for this scrape")
        families: dict[str, Metric] = {}
        for m in exported_metrics():
            cls = CounterMetricFamily if m.kind is PointKind.COUNTER else GaugeMetricFamily
            families[m.name] = cls("ray_" + m.name, m.description, labels=list(m.tag_keys))
        try:
            snap = self._read()
            if isinstance(snap, dict):
                snap = TelemetrySnapshot.model_validate(snap)
            points = () if snap is None else export_points(snap)
        except Exception:  # noqa: BLE001 - a scrape never fails: the series are absent, telemetry_up says why
            up.add_metric([], 0.0)
            yield up
            yield from families.values()
            return
        up.add_metric([], 1.0)
        for p in points:
            fam = families[p.name]
            fam.add_metric([v for _, v in p.tags], p.value)
        yield up
        yield from families.values()


class RequestTimer:
    """Token times of one HTTP request's choices: TTFT (from ``arrived``, ``time.perf_counter`` seconds) and
    TPOT, observed into ``metrics`` as the tokens arrive and the choices end."""

    def __init__(self, metrics: "ServerMetrics", arrived: float) -> None:
        self.metrics, self.arrived = metrics, arrived
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._ended: set[int] = set()

    def token(self, index: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if index not in self._first:
            self._first[index] = now
            self.metrics.ttft.observe(max(0.0, now - self.arrived))
        self._last[index] = now
        self._count[index] = self._count.get(index, 0) + 1

    def ended(self, index: int) -> None:
        """Choice ``index`` finished: its time per output token, when it has two tokens or more."""
        if index in self._ended:
            return
        self._ended.add(index)
        n = self._count.get(index, 0)
        if n >= 2:
            self.metrics.tpot.observe(max(0.0, self._last[index] - self._first[index]) / (n - 1))


class ServerMetrics:
    """The server's own registry and instruments. ``engine``: the generation loop (None before it started);
    ``telemetry``: the deployment's telemetry snapshot (``Runtime.telemetry_snapshot``)."""

    def __init__(self, engine: Callable[[], Any], telemetry: Callable[[], TelemetrySnapshot | dict | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(PREFIX + "requests", "HTTP requests answered, by endpoint (route template) and "
                                "status code (/metrics itself not counted)", ["endpoint", "status"],
                                registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of generation requests (as usage "
                                     "counts them: each prompt once, whatever n)", registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "generated tokens, every choice (as usage "
                                         "counts them)", registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "per choice: seconds from the request's "
                              "arrival to its first generated token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "per choice of two tokens or more: seconds "
                              "from its first to its last token over tokens - 1", buckets=TPOT_BUCKETS,
                              registry=self.registry)
        self.registry.register(EngineCollector(engine))
        self.registry.register(TelemetryCollector(telemetry))

    def answered(self, path: str, status: int) -> None:
        route = ApiRoute.of(path)
        if route is not ApiRoute.METRICS:
            self.requests.labels(endpoint=route.value, status=str(int(status))).inc()

    def timer(self, arrived: float) -> RequestTimer:
        return RequestTimer(self, arrived)

    def tokens(self, prompt: int, generated: int) -> None:
        """One generation request's usage (``prompt`` and ``generated`` tokens)."""
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generated:
            self.generation_tokens.inc(generated)


class CountRequests:
    """ASGI middleware: every HTTP answer counted by ``ServerMetrics.answered`` when its response ends (a streamed
    one when its stream ends; an exception as 500). ``metrics()``: the replica's ``ServerMetrics`` (None: not
    counted). Pure ASGI, so a streamed response and its client's disconnect pass through untouched."""

    def __init__(self, app: Any, metrics: Callable[[], "ServerMetrics | None"]) -> None:
        self.app, self._metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message: dict) -> None:
            if message.get("type") == "http.response.start":
                status[0] = int(message.get("status", 500))
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            m = self._metrics()
            if m is not None:
                m.answered(scope.get("path", ""), status[0])


__all__ = [
    "ApiRoute",
    "CountRequests",
    "EngineCollector",
    "EngineState",
    "PREFIX_CACHE_HELP",
    "RequestTimer",
    "ServerMetrics",
    "TelemetryCollector",
]
