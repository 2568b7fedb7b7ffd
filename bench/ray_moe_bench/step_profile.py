"""Where a serving step's time goes, in process (no Ray): per-step device time, the plan each step ran, and kernel tables from the shard's generation thread.

    python -m ray_moe_bench.step_profile --quick                             # CPU smoke (< 60 s): tiny model
    python -m ray_moe_bench.step_profile --layers 48 --variants 0:0,4096:8
    python -m ray_moe_bench.step_profile --workload decode-heavy --windows 10:14,40:44 --out bench/results
    python -m ray_moe_bench.step_profile --checkpoint /tmp/ray-moe-fp8/qwen3-30b-a3b --workload decode-heavy \
        --windows 20:21                                              # a checkpoint's model (an FP8 one, say)

One rank, ``InProcessDeployment`` + ``LocalTransport`` + ``GenerationLoop`` in this process (Qwen3-30B-A3B's
shapes with random weights and ``--layers`` decoder layers on CUDA; the tiny Qwen3-MoE in float32 on CPU with
``--quick``; ``--checkpoint``: a Hugging Face folder's model as ``RuntimeConfig.from_pretrained`` reads it, every
layer, an FP8 one served in FP8), the serving benchmark's seeded workload, greedy, exactly ``new_tokens`` per request (EOS ignored).
Each variant S:D (step tokens : decode steps; 0 = the product's default) captures its own step lattice (the token
sizes follow the step tokens; the previous variant's graphs released), runs one warm pass, then one measured pass
of the whole workload at those settings.
Reported per variant (MEASURED): wall seconds, output tokens and tokens/s, engine steps, every step's device ms
(the slowest rank's, ``loop.timings``), the loop's timing medians, the plan every step ran (decode items, prefill
tokens, decode sub-steps, requests still waiting when it was launched), the graph counters' change, memory
backoffs and events. ``--windows a:b,...``: one more pass per variant with torch.profiler over its steps a..b-1
(started when step a is launched, stopped when step b-1's results are in; pipelined neighbours may leak in),
started and stopped on the shard's generation thread (CPU ops are recorded per thread; on CPU there are no
kernels): the top kernels by self device time and the top CPU ops by self CPU time, as data.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from ray_moe_dev.testing.inprocess import InProcessDeployment, LocalTransport

from ray_moe.driver.defaults import DEFAULT_DECODE_STEPS_CUDA, DEFAULT_STEP_TOKENS
from ray_moe.driver.loop import GenerationLoop
from ray_moe.model.config import RuntimeConfig
from ray_moe.model.sampling import SamplingParams
from ray_moe_bench.common import add_output_argument, host_kind, write_result
from ray_moe_bench.generate import QUICK, QWEN3_30B_A3B
from ray_moe_bench.serving import add_workload_arguments, host_share, workload_spec

TOP_ROWS = 80
# the ops whose copies and gathers a window lists by input shape (long's kernel mix at 0114027: copies and elementwise
# kernels 113 ms against vLLM's 28, among them 2,463 device-to-device copies and 274 gathers of unknown origin)
MEMORY_OPS = ("aten::copy_", "aten::index_select", "aten::gather", "aten::index", "aten::index_copy_", "aten::cat",
              "aten::add", "aten::mul", "aten::where", "aten::fill_", "aten::zero_", "aten::clone", "aten::contiguous")


def parse_ints(text: str, n: int, flag: str) -> list[tuple[int, ...]]:
    """``a:b[:c],...`` -> [(a, b, ...)], ``n`` non-negative ints each; a bad item raises ValueError naming ``flag``."""
    out = [tuple(int(x) if x.isdigit() else -1 for x in part.split(":")) for part in text.split(",") if part.strip()]
    windows = flag == "--windows"
    bad = [t for t in out if len(t) != n or min(t) < 0 or (not windows and t[1] > 64) or (windows and t[0] >= t[1])]
    if bad or (windows and any(a[1] > b[0] for a, b in zip(sorted(out), sorted(out)[1:]))):
        raise ValueError(f"{flag}={text!r}: want " + ("a:b with 0 <= a < b, windows not overlapping" if windows else
                                                        "S:D with S >= 0, 0 <= D <= 64"))
    return sorted(out) if windows else out


def profile_rows(prof: torch.profiler.profile) -> dict[str, Any]:
    """The top kernels (self device time) and CPU ops (self CPU time) of one window, in ms, and the memory ops
    (``MEMORY_OPS``) by input shapes with the device time of the kernels and copies they issued (ops run eagerly:
    a replayed graph's are inside its launch)."""
    ka = prof.key_averages()
    cuda = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu = [e for e in ka if e.device_type == torch.autograd.DeviceType.CPU]
    cuda.sort(key=lambda e: e.self_device_time_total, reverse=True)
    cpu.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    mem = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type == torch.autograd.DeviceType.CPU and e.key in MEMORY_OPS]
    mem.sort(key=lambda e: e.device_time_total, reverse=True)
    return {"kernel_ms_total": sum(e.self_device_time_total for e in cuda) / 1e3,
            "kernels": [{"name": e.key, "self_device_ms": e.self_device_time_total / 1e3, "calls": e.count}
                        for e in cuda[:TOP_ROWS]],
            "cpu_ops": [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                        for e in cpu[:TOP_ROWS]],
            "memory_ops": [{"name": e.key, "input_shapes": plain_shapes(e.input_shapes or []),
                            "device_ms": e.device_time_total / 1e3, "calls": e.count} for e in mem[:TOP_ROWS]]}


def plain_shapes(shapes: Any) -> Any:
    """The profiler's input shapes as JSON: ints, lists of them, nested for a tensor list's operand (``cat``)."""
    if isinstance(shapes, (list, tuple)):
        return [plain_shapes(s) for s in shapes]
    return int(shapes) if isinstance(shapes, int) else str(shapes)


class RecordingTransport(LocalTransport):
    """A ``LocalTransport`` that books the plan of every step it launches (a pass's ``plans``) and runs
    profiler windows over steps [a, b) of a pass, on rank 0's generation thread (CPU ops are per thread)."""

    def __init__(self, dep: InProcessDeployment) -> None:
        super().__init__(dep)
        self.waiting: Callable[[], int] = lambda: 0  # requests not admitted yet (set once the loop exists)
        self.start_pass(())

    def start_pass(self, windows: Sequence[tuple[int, int]]) -> None:
        self.launched = self.gathered = 0
        self.plans: list[list[int]] = []
        self.windows: list[dict[str, Any]] = []
        self._todo, self._open = list(windows), None

    def _gen(self, fn: Callable[[], Any]) -> None:
        self.dep.cores[0]._gen_thread.submit(fn).result()

    def launch(self, reqs: Mapping[int, Any]) -> dict:
        if self._open is None and self._todo and self.launched >= self._todo[0][0]:
            a, b = self._todo.pop(0)
            acts = [x for x in (torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA)
                    if x in torch.profiler.supported_activities()]
            prof = torch.profiler.profile(activities=acts, record_shapes=True)
            self._gen(prof.__enter__)
            self._open = {"steps": [a, b], "first": self.launched, "t0": time.perf_counter(), "prof": prof}
        items = [it for req in reqs.values() for it in req.input.items]
        self.plans.append([sum(it.decode for it in items), sum(len(it.tokens) for it in items if not it.decode),
                           max((req.input.steps for req in reqs.values()), default=1), self.waiting()])
        self.launched += 1
        return super().launch(reqs)

    def gather(self, step_id: str, reqs: Mapping[int, Any], handles: Mapping[int, Any]) -> dict:
        try:
            return super().gather(step_id, reqs, handles)
        finally:
            self.gathered += 1
            if self._open is not None and self.gathered >= self._open["steps"][1]:
                self.stop_window()

    def stop_window(self) -> None:
        w, self._open = self._open, None
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        self._gen(lambda: (sync(), w["prof"].__exit__(None, None, None)))
        self.windows.append({"steps": w["steps"], "first_step": w["first"], "prof": w["prof"],
                             "steps_collected": self.gathered - w["first"],
                             "wall_ms": (time.perf_counter() - w["t0"]) * 1e3})

    def finish(self) -> list[dict[str, Any]]:
        """Close an open window, summarise every one (windows never reached are reported as missed)."""
        if self._open is not None:
            self.stop_window()
        done = [{**{k: v for k, v in w.items() if k != "prof"}, **profile_rows(w["prof"])} for w in self.windows]
        return done + [{"steps": [a, b], "missed": True} for a, b in self._todo]


def run_pass(loop: Any, tr: Any, prompts: list[list[int]], params: Any,
             windows: Sequence[tuple[int, int]] = ()) -> tuple[list[list[int]], float, int]:
    """Every prompt submitted at once; (outputs, wall seconds, engine steps)."""
    tr.start_pass(windows)
    s0, t0 = loop.steps, time.perf_counter()
    outs = [h.result(3600) for h in [loop.submit(p, q) for p, q in zip(prompts, params)]]
    return outs, time.perf_counter() - t0, loop.steps - s0


def run_variant(dep: Any, loop: Any, tr: Any, prompts: list[list[int]], params: Any, variant: tuple[int, int],
                windows: Sequence[tuple[int, int]], warmup: bool, device: str) -> dict[str, Any]:
    from ray_moe.shard.lattice import StepLattice

    st, ds = variant
    core = dep.cores[0]
    gen, sched = core.generator, loop.scheduler
    st = st or DEFAULT_STEP_TOKENS["cuda" if device == "cuda" else "cpu"]
    ds = ds or (DEFAULT_DECODE_STEPS_CUDA if device == "cuda" else 1)
    sched.step_tokens, sched.decode_steps = st, ds
    sched.configured = (st, sched.max_running)  # what a memory backoff recovers to
    core.release_graphs(dep.generation)  # this variant's own lattice (its token sizes follow the step tokens)
    if device == "cuda":
        torch.cuda.empty_cache()
    gen.configure(StepLattice.build(loop.rank_running, st), core.paths)
    capture = core.prepare_steps()["capture"]
    if capture.get("errors"):  # a failed capture leaves its kind eager: the variant's figures are then not the product's
        print(f"variant S={st} D={ds}: CAPTURE FAILED, steps of that kind run eagerly: {capture['errors']}", flush=True)

    def counters_since(c0: dict[str, int]) -> dict[str, int]:
        return {k: v - c0.get(k, 0) for k, v in gen.pipeline.counters.items() if v != c0.get(k, 0)}

    res: dict[str, Any] = {"step_tokens": st, "decode_steps": ds, "capture": capture, "warm": None}
    if warmup:
        c0 = dict(gen.pipeline.counters)
        _, w, n = run_pass(loop, tr, prompts, params)
        res["warm"] = {"wall_s": w, "steps": n, "graph_counters": counters_since(c0)}
    for dq in loop.timings.values():
        dq.clear()
    loop.memory_events.clear()
    c1, b0 = dict(gen.pipeline.counters), sched.backoffs
    outs, wall, steps = run_pass(loop, tr, prompts, params)
    ntok = sum(len(o) for o in outs)
    dev = list(loop.timings["device"])
    mixed = [k for k, p in enumerate(tr.plans) if p[1] > 0]  # steps with prompt tokens (prefill / mixed)
    per = {k: list(loop.timings[k]) for k in ("host", "replay", "device")}
    aligned = all(len(v) == len(tr.plans) for v in per.values())
    res.update(wall_s=wall, output_tokens=ntok, output_tokens_per_s=ntok / wall, steps=steps, device_ms=dev,
               device_ms_complete=len(dev) == steps, device_ms_sum=sum(dev), timing_medians_ms=loop.timing_summary(),
               host_work=host_share(loop.timings),
               host_work_mixed_steps=host_share({k: [v[i] for i in mixed] for k, v in per.items()}) if aligned else None,
               plans=tr.plans, plan_fields=["decode_items", "prefill_tokens", "sub_steps", "queued"],
               graph_counters=counters_since(c1), graphs=len(gen.pipeline.graphs), backoffs=sched.backoffs - b0,
               memory_events=list(loop.memory_events))
    if device == "cuda":
        res["memory_reserved_gb"] = torch.cuda.memory_reserved() / 1e9
    print(f"variant S={st} D={ds}: warm {res['warm'] and round(res['warm']['wall_s'], 2)} s; measured "
          f"{wall:.2f} s, {steps} steps, {ntok / wall:.0f} tok/s, device sum {sum(dev) / 1e3:.2f} s; "
          f"counters {res['graph_counters']}; backoffs {res['backoffs']}", flush=True)
    hw, hm = res["host_work"], res["host_work_mixed_steps"] or {}
    print(f"  host over device time: {hw['host_over_device']} (outside graph replays "
          f"{hw['host_outside_replays_over_device']}; steps with prompt tokens: {hm.get('host_over_device')} / "
          f"{hm.get('host_outside_replays_over_device')})", flush=True)
    print("  device ms per step:", " ".join(f"{x:.1f}" for x in dev), flush=True)
    print("  plans (decode/prefill/sub-steps/queued):", " ".join("/".join(map(str, p)) for p in tr.plans), flush=True)
    res["windows"] = []
    if windows:
        run_pass(loop, tr, prompts, params, windows)
        res["windows"] = tr.finish()
        for w in res["windows"]:
            top = ", ".join(f"{r['name'][:40]} {r['self_device_ms']:.2f}" for r in w.get("kernels", [])[:5])
            print(f"  window {w['steps']}: " + ("missed (the pass ended first)" if w.get("missed") else
                  f"{w['steps_collected']} steps in {w['wall_ms']:.1f} ms; kernels {w['kernel_ms_total']:.1f} ms "
                  f"({top or 'none'})"), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="step_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, float32, 2 layers, 8 requests")
    add_workload_arguments(p)
    p.add_argument("--variants", default="0:0", help="S:D,...: step tokens, decode steps (0: the product's default)")
    p.add_argument("--windows", default="", help="a:b,...: measured-pass step ranges to profile (default: none)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--cpu-draw", action="store_true", help="seeded experts drawn on the CPU (default on CUDA: on the GPU)")
    p.add_argument("--skip-fusions", default="", help="routers,qkv: leave these of the model unfused (a before run)")
    p.add_argument("--checkpoint", default=None, help="a Hugging Face folder to serve (default: random weights)")
    add_output_argument(p)
    a = p.parse_args(argv)
    skip = {s for s in a.skip_fusions.split(",") if s}
    if skip - {"routers", "qkv"}:
        p.error(f"--skip-fusions={a.skip_fusions!r}: names among routers, qkv")
    import ray_moe.model.host as host_module  # the shard builds its model in this process: its fusions follow
    if "routers" in skip:
        host_module.fuse_routers = lambda model: host_module.FusedRouters()
    if "qkv" in skip:
        host_module.fuse_qkv = lambda model: host_module.FusedQKV()
    if a.quick:
        a.layers = 2
        a.requests = 8 if a.requests is None else a.requests
        a.new_tokens = 4 if a.new_tokens is None else a.new_tokens
        a.prompt_mean = 24 if a.prompt_mean is None else a.prompt_mean
    try:
        work = workload_spec(a.workload, a.requests, a.new_tokens, a.prompt_mean, 0)
        variants, windows = parse_ints(a.variants, 2, "--variants"), parse_ints(a.windows, 2, "--windows")
    except ValueError as exc:
        p.error(str(exc))
    if a.layers < 1 or not variants:
        p.error(f"--layers={a.layers} (>= 1), --variants={a.variants!r} (at least one S:D)")
    device = "cpu" if a.quick or not torch.cuda.is_available() else "cuda"
    dtype = "bfloat16" if device == "cuda" else "float32"
    if a.checkpoint:
        try:
            cfg = RuntimeConfig.from_pretrained(a.checkpoint, num_ranks=1, device=device, dtype=dtype,
                                                name="step-profile")
        except (OSError, ValueError) as exc:
            p.error(f"--checkpoint={a.checkpoint!r}: {exc}")
        a.layers = cfg.num_layers
        vocab, random_model = json.load(open(os.path.join(a.checkpoint, "config.json")))["vocab_size"], None
        prompts = work.prompts(vocab)
    else:
        conf = dict(QUICK if a.quick else QWEN3_30B_A3B, num_hidden_layers=a.layers)
        random_model = conf
        prompts = work.prompts(conf["vocab_size"])
        cfg = RuntimeConfig(num_ranks=1, num_experts=conf["num_experts"], hidden_size=conf["hidden_size"],
                            ffn_size=conf["moe_intermediate_size"], top_k=conf["num_experts_per_tok"],
                            slots_per_rank=conf["num_experts"], num_layers=a.layers, device=device, dtype=dtype,
                            seed=0, decode_token_capacity=min(len(prompts), 256), name="step-profile",
                            seeded_on_device=device == "cuda" and not a.cpu_draw)
    t0 = time.perf_counter()
    dep = InProcessDeployment(cfg, device=device, timeout_s=600)
    tr = RecordingTransport(dep)
    t1 = time.perf_counter()
    # (no prefix caching: the warm pass runs the same prompts, and the measured pass is a profile of computing them)
    loop = GenerationLoop(tr, device=device, kv_tokens=8192 if a.quick else None, block_size=16, max_running=None,
                          max_queued=4096, random_model=random_model, prefix_caching=False)
    tr.waiting = lambda: loop.signals().waiting
    # one per request: chat's seeded lognormal output lengths (its steps then mix prompt chunks with decoding
    # sequences, as in the serving benchmark); every other workload's fixed count
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in work.new_tokens_list()]
    res: dict[str, Any] = {"quick": a.quick, "device": device, "dtype": dtype, "layers": a.layers,
                           "checkpoint": a.checkpoint,
                           "skipped_fusions": sorted(skip),
                           "workload": {"kind": work.kind.value, "requests": work.requests,
                                        "new_tokens": work.new_tokens, "output_tokens": sum(work.new_tokens_list()), "prompt_mean": work.prompt_mean,
                                        "prompt_tokens": sum(map(len, prompts))},
                           "start_s": {"deployment": t1 - t0, "model_and_kv": time.perf_counter() - t1},
                           "kv_tokens": loop.kv_tokens, "attention": loop.attention_backend}
    if device == "cuda":
        res["memory_after_start_gb"] = {"allocated": torch.cuda.memory_allocated() / 1e9,
                                        "reserved": torch.cuda.memory_reserved() / 1e9,
                                        "device_used": (lambda f, t: (t - f) / 1e9)(*torch.cuda.mem_get_info())}
    print(f"start: deployment {t1 - t0:.1f} s, model+kv {res['start_s']['model_and_kv']:.1f} s, "
          f"kv_tokens {loop.kv_tokens}, attention {loop.attention_backend}, memory {res.get('memory_after_start_gb')}",
          flush=True)
    try:
        res["variants"] = [run_variant(dep, loop, tr, prompts, params, v, windows, not a.no_warmup, device)
                           for v in variants]
    finally:
        loop.close()
        tr.close()
    suffix = f"{work.kind.value}-cpu-quick" if a.quick else f"{host_kind()}-{a.layers}l-{work.kind.value}"
    path = write_result("step_profile", res, suffix=suffix, out=a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
