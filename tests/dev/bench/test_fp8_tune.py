"""The FP8 tuner's search and table merge (``ray_moe_bench.fp8_tune``; its measurements need a GPU): the search
returns the fastest accepted candidate, tries the winner's other pipeline depths, skips rejected settings, and a
new table keeps the old table's other shapes."""

from __future__ import annotations

import pytest

from ray_moe.moe.experts.runners.fp8_configs import LaunchConfig, RowTable, TunedTable
from ray_moe_bench import fp8_tune

pytestmark = pytest.mark.triton  # its Triton kernels also run under the CPU interpreter (TRITON_INTERPRET=1)


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



@pytest.fixture
def interpreted(monkeypatch):
    """The tuner end to end on CPU tensors: the kernels under Triton's interpreter, the CUDA-graph timer replaced
    by a made-up cost (the tuner's measurements need a GPU)."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the FP8 kernels run on CPU under Triton's interpreter: set TRITON_INTERPRET=1 for pytest")
    from ray_moe.moe.experts.runners import fp8_kernels

    fp8_kernels._kernels.cache_clear()
    timed = []

    def fake_graph_us(fn, iters):
        fn()  # the candidate runs (its output was already checked against the heuristic launch's)
        timed.append(iters)
        return 100.0 - len(timed) % 7  # any order: the search takes the smallest
    monkeypatch.setattr(fp8_tune, "_graph_us", fake_graph_us)
    return timed


def test_the_tuner_runs_every_candidate_through_the_kernels(interpreted):
    logs = []
    table, records = fp8_tune.tune_experts(fp8_tune.ExpertShape(4, 128, 128, 2), [3, 20], 1, logs.append, "cpu")
    assert table.rows == (6, 40) and len(records) == 2 and interpreted
    assert all(r["gate_up_candidates_us"] and r["down_candidates_us"] for r in records)
    assert not [m for m in logs if "rejected" in m], logs  # every candidate computes the heuristic's output
    lt, lrec = fp8_tune.tune_linear(256, 128, [1, 20], 1, logs.append, "cpu")
    assert lt.rows == (1, 20) and all(c.backend.value == "triton" for c in lt.choices)  # no scaled_mm on a CPU
    assert all("CUDA bf16" in r["scaled_mm_reason"] for r in lrec)
    assert any(k.endswith("k2") for k in lrec[1]["triton_candidates_us"])  # the K splits were tried
    assert not [m for m in logs if "rejected" in m], logs
