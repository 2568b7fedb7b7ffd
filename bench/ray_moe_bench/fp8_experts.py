"""FP8 expert compute per MoE layer (one GPU): the block-FP8 Triton kernels against the bf16 runner and the
dequantize-then-bf16 path, at the 48-layer Qwen3-30B-A3B expert shape.

    python -m ray_moe_bench.fp8_experts        # hidden 2048, moe_intermediate 768, 128 experts, top-8, tokens 1..8192

Rows: T tokens, each routed to 8 distinct experts at random, expert-major with device-side offsets (the
one-rank path's layout: ``run_offsets``). The same random weights three ways:
  fp8      ``Fp8Runner(GroupedRunner())`` on FP8 slots (128 x 128 block scales): the kernels (activations
           quantized per 1 x 128 group, gate/up + SiLU-and-mul + the intermediate's quantization, down)
  bf16     ``GroupedRunner()`` on the bf16 weights (the skinny Triton kernels at decode sizes, torch._grouped_mm
           above): ray-moe's bf16 expert path
  dequant  ``Fp8Runner(GroupedRunner(), kernels=False)``: every call dequantizes the slots, then the bf16 runner
           (the reference path, and the fallback where the kernels are unavailable)
Time: CUDA events over ``--iters`` back-to-back calls (eager), and for T <= ``--graph-max`` one call captured in
a CUDA graph and replayed ``--iters`` times (the serving path replays captured steps). Per-row-block times of
the kernels (``block_m`` 16 / 32 / 64) and, at ``--sweep`` token counts, their warps / pipeline stages show the
launch choice. Accuracy: the kernels' max |diff| relative to the
torch reference of the same contract (``fp8_swiglu_reference``), and the relative Frobenius difference between
the FP8 and bf16 outputs (the FP8 model's own error: activations and weights in e4m3). ``step_ms`` = 48 x one
layer (derived, not measured as a step). JSON (hardware, versions, shapes) to $RAY_MOE_RESULTS_DIR.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from ray_moe_bench.common import add_output_argument, write_result

HIDDEN, FFN, EXPERTS, TOP_K, LAYERS = 2048, 768, 128, 8, 48
TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _events_us(fn: Callable[[], Any], iters: int) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters * 1e3


def time_eager_us(fn: Callable[[], Any], iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return _events_us(fn, iters)


def time_graph_us(fn: Callable[[], Any], iters: int) -> float:
    """One call captured (after an eager warm-up on a side stream), then replays timed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    us = _events_us(graph.replay, iters)
    del graph
    return us


def run(tokens: list[int], iters: int, graph_max: int, sweep: tuple[int, ...] = ()) -> dict[str, Any]:
    from ray_moe.moe.experts.fp8 import quantize
    from ray_moe.moe.experts.runners import fp8_kernels
    from ray_moe.moe.experts.runners.fp8 import Fp8Runner, fast_path_reason, fp8_swiglu_reference
    from ray_moe.moe.experts.runners.fp8_configs import LaunchConfig, SwigluChoice
    from ray_moe.moe.experts.runners.grouped import GroupedRunner
    from ray_moe.moe.experts.weights import SlotWeights

    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    dense = [torch.randn(EXPERTS, FFN, HIDDEN, generator=g, device=dev) / HIDDEN ** 0.5,
             torch.randn(EXPERTS, FFN, HIDDEN, generator=g, device=dev) / HIDDEN ** 0.5,
             torch.randn(EXPERTS, HIDDEN, FFN, generator=g, device=dev) / FFN ** 0.5]
    pairs = [quantize(w, (128, 128)) for w in dense]
    ids = tuple(range(EXPERTS))
    w8 = SlotWeights(0, ids, ids, *(p[0] for p in pairs), scales=tuple(p[1] for p in pairs), block=(128, 128))
    w16 = SlotWeights(0, ids, ids, *(t.to(torch.bfloat16) for t in dense))
    del dense
    why = fast_path_reason(dev, torch.bfloat16, HIDDEN, FFN, (128, 128))
    fp8, bf16, deq = Fp8Runner(GroupedRunner()), GroupedRunner(), Fp8Runner(GroupedRunner(), kernels=False)
    out: dict[str, Any] = {"fast_path_reason": why}
    print(f"FP8 kernels: {'on' if why is None else 'OFF: ' + why}")
    head = (f"{'tokens':>6} {'rows':>6} {'act':>4} | {'fp8 us':>8} {'bf16 us':>8} {'deq us':>8} {'bf16/fp8':>8} | "
            f"{'graph fp8':>9} {'bf16':>8} {'deq':>8} {'bf16/fp8':>8} | {'fp8 TB/s':>8} {'bm16/32/64 us':>20} | "
            f"{'rel ref':>7} {'frob bf16':>9}")
    print(head)
    print("-" * len(head))
    for t in tokens:
        gen = torch.Generator().manual_seed(t)
        route = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(t)]).reshape(-1)
        counts = torch.bincount(route, minlength=EXPERTS)
        offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
        x = torch.randn(t * TOP_K, HIDDEN, generator=g, device=dev).to(torch.bfloat16)
        calls = {"fp8": lambda: fp8.run_offsets(x, offs, w8), "bf16": lambda: bf16.run_offsets(x, offs, w16),
                 "dequant": lambda: deq.run_offsets(x, offs, w8)}
        y8, y16 = calls["fp8"]().float(), calls["bf16"]().float()
        codes = (w8.w_gate, w8.w_up, w8.w_down)
        want = fp8_swiglu_reference(x, counts.tolist(), codes, w8.scales, (128, 128)).float()
        active = int((counts > 0).sum())
        r: dict[str, Any] = {"tokens": t, "rows": t * TOP_K, "active_experts": active,
                             "max_rows_per_expert": int(counts.max()), "block_m": fp8_kernels.row_block(t * TOP_K, EXPERTS),
                             "rel_diff_vs_reference": float((y8 - want).abs().max() / want.abs().max()),
                             "frobenius_vs_bf16": float((y8 - y16).norm() / y16.norm())}
        for name, fn in calls.items():
            r[f"{name}_us"] = time_eager_us(fn, iters)
            if t <= graph_max:
                r[f"{name}_graph_us"] = time_graph_us(fn, iters)
        r["block_m_us"] = {bm: time_eager_us(lambda bm=bm: fp8_kernels.fp8_swiglu(x, offs, codes, w8.scales, (128, 128),
                                                                                  block_m=bm), iters)
                           for bm in fp8_kernels.ROW_BLOCKS}
        if t in sweep:  # launch settings around the defaults (the row tile the runner picks)
            bm = fp8_kernels.row_block(t * TOP_K, EXPERTS)
            r["config_us"] = {f"w{gw}/{dw}s{st}": time_eager_us(
                lambda c=SwigluChoice(LaunchConfig(bm, 128, gw, st), LaunchConfig(bm, 128, dw, st)):
                fp8_kernels.fp8_swiglu(x, offs, codes, w8.scales, (128, 128), choice=c), iters)
                for gw, dw, st in ((4, 4, 3), (8, 4, 3), (4, 4, 4), (8, 8, 3), (4, 4, 2))}
            print(f"       launch settings at {t} tokens (gate/up warps / down warps, stages): " +
                  ", ".join(f"{k} {v:.1f} us" for k, v in r["config_us"].items()), flush=True)
        wbytes = active * 3 * HIDDEN * FFN  # FP8 codes the active experts read (scales: 1/16384 of it)
        best8 = r.get("fp8_graph_us", r["fp8_us"])
        r.update(fp8_weight_gbytes=wbytes / 1e9, fp8_tb_s=wbytes / best8 / 1e6,
                 step_ms_fp8=LAYERS * best8 / 1e3, step_ms_bf16=LAYERS * r.get("bf16_graph_us", r["bf16_us"]) / 1e3)
        out[f"tokens_{t}"] = r
        gr = (f"{r['fp8_graph_us']:>9.1f} {r['bf16_graph_us']:>8.1f} {r['dequant_graph_us']:>8.1f} "
              f"{r['bf16_graph_us'] / r['fp8_graph_us']:>8.2f}" if t <= graph_max else f"{'-':>9} {'-':>8} {'-':>8} {'-':>8}")
        bms = "/".join(f"{r['block_m_us'][bm]:.0f}" for bm in fp8_kernels.ROW_BLOCKS)
        print(f"{t:>6} {t * TOP_K:>6} {active:>4} | {r['fp8_us']:>8.1f} {r['bf16_us']:>8.1f} {r['dequant_us']:>8.1f} "
              f"{r['bf16_us'] / r['fp8_us']:>8.2f} | {gr} | {r['fp8_tb_s']:>8.2f} {bms:>20} | "
              f"{r['rel_diff_vs_reference']:>7.1e} {r['frobenius_vs_bf16']:>9.1e}", flush=True)
        del x, y8, y16, want
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fp8_experts", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graph-max", type=int, default=512, help="largest token count also timed as a CUDA graph")
    p.add_argument("--sweep", type=int, nargs="*", default=[8, 256, 4096],
                   help="token counts at which the kernels' launch settings are swept too")
    add_output_argument(p)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the FP8 kernels are Triton on CUDA)")
    import triton

    res = {"shape": {"hidden": HIDDEN, "moe_intermediate": FFN, "experts": EXPERTS, "top_k": TOP_K, "layers": LAYERS,
                     "block": [128, 128], "activation_groups": 128, "dtype": "bfloat16"},
           "triton": triton.__version__, "iters": a.iters, "results": run(a.tokens, a.iters, a.graph_max, tuple(a.sweep))}
    print(f"wrote {write_result('fp8_experts', res, out=a.out)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
