"""The captured steps' store and inputs (``moe/decode/graphs.py``): graphs by (generation, key), released with
their generation; a replay's inputs copied into the captured buffers, a shorter slot vector into its prefix;
weak views over a tensor's memory."""

from __future__ import annotations

import pytest
import torch

from ray_moe.moe.decode.graphs import StepGraphs, copy_inputs, weak


def test_graphs_are_kept_by_generation_and_released_with_it():
    g = StepGraphs()
    for key in [("decode", 8), ("decode", 16), ("tokens", 64)]:
        g.put(7, key, object())
    g.put(8, ("decode", 8), object())
    assert g.get(7, ("decode", 16)) is not None and g.get(8, ("decode", 16)) is None
    assert g.ready_mask(7, ("decode",), (4, 8, 16)) == 0b110 and g.count(7, "decode") == 2
    assert g.release(7) == 3 and len(g) == 1 and g.get(7, ("decode", 8)) is None


def test_inputs_copy_into_the_captured_buffers_and_a_prefix_of_a_longer_vector():
    inputs = {"rows": torch.zeros(4), "slots": torch.full((10,), -1)}
    copy_inputs(inputs, {"rows": torch.arange(4.0), "slots": torch.tensor([5, 6, 7])})
    assert inputs["rows"].tolist() == [0, 1, 2, 3] and inputs["slots"].tolist() == [5, 6, 7] + [-1] * 7
    with pytest.raises(ValueError, match="rows"):
        copy_inputs(inputs, {"rows": torch.zeros(5)})


def test_a_weak_view_sees_the_tensors_memory_without_owning_it():
    t = torch.arange(12.0).view(3, 4)[:, 1:3]
    w = weak((t, "label"))
    assert w[1] == "label" and w[0].data_ptr() == t.data_ptr() and w[0].tolist() == t.tolist()
    t[0, 0] = 100.0
    assert w[0][0, 0] == 100.0
