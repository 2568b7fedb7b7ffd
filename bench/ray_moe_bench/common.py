"""Shared benchmark plumbing: environment description, timers, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from typing import Any, Callable

import torch


def hardware() -> dict[str, Any]:
    """What ran the benchmark."""
    info: dict[str, Any] = {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import ray

        info["ray"] = ray.__version__
    except Exception:  # noqa: BLE001
        info["ray"] = None
    try:
        import cupy

        info["cupy"] = cupy.__version__
        from cupy.cuda import nccl

        info["nccl"] = nccl.get_version()
    except Exception:  # noqa: BLE001
        pass
    return info


def host_kind() -> str:
    """Short label used in result file names: ``cpu`` or ``h200x2`` style."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower()
        short = "h200" if "h200" in name else name.replace("nvidia", "").strip().split()[0]
        return f"{short}x{torch.cuda.device_count()}"
    return "cpu"


def add_output_argument(parser: argparse.ArgumentParser) -> None:
    """``--out DIR``: where this run writes its result JSON."""
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="folder for the result JSON (default: $RAY_MOE_RESULTS_DIR, else ./ray-moe-results)")


def results_dir(out: str | None = None) -> str:
    """The folder a run writes to: ``out`` (``--out``), else ``RAY_MOE_RESULTS_DIR``, else ``./ray-moe-results``.

    The repository's tracked ``bench/results/`` is written only when named explicitly (``bench/run_h200x2.sh``)."""
    if out is None:  # (the product's env reader: imported only when needed, so --out runs need no pydantic)
        from ray_moe.core.env import read_env

        out = read_env().results_dir
    path = out
    os.makedirs(path, exist_ok=True)
    return path


def write_result(name: str, payload: dict[str, Any], *, suffix: str | None = None, out: str | None = None) -> str:
    """Write ``<results dir>/<name>-<host>.json`` with hardware and timestamp added; returns the path."""
    body = {
        "benchmark": name,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware(),
        **payload,
    }
    path = os.path.join(results_dir(out), f"{name}-{suffix or host_kind()}.json")
    with open(path, "w") as fh:
        json.dump(body, fh, indent=2, sort_keys=False, default=str)
    return path


def time_fn(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 10, cuda: bool | None = None) -> dict[str, float]:
    """Wall time of ``fn`` (CUDA-synchronised when on GPU): median/min/p90 in milliseconds."""
    return time_interleaved({"fn": fn}, warmup=warmup, iters=iters, cuda=cuda)["fn"]


def time_interleaved(fns: dict[str, Callable[[], Any]], *, warmup: int = 3, iters: int = 10,
                     cuda: bool | None = None) -> dict[str, dict[str, float]]:
    """``time_fn`` for several functions measured in alternating rounds (A B C A B C ...), so clock,
    thermal and allocator drift over the run hits every candidate alike (a fair same-run baseline)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    if cuda:
        torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for name, xs in samples.items():
        xs.sort()
        out[name] = {"median_ms": statistics.median(xs), "min_ms": xs[0],
                     "p90_ms": xs[min(len(xs) - 1, int(0.9 * len(xs)))], "iters": iters}
    return out


def nearest_rank(samples: list[float], q: float) -> float:
    """Nearest-rank quantile x_(ceil(q n)) (spec 0x0DA)."""
    import math

    xs = sorted(samples)
    if not xs:
        raise ValueError("samples: empty")
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


# ------------------------------------------------------------------ SPMD benchmarks (one exchange per rank)
def build_snapshot(world: int, num_experts: int):
    """E experts in E slots, slot q on rank q * P // E (E / P contiguous slots per rank, no replicas)."""
    from ray_moe.placement.manifest import manifest_from_assignment
    from ray_moe.placement.snapshot import PlacementSnapshot
    from ray_moe.placement.topology import ProcessGroupSpec, Topology

    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} must be a multiple of world={world}")
    topo = Topology.single_node(world)
    manifest = manifest_from_assignment(generation=0, phy2log=[list(range(num_experts))],
                                        slot_rank=[[q * world // num_experts for q in range(num_experts)]],
                                        num_experts=num_experts, topology=topo)
    return PlacementSnapshot.from_manifest(manifest, topo, ProcessGroupSpec.identity(world))


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spmd_barrier(exchange: Any, device: torch.device, tag: str) -> None:
    """Every rank reaches this point (a control all-gather; on NCCL it also waits for the stream)."""
    import numpy as np

    exchange.all_gather(tag, np.zeros(1, dtype=np.int64))
    device_sync(device)


def timed_ms(device: torch.device, fn: Callable[[], Any]) -> float:
    """Milliseconds of one call: CUDA events on a GPU, the host clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def spmd_measure(exchange: Any, device: torch.device, label: str, step: Callable[[str], Any], *, warmup: int,
                 iters: int) -> list[float]:
    """Per-iteration milliseconds of ``step(tag)`` on this rank: warmup, then (barrier, timed step) x iters."""
    for i in range(warmup):
        step(f"{label}/w{i}")
    device_sync(device)
    samples = []
    for i in range(iters):
        spmd_barrier(exchange, device, f"{label}/b{i}")
        samples.append(timed_ms(device, lambda: step(f"{label}/i{i}")))
    return samples


def step_stats(per_rank: list[list[float]]) -> dict[str, float]:
    """Per-iteration maximum over ranks, then median / p10 / p90 / min of those step times (ms)."""
    import math

    steps = sorted(max(vals) for vals in zip(*per_rank))
    n = len(steps)
    return {"median_ms": statistics.median(steps), "p10_ms": steps[int(0.1 * (n - 1))],
            "p90_ms": steps[math.ceil(0.9 * (n - 1))], "min_ms": steps[0], "iters": n}



# ------------------------------------------------------------------ serving metrics
def latency_summary_ms(samples_s: list[float]) -> dict[str, float | int] | None:
    """Seconds in, milliseconds out: ``{"p50_ms", "p99_ms", "mean_ms", "count"}`` (nearest-rank quantiles);
    None for no samples."""
    if not samples_s:
        return None
    return {"p50_ms": nearest_rank(samples_s, 0.50) * 1e3, "p99_ms": nearest_rank(samples_s, 0.99) * 1e3,
            "mean_ms": statistics.fmean(samples_s) * 1e3, "count": len(samples_s)}


def nvidia_smi_used_mib() -> list[int] | None:
    """Used memory of every GPU in MiB as nvidia-smi reports it (all processes); None without nvidia-smi."""
    return nvidia_smi_mib("memory.used")


def nvidia_smi_mib(field: str) -> list[int] | None:
    """``field`` (memory.used, memory.total) of every GPU in MiB as nvidia-smi reports it, without touching CUDA
    in this process; None without nvidia-smi."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={field}", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        return [int(float(x)) for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class GpuMemorySampler:
    """Peak nvidia-smi used memory per GPU while it runs (a background thread polling every ``interval_s``):
    ``with GpuMemorySampler() as s: ...`` then ``s.report()`` (baseline, peak and peak - baseline in MiB, or
    None without nvidia-smi)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        import threading

        self.interval_s = interval_s
        self.baseline = nvidia_smi_used_mib()
        self.peak = list(self.baseline) if self.baseline else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="gpu-memory-sampler", daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = nvidia_smi_used_mib()
            if now and self.peak and len(now) == len(self.peak):
                self.peak = [max(a, b) for a, b in zip(self.peak, now)]

    def __enter__(self) -> GpuMemorySampler:
        if self.baseline is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def report(self) -> dict[str, list[int]] | None:
        if self.baseline is None or self.peak is None:
            return None
        return {"baseline_mib": self.baseline, "peak_mib": self.peak,
                "peak_minus_baseline_mib": [p - b for p, b in zip(self.peak, self.baseline)]}
