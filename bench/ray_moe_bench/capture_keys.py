"""Which captured shapes a serving workload's steps take, warm-up pass then timed pass, on a CPU (the H200's path).

    python -m ray_moe_bench.capture_keys                       # the mixed workload, 256 requests, two passes
    python -m ray_moe_bench.capture_keys --new-tokens 32 --out bench/results/logs/s16/capture-keys-cpu.json
    python -m ray_moe_bench.capture_keys --workload decode-heavy --units decode

One rank in process, the tiny Qwen3-MoE of ``generate.QUICK`` with ``--layers`` layers in float32, the H200's step
path (static shapes with an eager 'capture', varlen attention with the in-place decode path; their references as
kernels: ``host_profile.instrument``), a serving benchmark workload (``--workload``), 16k step tokens, multi-step
decode 4.
The workload runs twice as the serving benchmark runs it: a warm-up pass with every token id shifted by one, then the
timed pass. MEASURED, per pass: every prefill / mixed (``--units prefill``) or decode step's captured-shape key
(``GenerationExecutor._graph_step``: unit, rows, keys, sampled rows, decode rows, slot vector, query bound, marked,
layout) and whether it replayed a graph or ran eagerly and was captured; an eager step of the timed pass is one an
H200 runs eagerly (a prefill step at ~2x a replay's device time) plus its capture (~0.3 s of host for 48 layers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from ray_moe_dev.testing.inprocess import InProcessDeployment, LocalTransport

from ray_moe.driver.loop import GenerationLoop
from ray_moe.model.config import RuntimeConfig
from ray_moe.model.sampling import SamplingParams
from ray_moe_bench.generate import QUICK
from ray_moe_bench.host_profile import PhaseClock, git_state, instrument, step_kind
from ray_moe_bench.serving import Workload, workload_spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="capture_keys", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=None, help="default: the workload's (mixed 128, decode-heavy 256)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--workload", choices=[w.value for w in Workload], default=Workload.MIXED.value)
    p.add_argument("--units", nargs="+", choices=("prefill", "decode"), default=["prefill"],
                   help="which captured steps to report (prefill: prefill and mixed steps)")
    p.add_argument("--out", metavar="JSON", help="write the report here")
    a = p.parse_args(argv)
    if a.requests < 1 or (a.new_tokens is not None and a.new_tokens < 1) or a.layers < 1:
        p.error(f"--requests={a.requests}, --new-tokens={a.new_tokens}, --layers={a.layers}: each must be >= 1")

    import ray_moe.shard.pipeline as pipeline

    instrument(PhaseClock(step_kind))  # the H200's path on a CPU (the phase clock itself is not read)
    seen: list[tuple[Any, bool]] = []
    run_static = pipeline.StepPipeline.run_static

    def recorded(self, generation, key, staged, body, **kw):
        out, replayed = run_static(self, generation, key, staged, body, **kw)
        if kw.get("unit") in a.units:
            seen.append((key, replayed))
        return out, replayed

    pipeline.StepPipeline.run_static = recorded
    work = workload_spec(Workload(a.workload), a.requests, a.new_tokens, None, 0)
    conf = dict(QUICK, num_hidden_layers=a.layers)
    prompts = work.prompts(conf["vocab_size"])
    cfg = RuntimeConfig(num_ranks=1, num_experts=conf["num_experts"], hidden_size=conf["hidden_size"],
                        ffn_size=conf["moe_intermediate_size"], top_k=conf["num_experts_per_tok"],
                        slots_per_rank=conf["num_experts"], num_layers=a.layers, device="cpu", dtype="float32",
                        seed=0, decode_token_capacity=min(len(prompts), 256), name="capture-keys")
    dep = InProcessDeployment(cfg, device="cpu", timeout_s=600)
    tr = LocalTransport(dep)
    new = work.new_tokens
    kv_tokens = 16 * (sum(-(-(len(x) + new) // 16) for x in prompts) + 64)
    loop = GenerationLoop(tr, device="cpu", kv_tokens=kv_tokens, block_size=16, max_running=256, max_queued=4096,
                          random_model=conf, step_tokens=16384, decode_steps=4)
    dep.cores[0].paths = dataclasses.replace(dep.cores[0].paths, capture=True)
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    passes = []
    try:
        for name, shift in (("warm-up", 1), ("timed", 0)):
            seen.clear()
            t0 = time.perf_counter()
            batch = [([(t + shift) % conf["vocab_size"] for t in x], params, None) for x in prompts]
            for h in loop.submit_many(batch):
                h.result(3600)
            passes.append({"pass": name, "wall_s": round(time.perf_counter() - t0, 2),
                           "steps": [{"key": list(k), "replayed": r} for k, r in seen],
                           "eager": sum(not r for _, r in seen)})
    finally:
        loop.close()
        tr.close()
    res = {"benchmark": "capture_keys", **git_state(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "units": a.units, "workload": {"kind": a.workload, "requests": a.requests, "new_tokens": new, "prompt_tokens": sum(map(len, prompts)),
                        "layers": a.layers, "step_tokens": 16384, "decode_steps": 4},
           "key_fields": ["unit", "rows", "keys", "last_rows", "single", "paged_keys", "max_q", "marked", "layout"],
           "measured": "MEASURED: each prefill / mixed step's captured-shape key and whether it replayed",
           "passes": passes}
    for ps in passes:
        print(f"{ps['pass']}: {len(ps['steps'])} {'/'.join(a.units)} steps, {ps['eager']} eager (then captured)")
        for s in ps["steps"]:
            print(f"  {'replay' if s['replayed'] else 'EAGER '} {tuple(s['key'])}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=2)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
