"""Expert migration under traffic: a live rebalance and a live scale while decode/prefill steps stream.

    python -m ray_moe_bench.migration                 # GPU (>= 2): Mixtral-like experts (352 MiB each in bf16), NCCL copies
    python -m ray_moe_bench.migration --layers 4      # more bytes per operation
    python -m ray_moe_bench.migration --quick         # CPU smoke (< 60 s): object-store copies, small experts

Setup: 2 ranks (one GPU each), E=8 experts of d=4096 f=14336 (bf16: 3*d*f*2 = 352 MiB per expert), top-2,
slots_per_rank = E/2 + 1 (the initial spread replicates experts 0 and 1), ``--layers`` layers (default 2).
A driver thread streams steps through ``Runtime.forward`` the whole time: decode steps of ``--decode-tokens``
tokens per rank (the bucket / CUDA-graph path), every ``--prefill-every``-th step a prefill of
``--prefill-tokens`` tokens. Routes are skewed: experts 6 and 7 (initially one copy each, both on rank 1)
draw ``--hot-weight`` times the routing weight of the others, so EPLB has replicas to move. The decode bucket's
slot capacity defaults to C_T*k*ranks so the skewed steps stay on the bucket (CUDA-graph) path before and
after the rebalance (otherwise the steady state would be the slot-capacity fallback).

Operations (main thread, while the traffic thread keeps stepping), each through the coordinator actor so
its full report comes back (timings plan / materialize / verify / publish / drain_retire, ledger, copies):
  rebalance  EPLB over the load window the traffic fed, migration-aware
  scale      one expert left with a single copy (a hot one if any) to 2 replicas
Expert copies go GPU to GPU over the shards' migration NCCL communicator (send_experts / recv_experts);
on CPU (--quick) through the Ray object store (fetch_experts).

Reported per operation:
  bytes     ledger.network_bytes and copy counts (ANALYTICAL, from the coordinator's plan), and the measured
            tensor bytes of the copied (layer, expert) weights as the destination shard holds them after the op
            (the (src, dst) pairs and keys come from the same pure ``plan_migration`` the coordinator ran)
  time      materialize_s (the coordinator's timing of the copy stage: NCCL transfer + receiver digest of
            every copy, pairs in sequence), plus the rest of the publication (MEASURED)
  bandwidth tensor bytes / materialize_s, against the baseline measured in the same run between the same two
            shards with the same bytes per pair: raw_send / raw_recv on the migration communicator (GPU) or
            a raw object-store transfer (CPU); the traffic is paused while baselines run. Also measured with
            traffic paused: a replay of the actor copy (send_experts + recv_experts, driver wall) and the
            receiver's digest time, to attribute the gap between materialize and raw.
  latency   step wall time p50/p99 (nearest rank) per phase: steady state (before the first operation),
            during each operation, during its materialize stage (from the coordinator's timeline), after.
"""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time
from collections import defaultdict
from typing import Any, Sequence

import numpy as np
import torch

from ray_moe_bench import summary
from ray_moe_bench.common import add_output_argument, host_kind, nearest_rank, write_result
from ray_moe_bench.layer_step import RecordingRuntime, step_record

HOT = (6, 7)


# ============================================================================ remote helpers (run via __ray_call__)
def _actor_fns():
    """Closures executed inside the shard actors through ``ActorHandle.__ray_call__`` (pickled by value)."""

    def tensor_bytes(actor, keys, on_device):
        ws = actor.core.export_experts([tuple(k) for k in keys], device=on_device)
        return int(sum(w.nbytes for w in ws.values()))

    def held(actor):
        return [tuple(k) for k in actor.core.held_experts()]

    def digest_s(actor, keys):
        t0 = time.perf_counter()
        for layer, expert in keys:
            w = actor.core.expert_weights(int(layer), int(expert))  # device -> host copy, as import does
            w.digest()
        return time.perf_counter() - t0

    def scratch(actor, n):
        buf = getattr(actor, "_bench_scratch", None)
        if buf is None or buf.nbytes != n:
            buf = np.ones(n, dtype=np.uint8)
            actor._bench_scratch = buf
        return buf

    def pull(actor, src, n, scratch_fn):
        import ray

        t0 = time.perf_counter()
        arr = ray.get(src.__ray_call__.remote(scratch_fn, n))
        out = torch.from_numpy(np.array(arr, copy=True))  # the receiver keeps its own copy, as import does
        dt = time.perf_counter() - t0
        del out
        return dt

    return {"tensor_bytes": tensor_bytes, "held": held, "digest_s": digest_s, "scratch": scratch, "pull": pull}


FN = _actor_fns()


# ============================================================================ traffic
def skewed_routes(tokens: int, e: int, k: int, hot_weight: float, g: torch.Generator):
    p = torch.ones(e, dtype=torch.float64)
    for h in HOT:
        if h < e:
            p[h] = hot_weight
    ids = torch.multinomial(p.expand(tokens, e), k, replacement=False, generator=g)
    w = torch.rand(tokens, k, generator=g) + 0.05
    return ids, (w / w.sum(1, keepdim=True)).to(torch.float32)


def batches(tokens: int, d: int, e: int, k: int, hot_weight: float, dtype: torch.dtype, seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        h = torch.randn(tokens, d, generator=g).to(dtype)
        ids, w = skewed_routes(tokens, e, k, hot_weight, g)
        out.append((h, ids, w))
    return out


class Traffic(threading.Thread):
    """Streams steps until stopped; ``pause()`` / ``resume()`` hold it between steps."""

    def __init__(self, rt: RecordingRuntime, decode, prefill, prefill_every: int) -> None:
        super().__init__(daemon=True)
        self.rt = rt
        self.decode = decode
        self.prefill = prefill
        self.prefill_every = prefill_every
        self.records: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._idle = threading.Event()

    def run(self) -> None:
        i = 0
        try:
            while not self._halt.is_set():
                if not self._go.is_set():
                    self._idle.set()
                    self._go.wait(0.05)
                    continue
                self._idle.clear()
                pre = self.prefill_every > 0 and i % self.prefill_every == self.prefill_every - 1
                h, ids, w = (self.prefill if pre else self.decode)[i % len(self.prefill if pre else self.decode)]
                phase = "prefill" if pre else "decode"
                t0w, t0 = time.time(), time.perf_counter()
                self.rt.forward(h, ids, w, phase=phase)
                rec = step_record(self.rt, time.perf_counter() - t0)
                rec.update(phase=phase, t0=t0w, t1=time.time(), tokens=int(h.shape[0]), i=i)
                self.records.append(rec)
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc
        finally:
            self._idle.set()

    def pause(self, timeout: float = 120.0) -> None:
        self._go.clear()
        self._idle.wait(timeout)

    def resume(self) -> None:
        self._idle.clear()
        self._go.set()

    def stop(self) -> None:
        self._halt.set()
        self._go.set()


def lat(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    if not records:
        return None
    xs = [r["wall_ms"] for r in records]
    sh = [r["shard_ms"] for r in records]
    return {"n": len(xs), "wall_ms": {"p50": nearest_rank(xs, 0.5), "p99": nearest_rank(xs, 0.99), "max": max(xs),
                                      "mean": statistics.fmean(xs)},
            "shard_ms": {"p50": nearest_rank(sh, 0.5), "p99": nearest_rank(sh, 0.99)},
            "paths": dict(sorted({p: sum(r["paths"].count(p) for r in records)
                                  for r in records for p in r["paths"]}.items()))}


# ============================================================================ baselines (traffic paused)
def copy_pairs(before, after, rt, expert_bytes: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(src, dst) -> copied (layer, expert) keys, from the same pure plan the coordinator made."""
    from ray_moe.placement.migration import MigrationActionKind, plan_migration

    plan = plan_migration(before, after, rt.topology, expert_bytes=max(1, expert_bytes))
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for a in plan.target_actions():
        if a.action in (MigrationActionKind.SAME_NODE_COPY, MigrationActionKind.CROSS_NODE_COPY):
            pairs[(int(a.source_rank), int(a.target_rank))].append((a.layer, a.expert))
    return {k: sorted(set(v)) for k, v in sorted(pairs.items())}


def raw_transfer(rt, src: int, dst: int, nbytes: int, reps: int, cuda: bool) -> dict[str, Any]:
    """Baseline: ``nbytes`` between the same two shards, no expert logic. GPU: raw_send / raw_recv on the
    migration communicator (both sides' own clocks; the later starter's time ~ the transfer). CPU: the
    receiver pulls a scratch buffer of the source through the object store and copies it."""
    import ray

    a, b = rt.shards[src], rt.shards[dst]
    samples = []
    for i in range(reps + 1):  # first one warms allocators / connections
        if cuda:
            ts, tr = ray.get([a.raw_send.remote(int(nbytes), dst), b.raw_recv.remote(int(nbytes), src)])
            rec = {"send_s": ts, "recv_s": tr, "transfer_s": min(ts, tr)}
        else:
            tp = ray.get(b.__ray_call__.remote(FN["pull"], a, int(nbytes), FN["scratch"]))
            rec = {"transfer_s": tp}
        if i:
            samples.append(rec)
    med = statistics.median(s["transfer_s"] for s in samples)
    return {"evidence": "measured", "method": "raw_send/raw_recv (NCCL, migration communicator)" if cuda
            else "object store: src scratch buffer -> ray.get on dst -> copy", "bytes": int(nbytes), "reps": reps,
            "transfer_s_median": med, "GBps": nbytes / med / 1e9 if med > 0 else None, "samples": samples}


def replay_copy(rt, src: int, dst: int, keys, reps: int, cuda: bool) -> dict[str, Any]:
    """The actor copy the coordinator issues, issued again with the traffic paused and timed on the driver;
    and the receiver's digest time alone. Forward (src -> dst; dst already holds the keys: same bytes, same
    digests) when src still holds them; else (the op moved them and src retired its copies) in reverse,
    dst -> src, and the staged copies on src are dropped again."""
    import ray

    held_src = set(map(tuple, ray.get(rt.shards[src].__ray_call__.remote(FN["held"]))))
    fwd = [list(k) for k in keys if tuple(k) in held_src]
    if fwd:
        a_rank, b_rank, ks, direction = src, dst, fwd, "forward"
    else:
        a_rank, b_rank, ks, direction = dst, src, [list(k) for k in keys], "reverse"
    a, b = rt.shards[a_rank], rt.shards[b_rank]
    nbytes = ray.get(a.__ray_call__.remote(FN["tensor_bytes"], ks, cuda))
    walls, sent = [], None
    for i in range(reps + 1):
        t0 = time.perf_counter()
        if cuda:
            n, _ = ray.get([a.send_experts.remote(ks, b_rank), b.recv_experts.remote(ks, a_rank)])
            sent = int(n)
        else:
            ray.get(b.fetch_experts.remote(a, ks))
        if i:
            walls.append(time.perf_counter() - t0)
    dig = [ray.get(b.__ray_call__.remote(FN["digest_s"], ks)) for _ in range(max(1, reps))]
    if direction == "reverse":
        ray.get(b.drop_experts.remote(ks))  # staged, unused by any generation: freed
    wall = statistics.median(walls)
    method = "send_experts + recv_experts (NCCL)" if cuda else "fetch_experts (object store)"
    return {"evidence": "measured", "method": method,
            "direction": direction, "src": a_rank, "dst": b_rank, "keys": ks, "bytes": nbytes, "bytes_sent": sent,
            "wall_s_median": wall, "GBps": nbytes / wall / 1e9 if wall > 0 else None, "reps": reps,
            "receiver_digest_s_median": statistics.median(dig),
            "receiver_digest_GBps": nbytes / statistics.median(dig) / 1e9 if statistics.median(dig) > 0 else None}


# ============================================================================ main
def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--quick", action="store_true", help="CPU smoke: small experts, object-store copies (< 60 s)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--d", type=int, default=None, help="hidden size (GPU 4096, CPU 1024, quick 256)")
    ap.add_argument("--f", type=int, default=None, help="expert FFN size (GPU 14336, CPU 3584, quick 512)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=8, help="decode tokens per rank per step")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="GPU 2048, CPU 128")
    ap.add_argument("--slot-capacity", type=int, default=None,
                    help="decode bucket C_q per slot (default C_T*k*ranks: skewed steps stay on the bucket path)")
    ap.add_argument("--prefill-every", type=int, default=10, help="every n-th traffic step is a prefill (0: none)")
    ap.add_argument("--hot-weight", type=float, default=6.0, help="routing weight of experts 6 and 7 (others 1)")
    ap.add_argument("--steady-s", type=float, default=None, help="traffic before the first op (GPU 4 s, CPU 3 s)")
    ap.add_argument("--post-s", type=float, default=None, help="traffic after each op (GPU 2 s, CPU 1.5 s)")
    ap.add_argument("--ops", default="rebalance,scale")
    ap.add_argument("--raw-reps", type=int, default=None, help="baseline repetitions (GPU 5, CPU 3)")
    ap.add_argument("--exchange-timeout-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    add_output_argument(ap)
    args = ap.parse_args(argv)

    import ray

    import ray_moe

    cuda = not args.quick and (args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()))
    if cuda and torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"--ranks {args.ranks}: GPU to GPU migration needs {args.ranks} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    if args.ranks < 2:
        raise SystemExit("--ranks must be >= 2 (migration moves experts between shards)")
    d = args.d or (4096 if cuda else 256 if args.quick else 1024)
    f = args.f or (14336 if cuda else 512 if args.quick else 3584)
    device, dtype_name = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    prefill_tokens = args.prefill_tokens or (2048 if cuda else 128)
    steady_s = args.steady_s if args.steady_s is not None else (4.0 if cuda else 3.0)
    post_s = args.post_s if args.post_s is not None else (2.0 if cuda else 1.5)
    reps = args.raw_reps or (5 if cuda else 3)
    ops = [o for o in args.ops.split(",") if o]
    e = args.experts
    cfg = ray_moe.RuntimeConfig(
        num_ranks=args.ranks, num_experts=e, hidden_size=d, ffn_size=f, top_k=args.top_k,
        slots_per_rank=math.ceil(e / args.ranks) + 1, num_layers=args.layers, device=device, dtype=dtype_name,
        seed=args.seed, name="bench-migration", decode_token_capacity=max(args.decode_tokens, 8),
        decode_slot_capacity=args.slot_capacity or max(args.decode_tokens, 8) * args.top_k * args.ranks,
        exchange_timeout_s=args.exchange_timeout_s,
    )
    elt = torch.tensor([], dtype=getattr(torch, dtype_name)).element_size()
    expert_bytes = 3 * d * f * elt
    print(f"migration bench: {device} {dtype_name}, {args.ranks} ranks, E={e}, L={args.layers}, d={d} f={f}: "
          f"{expert_bytes / 2**20:.1f} MiB per expert (analytical)", flush=True)

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(4, 2 * args.ranks + 2), include_dashboard=False, log_to_driver=False,
                 namespace="ray-moe-bench")
    t_start = time.perf_counter()
    rt = RecordingRuntime.start(cfg)
    deploy_s = time.perf_counter() - t_start
    print(f"deployed in {deploy_s:.1f}s", flush=True)
    dtype = rt.dtype
    dec = batches(args.decode_tokens * args.ranks, d, e, args.top_k, args.hot_weight, dtype, args.seed, 8)
    pre = batches(prefill_tokens, d, e, args.top_k, args.hot_weight, dtype, args.seed + 1, 2)
    out_ops: list[dict[str, Any]] = []
    op_errors: list[dict[str, str]] = []
    traffic = Traffic(rt, dec, pre, args.prefill_every)
    try:
        # warm both paths (graph capture, allocator) before anything is timed
        for i in range(3):
            rt.forward(*dec[i], phase="decode")
        rt.forward(*pre[0], phase="prefill")
        stats0 = rt.stats()
        traffic.start()
        time.sleep(steady_s)
        for op in ops:
            if traffic.error is not None:
                break
            rt.flush_load()
            before = rt.placement()
            if op == "rebalance":
                call = lambda: rt.coordinator.rebalance.remote(True)  # noqa: E731
                detail = {"migration_aware": True}
            elif op == "scale":
                counts = before.replica_counts(0)
                singles = [x for x in range(e) if counts[x] == 1]
                hot_single = [x for x in HOT if x in singles]
                target = (hot_single or singles or [0])[0]
                call = lambda t=target: rt.coordinator.scale.remote(t, 2, None)  # noqa: E731
                detail = {"expert": target, "replicas": 2, "layers": "all"}
            else:
                raise SystemExit(f"--ops: {op!r} is not rebalance or scale")
            n_before = len(traffic.records)
            t0w, t0 = time.time(), time.perf_counter()
            try:
                rep = ray.get(call())
            except Exception as exc:  # noqa: BLE001 - recorded; the results written so far still matter
                from ray_moe.core.errors import root_cause

                op_errors.append({"op": op, "error": f"{type(root_cause(exc)).__name__}: {root_cause(exc)}"})
                print(f"[{op}] FAILED: {op_errors[-1]['error']}", flush=True)
                continue
            t1w, wall = time.time(), time.perf_counter() - t0
            after = rt.placement()
            tl = [ev for ev in rt.timeline() if t0w - 1.0 <= ev["t"] <= t1w + 1.0]
            g_new = rep["new_generation"]
            ev_t = {ev["event"]: ev["t"] for ev in tl if ev["generation"] == g_new}
            mat = (ev_t.get("reserve", t0w), ev_t.get("materialize", t1w))
            print(f"[{op}] generation {rep['old_generation']} -> {g_new}: {rep['copies']} copies, "
                  f"{rep['loads']} loads, "
                  f"materialize {rep['timings_s'].get('materialize', float('nan')):.3f}s, op wall {wall:.3f}s "
                  f"({len(traffic.records) - n_before} steps served meanwhile)", flush=True)
            time.sleep(post_s)
            # baselines with the traffic paused, while both shards still hold the copied keys
            traffic.pause()
            pairs = copy_pairs(before, after, rt, expert_bytes)
            pair_out = []
            for (src, dst), keys in pairs.items():
                # the copies as they arrived: dst holds every copied key in the new ACTIVE generation
                held_dst = set(map(tuple, ray.get(rt.shards[dst].__ray_call__.remote(FN["held"]))))
                keys_ok = [list(k) for k in keys if tuple(k) in held_dst]
                nbytes = (ray.get(rt.shards[dst].__ray_call__.remote(FN["tensor_bytes"], keys_ok, cuda))
                          if keys_ok else 0)
                entry = {"src": src, "dst": dst, "keys": [list(k) for k in keys], "tensor_bytes": nbytes,
                         "analytical_bytes": len(keys) * expert_bytes}
                try:
                    if nbytes:
                        entry["raw"] = raw_transfer(rt, src, dst, nbytes, reps, cuda)
                        rp = replay_copy(rt, src, dst, keys_ok, max(1, reps // 2), cuda)
                        entry["replay"] = rp
                        # the replay's rate applied to this pair's bytes (a reverse replay moves the same keys)
                        entry["replay_s_for_pair"] = nbytes / (rp["GBps"] * 1e9) if rp["GBps"] else None
                        entry["digest_s_for_pair"] = (nbytes / (rp["receiver_digest_GBps"] * 1e9)
                                                      if rp["receiver_digest_GBps"] else None)
                except Exception as exc:  # noqa: BLE001 - keep the op's own measurements
                    entry["baseline_error"] = f"{type(exc).__name__}: {exc}"
                    op_errors.append({"op": f"{op} baseline {src}->{dst}", "error": entry["baseline_error"]})
                pair_out.append(entry)
            traffic.resume()
            tensor_bytes = sum(p["tensor_bytes"] for p in pair_out)
            raw_s = sum(p["raw"]["transfer_s_median"] for p in pair_out if "raw" in p)
            replay_s = sum(p.get("replay_s_for_pair") or 0.0 for p in pair_out)
            digest_s = sum(p.get("digest_s_for_pair") or 0.0 for p in pair_out)
            mat_s = rep["timings_s"].get("materialize")
            out_ops.append({
                "op": op, "detail": detail, "report": rep, "op_wall_s": wall, "t0": t0w, "t1": t1w,
                "materialize_window": list(mat), "timeline": tl,
                "bytes": {"ledger_network_bytes (analytical)": rep.get("ledger", {}).get("network_bytes"),
                          "ledger": rep.get("ledger"), "copies": rep["copies"], "loads": rep["loads"],
                          "tensor_bytes (measured, copies as held by dst)": tensor_bytes,
                          "bytes_sent (measured, replay send_experts)": sum(
                              p["replay"]["bytes_sent"] or 0 for p in pair_out if "replay" in p) if cuda else None},
                "pairs": pair_out,
                "bandwidth": {
                    "materialize_s": mat_s,
                    "achieved_GBps": tensor_bytes / mat_s / 1e9 if mat_s and tensor_bytes else None,
                    "raw_s": raw_s, "raw_GBps": tensor_bytes / raw_s / 1e9 if raw_s else None,
                    "fraction_of_raw": (raw_s / mat_s) if mat_s and raw_s else None,
                    "replay_copy_s (replay rate x bytes)": replay_s,
                    "receiver_digest_s (digest rate x bytes)": digest_s,
                },
            })
        time.sleep(0.2)
    finally:
        traffic.stop()
        traffic.join(timeout=300)
    stats1 = rt.stats()
    refcounts = rt.refcounts()
    gens = rt.generations()
    rt.shutdown()
    ray.shutdown()
    traffic_error = None
    if traffic.error is not None:
        from ray_moe.core.errors import root_cause

        traffic_error = f"{type(root_cause(traffic.error)).__name__}: {root_cause(traffic.error)}"

    # ---------------------------------------------------------------- latency classes
    recs = traffic.records
    first = out_ops[0]["t0"] if out_ops else float("inf")

    def overlaps(r, a, b):
        return r["t0"] < b and r["t1"] > a

    classes: dict[str, list[dict[str, Any]]] = {"steady": [r for r in recs if r["t1"] <= first]}
    for i, o in enumerate(out_ops):
        nxt = out_ops[i + 1]["t0"] if i + 1 < len(out_ops) else float("inf")
        classes[f"during:{o['op']}"] = [r for r in recs if overlaps(r, o["t0"], o["t1"])]
        classes[f"materialize:{o['op']}"] = [r for r in recs if overlaps(r, *o["materialize_window"])]
        classes[f"after:{o['op']}"] = [r for r in recs if r["t0"] >= o["t1"] and r["t1"] <= nxt]
    latency = {c: {ph: lat([r for r in rs if r["phase"] == ph]) for ph in ("decode", "prefill")}
               for c, rs in classes.items()}

    payload = {
        "mode": "quick" if args.quick else "full", "device": device, "dtype": dtype_name,
        "evidence": {"ledger bytes": "analytical (coordinator plan)",
                     "tensor bytes, times, bandwidths, latencies": "measured in this run (time.perf_counter / "
                     "coordinator timings; raw baseline on the shards' own clocks)"},
        "config": {**cfg.model_dump(mode="json"), "expert_bytes": expert_bytes,
                   "decode_tokens_per_rank": args.decode_tokens,
                   "prefill_tokens": prefill_tokens, "prefill_every": args.prefill_every, "hot_experts": list(HOT),
                   "hot_weight": args.hot_weight, "steady_s": steady_s, "post_s": post_s, "ops": ops, "raw_reps": reps},
        "baseline": ("raw NCCL send/recv of the same bytes between the same two shards (raw_send/raw_recv, "
                     "migration communicator)" if cuda else
                     "raw object-store transfer of the same bytes between the same two shards")
        + ", measured in this run",
        "deploy_s": deploy_s,
        "ops": out_ops,
        "latency_ms": latency,
        "traffic": {"steps": len(recs), "stale_retries": stats1["stale_retries"] - stats0["stale_retries"],
                    "failed_steps": stats1["failed_steps"] - stats0["failed_steps"],
                    "graph_replays": stats1["graph_replays"] - stats0["graph_replays"],
                    "fallbacks": stats1["fallbacks"]},
        "errors": {"traffic": traffic_error, "ops": op_errors},
        "refcounts_after": {str(k): v for k, v in refcounts.items()},
        "generations": {str(k): v for k, v in gens.items()},
    }
    path = write_result("migration", payload, suffix=host_kind() + ("-quick" if args.quick else ""), out=args.out)

    # ---------------------------------------------------------------- tables
    print("\n== migration (bytes: ledger analytical, tensor measured; times measured) ==")
    print(f"{'op':10} {'copies':>6} {'ledger MiB':>10} {'tensor MiB':>10} | {'materialize s':>13} {'GB/s':>7} | "
          f"{'raw s':>8} {'raw GB/s':>8} {'frac':>6} | {'replay s':>8} {'digest s':>8} | {'op wall s':>9}")
    for o in out_ops:
        b, bw = o["bytes"], o["bandwidth"]
        nb = b["ledger_network_bytes (analytical)"] or 0
        fmt = lambda x, w, p: f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"  # noqa: E731
        tb = b["tensor_bytes (measured, copies as held by dst)"]
        print(f"{o['op']:10} {b['copies']:6d} {nb / 2**20:10.1f} {tb / 2**20:10.1f} | "
              f"{fmt(bw['materialize_s'], 13, 4)} {fmt(bw['achieved_GBps'], 7, 2)} | {fmt(bw['raw_s'], 8, 4)} "
              f"{fmt(bw['raw_GBps'], 8, 2)} {fmt(bw['fraction_of_raw'], 6, 3)} | "
              f"{fmt(bw['replay_copy_s (replay rate x bytes)'], 8, 4)} "
              f"{fmt(bw['receiver_digest_s (digest rate x bytes)'], 8, 4)} | {o['op_wall_s']:9.3f}")
        t = o["report"]["timings_s"]
        print(f"{'':10} timings: " + ", ".join(f"{k} {v:.4f}s" for k, v in t.items()))
    print("\n== step latency under migration (measured wall ms, nearest rank) ==")
    print(f"{'window':22} {'phase':8} {'n':>5} | {'p50':>8} {'p99':>8} {'max':>8} | {'shard p50':>9} | paths")
    for c, by_phase in latency.items():
        for ph, s in by_phase.items():
            if s is None:
                continue
            print(f"{c:22} {ph:8} {s['n']:5d} | {s['wall_ms']['p50']:8.2f} {s['wall_ms']['p99']:8.2f} "
                  f"{s['wall_ms']['max']:8.2f} | {s['shard_ms']['p50']:9.2f} | {s['paths']}")
    tr = payload["traffic"]
    print(f"\ntraffic: {tr['steps']} steps, {tr['stale_retries']} stale retries, {tr['failed_steps']} failed; "
          f"refcounts after {payload['refcounts_after']}")
    print(f"wrote {path}")
    if traffic_error or op_errors:
        raise SystemExit(f"FAILED: traffic error {traffic_error!r}, op errors {op_errors}")
    return path


if __name__ == "__main__":
    main()
