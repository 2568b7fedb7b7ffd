"""The shard's host (Python / CPU) time per generation step, by phase, on a CPU: a tiny model, a realistic batch.

    python -m ray_moe_bench.host_profile                                   # 256 requests, mixed prompts, 4 sub-steps
    python -m ray_moe_bench.host_profile --requests 64 --new-tokens 16     # a quicker look
    python -m ray_moe_bench.host_profile --record bench/results/logs/host_profile-cpu-s15.json --label after

One rank in process (``InProcessDeployment`` + ``LocalTransport`` + ``GenerationLoop``), the tiny Qwen3-MoE of
``generate.QUICK`` (2 layers, hidden 64, 8 experts, float32) so the model's compute is small, and the serving
benchmark's mixed workload (256 requests, lognormal prompt lengths of mean 480 clipped to [16, 1536], greedy,
``--new-tokens`` each, EOS ignored), 16k step tokens, 4 decode sub-steps: the step shapes of an H200 serving run.
The shard takes the path it takes on an H200: the step lattice captured at start (``ray_moe_dev.testing.graphs``:
a 'capture' keeps the body and a 'replay' copies the staged inputs into the captured buffers and runs it eagerly,
a piecewise one with its attention holes), the varlen attention backend with the in-place decode path (their per-sequence references
stand in for FlashAttention and the Triton kernel). Prefix caching on (hashes computed, no hits).

Measured (MEASURED, on the shard's generation thread): the self time of each phase (a wrapped function; time in a
nested wrapped function is that one's) in thread CPU time (``time.thread_time``: the in-process driver's threads
hold the GIL at times, a wait that is not the shard's work; on a Ray deployment the driver is another process)
and in wall time, summed per step kind (multi-step decode, one-step decode, prefill / mixed) over the measured
pass and divided by its steps. ``forward`` (the model over a planned layout: the device's work on an H200, graph
replays there) and ``attention_reference`` are NOT host work here; ``host_ms_per_step`` sums every other phase.
This VM's speed drifts between runs: compare runs made back to back (session 15's, before and after, interleaved:
``bench/results/logs/host_profile-cpu-s15.json``). Then a second pass (prompt ids shifted by one: no prefix-cache hit)
under cProfile on the same thread: the top functions by self time, all of them and those outside the model's
forward (``DEVICE_STANDIN``: torch, transformers, the attention references).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import json
import os
import pstats
import subprocess
import threading
import time
from collections import defaultdict
from enum import Enum
from typing import Any, Callable

import torch
from ray_moe_dev.testing.inprocess import InProcessDeployment, LocalTransport

from ray_moe.driver.loop import GenerationLoop
from ray_moe.model.config import RuntimeConfig
from ray_moe.model.sampling import SamplingParams
from ray_moe_bench.common import hardware
from ray_moe_bench.generate import QUICK, QWEN3_30B_A3B
from ray_moe_bench.serving import Workload, workload_spec

class GcMode(str, Enum):
    """The collector's policy in the profiled process: Python's own; the heap frozen after start (what a CUDA
    deployment did up to session 35); frozen and young collections at safe points (a CUDA deployment since)."""

    PYTHON = "python"
    FROZEN = "frozen"
    SAFE_POINTS = "safe-points"


NOT_HOST = ("forward", "attention_reference")  # the device's work on an H200 (phases excluded from host time)
TOP_ROWS = 30
# the model's forward (the device's work on an H200): files, or file:function
DEVICE_STANDIN = ("torch/", "transformers/", "attention.py", "paged_decode.py", "ray_moe/moe/", "kv.py:update",
                  "host.py:forward_rows", "seam.py")


class PhaseClock:
    """Self time of wrapped functions, per step kind and phase, on any thread (a stack per thread): the thread's
    CPU time (``time.thread_time``: waiting for the GIL, which the in-process driver's threads hold at times,
    is not work) and its wall time.

    cpu / wall: {kind: {phase: seconds}}; steps: {kind: launched requests}. The outermost wrapped call of a
    thread names the kind (``kind_of`` on its arguments); nested calls inherit it."""

    WRAPPER = "timed"  # the wrappers' function name (cProfile rows)

    def __init__(self, kind_of: Callable[..., str | None]) -> None:
        self.kind_of = kind_of
        self.cpu: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.wall: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)
        self._local = threading.local()

    def reset(self) -> None:
        self.cpu.clear()
        self.wall.clear()
        self.steps.clear()

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        """Replace ``owner.name`` by a timed wrapper booking its self time under ``phase``."""
        fn = getattr(owner, name)
        clock = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            # 1. push a frame (the kind: the outermost call's, else the caller's)
            stack = getattr(clock._local, "stack", None)
            if stack is None:
                stack = clock._local.stack = []
            kind = stack[-1][0] if stack else (clock.kind_of(phase, *args) or "other")
            if phase == "launch":
                clock.steps[kind] += 1
            # kind, CPU start, wall start, CPU and wall time in nested wrapped calls
            frame = [kind, time.thread_time(), time.perf_counter(), 0.0, 0.0]
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                # 2. book the self time, charge the whole span to the parent's nested time
                stack.pop()
                cpu, wall = time.thread_time() - frame[1], time.perf_counter() - frame[2]
                clock.cpu[kind][phase] += cpu - frame[3]
                clock.wall[kind][phase] += wall - frame[4]
                if stack:
                    stack[-1][3] += cpu
                    stack[-1][4] += wall

        setattr(owner, name, timed)


def step_kind(phase: str, *args: Any) -> str | None:
    """The kind of the step a call belongs to: from the request (``_launch``) or the pending step (complete)."""
    req = args[1] if phase == "launch" else getattr(args[0], "req", None)
    if req is None:
        return None
    work = req.input
    if work.steps > 1:
        return "multi_decode"
    return "decode" if all(it.decode for it in work.items) else "prefill_mixed"


def instrument(clock: PhaseClock, standins: bool = True) -> None:
    """Wrap the phases of a generation step (see the module docstring); ``standins`` (a CPU run): install the
    eager captures (``ray_moe_dev.testing.graphs``: the graphs' bodies replayed eagerly over their static inputs)
    and the attention references as the H200's kernels (on CUDA the real ones run, and a real graph replay is the
    phase ``replay_copy``)."""
    import ray_moe.model.attention as attn
    import ray_moe.model.paged_decode as paged
    import ray_moe.shard.token_steps as gen
    import ray_moe.shard.graph_runner as graph_runner
    import ray_moe.shard.pipeline as pipeline
    from ray_moe.model.host import ModelHost
    from ray_moe.model.kv import PagedKVCache
    from ray_moe.model.piecewise import PiecewiseGraph
    from ray_moe.moe.decode.graphs import CapturedStep
    from ray_moe.shard.pending import GraphPending, MultiPending, PendingStep
    from ray_moe.shard.prefix import ShardPrefixes
    from ray_moe.shard.step_batch import StepBatcher
    from ray_moe_dev.testing.graphs import EagerCapture, EagerGraphs, EagerPiecewise

    # 1. the H200's path on a CPU: the lattice captured (eagerly replayed), varlen attention, in-place decode
    if standins:
        pick = pipeline.DataPaths.pick.__func__
        pipeline.DataPaths.pick = classmethod(lambda cls, *a, **k: dataclasses.replace(pick(cls, *a, **k), capture=True))
        graph_runner.CudaGraphs = EagerGraphs
        attn.check_flash = lambda *a, **k: None
        paged.check_paged = lambda *a, **k: None
        attn.flash_varlen = attn.sequence_reference
        paged.paged_decode = paged.paged_decode_reference
    # 2. the phases
    ex = gen.TokenStepExecutor
    full, pieces = (EagerCapture, EagerPiecewise) if standins else (CapturedStep, PiecewiseGraph)
    for owner, name, phase in [
            (ex, "_launch", "launch"), (ex, "_launch_one", "launch_one"), (StepBatcher, "_resolve", "resolve"),
            (StepBatcher, "_keep_tokens", "keep_tokens"), (ex, "_decode_graph", "graph_step"),
            (ex, "_piecewise", "graph_step"), (ex, "_eager", "forward_eager"), (ex, "finished", "remember"),
            (ShardPrefixes, "trim", "prefix_trim"), (ShardPrefixes, "commit", "prefix_commit"),
            (PagedKVCache, "plan_step", "kv_plan"), (PagedKVCache, "plan_decode_graph", "kv_plan"),
            (pipeline.StepPipeline, "agree_decode", "agree_decode"),
            (full, "replay", "replay_copy"), (pieces, "replay", "replay_copy"), (ModelHost, "forward_rows", "forward"),
            (gen, "sample_tensor", "sample"), (gen, "logprobs_tensor", "sample"),
            (PendingStep, "__init__", "pending_init"), (PendingStep, "complete", "complete"),
            (MultiPending, "complete", "complete"), (GraphPending, "finish", "complete_read"),
            (attn, "sequence_reference", "attention_reference"),
            (paged, "paged_decode_reference", "attention_reference")]:
        clock.wrap(owner, name, phase)
    if standins:
        attn.flash_varlen, paged.paged_decode = attn.sequence_reference, paged.paged_decode_reference


def summarize(clock: PhaseClock, not_host: tuple[str, ...] = NOT_HOST) -> dict[str, Any]:
    """Per step kind: steps, CPU ms per step by phase, host ms per step (CPU; phases not in ``not_host``), and
    the same in wall time."""
    out: dict[str, Any] = {}
    for kind, phases in sorted(clock.cpu.items()):
        n = max(1, clock.steps.get(kind, 0))
        per = {p: round(s * 1e3 / n, 3) for p, s in sorted(phases.items(), key=lambda kv: -kv[1])}
        wall = {p: round(s * 1e3 / n, 3) for p, s in sorted(clock.wall[kind].items(), key=lambda kv: -kv[1])}
        out[kind] = {"steps": clock.steps.get(kind, 0), "cpu_ms_per_step": per,
                     "host_ms_per_step": round(sum(v for p, v in per.items() if p not in not_host), 3),
                     "wall_ms_per_step": wall,
                     "host_wall_ms_per_step": round(sum(v for p, v in wall.items() if p not in not_host), 3)}
    return out


def _standin(func: tuple[str, int, str]) -> bool:
    name = f"{func[0]}:{func[2]}"
    return any(w in name for w in DEVICE_STANDIN)


def top_functions(prof: cProfile.Profile, rows: int = TOP_ROWS, host_only: bool = False) -> list[dict[str, Any]]:
    """cProfile's top functions by self time: name, calls, self ms, cumulative ms. ``host_only``: none named in
    ``DEVICE_STANDIN``, and each one's self time only from callers that are not either (NumPy's and Python's
    built-ins are called from both sides)."""
    st = pstats.Stats(prof, stream=io.StringIO())
    rows_out = []
    for func, (cc, nc, tt, ct, callers) in st.stats.items():
        if host_only:
            if _standin(func) or func[2] == PhaseClock.WRAPPER:  # (the clock's own wrapper: the bench's overhead)
                continue
            if callers:  # (callers: {caller: (calls, primitive calls, self s, cumulative s)})
                nc = sum(v[1] for c, v in callers.items() if not _standin(c))
                tt = sum(v[2] for c, v in callers.items() if not _standin(c))
                ct = sum(v[3] for c, v in callers.items() if not _standin(c))
        rows_out.append((func, nc, tt, ct))
    rows_out.sort(key=lambda r: -r[2])
    return [{"function": f"{os.path.relpath(f) if f.startswith('/') else f}:{line}({fn})", "calls": nc,
             "self_ms": round(tt * 1e3, 2), "cum_ms": round(ct * 1e3, 2)}
            for (f, line, fn), nc, tt, ct in rows_out[:rows]]


def git_state(commit: str | None = None) -> dict[str, Any]:
    """The commit measured and the product files changed in the working tree (uncommitted); ``commit``: given
    (a tree exported from that commit, not a checkout)."""
    if commit:
        return {"commit": commit, "uncommitted": []}
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return ""
    return {"commit": run("git", "rev-parse", "HEAD"),
            "uncommitted": [x for x in run("git", "diff", "--name-only").splitlines() if x]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="host_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", type=Workload, choices=[Workload.MIXED, Workload.CHAT], default=Workload.MIXED,
                   help="mixed (every request --new-tokens) or chat (lognormal output lengths of mean --new-tokens)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-mean", type=int, default=480)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--step-tokens", type=int, default=16384)
    p.add_argument("--max-running", type=int, default=256,
                   help="sequences running at once (1024: the chat workload's decode steps, ray-moe serve's default)")
    p.add_argument("--gc", type=GcMode, choices=list(GcMode), default=GcMode.SAFE_POINTS,
                   help="the collector's policy (default: a CUDA deployment's, frozen with safe points)")
    p.add_argument("--record", metavar="JSON", help="add this run to JSON (under --label)")
    p.add_argument("--label", default="run")
    p.add_argument("--pstats", metavar="FILE", help="also dump the cProfile pass's statistics to FILE")
    p.add_argument("--commit", help="the commit measured, when this runs from an exported tree (no checkout)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: Qwen3-30B-A3B's shapes (random bf16 weights, --layers layers) on the GPU, the real "
                        "kernels and graphs; the whole workload runs once first (warm: every shape captured)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: 48 on cuda, the whole shape; 2 on cpu: the host's per-layer work, "
                        "layer statistics among it, grows with them)")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    a.layers = a.layers or (48 if cuda else 2)
    if a.layers < 1:
        p.error(f"--layers={a.layers}: must be >= 1")
    torch.set_num_threads(1)  # the forward's kernels stay off the profiled thread's cores as much as they can

    # 1. the deployment: one rank, the tiny model on CPU (a cache for every sequence's whole context) or the
    # whole shape on CUDA (the cache sized from memory)
    clock = PhaseClock(step_kind)
    instrument(clock, standins=not cuda)
    work = workload_spec(a.workload, a.requests, a.new_tokens, a.prompt_mean, 0)
    conf = dict(QWEN3_30B_A3B if cuda else QUICK, num_hidden_layers=a.layers)
    layers = conf["num_hidden_layers"]
    prompts = work.prompts(conf["vocab_size"])
    cfg = RuntimeConfig(num_ranks=1, num_experts=conf["num_experts"], hidden_size=conf["hidden_size"],
                        ffn_size=conf["moe_intermediate_size"], top_k=conf["num_experts_per_tok"],
                        slots_per_rank=conf["num_experts"], num_layers=layers, device=a.device,
                        dtype="bfloat16" if cuda else "float32", seed=0, seeded_on_device=cuda, name="host-profile")
    dep = InProcessDeployment(cfg, device=a.device, timeout_s=600)
    tr = LocalTransport(dep)
    news = work.new_tokens_list()
    kv_tokens = None if cuda else 16 * (sum(-(-(len(x) + n) // 16) for x, n in zip(prompts, news)) + 64)
    loop = GenerationLoop(tr, device=a.device, kv_tokens=kv_tokens, block_size=16, max_running=a.max_running, max_queued=4096,
                          random_model=conf, step_tokens=a.step_tokens, decode_steps=a.decode_steps)
    core = dep.cores[0]
    if a.gc is not GcMode.PYTHON:  # as on CUDA (the driver loop and the shard actor do it there)
        loop.gc.freeze()
        if a.gc is GcMode.SAFE_POINTS:
            loop.gc.defer_to_safe_points()
            core.safe_point = loop.gc.safe_point
    made = {n: SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in set(news)}
    params = [made[n] for n in news]
    gen_thread = core._gen_thread
    # on CUDA the forward is the host launching kernels (eager steps, captures): host work too
    not_host = () if cuda else NOT_HOST
    try:
        # 2. a warm pass (small on CPU; the whole workload on CUDA, prompt ids shifted by two), the measured pass
        # (phases), then one under cProfile on the shard's generation thread (prompt ids shifted by one: no
        # prefix-cache hit on the measured pass's blocks)
        warm = [[(t + 2) % conf["vocab_size"] for t in x] for x in prompts] if cuda else [x[:64] for x in prompts[:8]]
        for h in loop.submit_many([(x, p, None) for x, p in zip(warm, params)]):
            h.result(600)
        clock.reset()
        for dq in loop.timings.values():
            dq.clear()
        s0, t0, gc0 = loop.steps, time.perf_counter(), loop.gc_counters()
        outs = [h.result(3600) for h in loop.submit_many([(x, p, None) for x, p in zip(prompts, params)])]
        wall, steps, host = time.perf_counter() - t0, loop.steps - s0, sum(loop.timings["host"])
        gc1 = loop.gc_counters()
        gc_pass = {k: gc1[k] - gc0[k] for k in ("gc_collections", "gc_full_collections", "gc_pause_us",
                                                  "gc_safe_point_collections")}
        device_ms = sum(loop.timings["device"])
        phases = summarize(clock, not_host)
        prof = cProfile.Profile()
        gen_thread.submit(prof.enable).result()
        shifted = [[(t + 1) % conf["vocab_size"] for t in x] for x in prompts]
        for h in loop.submit_many([(x, p, None) for x, p in zip(shifted, params)]):
            h.result(3600)
        gen_thread.submit(prof.disable).result()
    finally:
        loop.close()
        tr.close()

    # 3. the report
    res: dict[str, Any] = {
        "label": a.label, **git_state(a.commit), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "hardware": hardware(), "device": a.device, "model": {k: conf[k] for k in ("num_hidden_layers", "hidden_size", "num_experts",
                                                                  "num_experts_per_tok", "vocab_size")},
        "workload": {"kind": work.kind.value, "requests": work.requests, "new_tokens": work.new_tokens, "prompt_mean": work.prompt_mean,
                     "prompt_tokens": sum(map(len, prompts)), "max_prompt": max(map(len, prompts)),
                     "step_tokens": a.step_tokens, "decode_steps": a.decode_steps},
        "measured": "MEASURED: per-phase self time on the shard's generation thread, per step kind: the thread's "
                    "CPU time (time.thread_time; cpu_ms_per_step) and wall time (perf_counter; wall_ms_per_step, "
                    "GIL waits on the in-process driver's threads included); host_ms_per_step (CPU) and "
                    "host_wall_ms_per_step exclude " + ", ".join(NOT_HOST) + " (the device's work on an H200); "
                    "shard_host_ms_total: the sum of StepResult.host_s (forward included); top_functions: cProfile "
                    "on the same thread over a second pass (prompt ids shifted by one)",
        "wall_s": round(wall, 2), "engine_steps": steps, "output_tokens": sum(map(len, outs)),
        "gc": {**gc_pass, "mode": a.gc.value, "note": "this process's collections in the measured pass (driver and shard: one process "
                                  "here), every thread"},
        "shard_host_ms_total": round(host, 1), "device_ms_total": round(device_ms, 1),
        "host_cpu_ms_total": round(sum(v["host_ms_per_step"] * v["steps"] for v in phases.values()), 1),
        "phases": phases,
        "top_functions": top_functions(prof), "top_functions_host": top_functions(prof, host_only=True)}
    if cuda:
        print(f"device {res['device_ms_total']:.0f} ms; shard host (StepResult.host_s) {host:.0f} ms; host CPU "
              f"(phases) {res['host_cpu_ms_total']:.0f} ms")
    print(f"{res['engine_steps']} steps in {wall:.1f} s ({res['output_tokens']} tokens); commit "
          f"{res['commit'][:7]} {'+ ' + ', '.join(res['uncommitted']) if res['uncommitted'] else '(clean)'}")
    for kind, v in phases.items():
        print(f"  {kind}: {v['steps']} steps, host {v['host_ms_per_step']:.2f} ms/step CPU "
              f"({v['host_wall_ms_per_step']:.2f} wall); " + ", ".join(f"{k} {x:.2f}" for k, x in v["cpu_ms_per_step"].items()))
    print(f"  gc in the measured pass: {gc_pass}")
    print("  top functions outside the forward (self ms, cProfile pass):")
    for r in res["top_functions_host"][:20]:
        print(f"    {r['self_ms']:9.1f} {r['calls']:8d}  {r['function']}")
    if a.pstats:
        prof.dump_stats(a.pstats)
    if a.record:
        body: dict[str, Any] = {"benchmark": "host_profile", "runs": {}}
        if os.path.exists(a.record):
            with open(a.record) as fh:
                body = json.load(fh)
        body.setdefault("runs", {})[a.label] = res
        with open(a.record, "w") as fh:
            json.dump(body, fh, indent=2, default=str)
        print(f"wrote {a.record} [{a.label}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
