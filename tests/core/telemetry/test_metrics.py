"""Telemetry registry of 0x0DB: bounded labels, numerators/denominators, snapshot merging, status table."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.telemetry.metrics import (
    METRIC_SPECS,
    CounterSeries,
    MetricName,
    MetricType,
    RatioSeries,
    Telemetry,
    TelemetrySnapshot,
    merge_snapshots,
)
from tests.core.telemetry.test_ratios import REL, spec_cells

DROP = MetricName.ROUTE_DROP_RATIO


def record_spec_cells(t: Telemetry) -> None:
    for c in spec_cells():
        t.record_cell(c, topology="topology-v3", graph="decode.bucket4.v19" if c.phase != "prefill" else "eager",
                      reason="oversize" if c.fallback else "none")


def test_metric_names_and_labels_of_0x0DB():
    assert {m.value for m in MetricName} == {
        "moe_route_drop_ratio", "moe_remote_route_ratio", "moe_inter_node_route_ratio", "moe_graph_replay_ratio",
        "moe_fallback_step_ratio", "moe_route_output_mismatch_total", "moe_stale_handle_accept_total",
        "moe_count_conservation_failure_total", "moe_step_latency_seconds",
    }
    labels = {m.value: METRIC_SPECS[m].label_names for m in MetricName}
    assert labels["moe_route_drop_ratio"] == ("release", "phase")
    assert labels["moe_remote_route_ratio"] == ("release", "phase")
    assert labels["moe_inter_node_route_ratio"] == ("release", "phase", "topology")
    assert labels["moe_graph_replay_ratio"] == ("release", "phase", "graph")
    assert labels["moe_fallback_step_ratio"] == ("release", "phase", "reason")
    assert labels["moe_route_output_mismatch_total"] == ("release", "phase")
    assert labels["moe_stale_handle_accept_total"] == ("release", "placement_generation")
    assert labels["moe_count_conservation_failure_total"] == ("release", "process_group_generation")
    assert METRIC_SPECS[MetricName.REMOTE_ROUTE_RATIO].denominator == "accepted routes"
    assert METRIC_SPECS[DROP].numerator == "dropped routes"


def test_spec_cells_through_the_registry_reproduce_the_golden_ratios():
    t = Telemetry("driver")
    record_spec_cells(t)
    snap = t.snapshot()
    assert (snap.ratio(DROP).numerator, snap.ratio(DROP).denominator) == (2, 800)
    assert snap.ratio(DROP).value == 0.0025
    r = snap.ratio(MetricName.REMOTE_ROUTE_RATIO)
    assert (r.numerator, r.denominator) == (570, 798)
    r = snap.ratio(MetricName.INTER_NODE_ROUTE_RATIO, topology="topology-v3")
    assert (r.numerator, r.denominator) == (300, 798)
    r = snap.ratio(MetricName.GRAPH_REPLAY_RATIO, release=REL)
    assert (r.numerator, r.denominator, r.value) == (176, 200, 0.88)
    r = snap.ratio(MetricName.FALLBACK_STEP_RATIO)
    assert (r.numerator, r.denominator, r.value) == (24, 240, 0.1)
    # a label selector narrows the pool: decode only
    r = snap.ratio(DROP, phase="decode")
    assert (r.numerator, r.denominator) == (2, 360)


def test_add_ratio_keeps_numerator_and_denominator_separately():
    t = Telemetry("driver")
    labels = {"release": REL, "phase": "decode"}
    t.add_ratio(DROP, labels, 1, 100)
    t.add_ratio(DROP, labels, 0, 300)
    (s,) = t.snapshot().ratios
    assert (s.numerator, s.denominator) == (1, 400)
    assert s.value == 0.0025


def test_zero_denominator_series_has_no_value():
    t = Telemetry("driver")
    t.add_ratio(DROP, {"release": REL, "phase": "decode"}, 0, 0)
    snap = t.snapshot()
    assert snap.ratios[0].value is None
    assert snap.ratio(DROP).value is None
    assert "n/a" in snap.render_table()
    # no series at all also gives a ratio with no value
    assert Telemetry("x").snapshot().ratio(DROP).value is None


@pytest.mark.parametrize("key", ["request_id", "token_id", "prompt"])
def test_unbounded_label_keys_are_rejected(key):
    t = Telemetry("driver")
    with pytest.raises(ValueError, match=f"labels\\['{key}'\\]: unbounded label key"):
        t.add_ratio(DROP, {"release": REL, "phase": "decode", key: "r-123"}, 0, 1)
    with pytest.raises(ValueError, match=f"labels\\['{key}'\\]: unbounded"):
        t.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": REL, "phase": "decode", key: "x"})


def test_labels_outside_the_metric_and_missing_labels_are_rejected():
    t = Telemetry("driver")
    with pytest.raises(ValueError, match="labels\\['topology'\\]: not a label of moe_route_drop_ratio"):
        t.add_ratio(DROP, {"release": REL, "phase": "decode", "topology": "t"}, 0, 1)
    with pytest.raises(ValueError, match="needs label\\(s\\) \\['topology'\\]"):
        t.add_ratio(MetricName.INTER_NODE_ROUTE_RATIO, {"release": REL, "phase": "decode"}, 0, 1)
    with pytest.raises(ValueError, match="labels\\['phase'\\]='train'"):
        t.add_ratio(DROP, {"release": REL, "phase": "train"}, 0, 1)
    with pytest.raises(ValueError, match="labels\\['release'\\]="):
        t.add_ratio(DROP, {"release": "x" * 500, "phase": "decode"}, 0, 1)


def test_cardinality_cap_per_metric():
    t = Telemetry("driver", max_series_per_metric=3)
    for i in range(3):
        t.add_ratio(DROP, {"release": f"rel-{i}", "phase": "decode"}, 0, 1)
    t.add_ratio(DROP, {"release": "rel-0", "phase": "decode"}, 0, 1)  # existing series: fine
    with pytest.raises(ValueError, match="moe_route_drop_ratio already has 3 label sets \\(max_series_per_metric=3\\)"):
        t.add_ratio(DROP, {"release": "rel-3", "phase": "decode"}, 0, 1)
    # the cap is per metric: another metric still takes new series
    t.add_ratio(MetricName.REMOTE_ROUTE_RATIO, {"release": "rel-3", "phase": "decode"}, 0, 1)
    for i in range(3):
        t.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": f"rel-{i}", "phase": "decode"})
    with pytest.raises(ValueError, match="max_series_per_metric=3"):
        t.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": "rel-9", "phase": "decode"})


def test_record_cell_is_all_or_nothing_under_the_cap():
    t = Telemetry("driver", max_series_per_metric=1)
    c0, c1 = spec_cells()[:2]
    t.record_cell(c0, topology="topology-v3", graph="eager", reason="none")
    with pytest.raises(ValueError, match="max_series_per_metric=1"):
        t.record_cell(c1, topology="topology-v3", graph="decode.bucket4.v19", reason="oversize")
    assert t.snapshot().ratio(DROP).denominator == 320  # nothing of c1 was added


def test_wrong_metric_type_and_bad_increments():
    t = Telemetry("driver")
    labels = {"release": REL, "phase": "decode"}
    with pytest.raises(ValueError, match="is a counter metric, not a ratio metric"):
        t.add_ratio(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, labels, 0, 1)
    with pytest.raises(ValueError, match="is a ratio metric, not a counter metric"):
        t.inc(DROP, labels)
    with pytest.raises(ValueError, match="numerator=5 exceeds denominator=4"):
        t.add_ratio(DROP, labels, 5, 4)
    with pytest.raises(ValueError, match="amount=-1"):
        t.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, labels, -1)
    with pytest.raises(ValueError, match="metric='moe_nope'"):
        t.add_ratio("moe_nope", labels, 0, 1)
    with pytest.raises(ValueError, match="seconds=nan"):
        t.observe_step_latency(labels, float("nan"))


def test_counters_and_latency_samples():
    t = Telemetry("shard-r0", max_samples_per_series=4)
    t.inc(MetricName.STALE_HANDLE_ACCEPT_TOTAL, {"release": REL, "placement_generation": "placement-v19"}, 0)
    t.inc(MetricName.COUNT_CONSERVATION_FAILURE_TOTAL, {"release": REL, "process_group_generation": "g19"}, 2)
    for x in (0.5, 0.1, 0.3, 0.2, 0.4, 0.9):
        t.observe_step_latency({"release": REL, "phase": "decode"}, x)
    snap = t.snapshot()
    assert snap.counter(MetricName.STALE_HANDLE_ACCEPT_TOTAL) == 0
    assert snap.counter(MetricName.COUNT_CONSERVATION_FAILURE_TOTAL, release=REL) == 2
    (s,) = snap.samples
    assert s.samples == (0.3, 0.2, 0.4, 0.9) and s.observed == 6 and s.truncated
    q = snap.latency(release=REL)
    assert (q.n, q.p50, q.p95, q.max, q.unit, q.is_latency) == (4, 0.3, 0.9, 0.9, "seconds", True)
    assert "(last 4 of 6)" in snap.render_table()


def test_merge_adds_numerators_and_denominators_across_processes():
    cells = spec_cells()
    driver, a0, a1 = Telemetry("driver"), Telemetry("shard-r0"), Telemetry("shard-r1")
    for t, c in zip((driver, a0, a1, a1), cells):
        t.record_cell(c, topology="topology-v3", graph="g", reason="oversize")
    a0.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": REL, "phase": "decode"}, 1)
    a1.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": REL, "phase": "decode"}, 2)
    a0.observe_step_latency({"release": REL, "phase": "decode"}, 1.0)
    a1.observe_step_latency({"release": REL, "phase": "decode"}, 3.0)
    merged = merge_snapshots([driver.snapshot(), a0.snapshot(), a1.snapshot()])
    assert merged.sources == ("driver", "shard-r0", "shard-r1")
    r = merged.ratio(MetricName.REMOTE_ROUTE_RATIO)
    assert (r.numerator, r.denominator) == (570, 798)
    r = merged.ratio(MetricName.GRAPH_REPLAY_RATIO)
    assert (r.numerator, r.denominator) == (176, 200)
    # decode series came from two processes: one merged series, counts added
    decode = [s for s in merged.ratios if s.metric is DROP and s.labels["phase"] == "decode"]
    assert len(decode) == 1 and (decode[0].numerator, decode[0].denominator) == (2, 360)
    assert merged.counter(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL) == 3
    assert merged.latency().n == 2 and merged.latency().max == 3.0
    # merging is associative over disjoint sources
    again = merge_snapshots([driver.snapshot(), merge_snapshots([a0.snapshot(), a1.snapshot()])])
    assert again.ratio(DROP) == merged.ratio(DROP)


def test_merge_refuses_the_same_source_twice():
    t = Telemetry("shard-r0")
    t.add_ratio(DROP, {"release": REL, "phase": "decode"}, 1, 2)
    s = t.snapshot()
    with pytest.raises(ValueError, match="repeats source 'shard-r0'"):
        merge_snapshots([s, s])
    with pytest.raises(ValueError, match="empty"):
        merge_snapshots([])


def test_snapshot_is_a_frozen_copy_and_round_trips_json():
    t = Telemetry("driver")
    record_spec_cells(t)
    t.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, {"release": REL, "phase": "decode"})
    snap = t.snapshot()
    t.add_ratio(DROP, {"release": REL, "phase": "decode"}, 1, 1)
    assert snap.ratio(DROP).denominator == 800  # later adds do not leak into an earlier snapshot
    again = TelemetrySnapshot.model_validate_json(snap.model_dump_json())
    assert again == snap
    with pytest.raises(Exception):
        snap.sources = ("x",)


def test_snapshot_validation_rejects_inconsistent_series():
    with pytest.raises(ValueError, match="numerator=3 exceeds denominator=2"):
        RatioSeries(metric=DROP, labels={"release": REL, "phase": "decode"}, numerator=3, denominator=2)
    with pytest.raises(ValueError, match="request_id"):
        CounterSeries(metric=MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL,
                      labels={"release": REL, "phase": "decode", "request_id": "1"}, value=0)
    s = RatioSeries(metric=DROP, labels={"release": REL, "phase": "decode"}, numerator=0, denominator=1)
    with pytest.raises(ValueError, match="appears twice"):
        TelemetrySnapshot(sources=("a",), ratios=(s, s))


def test_render_table_shows_numerators_and_denominators():
    t = Telemetry("driver")
    record_spec_cells(t)
    text = t.snapshot().render_table()
    lines = text.splitlines()
    assert lines[0] == "sources: driver"
    assert lines[1].split() == ["metric", "labels", "numerator", "denominator", "value"]
    row = next(l for l in lines if l.startswith("moe_route_drop_ratio") and "phase=decode" in l)
    assert row.split()[2:] == ["2", "360", "0.005556"]
    row = next(l for l in lines if l.startswith("moe_graph_replay_ratio") and "phase=prefill" in l)
    assert row.split()[2:] == ["0", "0", "n/a"]


def test_thread_safety_of_concurrent_adds():
    t = Telemetry("driver")
    labels = {"release": REL, "phase": "decode"}

    def work():
        for _ in range(500):
            t.add_ratio(DROP, labels, 1, 2)
            t.inc(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL, labels)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    snap = t.snapshot()
    assert (snap.ratio(DROP).numerator, snap.ratio(DROP).denominator) == (2000, 4000)
    assert snap.counter(MetricName.ROUTE_OUTPUT_MISMATCH_TOTAL) == 2000


def test_every_metric_has_a_type():
    assert {s.type for s in METRIC_SPECS.values()} == set(MetricType)


increments = st.lists(
    st.tuples(st.sampled_from(["driver", "shard-r0", "shard-r1"]), st.sampled_from(["prefill", "decode"]),
              st.integers(0, 50), st.integers(0, 50)),
    max_size=25,
)


@settings(deadline=None, max_examples=40)
@given(increments)
def test_merge_equals_one_registry_seeing_everything(incs):
    per = {s: Telemetry(s) for s in ("driver", "shard-r0", "shard-r1")}
    whole = Telemetry("all")
    for src, phase, a, b in incs:
        num, den = min(a, b), max(a, b)
        per[src].add_ratio(DROP, {"release": REL, "phase": phase}, num, den)
        whole.add_ratio(DROP, {"release": REL, "phase": phase}, num, den)
    merged = merge_snapshots([t.snapshot() for t in per.values()])
    ref = whole.snapshot()
    for phase in ("prefill", "decode"):
        assert merged.ratio(DROP, phase=phase) == ref.ratio(DROP, phase=phase)
