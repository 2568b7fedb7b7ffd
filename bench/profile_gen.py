"""Where a generation step's time goes on one GPU, in process (no Ray): host spans, cProfile, torch profiler."""
import cProfile, io, pstats, sys, time, json, os
import torch
from ray_moe.config import RuntimeConfig
from ray_moe.testing.inprocess import InProcessDeployment
from ray_moe.serving.engine import GenStepRequest
from ray_moe.serving.sampling import SamplingParams
from ray_moe.serving.scheduler import Scheduler
from ray_moe.bench.generate import QWEN3_30B_A3B

layers = int(os.environ.get("L", "8"))
conf = dict(QWEN3_30B_A3B, num_hidden_layers=layers)
cfg = RuntimeConfig(num_ranks=1, num_experts=128, hidden_size=2048, ffn_size=768, top_k=8, slots_per_rank=128,
                    num_layers=layers, device="cuda", dtype="bfloat16", seed=0, decode_token_capacity=128, name="prof")
dep = InProcessDeployment(cfg, device="cuda")
core = dep.cores[0]
info = core.load_model(kv_tokens=128 * 80 + 4096 + 1024, block_size=16, random_model=conf)
sched = Scheduler([0], kv_blocks=info["kv_blocks"], block_size=16, max_context=info["max_context"], step_tokens=4096,
                  eos_token_ids=())
g = torch.Generator().manual_seed(1)
step_no = [0]

def one_step(times=None):
    plan = sched.plan()
    units = (plan.has_prefill or not plan.has_decode, plan.has_decode)
    req = GenStepRequest(f"s{step_no[0]}", dep.generation, plan.items[0], plan.free[0], units)
    step_no[0] += 1
    t0 = time.perf_counter()
    res = core.generate_step(req)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if times is not None:
        times.append(dt * 1e3)
    sched.commit(plan, res.tokens)
    return res

def drain():
    while sched.pending():
        one_step()

out = {}
# prefill 4096
p = torch.randint(0, 151936, (4096,), generator=g).tolist()
for rep in range(3):
    sched.submit(p, SamplingParams(max_new_tokens=1))
    ts = []
    one_step(ts)
    drain()
    print("prefill 4096 step ms", ts, flush=True)
out["prefill_ms"] = ts
# profile prefill
sched.submit(p, SamplingParams(max_new_tokens=1))
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    one_step()
drain()
print("=== PREFILL by self cuda", flush=True)
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
print("=== PREFILL by cpu total", flush=True)
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30), flush=True)

for b in (32, 128):
    for _ in range(b):
        sched.submit(torch.randint(0, 151936, (32,), generator=g).tolist(), SamplingParams(max_new_tokens=40))
    one_step()  # prefill
    ts = []
    for _ in range(6):
        one_step(ts)  # eager + capture, then replays
    print(f"decode b{b} step ms", [round(x, 2) for x in ts], flush=True)
    pr = cProfile.Profile()
    pr.enable()
    ts2 = []
    for _ in range(10):
        one_step(ts2)
    pr.disable()
    print(f"decode b{b} step ms (profiled)", [round(x, 2) for x in ts2], flush=True)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
    print(s.getvalue()[:9000], flush=True)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue()[:6000], flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            one_step()
    print(f"=== DECODE b{b} by self cuda", flush=True)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20), flush=True)
    ts3 = []
    # pure graph replay cost
    gs = list(core.generator.graphs._graphs.values())
    if gs:
        key = gs[-1]
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(20):
            key.graph.replay()
        torch.cuda.synchronize()
        print(f"decode b{b}: pure graph replay ms {(time.perf_counter()-t0)/20*1e3:.3f}", flush=True)
    print("capture_error", core.generator.capture_error, flush=True)
    drain()
print(json.dumps(core.generator.counters))
