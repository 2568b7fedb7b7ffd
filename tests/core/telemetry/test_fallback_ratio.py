"""moe_fallback_step_ratio has one denominator, all decode steps, whatever the reason label (0x0D, 0x0DB).

The driver records each decode step under its fallback reason ("none" when the step stayed on the bucket
path); the table, ``breakdown`` and the Prometheus export show every reason over the pooled step count.
"""

from __future__ import annotations

import pytest

from ray_moe.core.telemetry.metrics import MetricName, Telemetry, merge_snapshots
from ray_moe.ray.prometheus import export_points

FALLBACK = MetricName.FALLBACK_STEP_RATIO
REL = "cli-test"


def record_decode_steps(t: Telemetry, reasons: dict[str, int]) -> None:
    """What ``Runtime._account`` records per decode step: 1/1 under the step's reason, 0/1 under "none"."""
    base = {"release": REL, "phase": "decode"}
    for reason, steps in reasons.items():
        for _ in range(steps):
            t.add_ratio(FALLBACK, {**base, "reason": reason}, 0 if reason == "none" else 1, 1)


def test_table_shows_fallback_steps_over_all_decode_steps():
    t = Telemetry("driver")
    record_decode_steps(t, {"none": 141, "rank_token_capacity_exceeded": 6})
    lines = t.snapshot().render_table().splitlines()
    rows = [l.split() for l in lines if l.startswith("moe_fallback_step_ratio")]
    # the pooled rate first, then each reason that occurred over the same 147 steps; no 6/6, no 0/141 row
    assert rows == [
        ["moe_fallback_step_ratio", f"release={REL},phase=decode", "6", "147", "0.040816"],
        ["moe_fallback_step_ratio", f"release={REL},phase=decode,reason=rank_token_capacity_exceeded",
         "6", "147", "0.040816"],
    ]


def test_breakdown_and_pooled_ratio_share_the_denominator():
    t = Telemetry("driver")
    record_decode_steps(t, {"none": 140, "graph_key_mismatch": 4, "expert_route_capacity_exceeded": 3})
    snap = t.snapshot()
    pooled = snap.ratio(FALLBACK, release=REL, phase="decode")
    assert (pooled.numerator, pooled.denominator) == (7, 147)
    parts = snap.breakdown(FALLBACK, release=REL)
    assert {k: (r.numerator, r.denominator) for k, r in parts.items()} == {
        "expert_route_capacity_exceeded": (3, 147), "graph_key_mismatch": (4, 147), "none": (0, 147)}
    assert sum(r.numerator for r in parts.values()) == pooled.numerator
    with pytest.raises(ValueError, match="no partition label"):
        snap.breakdown(MetricName.ROUTE_DROP_RATIO)


def test_merged_drivers_pool_their_steps():
    a, b = Telemetry("driver-a"), Telemetry("driver-b")
    record_decode_steps(a, {"none": 100, "rank_token_capacity_exceeded": 5})
    record_decode_steps(b, {"none": 41, "rank_token_capacity_exceeded": 1})
    merged = merge_snapshots([a.snapshot(), b.snapshot()])
    r = merged.breakdown(FALLBACK)["rank_token_capacity_exceeded"]
    assert (r.numerator, r.denominator) == (6, 147)
    rows = [l.split() for l in merged.render_table().splitlines() if l.startswith("moe_fallback_step_ratio")]
    assert [r[2:4] for r in rows] == [["6", "147"], ["6", "147"]]


def test_prometheus_exports_each_reason_over_all_steps():
    t = Telemetry("driver")
    record_decode_steps(t, {"none": 141, "rank_token_capacity_exceeded": 6})
    pts = {(p.name, p.tags): p.value for p in export_points(t.snapshot())}
    tags = (("release", REL), ("phase", "decode"), ("reason", "rank_token_capacity_exceeded"))
    assert pts[("moe_fallback_step_ratio_numerator", tags)] == 6.0
    assert pts[("moe_fallback_step_ratio_denominator", tags)] == 147.0
    assert pts[("moe_fallback_step_ratio", tags)] == pytest.approx(6 / 147)
    none = (("release", REL), ("phase", "decode"), ("reason", "none"))
    assert pts[("moe_fallback_step_ratio", none)] == 0.0
    assert pts[("moe_fallback_step_ratio_denominator", none)] == 147.0
