"""FP8 vs BF16 dispatch: time, payload bytes and the combined output's error, per payload format.

Dispatch and dispatch+combine time (measured), payload bytes (from the real count matrix, and analytical),
and the error of the combined output, per payload format and tokens per rank.

    python -m ray_moe_bench.fp8_dispatch --world 2 --tokens 128,1024,4096 --iters 20   # GPU: 2 x H200, NCCL (< 90 s)
    python -m ray_moe_bench.fp8_dispatch                    # CPU: 4 ranks as threads over the in-process exchange
    python -m ray_moe_bench.fp8_dispatch --quick            # CPU smoke (< 60 s on 2 cores): d=1024, 64 tokens/rank

Backends (``--backend``, default ``auto``: ``nccl`` when CUDA is available and not ``--quick``, else
``local``): ``nccl`` runs one process per GPU (``--world``, default every visible GPU) over
``NcclExchange``; ``local`` runs the ranks as threads over ``LocalExchangeGroup`` (``--world`` default 4).
Both run the same rank body, ``bench_rank``, through ``ray_moe_dev.testing.spmd.run_spmd``; each rank builds
the snapshot and its own route batch on its device, deterministically from ``--seed`` and its rank.

Formats, all on the same routes in the same run: ``native`` (the BF16 payload, the baseline), ``fp8_row``
(e4m3 + one FP32 scale per row), ``fp8_block128`` (e4m3 + one FP32 scale per 128 values).

Measured on every rank, per format and tokens per rank:
  dispatch   engine.dispatch (validation, selection, plan, control round, quantize, payload all-to-all-v
             of rows + scales + int32 slot ids, receive repack) through dequantize of the received rows
             to BF16
  disp+comb  the above + identity expert (the dequantized BF16 rows go back unchanged) + engine.combine
             (return all-to-all-v of BF16 rows: the return payload is BF16 in every format)
Timing: ``--warmup`` steps, then ``--iters`` steps, each after a barrier (a control all-gather, then a CUDA
synchronize); CUDA events on GPU, ``perf_counter`` on CPU. A step's time is the maximum over ranks of
that iteration; the table reports the median (p10 / p90 in the JSON). On CPU (threads, no link) the
quantisation cost is all there is to see; on NCCL the FP8 formats halve the dispatch round's payload
bytes (the return round stays BF16), which is what the GPU run measures the time of.

Defaults: d=7168, k=8, E=32 experts (E / P contiguous per rank, no replicas), uniform routing; on nccl
tokens 128,1024,4096, warmup 3, iters 20; on local tokens 256, warmup 1, iters 5 (--quick: d=1024, 64 tokens,
3 iters). Output: ``fp8_dispatch-<suffix>.json`` in ``--out DIR`` (default ``$RAY_MOE_RESULTS_DIR``, else
``./ray-moe-results``) with suffix ``host_kind()`` on nccl (e.g. ``h200x2``), ``cpu`` on local, ``cpu-quick``
with --quick.

Bytes of the dispatch round (all ranks together, remote rows only: the local rows cross no link):
  wire_bytes_from_counts  remote rows of the real count matrix * (d * element bytes + scales * 4 + 4
                          slot-id bytes): the tensors handed to all_to_all_v, computed from the counts
                          (not a fabric measurement)
  ledger bytes            ``PrecisionPayloadLedger`` (analytical, spec 0x0AB: data + scales, no slot ids)
Error: ||y - h * sum(gates)||_F / ||h * sum(gates)||_F in FP64 per rank (identity experts, so only the
payload precision and the BF16 output contribute), maximum over ranks.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ray_moe_bench import summary
from ray_moe_bench.common import add_output_argument, build_snapshot, host_kind, spmd_measure, step_stats, write_result
from ray_moe_dev.analysis.precision_ledger import PrecisionPayloadLedger
from ray_moe.moe.dispatch.engine import combine, dispatch
from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.dispatch.precision import FP8_DTYPE, dequantize, scales_per_row
from ray_moe.core.routes import RouteBatch
from ray_moe.placement.selector import make_selector
from ray_moe_dev.testing.spmd import exchange_device, run_spmd
from ray_moe.core.types import PayloadFormat

MiB = 1 << 20
FORMATS = (PayloadFormat.NATIVE, PayloadFormat.FP8_ROW, PayloadFormat.FP8_BLOCK128)
SLOT_ID_BYTES = 4  # int32 slot id per dispatched row
SCALE_BYTES = 4  # float32 scale
ACT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Fp8BenchConfig:
    """One run. tokens: tokens per rank of each case."""

    world: int
    backend: str  # "nccl" | "local"
    d: int
    k: int
    experts: int
    tokens: tuple[int, ...]
    warmup: int
    iters: int
    seed: int


# ------------------------------------------------------------------------------------ rank side
def make_batch(rank: int, tokens: int, cfg: Fp8BenchConfig, device: torch.device) -> RouteBatch:
    """Uniform routing of one rank, generated on ``device`` from (seed, rank, tokens): hidden [T, d] bf16,
    topk_ids [T, k] int64 distinct experts, topk_weights [T, k] float32 gates uniform in [0, 1) (not
    normalised: the BF16 output's rounding shows in the native format's error)."""
    g = torch.Generator(device=device).manual_seed(cfg.seed * 7919 + rank * 104729 + tokens)
    hidden = torch.randn(tokens, cfg.d, generator=g, device=device, dtype=torch.float32).to(ACT_DTYPE)
    ids = torch.rand(tokens, cfg.experts, generator=g, device=device).topk(cfg.k, dim=1).indices.to(torch.int64)
    gates = torch.rand(tokens, cfg.k, generator=g, device=device)
    return RouteBatch(rank, hidden, ids, gates)


def bench_rank(exchange: Exchange, rank: int, cfg_fields: dict[str, Any]) -> dict[str, Any]:
    """The per-rank body (``run_spmd``, NCCL processes or local threads): every tokens case and format in
    order. Returns plain data: per case and format the samples, the error and the count matrix."""
    cfg = Fp8BenchConfig(**{**cfg_fields, "tokens": tuple(cfg_fields["tokens"])})
    device = exchange_device(exchange)
    snap = build_snapshot(exchange.size, cfg.experts)
    sel = make_selector("round_robin")
    cases = []
    for tokens in cfg.tokens:
        batch = make_batch(rank, tokens, cfg, device)
        ref = batch.hidden.double() * batch.topk_weights.double().sum(1, keepdim=True)
        per_fmt: dict[str, Any] = {}
        for fmt in FORMATS:
            def disp(tag: str, fmt: PayloadFormat = fmt):
                o = dispatch(batch, snap, exchange, selector=sel, tag=tag, payload_format=fmt)
                return o, dequantize(o.rows, o.scales, fmt, ACT_DTYPE)

            def full(tag: str, fmt: PayloadFormat = fmt) -> torch.Tensor:
                o, x = disp(tag, fmt)
                return combine(x, o.handle, snap, exchange, tag=tag, out_dtype=ACT_DTYPE)

            label = f"T{tokens}/{fmt.value}"
            # one checked step: identity experts, so y = h * sum(gates) up to the payload's precision
            o, x = disp(f"{label}/check")
            y = combine(x, o.handle, snap, exchange, tag=f"{label}/check", out_dtype=ACT_DTYPE)
            den = float(ref.norm())
            err = float((y.double() - ref).norm()) / den if den else 0.0
            counts = o.handle.count_matrix.tolist()
            sent_dtype = str(o.rows.dtype)
            del o, x, y
            per_fmt[fmt.value] = {
                "rel_error": err,
                "count_matrix": counts,
                "received_dtype": sent_dtype,
                "dispatch_ms": spmd_measure(exchange, device, f"{label}/d", disp, warmup=cfg.warmup, iters=cfg.iters),
                "dispatch_combine_ms": spmd_measure(exchange, device, f"{label}/dc", full, warmup=cfg.warmup, iters=cfg.iters),
            }
        cases.append({"tokens": tokens, "formats": per_fmt})
        del batch, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rank": rank, "device": str(device), "cases": cases}


# ---------------------------------------------------------------------------------- parent side
def row_bytes(fmt: PayloadFormat, d: int) -> dict[str, int]:
    """Bytes per dispatched row handed to all_to_all_v: data, scales, slot id."""
    elem = ACT_DTYPE.itemsize if fmt is PayloadFormat.NATIVE else FP8_DTYPE.itemsize
    return {"data": d * elem, "scales": scales_per_row(fmt, d) * SCALE_BYTES, "slot_id": SLOT_ID_BYTES}


def aggregate(cfg: Fp8BenchConfig, ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tokens case, per format: time statistics, bytes (from counts and analytical), ratios, error."""
    out: dict[str, dict[str, Any]] = {}
    for ci, tokens in enumerate(cfg.tokens):
        per = [r["cases"][ci]["formats"] for r in ranks]
        case: dict[str, Any] = {}
        for fmt in FORMATS:
            f = fmt.value
            counts = np.asarray(per[0][f]["count_matrix"], dtype=np.int64)
            agree = all(np.array_equal(counts, np.asarray(p[f]["count_matrix"])) for p in per)
            if not agree:
                raise RuntimeError(f"T={tokens} {f}: the ranks' count matrices differ")
            remote = int(counts.sum() - np.trace(counts))
            local = int(np.trace(counts))
            rb = row_bytes(fmt, cfg.d)
            per_row = sum(rb.values())
            send_remote = counts.sum(axis=1) - np.diag(counts)
            ledger = PrecisionPayloadLedger(remote, cfg.d, fmt)
            case[f] = {
                "dispatch": step_stats([p[f]["dispatch_ms"] for p in per]),
                "dispatch_combine": step_stats([p[f]["dispatch_combine_ms"] for p in per]),
                "rel_error_vs_exact": max(p[f]["rel_error"] for p in per),
                "rel_error_per_rank": [p[f]["rel_error"] for p in per],
                "received_dtype": per[0][f]["received_dtype"],
                "count_matrix": counts.tolist(),
                "remote_rows": remote,
                "local_rows": local,
                "row_bytes": rb,
                "wire_bytes_from_counts": remote * per_row,
                "wire_bytes_from_counts_max_rank": int(send_remote.max()) * per_row,
                "combine_wire_bytes_from_counts": remote * cfg.d * ACT_DTYPE.itemsize,
                "dispatch_payload_bytes_analytical": ledger.total_bytes,
                "ledger": ledger.as_dict(),
            }
        base = case["native"]
        for f, r in case.items():
            r["wire_bytes_vs_bf16"] = r["wire_bytes_from_counts"] / base["wire_bytes_from_counts"] \
                if base["wire_bytes_from_counts"] else None
            r["analytical_bytes_vs_bf16"] = r["dispatch_payload_bytes_analytical"] / \
                base["dispatch_payload_bytes_analytical"] if base["dispatch_payload_bytes_analytical"] else None
            r["dispatch_time_vs_bf16"] = r["dispatch"]["median_ms"] / base["dispatch"]["median_ms"]
            r["dispatch_combine_time_vs_bf16"] = (r["dispatch_combine"]["median_ms"]
                                                  / base["dispatch_combine"]["median_ms"])
        out[str(tokens)] = case
    return out


def print_table(cfg: Fp8BenchConfig, res: dict[str, dict[str, Any]], timer: str) -> None:
    print(f"\nfp8_dispatch: world={cfg.world} backend={cfg.backend} d={cfg.d} k={cfg.k} E={cfg.experts} "
          f"warmup={cfg.warmup} iters={cfg.iters}")
    print(f"time: measured ({timer}), max over ranks per iteration, median; bytes: dispatch round, remote rows, "
          f"all ranks (wire = from counts incl. scales + slot ids; ledger = analytical)")
    head = (f"{'T/rank':>6} {'format':13} {'disp ms':>8} {'x bf16':>6} {'d+c ms':>8} {'x bf16':>6} "
            f"{'wire MiB':>9} {'x bf16':>6} {'ledger MiB':>10} {'x bf16':>6} {'rel err':>9}")
    print(head)
    print("-" * len(head))
    for t, case in res.items():
        for f, r in case.items():
            print(f"{t:>6} {f:13} {r['dispatch']['median_ms']:8.3f} {r['dispatch_time_vs_bf16']:6.2f} "
                  f"{r['dispatch_combine']['median_ms']:8.3f} {r['dispatch_combine_time_vs_bf16']:6.2f} "
                  f"{r['wire_bytes_from_counts'] / MiB:9.2f} {r['wire_bytes_vs_bf16'] or 0:6.3f} "
                  f"{r['dispatch_payload_bytes_analytical'] / MiB:10.2f} {r['analytical_bytes_vs_bf16'] or 0:6.3f} "
                  f"{r['rel_error_vs_exact']:9.2e}")


def config_from_args(a: argparse.Namespace) -> Fp8BenchConfig:
    if a.backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and not a.quick else "local"
    else:
        backend = a.backend
    gpu = backend == "nccl"
    world = a.world or (torch.cuda.device_count() if gpu else 4)
    if a.quick:
        d = a.d or 1024
        tokens = a.tokens or "64"
        warmup = 1 if a.warmup is None else a.warmup
        iters = a.iters or 3
    else:
        d = a.d or 7168
        tokens = a.tokens or ("128,1024,4096" if gpu else "256")
        warmup = (3 if gpu else 1) if a.warmup is None else a.warmup
        iters = a.iters or (20 if gpu else 5)
    return Fp8BenchConfig(world=world, backend=backend, d=d, k=a.k, experts=a.experts,
                          tokens=tuple(int(t) for t in str(tokens).split(",") if t.strip()),
                          warmup=warmup, iters=iters, seed=a.seed)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--backend", default="auto", choices=("auto", "local", "nccl"),
                    help="auto: nccl when CUDA is available and not --quick, else local (CPU threads)")
    ap.add_argument("--world", type=int, default=0, help="ranks (default: every visible GPU on nccl, 4 on local)")
    ap.add_argument("--tokens", default="", help="comma-separated tokens per rank "
                                                 "(default: 128,1024,4096 on nccl, 256 on local, 64 with --quick)")
    ap.add_argument("--d", type=int, default=0, help="hidden width (default 7168; 1024 with --quick)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=None, help="default 3 on nccl, 1 on local")
    ap.add_argument("--iters", type=int, default=0, help="default 20 on nccl, 5 on local, 3 with --quick")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="CPU smoke: local threads, d=1024, 64 tokens, 3 iters")
    ap.add_argument("--timeout-s", type=float, default=570.0, help="limit of the whole run")
    ap.add_argument("--exchange-timeout-s", type=float, default=60.0, help="watchdog on one exchange round")
    add_output_argument(ap)
    a = ap.parse_args(argv)
    cfg = config_from_args(a)
    print(f"fp8_dispatch: world={cfg.world} backend={cfg.backend} tokens/rank={list(cfg.tokens)} d={cfg.d}",
          flush=True)
    t0 = time.monotonic()
    ranks = run_spmd(bench_rank, cfg.world, args=(asdict(cfg),), backend=cfg.backend, timeout_s=a.timeout_s,
                     exchange_timeout_s=a.exchange_timeout_s)
    res = aggregate(cfg, ranks)
    gpu = cfg.backend == "nccl"
    timer = "CUDA events" if gpu else "perf_counter, CPU threads"
    print_table(cfg, res, timer)
    wall = time.monotonic() - t0
    if gpu:
        suffix = host_kind() + ("-quick" if a.quick else "")
    else:
        suffix = "cpu-quick" if a.quick else "cpu"
    path = write_result("fp8_dispatch", {
        "mode": "quick" if a.quick else "full",
        "shapes": {"world": cfg.world, "d": cfg.d, "tokens_per_rank": list(cfg.tokens), "k": cfg.k,
                   "experts": cfg.experts, "activation_dtype": "bfloat16"},
        "backend": ("nccl (one process per GPU, NcclExchange)" if gpu
                    else "local threads (CPU, LocalExchangeGroup)"),
        "config": asdict(cfg),
        "devices": [r["device"] for r in ranks],
        "evidence": {
            "time": f"measured ({timer})",
            "wire_bytes_from_counts": "from counts: remote rows of the real count matrix * (data + scale + "
                                      "4 slot-id bytes per row); computed, not a fabric measurement",
            "dispatch_payload_bytes_analytical": "analytical (PrecisionPayloadLedger: data + scales)",
            "rel_error_vs_exact": "measured vs FP64 h * sum(gates) (identity experts), max over ranks",
        },
        "definitions": {
            "dispatch": "engine.dispatch (incl. quantize) through dequantize of the received rows to bf16",
            "dispatch_combine": "dispatch + identity expert (dequantized bf16 rows) + engine.combine (bf16 return)",
            "step_time": "max over ranks per iteration, then median / p10 / p90 over iterations",
            "bytes": "dispatch round only, all ranks together, remote (off-diagonal) rows only",
            "combine_wire_bytes_from_counts": "the return round's bf16 rows (the same in every format)",
            "x_vs_bf16": "value of the format / value of the native (bf16) payload in the same run",
        },
        "results": res,
        "wall_s": wall,
    }, suffix=suffix, out=a.out)
    print(f"wrote {path} ({wall:.1f} s)")
    return path


if __name__ == "__main__":
    main()
