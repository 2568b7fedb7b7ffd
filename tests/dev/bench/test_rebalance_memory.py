"""The rebalance-memory benchmark's CPU smoke run: a rebalance that copies experts into the other rank's staging
rows while traffic runs, no slot buffer grows, no step fails (the GPU run adds the allocator's counters)."""

from __future__ import annotations

from ray_moe_bench.rebalance_memory import run


def test_quick_rebalance_copies_within_the_staging_rows_under_traffic():
    res = run(2, True, "cpu", 16)
    assert res["report"]["copies"] > 0 and res["new_generation"] == 1
    before, after = res["slot_buffers_before"], res["slot_buffers_after"]
    assert before["bytes"] == after["bytes"] and after["grows"] == 0 and before["rows"] == after["rows"]
    assert res["steps_failed_during"] == []
    assert res["peak_during_rebalance_bytes"] is None  # CPU: no allocator counters
