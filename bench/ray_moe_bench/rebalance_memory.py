"""Device memory during a live rebalance: the experts held once in slot buffers, a migration within the staging rows.

    python -m ray_moe_bench.rebalance_memory                  # Qwen3-30B-A3B experts, 48 layers, 2 ranks on one GPU
    python -m ray_moe_bench.rebalance_memory --quick          # CPU smoke run (tiny shapes; no memory counters)

In process (no Ray): two ranks of one deployment share one device (``InProcessDeployment``; the local exchange
moves rows between them), the seeded experts drawn there. A skewed load is recorded, EPLB proposes a placement
with the hot experts replicated on the other rank, and ``ControlPlane.apply`` reserves, copies, verifies,
publishes, drains and retires it while a thread keeps running expert-only steps on the active generation.
Reported: the slot buffers' bytes (every held expert plus the staging rows: the bound), the allocator's bytes
after start, its peak during the rebalance (torch's ``max_memory_allocated`` since just before it) and after,
the steps served during it (none failing), the rows the migration copied and whether any buffer grew.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from ray_moe.core.errors import StaleGenerationError
from ray_moe.core.types import Phase
from ray_moe.model.config import RuntimeConfig
from ray_moe_bench.common import add_output_argument, host_kind, write_result
from ray_moe_dev.testing.inprocess import InProcessDeployment

SHAPE = {"num_experts": 128, "hidden_size": 2048, "ffn_size": 768, "top_k": 8}  # Qwen3-30B-A3B's experts
QUICK = {"num_experts": 8, "hidden_size": 16, "ffn_size": 24, "top_k": 2}


def _allocated(device: str) -> int | None:
    return torch.cuda.memory_allocated() if device == "cuda" else None


def run(layers: int, quick: bool, device: str, tokens: int) -> dict[str, Any]:
    shape = QUICK if quick else SHAPE
    e = shape["num_experts"]
    cfg = RuntimeConfig(num_ranks=2, slots_per_rank=e // 2 + max(1, e // 16), num_layers=layers, device=device,
                        dtype="bfloat16" if device == "cuda" else "float32", seed=0, staging_slots=2,
                        seeded_on_device=device == "cuda", decode_token_capacity=tokens, cuda_graphs=False, **shape)
    # no CUDA graphs: both ranks share this process and device here, and two threads capturing decode graphs
    # while they exchange rows with each other stalled the run on the GPU (each rank is its own process and
    # GPU in a deployment); the benchmark measures memory, not speed. cuda_graphs=False also keeps the dispatch
    # plans uncaptured: with captures taking turns (session 14), one rank's plan capture still failed while the
    # other launched kernels on the legacy stream ("operation would make the legacy stream depend on a capturing
    # blocking stream", session 15)
    t0 = time.perf_counter()
    # exchange waits of 60 s: a rank that fails leaves its peer waiting that long, then the step reports the error
    # (with 600 s the GPU run looked like a hang: twice past its limit with nothing printed after the start)
    dep = InProcessDeployment(cfg, device=device, timeout_s=60)
    start_s = time.perf_counter() - t0
    print(f"started in {start_s:.1f} s", flush=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, shape["hidden_size"], generator=g).to(dtype)

    def buffers() -> dict[str, int]:
        st = {r: c.status() for r, c in dep.cores.items()}
        return {"bytes": sum(int(s["weight_bytes"]) for s in st.values()),
                "grows": sum(int(s["slot_buffer_grows"]) for s in st.values()),
                "rows": sum(b["capacity"] for s in st.values() for b in s["slot_buffers"].values()),
                "used": sum(b["used"] for s in st.values() for b in s["slot_buffers"].values())}

    y, res = dep.step(hidden, phase=Phase.DECODE)  # one step of each kind before: the allocator's working set
    if dep.errors(res):
        raise SystemExit(f"the first decode step failed: {dep.errors(res)}")
    print("first decode step served", flush=True)
    _, res = dep.step(hidden, phase=Phase.PREFILL)
    if dep.errors(res):
        raise SystemExit(f"the first prefill step failed: {dep.errors(res)}")
    if device == "cuda":
        torch.cuda.synchronize()
    before, after_start = buffers(), _allocated(device)
    # a skewed load on the last experts of every layer (the initial placement's spare slots replicate the
    # first ones): EPLB replicates the hot ones onto the other rank, rows copied into its staging rows
    load = np.ones((layers, e), dtype=np.int64)
    load[:, e - 1], load[:, e // 2 - 1] = 40 * e, 20 * e
    dep.plane.record_load(load, phase="decode", generation=dep.generation)
    proposal = dep.plane.propose_rebalance()
    print(f"proposal ready at {time.perf_counter() - t0:.1f} s; applying it under traffic", flush=True)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    served, stale, failed, stop = [0], [0], [], threading.Event()

    def traffic() -> None:  # live: steps keep running on the active generation while the rebalance stages
        while not stop.is_set():
            gen = dep.plane.active_generation()
            _, r = dep.step(hidden, phase=Phase.DECODE, generation=gen)
            errs = dep.errors(r)
            if errs and all(isinstance(x, StaleGenerationError) for x in errs.values()):
                stale[0] += 1  # pinned the generation just retired: a driver re-plans on the new one, as here
            elif errs:
                failed.append(str(errs))
            else:
                served[0] += 1

    th = threading.Thread(target=traffic, daemon=True)
    th.start()
    t1 = time.perf_counter()
    try:
        rep = dep.plane.apply(proposal, reason="rebalance")
    finally:
        stop.set()
        th.join(timeout=120)
    dep.generation = rep.new_generation
    rebalance_s = time.perf_counter() - t1
    if device == "cuda":
        torch.cuda.synchronize()
    peak, after = (torch.cuda.max_memory_allocated(), _allocated(device)) if device == "cuda" else (None, None)
    y2, res2 = dep.step(hidden, phase=Phase.DECODE)
    assert not dep.errors(res2), dep.errors(res2)
    later = buffers()
    out = {"layers": layers, "shape": shape, "ranks": 2, "slots_per_rank": cfg.slots_per_rank,
           "staging_slots": cfg.staging_slots, "tokens_per_step": tokens, "start_s": start_s,
           "slot_buffers_before": before, "slot_buffers_after": later,
           "allocated_after_start_bytes": after_start, "peak_during_rebalance_bytes": peak,
           "allocated_after_rebalance_bytes": after, "rebalance_s": rebalance_s,
           "steps_served_during": served[0], "stale_retries_during": stale[0], "steps_failed_during": failed[:3],
           "new_generation": rep.new_generation,
           "report": {k: v for k, v in vars(rep).items() if isinstance(v, (int, float, str, dict, list, tuple))}}
    if not rep.copies:
        raise SystemExit(f"the rebalance copied no expert ({out['report']}): nothing measured")
    if peak is not None:
        out["peak_over_slot_buffers"] = peak / before["bytes"]
        out["peak_minus_after_start_bytes"] = peak - after_start
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rebalance_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, 2 layers")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--tokens", type=int, default=256, help="rows per traffic step (decode-sized)")
    p.add_argument("--stall-dump", type=float, default=0.0,
                   help="seconds after which every thread's stack is printed and the run exits (0: never)")
    add_output_argument(p)
    a = p.parse_args(argv)
    device = "cpu" if a.quick or not torch.cuda.is_available() else "cuda"
    if a.stall_dump > 0:  # a stalled run prints where every thread is (then exits) instead of a silent timeout
        faulthandler.dump_traceback_later(a.stall_dump, exit=True, file=sys.stderr)
    res = run(2 if a.quick else a.layers, a.quick, device, 16 if a.quick else a.tokens)
    faulthandler.cancel_dump_traceback_later()
    res.update(quick=a.quick, device=device)
    for k in ("slot_buffers_before", "slot_buffers_after", "allocated_after_start_bytes",
              "peak_during_rebalance_bytes", "allocated_after_rebalance_bytes", "peak_over_slot_buffers",
              "rebalance_s", "steps_served_during", "stale_retries_during", "steps_failed_during", "report"):
        print(f"{k}: {res.get(k)}", flush=True)
    path = write_result("rebalance_memory", res, suffix="cpu-quick" if a.quick else f"{host_kind()}-{res['layers']}l",
                        out=a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
