"""Prometheus export through ray.util.metrics: the pure value mapping, then one scrape under local Ray."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest

from ray_moe.core.telemetry.metrics import MetricName, Telemetry
from ray_moe.ray.prometheus import (
    PointKind,
    PrometheusExporter,
    export_points,
    exported_metrics,
    scraped_names,
)
from tests.core.telemetry.test_metrics import record_spec_cells
from tests.core.telemetry.test_ratios import REL


class FakeMetric:
    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys, self.calls = name, tag_keys, []

    def set(self, value, tags=None):
        assert set(tags) == set(self.tag_keys)
        self.calls.append(("set", value, dict(tags)))

    def inc(self, value=1.0, tags=None):
        assert value > 0 and set(tags) == set(self.tag_keys)
        self.calls.append(("inc", value, dict(tags)))


class FakeMetricsModule:
    def __init__(self):
        self.created: dict[str, FakeMetric] = {}

    def _make(self, kind):
        def make(name, description="", tag_keys=()):
            m = FakeMetric(name, description, tag_keys)
            self.created[name] = m
            m.kind = kind
            return m
        return make

    @property
    def Gauge(self):  # noqa: N802
        return self._make("gauge")

    @property
    def Counter(self):  # noqa: N802
        return self._make("counter")


def fixture_snapshot(source="driver"):
    t = Telemetry(source)
    record_spec_cells(t)
    t.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": REL, "phase": "decode"}, 2)
    t.observe_step_latency({"release": REL, "phase": "decode"}, 0.25)
    return t, t.snapshot()


def test_importing_the_exporter_does_not_import_ray():
    code = "import sys, ray_moe.ray.prometheus; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_exported_metric_set():
    names = {m.name: m for m in exported_metrics()}
    assert names["moe_route_drop_ratio"].kind is PointKind.GAUGE
    assert names["moe_route_drop_ratio_numerator"].tag_keys == ("release", "phase")
    assert names["moe_inter_node_route_ratio_denominator"].tag_keys == ("release", "phase", "topology")
    assert names["moe_stale_handle_accept_total"].kind is PointKind.COUNTER
    assert names["moe_step_latency_seconds_p95"].kind is PointKind.GAUGE
    assert len(names) == 5 * 3 + 3 + 4
    assert "ray_moe_fallback_step_ratio" in scraped_names()


def test_point_values_carry_numerators_and_denominators():
    _, snap = fixture_snapshot()
    pts = {(p.name, p.tags): p for p in export_points(snap)}
    decode = (("release", REL), ("phase", "decode"))
    assert pts[("moe_route_drop_ratio_numerator", decode)].value == 2.0
    assert pts[("moe_route_drop_ratio_denominator", decode)].value == 360.0
    assert pts[("moe_route_drop_ratio", decode)].value == pytest.approx(2 / 360)
    prefill_graph = (("release", REL), ("phase", "prefill"), ("graph", "eager"))
    # denominator 0: numerator/denominator exported, value gauge absent (never a silent 0)
    assert pts[("moe_graph_replay_ratio_denominator", prefill_graph)].value == 0.0
    assert ("moe_graph_replay_ratio", prefill_graph) not in pts
    assert pts[("moe_route_output_mismatch_total", decode)].kind is PointKind.COUNTER
    assert pts[("moe_route_output_mismatch_total", decode)].value == 2.0
    assert pts[("moe_step_latency_seconds_p50", decode)].value == 0.25
    assert pts[("moe_step_latency_seconds_count", decode)].value == 1.0
    assert pts[("moe_route_drop_ratio", decode)].scraped_name == "ray_moe_route_drop_ratio"


def test_exporter_sets_gauges_and_increments_counters_by_growth():
    fake = FakeMetricsModule()
    exp = PrometheusExporter(metrics_module=fake)
    # counters are registered by stem: Ray appends _total itself
    assert "moe_route_output_mismatch" in fake.created and fake.created["moe_route_output_mismatch"].kind == "counter"
    t, snap = fixture_snapshot()
    exp.export(snap)
    g = fake.created["moe_route_drop_ratio_denominator"]
    assert ("set", 360.0, {"release": REL, "phase": "decode"}) in g.calls
    c = fake.created["moe_route_output_mismatch"]
    assert c.calls == [("inc", 2.0, {"release": REL, "phase": "decode"})]
    exp.export(t.snapshot())  # unchanged: no increment
    assert len(c.calls) == 1
    t.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": REL, "phase": "decode"}, 3)
    exp.export(t.snapshot())
    assert c.calls[-1] == ("inc", 3.0, {"release": REL, "phase": "decode"})
    # a restarted source (smaller cumulative value) resets the baseline without a negative increment
    _, fresh = fixture_snapshot()
    exp.export(fresh)
    assert len(c.calls) == 2


def test_exporter_rejects_non_snapshots():
    exp = PrometheusExporter(metrics_module=FakeMetricsModule())
    with pytest.raises(ValueError, match="snapshot=dict"):
        exp.export({})


def _scrape(ray, deadline_s: float) -> str:
    node = next(n for n in ray.nodes() if n.get("Alive"))
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    end = time.monotonic() + deadline_s
    text = ""
    while time.monotonic() < end:
        try:
            text = urllib.request.urlopen(url, timeout=2).read().decode()
        except OSError:
            text = ""
        if "ray_moe_route_drop_ratio_denominator" in text and "ray_moe_route_output_mismatch_total" in text:
            return text
        time.sleep(1.0)
    return text


def test_ray_metrics_endpoint_shows_the_exported_values(ray_session):
    """Real ray.util.metrics under the shared local Ray; the agent flushes every ~10 s, so poll <= 40 s.

    Ray metric objects are process-wide, so this test exports under a release label no other test uses
    (counters from other tests' exporters must not add into the values asserted here)."""
    import uuid

    exp = PrometheusExporter()
    _, snap = fixture_snapshot()
    points = exp.export(snap)
    assert len(points) > 20
    rel = f"scrape-{uuid.uuid4().hex[:8]}"
    t = Telemetry("scrape-test")
    t.add_ratio(MetricName.ROUTE_DROP_RATIO, {"release": rel, "phase": "decode"}, 2, 360)
    t.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": rel, "phase": "decode"}, 2)
    exp.export(t.snapshot())
    end = time.monotonic() + 40.0
    mine: list[str] = []
    text = ""
    while time.monotonic() < end:
        text = _scrape(ray_session, 10.0)
        mine = [l for l in text.splitlines() if l.startswith("ray_moe_") and f'release="{rel}"' in l]
        if any(l.startswith("ray_moe_route_output_mismatch_total{") for l in mine) and \
                any(l.startswith("ray_moe_route_drop_ratio_denominator{") for l in mine):
            break
        time.sleep(1.0)
    if not mine:
        pytest.skip("Ray metrics agent did not publish within 40 s (exporter ran without error)")
    den = [l for l in mine if l.startswith("ray_moe_route_drop_ratio_denominator{") and 'phase="decode"' in l]
    assert den and float(den[0].rsplit(" ", 1)[1]) == 360.0
    num = [l for l in mine if l.startswith("ray_moe_route_drop_ratio_numerator{")]
    assert num and float(num[0].rsplit(" ", 1)[1]) == 2.0
    mism = [l for l in mine if l.startswith("ray_moe_route_output_mismatch_total{")]
    assert mism and float(mism[0].rsplit(" ", 1)[1]) == 2.0
    assert "# TYPE ray_moe_route_output_mismatch_total counter" in text
