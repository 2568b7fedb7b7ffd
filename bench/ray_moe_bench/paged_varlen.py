"""One layer's attention of a step, two ways (one GPU, no Ray): what a piecewise graph's hole runs (decode rows
in place by the decode kernel, the prefill chunks' contexts gathered then FlashAttention-2's varlen forward) and
what a whole-step token graph runs (every row in place by the paged varlen kernel, ``model/paged_varlen.py``).
A candidate beside them, for the prefill chunks only: cuDNN's variable-length attention through PyTorch
(``aten._cudnn_attention_forward`` with cumulative lengths; no grouped-query heads there, so the gathered keys and
values are repeated per query head first), with its largest difference from FlashAttention-2 (its causal mask's
alignment for a chunk over earlier context is what the difference checks) or why it does not run here. For one
fresh chunk (a long prompt's first 8k tokens: no earlier context, so both causal alignments agree) also PyTorch's
dense SDPA backends on it (cuDNN's fused attention, FlashAttention-2, memory-efficient; keys repeated per query head
once, outside the timing): the f048dfe lease measured cuDNN's varlen path at 15-29 TF/s, which may be that path
rather than cuDNN's Hopper kernel.

    python -m ray_moe_bench.paged_varlen [--out DIR]

The Qwen3-30B-A3B attention shape (32 query heads, 4 kv heads, head size 128, bf16), contexts at scattered cache
slots. MEASURED: device ms of one layer's attention (CUDA events, the median of interleaved rounds) and TFLOP/s
of the causal work; the choice of the lattice's whole-step token sizes (``shard/lattice.py`` WHOLE_ROWS) reads it.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import torch

from ray_moe.model import dense_prefill as dp
from ray_moe.model import paged_varlen as pv
from ray_moe.model.attention import flash_varlen
from ray_moe.model.paged_decode import paged_decode
from ray_moe_bench.common import add_output_argument, time_interleaved, write_result

HQ, HK, D = 32, 4, 128

# name: (decode rows, their context, [(chunk rows, context before it)])
SHAPES = {
    "decode256-ctx500 + chunk512": (256, 500, [(512, 0)]),
    "decode250-ctx600 + chunk1700": (250, 600, [(1700, 0)]),
    "decode100-ctx2000 + 2 chunks 1024 over 3000": (100, 2000, [(1024, 3000), (1024, 3000)]),
    "chunk8192 fresh": (0, 0, [(8192, 0)]),
    "chunk8192 over 4096": (0, 0, [(8192, 4096)]),
    "chunk6000 over 1200": (0, 0, [(6000, 1200)]),
    "chunk1500 over 6500": (0, 0, [(1500, 6500)]),
    "decode23-ctx7000 + chunk8169 over 6000": (23, 7000, [(8169, 6000)]),
}


def _flops(qlens: list[int], klens: list[int]) -> float:
    """Causal attention work: 4 * D * Hq per (query, visible key) pair."""
    pairs = sum(q * (k - q) + q * (q + 1) / 2 for q, k in zip(qlens, klens))
    return 4.0 * D * HQ * pairs


def case(name: str, dec: int, dec_ctx: int, chunks: list[tuple[int, int]], seed: int = 0) -> dict:
    qlens = [1] * dec + [c for c, _ in chunks]
    klens = [dec_ctx] * dec + [c + e for c, e in chunks]
    cap = sum(klens) + 1024
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    k = torch.randn(cap, HK, D, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(cap, HK, D, generator=g).to(dev, torch.bfloat16)
    slots = torch.randperm(cap, generator=g)[: sum(klens)].to(dev)
    q = torch.randn(sum(qlens), HQ, D, generator=g).to(dev, torch.bfloat16)
    cu_q = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *itertools.accumulate(klens)], dtype=torch.int32, device=dev)
    bq = pv.block_rows(HQ, HK)
    na, nb = pv.table_sizes(sum(qlens), len(qlens), bq)
    tabs = [np.zeros(n, np.int64) for n in (na, nb, nb)]
    pv.work_tables(np.asarray(qlens), *tabs, bq)
    one, seq, first = (torch.from_numpy(t).to(dev, torch.int32) for t in tabs)
    scale = D ** -0.5
    kd = dec * dec_ctx
    gather = slots[kd:]
    cu_q_rest = (cu_q[dec:] - dec).contiguous()
    cu_k_rest = (cu_k[dec:] - kd).contiguous()
    max_q = max([c for c, _ in chunks], default=1)
    max_k = max([c + e for c, e in chunks], default=1)

    def hole():  # what a piecewise hole runs
        parts = []
        if dec:
            parts.append(paged_decode(q[:dec], k, v, slots, cu_k[:dec + 1], dec_ctx, scale))
        if chunks:
            kg, vg = k.index_select(0, gather), v.index_select(0, gather)
            parts.append(flash_varlen(q[dec:], kg, vg, cu_q_rest, cu_k_rest, max_q, max_k, scale))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def whole():  # what a whole-step token graph runs
        return pv.paged_varlen(q, k, v, slots, cu_q, cu_k, one, seq, first, scale)

    err = float((hole().float() - whole().float()).abs().max())
    t = time_interleaved({"hole": hole, "whole": whole}, warmup=3, iters=15)
    fl = _flops(qlens, klens)
    out = {"name": name, "rows": sum(qlens), "keys": sum(klens), "max_abs_diff": err,
           "piecewise_hole_ms": t["hole"]["median_ms"], "paged_varlen_ms": t["whole"]["median_ms"],
           "hole_tflops": fl / t["hole"]["median_ms"] / 1e9, "paged_varlen_tflops": fl / t["whole"]["median_ms"] / 1e9,
           "paged_over_hole": t["whole"]["median_ms"] / t["hole"]["median_ms"]}
    if chunks and not dec:  # the prefill chunks alone: FlashAttention-2 against cuDNN on the same gathered keys
        kg, vg = k.index_select(0, gather), v.index_select(0, gather)
        args = (q, kg, vg, cu_q_rest, cu_k_rest, max_q, max_k, scale)
        try:
            diff = float((cudnn_varlen(*args).float() - flash_varlen(*args).float()).abs().max())
            tc = time_interleaved({"flash": lambda: flash_varlen(*args), "cudnn": lambda: cudnn_varlen(*args)},
                                  warmup=3, iters=15)
            out["cudnn"] = {"max_abs_diff_vs_flash": diff, "flash_ms": tc["flash"]["median_ms"],
                            "cudnn_ms": tc["cudnn"]["median_ms"],
                            "cudnn_tflops": fl / tc["cudnn"]["median_ms"] / 1e9,
                            "cudnn_over_flash": tc["cudnn"]["median_ms"] / tc["flash"]["median_ms"]}
        except Exception as exc:  # noqa: BLE001 - a candidate: record why it does not run here
            out["cudnn"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if len(chunks) == 1 and not dec:  # one chunk: the product's dense kernels (model/dense_prefill.py) on it
        kg, vg = k.index_select(0, gather), v.index_select(0, gather)
        for kernel in (dp.dense_causal, dp.dense_causal_gqa):
            try:
                diff = float((kernel(q, kg, vg, scale).float() - flash_varlen(
                    q, kg, vg, cu_q_rest, cu_k_rest, max_q, max_k, scale).float()).abs().max())
                td = time_interleaved({"flash": lambda: flash_varlen(q, kg, vg, cu_q_rest, cu_k_rest, max_q, max_k,
                                                                     scale),
                                       "dense": lambda: kernel(q, kg, vg, scale)}, warmup=3, iters=15)
                out[kernel.__name__] = {"worthy": dp.dense_worthy(sum(qlens), sum(klens), dp.DENSE_MIN_ROWS),
                                        "max_abs_diff_vs_flash": diff, "flash_ms": td["flash"]["median_ms"],
                                        "dense_ms": td["dense"]["median_ms"],
                                        "dense_tflops": fl / td["dense"]["median_ms"] / 1e9,
                                        "dense_over_flash": td["dense"]["median_ms"] / td["flash"]["median_ms"]}
            except Exception as exc:  # noqa: BLE001 - record why it does not run here
                out[kernel.__name__] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if len(chunks) == 1 and not dec and chunks[0][1] == 0:  # one fresh chunk: the dense SDPA backends too
        ref = flash_varlen(q, k.index_select(0, gather), v.index_select(0, gather), cu_q_rest, cu_k_rest, max_q, max_k,
                           scale)
        out["dense"] = dense_backends(q, k.index_select(0, gather), v.index_select(0, gather), scale, ref, fl)
    return out


def dense_backends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ref: torch.Tensor,
                   flops: float) -> dict:
    """One causal sequence (q [L, Hq, D], k / v [L, Hk, D]) through each of PyTorch's dense SDPA backends: median
    device ms, TF/s and the largest difference from ``ref`` (FlashAttention-2's varlen output), or why it does not
    run here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q.shape[1] // k.shape[1]
    qd = q.transpose(0, 1)[None]  # [1, Hq, L, D]
    kd, vd = (t.repeat_interleave(rep, dim=1).transpose(0, 1)[None].contiguous() for t in (k, v))
    out: dict = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
        try:
            diff = float((run()[0].transpose(0, 1).float() - ref.float()).abs().max())
            ms = time_interleaved({"x": run}, warmup=3, iters=15)["x"]["median_ms"]
            out[backend.name.lower()] = {"ms": ms, "tflops": flops / ms / 1e9, "max_abs_diff_vs_flash_varlen": diff}
        except Exception as exc:  # noqa: BLE001 - a candidate: record why it does not run here
            out[backend.name.lower()] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return out


def cudnn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """``flash_varlen``'s contract through cuDNN (q [Nq, Hq, D], k / v [Nk, Hk, D] -> [Nq, Hq, D]): keys and values
    repeated to Hq heads (cuDNN's variable-length path takes no grouped-query heads)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, False, 0.0, True, False,
                                                   scale=scale)[0]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_argument(ap)
    args = ap.parse_args(argv)
    rows = []
    for name, (dec, ctx, chunks) in SHAPES.items():
        r = case(name, dec, ctx, chunks)
        rows.append(r)
        print(f"{name:48s} hole {r['piecewise_hole_ms']:8.3f} ms ({r['hole_tflops']:5.0f} TF/s)  paged_varlen "
              f"{r['paged_varlen_ms']:8.3f} ms ({r['paged_varlen_tflops']:5.0f} TF/s)  ratio {r['paged_over_hole']:.2f}"
              f"  diff {r['max_abs_diff']:.3g}", flush=True)
        if "cudnn" in r:
            c = r["cudnn"]
            print(f"{'':48s} cuDNN: " + (c["error"] if "error" in c else
                  f"{c['cudnn_ms']:8.3f} ms ({c['cudnn_tflops']:5.0f} TF/s) over FlashAttention-2 "
                  f"{c['cudnn_over_flash']:.2f}, diff {c['max_abs_diff_vs_flash']:.3g}"), flush=True)
        for name in ("dense_causal", "dense_causal_gqa"):
            c = r.get(name)
            if c is not None:
                print(f"{'':48s} product {name}: " + (c["error"] if "error" in c else
                      f"{c['dense_ms']:8.3f} ms ({c['dense_tflops']:5.0f} TF/s) over FlashAttention-2 "
                      f"{c['dense_over_flash']:.2f}, diff {c['max_abs_diff_vs_flash']:.3g}, worthy {c['worthy']}"),
                      flush=True)
        for bk, c in (r.get("dense") or {}).items():
            print(f"{'':48s} dense SDPA {bk}: " + (c["error"] if "error" in c else
                  f"{c['ms']:8.3f} ms ({c['tflops']:5.0f} TF/s), diff {c['max_abs_diff_vs_flash_varlen']:.3g}"),
                  flush=True)
    payload = {"what": "one layer's attention of a step: a piecewise hole (decode kernel + gathered FlashAttention-2"
                       " varlen) against the paged varlen kernel (every row in place), and for prefill chunks alone "
                       "cuDNN's varlen attention (a candidate) against FlashAttention-2, for one chunk the product's dense kernel "
                       "(model/dense_prefill.py: cuDNN on a padded square) against FlashAttention-2, and for one fresh chunk "
                       "PyTorch's dense SDPA backends (cuDNN, FlashAttention-2, memory-efficient); MEASURED device ms",
               "shape": {"heads": HQ, "kv_heads": HK, "head_dim": D, "dtype": "bfloat16"}, "cases": rows}
    print("wrote", write_result("paged_varlen", payload, out=args.out))
    return payload


if __name__ == "__main__":
    main()
