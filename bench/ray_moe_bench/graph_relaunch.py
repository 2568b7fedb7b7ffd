"""Does launching a CUDA graph block the host while an earlier launch is still running? (one GPU, no Ray)

    python -m ray_moe_bench.graph_relaunch --out bench/results/logs/s17

Why: through Ray, a serving run's mixed steps spend most of their host time inside the graph replay's launch
(session 17: ~236 of a step's ~248 ms of host time, the thread's CPU spinning), while the decode sub-steps'
replays of one graph back to back return in ~0.1 ms each. This measures, on the device alone, the host wall time
of ``CUDAGraph.replay()`` issued while a launch is still running on the stream, for graphs of two kinds:
``heavy`` (few long kernels: bf16 GEMMs) and ``many`` (many short kernels, a decode step's node count), each
right behind (1) a launch of the SAME graph, (2) a launch of ANOTHER graph of the same kind, and (3) eager
kernels of the same length (no graph in flight). MEASURED: host wall ms of the second launch call (median of
``--reps``), and each graph's device time alone (CUDA events).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from ray_moe_bench.common import hardware, write_result


def _heavy(n: int, size: int) -> Callable[[], torch.Tensor]:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16) / size ** 0.5
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)

    def body() -> torch.Tensor:
        y = x
        for _ in range(n):
            y = y @ a
        return y
    return body


def _many(n: int, numel: int) -> Callable[[], torch.Tensor]:
    x = torch.randn(numel, device="cuda")

    def body() -> torch.Tensor:
        y = x
        for _ in range(n):
            y = y * 1.0001 + 0.0001
        return y
    return body


def _capture(body: Callable[[], torch.Tensor]) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # warm-up (cuBLAS workspaces, allocator)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    torch.cuda.synchronize()
    return g


def _device_ms(run: Callable[[], object]) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    run()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _second_launch_ms(first: Callable[[], object], second: Callable[[], object], reps: int) -> float:
    """Host wall ms of ``second()`` issued right after ``first()`` (still running on the device)."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        first()
        t = time.perf_counter()
        second()
        out.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("graph_relaunch: needs a CUDA GPU")
        return 2
    kinds = {"heavy": lambda: _heavy(60, 8192), "many": lambda: _many(3000, 1 << 22)}
    res: dict = {"hardware": hardware(), "reps": a.reps, "kinds": {}}
    for kind, make in kinds.items():
        body = make()
        g1, g2 = _capture(body), _capture(body)
        row = {"nodes": 60 if kind == "heavy" else 6000,
               "device_ms_graph": _device_ms(g1.replay), "device_ms_eager": _device_ms(body),
               "host_ms_launch_idle_device": _second_launch_ms(lambda: None, g1.replay, a.reps),
               "host_ms_same_graph_behind_itself": _second_launch_ms(g1.replay, g1.replay, a.reps),
               "host_ms_other_graph_behind_one": _second_launch_ms(g1.replay, g2.replay, a.reps),
               "host_ms_graph_behind_eager_kernels": _second_launch_ms(body, g1.replay, a.reps)}
        res["kinds"][kind] = row
        print(kind, json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
        del g1, g2
        torch.cuda.synchronize()
    write_result("graph_relaunch", res, out=a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
