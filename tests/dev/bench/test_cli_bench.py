"""``ray-moe bench`` as a user runs it: the installed console script, from a directory outside the repository.

Benchmarks are the package ``ray_moe_bench`` in the checkout's ``bench/`` folder; ``ray-moe bench`` runs
``python -m ray_moe_bench [NAME args]`` in its own process (the product never imports them) and they write their JSON
where they are told (``--out``, else ``RAY_MOE_RESULTS_DIR``, else ``./ray-moe-results``), never into the
repository's recorded ``bench/results/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ray_moe_bench import available

REPO = Path(__file__).resolve().parents[3]
EXPECTED = {"cpu_exchange", "cpu_memory", "direct_profile", "dispatch_combine", "elastic", "eplb", "fp8_dispatch", "fp8_experts", "layer_step", "migration", "moe_layer", "generate", "serving",
            "overlap", "rebalance_memory", "runners", "skinny", "step_profile", "host_profile", "graph_relaunch", "kernel_mix",
            "start_profile", "paged_varlen", "fp8_dense", "fp8_tune", "route_plan"}


def console_script() -> str:
    path = Path(sys.executable).parent / "ray-moe"
    if not path.exists():
        pytest.skip(f"no ray-moe console script beside {sys.executable} (pip install -e .)")
    return str(path)


def run_cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    child = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child.pop("RAY_MOE_RESULTS_DIR", None)
    child.update(env or {})
    return subprocess.run([console_script(), *args], capture_output=True, text=True, env=child, cwd=cwd,
                          timeout=timeout)


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_available_lists_every_benchmark_with_a_plain_description():
    benches = available()
    assert set(benches) == EXPECTED
    for name, doc in benches.items():
        assert doc and "\n" not in doc and "``" not in doc, (name, doc)
    assert benches["eplb"].startswith("EPLB solver benchmark: vectorised rebalance_experts vs the loop-form oracle")


def test_the_benchmarks_are_not_in_the_installed_package_but_found_from_a_checkout():
    """pyproject's package discovery (what ``pip install .`` copies) holds the product only; ``ray-moe bench``
    finds the benchmarks beside the package in a checkout (``pip install -e .``) without importing them."""
    from setuptools import find_packages

    from ray_moe.apps.cli import bench_folder

    found = find_packages(str(REPO), include=["ray_moe*"])
    assert "ray_moe" in found and not any(p.startswith(("ray_moe_bench", "ray_moe_dev")) for p in found)
    assert bench_folder() == REPO / "bench"


def test_listing_and_help_from_any_directory(tmp_path):
    res = run_cli("bench", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    listed = {l.split()[0] for l in lines if l.startswith("  ")}
    assert listed == EXPECTED
    assert "``" not in res.stdout and "--out DIR" in res.stdout
    help_text = run_cli("bench", "--help", cwd=tmp_path)
    assert help_text.returncode == 0 and "``" not in help_text.stdout
    assert "python -m ray_moe_bench NAME, in its own process" in " ".join(help_text.stdout.split())
    top = run_cli("--help", cwd=tmp_path)
    assert top.returncode == 0 and "``" not in top.stdout


def test_unknown_benchmark_is_one_line_and_exit_code_2(tmp_path):
    res = run_cli("bench", "no_such_bench", cwd=tmp_path)
    assert res.returncode == 2
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert lines[0].startswith("ray-moe bench: error: bench='no_such_bench' is not a benchmark; choose one of: ")


def test_quick_eplb_writes_where_it_is_told_and_not_into_bench_results(tmp_path):
    recorded = REPO / "bench" / "results"
    before = tree_digest(recorded)
    out = tmp_path / "out"
    work = tmp_path / "work"
    work.mkdir()
    res = run_cli("bench", "eplb", "--quick", "--out", str(out), cwd=work)
    assert res.returncode == 0, res.stderr
    (path,) = out.glob("eplb-*-quick.json")
    body = json.loads(path.read_text())
    assert body["benchmark"] == "eplb" and body["quick"] is True
    assert all(all(s["identical_to_reference"].values()) for s in body["shapes"])
    assert f"wrote {path}" in res.stdout
    assert not (work / "ray-moe-results").exists()  # --out wins over the default folder
    assert tree_digest(recorded) == before


def test_default_results_folder_is_in_the_working_directory(tmp_path, monkeypatch):
    from ray_moe_bench.common import results_dir

    monkeypatch.delenv("RAY_MOE_RESULTS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert Path(results_dir()).resolve() == tmp_path / "ray-moe-results"
    monkeypatch.setenv("RAY_MOE_RESULTS_DIR", str(tmp_path / "env"))
    assert results_dir() == str(tmp_path / "env")
    assert results_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")


def test_graph_relaunch_needs_a_gpu_and_says_so(capsys, monkeypatch):
    import torch

    from ray_moe_bench import graph_relaunch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark runs (bench/results/logs/s17/graph_relaunch-h200x1.json)")
    monkeypatch.setattr(sys, "argv", ["graph_relaunch"])
    assert graph_relaunch.main() == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
