"""Decode- and mixed-size expert SwiGLU: the skinny and tiled Triton kernels against torch._grouped_mm on the same rows (one GPU).

    python -m ray_moe_bench.skinny            # Qwen3-30B-A3B, Mixtral and DeepSeek-V3 expert shapes, bf16

Rows: T tokens, each routed to k distinct experts uniformly at random, expert-major with device-side
offsets (the one-rank path's layout). Both sides compute the same SwiGLU experts from the same weights and
offsets; time = CUDA events over ``--iters`` back-to-back calls; effective bandwidth = the active experts'
weight bytes / time. The kernels are timed at the row block the runner picks (``row_block``) and at every
block of ``ROW_BLOCKS``; ``runner_takes_kernels`` says which side the grouped runner runs at that size
(``SKINNY_ROWS_PER_SLOT``). The token counts run past the runner's crossover (to ~190 rows a slot), so the
measurement shows where it should sit. The tiled kernels (``runners/tiled.py``: programs over row blocks and
column blocks, for mid-size steps) are timed at every candidate config (``tiled_us``), and the grouped runner's
start check (``mid_choice``) is run once a shape: the bands it would serve (``start_check``). The maximum
difference relative to the grouped result is reported too (bf16: the kernels accumulate gate and up in FP32 and
round once).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ray_moe_bench.common import add_output_argument, write_result

SHAPES = {"qwen3_30b_a3b": (128, 2048, 768, 8, (1, 32, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 8192)),
          "mixtral": (8, 4096, 14336, 2, (1, 8, 32, 64, 128, 256, 512, 768)),
          "deepseek_v3": (64, 7168, 2048, 8, (1, 8, 32, 64, 256, 512, 1024, 1536))}  # experts, d, f, top-k, tokens


def _time_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters * 1e3


def run(iters: int, shapes: list[str]) -> dict[str, Any]:
    from ray_moe.moe.experts.runners.grouped import SKINNY_ROWS_PER_SLOT
    from ray_moe.moe.experts.runners import tiled
    from ray_moe.moe.experts.runners.grouped import mid_choice
    from ray_moe.moe.experts.runners.skinny import ROW_BLOCKS, row_block, skinny_swiglu

    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for name in shapes:
        e_, d, f, k, tokens = SHAPES[name]
        wg, wu = (torch.randn(e_, f, d, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
        wd = torch.randn(e_, d, f, device="cuda", dtype=torch.bfloat16) * 0.02
        choice = mid_choice(torch.device("cuda"), torch.bfloat16, d, f, e_, k)
        out[f"{name}/start_check"] = {"bands": [[top, vars(c)] for top, c in choice.bands], "reason": choice.reason}
        print(f"{name} start check: {choice.reason}", flush=True)
        configs = [c for c in tiled.CANDIDATES if c.fits(d, f)]
        for t in tokens:
            ids = torch.stack([torch.randperm(e_, device="cuda")[:k] for _ in range(t)]).reshape(-1)
            counts = torch.bincount(ids, minlength=e_)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            x = torch.randn(t * k, d, device="cuda", dtype=torch.bfloat16)

            def grouped():
                g = torch._grouped_mm(x, wg.transpose(1, 2), offs=offs)
                u = torch._grouped_mm(x, wu.transpose(1, 2), offs=offs)
                return torch._grouped_mm(torch.nn.functional.silu(g, inplace=True).mul_(u), wd.transpose(1, 2), offs=offs)

            def kernels(bm=None):
                return skinny_swiglu(x, offs, wg, wu, wd, block_m=bm)

            ref = grouped().float()
            scale = ref.abs().max()
            diffs = {bm: float((kernels(bm).float() - ref).abs().max() / scale) for bm in ROW_BLOCKS}
            active = int((counts > 0).sum())
            gbytes = active * 3 * f * d * 2 / 1e9
            gflop = 6 * t * k * d * f / 1e9
            tg, tk = _time_us(grouped, iters), _time_us(kernels, iters)
            blocks = {bm: _time_us(lambda bm=bm: kernels(bm), iters) for bm in ROW_BLOCKS}
            tiled_us, tiled_diff = {}, {}
            mid_cfg = None if t * k <= SKINNY_ROWS_PER_SLOT * e_ else choice.config(t * k, e_)  # the runner's pick
            for c in configs:
                key = f"{c.block_m}x{c.block_n}x{c.block_k}/w{c.warps}s{c.stages}"
                tiled_diff[key] = float((tiled.tiled_swiglu(x, offs, wg, wu, wd, config=c).float() - ref).abs().max()
                                        / scale)
                tiled_us[key] = _time_us(lambda c=c: tiled.tiled_swiglu(x, offs, wg, wu, wd, config=c), iters)
            out[f"{name}/tokens_{t}"] = {
                "block_m": row_block(t * k, e_), "max_rows_per_expert": int(counts.max()),
                "rows_per_expert_mean": t * k / e_, "runner_takes_kernels": t * k <= SKINNY_ROWS_PER_SLOT * e_,
                "block_us": blocks, "block_max_rel_diff": diffs, "tiled_us": tiled_us,
                "tiled_max_rel_diff": tiled_diff, "runner_tiled": mid_cfg and vars(mid_cfg),
                "experts": e_, "hidden": d, "ffn": f, "top_k": k, "tokens": t, "rows": t * k, "active_experts": active,
                "weight_gbytes": gbytes, "gflop": gflop, "grouped_mm_us": tg, "skinny_us": tk, "speedup": tg / tk,
                "grouped_mm_tb_s": gbytes / tg * 1e3, "skinny_tb_s": gbytes / tk * 1e3,
                "grouped_mm_tflop_s": gflop / tg * 1e3, "skinny_tflop_s": gflop / tk * 1e3,
                "max_rel_diff": diffs[row_block(t * k, e_)]}
            r = out[f"{name}/tokens_{t}"]
            per_block = " ".join(f"{bm}:{us:.0f}" for bm, us in blocks.items())
            per_tile = " ".join(f"{key}:{us:.0f}" for key, us in tiled_us.items())
            print(f"{name} T={t} ({t * k / e_:.0f} rows/expert, runner: "
                  f"{'kernels' if r['runner_takes_kernels'] else 'grouped_mm'}): grouped_mm {tg:.1f} us "
                  f"({r['grouped_mm_tb_s']:.2f} TB/s, {r['grouped_mm_tflop_s']:.0f} TF/s), skinny {tk:.1f} us "
                  f"({r['skinny_tb_s']:.2f} TB/s, {r['skinny_tflop_s']:.0f} TF/s) at block {r['block_m']} "
                  f"(blocks us {per_block}), {r['speedup']:.2f}x, max rel diff {r['max_rel_diff']:.1e}; tiled us "
                  f"{per_tile}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="skinny", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    add_output_argument(p)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the kernels are Triton on CUDA; on CPU the runner keeps grouped_mm / loop)")
    res = {"shapes": {k: SHAPES[k] for k in a.shapes}, "iters": a.iters, "results": run(a.iters, a.shapes)}
    print(f"wrote {write_result('skinny', res, out=a.out)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
