"""Telemetry registry with bounded labels (spec 0x0D, 0x0DA, 0x0DB). Pure: no Ray.

Each process (the driver, every shard actor) owns one ``Telemetry``. It keeps, per metric and per
label set ("series"):

* ratio metrics: the numerator and the denominator as two cumulative integer counts (never a value);
* counters: one cumulative integer;
* step-latency samples: the most recent ``max_samples_per_series`` measured observations and the total
  count observed (so a truncated window is visible, 0x0DA).

``snapshot()`` returns a frozen ``TelemetrySnapshot``. Snapshots are cumulative since the process
started, so the driver merges the *latest* snapshot of each process with ``merge_snapshots``; merging
adds numerators to numerators and denominators to denominators, and refuses two snapshots of one
source (that would double count).

Labels are bounded (0x0DB): each metric has a fixed label-key set; request ids, token ids and prompt
text are rejected as unbounded keys, and each metric has a cap on distinct label sets.

A ratio may have a *partition label* (``reason`` of ``moe_fallback_step_ratio``): every unit of its
denominator (a decode step) is counted in exactly one series, the one of its reason (``none`` when the step
did not fall back). Stored counts therefore add across the partition label, and the ratio's real
denominator is the pool over it: ``ratio()`` pools, ``breakdown()`` gives each reason's numerator over
that pooled denominator, and the status table and the Prometheus export show exactly that (6 fallback
steps of 147 decode steps read ``6/147``, never ``6/6`` beside ``0/141``).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_moe.core.telemetry.quantiles import EvidenceClass, QuantileSummary, summarize
from ray_moe.core.telemetry.ratios import CELL_PHASES, RATIO_DEFINITIONS, Ratio, RatioKind, WorkloadCell


class MetricName(str, Enum):
    """Metric names of 0x0DB (the value is the exported name, before Ray's ``ray_`` prefix)."""

    ROUTE_DROP_RATIO = "moe_route_drop_ratio"
    REMOTE_ROUTE_RATIO = "moe_remote_route_ratio"
    INTER_NODE_ROUTE_RATIO = "moe_inter_node_route_ratio"
    GRAPH_REPLAY_RATIO = "moe_graph_replay_ratio"
    FALLBACK_STEP_RATIO = "moe_fallback_step_ratio"
    ROUTE_OUTPUT_MISMATCH_TOTAL = "moe_route_output_mismatch_total"
    STALE_HANDLE_ACCEPT_TOTAL = "moe_stale_handle_accept_total"
    COUNT_CONSERVATION_FAILURE_TOTAL = "moe_count_conservation_failure_total"
    STEP_LATENCY_SECONDS = "moe_step_latency_seconds"


class MetricType(str, Enum):
    RATIO = "ratio"
    COUNTER = "counter"
    SAMPLES = "samples"


class LabelKey(str, Enum):
    """The bounded label keys of 0x0DB."""

    RELEASE = "release"
    PHASE = "phase"
    TOPOLOGY = "topology"
    GRAPH = "graph"
    REASON = "reason"
    PLACEMENT_GENERATION = "placement_generation"
    PROCESS_GROUP_GENERATION = "process_group_generation"


UNBOUNDED_LABEL_KEYS: frozenset[str] = frozenset(
    {"request_id", "request", "token_id", "token", "prompt", "prompt_text", "text", "trace_id",
     "session_id", "user", "user_id", "sequence_id", "seq_id"}
)
"""Keys that name per-request or per-token values: never labels (0x0DB)."""

MAX_LABEL_VALUE_CHARS = 128


@dataclass(frozen=True)
class MetricSpec:
    """One metric of 0x0DB: its type, its fixed label keys and what its counts mean."""

    name: MetricName
    type: MetricType
    labels: tuple[LabelKey, ...]
    description: str
    numerator: str = ""
    denominator: str = ""
    unit: str = ""
    partition: LabelKey | None = None  # a label that splits the denominator's units (see the module doc)

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(k.value for k in self.labels)

    def pool_key(self, labels: Mapping[str, str]) -> tuple[str, ...]:
        """The label values that share one denominator: every label but the partition label."""
        part = self.partition.value if self.partition is not None else None
        return tuple(labels[k] for k in self.label_names if k != part)


_R, _P = LabelKey.RELEASE, LabelKey.PHASE


def _ratio_spec(name: MetricName, labels: tuple[LabelKey, ...], partition: LabelKey | None = None) -> MetricSpec:
    d = RATIO_DEFINITIONS[RatioKind(name.value)]
    return MetricSpec(
        name, MetricType.RATIO, labels, f"{d.numerator_label} / {d.denominator_label}",
        numerator=d.numerator_label, denominator=d.denominator_label, partition=partition,
    )


METRIC_SPECS: Mapping[MetricName, MetricSpec] = MappingProxyType(
    {
        MetricName.ROUTE_DROP_RATIO: _ratio_spec(MetricName.ROUTE_DROP_RATIO, (_R, _P)),
        MetricName.REMOTE_ROUTE_RATIO: _ratio_spec(MetricName.REMOTE_ROUTE_RATIO, (_R, _P)),
        MetricName.INTER_NODE_ROUTE_RATIO: _ratio_spec(
            MetricName.INTER_NODE_ROUTE_RATIO, (_R, _P, LabelKey.TOPOLOGY)
        ),
        MetricName.GRAPH_REPLAY_RATIO: _ratio_spec(MetricName.GRAPH_REPLAY_RATIO, (_R, _P, LabelKey.GRAPH)),
        # each step lands in the series of its fallback reason ("none": no fallback): the denominator is the pool
        MetricName.FALLBACK_STEP_RATIO: _ratio_spec(MetricName.FALLBACK_STEP_RATIO, (_R, _P, LabelKey.REASON),
                                                    partition=LabelKey.REASON),
        MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL: MetricSpec(
            MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, MetricType.COUNTER, (_R, _P),
            "route outputs that differ from the reference (mismatches)",
        ),
        MetricName.STALE_HANDLE_ACCEPT_TOTAL: MetricSpec(
            MetricName.STALE_HANDLE_ACCEPT_TOTAL, MetricType.COUNTER, (_R, LabelKey.PLACEMENT_GENERATION),
            "stale dispatch handles that were accepted (must stay 0)",
        ),
        MetricName.COUNT_CONSERVATION_FAILURE_TOTAL: MetricSpec(
            MetricName.COUNT_CONSERVATION_FAILURE_TOTAL, MetricType.COUNTER,
            (_R, LabelKey.PROCESS_GROUP_GENERATION),
            "count-conservation failures (sum of counts != accepted routes)",
        ),
        MetricName.STEP_LATENCY_SECONDS: MetricSpec(
            MetricName.STEP_LATENCY_SECONDS, MetricType.SAMPLES, (_R, _P),
            "measured wall time of one MoE step", unit="seconds",
        ),
    }
)

RATIO_METRIC_OF: Mapping[RatioKind, MetricName] = MappingProxyType({k: MetricName(k.value) for k in RatioKind})

LabelValues = tuple[str, ...]


def _metric(metric: MetricName | str, expected: MetricType) -> MetricSpec:
    try:
        name = MetricName(metric)
    except ValueError:
        raise ValueError(f"metric={metric!r} is not a known metric ({[m.value for m in MetricName]})") from None
    spec = METRIC_SPECS[name]
    if spec.type is not expected:
        raise ValueError(f"metric={name.value!r} is a {spec.type.value} metric, not a {expected.value} metric")
    return spec


def check_labels(spec: MetricSpec, labels: Mapping[str, str]) -> LabelValues:
    """Validate one label set against a metric's fixed keys; return its values in key order.

    1. Reject unbounded keys (request/token ids, prompt text) by name.
    2. Reject keys outside the metric's set and missing keys.
    3. Require each value to be a short non-empty single-line string; ``phase`` must be a cell phase.
    """
    if not isinstance(labels, Mapping):
        raise ValueError(f"labels={labels!r} must be a mapping of label key to value")
    keys = {k.value if isinstance(k, LabelKey) else k for k in labels}
    for k in sorted(keys):
        if k in UNBOUNDED_LABEL_KEYS:
            raise ValueError(f"labels[{k!r}]: unbounded label key on {spec.name.value} (0x0DB forbids it)")
        if k not in spec.label_names:
            raise ValueError(
                f"labels[{k!r}]: not a label of {spec.name.value} (its labels are {list(spec.label_names)})"
            )
    missing = [k for k in spec.label_names if k not in keys]
    if missing:
        raise ValueError(f"labels: {spec.name.value} needs label(s) {missing}, got {sorted(keys)}")
    flat = {(k.value if isinstance(k, LabelKey) else k): v for k, v in labels.items()}
    values: list[str] = []
    for k in spec.label_names:
        v = flat[k]
        v = v.value if isinstance(v, Enum) else v
        if not isinstance(v, str) or not v or len(v) > MAX_LABEL_VALUE_CHARS or "\n" in v:
            raise ValueError(
                f"labels[{k!r}]={v!r} must be a non-empty single-line string of at most "
                f"{MAX_LABEL_VALUE_CHARS} characters"
            )
        if k == LabelKey.PHASE.value and v not in CELL_PHASES:
            raise ValueError(f"labels['phase']={v!r} is not one of {sorted(CELL_PHASES)}")
        values.append(v)
    return tuple(values)


# ---------------------------------------------------------------------------------------------- snapshot
class _Series(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: MetricName
    labels: dict[str, str]

    @model_validator(mode="after")
    def _labels_ok(self) -> "_Series":
        check_labels(METRIC_SPECS[self.metric], self.labels)
        return self

    def key(self) -> tuple[MetricName, LabelValues]:
        spec = METRIC_SPECS[self.metric]
        return self.metric, tuple(self.labels[k] for k in spec.label_names)

    def matches(self, selector: Mapping[str, str]) -> bool:
        return all(self.labels.get(k) == v for k, v in selector.items())

    def label_text(self) -> str:
        spec = METRIC_SPECS[self.metric]
        return ",".join(f"{k}={self.labels[k]}" for k in spec.label_names)


class RatioSeries(_Series):
    """Cumulative numerator and denominator of one ratio series; ``value`` is None when den = 0."""

    numerator: int = Field(ge=0)
    denominator: int = Field(ge=0)

    @model_validator(mode="after")
    def _proportion(self) -> "RatioSeries":
        if METRIC_SPECS[self.metric].type is not MetricType.RATIO:
            raise ValueError(f"metric={self.metric.value!r} is not a ratio metric")
        if self.numerator > self.denominator:
            raise ValueError(
                f"{self.metric.value}{{{self.label_text()}}}.numerator={self.numerator} exceeds "
                f"denominator={self.denominator}"
            )
        return self

    def ratio(self) -> Ratio:
        return Ratio(self.metric.value, self.numerator, self.denominator)

    @property
    def value(self) -> float | None:
        return self.ratio().value


class CounterSeries(_Series):
    value: int = Field(ge=0)

    @model_validator(mode="after")
    def _counter(self) -> "CounterSeries":
        if METRIC_SPECS[self.metric].type is not MetricType.COUNTER:
            raise ValueError(f"metric={self.metric.value!r} is not a counter metric")
        return self


class SampleSeries(_Series):
    """The retained window of measured samples and the total number ever observed in this series."""

    samples: tuple[float, ...]
    observed: int = Field(ge=0)

    @model_validator(mode="after")
    def _window(self) -> "SampleSeries":
        if METRIC_SPECS[self.metric].type is not MetricType.SAMPLES:
            raise ValueError(f"metric={self.metric.value!r} is not a samples metric")
        if len(self.samples) > self.observed:
            raise ValueError(f"observed={self.observed} is less than the {len(self.samples)} retained samples")
        return self

    @property
    def truncated(self) -> bool:
        return len(self.samples) < self.observed

    def summary(self) -> QuantileSummary | None:
        if not self.samples:
            return None
        return summarize(self.samples, unit=METRIC_SPECS[self.metric].unit, evidence=EvidenceClass.MEASURED)


class TelemetrySnapshot(BaseModel):
    """Cumulative telemetry of one or more processes (``sources``), frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sources: tuple[str, ...] = Field(min_length=1)
    ratios: tuple[RatioSeries, ...] = ()
    counters: tuple[CounterSeries, ...] = ()
    samples: tuple[SampleSeries, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> "TelemetrySnapshot":
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"sources={list(self.sources)} repeats a source")
        for s in self.sources:
            if not isinstance(s, str) or not s:
                raise ValueError(f"sources: {s!r} must be a non-empty string")
        for group in (self.ratios, self.counters, self.samples):
            keys = [s.key() for s in group]
            if len(set(keys)) != len(keys):
                dup = next(k for k in keys if keys.count(k) > 1)
                raise ValueError(f"series {dup[0].value}{list(dup[1])} appears twice")
        return self

    def ratio(self, metric: MetricName | str, **selector: str) -> Ratio:
        """Pool every series of ``metric`` whose labels match ``selector`` (numerators and denominators add)."""
        spec = _metric(metric, MetricType.RATIO)
        _check_selector(spec, selector)
        num = den = 0
        for s in self.ratios:
            if s.metric is spec.name and s.matches(selector):
                num += s.numerator
                den += s.denominator
        return Ratio(spec.name.value, num, den)

    def counter(self, metric: MetricName | str, **selector: str) -> int:
        spec = _metric(metric, MetricType.COUNTER)
        _check_selector(spec, selector)
        return sum(s.value for s in self.counters if s.metric is spec.name and s.matches(selector))

    def latency(self, **selector: str) -> QuantileSummary | None:
        """Nearest-rank summary over the retained step-latency samples matching ``selector``."""
        spec = METRIC_SPECS[MetricName.STEP_LATENCY_SECONDS]
        _check_selector(spec, selector)
        xs = [x for s in self.samples if s.matches(selector) for x in s.samples]
        return summarize(xs, unit=spec.unit, evidence=EvidenceClass.MEASURED) if xs else None

    def breakdown(self, metric: MetricName | str, **selector: str) -> dict[str, Ratio]:
        """Per value of the metric's partition label (``reason``): its numerator over the pooled denominator of
        every matching series (all steps, whatever their reason), so the values add up to ``ratio()``."""
        spec = _metric(metric, MetricType.RATIO)
        if spec.partition is None:
            raise ValueError(f"metric={spec.name.value!r} has no partition label to break down by")
        _check_selector(spec, selector)
        part = spec.partition.value
        nums: dict[str, int] = {}
        den = 0
        for s in self.ratios:
            if s.metric is spec.name and s.matches(selector):
                nums[s.labels[part]] = nums.get(s.labels[part], 0) + s.numerator
                den += s.denominator
        return {k: Ratio(spec.name.value, n, den) for k, n in sorted(nums.items())}

    def render_table(self) -> str:
        """Plain-text table for ``ray-moe status``: every ratio shows numerator/denominator; no data is n/a.

        A ratio with a partition label (the fallback reason) shows one row per pool (all steps of a release
        and phase) and then one row per reason that occurred, its numerator over the same pooled denominator.
        """
        rows: list[tuple[str, str, str, str, str]] = [("metric", "labels", "numerator", "denominator", "value")]

        def ratio_row(metric: MetricName, labels: str, num: int, den: int) -> tuple[str, str, str, str, str]:
            v = Ratio(metric.value, num, den).value
            return metric.value, labels, str(num), str(den), "n/a" if v is None else f"{v:.6f}"

        for metric in sorted({r.metric for r in self.ratios}, key=lambda m: m.value):
            spec = METRIC_SPECS[metric]
            series = sorted((r for r in self.ratios if r.metric is metric), key=lambda r: r.key()[1])
            if spec.partition is None:
                rows.extend(ratio_row(metric, r.label_text(), r.numerator, r.denominator) for r in series)
                continue
            part = spec.partition.value
            pools: dict[tuple[str, ...], list[RatioSeries]] = {}
            for r in series:
                pools.setdefault(spec.pool_key(r.labels), []).append(r)
            for _, members in sorted(pools.items()):
                den = sum(m.denominator for m in members)
                pool_labels = ",".join(f"{k}={members[0].labels[k]}" for k in spec.label_names if k != part)
                rows.append(ratio_row(metric, pool_labels, sum(m.numerator for m in members), den))
                rows.extend(ratio_row(metric, m.label_text(), m.numerator, den) for m in members if m.numerator)
        for c in sorted(self.counters, key=lambda s: (s.metric.value, s.key()[1])):
            rows.append((c.metric.value, c.label_text(), "-", "-", str(c.value)))
        for s in sorted(self.samples, key=lambda s: (s.metric.value, s.key()[1])):
            q = s.summary()
            text = "n/a" if q is None else f"n={q.n} p50={q.p50:.6g} p95={q.p95:.6g} max={q.max:.6g} {q.unit}"
            if s.truncated:
                text += f" (last {len(s.samples)} of {s.observed})"
            rows.append((s.metric.value, s.label_text(), "-", "-", text))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        head = f"sources: {', '.join(self.sources)}"
        return "\n".join([head, *lines])


def _check_selector(spec: MetricSpec, selector: Mapping[str, str]) -> None:
    for k in selector:
        if k not in spec.label_names:
            raise ValueError(f"selector[{k!r}]: not a label of {spec.name.value} ({list(spec.label_names)})")


def merge_snapshots(snapshots: Iterable[TelemetrySnapshot]) -> TelemetrySnapshot:
    """Merge the latest snapshot of several processes.

    1. Refuse a source that appears in two snapshots (cumulative counts would be counted twice).
    2. Per (metric, labels): add numerators, add denominators, add counters.
    3. Samples: concatenate windows in source order; add the observed totals.
    """
    snaps = list(snapshots)
    if not snaps:
        raise ValueError("snapshots=[] is empty: nothing to merge")
    sources: list[str] = []
    for i, s in enumerate(snaps):
        if not isinstance(s, TelemetrySnapshot):
            raise ValueError(f"snapshots[{i}]={type(s).__name__} is not a TelemetrySnapshot")
        for src in s.sources:
            if src in sources:
                raise ValueError(f"snapshots[{i}].sources repeats source {src!r}: merge each process once")
            sources.append(src)
    ratios: dict[tuple, list[int]] = {}
    counters: dict[tuple, int] = {}
    samples: dict[tuple, tuple[list[float], int]] = {}
    labels_of: dict[tuple, dict[str, str]] = {}
    for s in snaps:
        for r in s.ratios:
            k = r.key()
            labels_of[k] = r.labels
            acc = ratios.setdefault(k, [0, 0])
            acc[0] += r.numerator
            acc[1] += r.denominator
        for c in s.counters:
            k = c.key()
            labels_of[k] = c.labels
            counters[k] = counters.get(k, 0) + c.value
        for x in s.samples:
            k = x.key()
            labels_of[k] = x.labels
            xs, n = samples.get(k, ([], 0))
            samples[k] = (xs + list(x.samples), n + x.observed)
    return TelemetrySnapshot(
        sources=tuple(sources),
        ratios=tuple(RatioSeries(metric=k[0], labels=dict(labels_of[k]), numerator=v[0], denominator=v[1])
                     for k, v in ratios.items()),
        counters=tuple(CounterSeries(metric=k[0], labels=dict(labels_of[k]), value=v) for k, v in counters.items()),
        samples=tuple(SampleSeries(metric=k[0], labels=dict(labels_of[k]), samples=tuple(v[0]), observed=v[1])
                      for k, v in samples.items()),
    )


# ---------------------------------------------------------------------------------------------- registry
class Telemetry:
    """Thread-safe per-process registry of ratio counts, counters and step-latency samples.

    ``source`` names the process in snapshots (``"driver"``, ``"shard-r2"``). ``max_series_per_metric``
    caps the distinct label sets of each metric: a new label set beyond the cap raises ``ValueError``
    (an unbounded label value, e.g. a per-request release name, shows up here).
    """

    def __init__(self, source: str, *, max_series_per_metric: int = 256, max_samples_per_series: int = 4096):
        if not isinstance(source, str) or not source:
            raise ValueError(f"source={source!r} must be a non-empty string")
        if isinstance(max_series_per_metric, bool) or not isinstance(max_series_per_metric, int) \
                or max_series_per_metric < 1:
            raise ValueError(f"max_series_per_metric={max_series_per_metric!r} must be an int >= 1")
        if isinstance(max_samples_per_series, bool) or not isinstance(max_samples_per_series, int) \
                or max_samples_per_series < 1:
            raise ValueError(f"max_samples_per_series={max_samples_per_series!r} must be an int >= 1")
        self._source = source
        self._max_series = max_series_per_metric
        self._max_samples = max_samples_per_series
        self._lock = threading.Lock()
        self._ratios: dict[MetricName, dict[LabelValues, list[int]]] = {}
        self._counters: dict[MetricName, dict[LabelValues, int]] = {}
        self._samples: dict[MetricName, dict[LabelValues, tuple[deque, list[int]]]] = {}

    @property
    def source(self) -> str:
        return self._source

    def _series_slot(self, table: dict, spec: MetricSpec, key: LabelValues, fresh):
        per_metric = table.setdefault(spec.name, {})
        if key not in per_metric:
            if len(per_metric) >= self._max_series:
                raise ValueError(
                    f"labels={dict(zip(spec.label_names, key))}: {spec.name.value} already has "
                    f"{len(per_metric)} label sets (max_series_per_metric={self._max_series})"
                )
            per_metric[key] = fresh()
        return per_metric[key]

    def add_ratio(self, metric: MetricName | str, labels: Mapping[str, str], numerator: int, denominator: int) -> None:
        """Add ``numerator`` and ``denominator`` counts to one ratio series (``0 <= numerator <= denominator``)."""
        spec = _metric(metric, MetricType.RATIO)
        Ratio(spec.name.value, numerator, denominator)  # validates the increment
        key = check_labels(spec, labels)
        with self._lock:
            acc = self._series_slot(self._ratios, spec, key, lambda: [0, 0])
            acc[0] += numerator
            acc[1] += denominator

    def inc(self, metric: MetricName | str, labels: Mapping[str, str], amount: int = 1) -> None:
        """Add ``amount >= 0`` to a counter series (a 0 increment registers the series at 0)."""
        spec = _metric(metric, MetricType.COUNTER)
        if isinstance(amount, bool) or not isinstance(amount, int) or amount < 0:
            raise ValueError(f"amount={amount!r} must be an int >= 0")
        key = check_labels(spec, labels)
        with self._lock:
            per_metric = self._counters.setdefault(spec.name, {})
            if key not in per_metric and len(per_metric) >= self._max_series:
                raise ValueError(
                    f"labels={dict(zip(spec.label_names, key))}: {spec.name.value} already has "
                    f"{len(per_metric)} label sets (max_series_per_metric={self._max_series})"
                )
            per_metric[key] = per_metric.get(key, 0) + amount

    def observe_step_latency(self, labels: Mapping[str, str], seconds: float) -> None:
        """Record one measured step time in seconds (a finite value >= 0)."""
        spec = METRIC_SPECS[MetricName.STEP_LATENCY_SECONDS]
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds < 0:
            raise ValueError(f"seconds={seconds!r} must be a finite number >= 0")
        key = check_labels(spec, labels)
        with self._lock:
            window, observed = self._series_slot(
                self._samples, spec, key, lambda: (deque(maxlen=self._max_samples), [0])
            )
            window.append(float(seconds))
            observed[0] += 1

    def record_cell(self, cell: WorkloadCell, *, topology: str, graph: str, reason: str) -> None:
        """Add one workload cell's counts to the five ratio metrics (labels from the cell plus the three given)."""
        if not isinstance(cell, WorkloadCell):
            raise ValueError(f"cell={cell!r} is not a WorkloadCell")
        base = {LabelKey.RELEASE.value: cell.release, LabelKey.PHASE.value: cell.phase}
        extra = {
            RatioKind.DROP: {},
            RatioKind.REMOTE: {},
            RatioKind.INTER_NODE: {LabelKey.TOPOLOGY.value: topology},
            RatioKind.GRAPH_REPLAY: {LabelKey.GRAPH.value: graph},
            RatioKind.FALLBACK: {LabelKey.REASON.value: reason},
        }
        staged = []
        for kind, d in RATIO_DEFINITIONS.items():
            spec = METRIC_SPECS[RATIO_METRIC_OF[kind]]
            staged.append((spec, check_labels(spec, {**base, **extra[kind]}), d.numerator(cell), d.denominator(cell)))
        with self._lock:
            for spec, key, _, _ in staged:  # check every cap before adding anything
                per_metric = self._ratios.get(spec.name, {})
                if key not in per_metric and len(per_metric) >= self._max_series:
                    raise ValueError(
                        f"labels={dict(zip(spec.label_names, key))}: {spec.name.value} already has "
                        f"{len(per_metric)} label sets (max_series_per_metric={self._max_series})"
                    )
            for spec, key, num, den in staged:
                acc = self._series_slot(self._ratios, spec, key, lambda: [0, 0])
                acc[0] += num
                acc[1] += den

    def snapshot(self) -> TelemetrySnapshot:
        """A frozen copy of every series, taken under the lock."""
        with self._lock:
            ratios = [(m, k, v[0], v[1]) for m, per in self._ratios.items() for k, v in per.items()]
            counters = [(m, k, v) for m, per in self._counters.items() for k, v in per.items()]
            samples = [(m, k, tuple(w), n[0]) for m, per in self._samples.items() for k, (w, n) in per.items()]

        def labels(m: MetricName, k: LabelValues) -> dict[str, str]:
            return dict(zip(METRIC_SPECS[m].label_names, k))

        return TelemetrySnapshot(
            sources=(self._source,),
            ratios=tuple(RatioSeries(metric=m, labels=labels(m, k), numerator=a, denominator=b)
                         for m, k, a, b in ratios),
            counters=tuple(CounterSeries(metric=m, labels=labels(m, k), value=v) for m, k, v in counters),
            samples=tuple(SampleSeries(metric=m, labels=labels(m, k), samples=w, observed=n)
                          for m, k, w, n in samples),
        )
