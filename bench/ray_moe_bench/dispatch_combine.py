"""Dispatch + combine exchange benchmark: our planned all-to-all-v against raw NCCL and torch.distributed.

    python -m ray_moe_bench.dispatch_combine                 # GPU: one process per visible GPU (--world N), NCCL
    python -m ray_moe_bench.dispatch_combine --world 2 --tokens 64,4096
    python -m ray_moe_bench.dispatch_combine --quick         # CPU smoke (< 60 s): local exchange threads, tiny shapes

Paths, all on the same routes, rows and split vectors (per case, measured in the same run):

  ours        ray_moe.moe.dispatch.engine.dispatch + combine (handle check deferred, as the runtime runs it)
              with an identity expert (the expert rows go back
              unchanged, so no compute): validation, replica selection, source plan, control all-gather,
              payload all-to-all-v (rows + int32 slot ids), receive plan and repack, inverse repack, return
              all-to-all-v, inverse send, gated FP32 combine.
  raw         NcclExchange.all_to_all_v on a pre-packed [R, d] buffer with the same splits, dispatch then
              return: grouped CuPy NCCL send/recv and nothing else (no planning, no repacks, no combine).
              On CPU (--quick) the same call through the local exchange.
  torch_dist  torch.distributed.all_to_all_single (NCCL backend) with the same uneven splits, dispatch then
              return, into preallocated outputs.
  direct_cN   ``DirectDispatcher(chunks=N)`` dispatch + combine (dispatch/direct.py): one host copy before
              two control all-gathers, own rows never enter the network (one gather/scatter kernel), peer
              rows in N chunk rounds on a separate stream overlapping packs and placements, one-pass gated
              FP32 combine (Triton on CUDA). Same rows, counts and output as ``ours`` (checked per case).
  plan        the planning overhead alone: engine.dispatch up to and including the control all-gather
              (validation, selection, plan_source, the counts' device->host copy), ended by a planted
              status so every rank aborts before payload.

Proposed patches, measured beside them (prototypes in this file; see the report):

  ours_fastcombine  engine.dispatch + ``combine_fast``: inverse repack as a gather, host split vectors
              from the count matrix, gated FP32 sum per route slot (no [R, d] FP32 temporary, no atomics).
  ours_fast   ``fast_dispatch`` + ``combine_fast``: the engine's protocol and results (checked equal on
              every case) with a device-resident snapshot, sync-free counting and ONE device->host copy
              before the control round instead of ~20 stream syncs.
  raw_with_slot  raw plus the int32 slot-id tensor in the dispatch round (the engine's metadata cost).
  raw_selfgroup  raw with the self segment as a send/recv to self inside the NCCL group instead of a
              device copy queued before it (NCCL only).

Stages (on unless ``--no-stages``): the local, communication-free pieces of ``ours`` timed alone on each
rank (CUDA events, median), to attribute the gap between ``ours`` and ``raw``.

Timing: CUDA events around one dispatch+return step after a barrier (a control all-gather that also
drains the stream), ``--warmup`` steps first, then ``--iters`` (>= 20 on GPU) steps. A step's time is the
maximum over ranks of that iteration; the table reports the median (p10 / p90 in the JSON).

Bytes (per case; R = routes sent by a rank, row = d * element size):
  per-peer bytes  mean over ordered rank pairs (s != t) of rows(s -> t) * row, for one exchange
  size            per-rank send buffer of one all-to-all, R * row (nccl-tests' "size" for alltoall)
  algbw           2 * size / time (dispatch + return: two all-to-alls per step)
  busbw           algbw * (P - 1) / P (nccl-tests' all-to-all bus bandwidth)
  frac_of_raw     raw time / ours time (1.0 = parity with raw NCCL)
Routing is uniform: every token picks k distinct experts out of E uniformly at random; experts are split
evenly over the ranks (E / P slots per rank, no replicas).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any, Callable

import numpy as np
import torch

from ray_moe_bench import summary
from ray_moe_bench.common import (add_output_argument, build_snapshot, device_sync, host_kind, spmd_measure, step_stats,
                                  timed_ms, write_result)
from ray_moe.moe.dispatch.combine import combine_routes
from ray_moe.moe.dispatch.engine import check_handle, combine, dispatch
from ray_moe.moe.exchange.base import Exchange
from ray_moe_bench.dispatch_prototypes import (
    DeviceSnapshot,
    all_to_all_v_in_group,
    combine_fast,
    fast_dispatch,
    host_splits,
)
from ray_moe.moe.dispatch.plan import check_assignment, plan_receive, plan_source, semantic_from_send, source_major_from_expert
from ray_moe.moe.dispatch.protocol import ControlStatus, DeferredChecks
from ray_moe.moe.dispatch.records import DispatchHandle
from ray_moe.core.routes import RouteBatch, SemanticRoutes
from ray_moe.core.errors import CountAgreementError, RouteValidationError
from ray_moe.placement.selector import ReplicaSelector, make_selector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe_dev.testing.spmd import exchange_device, run_spmd

MiB = 1 << 20
AUTO_TOKENS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
PER_PEER_RANGE = (0.75 * MiB, 300 * MiB)  # the automatic token list spans ~1 MiB .. 256 MiB per peer
BASE_PATHS = ("ours", "ours_fastcombine", "ours_fast", "raw", "raw_with_slot", "raw_selfgroup", "torch_dist", "plan")


def direct_name(chunks: int) -> str:
    return f"direct_c{chunks}"


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. tokens: prefill tokens per rank; decode_tokens: the decode case (per rank)."""

    world: int
    backend: str  # "nccl" (one process per GPU) | "local" (CPU threads)
    d: int
    k: int
    num_experts: int
    tokens: tuple[int, ...]
    decode_tokens: int
    dtype: str
    warmup: int
    iters: int
    stage_iters: int
    seed: int
    dist: bool
    stages: bool
    proposed: bool
    direct_chunks: tuple[int, ...] = (1, 2, 4)

    @property
    def paths(self) -> tuple[str, ...]:
        return BASE_PATHS[:3] + tuple(direct_name(c) for c in self.direct_chunks) + BASE_PATHS[3:]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def row_bytes(self) -> int:
        return self.d * torch.empty(0, dtype=self.torch_dtype).element_size()

    def cases(self) -> list[tuple[str, int]]:
        out = [("decode", self.decode_tokens)] if self.decode_tokens else []
        return out + [("prefill", t) for t in self.tokens if t != self.decode_tokens]


def auto_tokens(world: int, k: int, row_bytes: int) -> tuple[int, ...]:
    """Prefill token counts whose expected per-peer payload T*k/P*row lies in ``PER_PEER_RANGE``."""
    lo, hi = PER_PEER_RANGE
    return tuple(t for t in AUTO_TOKENS if lo <= t * k / max(world, 1) * row_bytes <= hi)


# ------------------------------------------------------------------------------------ rank side
@dataclass(frozen=True, eq=False)
class RankContext:
    """What every measurement on one rank shares."""

    exchange: Exchange
    rank: int
    cfg: BenchConfig
    device: torch.device
    snapshot: PlacementSnapshot
    dsnap: DeviceSnapshot
    selector: ReplicaSelector
    dist_on: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def make_batch(ctx: RankContext, tokens: int) -> RouteBatch:
    """Uniform routing on one rank: hidden [T, d] (cfg dtype), topk_ids [T, k] int64 distinct experts,
    topk_weights [T, k] float32 softmax gates. Generated on the rank's device."""
    cfg, dev = ctx.cfg, ctx.device
    g = torch.Generator(device=dev).manual_seed(cfg.seed * 7919 + ctx.rank * 104729 + tokens)
    hidden = torch.randn(tokens, cfg.d, generator=g, device=dev, dtype=torch.float32).to(cfg.torch_dtype)
    scores = torch.rand(tokens, cfg.num_experts, generator=g, device=dev)
    ids = scores.topk(cfg.k, dim=1).indices.to(torch.int64)
    gates = torch.softmax(torch.randn(tokens, cfg.k, generator=g, device=dev), dim=1)
    return RouteBatch(ctx.rank, hidden, ids, gates)


def _sync(ctx: RankContext) -> None:
    device_sync(ctx.device)


def _timed_ms(ctx: RankContext, fn: Callable[[], Any]) -> float:
    return timed_ms(ctx.device, fn)


def measure(ctx: RankContext, label: str, step: Callable[[str], Any]) -> list[float]:
    """Per-iteration milliseconds of ``step(tag)`` on this rank: warmup, then barrier + timed step."""
    return spmd_measure(ctx.exchange, ctx.device, label, step, warmup=ctx.cfg.warmup, iters=ctx.cfg.iters)


def local_median_ms(ctx: RankContext, fn: Callable[[], Any], iters: int) -> float:
    """Median ms of a communication-free piece of work on this rank."""
    for _ in range(2):
        fn()
    _sync(ctx)
    return statistics.median(_timed_ms(ctx, fn) for _ in range(iters))


def stage_times(ctx: RankContext, batch: RouteBatch, handle: DispatchHandle, rows: torch.Tensor) -> dict[str, float]:
    """Median ms of each communication-free piece of ``ours`` on this rank (same tensors as the run)."""
    cfg, snap, dev = ctx.cfg, ctx.snapshot, ctx.device
    routes, source, receive = handle.routes, handle.source, handle.receive
    it = cfg.stage_iters
    send_tokens = routes.origin_token[source.send_order]
    packed = batch.hidden.index_select(0, send_tokens)  # [R, d], stands in for the returned rows
    recv_counts = receive.recv_counts.to(dev)

    def select_and_plan() -> None:
        r = SemanticRoutes.from_batch(batch)
        slots = ctx.selector.select(r, snap).to(dev)
        check_assignment(r, slots, snap)
        plan_source(r, slots, snap).send_counts.cpu()

    semantic = semantic_from_send(packed, source)
    out = {
        "validate": local_median_ms(ctx, lambda: batch.validate(snap.num_experts), it),
        "select_plan_source": local_median_ms(ctx, select_and_plan, it),
        "pack_gather": local_median_ms(ctx, lambda: batch.hidden.index_select(0, send_tokens), it),
        "plan_receive": local_median_ms(ctx, lambda: plan_receive(ctx.rank, recv_counts, receive.recv_slot, snap), it),
        "recv_repack": local_median_ms(ctx, lambda: rows.index_select(0, receive.expert_order), it),
        "return_repack": local_median_ms(ctx, lambda: source_major_from_expert(rows, receive), it),
        "check_handle": local_median_ms(ctx, lambda: check_handle(handle), it),
        "unsend_gather": local_median_ms(ctx, lambda: semantic_from_send(packed, source), it),
        "combine_routes": local_median_ms(ctx, lambda: combine_routes(semantic, routes, cfg.torch_dtype), it),
    }
    if ctx.cuda:  # one device copy of the payload: the HBM yardstick for the passes above
        out["copy_payload"] = local_median_ms(ctx, lambda: packed.clone(), it)
    return out


def run_case(ctx: RankContext, phase: str, tokens: int, case_id: str) -> dict[str, Any]:
    """Every path on one case; returns plain data (lists, floats) for the parent."""
    cfg, ex, snap = ctx.cfg, ctx.exchange, ctx.snapshot
    dtype = cfg.torch_dtype
    batch = make_batch(ctx, tokens)
    want = (batch.hidden.float() * batch.topk_weights.sum(dim=1, keepdim=True)).to(dtype)

    # the handle checks are deferred as in the runtime (read with the step's output, not inside the step)
    deferred = DeferredChecks()

    def ours(tag: str) -> torch.Tensor:
        out = dispatch(batch, snap, ex, selector=ctx.selector, tag=tag)
        return combine(out.rows, out.handle, snap, ex, tag=tag, out_dtype=dtype, checks=deferred)

    def ours_fastcombine(tag: str) -> torch.Tensor:
        out = dispatch(batch, snap, ex, selector=ctx.selector, tag=tag)
        return combine_fast(out.rows, out.handle, ex, tag=tag, out_dtype=dtype)

    def ours_fast(tag: str) -> torch.Tensor:
        out = fast_dispatch(batch, snap, ctx.dsnap, ex, tag=tag, selector=ctx.selector)
        return combine_fast(out.rows, out.handle, ex, tag=tag, out_dtype=dtype)

    def plan_only(tag: str) -> None:
        try:
            dispatch(batch, snap, ex, selector=ctx.selector, tag=tag, status=ControlStatus.FAULT)
        except CountAgreementError:
            return
        raise RuntimeError("the planted FAULT status did not abort the step")

    # 1. one checked step: identity expert -> y_t = h_t * sum_j g_tj
    ref = dispatch(batch, snap, ex, selector=ctx.selector, tag=f"{case_id}/check")
    y = combine(ref.rows, ref.handle, snap, ex, tag=f"{case_id}/check", out_dtype=dtype)
    scale = float(want.float().abs().max()) if tokens else 1.0
    checks: dict[str, Any] = {"ours_max_rel_err": _rel_err(y, want, scale)}
    send, recv = host_splits(ref.handle, ex)
    r_rows, n_rows = sum(send), sum(recv)
    samples: dict[str, list[float]] = {}
    # 2. ours, and the planning overhead alone
    samples["ours"] = measure(ctx, f"{case_id}/ours", ours)
    samples["plan"] = measure(ctx, f"{case_id}/plan", plan_only)
    if cfg.proposed:
        checks["ours_fastcombine_max_rel_err"] = _rel_err(ours_fastcombine(f"{case_id}/fccheck"), want, scale)
        samples["ours_fastcombine"] = measure(ctx, f"{case_id}/fastcomb", ours_fastcombine)
        fast = fast_dispatch(batch, snap, ctx.dsnap, ex, tag=f"{case_id}/fdcheck", selector=ctx.selector)
        checks["fast_dispatch_equals_engine_exact"] = bool(
            torch.equal(fast.rows, ref.rows) and fast.counts_list == ref.counts_list
            and torch.equal(fast.handle.source.send_order, ref.handle.source.send_order)
            and torch.equal(fast.handle.receive.expert_order, ref.handle.receive.expert_order)
            and torch.equal(fast.handle.count_matrix, ref.handle.count_matrix))
        checks["ours_fast_max_rel_err"] = _rel_err(ours_fast(f"{case_id}/fcheck"), want, scale)
        samples["ours_fast"] = measure(ctx, f"{case_id}/fast", ours_fast)
    # 2b. the direct path, one dispatcher (its comm stream) per chunk count, checked against ``ours``
    from ray_moe.moe.dispatch.direct import DirectDispatcher

    for chunks in cfg.direct_chunks:
        dd = DirectDispatcher(ex, ctx.selector, chunks=chunks)
        name = direct_name(chunks)

        def direct(tag: str, dd=dd) -> torch.Tensor:
            out = dd.dispatch(batch, snap, tag=tag)
            return dd.combine(out.rows, out.handle, snap, tag=tag, out_dtype=dtype, checks=deferred)

        chk = dd.dispatch(batch, snap, tag=f"{case_id}/{name}check")
        checks[f"{name}_rows_equal_engine_exact"] = bool(torch.equal(chk.rows, ref.rows)
                                                         and chk.counts_list == ref.counts_list)
        checks[f"{name}_max_rel_err"] = _rel_err(dd.combine(chk.rows, chk.handle, snap, tag=f"{case_id}/{name}check",
                                                            out_dtype=dtype), want, scale)
        del chk
        samples[name] = measure(ctx, f"{case_id}/{name}", direct)
    try:
        deferred.verify()
        checks["deferred_handle_checks_ok_exact"] = True
    except RouteValidationError:
        checks["deferred_handle_checks_ok_exact"] = False
    deferred = DeferredChecks()  # drop the flags read above (the closures use the fresh one)
    # 3. raw exchange of the same bytes (pre-packed, no planning)
    g = torch.Generator(device=ctx.device).manual_seed(cfg.seed + 17 * ctx.rank + tokens)
    buf = torch.randn(r_rows, cfg.d, generator=g, device=ctx.device, dtype=torch.float32).to(dtype)

    def raw(tag: str) -> torch.Tensor:
        got = ex.all_to_all_v(f"{tag}/d", {"x": buf}, send, recv)["x"]
        return ex.all_to_all_v(f"{tag}/c", {"y": got}, recv, send)["y"]

    slot_ids = ref.handle.source.send_slot.to(torch.int32)

    def raw_with_slot(tag: str) -> torch.Tensor:
        got = ex.all_to_all_v(f"{tag}/d", {"x": buf, "slot": slot_ids}, send, recv)["x"]
        return ex.all_to_all_v(f"{tag}/c", {"y": got}, recv, send)["y"]

    def raw_selfgroup(tag: str) -> torch.Tensor:
        got = all_to_all_v_in_group(ex, {"x": buf}, send, recv)["x"]
        return all_to_all_v_in_group(ex, {"y": got}, recv, send)["y"]

    checks["raw_round_trip_exact"] = bool(torch.equal(raw(f"{case_id}/rcheck"), buf))
    samples["raw"] = measure(ctx, f"{case_id}/raw", raw)
    samples["raw_with_slot"] = measure(ctx, f"{case_id}/rawslot", raw_with_slot)
    if ctx.cuda and hasattr(ex, "comm"):
        checks["raw_selfgroup_round_trip_exact"] = bool(torch.equal(raw_selfgroup("x"), buf))
        samples["raw_selfgroup"] = measure(ctx, f"{case_id}/rawself", raw_selfgroup)
    # 4. torch.distributed all_to_all_single, same splits
    if ctx.dist_on:
        import torch.distributed as dist

        mid = torch.empty(n_rows, cfg.d, dtype=dtype, device=ctx.device)
        back = torch.empty(r_rows, cfg.d, dtype=dtype, device=ctx.device)

        def tdist(tag: str) -> None:
            dist.all_to_all_single(mid, buf, output_split_sizes=recv, input_split_sizes=send)
            dist.all_to_all_single(back, mid, output_split_sizes=send, input_split_sizes=recv)

        tdist("check")
        _sync(ctx)
        checks["torch_dist_round_trip_exact"] = bool(torch.equal(back, buf))
        samples["torch_dist"] = measure(ctx, f"{case_id}/tdist", tdist)
    stages = stage_times(ctx, batch, ref.handle, ref.rows) if cfg.stages else {}
    del buf
    return {"phase": phase, "tokens": tokens, "send": send, "recv": recv, "samples": samples, "stages": stages,
            "checks": checks}


def _rel_err(y: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    if y.numel() == 0:
        return 0.0
    return float((y.float() - want.float()).abs().max()) / (scale or 1.0)


def bench_rank(exchange: Exchange, rank: int, cfg_fields: dict[str, Any]) -> dict[str, Any]:
    """The per-rank body run by ``run_spmd``: every case in order. Returns plain data only."""
    cfg = BenchConfig(**{**cfg_fields, "tokens": tuple(cfg_fields["tokens"]),
                         "direct_chunks": tuple(cfg_fields.get("direct_chunks", ()))})
    dist_on = False
    if cfg.dist:
        import torch.distributed as dist

        dist_on = dist.is_available() and dist.is_initialized()
    device = exchange_device(exchange)
    snapshot = build_snapshot(exchange.size, cfg.num_experts)
    ctx = RankContext(exchange=exchange, rank=rank, cfg=cfg, device=device, snapshot=snapshot,
                      dsnap=DeviceSnapshot.build(snapshot, rank, device), selector=make_selector("round_robin"),
                      dist_on=dist_on)
    cases = []
    for i, (phase, tokens) in enumerate(cfg.cases()):
        cases.append(run_case(ctx, phase, tokens, f"c{i}"))
        if ctx.cuda:
            torch.cuda.empty_cache()
    return {"rank": rank, "device": str(ctx.device), "cases": cases}


# ---------------------------------------------------------------------------------- parent side
def aggregate(cfg: BenchConfig, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join the ranks' samples per case: step statistics, bytes and bandwidths."""
    p = cfg.world
    rows = []
    for ci, (phase, tokens) in enumerate(cfg.cases()):
        per = [r["cases"][ci] for r in ranks]
        c = np.asarray([x["send"] for x in per], dtype=np.int64)  # C[src, dst] rows
        off = ~np.eye(p, dtype=bool)
        per_peer = float(c[off].mean()) * cfg.row_bytes if p > 1 else 0.0
        size = float(c.sum(axis=1).mean()) * cfg.row_bytes
        paths: dict[str, Any] = {}
        for name in cfg.paths:
            if name not in per[0]["samples"]:
                continue
            st = step_stats([x["samples"][name] for x in per])
            if name != "plan":
                algbw = 2 * size / (st["median_ms"] * 1e-3) / 1e9 if st["median_ms"] > 0 else 0.0
                st.update(algbw_GBps=algbw, busbw_GBps=algbw * (p - 1) / p)
            paths[name] = st
        raw_ms = paths["raw"]["median_ms"]
        for name in ("ours", "ours_fastcombine", "ours_fast", *map(direct_name, cfg.direct_chunks)):
            if name in paths:
                paths[name]["frac_of_raw"] = raw_ms / paths[name]["median_ms"] if paths[name]["median_ms"] else 0.0
        stages = {}
        if per[0]["stages"]:
            stages = {k: max(x["stages"][k] for x in per) for k in per[0]["stages"]}
        checks = {k: [x["checks"][k] for x in per] for k in per[0]["checks"]}
        rows.append({
            "phase": phase, "tokens_per_rank": tokens, "routes_per_rank": tokens * cfg.k,
            "count_matrix_rows": c.tolist(),
            "per_peer_bytes": per_peer, "max_per_peer_bytes": float(c[off].max()) * cfg.row_bytes if p > 1 else 0.0,
            "size_bytes_per_rank": size, "total_bytes_all_ranks": float(c.sum()) * cfg.row_bytes,
            "paths": paths, "stages_ms_max_over_ranks": stages, "checks": checks,
        })
    return rows


_SHORT = MappingProxyType({"ours": "ours", "ours_fastcombine": "fastcomb", "ours_fast": "ours_fast", "raw": "raw",
                           "raw_with_slot": "raw+slot", "raw_selfgroup": "raw_self", "torch_dist": "tdist",
                           "plan": "plan"})


def short(name: str) -> str:
    return _SHORT.get(name, name)


def print_table(cfg: BenchConfig, rows: list[dict[str, Any]]) -> None:
    names = [n for n in cfg.paths if n in rows[0]["paths"]]
    directs = [direct_name(c) for c in cfg.direct_chunks]
    bw = [n for n in ("ours", *directs, "raw", "torch_dist") if n in names]
    fr = [n for n in ("ours", "ours_fastcombine", "ours_fast", *directs) if n in names]
    print(f"\nworld={cfg.world} backend={cfg.backend} d={cfg.d} k={cfg.k} E={cfg.num_experts} dtype={cfg.dtype} "
          f"iters={cfg.iters}: dispatch+return per step, median over iterations of the slowest rank (ms)")
    head = f"{'phase':7} {'T':>6} {'peer MiB':>9} {'size MiB':>9} |" + "".join(f" {short(n):>9}" for n in names)
    print(head)
    print("-" * len(head))
    for r in rows:
        ps = r["paths"]
        print(f"{r['phase']:7} {r['tokens_per_rank']:6d} {r['per_peer_bytes'] / MiB:9.2f} "
              f"{r['size_bytes_per_rank'] / MiB:9.2f} |" + "".join(f" {ps[n]['median_ms']:9.3f}" for n in names))
    print("\nbus bandwidth (GB/s, algbw * (P-1)/P) and fraction of raw NCCL (raw ms / path ms):")
    head = f"{'phase':7} {'T':>6} |" + "".join(f" {short(n) + ' bus':>14}" for n in bw) + " |"
    head += "".join(f" {short(n) + '/raw':>13}" for n in fr)
    print(head)
    print("-" * len(head))
    for r in rows:
        ps = r["paths"]
        print(f"{r['phase']:7} {r['tokens_per_rank']:6d} |" + "".join(f" {ps[n]['busbw_GBps']:14.1f}" for n in bw)
              + " |" + "".join(f" {ps[n]['frac_of_raw']:13.2f}" for n in fr))
    if rows[0]["stages_ms_max_over_ranks"]:
        keys = list(rows[0]["stages_ms_max_over_ranks"])
        print("\nstages of 'ours' alone (ms, median per rank, max over ranks; no communication):")
        print(f"{'phase':7} {'T':>6} |" + "".join(f" {k:>14}" for k in keys))
        for r in rows:
            st = r["stages_ms_max_over_ranks"]
            print(f"{r['phase']:7} {r['tokens_per_rank']:6d} |" + "".join(f" {st[k]:14.3f}" for k in keys))
    bad = [(r["phase"], r["tokens_per_rank"], k, v) for r in rows for k, v in r["checks"].items()
           if (k.endswith("exact") and not all(v)) or (k.endswith("err") and max(v) > 2e-2)]
    print("\nchecks: " + ("all passed" if not bad else f"FAILED {bad}"))


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cuda = torch.cuda.is_available() and not args.quick and args.backend != "local"
    backend = "nccl" if cuda else "local"
    if args.quick:
        d, k, e = 256, 4, 16
        world = args.world or 2
        tokens, decode = (16, 64), 8
        warmup, iters, stage_iters = 1, 5, 3
    else:
        d, k, e = args.d, args.k, args.experts
        world = args.world or (torch.cuda.device_count() if cuda else 2)
        row = d * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else auto_tokens(world, k, row)
        decode = args.decode_tokens
        warmup, iters, stage_iters = args.warmup, args.iters, args.stage_iters
    return BenchConfig(world=world, backend=backend, d=d, k=k, num_experts=e, tokens=tokens, decode_tokens=decode,
                       dtype=args.dtype, warmup=warmup, iters=iters, stage_iters=stage_iters, seed=args.seed,
                       dist=backend == "nccl" and not args.no_dist, stages=not args.no_stages,
                       proposed=not args.no_proposed,
                       direct_chunks=tuple(int(c) for c in args.direct_chunks.split(",") if c.strip()))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--quick", action="store_true", help="CPU smoke: local exchange, tiny shapes (< 60 s)")
    ap.add_argument("--world", type=int, default=0, help="ranks (default: every visible GPU; 2 on CPU)")
    ap.add_argument("--backend", default="auto", choices=("auto", "nccl", "local"))
    ap.add_argument("--tokens", default="", help="comma-separated prefill tokens per rank (default: ~1..256 MiB/peer)")
    ap.add_argument("--decode-tokens", type=int, default=128, help="the decode case's tokens per rank (0: none)")
    ap.add_argument("--d", type=int, default=7168)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--stage-iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-dist", action="store_true", help="skip the torch.distributed baseline")
    ap.add_argument("--no-stages", action="store_true", help="skip the per-stage breakdown")
    ap.add_argument("--no-proposed", action="store_true", help="skip the proposed-combine variant")
    ap.add_argument("--direct-chunks", default="1,2,4", help="chunk counts of the direct path ('' for none)")
    ap.add_argument("--timeout-s", type=float, default=570.0, help="limit of the whole run")
    ap.add_argument("--exchange-timeout-s", type=float, default=60.0, help="watchdog on one exchange round")
    add_output_argument(ap)
    args = ap.parse_args(argv)
    cfg = config_from_args(args)
    print(f"dispatch_combine: world={cfg.world} backend={cfg.backend} cases={cfg.cases()}", flush=True)
    t0 = time.monotonic()
    ranks = run_spmd(bench_rank, cfg.world, args=(asdict(cfg),), backend=cfg.backend, timeout_s=args.timeout_s,
                     exchange_timeout_s=args.exchange_timeout_s, torch_dist=cfg.dist)
    rows = aggregate(cfg, ranks)
    print_table(cfg, rows)
    payload = {
        "mode": "quick" if args.quick else "full",
        "evidence": "measured (CUDA events)" if cfg.backend == "nccl" else "measured (CPU wall clock, local exchange)",
        "config": asdict(cfg),
        "devices": [r["device"] for r in ranks],
        "baselines": {
            "raw": "NcclExchange.all_to_all_v on a pre-packed buffer, same splits (local exchange on CPU)",
            "torch_dist": "torch.distributed.all_to_all_single, NCCL backend, preallocated outputs",
        },
        "definitions": {
            "step": "dispatch + return (two all-to-alls); time = max over ranks per iteration, then median",
            "per_peer_bytes": "mean over ordered pairs s != t of rows(s->t) * d * elem, one exchange",
            "size_bytes_per_rank": "R * d * elem, the per-rank send buffer of one all-to-all",
            "algbw_GBps": "2 * size / time", "busbw_GBps": "algbw * (P-1)/P",
            "frac_of_raw": "raw median / path median",
            "plan": "engine.dispatch through the control all-gather, aborted by a planted status",
            "direct_cN": "DirectDispatcher(chunks=N).dispatch + combine (dispatch/direct.py), same routes",
            "stages_ms_max_over_ranks": "communication-free pieces of 'ours' timed alone (median per rank)",
        },
        "cases": rows,
        "wall_s": time.monotonic() - t0,
    }
    path = write_result("dispatch_combine", payload, suffix=host_kind() if not args.quick else "cpu-quick",
                        out=args.out)
    print(f"wrote {path} ({time.monotonic() - t0:.1f} s)")
    return path


if __name__ == "__main__":
    main()
