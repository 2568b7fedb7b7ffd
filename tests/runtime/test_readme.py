"""The README's "Using it from Python" snippet runs as pasted (every name it uses is defined in it).

It runs in this process on the session's local Ray instance (``Runtime.start`` joins an initialised Ray
instead of starting one); pasted into a fresh interpreter it starts its own local instance.
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def using_it_snippet() -> str:
    """The first ```python block of the "## Using it from Python" section."""
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Using it from Python\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else len(text)]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README.md: no ```python block under '## Using it from Python'"
    return m.group(1)


def test_snippet_is_self_contained():
    """Every name the snippet reads is imported or assigned earlier in it (no undefined inputs)."""
    tree = ast.parse(using_it_snippet())
    known = set(dir(builtins))
    for stmt in tree.body:
        loads = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert loads <= known, f"line {stmt.lineno}: {sorted(loads - known)} used before it is defined"
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                known.add(n.id)
            elif isinstance(n, ast.alias):
                known.add((n.asname or n.name).split(".")[0])
    assert {"hidden", "topk_ids", "topk_weights", "decode_mask"} <= known


def test_snippet_runs_as_pasted(ray_session):
    code = using_it_snippet()
    ns: dict = {"__name__": "__readme__"}
    try:
        exec(compile(code, "README.md:Using it", "exec"), ns)  # noqa: S102 - the documented usage, verbatim
    finally:
        rt = ns.get("rt")
        if rt is not None and rt.shards:  # the snippet failed before its own rt.shutdown()
            rt.shutdown()
    assert isinstance(ns["y"], torch.Tensor) and ns["y"].shape == ns["hidden"].shape
    assert ns["w_gate"].shape == (ns["cfg"].ffn_size, ns["cfg"].hidden_size)
    assert isinstance(ns["g"], int) and ns["rt"].shards == {}
