"""The captured steps' store (``moe/decode/graphs.py`` ``StepGraphs``): a step whose key has no graph may run in
the graph of the same key with a larger upper bound at one position (a kernel's grid bound baked into the graph),
the smallest such one, of its own generation only."""

from __future__ import annotations

from ray_moe.moe.decode.graphs import StepGraphs


def test_covering_finds_the_smallest_larger_bound_of_an_otherwise_equal_key():
    g = StepGraphs()
    for key in [("prefill", 16, 64, 2048, "packed"), ("prefill", 16, 64, 4096, "packed"),
                ("prefill", 32, 64, 512, "packed"), ("decode", 16, 64, 1024, "packed")]:
        g.put(7, key, object())
    g.put(8, ("prefill", 16, 64, 1024, "packed"), object())
    assert g.covering(7, ("prefill", 16, 64, 1024, "packed"), 3) == ("prefill", 16, 64, 2048, "packed")
    assert g.covering(7, ("prefill", 16, 64, 2048, "packed"), 3) == ("prefill", 16, 64, 2048, "packed")
    assert g.covering(7, ("prefill", 16, 64, 3000, "packed"), 3) == ("prefill", 16, 64, 4096, "packed")
    assert g.covering(7, ("prefill", 16, 64, 8192, "packed"), 3) is None  # nothing bounds it
    assert g.covering(7, ("prefill", 32, 64, 1024, "packed"), 3) is None  # rows differ: no graph of them
    assert g.covering(7, ("prefill", 16, 128, 512, "packed"), 3) is None  # keys differ
    assert g.covering(7, ("prefill", 16, 64, 512, "batched"), 3) is None
    assert g.covering(9, ("prefill", 16, 64, 512, "packed"), 3) is None  # another generation's graphs
    assert g.release(7) == 4 and g.covering(7, ("prefill", 16, 64, 1024, "packed"), 3) is None
