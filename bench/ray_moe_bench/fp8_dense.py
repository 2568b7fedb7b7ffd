"""Dense block-FP8 Linears on one GPU: ray-moe's Triton kernel against torch._scaled_mm's blockwise and bf16.

ray-moe's ``fp8_linear`` against PyTorch's blockwise-scaled ``torch._scaled_mm`` (cuBLASLt; activations 1 x 128,
weights 128 x 128) and bf16 ``F.linear``, at the 48-layer Qwen3-30B-A3B attention shapes.

    python -m ray_moe_bench.fp8_dense          # q 2048 -> 4096, k / v 2048 -> 512, o 4096 -> 2048; rows 1 .. 8192

The choice issue 41 asks for (a library kernel where one fits, chosen by measurement): both FP8 candidates quantize
the activations the same way (``quantize_rows``: per row and 128-column group, e4m3, float32 scales) and read the
checkpoint's codes and block scales as they are; ``scaled_mm`` hands them to cuBLASLt (scale_a [M, K/128] M-major,
scale_b the weight scales' transpose [K/128, N/128]). MEASURED per shape and row count: CUDA events over ``--iters``
back-to-back calls after a warm-up, and one call captured in a CUDA graph and replayed (the serving path replays
captured steps); the largest difference of each FP8 candidate from ``fp8_linear_reference`` relative to its
largest value, and TFLOP/s. A candidate that does not run here is recorded with the reason. JSON (hardware,
versions, shapes) to $RAY_MOE_RESULTS_DIR.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from ray_moe_bench.common import add_output_argument, write_result
from ray_moe_bench.fp8_experts import time_eager_us, time_graph_us

BLOCK = (128, 128)
SHAPES = {"q_proj": (4096, 2048), "k_proj": (512, 2048), "o_proj": (2048, 4096)}  # name: (out, in)
ROWS = (1, 16, 64, 256, 1024, 2048, 8192)


def case(out_f: int, in_f: int, rows: int, iters: int, seed: int = 0) -> dict[str, Any]:
    from ray_moe.model.fp8_linear import fp8_linear_reference
    from ray_moe.moe.experts.fp8 import quantize
    from ray_moe.moe.experts.runners.fp8_configs import LinearBackend, LinearChoice
    from ray_moe.moe.experts.runners.fp8_kernels import fp8_linear

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / in_f ** 0.5).to(dev)
    codes, scales = quantize(w, BLOCK)
    wb = w.to(torch.bfloat16)
    x = torch.randn(rows, in_f, generator=g).to(dev, torch.bfloat16)
    want = fp8_linear_reference(x, codes, scales, BLOCK).float()
    fns: dict[str, Callable[[], Any]] = {"triton": lambda: fp8_linear(x, codes, scales, BLOCK),
                                         "scaled_mm": lambda: fp8_linear(x, codes, scales, BLOCK,
                                                                         choice=LinearChoice(LinearBackend.SCALED_MM)),
                                         "bf16": lambda: torch.nn.functional.linear(x, wb)}
    flops = 2.0 * rows * out_f * in_f
    out: dict[str, Any] = {"out": out_f, "in": in_f, "rows": rows}
    for name, fn in fns.items():
        try:
            got = fn().float()
            res: dict[str, Any] = {"eager_us": time_eager_us(fn, iters), "graph_us": time_graph_us(fn, iters)}
            res["tflops_graph"] = flops / res["graph_us"] / 1e6
            if name != "bf16":
                res["rel_diff_vs_reference"] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        except Exception as exc:  # noqa: BLE001 - a candidate that does not run here: say why
            res = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out[name] = res
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    add_output_argument(ap)
    a = ap.parse_args(argv)
    if a.iters < 1:
        ap.error(f"--iters={a.iters}: must be >= 1")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    cases = []
    for name, (out_f, in_f) in SHAPES.items():
        for rows in ROWS:
            c = {"shape": name, **case(out_f, in_f, rows, a.iters)}
            cases.append(c)
            cells = []
            for k in ("triton", "scaled_mm", "bf16"):
                r = c[k]
                cells.append(f"{k} " + (r["error"][:60] if "error" in r else
                                        f"{r['graph_us']:8.1f} us ({r['tflops_graph']:5.0f} TF/s"
                                        + (f", diff {r['rel_diff_vs_reference']:.1e})" if "rel_diff_vs_reference"
                                           in r else ")")))
            print(f"{name:7s} rows {rows:5d}: " + "  ".join(cells), flush=True)
    payload = {"what": "dense block-FP8 Linear: ray-moe's Triton fp8_linear vs torch._scaled_mm blockwise (cuBLASLt) "
                       "vs bf16 F.linear; MEASURED us per call (eager and CUDA-graph replay)",
               "block": list(BLOCK), "iters": a.iters, "cases": cases}
    print("wrote", write_result("fp8_dense", payload, out=a.out))
    return payload


if __name__ == "__main__":
    main()
