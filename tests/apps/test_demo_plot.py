"""The demo's report pieces, without Ray: the load windows before and after the rebalance span different numbers
of steps, so the PNG plots each rank's share of its window (the title says so); the replicas line prints every
expert's count. The full demo run: tests/runtime/test_cli.py::test_demo_smoke."""

from __future__ import annotations

import pytest

from ray_moe.apps.demo import PLOT_TITLE, _gamma, _plot, load_shares, replicas_line


def test_windows_of_different_sizes_compare_as_shares():
    before, after = [300, 100, 100, 100], [40, 40, 50, 70]  # 600 rows vs 200: a short window after the rebalance
    assert load_shares(before) == pytest.approx([50.0, 50 / 3, 50 / 3, 50 / 3])
    assert load_shares(after) == pytest.approx([20.0, 20.0, 25.0, 35.0])
    assert sum(load_shares(after)) == pytest.approx(100.0)
    assert load_shares([0, 0]) == [0.0, 0.0]
    # Gamma does not depend on the window's size
    assert _gamma(load_shares(before)) == pytest.approx(_gamma(before)) == pytest.approx(2.0)


def test_the_png_plots_shares_and_says_so(tmp_path):
    path = tmp_path / "plot" / "demo.png"
    bars = _plot(str(path), [300, 100, 100, 100], [40, 40, 50, 70], 4)
    assert bars[0] == pytest.approx([50.0, 50 / 3, 50 / 3, 50 / 3]) and bars[1] == pytest.approx([20, 20, 25, 35])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    assert "normalised to 100%" in PLOT_TITLE


def test_the_replicas_line_prints_every_expert():
    line = replicas_line([2, 1, 1, 1, 3, 1, 1, 2])
    assert "[2, 1, 1, 1, 3, 1, 1, 2]" in line and "12 slots for 8 experts" in line
