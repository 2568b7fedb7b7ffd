"""Export a ``TelemetrySnapshot`` through ``ray.util.metrics`` (spec 0x0DB).

The only module of ray-moe that touches ``ray.util.metrics``, and only lazily (inside
``PrometheusExporter.__init__``), so importing it never imports Ray. Ray's metrics agent on every node
serves the recorded values on the node's metrics export port; Ray prefixes each name with ``ray_``
(``moe_route_drop_ratio`` is scraped as ``ray_moe_route_drop_ratio``).

Mapping (``export_points`` is the pure half, testable without Ray):

==========================  =====================================================  =========
snapshot series             exported metrics                                        type
==========================  =====================================================  =========
ratio ``m``                 ``m`` (value), ``m_numerator``, ``m_denominator``       gauges
counter ``m_total``         ``m_total``                                             counter
step-latency samples ``m``  ``m_p50``, ``m_p95``, ``m_max``, ``m_count``            gauges
==========================  =====================================================  =========

A ratio with denominator 0 exports its numerator and denominator (both 0) but no value gauge: absent,
never a silent 0. A ratio with a partition label (``reason`` of ``moe_fallback_step_ratio``: each step is
counted under exactly one reason) exports, per reason, that reason's numerator over the pooled denominator
(every step of its release and phase), so ``{reason="oversize"}`` reads 6/147 rather than 6/6; the rate
over all reasons is ``sum by (release, phase)`` of the numerators over any one reason's denominator.
Numerator and denominator gauges carry cumulative counts, so ``rate(num) / rate(den)`` gives a windowed
ratio in PromQL. Counters are cumulative in the snapshot; the exporter increments each Ray counter by the
growth since its previous export (Ray counters only take positive increments, so a counter that is still 0
appears after its first increment).

The coordinator's autopilot (automatic rebalance) has its own metrics (``AUTOPILOT_METRICS``, recorded by
``AutopilotExporter`` in the coordinator's process): ``moe_eplb_imbalance_ratio`` (gauge, current / predicted),
``moe_eplb_decisions_total``, ``moe_eplb_rebalances_total`` and ``moe_eplb_rebalance_failures_total`` (by
reason), ``moe_eplb_migrated_bytes_total`` and ``moe_eplb_time_to_publish_seconds``; each counter grows by
what one decision did.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from ray_moe.core.telemetry.metrics import METRIC_SPECS, MetricType, TelemetrySnapshot

if TYPE_CHECKING:
    from ray_moe.control.autopilot import AutopilotEvent

RAY_METRIC_PREFIX = "ray_"


class PointKind(str, Enum):
    GAUGE = "gauge"
    COUNTER = "counter"


@dataclass(frozen=True)
class ExportPoint:
    """One value to record: metric name (before Ray's prefix), kind, tags, cumulative value."""

    name: str
    kind: PointKind
    tags: tuple[tuple[str, str], ...]
    value: float

    @property
    def scraped_name(self) -> str:
        return RAY_METRIC_PREFIX + self.name


@dataclass(frozen=True)
class ExportedMetric:
    """One Ray metric object to create: name, kind, tag keys, help text."""

    name: str
    kind: PointKind
    tag_keys: tuple[str, ...]
    description: str


def exported_metrics() -> tuple[ExportedMetric, ...]:
    """Every metric the exporter creates, derived from the 0x0DB specs."""
    out: list[ExportedMetric] = []
    for spec in METRIC_SPECS.values():
        keys = spec.label_names
        name = spec.name.value
        if spec.type is MetricType.RATIO:
            out.append(ExportedMetric(name, PointKind.GAUGE, keys, f"{spec.description} (absent when denominator is 0)"))
            out.append(ExportedMetric(f"{name}_numerator", PointKind.GAUGE, keys, f"cumulative {spec.numerator}"))
            out.append(ExportedMetric(f"{name}_denominator", PointKind.GAUGE, keys, f"cumulative {spec.denominator}"))
        elif spec.type is MetricType.COUNTER:
            out.append(ExportedMetric(name, PointKind.COUNTER, keys, spec.description))
        else:
            for suffix in ("p50", "p95", "max"):
                out.append(ExportedMetric(f"{name}_{suffix}", PointKind.GAUGE, keys,
                                          f"nearest-rank {suffix} of {spec.description} ({spec.unit})"))
            out.append(ExportedMetric(f"{name}_count", PointKind.GAUGE, keys, f"observations of {spec.description}"))
    return tuple(out)


def export_points(snapshot: TelemetrySnapshot) -> tuple[ExportPoint, ...]:
    """The values a snapshot maps to (pure).

    1. Ratios: numerator and denominator gauges always; the value gauge only when denominator > 0. A ratio
       with a partition label exports the pooled denominator (and value) of its series' pool.
    2. Counters: one cumulative counter point.
    3. Samples: p50/p95/max of the retained window and the total observed count.
    """
    if not isinstance(snapshot, TelemetrySnapshot):
        raise ValueError(f"snapshot={type(snapshot).__name__} is not a TelemetrySnapshot")
    pts: list[ExportPoint] = []
    pooled: dict[tuple, int] = {}
    for r in snapshot.ratios:
        spec = METRIC_SPECS[r.metric]
        if spec.partition is not None:
            key = (r.metric, spec.pool_key(r.labels))
            pooled[key] = pooled.get(key, 0) + r.denominator
    for r in snapshot.ratios:
        spec = METRIC_SPECS[r.metric]
        tags = tuple((k, r.labels[k]) for k in spec.label_names)
        name = r.metric.value
        den = r.denominator if spec.partition is None else pooled[(r.metric, spec.pool_key(r.labels))]
        if den:
            pts.append(ExportPoint(name, PointKind.GAUGE, tags, r.numerator / den))
        pts.append(ExportPoint(f"{name}_numerator", PointKind.GAUGE, tags, float(r.numerator)))
        pts.append(ExportPoint(f"{name}_denominator", PointKind.GAUGE, tags, float(den)))
    for c in snapshot.counters:
        tags = tuple((k, c.labels[k]) for k in METRIC_SPECS[c.metric].label_names)
        pts.append(ExportPoint(c.metric.value, PointKind.COUNTER, tags, float(c.value)))
    for s in snapshot.samples:
        tags = tuple((k, s.labels[k]) for k in METRIC_SPECS[s.metric].label_names)
        q = s.summary()
        name = s.metric.value
        if q is not None:
            pts.append(ExportPoint(f"{name}_p50", PointKind.GAUGE, tags, q.p50))
            pts.append(ExportPoint(f"{name}_p95", PointKind.GAUGE, tags, q.p95))
            pts.append(ExportPoint(f"{name}_max", PointKind.GAUGE, tags, q.max))
        pts.append(ExportPoint(f"{name}_count", PointKind.GAUGE, tags, float(s.observed)))
    return tuple(pts)


class PrometheusExporter:
    """Holds the Ray metric objects of this process and records snapshots into them.

    Create one per process (the driver, each actor) and keep it: Ray metric objects are process-local
    and registering a name twice in one process is wasteful. ``metrics_module`` defaults to
    ``ray.util.metrics`` (imported here, lazily); tests may pass a stand-in with ``Gauge``/``Counter``.
    """

    def __init__(self, metrics_module: Any = None):
        if metrics_module is None:
            from ray.util import metrics as metrics_module  # lazy: only this module touches Ray metrics
        self._lock = threading.Lock()
        self._metrics: dict[str, Any] = {}
        self._kinds: dict[str, PointKind] = {}
        for m in exported_metrics():
            if m.kind is PointKind.GAUGE:
                obj = metrics_module.Gauge(m.name, description=m.description, tag_keys=m.tag_keys)
            else:
                # Ray appends "_total" to counters; pass the stem so the scraped name is ray_<name>.
                stem = m.name[: -len("_total")] if m.name.endswith("_total") else m.name
                obj = metrics_module.Counter(stem, description=m.description, tag_keys=m.tag_keys)
            self._metrics[m.name] = obj
            self._kinds[m.name] = m.kind
        self._counter_last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(self._metrics)

    def export(self, snapshot: TelemetrySnapshot) -> tuple[ExportPoint, ...]:
        """Record every point of ``snapshot``; return the points.

        1. Gauges: set to the snapshot value.
        2. Counters: increment by the growth since this exporter last saw the series; a smaller value
           (a restarted source) becomes the new baseline without an increment.
        """
        points = export_points(snapshot)
        with self._lock:
            for p in points:
                obj = self._metrics[p.name]
                tags = dict(p.tags)
                if p.kind is PointKind.GAUGE:
                    obj.set(p.value, tags=tags)
                    continue
                key = (p.name, p.tags)
                delta = p.value - self._counter_last.get(key, 0.0)
                self._counter_last[key] = p.value
                if delta > 0:
                    obj.inc(delta, tags=tags)
        return points


# ---------------------------------------------------------------- automatic rebalance (the coordinator's autopilot)
AUTOPILOT_METRICS: tuple[ExportedMetric, ...] = (
    ExportedMetric("moe_eplb_imbalance_ratio", PointKind.GAUGE, ("deployment", "estimate"),
                   "routed rows of the busiest rank over the mean (sum over layers), at the last decision; "
                   "estimate=current: the active placement, predicted: after the EPLB solve"),
    ExportedMetric("moe_eplb_decisions_total", PointKind.COUNTER, ("deployment", "action", "reason"),
                   "autopilot decisions (rebalance or hold) by reason"),
    ExportedMetric("moe_eplb_rebalances_total", PointKind.COUNTER, ("deployment", "reason"),
                   "rebalances the autopilot published, by reason (gain, periodic)"),
    ExportedMetric("moe_eplb_rebalance_failures_total", PointKind.COUNTER, ("deployment", "reason"),
                   "rebalances the autopilot decided that failed (the prior generation kept serving)"),
    ExportedMetric("moe_eplb_migrated_bytes_total", PointKind.COUNTER, ("deployment",),
                   "expert bytes measured crossing between shards in autopilot rebalances"),
    ExportedMetric("moe_eplb_time_to_publish_seconds", PointKind.GAUGE, ("deployment",),
                   "last autopilot rebalance: seconds from the decision to the published generation"),
)


def autopilot_points(deployment: str, event: AutopilotEvent) -> tuple[ExportPoint, ...]:
    """The values one recorded autopilot decision maps to (pure). Counter points carry the increment this
    event adds (what happened), not a cumulative value.

    1. Imbalance gauges: current (and predicted, when the decision solved) overall imbalance.
    2. One decision, by action and reason.
    3. A taken rebalance: one rebalance by reason, its measured bytes, its time to publish; a failed one: one
       failure by reason.
    """
    from ray_moe.control.autopilot import AutopilotEvent

    if not isinstance(event, AutopilotEvent):
        raise ValueError(f"event={type(event).__name__} is not an AutopilotEvent")
    d = event.decision
    dep = (("deployment", deployment),)
    pts: list[ExportPoint] = []
    # 1.
    if d.imbalance_now is not None:
        pts.append(ExportPoint("moe_eplb_imbalance_ratio", PointKind.GAUGE, dep + (("estimate", "current"),),
                               float(d.imbalance_now)))
    if d.imbalance_predicted is not None:
        pts.append(ExportPoint("moe_eplb_imbalance_ratio", PointKind.GAUGE, dep + (("estimate", "predicted"),),
                               float(d.imbalance_predicted)))
    # 2.
    pts.append(ExportPoint("moe_eplb_decisions_total", PointKind.COUNTER,
                           dep + (("action", d.action.value), ("reason", d.reason.value)), 1.0))
    # 3.
    if event.taken:
        pts.append(ExportPoint("moe_eplb_rebalances_total", PointKind.COUNTER, dep + (("reason", d.reason.value),), 1.0))
        if event.copied_bytes:
            pts.append(ExportPoint("moe_eplb_migrated_bytes_total", PointKind.COUNTER, dep, float(event.copied_bytes)))
        if event.publish_s is not None:
            pts.append(ExportPoint("moe_eplb_time_to_publish_seconds", PointKind.GAUGE, dep, float(event.publish_s)))
    elif event.error is not None:
        pts.append(ExportPoint("moe_eplb_rebalance_failures_total", PointKind.COUNTER,
                               dep + (("reason", d.reason.value),), 1.0))
    return tuple(pts)


class AutopilotExporter:
    """The autopilot's Ray metric objects in the coordinator's process (``metrics_module`` as for
    ``PrometheusExporter``). ``record`` sets the gauges and increments the counters by what one event did."""

    def __init__(self, metrics_module: Any = None):
        if metrics_module is None:
            from ray.util import metrics as metrics_module  # lazy, as PrometheusExporter
        self._lock = threading.Lock()
        self._metrics: dict[str, Any] = {}
        for m in AUTOPILOT_METRICS:
            if m.kind is PointKind.GAUGE:
                self._metrics[m.name] = metrics_module.Gauge(m.name, description=m.description, tag_keys=m.tag_keys)
            else:  # Ray appends "_total" itself
                self._metrics[m.name] = metrics_module.Counter(m.name.removesuffix("_total"), description=m.description,
                                                               tag_keys=m.tag_keys)

    def record(self, deployment: str, event: AutopilotEvent) -> tuple[ExportPoint, ...]:
        points = autopilot_points(deployment, event)
        with self._lock:
            for p in points:
                obj = self._metrics[p.name]
                if p.kind is PointKind.GAUGE:
                    obj.set(p.value, tags=dict(p.tags))
                elif p.value > 0:
                    obj.inc(p.value, tags=dict(p.tags))
        return points


def scraped_names() -> tuple[str, ...]:
    """Names as they appear in a Prometheus scrape of Ray's metrics endpoint."""
    return tuple(RAY_METRIC_PREFIX + m.name for m in exported_metrics())


__all__ = [
    "AUTOPILOT_METRICS",
    "AutopilotExporter",
    "ExportPoint",
    "ExportedMetric",
    "PointKind",
    "PrometheusExporter",
    "autopilot_points",
    "export_points",
    "exported_metrics",
    "scraped_names",
]
