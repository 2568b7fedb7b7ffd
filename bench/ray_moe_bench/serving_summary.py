"""One lease's serving comparison in one table: every workload's result JSON of ray-moe and vLLM (written by
``bench/run_h200.sh serving-ray`` / ``serving-vllm`` under ``<dir>/<system>/<workload>[-online]/``) read back
into ``<dir>/summary.json``, and printed.

    python -m ray_moe_bench.serving_summary DIR [--what TEXT]

READ, never computed anew: tokens/s, start, the timed pass's graph counters, TTFT / TPOT p50 / p99 (online), the
step paths ray-moe reported at start, each system's non-defaults.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Any

SYSTEMS = ("ray_moe", "vllm")


def _load(folder: str, system: str, workload: str) -> dict[str, Any] | None:
    """The system's entry of the first result JSON in ``folder/system/workload`` (None: none there)."""
    for path in sorted(glob.glob(os.path.join(folder, system, workload, "*.json"))):
        with open(path) as fh:
            return json.load(fh)["systems"].get(system)
    return None


def _pcts(entry: dict[str, Any], key: str) -> list[float] | None:
    lat = (entry.get("latency") or {}).get(key)
    return None if not lat or "p50_ms" not in lat else [lat["p50_ms"], lat["p99_ms"]]


def summarize(folder: str) -> dict[str, Any]:
    """{workload: figures of both systems, their ratio}, the start report of ray-moe and each system's
    non-defaults."""
    names = sorted({os.path.basename(p) for s in SYSTEMS for p in glob.glob(os.path.join(folder, s, "*"))
                    if os.path.isdir(p)})
    out: dict[str, Any] = {"workloads": {}, "non_defaults": {}}
    for w in names:
        got = {s: _load(folder, s, w) for s in SYSTEMS}
        row: dict[str, Any] = {}
        for s, e in got.items():
            if e is None:
                continue
            row.update({"requests": e.get("requests"), "prompt_tokens": e.get("prompt_tokens"),
                        "output_tokens": e.get("output_tokens"), f"{s}_status": e.get("status"),
                        f"{s}_output_tokens_per_s": e.get("output_tokens_per_s"), f"{s}_wall_s": e.get("wall_s"),
                        f"{s}_start_s": e.get("start_s"), f"{s}_mismatched_requests": e.get("mismatched_requests")})
            if _pcts(e, "ttft"):
                row[f"{s}_ttft_p50_p99_ms"], row[f"{s}_tpot_p50_p99_ms"] = _pcts(e, "ttft"), _pcts(e, "tpot")
            if s == "ray_moe":
                row["ray_moe_timed_pass_graphs"] = (e.get("timed_pass_graphs") or {}).get("total")
                hw = e.get("host_work") or {}
                row["ray_moe_host_over_device"] = hw.get("host_over_device")
                gc = e.get("shard_gc") or {}  # the shards' collector pauses in the timed pass, summed
                row["ray_moe_shard_gc_pause_ms"] = (sum(g.get("gc_pause_us", 0) for g in gc.values()) / 1e3
                                                    if gc else None)
                out.setdefault("ray_moe_start", {"start_s": e.get("start_s"), "capture_s": e.get("capture_s"),
                                                 "step_paths": e.get("step_paths"),
                                                 "engine_warnings": e.get("engine_warnings")})
            out["non_defaults"].setdefault(s, e.get("non_defaults"))
        a, b = row.get("ray_moe_output_tokens_per_s"), row.get("vllm_output_tokens_per_s")
        row["ratio"] = a / b if a and b else None
        out["workloads"][w] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--what", default="", help="what the lease ran (commit, card, date): the summary's first field")
    args = ap.parse_args(argv)
    res = {"what": args.what, **summarize(args.folder)}
    with open(os.path.join(args.folder, "summary.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    for w, r in res["workloads"].items():
        ratio = r.get("ratio")
        line = (f"{w:14s} ray-moe {r.get('ray_moe_output_tokens_per_s') or 0:9,.0f}  vLLM "
                f"{r.get('vllm_output_tokens_per_s') or 0:9,.0f}  " + (f"{ratio:.2f}x" if ratio else "-"))
        for s in SYSTEMS:
            if f"{s}_ttft_p50_p99_ms" in r:
                line += (f"  {s} TTFT {r[f'{s}_ttft_p50_p99_ms'][0]:.0f}/{r[f'{s}_ttft_p50_p99_ms'][1]:.0f} TPOT "
                         f"{r[f'{s}_tpot_p50_p99_ms'][0]:.1f}/{r[f'{s}_tpot_p50_p99_ms'][1]:.1f} ms")
        print(line + f"  graphs {(r.get('ray_moe_timed_pass_graphs') or {}).get('captures_serving')}")
    return res


if __name__ == "__main__":
    main()
