"""Is a prefill step slower inside a Ray actor than in a plain process? Same in-process shard code, three hosts."""
import os, sys, time, json
import torch

def run_steps(tag):
    import torch
    from ray_moe.config import RuntimeConfig
    from ray_moe.testing.inprocess import InProcessDeployment
    from ray_moe.serving.engine import GenStepRequest
    from ray_moe.serving.sampling import SamplingParams
    from ray_moe.serving.scheduler import Scheduler
    from ray_moe.bench.generate import QWEN3_30B_A3B
    layers = 8
    conf = dict(QWEN3_30B_A3B, num_hidden_layers=layers)
    cfg = RuntimeConfig(num_ranks=1, num_experts=128, hidden_size=2048, ffn_size=768, top_k=8, slots_per_rank=128,
                        num_layers=layers, device="cuda", dtype="bfloat16", seed=0, decode_token_capacity=128, name="prof")
    dep = InProcessDeployment(cfg, device="cuda")
    core = dep.cores[0]
    info = core.load_model(kv_tokens=8192, block_size=16, random_model=conf)
    sched = Scheduler([0], kv_blocks=info["kv_blocks"], block_size=16, max_context=info["max_context"], step_tokens=4096)
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, 151936, (4096,), generator=g).tolist()
    out = []
    for rep in range(5):
        sched.submit(p, SamplingParams(max_new_tokens=1))
        while sched.pending():
            plan = sched.plan()
            req = GenStepRequest(f"s{rep}-{plan.step}", dep.generation, plan.items[0], plan.free[0], (True, False))
            torch.cuda.synchronize(); t0 = time.perf_counter()
            res = core.generate_step(req)
            torch.cuda.synchronize()
            if plan.items[0]:
                out.append(round((time.perf_counter() - t0) * 1e3, 2))
            sched.commit(plan, res.tokens)
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "MKL_NUM_THREADS")}
    return {"tag": tag, "prefill_ms": out, "threads": torch.get_num_threads(), "env": env,
            "affinity": len(os.sched_getaffinity(0))}

if __name__ == "__main__":
    print(run_steps("plain"), flush=True)
    import ray
    ray.init(address="local", include_dashboard=False, log_to_driver=True)
    A = ray.remote(num_gpus=1, num_cpus=1)(type("A", (), {"go": lambda self, t: run_steps(t)}))
    a = A.remote(); print(ray.get(a.go.remote("actor")), flush=True); ray.kill(a)
    B = ray.remote(num_gpus=1, num_cpus=1, max_concurrency=16)(type("B", (), {"go": lambda self, t: run_steps(t)}))
    b = B.remote(); print(ray.get(b.go.remote("threaded-actor")), flush=True); ray.kill(b)
    C = ray.remote(num_gpus=1, num_cpus=1, max_concurrency=16, runtime_env={"env_vars": {"OMP_NUM_THREADS": "8"}})(type("C", (), {"go": lambda self, t: run_steps(t)}))
    c = C.remote(); print(ray.get(c.go.remote("threaded-actor-omp8")), flush=True)
