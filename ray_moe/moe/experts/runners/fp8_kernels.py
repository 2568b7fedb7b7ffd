# ======================================================================================================
#  BLOCK-FP8 EXPERT KERNELS (one rank, one layer; pure torch + Triton: no Ray)
#
#   x [N, d] (bf16 / fp16 / fp32 activations; or token-major [T, d] read through ``order``)
#     ──> quantize_rows: per row and group of b1 columns, scale = max(amax / 448, 1e-12), code = e4m3(x / scale)
#         ──> xq [N, d] e4m3 + xs [N, ceil(d / b1)] float32                     (one program per row)
#     ──> gate/up: program (row tile of one slot, b1 columns of f): for every b1-deep K step
#             acc_g += (xq_tile . Wg_codes_tile) * xs[:, k] * sg[col // b0, k]  (fp32; same for up; where the
#             program's columns sit in one b0 block, xs[:, k] * sg[k] first: one FMA per element a K step)
#         silu(acc_g) * acc_u, then quantized per row over the program's b1 columns (one group)
#         ──> hq [R, f] e4m3 + hs [R, ceil(f / b1)] float32
#     ──> down: program (row tile of one slot, BLOCK_N columns of d): acc += (hq . Wd_codes) * hs * sd
#         ──> y [R, d] in x's dtype
#   rows are expert-major; a program finds its (slot, row tile) from the per-slot bounds on the device
#   (tiles per slot, cumulative sum, search), so the grid is fixed by the shapes: no host read, no
#   data-dependent allocation, CUDA-graph capturable; tiles past the last live one return at once.
#   dense Linear (fp8_linear): quantize_rows, then the down kernel over one slot [out, in] (K split over
#   split_k programs: FP32 partials [split_k, N, out] summed after), or torch._scaled_mm (cuBLASLt)
#   launch settings: the GPU model's tuned table (fp8_configs), else the heuristics (row_block, launch_config)
# ======================================================================================================
"""FP8 (e4m3) expert SwiGLU on block-scaled weights without dequantizing them: the grouped MoE GEMMs of
``runners/fp8.py``'s fast path (the w8a8 block-FP8 scheme of DeepSeek-V3 / Qwen3-FP8 checkpoints).

Weights are the slot stacks as stored (``SlotWeights``: codes w_gate / w_up [C, f, d], w_down [C, d, f]
float8_e4m3fn, scales [C, ceil(out / b0), ceil(in / b1)] float32, block (b0, b1)); activations are quantized
per token group of b1 columns (1 x b1, dynamic: the checkpoints' ``activation_scheme: dynamic``) with the
math of the FP8_BLOCK128 dispatch payload (``moe.dispatch.precision``). Every K step of a GEMM is exactly one
b1-wide scale block of both operands, so the block scales multiply each step's FP32 partial product
(a [BLOCK_M] column of activation scales times a [BLOCK_N] row of weight scales) and the sum stays FP32.

Rows come in two layouts, both with device-side bounds:
  * offsets (expert-major rows): ``bounds`` [Q] int32 inclusive row ends per slot (rows past bounds[-1]
    are padding: never read, their outputs left unwritten); ``order`` / ``top_k``: row r reads token
    order[r] // top_k of a token-major x; ``weight_rows`` [Q] int64: slot q's weights sit at buffer row
    weight_rows[q] (a row-mapped generation over the slot buffer); -> y [R, d]
  * capacity (the decode bucket): x [Q, C, d], ``bounds`` = valid [Q] int64 rows per slot -> y [Q, C, d]
    (padding positions zero).

Tiling: BLOCK_M rows (16 / 32 / 64; 128 where a tuned table says so), gate/up BLOCK_N = b1 (the intermediate's quantization group: one program
owns one group of each of its rows), BLOCK_K = b1; down BLOCK_N = 32 / 64 / 128, BLOCK_K = b1; warps and pipeline
stages per launch. The settings come from the GPU model's tuned table (``fp8_configs``: measured by
``ray_moe_bench.fp8_tune``), else from the heuristics (``row_block``: the mean rows per slot; ``launch_config``). Supported blocks: b1 in 32 / 64 / 128, any b0 (``supports``); d and f any size
(partial edge blocks masked). The torch reference of the same contract is ``runners/fp8.py``
``fp8_swiglu_reference``; ``check_fp8_kernel`` there compares them on the serving device.
"""

from __future__ import annotations

import functools

import torch

from ray_moe.moe.experts.fp8 import ACT_SCALE_MIN as SCALE_MIN, FP8_DTYPE, FP8_MAX, scale_shape
from ray_moe.moe.experts.runners import fp8_configs
from ray_moe.moe.experts.runners.fp8_configs import LaunchConfig, LinearBackend, LinearChoice, SwigluChoice

ROW_BLOCKS = (16, 32, 64)
GROUPS = (32, 64, 128)  # the K-block widths b1 the kernels take (one tl.dot K step each)
DOWN_BLOCK_N = 128


@functools.lru_cache(maxsize=1)
def _kernels():
    """(quantize_rows, gate_up, down, interpreted) or None when Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _e4m3(v, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr):
        """float32 -> e4m3 (round to nearest even, saturated at +-448). EMULATE (Triton's CPU interpreter,
        whose float32 -> fp8 cast drops the carry of a rounded mantissa): round on the e4m3 grid in float32
        first (normals: 3 mantissa bits kept by bit arithmetic; subnormals: multiples of 2^-9), so the cast
        is exact."""
        v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
        if EMULATE:
            a = tl.abs(v)
            bits = a.to(tl.int32, bitcast=True)
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
            sub = ((a * 512.0 + 8388608.0) - 8388608.0) / 512.0
            r = tl.where(a < 0.015625, sub, normal)
            v = tl.where(v < 0, -r, r)
        return v.to(tl.float8e4nv)

    @triton.jit
    def _div_rows(v, s):
        """v [M, N] / s [M] per row, rounded as IEEE division (``torch``'s): Triton's ``/`` is the GPU's
        approximate division (~2 ulp), which moves a bf16 activation's exact e4m3 rounding ties (common: a bf16
        value over its group's bf16 amax x 448) to either side, away from ``quantize_groups``' codes."""
        return tl.math.div_rn(v, tl.zeros_like(v) + s[:, None])

    @triton.jit
    def _tile(bounds_ptr, Q, CAP, t, BLOCK_M: tl.constexpr, QP: tl.constexpr, CAPACITY: tl.constexpr):
        """Program tile t -> (slot, first row, end row) from the per-slot bounds; slot >= Q: no tile.
        1. rows per slot (offsets: end - previous end; capacity: min(valid, CAP)) and first rows
        2. tiles per slot = ceil(rows / BLOCK_M), inclusive cumulative sum
        3. slot = number of slots whose cumulative tiles end at or before t (an empty slot adds none)"""
        qs = tl.arange(0, QP)
        live = qs < Q
        if CAPACITY:
            cnt = tl.minimum(tl.maximum(tl.load(bounds_ptr + qs, mask=live, other=0).to(tl.int32), 0), CAP)
            first = qs * CAP
        else:
            end = tl.load(bounds_ptr + qs, mask=live, other=0).to(tl.int32)
            first = tl.load(bounds_ptr + qs - 1, mask=live & (qs > 0), other=0).to(tl.int32)
            cnt = tl.where(live, end - first, 0)
        tiles = (cnt + BLOCK_M - 1) // BLOCK_M
        cum = tl.cumsum(tiles, axis=0)
        slot = tl.sum((cum <= t).to(tl.int32), axis=0)
        sel = qs == slot
        before = tl.sum(tl.where(sel, cum - tiles, 0), axis=0)
        row0 = tl.sum(tl.where(sel, first, 0), axis=0) + (t - before) * BLOCK_M
        rend = tl.sum(tl.where(sel, first + cnt, 0), axis=0)
        return slot, row0, rend

    # the kernels call the two helpers by name: Triton resolves names in the module's globals, not in this
    # closure, so the helpers are published there before any kernel is compiled (or interpreted)
    globals().update(_e4m3=_e4m3, _div_rows=_div_rows, _tile=_tile)

    @triton.jit
    def _quantize_rows(x_ptr, q_ptr, s_ptr, D, NG, G: tl.constexpr, NGP: tl.constexpr, FP8_MAX: tl.constexpr,
                       SCALE_MIN: tl.constexpr, EMULATE: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, NGP)
        cols = g[:, None] * G + tl.arange(0, G)[None, :]
        m = cols < D
        v = tl.load(x_ptr + r * D + cols, mask=m, other=0.0).to(tl.float32)
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=1), FP8_MAX), SCALE_MIN)
        tl.store(q_ptr + r * D + cols, _e4m3(_div_rows(v, s), FP8_MAX, EMULATE), mask=m)
        tl.store(s_ptr + r * NG + g, s, mask=g < NG)

    @triton.jit
    def _gate_up(xq_ptr, xs_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, bounds_ptr, tok_ptr, wrow_ptr, hq_ptr, hs_ptr,
                 Q, CAP, D, F, NGD, NGF, SF, SD,
                 B0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QP: tl.constexpr,
                 TOP_K: tl.constexpr, GATHER: tl.constexpr, ROWS: tl.constexpr, CAPACITY: tl.constexpr,
                 EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, FP8_MAX: tl.constexpr, SCALE_MIN: tl.constexpr,
                 EMULATE: tl.constexpr, UNIFORM: tl.constexpr):
        # UNIFORM (B0 % BLOCK_N == 0): the program's columns sit in one weight-scale block, so each K step's weight
        # scale is one number, folded into the rows' activation scales: one FMA per accumulator element a K step
        pid = tl.program_id(0)
        nb = tl.cdiv(F, BLOCK_N)
        pid_n = pid % nb
        slot, row0, rend = _tile(bounds_ptr, Q, CAP, pid // nb, BLOCK_M, QP, CAPACITY)
        if slot >= Q:
            return
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rmask = rows < rend
        if GATHER:  # row r is route tok[r] of token tok[r] // TOP_K: read that token's quantized row
            src = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64) // TOP_K
        else:
            src = rows
        if ROWS:
            w = tl.load(wrow_ptr + slot).to(tl.int64)
        else:
            w = slot.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < F
        ks = tl.arange(0, BLOCK_N)  # BLOCK_K == BLOCK_N == b1: one scale block deep
        w_tile = w * F * D + cols[None, :].to(tl.int64) * D + ks[:, None]
        s_col = w * SF * SD + (cols // B0) * SD
        s_one = w * SF * SD + (pid_n * BLOCK_N // B0) * SD  # (UNIFORM: the one scale row of the program's columns)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, NGD):
            k0 = kb * BLOCK_N
            a = tl.load(xq_ptr + src[:, None] * D + (k0 + ks)[None, :],
                        mask=rmask[:, None] & ((k0 + ks)[None, :] < D), other=0.0)
            a_s = tl.load(xs_ptr + src * NGD + kb, mask=rmask, other=0.0)
            if EVEN_K and EVEN_N:
                bg = tl.load(wg_ptr + w_tile + k0)
                bu = tl.load(wu_ptr + w_tile + k0)
            else:
                wm = cmask[None, :] & ((k0 + ks)[:, None] < D)
                bg = tl.load(wg_ptr + w_tile + k0, mask=wm, other=0.0)
                bu = tl.load(wu_ptr + w_tile + k0, mask=wm, other=0.0)
            if UNIFORM:
                acc_g += tl.dot(a, bg) * (a_s * tl.load(sg_ptr + s_one + kb))[:, None]
                acc_u += tl.dot(a, bu) * (a_s * tl.load(su_ptr + s_one + kb))[:, None]
            else:
                s_g = tl.load(sg_ptr + s_col + kb, mask=cmask, other=0.0)
                s_u = tl.load(su_ptr + s_col + kb, mask=cmask, other=0.0)
                acc_g += tl.dot(a, bg) * a_s[:, None] * s_g[None, :]
                acc_u += tl.dot(a, bu) * a_s[:, None] * s_u[None, :]
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(g) * u in FP32 (masked columns: 0)
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(h), axis=1), FP8_MAX), SCALE_MIN)  # one group per program
        tl.store(hq_ptr + rows[:, None] * F + cols[None, :], _e4m3(_div_rows(h, s), FP8_MAX, EMULATE),
                 mask=rmask[:, None] & cmask[None, :])
        tl.store(hs_ptr + rows * NGF + pid_n, s, mask=rmask)

    @triton.jit
    def _down(hq_ptr, hs_ptr, wd_ptr, sd_ptr, bounds_ptr, wrow_ptr, y_ptr, Q, CAP, D, F, NGF, SDR, SDC, YS,
              B0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              QP: tl.constexpr, ROWS: tl.constexpr, CAPACITY: tl.constexpr, EVEN_K: tl.constexpr,
              EVEN_N: tl.constexpr, SPLIT_K: tl.constexpr, UNIFORM: tl.constexpr):
        # SPLIT_K > 1 (a dense Linear's skinny steps): program k of a tile sums its share of the K blocks into
        # y_ptr + k * YS (FP32 partials, reduced in a fixed order by the caller)
        pid = tl.program_id(0)
        if SPLIT_K > 1:
            pid_k = pid % SPLIT_K
            pid = pid // SPLIT_K
            per = tl.cdiv(NGF, SPLIT_K)
            k_lo, k_hi = pid_k * per, tl.minimum(NGF, pid_k * per + per)
            y_ptr += pid_k * YS
        else:  # (the experts' down: the loop as measured, every K block in one program)
            k_lo, k_hi = 0, NGF
        nb = tl.cdiv(D, BLOCK_N)
        pid_n = pid % nb
        slot, row0, rend = _tile(bounds_ptr, Q, CAP, pid // nb, BLOCK_M, QP, CAPACITY)
        if slot >= Q:
            return
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rmask = rows < rend
        if ROWS:
            w = tl.load(wrow_ptr + slot).to(tl.int64)
        else:
            w = slot.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < D
        ks = tl.arange(0, BLOCK_K)
        w_tile = w * D * F + cols[None, :].to(tl.int64) * F + ks[:, None]
        s_col = w * SDR * SDC + (cols // B0) * SDC
        s_one = w * SDR * SDC + (pid_n * BLOCK_N // B0) * SDC  # (UNIFORM: the one scale row of the program's columns)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(k_lo, k_hi):
            k0 = kb * BLOCK_K
            a = tl.load(hq_ptr + rows[:, None] * F + (k0 + ks)[None, :],
                        mask=rmask[:, None] & ((k0 + ks)[None, :] < F), other=0.0)
            a_s = tl.load(hs_ptr + rows * NGF + kb, mask=rmask, other=0.0)
            if EVEN_K and EVEN_N:
                b = tl.load(wd_ptr + w_tile + k0)
            else:
                b = tl.load(wd_ptr + w_tile + k0, mask=cmask[None, :] & ((k0 + ks)[:, None] < F), other=0.0)
            if UNIFORM:  # (as in _gate_up: one weight scale for the program's columns)
                acc += tl.dot(a, b) * (a_s * tl.load(sd_ptr + s_one + kb))[:, None]
            else:
                s_b = tl.load(sd_ptr + s_col + kb, mask=cmask, other=0.0)
                acc += tl.dot(a, b) * a_s[:, None] * s_b[None, :]
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])

    from triton.runtime.interpreter import InterpretedFunction

    return _quantize_rows, _gate_up, _down, isinstance(_gate_up, InterpretedFunction)


def available() -> bool:
    """Whether Triton can be imported here (the kernels then still have to pass ``check_fp8_kernel``)."""
    return _kernels() is not None


def interpreted() -> bool:
    """Whether the kernels run under Triton's CPU interpreter (tests on CPU tensors; never a serving path)."""
    k = _kernels()
    return bool(k and k[3])


def supports(block: tuple[int, int] | None, d: int, f: int) -> str | None:
    """Why the kernels cannot take weights of this block and shape (None: they can)."""
    if block is None:
        return "the slots hold no FP8 block scales"
    b0, b1 = (int(v) for v in block)
    if b1 not in GROUPS or b0 < 1:
        return (f"weight block {[b0, b1]}: the FP8 expert kernels take K blocks (the block's columns) of "
                f"{' / '.join(map(str, GROUPS))}")
    if d < 1 or f < 1:
        return f"d={d}, f={f}: empty experts"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def row_block(rows: int, slots: int) -> int:
    """Rows per program tile for ``rows`` spread over ``slots``: the smallest of 16 / 32 / 64 holding the mean
    rows per slot plus 2.5 standard deviations of a binomial draw (as the skinny bf16 kernels), so a decode
    step's slot fits one tile and streams its weights once; prefill takes 64-row tiles."""
    mean = rows / max(slots, 1)
    need = mean + 2.5 * mean ** 0.5
    return next((b for b in ROW_BLOCKS if need <= b), ROW_BLOCKS[-1])


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d] (float) -> (codes [N, d] float8_e4m3fn, scales [N, ceil(d / group)] float32): per row and group
    of ``group`` columns scale = max(amax / 448, 1e-12), code = e4m3(x / scale) (round to nearest even,
    within +-448); ``fp8.quantize_groups`` is the torch version. One program per row."""
    quant = _kernels()[0]
    x = x.contiguous()
    n, d = int(x.shape[0]), int(x.shape[1])
    ng = -(-d // group)
    q = torch.empty((n, d), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((n, ng), dtype=torch.float32, device=x.device)
    if n and d:
        ngp = _next_pow2(ng)
        quant[(n,)](x, q, s, d, ng, G=group, NGP=ngp, FP8_MAX=FP8_MAX, SCALE_MIN=SCALE_MIN, EMULATE=_kernels()[3],
                    num_warps=8 if ngp * group >= 4096 else 4)
    return q, s


def launch_config(block_m: int) -> SwigluChoice:
    """The heuristic launch settings of the two GEMM kernels at a row tile (a GPU without a tuned table, and the
    tuner's baseline): gate/up holds two FP32 accumulators [BLOCK_M, b1] (8 warps from 32 rows on, as a
    256-column tile), down one over 128 columns; 3 pipeline stages."""
    return SwigluChoice(LaunchConfig(block_m, 128, 8 if block_m >= 32 else 4, 3),
                        LaunchConfig(block_m, DOWN_BLOCK_N, 4, 3))


def swiglu_choice(x: torch.Tensor, d: int, f: int, block, rows: int, slots: int) -> SwigluChoice:
    """The launch settings of ``rows`` routed rows over ``slots`` slots on ``x``'s device: the tuned table's entry
    for this GPU model and shape (``fp8_configs``), else ``launch_config(row_block(rows, slots))``."""
    table = fp8_configs.table_for_device(x.device)
    got = table.swiglu(d, f, tuple(block), rows) if table is not None else None
    return got if got is not None else launch_config(row_block(rows, slots))


def _launch(xq, xs, rows: int, bounds, codes, scales, block, *, capacity: int, order, top_k: int,
            weight_rows, choice: SwigluChoice, y: torch.Tensor) -> torch.Tensor:
    """The gate/up and down kernels over ``rows`` expert-major rows (see ``fp8_swiglu``)."""
    _, gate_up, down, emulate = _kernels()
    wg, wu, wd = codes
    sg, su, sd = scales
    b0, b1 = (int(v) for v in block)
    q = int(bounds.shape[0])
    f, d = int(wg.shape[1]), int(wg.shape[2])
    gu, dn = choice.gate_up, choice.down

    # 1. the grid: every tile a slot can start (fixed by the shapes: no host read of the bounds)
    def tiles(bm: int) -> int:
        if capacity:
            return q * -(-capacity // bm)
        return -(-rows // bm) + min(q, rows)  # each live tile holds >= 1 row; one partial tile per slot

    qp = max(_next_pow2(q), 2)
    ngd, ngf = -(-d // b1), -(-f // b1)
    hq = torch.empty((rows, f), dtype=FP8_DTYPE, device=xq.device)
    hs = torch.empty((rows, ngf), dtype=torch.float32, device=xq.device)
    tok = order if order is not None else bounds  # never read without GATHER
    wrow = weight_rows if weight_rows is not None else bounds  # never read without ROWS
    # 2. gate/up + SiLU-and-mul + the intermediate's quantization (one group of b1 columns per program)
    gate_up[(-(-f // b1) * tiles(gu.block_m),)](
        xq, xs, wg, wu, sg, su, bounds, tok, wrow, hq, hs, q, capacity, d, f, ngd, ngf, int(sg.shape[1]),
        int(sg.shape[2]), B0=b0, BLOCK_M=gu.block_m, BLOCK_N=b1, QP=qp, TOP_K=max(int(top_k), 1), GATHER=order is not None,
        ROWS=weight_rows is not None, CAPACITY=bool(capacity), EVEN_K=d % b1 == 0, EVEN_N=f % b1 == 0,
        FP8_MAX=FP8_MAX, SCALE_MIN=SCALE_MIN, EMULATE=emulate, UNIFORM=b0 % b1 == 0, num_warps=gu.warps,
        num_stages=gu.stages)
    # 3. down, into y
    down[(-(-d // dn.block_n) * tiles(dn.block_m),)](
        hq, hs, wd, sd, bounds, wrow, y, q, capacity, d, f, ngf, int(sd.shape[1]), int(sd.shape[2]), 0, B0=b0,
        BLOCK_M=dn.block_m, BLOCK_N=dn.block_n, BLOCK_K=b1, QP=qp, ROWS=weight_rows is not None,
        CAPACITY=bool(capacity), EVEN_K=f % b1 == 0, EVEN_N=d % dn.block_n == 0, SPLIT_K=1,
        UNIFORM=b0 % dn.block_n == 0, num_warps=dn.warps, num_stages=dn.stages)
    return y


def _check_weights(codes, scales, block) -> None:
    wg, wu, wd = codes
    if wg.dtype != FP8_DTYPE or wu.dtype != FP8_DTYPE or wd.dtype != FP8_DTYPE:
        raise ValueError(f"codes: expected float8_e4m3fn, got {[t.dtype for t in codes]}")
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in scales) or not all(
            t.is_contiguous() for t in codes):
        raise ValueError("codes / scales: expected contiguous codes and contiguous float32 scales")
    why = supports(block, int(wg.shape[2]), int(wg.shape[1]))
    if why is not None:
        raise ValueError(why)
    if tuple(wu.shape) != tuple(wg.shape) or tuple(wd.shape) != (wg.shape[0], wg.shape[2], wg.shape[1]) or any(
            tuple(s.shape) != scale_shape(c.shape, block) for c, s in zip(codes, scales)):
        raise ValueError(f"codes / scales: shapes {[tuple(t.shape) for t in codes]} / {[tuple(t.shape) for t in scales]} "
                         f"are not w_gate / w_up [C, f, d], w_down [C, d, f] with their {list(block)} block scales")


def _pick(x: torch.Tensor, d: int, f: int, block, rows: int, slots: int, block_m: int | None,
          choice: SwigluChoice | None) -> SwigluChoice:
    if choice is not None:
        return choice
    return _heuristic(block_m) if block_m is not None else swiglu_choice(x, d, f, block, rows, slots)


def _heuristic(block_m: int) -> SwigluChoice:
    """``launch_config`` at a caller's row tile, which must be one of ``ROW_BLOCKS``."""
    if block_m not in ROW_BLOCKS:
        raise ValueError(f"block_m={block_m}: must be one of {ROW_BLOCKS}")
    return launch_config(int(block_m))


def fp8_swiglu(x: torch.Tensor, bounds: torch.Tensor, codes, scales, block, *, order: torch.Tensor | None = None,
               top_k: int = 1, weight_rows: torch.Tensor | None = None, block_m: int | None = None,
               choice: SwigluChoice | None = None) -> torch.Tensor:
    """Expert-major rows: y [R, d] = per slot q over its rows: down(quant(silu(g) * u)) with g / u the FP8
    GEMMs of the quantized rows against slot q's codes and block scales (see the module docstring).

    x [N, d] expert-major (R = N), or token-major [T, d] with ``order`` [R] int32 (row r reads token
    order[r] // top_k); bounds [Q] int32 inclusive row ends per slot; codes (w_gate [C, f, d], w_up [C, f, d],
    w_down [C, d, f]) float8_e4m3fn; scales (s_gate [C, ceil(f/b0), ceil(d/b1)], s_up, s_down
    [C, ceil(d/b0), ceil(f/b1)]) float32; block (b0, b1); weight_rows [Q] int64 (None: slot q is row q).
    -> y [R, d] in x's dtype; rows past bounds[-1] are left unwritten. Launch settings: ``choice`` (the tuner's
    candidates), else ``block_m`` with the heuristic settings, else ``swiglu_choice`` (the GPU's tuned table)."""
    _check_weights(codes, scales, block)
    rows = int(order.numel()) if order is not None else int(x.shape[0])
    d, f = int(codes[0].shape[2]), int(codes[0].shape[1])
    if x.dim() != 2 or int(x.shape[1]) != d:
        raise ValueError(f"x: expected [N, {d}], got {tuple(x.shape)}")
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0 or int(bounds.shape[0]) == 0:
        return y
    picked = _pick(x, d, f, block, rows, int(bounds.shape[0]), block_m, choice)
    xq, xs = quantize_rows(x, int(block[1]))
    return _launch(xq, xs, rows, bounds, codes, scales, block, capacity=0, order=order, top_k=top_k,
                   weight_rows=weight_rows, choice=picked, y=y)


def default_linear(rows: int) -> LinearChoice:
    """The heuristic dense launch (no tuned entry): the Triton kernel, ``row_block(rows, 1)`` rows per tile, 128
    columns, 4 warps, 3 stages."""
    return LinearChoice(LinearBackend.TRITON, LaunchConfig(row_block(rows, 1), DOWN_BLOCK_N, 4, 3))


def scaled_mm_reason(x: torch.Tensor, out_features: int, in_features: int, block) -> str | None:
    """Why ``torch._scaled_mm``'s blockwise GEMM cannot take this call (None: it can): CUDA, bf16 / fp16
    activations, 128 x 128 weight blocks, in / out features multiples of 16 and at least 16 rows (cuBLASLt has
    no blockwise algorithm below; measured: CUBLAS_STATUS_NOT_SUPPORTED at one row on an H100)."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return f"scaled_mm takes CUDA bf16 / fp16 activations (got {x.device.type} {x.dtype})"
    if tuple(int(b) for b in block) != (128, 128):
        return f"scaled_mm's blockwise GEMM takes 128 x 128 weight blocks (got {list(block)})"
    if int(x.shape[0]) < 16 or out_features % 16 or in_features % 16:
        return (f"scaled_mm needs >= 16 rows and 16-divisible features (rows {int(x.shape[0])}, out {out_features}, "
                f"in {in_features})")
    return None


def linear_choice(x: torch.Tensor, out_features: int, in_features: int, block) -> LinearChoice:
    """The dense launch on ``x``'s device: the tuned table's entry for this GPU model, shape and row count where it
    has one (a scaled_mm entry only where ``scaled_mm_reason`` allows the call), else ``default_linear``."""
    rows = int(x.shape[0])
    table = fp8_configs.table_for_device(x.device)
    got = table.linear(out_features, in_features, tuple(block), rows) if table is not None else None
    if got is None or (got.backend is LinearBackend.SCALED_MM and
                       scaled_mm_reason(x, out_features, in_features, block) is not None):
        return default_linear(rows)
    return got


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block, *,
               choice: LinearChoice | None = None) -> torch.Tensor:
    """A dense block-FP8 Linear (attention projections, shared experts, dense MLPs of an FP8 checkpoint):
    x [N, in] (bf16 / fp16 / fp32) quantized per row and b1-column group (``quantize_rows``), then
      TRITON:    the down kernel over one slot: y = sum over K blocks of (xq . codes^T) * xs * scale
      SCALED_MM: torch._scaled_mm(xq, codes^T, scale_a = xs [N, in/128] (M-major), scale_b = scales^T) (cuBLASLt)
    -> y [N, out] in x's dtype. codes [out, in] float8_e4m3fn, scales [ceil(out / b0), ceil(in / b1)] float32.
    Fixed grid (no host read of the data): CUDA-graph capturable. ``choice``: the tuner's candidate (None:
    ``linear_choice``). The torch reference is ``fp8_linear_reference`` in ``model/fp8_linear.py``."""
    b0, b1 = (int(v) for v in block)
    if codes.dtype != FP8_DTYPE or scales.dtype != torch.float32 or codes.dim() != 2:
        raise ValueError(f"codes / scales: expected [out, in] float8_e4m3fn and float32 scales, got "
                         f"{codes.dtype} {tuple(codes.shape)} / {scales.dtype}")
    out_f, in_f = (int(v) for v in codes.shape)
    if tuple(scales.shape) != scale_shape(codes.shape, block):
        raise ValueError(f"scales: expected {scale_shape(codes.shape, block)} for codes {(out_f, in_f)} in "
                         f"{[b0, b1]} blocks, got {tuple(scales.shape)}")
    why = supports(block, out_f, in_f)
    if why is not None:
        raise ValueError(why)
    if x.dim() != 2 or int(x.shape[1]) != in_f:
        raise ValueError(f"x: expected [N, {in_f}], got {tuple(x.shape)}")
    n = int(x.shape[0])
    if n == 0:
        return torch.empty((0, out_f), dtype=x.dtype, device=x.device)
    if choice is not None and choice.backend is LinearBackend.SCALED_MM:  # (linear_choice asks the same itself)
        why = scaled_mm_reason(x, out_f, in_f, block)
        if why is not None:
            raise ValueError(why)
    picked = choice if choice is not None else linear_choice(x, out_f, in_f, block)
    xq, xs = quantize_rows(x, b1)
    if picked.backend is LinearBackend.SCALED_MM:
        return torch._scaled_mm(xq, codes.t(), scale_a=xs.t().contiguous().t(), scale_b=scales.t(), out_dtype=x.dtype)
    cfg = picked.config
    split = cfg.split_k
    # split_k > 1: FP32 partials [split, N, out], summed over the splits in a fixed order (deterministic), then cast
    y = torch.empty((split, n, out_f) if split > 1 else (n, out_f), dtype=torch.float32 if split > 1 else x.dtype,
                    device=x.device)
    tiles = -(-n // cfg.block_m) + 1  # one slot: its row tiles plus the partial one
    bounds = torch.full((1,), n, dtype=torch.int32, device=x.device)
    _kernels()[2][(-(-out_f // cfg.block_n) * tiles * split,)](
        xq, xs, codes.unsqueeze(0), scales.unsqueeze(0), bounds, bounds, y, 1, 0, out_f, in_f, -(-in_f // b1),
        int(scales.shape[0]), int(scales.shape[1]), n * out_f, B0=b0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=b1, QP=2, ROWS=False, CAPACITY=False, EVEN_K=in_f % b1 == 0, EVEN_N=out_f % cfg.block_n == 0,
        SPLIT_K=split, UNIFORM=b0 % cfg.block_n == 0, num_warps=cfg.warps, num_stages=cfg.stages)
    return y.sum(0).to(x.dtype) if split > 1 else y


def fp8_swiglu_capacity(x: torch.Tensor, valid: torch.Tensor, codes, scales, block, *,
                        block_m: int | None = None) -> torch.Tensor:
    """The decode bucket's capacity layout: x [Q, C, d] (slot q's rows at [q, :valid[q]]), valid [Q] int64
    (values clamped to [0, C]), codes / scales / block as ``fp8_swiglu`` with slot q at row q -> [Q, C, d],
    padding positions zero. Row tiles: the smallest of 16 / 32 / 64 holding C (one tile per slot; the
    heuristic settings: the capacity layout is not tuned)."""
    _check_weights(codes, scales, block)
    q, cap, d = (int(v) for v in x.shape)
    if q != int(valid.shape[0]) or d != int(codes[0].shape[2]):
        raise ValueError(f"x: expected [{int(valid.shape[0])}, C, {int(codes[0].shape[2])}], got {tuple(x.shape)}")
    y = torch.zeros((q, cap, d), dtype=x.dtype, device=x.device)
    if q == 0 or cap == 0:
        return y
    picked = _heuristic(block_m if block_m is not None else next((b for b in ROW_BLOCKS if cap <= b), ROW_BLOCKS[-1]))
    xq, xs = quantize_rows(x.reshape(q * cap, d), int(block[1]))
    _launch(xq, xs, q * cap, valid, codes, scales, block, capacity=cap, order=None, top_k=1, weight_rows=None,
            choice=picked, y=y.view(q * cap, d))
    return y


__all__ = ["FP8_DTYPE", "FP8_MAX", "SCALE_MIN", "ROW_BLOCKS", "GROUPS", "available", "interpreted", "supports",
           "row_block", "launch_config", "swiglu_choice", "default_linear", "linear_choice", "scaled_mm_reason",
           "quantize_rows", "fp8_swiglu", "fp8_swiglu_capacity", "fp8_linear"]
