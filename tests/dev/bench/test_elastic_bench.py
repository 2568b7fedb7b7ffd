"""The elasticity benchmark's ``--quick`` preset on local Ray: a killed shard is back to full strength with nothing
lost or wrong, and the autopilot rebalances a shifting skew by itself with a lower imbalance afterwards; the
result JSON holds what ran."""

from __future__ import annotations

import json

from ray_moe_bench import available, elastic


def test_quick_preset_heals_and_rebalances(ray_session, tmp_path):
    assert "elastic" in available() and available()["elastic"].startswith("Elasticity on autopilot")
    out = tmp_path / "out"
    assert elastic.main(["--quick", "--out", str(out)]) == 0
    (path,) = out.glob("elastic-*.json")
    body = json.loads(path.read_text())
    assert body["benchmark"] == "elastic" and body["quick"] is True and body["device"] == "cpu"
    heal = body["heal"]
    assert heal["full_strength"] and heal["replacement_rank"] == 3 and heal["killed_rank"] == 2
    assert sorted(heal["live_ranks_after"]) == [0, 1, 3]
    assert 0 < heal["healer_seconds"] <= heal["seconds_to_full_strength"] < 120
    assert heal["requests_lost"] == heal["routes_dropped"] == heal["wrong_outputs"] == 0, heal["errors"]
    assert heal["steps_per_s"]["before"] > 0 and heal["steps_per_s"]["after"] > 0
    skew = body["skew"]
    assert skew["requests_lost"] == skew["routes_dropped"] == skew["wrong_outputs"] == 0, skew["errors"]
    assert skew["rebalances_taken"] >= 1 and len(skew["rebalances"]) == skew["rebalances_taken"]
    for r in skew["rebalances"]:
        assert r["reason"] == "gain" and r["imbalance_predicted"] < r["imbalance_now"] and r["bytes"] > 0
    assert [p["hot_expert"] for p in skew["phases"]] == [4, 6]
    first = skew["phases"][0]
    assert first["generation_at_end"] > first["generation_at_start"]
    assert first["imbalance_last"] < first["imbalance_first"], skew["phases"]
