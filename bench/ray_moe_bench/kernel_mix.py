"""Where two systems' device time goes on the same workload, by kind of kernel, side by side.

    python -m ray_moe_bench.kernel_mix --vllm-trace DIR --ray-moe PROFILE.json [--out FILE.json]

* ``--vllm-trace DIR``: the torch-profiler traces vLLM writes (``*.pt.trace.json[.gz]``, Chrome trace format) for a
  profiled pass: ``python -m ray_moe_bench.serving --systems vllm --vllm-profile DIR ...`` profiles its first
  timed pass (that pass's figures are not benchmark figures: the profiler slows it).
* ``--ray-moe PROFILE.json``: a ``step_profile`` JSON whose profiler windows cover the steps to compare
  (``--windows 0:100000``: every step of the pass).

Each kernel's device time is summed by name, then by category (``categorize``: experts, attention, dense GEMM,
norms, rotary, cache writes, routing, activations, MoE combine, copies and elementwise ops, sampling, other), as milliseconds and shares of the
total, and per 1,000 tokens the pass processed where ``--tokens`` gives it. Shares compare the two systems'
mixes; milliseconds only where both profiled the same requests.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
from typing import Any, Iterable

# (category, name pattern): the first match names a kernel's category (names as the profiler reports them: a
# Triton kernel by its function, a CUDA kernel by its demangled signature, cuBLAS's by its generated names)
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("experts", r"fused_moe|_gate_up|_down\b|_skinny|GroupProblemShape|grouped_gemm|moe_mm|_fp8_experts"),
    ("cache_write", r"reshape_and_cache|index_copy|_write_kv"),
    ("attention", r"flash|fmha|sdpa|_attend|_decode\b|_decode_combine|paged_attention|attention|"
                  r"cudnn_generated|merge_attn"),
    ("rotary", r"rotary|_rope\b"),
    ("norm", r"rms_norm|layernorm|layer_norm|rsqrt"),
    ("routing", r"topk|top_k|_route_plan|moe_align|count_and_sort|_softmax_topk|_blocked_|bitonicSort|sort"),
    ("activation", r"silu|act_and_mul|gelu"),
    ("moe_combine", r"_combine\b|moe_sum|_gated_combine|scatter"),
    ("dense_gemm", r"nvjet|gemm|Gemm|sm90_xmma|cublas|cutlass|splitKreduce|memcpy32_post"),
    ("sampling", r"argmax|sampl|multinomial|softmax"),
    ("copies_elementwise", r"Memcpy|Memset|copy|Cat|cat_|elementwise|fill|gather|index|where|unrolled|triton_poi"),
)
_COMPILED = tuple((cat, re.compile(pat)) for cat, pat in CATEGORIES)
KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace events that are device time
UNLISTED = "(kernels past a step_profile window's top list)"  # categorized "other"


def categorize(name: str) -> str:
    """The category of a kernel named ``name`` (``CATEGORIES``, first match; "other" where none matches)."""
    for cat, pat in _COMPILED:
        if pat.search(name):
            return cat
    return "other"


def by_name_from_trace(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{kernel name: {"ms", "calls"}} from Chrome-trace events: complete events (ph X) of the device categories."""
    out: dict[str, dict[str, float]] = {}
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in KERNEL_CATS:
            continue
        row = out.setdefault(str(ev.get("name", "?")), {"ms": 0.0, "calls": 0})
        row["ms"] += float(ev.get("dur", 0.0)) / 1e3  # microseconds in the trace
        row["calls"] += 1
    return out


def read_trace_dir(folder: str) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Every trace file under ``folder`` (``*.json`` / ``*.json.gz``) summed by kernel name, and the files read."""
    files = sorted(f for f in glob.glob(os.path.join(folder, "**", "*.json*"), recursive=True)
                   if f.endswith((".json", ".json.gz")))
    total: dict[str, dict[str, float]] = {}
    for f in files:
        with (gzip.open(f, "rt") if f.endswith(".gz") else open(f)) as fh:
            doc = json.load(fh)
        events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
        for name, row in by_name_from_trace(events).items():
            acc = total.setdefault(name, {"ms": 0.0, "calls": 0})
            acc["ms"] += row["ms"]
            acc["calls"] += row["calls"]
    return total, files


def by_name_from_step_profile(doc: dict[str, Any], variant: int = 0) -> dict[str, dict[str, float]]:
    """{kernel name: {"ms", "calls"}} over every profiler window of one variant of a ``step_profile`` JSON (its
    windows list their top kernels by self device time)."""
    out: dict[str, dict[str, float]] = {}
    for win in doc["variants"][variant].get("windows", []):
        listed = 0.0
        for k in win.get("kernels", []):
            row = out.setdefault(k["name"], {"ms": 0.0, "calls": 0})
            row["ms"] += float(k["self_device_ms"])
            row["calls"] += int(k["calls"])
            listed += float(k["self_device_ms"])
        rest = float(win.get("kernel_ms_total", listed)) - listed
        if rest > 0:  # the window's kernels past its top list: counted, not named
            row = out.setdefault(UNLISTED, {"ms": 0.0, "calls": 0})
            row["ms"] += rest
    return out


def mix(by_name: dict[str, dict[str, float]], tokens: int | None = None, top: int = 15) -> dict[str, Any]:
    """The categories' device ms, shares (and ms per 1,000 tokens with ``tokens``), and the ``top`` kernels."""
    total = sum(r["ms"] for r in by_name.values())
    cats: dict[str, float] = {}
    for name, row in by_name.items():
        cat = categorize(name)
        cats[cat] = cats.get(cat, 0.0) + row["ms"]
    rows = {c: {"ms": ms, "share": ms / total if total else 0.0,
                **({"ms_per_1k_tokens": 1e3 * ms / tokens} if tokens else {})}
            for c, ms in sorted(cats.items(), key=lambda kv: -kv[1])}
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1]["ms"])[:top]
    return {"total_ms": total, "categories": rows,
            "top_kernels": [{"name": n[:160], "category": categorize(n), **r} for n, r in kernels]}


def table(mixes: dict[str, dict[str, Any]]) -> str:
    """The systems' category shares side by side, one line a category (largest first in the first system)."""
    names = list(mixes)
    order: list[str] = []
    for m in mixes.values():
        order += [c for c in m["categories"] if c not in order]
    lines = ["category".ljust(20) + "".join(f"{n:>24}" for n in names)]
    for c in order:
        cells = []
        for n in names:
            r = mixes[n]["categories"].get(c)
            cells.append(f"{r['ms']:10.1f} ms {100 * r['share']:5.1f}%" if r else "-".rjust(24))
        lines.append(c.ljust(20) + "".join(f"{x:>24}" for x in cells))
    lines.append("total".ljust(20) + "".join(f"{mixes[n]['total_ms']:>21.1f} ms" for n in names))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-trace", metavar="DIR", help="vLLM's torch-profiler trace folder")
    p.add_argument("--ray-moe", metavar="JSON", help="a step_profile JSON with profiler windows")
    p.add_argument("--variant", type=int, default=0, help="the step_profile variant (default the first)")
    p.add_argument("--tokens", type=int, default=None, help="tokens both passes processed (for ms per 1k tokens)")
    p.add_argument("--out", metavar="JSON", help="write the mixes here")
    a = p.parse_args(argv)
    if not (a.vllm_trace or a.ray_moe):
        p.error("give --vllm-trace DIR and / or --ray-moe JSON")
    mixes: dict[str, dict[str, Any]] = {}
    sources: dict[str, Any] = {}
    if a.ray_moe:
        with open(a.ray_moe) as fh:
            mixes["ray-moe"] = mix(by_name_from_step_profile(json.load(fh), a.variant), a.tokens)
        sources["ray-moe"] = a.ray_moe
    if a.vllm_trace:
        by_name, files = read_trace_dir(a.vllm_trace)
        if not files:
            p.error(f"--vllm-trace={a.vllm_trace}: no *.json / *.json.gz trace under it")
        mixes["vllm"] = mix(by_name, a.tokens)
        sources["vllm"] = files
    print(table(mixes))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"benchmark": "kernel_mix", "sources": sources, "tokens": a.tokens, "mixes": mixes}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
