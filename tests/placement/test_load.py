"""LoadWindow / LoadMatrix: window sums, EMA, provenance, validation (spec 0x08A, 0x08I)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ray_moe.placement.load import LoadProvenance, LoadWindow
from ray_moe.core.types import Phase

CK = "checkpoint-0042"


def test_spec_0x08A_teaching_matrix_is_the_eight_route_count():
    # The Loop 2 semantic handoff: accepted routes per logical expert [4, 2, 1, 1] (sum 8).
    w = LoadWindow(num_layers=1, num_experts=4, window=4)
    assert w.record(torch.tensor([[4, 2, 1, 1]], dtype=torch.int64), phase="prefill", generation=17, checkpoint=CK) == 0
    m = w.snapshot()
    assert m.weight.dtype == np.float64 and m.weight.shape == (1, 4)
    assert m.weight.tolist() == [[4.0, 2.0, 1.0, 1.0]]
    assert m.as_tensor().dtype == torch.float64 and m.as_tensor().tolist() == [[4.0, 2.0, 1.0, 1.0]]
    p = m.provenance
    assert (p.unit, p.aggregation, p.smoothing, p.window, p.window_steps) == ("accepted_rows", "sum", None, 4, 1)
    assert (p.phases, p.phase, p.checkpoints, p.generations) == ((Phase.PREFILL,), "prefill", (CK,), (17,))
    assert (p.first_step, p.last_step, p.total_rows) == (0, 0, 8)


def test_window_keeps_last_observations_and_mixes_provenance():
    w = LoadWindow(2, 3, window=3)
    steps = [
        ([[1, 0, 0], [0, 0, 1]], "prefill", 17),
        ([[0, 2, 0], [0, 2, 0]], "decode", 17),
        ([[0, 0, 3], [3, 0, 0]], "decode", 18),
        ([[4, 0, 0], [0, 0, 4]], "decode", 18),
    ]
    for counts, phase, gen in steps:
        w.record(np.array(counts, dtype=np.int64), phase=phase, generation=gen, checkpoint=CK)
    assert len(w) == 3
    m = w.snapshot()
    assert m.weight.tolist() == [[4.0, 2.0, 3.0], [3.0, 2.0, 4.0]]  # step 0 fell out of the window
    p = m.provenance
    assert (p.window_steps, p.first_step, p.last_step, p.total_rows) == (3, 1, 3, 18)
    assert (p.phases, p.phase, p.generations) == ((Phase.DECODE,), "decode", (17, 18))
    # phase-specific estimate
    w.record(np.array([[1, 1, 1], [1, 1, 1]]), phase=Phase.PREFILL, generation=18, checkpoint="checkpoint-0043")
    mixed = w.snapshot()
    assert mixed.provenance.phase == "mixed" and mixed.provenance.phases == (Phase.PREFILL, Phase.DECODE)
    assert mixed.provenance.checkpoints == (CK, "checkpoint-0043")
    pre = w.snapshot(phase="prefill")
    assert pre.weight.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]] and pre.provenance.first_step == 4
    with pytest.raises(ValueError, match="phase='train'"):
        w.snapshot(phase="train")


def test_ema_matches_formula():
    beta = 0.5
    w = LoadWindow(1, 2, window=8, smoothing=beta)
    for c in ([4, 0], [0, 4], [2, 2]):
        w.record(np.array([c]), phase="decode", generation=1, checkpoint=CK)
    m = w.snapshot()
    # W0 = [4,0]; W1 = .5*[4,0] + .5*[0,4] = [2,2]; W2 = .5*[2,2] + .5*[2,2] = [2,2]
    assert m.weight.tolist() == [[2.0, 2.0]]
    assert (m.provenance.aggregation, m.provenance.smoothing, m.provenance.total_rows) == ("ema", 0.5, 12)
    w2 = LoadWindow(1, 1, window=2, smoothing=0.75)
    for c in (8, 0, 4):
        w2.record(np.array([[c]]), phase="decode", generation=1, checkpoint=CK)
    # window keeps [0, 4]: W = 0.75*0 + 0.25*4 = 1
    assert w2.snapshot().weight.tolist() == [[1.0]]
    w3 = LoadWindow(1, 1, window=5, smoothing=0.0)  # beta = 0: the last observation
    for c in (8, 3):
        w3.record(np.array([[c]]), phase="decode", generation=1, checkpoint=CK)
    assert w3.snapshot().weight.tolist() == [[3.0]]


def test_snapshot_is_immutable_and_independent_of_later_records():
    w = LoadWindow(1, 2, window=2)
    src = np.array([[1, 2]])
    w.record(src, phase="decode", generation=1, checkpoint=CK)
    src[0, 0] = 100  # the window copied the input
    m = w.snapshot()
    w.record(np.array([[5, 5]]), phase="decode", generation=1, checkpoint=CK)
    assert m.weight.tolist() == [[1.0, 2.0]]
    with pytest.raises(ValueError):
        m.weight[0, 0] = 9.0
    with pytest.raises(Exception):
        m.provenance.total_rows = 0  # type: ignore[misc]
    assert LoadProvenance.model_validate_json(m.provenance.model_dump_json()) == m.provenance


def test_validation_names_field_and_value_and_stores_nothing():
    w = LoadWindow(2, 3, window=2)
    ok = dict(phase="decode", generation=1, checkpoint=CK)
    with pytest.raises(ValueError, match=r"step_counts: expected shape \[L=2, E=3\], got \[3, 2\]"):
        w.record(np.zeros((3, 2), dtype=np.int64), **ok)
    with pytest.raises(ValueError, match=r"step_counts\[1, 2\]=-1 is negative"):
        w.record(np.array([[0, 0, 0], [0, 0, -1]]), **ok)
    with pytest.raises(ValueError, match="integer dtype, got torch.float32"):
        w.record(torch.zeros(2, 3), **ok)
    with pytest.raises(ValueError, match="integer dtype, got float64"):
        w.record(np.zeros((2, 3)), **ok)
    with pytest.raises(ValueError, match="phase='mixed'"):
        w.record(np.zeros((2, 3), dtype=np.int64), phase="mixed", generation=1, checkpoint=CK)
    with pytest.raises(ValueError, match="generation=-1"):
        w.record(np.zeros((2, 3), dtype=np.int64), phase="decode", generation=-1, checkpoint=CK)
    with pytest.raises(ValueError, match="checkpoint=''"):
        w.record(np.zeros((2, 3), dtype=np.int64), phase="decode", generation=1, checkpoint="")
    assert len(w) == 0
    with pytest.raises(ValueError, match="no observations"):
        w.snapshot()
    w.record(np.zeros((2, 3), dtype=np.int64), step=10, **ok)
    with pytest.raises(ValueError, match="step=10 must be an int >= 11"):
        w.record(np.zeros((2, 3), dtype=np.int64), step=10, **ok)
    assert w.record(np.zeros((2, 3), dtype=np.int64), **ok) == 11
    for kwargs, field in ((dict(num_layers=0, num_experts=1, window=1), "num_layers=0"),
                          (dict(num_layers=1, num_experts=0, window=1), "num_experts=0"),
                          (dict(num_layers=1, num_experts=1, window=0), "window=0"),
                          (dict(num_layers=1, num_experts=1, window=1, smoothing=1.0), "smoothing=1.0"),
                          (dict(num_layers=1, num_experts=1, window=1, smoothing=-0.1), "smoothing=-0.1")):
        with pytest.raises(ValueError, match=field):
            LoadWindow(**kwargs)
    w.clear()
    assert len(w) == 0 and w.record(np.zeros((2, 3), dtype=np.int64), **ok) == 12


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(arrays(np.int64, (2, 3), elements=st.integers(0, 50)), min_size=1, max_size=8),
    window=st.integers(1, 5),
    beta=st.one_of(st.none(), st.floats(0.0, 0.95)),
)
def test_property_window_sum_and_ema(counts, window, beta):
    w = LoadWindow(2, 3, window=window, smoothing=beta)
    for c in counts:
        w.record(c, phase="decode", generation=0, checkpoint=CK)
    kept = counts[-window:]
    m = w.snapshot()
    assert m.provenance.window_steps == len(kept)
    assert m.provenance.total_rows == int(sum(int(c.sum()) for c in kept))
    assert (m.provenance.first_step, m.provenance.last_step) == (len(counts) - len(kept), len(counts) - 1)
    if beta is None:
        np.testing.assert_array_equal(m.weight, np.sum(kept, axis=0).astype(np.float64))
    else:
        # the EMA is a convex combination: inside the elementwise min/max of the windowed counts
        lo, hi = np.min(kept, axis=0), np.max(kept, axis=0)
        assert np.all(m.weight >= lo - 1e-9) and np.all(m.weight <= hi + 1e-9)
        expect = kept[0].astype(np.float64)
        for c in kept[1:]:
            expect = beta * expect + (1 - beta) * c
        np.testing.assert_allclose(m.weight, expect)
