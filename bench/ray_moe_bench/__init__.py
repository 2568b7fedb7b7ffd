"""Benchmarks: ``ray-moe bench NAME [args]`` or ``python -m ray_moe_bench.NAME [args]``.

Each compares against a baseline measured in the same run and writes JSON (hardware, versions, shapes,
results) to ``--out DIR``, else ``$RAY_MOE_RESULTS_DIR``, else ``./ray-moe-results/``. The repository's
recorded results live in ``bench/results/`` (written only when named explicitly, as ``bench/run_h200x2.sh``
does). ``available()`` lists the benchmarks without importing them (no torch import for a listing).
"""

from __future__ import annotations

import ast
import importlib.resources
import re

#: helpers, not benchmarks (fp8_checkpoint: the serving benchmark's FP8 checkpoint writer, serving_fp8: its FP8 mode)
_NOT_BENCHMARKS = frozenset({"__init__", "common", "dispatch_prototypes", "fp8_checkpoint", "serving_fp8",
                             "serving_summary"})  # helpers: no measurement of their own


def summary(doc: str | None) -> str:
    """The first line of a docstring as plain text (reStructuredText ``literals`` without their backticks):
    a benchmark's one-line description in listings and in its --help."""
    first = (doc or "").strip().splitlines()[0] if (doc or "").strip() else ""
    return re.sub(r"``(.+?)``", r"\1", first)


def available() -> dict[str, str]:
    """Benchmark name -> the first line of its module docstring (plain text), sorted by name."""
    out: dict[str, str] = {}
    for entry in importlib.resources.files(__name__).iterdir():
        name = entry.name
        if not name.endswith(".py") or name[:-3] in _NOT_BENCHMARKS or name.startswith("_"):
            continue
        out[name[:-3]] = summary(ast.get_docstring(ast.parse(entry.read_text(encoding="utf-8"))))
    return dict(sorted(out.items()))
