"""The FP8 tuner's search and table merge (``ray_moe_bench.fp8_tune``; its measurements need a GPU): the search
returns the fastest accepted candidate, tries the winner's other pipeline depths, skips rejected settings, and a
new table keeps the old table's other shapes."""

from __future__ import annotations

import pytest

from ray_moe.moe.experts.runners.fp8_configs import LaunchConfig, RowTable, TunedTable
from ray_moe_bench import fp8_tune


def cost(c: LaunchConfig) -> float:
    """A made-up cost with its minimum at 32-row tiles, 64 columns, 8 warps, 4 stages."""
    return abs(c.block_m - 32) + abs(c.block_n - 64) / 2 + (c.warps != 8) * 5 + abs(c.stages - 4) * 3 + 10


def test_the_search_finds_the_cheapest_setting_in_two_steps():
    tried = []

    def time_us(c):
        tried.append(c)
        return cost(c)

    best, times = fp8_tune.search(time_us, fp8_tune.first_candidates(40, column_tiles=(32, 64, 128)))
    assert best == LaunchConfig(32, 64, 8, 4)
    assert len(tried) == len(set(tried)) == len(times)  # nothing timed twice
    assert {c.stages for c in tried if (c.block_m, c.block_n, c.warps) == (32, 64, 8)} == {2, 3, 4, 5}
    assert all(c.stages == fp8_tune.FIRST_STAGES for c in tried if (c.block_m, c.block_n, c.warps) != (32, 64, 8))


def test_rejected_settings_never_win_and_all_rejected_is_an_error():
    best, times = fp8_tune.search(lambda c: None if c.block_m == 32 else cost(c),
                                  fp8_tune.first_candidates(40, column_tiles=(64,)))
    assert best.block_m != 32 and times["m32n64w8s3"] is None
    with pytest.raises(RuntimeError, match="rejected"):
        fp8_tune.search(lambda c: None, fp8_tune.first_candidates(4))


def test_row_tiles_stop_at_the_rows_a_slot_holds():
    assert {c.block_m for c in fp8_tune.first_candidates(1)} == {16}
    assert {c.block_m for c in fp8_tune.first_candidates(17)} == {16, 32}
    assert {c.block_m for c in fp8_tune.first_candidates(64)} == {16, 32, 64}
    assert {c.block_m for c in fp8_tune.first_candidates(5000)} == {16, 32, 64, 128}


def test_a_new_table_keeps_the_shapes_not_measured_again():
    a, b = LaunchConfig(16, 128, 4, 3), LaunchConfig(64, 64, 8, 5)
    old = TunedTable("G", {"s1": RowTable((8,), (a,)), "s2": RowTable((8,), (a,))}, {}, {"x": {"iters": 1}})
    new = fp8_tune.merge(old, "G", {"s2": RowTable((8, 16), (b, b))}, {"l": RowTable((1,), (a,))}, {"y": {}})
    assert new.swiglu_rows["s1"] == old.swiglu_rows["s1"] and new.swiglu_rows["s2"].rows == (8, 16)
    assert set(new.linear_rows) == {"l"} and set(new.measured) == {"x", "y"}
    assert fp8_tune.merge(None, "G", {}, {}, {}).swiglu_rows == {}


def test_dense_linears_try_the_winner_with_its_k_split():
    def time_us(c):  # a skinny step: splitting K in 4 is fastest
        return cost(c) - {1: 0, 2: 4, 4: 6, 8: 5}[c.split_k]

    best, times = fp8_tune.search(time_us, fp8_tune.first_candidates(40, column_tiles=(64,)),
                                  (fp8_tune.stage_candidates, fp8_tune.split_candidates))
    assert best == LaunchConfig(32, 64, 8, 4, split_k=4)
    assert {k for k in times if k.endswith(("k2", "k4", "k8"))} == {"m32n64w8s4k2", "m32n64w8s4k4", "m32n64w8s4k8"}

