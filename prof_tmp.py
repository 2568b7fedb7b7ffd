import time, os, io, pstats, cProfile
import torch
from ray_moe.config import RuntimeConfig
from ray_moe.testing.inprocess import InProcessDeployment
from ray_moe.serving.engine import GenStepRequest
from ray_moe.serving.sampling import SamplingParams
from ray_moe.serving.scheduler import Scheduler
from ray_moe.bench.generate import QWEN3_30B_A3B
from torch.profiler import profile, ProfilerActivity
conf = dict(QWEN3_30B_A3B, num_hidden_layers=8)
cfg = RuntimeConfig(num_ranks=1, num_experts=128, hidden_size=2048, ffn_size=768, top_k=8, slots_per_rank=128,
                    num_layers=8, device="cuda", dtype="bfloat16", seed=0, decode_token_capacity=128, name="prof")
dep = InProcessDeployment(cfg, device="cuda")
core = dep.cores[0]
info = core.load_model(kv_tokens=128 * 80 + 4096 + 1024, block_size=16, random_model=conf)
sched = Scheduler([0], kv_blocks=info["kv_blocks"], block_size=16, max_context=info["max_context"], step_tokens=4096)
g = torch.Generator().manual_seed(1)
n = [0]
def one(times=None):
    plan = sched.plan()
    req = GenStepRequest(f"s{n[0]}", dep.generation, plan.items[0], plan.free[0], (plan.has_prefill or not plan.has_decode, plan.has_decode))
    n[0] += 1
    t0 = time.perf_counter(); res = core.generate_step(req); dt = time.perf_counter() - t0
    if times is not None: times.append(round(dt * 1e3, 2))
    sched.commit(plan, res.tokens); return res
def drain():
    while sched.pending(): one()
p = torch.randint(0, 151936, (4096,), generator=g).tolist()
ts = []
for _ in range(4):
    sched.submit(p, SamplingParams(max_new_tokens=1)); one(ts); drain()
print("prefill graph ms", ts, core.generator.counters, core.generator.capture_error, flush=True)
sched.submit(p, SamplingParams(max_new_tokens=1))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    one()
drain()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50), flush=True)
sched.submit(p, SamplingParams(max_new_tokens=1))
pr = cProfile.Profile(); pr.enable(); one(); pr.disable(); drain()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15); print(s.getvalue()[:4000], flush=True)
for b in (32,):
    for _ in range(b):
        sched.submit(torch.randint(0, 151936, (32,), generator=g).tolist(), SamplingParams(max_new_tokens=40))
    one()
    for _ in range(4): one()
    ts = []
    pr = cProfile.Profile(); pr.enable()
    for _ in range(10): one(ts)
    pr.disable()
    print(f"decode b{b} ms", ts, flush=True)
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000], flush=True)
    drain()
