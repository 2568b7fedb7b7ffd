"""The one-rank route plan on one GPU: the one-program plan, the blocked plan and the torch plan, by route count.

    python -m ray_moe_bench.route_plan          # 128 local slots (+ 2 spare), top-8; 256 .. 8,448 tokens

What a step of the one-rank data path pays to put its routes in expert-major order (``moe.dispatch.route_plan``):
the one-program Triton plan (up to ``ROUTE_PLAN_MAX`` routes), the blocked plan (three launches, any size it takes;
also at ``BLOCK_SWEEP``'s smaller blocks), the torch plan (the CPU path and both kernels' oracle, run on the GPU), and
for reference what the general path did for steps past ``ROUTE_PLAN_MAX`` before the blocked plan: the stable
expert-major order of ``plan.expert_major_order`` plus the gathered copy of every routed row (hidden 2048, bf16).
MEASURED: us per call,
one call captured in a CUDA graph and replayed ``--iters`` times (the serving path replays captured steps); each
plan's tensors checked equal to the torch plan's. JSON (hardware, versions) to $RAY_MOE_RESULTS_DIR.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ray_moe_bench.common import add_output_argument, write_result
from ray_moe_bench.fp8_experts import time_graph_us

TOKENS = (256, 512, 1024, 2048, 4096, 8192, 8448)
FIELDS = ("src", "gates", "order", "ends", "slot_rows", "sent", "ok")
BLOCK_SWEEP = (128, 256, 512)  # routes per block the blocked plan is also timed at, where they make <= 64 blocks


def case(tokens: int, experts: int, spare: int, top_k: int, hidden: int, iters: int) -> dict[str, Any]:
    from ray_moe.moe.dispatch.plan import expert_major_order
    from ray_moe.moe.dispatch.route_plan import (BLOCKED_MAX_BLOCKS, ROUTE_PLAN_MAX, _kernel, blocked_shape,
                                                 plan_routes, plan_routes_blocked, plan_routes_torch, route_tables)

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(tokens)
    s = experts + spare
    tables = route_tables(torch.randperm(s, generator=g).to(dev), torch.zeros(s, dtype=torch.int64, device=dev),
                          torch.randperm(s, generator=g)[:experts][:, None].to(dev), 0, s)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(dev)
    w = torch.rand(tokens, top_k, generator=g).to(dev)
    h = torch.randn(tokens, hidden, generator=g).to(dev, torch.bfloat16)
    n = tokens * top_k
    want = plan_routes_torch(ids, w, None, tables)
    res: dict[str, Any] = {"tokens": tokens, "routes": n, "blocked_shape": blocked_shape(n, s)}
    cands = {"torch_plan": lambda: plan_routes_torch(ids, w, None, tables)}
    if n <= ROUTE_PLAN_MAX and _kernel() is not None:
        cands["one_program"] = lambda: plan_routes(ids, w, None, tables)
    if blocked_shape(n, s) is not None and _kernel() is not None:
        cands["blocked"] = lambda: plan_routes_blocked(ids, w, None, tables)
        # the blocked plan at smaller blocks than blocked_shape's (BLOCKED_MIN_BLOCK: more programs, shorter sorts):
        # whether decode-sized steps (2,048-8,192 routes: 16-17 us at 6754740 on an H100) plan faster so
        for b in BLOCK_SWEEP:
            if b < blocked_shape(n, s)[0] and -(-n // b) <= BLOCKED_MAX_BLOCKS:
                cands[f"blocked_{b}"] = lambda b=b: plan_routes_blocked(ids, w, None, tables, block=b)

    def general() -> Any:  # the general path's order and gathered rows (no replica selection: one copy each)
        slot = tables.expert_slot.long()[ids.reshape(-1)]
        order, dest, counts = expert_major_order(slot, s + 1)
        return h.index_select(0, order // top_k), dest, counts

    for name, fn in cands.items():
        got = fn()
        same = all(torch.equal(getattr(got, f), getattr(want, f)) for f in FIELDS)
        res[name] = {"graph_us": time_graph_us(fn, iters), "equals_torch_plan": same}
    res["general_order_and_gather"] = {"graph_us": time_graph_us(general, iters)}
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    add_output_argument(ap)
    a = ap.parse_args(argv)
    if a.iters < 1 or any(t < 1 for t in a.tokens):
        ap.error(f"--iters={a.iters}, --tokens={a.tokens}: must be >= 1")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    cases = []
    for t in a.tokens:
        c = case(t, 128, 2, 8, 2048, a.iters)
        cases.append(c)
        print(f"tokens {t:5d} routes {c['routes']:6d}: " + "  ".join(
            f"{k} {v['graph_us']:7.1f} us" + ("" if v.get("equals_torch_plan", True) else " (DIFFERS)")
            for k, v in c.items() if isinstance(v, dict)), flush=True)
    payload = {"what": "the one-rank route plan: one-program / blocked / torch plans and the general path's order + "
                       "gather; MEASURED us per CUDA-graph replay", "experts": 128, "spare_slots": 2, "top_k": 8,
               "hidden": 2048, "iters": a.iters, "cases": cases}
    print("wrote", write_result("route_plan", payload, out=a.out))
    return payload


if __name__ == "__main__":
    main()
