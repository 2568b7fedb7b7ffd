"""Expert SwiGLU for mid-size steps (tens to hundreds of rows per expert): Triton kernels whose programs tile rows
AND columns, so a slot's rows beyond one block run in parallel programs instead of a loop inside one.

Where it sits: at decode sizes (<= 16 rows a slot) the skinny kernels (``skinny.py``: one program per slot and
column block, looping over the slot's rows) stream each expert's weights once; at prefill sizes (hundreds of
rows a slot) ``torch._grouped_mm`` runs compute-bound. Between them, mixed steps (a prompt chunk beside ~250
decoding sequences: 80-130 rows a slot) and large decode batches (1,024 sequences: ~64 rows a slot) are still a
weight read, where grouped_mm streams the weights at ~50-67% of HBM bandwidth (``bench/results/
skinny-h100x1-76a48a1``) and the skinny kernels' row loop starves the tensor cores. These kernels use the grid of
vLLM's fused MoE kernel: one program per (row block of a slot, column block), every row block of every slot in
flight at once. Whether they serve, and up to how many rows a slot, is measured at start (``check_tiled``).

  grid: axis 0 the column blocks (fastest: the row blocks of one slot run side by side and share its weight
  tiles through L2), axis 1 the row blocks: at most ceil(N / BLOCK_M) + Q of them (a fixed count for a fixed N:
  CUDA-graph capturable; programs past the step's blocks return at once)
  each program (slot q found from the offsets in the kernel: blocks per slot ceil(rows_q / BLOCK_M), their
  inclusive prefix, the first prefix above the program's block index):
  1. gate/up: rows [BLOCK_M, d] x the gate and up tiles [d, BLOCK_N] (FP32 accumulators), silu(gate) * up
     stored once into a [N, f]
  2. down:    a rows [BLOCK_M, f] x the w_down^T tile [f, BLOCK_N] -> y [N, d]

x: [N, d] expert-major rows (bf16 / fp16), or token-major [T, d] rows read through ``order`` (route r reads
x[order[r] // top_k]); offsets: [Q] int32 inclusive prefix of rows per local slot (rows past offsets[-1] are
never read, their outputs left unwritten); w_gate / w_up [Q, f, d], w_down [Q, d, f] (or a slot buffer's rows
through ``weight_rows`` [Q] int64) -> y [N, d]. The grouped runner's result is the reference (``check_tiled`` on
the device; tests under Triton's interpreter on CPU and compiled on CUDA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ray_moe.core.cuda_timing import best_ms
from ray_moe.core.env import triton_interpreted

MIN_SPEEDUP = 1.05  # over grouped_mm at a band's measured size, or that band stays on grouped_mm
# the bands' measured sizes, rows a slot (band i: above band i-1's). The last, 640, holds an 8,192-token step at
# top-8 of 128 experts (beside up to 2,048 decode rows: ~512-640 rows a slot); the default 16,384-token step
# (driver/defaults.py: ~1,024-1,150 rows a slot) runs grouped_mm above it, where the two were level at 640 rows
# (bench/results/serving-h100x1-d9eaf52: 1.50-1.57 against 1.62 ms)
CHECK_ROWS_PER_SLOT = (32, 64, 128, 256, 640)
CHECK_TOLERANCE = 2e-2  # max |kernel - reference| / max |reference| in the start check (bf16 rounding: ~4e-3)
CHECK_WEIGHT_BYTES = 2 << 30  # the start check's own seeded slots: at most this many bytes (at least 4 slots)


@dataclass(frozen=True)
class TileConfig:
    """One launch setting of both kernels: rows per block, output columns per block (gate/up: each of gate and up),
    the reduction step, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int

    def fits(self, d: int, f: int) -> bool:
        """Whether the tiles divide the model's widths (gate/up: f columns over d; down: d columns over f)."""
        return f % self.block_n == 0 and d % self.block_n == 0 and d % self.block_k == 0 and f % self.block_k == 0


# the candidates the start check times (vLLM's tuned fused-MoE tables for Hopper at 32-128 rows an expert lead to
# these: 64- or 128-row blocks, 128-wide columns, 64-deep steps, 8 warps where the two accumulators are large).
# Measured on an H100 (bench/results/tiled-h100x1-0092fc9 and serving-h100x1-c3cc57c's skinny JSON, the Qwen3-30B-A3B,
# Mixtral and DeepSeek-V3 expert shapes at 32-640 rows a slot): 64 x 64 / 4 warps won to 64 rows a slot and 128 x 128
# / 8 warps / 3 stages from 128 to 640 (1.08-1.24x faster than grouped_mm on Qwen3). Two more were timed there and
# dropped: 64 x 128 / 8 warps won no size of any shape, and 128 x 128 with vLLM's four stages won three sizes of
# Mixtral / DeepSeek by at most 1.4%. Each candidate costs its compiles at a first start (three variants of two
# kernels): cold starts on a fresh H100 went from 51 s (three candidates, four sizes) to 77-91 s (four, five sizes)
CANDIDATES = (TileConfig(64, 64, 64, 4, 4), TileConfig(128, 128, 64, 8, 3))


@dataclass(frozen=True)
class TiledChoice:
    """What ``check_tiled`` decided: ``bands`` ((max rows a slot, config), ...) ascending; a step of N rows over Q
    slots runs the first band with N <= max * Q (none: grouped_mm), and why, in words (with the timings)."""

    bands: tuple[tuple[int, TileConfig], ...]
    reason: str

    def config(self, rows: int, slots: int) -> TileConfig | None:
        """The config for ``rows`` expert-major rows over ``slots`` slots, or None (grouped_mm)."""
        for top, cfg in self.bands:
            if rows <= top * max(slots, 1):
                return cfg
        return None


OFF = TiledChoice((), "not checked")


@functools.lru_cache(maxsize=1)
def _kernels():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _block_of(offs_ptr, wrow_ptr, Q, stride_we, BLOCK_M: tl.constexpr, QP: tl.constexpr, ROWS: tl.constexpr):
        """This program's row block (program_id(1)): (rows [BLOCK_M] int64, their mask, the slot's weight offset,
        live). Blocks per slot ceil(rows / BLOCK_M), their inclusive prefix, the first slot whose prefix exceeds
        the block index; a program past the step's blocks is not live (it does nothing). ROWS: the slot's weights
        live in buffer row wrow[slot]."""
        qs = tl.arange(0, QP)
        ends = tl.load(offs_ptr + qs, mask=qs < Q, other=0)
        prev = tl.load(offs_ptr + qs - 1, mask=(qs > 0) & (qs < Q), other=0)
        nb = tl.where(qs < Q, (ends - prev + BLOCK_M - 1) // BLOCK_M, 0)
        cb = tl.cumsum(nb, 0)
        pid = tl.program_id(1)
        live = pid < tl.sum(nb)
        slot = tl.sum((cb <= pid).to(tl.int32))
        m0 = tl.sum(tl.where(qs == slot, prev, 0)) + (pid - tl.sum(tl.where(qs == slot - 1, cb, 0))) * BLOCK_M
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        if ROWS:
            wrow = tl.load(wrow_ptr + slot, mask=live, other=0).to(tl.int64)
        else:
            wrow = slot.to(tl.int64)
        return rows, rows < tl.sum(tl.where(qs == slot, ends, 0)), wrow * stride_we, live

    # the kernels call the helper by name: Triton resolves names in the module's globals, not in this closure
    globals().update(_block_of=_block_of)

    @triton.jit
    def _gate_up(x_ptr, wg_ptr, wu_ptr, offs_ptr, a_ptr, tok_ptr, wrow_ptr, Q, D, F, stride_we,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K: tl.constexpr,
                 QP: tl.constexpr, GATHER: tl.constexpr, ROWS: tl.constexpr):
        rows, rmask, wbase, live = _block_of(offs_ptr, wrow_ptr, Q, stride_we, BLOCK_M, QP, ROWS)
        if live:
            if GATHER:  # row r is route tok[r] of token tok[r] // K: read that token's hidden row
                src = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64) // K
            else:
                src = rows
            cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                x = tl.load(x_ptr + src[:, None] * D + (k0 + ks)[None, :], mask=rmask[:, None], other=0.0)
                w_off = wbase + cols[None, :].to(tl.int64) * D + (k0 + ks)[:, None]
                acc_g += tl.dot(x, tl.load(wg_ptr + w_off))
                acc_u += tl.dot(x, tl.load(wu_ptr + w_off))
            a = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(a_ptr + rows[:, None] * F + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=rmask[:, None])

    @triton.jit
    def _down(a_ptr, wd_ptr, offs_ptr, y_ptr, wrow_ptr, Q, D, F, stride_we,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QP: tl.constexpr,
              ROWS: tl.constexpr):
        rows, rmask, wbase, live = _block_of(offs_ptr, wrow_ptr, Q, stride_we, BLOCK_M, QP, ROWS)
        if live:
            cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, F, BLOCK_K):
                a = tl.load(a_ptr + rows[:, None] * F + (k0 + ks)[None, :], mask=rmask[:, None], other=0.0)
                acc += tl.dot(a, tl.load(wd_ptr + wbase + cols[None, :].to(tl.int64) * F + (k0 + ks)[:, None]))
            tl.store(y_ptr + rows[:, None] * D + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None])

    return _gate_up, _down


def available(x: torch.Tensor, w_gate: torch.Tensor, w_down: torch.Tensor, config: TileConfig) -> bool:
    """Whether the kernels take these operands at ``config``: CUDA (or Triton's CPU interpreter), bf16 / fp16 rows
    and weights alike, contiguous [Q, f, d] / [Q, d, f] weights the tiles divide, Triton importable."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or _kernels() is None:
        return False
    if x.device.type != "cuda" and not triton_interpreted():
        return False
    f, d = int(w_gate.shape[1]), int(w_gate.shape[2])
    return (x.is_contiguous() and w_gate.is_contiguous() and w_down.is_contiguous() and w_gate.dtype == x.dtype
            and config.fits(d, f))


def tiled_swiglu(x: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, *, config: TileConfig, order: torch.Tensor | None = None, top_k: int = 1,
                 weight_rows: torch.Tensor | None = None) -> torch.Tensor:
    """y [N, d] = per slot q: (silu(x_q W_g[q]^T) * x_q W_u[q]^T) W_d[q]^T over its rows (``offsets``), at
    ``config``. ``order``: [N] int32 route of each expert-major row (x is then token-major [T, d]);
    ``weight_rows``: [Q] int64 the weight row of each slot in a larger buffer (None: slot q is row q)."""
    gate_up, down = _kernels()
    n = int(order.numel()) if order is not None else int(x.shape[0])
    d = int(x.shape[1])
    q, f = int(offsets.shape[0]), int(w_gate.shape[1])
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n == 0 or q == 0:
        return y
    a = torch.empty((n, f), dtype=x.dtype, device=x.device)
    c = config
    blocks = -(-n // c.block_m) + q  # an upper bound of sum ceil(rows_q / BLOCK_M): fixed for a fixed n
    qp = 1 << max(q - 1, 1).bit_length()
    tok = order if order is not None else offsets  # never read without GATHER
    wrow = weight_rows if weight_rows is not None else offsets  # never read without ROWS
    gate_up[(f // c.block_n, blocks)](x, w_gate, w_up, offsets, a, tok, wrow, q, d, f, f * d, BLOCK_M=c.block_m,
                                      BLOCK_N=c.block_n, BLOCK_K=c.block_k, K=max(int(top_k), 1), QP=qp,
                                      GATHER=order is not None, ROWS=weight_rows is not None, num_warps=c.warps,
                                      num_stages=c.stages)
    down[(d // c.block_n, blocks)](a, w_down, offsets, y, wrow, q, d, f, d * f, BLOCK_M=c.block_m,
                                   BLOCK_N=c.block_n, BLOCK_K=c.block_k, QP=qp, ROWS=weight_rows is not None,
                                   num_warps=c.warps, num_stages=c.stages)
    return y


def bands(times: dict[int, dict[TileConfig | None, float]], min_speedup: float = MIN_SPEEDUP
          ) -> tuple[tuple[int, TileConfig], ...]:
    """The bands ``check_tiled`` serves from its timings: ``times`` {rows a slot: {config: ms, None: grouped_mm
    ms}} (or each config's time over grouped_mm's, None 1.0). Walking up the measured sizes, each size's fastest
    config serves the band up to it if it beats grouped_mm there by ``min_speedup``; the walk stops at the first
    size where none does (above it grouped_mm, whose lead grows with the rows, serves every step)."""
    out = []
    for rows in sorted(times):
        base = times[rows].get(None)
        tiled = {c: ms for c, ms in times[rows].items() if c is not None}
        if base is None or not tiled:
            break
        cfg = min(tiled, key=tiled.get)
        if tiled[cfg] * min_speedup > base:
            break
        out.append((rows, cfg))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def check_tiled(device: torch.device, dtype: torch.dtype, d: int, f: int, slots: int,
                reference: Callable[..., torch.Tensor], top_k: int) -> TiledChoice:
    """Whether, and up to how many rows a slot, mid-size steps' experts run through these kernels, decided once a
    process for each device, dtype and expert shape (a property of the device; every runner of the process reads
    the same answer). ``reference(x, offsets, w_gate, w_up, w_down) -> y`` is the path they would replace
    (grouped_mm); ``top_k``: the deployment's routes a token, which the route-order variants are compiled with, so
    serving reuses the check's compiles rather than making its own at capture. Used only where
      1. a config reproduces the reference on this device (seeded slots of ~40 rows, some empty, some over one
         block; expert-major rows and rows read through a route order) within CHECK_TOLERANCE, and
      2. at each of CHECK_ROWS_PER_SLOT (routes drawn uniformly over ``slots`` slots; CUDA events, the best of 5)
         the fastest passing config beats the reference by MIN_SPEEDUP in both variants serving runs (expert-major
         rows; rows read through a route order, against the gather + grouped_mm), from the smallest size up.
    Its seeded slots take at most CHECK_WEIGHT_BYTES (fewer slots than ``slots`` where the experts are large)."""
    if device.type != "cuda":
        return TiledChoice((), f"device {device.type}: the tiled expert kernels need CUDA")
    if dtype not in (torch.bfloat16, torch.float16) or _kernels() is None:
        return TiledChoice((), f"dtype {dtype} or no Triton: not served")
    configs = [c for c in CANDIDATES if c.fits(d, f)]
    if not configs:
        return TiledChoice((), f"no candidate tile divides d={d}, f={f}")
    try:
        return measure_choice(device, dtype, d, f, slots, configs, reference, top_k)
    except Exception as exc:  # noqa: BLE001 - the check itself failed here (memory, say): keep grouped_mm
        return TiledChoice((), f"the tiled check failed here: {type(exc).__name__}: {str(exc)[:200]}")
    finally:
        torch.cuda.empty_cache()  # (its temporaries: the KV cache is sized from the free memory after it)


def measure_choice(device: torch.device, dtype: torch.dtype, d: int, f: int, slots: int,
                   configs: Sequence[TileConfig], reference: Callable[..., torch.Tensor], top_k: int,
                   timer: Callable[[Callable[[], object]], float] = best_ms) -> TiledChoice:
    """``check_tiled``'s steps 1-2 on seeded slots: ``slots`` of them, or fewer where they would pass
    CHECK_WEIGHT_BYTES (the rows a slot, which decide the regime, are the same). ``timer(fn) -> ms``: CUDA events
    (tests pass their own). A config serves a size where it beats the reference by MIN_SPEEDUP in both variants
    serving runs: expert-major rows, and token-major rows read through a route order against the reference's
    gather + grouped_mm."""
    slots = max(4, min(slots, CHECK_WEIGHT_BYTES // (3 * f * d * torch.empty((), dtype=dtype).element_size())))
    g = torch.Generator(device="cpu").manual_seed(0)
    w = [torch.randn(slots, *s, generator=device_generator(g, device), device=device).div_(s[1] ** 0.5).to(dtype)
         for s in ((f, d), (f, d), (d, f))]
    passing, why = [], {}
    for cfg in configs:  # 1. equal to the reference
        try:
            err = check_error(cfg, w, device, dtype, g, reference, top_k)
            if err < CHECK_TOLERANCE:
                passing.append(cfg)
            else:
                why[cfg] = f"differs from the reference by {err:.3g}"
        except Exception as exc:  # noqa: BLE001 - this config does not compile or run here: say why, try the next
            why[cfg] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
    notes = "".join(f"; {_name(c)} {r}" for c, r in why.items())
    if not passing:
        return TiledChoice((), "no config reproduces the reference here" + notes)
    times: dict[int, dict[TileConfig | None, float]] = {}  # a config's time over the reference's (the worse variant)
    timed: dict[int, str] = {}
    k = max(int(top_k), 1)
    try:  # 2. faster than the reference, up to which size, in both variants serving runs
        for per_slot in CHECK_ROWS_PER_SLOT:
            x, offsets = routed_rows(per_slot * slots, slots, d, device, dtype, g)
            tokens, order = route_order(int(x.shape[0]), d, k, device, dtype, g)
            # expert-major rows (several ranks: the exchange delivers them so), and token-major rows read through
            # the route order (one rank), where the reference pays the gather serving makes before grouped_mm
            ref = (timer(lambda: reference(x, offsets, *w)),
                   timer(lambda: reference(tokens.index_select(0, order.long() // k), offsets, *w)))
            times[per_slot], text = {None: 1.0}, [f"grouped_mm {ref[0]:.3f} / {ref[1]:.3f} ms"]
            for cfg in passing:
                ms = (timer(lambda: tiled_swiglu(x, offsets, *w, config=cfg)),
                      timer(lambda: tiled_swiglu(tokens, offsets, *w, config=cfg, order=order, top_k=k)))
                times[per_slot][cfg] = max(m / r for m, r in zip(ms, ref))
                text.append(f"{_name(cfg)} {ms[0]:.3f} / {ms[1]:.3f}")
            timed[per_slot] = ", ".join(text)
    except Exception as exc:  # noqa: BLE001 - a size the kernels cannot run: keep grouped_mm
        return TiledChoice((), f"the tiled timing failed here: {type(exc).__name__}: {str(exc)[:200]}{notes}")
    timing = "expert-major / route order; " + "; ".join(f"{r} rows a slot: {t}" for r, t in sorted(timed.items()))
    chosen = bands(times)
    if not chosen:
        return TiledChoice((), f"not faster here ({timing}){notes}")
    served = ", ".join(f"{_name(c)} to {r}" for r, c in chosen)
    return TiledChoice(chosen, f"{served}; measured at start: {timing}{notes}")


def routed_rows(rows: int, slots: int, d: int, device: torch.device, dtype: torch.dtype,
                g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` expert-major rows [rows, d] with each row's slot drawn uniformly over ``slots`` -> (x, offsets
    [slots] int32 inclusive row ends)."""
    counts = torch.bincount(torch.randint(0, slots, (rows,), generator=g), minlength=slots)
    x = torch.randn(rows, d, generator=device_generator(g, device), device=device).to(dtype)
    return x, torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)


def route_order(rows: int, d: int, top_k: int, device: torch.device, dtype: torch.dtype,
                g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major rows and a route order for ``rows`` expert-major rows -> (tokens [ceil(rows / top_k), d], order
    [rows] int32: distinct route ids, row r reads tokens[order[r] // top_k])."""
    n_tok = -(-rows // top_k)
    tokens = torch.randn(n_tok, d, generator=device_generator(g, device), device=device).to(dtype)
    order = torch.randperm(n_tok * top_k, generator=g)[:rows].to(device=device, dtype=torch.int32)
    return tokens, order


def device_generator(g: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from ``g``'s next draw (large seeded tensors drawn where they live)."""
    return torch.Generator(device=device).manual_seed(int(torch.randint(0, 2 ** 62, (1,), generator=g)))


def check_error(cfg: TileConfig, w: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype,
                g: torch.Generator, reference: Callable[..., torch.Tensor], top_k: int) -> float:
    """The largest relative difference of ``cfg``'s kernels from ``reference`` over expert-major rows, token-major
    rows read through a route order (``top_k`` routes a token), and those again with the slots' weights read as
    permuted buffer rows (every variant serving compiles: checked here, at start), on slots of up to two row blocks
    (some empty)."""
    slots, k = int(w[0].shape[0]), max(int(top_k), 1)
    counts = torch.randint(0, 2 * cfg.block_m, (slots,), generator=g)
    counts[::5] = 0
    x = torch.randn(int(counts.sum()), int(w[0].shape[2]), generator=device_generator(g, device),
                    device=device).to(dtype)
    offsets = torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)
    want = reference(x, offsets, *w).float()
    err = float((tiled_swiglu(x, offsets, *w, config=cfg).float() - want).abs().max() / want.abs().max())
    tokens, order = route_order(int(x.shape[0]), int(x.shape[1]), k, device, dtype, g)
    want = reference(tokens.index_select(0, order.long() // k), offsets, *w).float()
    got = tiled_swiglu(tokens, offsets, *w, config=cfg, order=order, top_k=k).float()
    err = max(err, float((got - want).abs().max() / want.abs().max()))
    rows = torch.randperm(slots, generator=g).to(device)  # the same slots read as buffer rows, route order too
    buf = [torch.empty_like(t).index_copy_(0, rows, t) for t in w]
    got = tiled_swiglu(tokens, offsets, *buf, config=cfg, order=order, top_k=k, weight_rows=rows).float()
    return max(err, float((got - want).abs().max() / want.abs().max()))


def _name(c: TileConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k}/w{c.warps}s{c.stages}"


__all__ = ["CANDIDATES", "CHECK_ROWS_PER_SLOT", "CHECK_TOLERANCE", "CHECK_WEIGHT_BYTES", "MIN_SPEEDUP", "OFF",
           "TileConfig", "TiledChoice", "available", "bands", "check_error", "check_tiled", "device_generator",
           "measure_choice", "route_order", "routed_rows", "tiled_swiglu"]
