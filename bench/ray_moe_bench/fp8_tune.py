"""Tune the block-FP8 kernels' launch settings on this GPU, by measurement, and write the table the product reads.

    python -m ray_moe_bench.fp8_tune                          # the Qwen3-30B-A3B shape; table into the package
    python -m ray_moe_bench.fp8_tune --shape deepseek-v3 --install DIR

What runs (one GPU, the serving entry points, each candidate one CUDA-graph capture then ``--iters`` replays timed
with CUDA events, as the step graphs replay them):
  experts  ``fp8_swiglu`` reading token-major rows through the route order (the one-rank serving path), T tokens
           routed to top-k distinct experts at random (uniform), T in ``TOKENS``. Gate/up settings first (down at
           the heuristic), then down's with the best gate/up: a coordinate search, per T, over
           1. row tile x warps at 3 stages, 2. the best of those at 2 / 4 / 5 stages (down: x column tile too).
  linears  ``fp8_linear`` at every dense FP8 projection shape of the model (and the fused Q/K/V shape), rows in
           ``ROWS``: the Triton kernel searched the same way, 3. the winner with its K blocks split over 2 / 4 / 8
           programs (FP32 partials summed after: more programs for skinny steps), and ``torch._scaled_mm``'s
           blockwise GEMM (cuBLASLt) where it takes the call.
A candidate counts only if its output equals the heuristic launch's within 1e-2 of the largest value (a
setting that computes something else is rejected and listed). The fastest per (shape, rows) goes to the table
(``ray_moe.moe.experts.runners.fp8_configs``: ``configs/fp8-<gpu>.json``, merged with the table's other shapes),
the heuristic's time beside it in the result JSON ($RAY_MOE_RESULTS_DIR), with every candidate's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ray_moe.moe.experts.runners.fp8_configs import (
    BLOCK_MS,
    BLOCK_NS,
    CONFIG_DIR,
    SPLIT_KS,
    LaunchConfig,
    LinearBackend,
    LinearChoice,
    RowTable,
    SwigluChoice,
    TunedTable,
    dump_table,
    linear_key,
    parse_table,
    swiglu_key,
    table_path,
)
from ray_moe_bench.common import add_output_argument, write_result

BLOCK = (128, 128)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ROWS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FIRST_STAGES = 3
MORE_STAGES = (2, 4, 5)
WARPS = (4, 8)
AGREE = 1e-2
SPLIT_ROWS_MAX = 2048  # K-split candidates up to this many rows (more rows: programs enough without)


@dataclass(frozen=True)
class ExpertShape:
    experts: int
    hidden: int
    ffn: int
    top_k: int


SHAPES: dict[str, tuple[ExpertShape, tuple[tuple[str, int, int], ...]]] = {
    # name: (experts, dense FP8 projections (name, out, in)); the fused Q/K/V is q + k + v rows of one GEMM
    "qwen3-30b-a3b": (ExpertShape(128, 2048, 768, 8),
                      (("qkv_fused", 5120, 2048), ("o_proj", 2048, 4096))),
    "deepseek-v3": (ExpertShape(256, 7168, 2048, 8),
                    (("q_a_proj", 1536, 7168), ("q_b_proj", 24576, 1536), ("kv_a_proj_with_mqa", 576, 7168),
                     ("kv_b_proj", 32768, 512), ("o_proj", 7168, 16384), ("shared_gate_up", 2048, 7168),
                     ("shared_down", 7168, 2048), ("dense_gate_up", 18432, 7168), ("dense_down", 7168, 18432))),
}


def _tiles_for(rows: int) -> tuple[int, ...]:
    """Row tiles worth trying for ``rows`` rows per slot (a tile above the next power of two only pads)."""
    cap = max(16, 1 << max(int(rows) - 1, 0).bit_length())
    return tuple(b for b in BLOCK_MS if b <= cap)


def first_candidates(rows_per_slot: int, *, column_tiles: Sequence[int] = (128,)) -> list[LaunchConfig]:
    """Step 1 of the search: row tile x column tile x warps at ``FIRST_STAGES`` stages."""
    return [LaunchConfig(bm, bn, w, FIRST_STAGES)
            for bm, bn, w in itertools.product(_tiles_for(rows_per_slot), column_tiles, WARPS)]


def stage_candidates(best: LaunchConfig) -> list[LaunchConfig]:
    """Step 2: the best of step 1 at the other pipeline depths."""
    return [dataclasses.replace(best, stages=s) for s in MORE_STAGES]


def split_candidates(best: LaunchConfig) -> list[LaunchConfig]:
    """Step 3 (dense Linears): the best so far with its K blocks split over 2 / 4 / 8 programs per tile."""
    return [dataclasses.replace(best, split_k=k) for k in SPLIT_KS if k != 1]


def label(c: LaunchConfig) -> str:
    return f"m{c.block_m}n{c.block_n}w{c.warps}s{c.stages}" + (f"k{c.split_k}" if c.split_k != 1 else "")


def search(time_us: Callable[[LaunchConfig], float | None], first: Iterable[LaunchConfig],
           refine: Sequence[Callable[[LaunchConfig], list[LaunchConfig]]] = (stage_candidates,)) -> tuple[
               LaunchConfig, dict[str, Any]]:
    """The coordinate search: ``time_us(config)`` (None: rejected) over ``first``, then each ``refine`` step's
    variants of the winner so far; -> (fastest config, {label: us or None})."""
    seen: dict[LaunchConfig, float | None] = {}

    def best() -> LaunchConfig:
        ok = {c: t for c, t in seen.items() if t is not None}
        if not ok:
            raise RuntimeError("every candidate was rejected")
        return min(ok, key=lambda c: (ok[c], c.split_k, c.block_m, c.block_n, c.warps, c.stages))

    for c in first:
        seen[c] = time_us(c)
    for step in refine:
        for c in step(best()):
            if c not in seen:
                seen[c] = time_us(c)
    return best(), {label(c): t for c, t in seen.items()}


def merge(old: TunedTable | None, device: str, swiglu: dict[str, RowTable], linear: dict[str, RowTable],
          measured: dict[str, Any]) -> TunedTable:
    """The new table: ``old``'s shapes kept unless measured again now."""
    sw = {**(dict(old.swiglu_rows) if old else {}), **swiglu}
    li = {**(dict(old.linear_rows) if old else {}), **linear}
    return TunedTable(device, sw, li, {**(dict(old.measured) if old else {}), **measured})


# ----------------------------------------------------------------------------------------------- on the GPU
def _graph_us(fn: Callable[[], Any], iters: int) -> float:
    from ray_moe_bench.fp8_experts import time_graph_us

    return time_graph_us(fn, iters)


def _agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = got.float(), want.float()
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= AGREE * float(
        want.abs().max().clamp_min(1e-30))


def _timer(run: Callable[[Any], torch.Tensor], want: torch.Tensor, iters: int,
           log: Callable[[str], None]) -> Callable[[Any], float | None]:
    """time_us(choice): ``run(choice)``'s CUDA-graph replay time in us; None (rejected, logged) when its output is not
    ``want``'s (the heuristic launch's) within ``AGREE``, or it does not build or run here."""
    def time_us(choice: Any) -> float | None:
        try:
            if not _agree(run(choice), want):
                log(f"    rejected {choice}: its output differs from the heuristic launch's")
                return None
            return _graph_us(lambda: run(choice), iters)
        except Exception as exc:  # noqa: BLE001 - a setting that does not build or run here: rejected
            log(f"    rejected {choice}: {type(exc).__name__}: {str(exc)[:120]}")
            return None
    return time_us


def tune_experts(shape: ExpertShape, tokens: Sequence[int], iters: int, log: Callable[[str], None],
                 device: str = "cuda") -> tuple[RowTable, list[dict[str, Any]]]:
    """The expert kernels' table for ``shape`` (a RowTable by routed rows) and every measurement ("cuda"; the
    tests run it on CPU tensors under Triton's interpreter with the timer replaced)."""
    from ray_moe.moe.experts.fp8 import FP8_DTYPE, quantize, scale_shape
    from ray_moe.moe.experts.runners import fp8_kernels

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    e, d, f, k = shape.experts, shape.hidden, shape.ffn, shape.top_k
    codes, scales = [], []
    for out_f, in_f in ((f, d), (f, d), (d, f)):
        c = torch.empty(e, out_f, in_f, device=dev, dtype=FP8_DTYPE)
        s = torch.empty(e, *scale_shape((out_f, in_f), BLOCK), device=dev, dtype=torch.float32)
        for i in range(e):  # one expert at a time (DeepSeek-V3's float32 draws of all of them would not fit)
            c[i], s[i] = quantize(torch.randn(out_f, in_f, generator=g, device=dev) / in_f ** 0.5, BLOCK)
        codes.append(c)
        scales.append(s)
    rows_out, records = [], []
    for t in tokens:
        gen = torch.Generator().manual_seed(t)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).reshape(-1)
        order = torch.sort(ids, stable=True).indices.to(torch.int32).to(dev)
        bounds = torch.cumsum(torch.bincount(ids, minlength=e), 0).to(torch.int32).to(dev)
        x = torch.randn(t, d, generator=g, device=dev).to(torch.bfloat16)
        rows = t * k
        per_slot = int(torch.bincount(ids, minlength=e).max())
        heur = fp8_kernels.launch_config(fp8_kernels.row_block(rows, e))

        def run(ch: SwigluChoice) -> torch.Tensor:
            return fp8_kernels.fp8_swiglu(x, bounds, codes, scales, BLOCK, order=order, top_k=k, choice=ch)

        time_us = _timer(run, run(heur), iters, log)
        gu, gu_times = search(lambda c: time_us(SwigluChoice(c, heur.down)),
                              first_candidates(per_slot, column_tiles=(BLOCK[1],)))
        dn, dn_times = search(lambda c: time_us(SwigluChoice(gu, c)), first_candidates(per_slot, column_tiles=BLOCK_NS))
        best = SwigluChoice(gu, dn)
        heur_us, best_us = _graph_us(lambda: run(heur), iters), _graph_us(lambda: run(best), iters)
        records.append({"tokens": t, "rows": rows, "max_rows_per_expert": per_slot, "heuristic_us": heur_us,
                        "tuned_us": best_us, "gate_up": gu.to_json(), "down": dn.to_json(),
                        "gate_up_candidates_us": gu_times, "down_candidates_us": dn_times})
        rows_out.append((rows, best))
        log(f"  experts {t:5d} tokens ({rows:6d} rows): heuristic {heur_us:8.1f} us  tuned {best_us:8.1f} us  "
            f"gate/up {gu}  down {dn}")
        del x, time_us
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return RowTable(tuple(r for r, _ in rows_out), tuple(c for _, c in rows_out)), records


def tune_linear(out_f: int, in_f: int, rows_list: Sequence[int], iters: int, log: Callable[[str], None],
                device: str = "cuda") -> tuple[RowTable, list[dict[str, Any]]]:
    """A dense FP8 shape's table (a RowTable by rows) and every measurement (device: as ``tune_experts``)."""
    from ray_moe.moe.experts.fp8 import quantize
    from ray_moe.moe.experts.runners import fp8_kernels

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(1)
    codes, scales = quantize(torch.randn(out_f, in_f, generator=g, device=dev) / in_f ** 0.5, BLOCK)
    rows_out, records = [], []
    for rows in rows_list:
        x = torch.randn(rows, in_f, generator=g, device=dev).to(torch.bfloat16)
        heur = fp8_kernels.default_linear(rows)

        def run(ch: LinearChoice) -> torch.Tensor:
            return fp8_kernels.fp8_linear(x, codes, scales, BLOCK, choice=ch)

        time_us = _timer(run, run(heur), iters, log)
        tri, tri_times = search(lambda c: time_us(LinearChoice(LinearBackend.TRITON, c)),
                                first_candidates(rows, column_tiles=BLOCK_NS),
                                # (split partials [k, rows, out] FP32: tried where steps are skinny, not at prefill)
                                (stage_candidates, split_candidates) if rows <= SPLIT_ROWS_MAX else (stage_candidates,))
        scaled = LinearChoice(LinearBackend.SCALED_MM)
        why = fp8_kernels.scaled_mm_reason(x, out_f, in_f, BLOCK)
        smm = time_us(scaled) if why is None else None
        heur_us, tri_us = _graph_us(lambda: run(heur), iters), _graph_us(
            lambda: run(LinearChoice(LinearBackend.TRITON, tri)), iters)
        best = scaled if smm is not None and smm < tri_us else LinearChoice(LinearBackend.TRITON, tri)
        records.append({"rows": rows, "heuristic_us": heur_us, "triton_us": tri_us, "scaled_mm_us": smm,
                        "scaled_mm_reason": why, "chosen": best.backend.value, "triton": tri.to_json(),
                        "triton_candidates_us": tri_times})
        rows_out.append((rows, best))
        log(f"  linear {out_f}x{in_f} rows {rows:5d}: heuristic {heur_us:7.1f} us  triton {tri_us:7.1f} us ({tri})  "
            f"scaled_mm {('%.1f us' % smm) if smm is not None else (why or 'rejected')[:40]}  -> {best.backend.value}")
        del x, time_us
    return RowTable(tuple(r for r, _ in rows_out), tuple(c for _, c in rows_out)), records


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS), help="expert token counts")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS), help="dense Linear row counts")
    ap.add_argument("--install", metavar="DIR", default=str(CONFIG_DIR),
                    help="folder of the tuned tables (default: the package's, which the product reads)")
    add_output_argument(ap)
    a = ap.parse_args(argv)
    if a.iters < 1 or any(t < 1 for t in a.tokens) or any(r < 1 for r in a.rows):
        ap.error(f"--iters / --tokens / --rows must be >= 1 (got {a.iters}, {a.tokens}, {a.rows})")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    import triton

    device = torch.cuda.get_device_name(0)
    experts, linears = SHAPES[a.shape]
    start = time.monotonic()
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"tuning the FP8 kernels on {device} for {a.shape}")
    sw_table, sw_records = tune_experts(experts, a.tokens, a.iters, log)
    lin_tables, lin_records = {}, {}
    for name, out_f, in_f in linears:
        lin_tables[linear_key(out_f, in_f, BLOCK)], lin_records[name] = tune_linear(out_f, in_f, a.rows, a.iters, log)
    measured = {a.shape: {"tool": "ray_moe_bench.fp8_tune", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "torch": torch.__version__, "triton": triton.__version__, "iters": a.iters}}
    path = table_path(device, Path(a.install))
    old = parse_table(json.loads(path.read_text()), str(path)) if path.exists() else None
    table = merge(old, device, {swiglu_key(experts.hidden, experts.ffn, BLOCK): sw_table}, lin_tables, measured)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dump_table(table), indent=1) + "\n")
    log(f"table: {path} ({time.monotonic() - start:.0f} s)")
    payload = {"what": "block-FP8 kernel launch settings tuned by measurement (CUDA-graph replays, us per call); "
                       "the heuristic settings' time beside the tuned", "shape": a.shape, "device": device,
               "experts": {"shape": experts.__dict__, "records": sw_records}, "linears": lin_records,
               "table": str(path), "table_json": dump_table(table), "seconds": time.monotonic() - start}
    print("wrote", write_result("fp8_tune", payload, out=a.out))
    return payload


if __name__ == "__main__":
    main()
