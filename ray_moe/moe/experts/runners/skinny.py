"""Expert SwiGLU for few rows per expert (decode): Triton kernels that stream each active expert's weights once.

At decode sizes an expert receives a handful of rows, so the expert layer is a weight read: the grouped
GEMM (``torch._grouped_mm``) streams the active experts' weights at about half of HBM bandwidth there. These
two kernels are shaped for it (expert-major rows, device-side offsets, no host sync, CUDA-graph capturable):

  1. gate/up: one program per (expert, column block of f), looping over the expert's rows in blocks of
     BLOCK_M (``row_block``: sized so nearly every expert's rows fit one block, since each further block
     re-streams the expert's weights): rows [BLOCK_M, d] times the gate and up tiles [d, BLOCK_N], both
     accumulated in FP32;
     silu(gate) * up stored once (no [N, f] gate / up temporaries); an expert with no rows reads no weight.
  2. down:    one program per (expert, column block of d): [BLOCK_M, f] row blocks x the w_down^T tile.

x: [N, d] expert-major rows (bf16 / fp16), or token-major [T, d] rows read through ``order`` (the route
of each expert-major row: the dispatch's gather happens in the kernel's loads); offsets: [Q] int32
inclusive prefix of rows per local slot (rows past offsets[-1] are padding: never read, their outputs left
unwritten); w_gate / w_up: [Q, f, d], w_down: [Q, d, f] (the SlotWeights layouts; or a slot buffer's [C, f, d]
rows through ``weight_rows``) -> y: [N, d]. The grouped runner's result is the reference
(tests compare on CUDA); on CPU or without Triton ``available`` is False and the runner keeps grouped_mm.
"""

from __future__ import annotations

import functools

import torch

BLOCK_M = 16  # the smallest row block (the smallest tl.dot tile)
ROW_BLOCKS = (16, 32, 64)


@functools.lru_cache(maxsize=1)
def _kernels():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _gate_up(x_ptr, wg_ptr, wu_ptr, offs_ptr, a_ptr, tok_ptr, wrow_ptr, D, F, stride_we,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K: tl.constexpr,
                 GATHER: tl.constexpr, ROWS: tl.constexpr):
        e = tl.program_id(0)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        end = tl.load(offs_ptr + e).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        if ROWS:  # the slot's weights live in buffer row wrow[e]
            wbase = tl.load(wrow_ptr + e).to(tl.int64) * stride_we
        else:
            wbase = e.to(tl.int64) * stride_we
        for m0 in range(start, end, BLOCK_M):  # decode: one block; later blocks re-read the tiles from L2
            rows = m0 + tl.arange(0, BLOCK_M)
            rmask = rows < end
            if GATHER:  # row r is route tok[r] of token tok[r] // K: read that token's hidden row
                src = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64) // K
            else:
                src = rows
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
    def _down(a_ptr, wd_ptr, offs_ptr, y_ptr, wrow_ptr, D, F, stride_we,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
        e = tl.program_id(0)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        end = tl.load(offs_ptr + e).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        if ROWS:
            wbase = tl.load(wrow_ptr + e).to(tl.int64) * stride_we
        else:
            wbase = e.to(tl.int64) * stride_we
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            rmask = rows < end
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, F, BLOCK_K):
                a = tl.load(a_ptr + rows[:, None] * F + (k0 + ks)[None, :], mask=rmask[:, None], other=0.0)
                acc += tl.dot(a, tl.load(wd_ptr + wbase + cols[None, :].to(tl.int64) * F + (k0 + ks)[:, None]))
            tl.store(y_ptr + rows[:, None] * D + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None])

    return _gate_up, _down


def _block(n: int, prefer: int) -> int | None:
    """The largest power-of-two tile <= prefer (>= 16) dividing n, or None."""
    b = prefer
    while b >= 16:
        if n % b == 0:
            return b
        b //= 2
    return None


def row_block(rows: int, slots: int) -> int:
    """Rows per program block for ``rows`` spread over ``slots``: the smallest of 16 / 32 / 64 holding the
    mean rows per slot plus 2.5 standard deviations of a binomial draw (top-k routing spreads a step's rows
    about so), so nearly every slot's rows fit one block and its weights stream from HBM once. A second
    block re-reads the weights (the tiles of the 132 SMs in flight exceed the L2). Measured on one H200
    (Qwen3-30B-A3B experts, ``bench/results/skinny-h200x1-qwen3-s11.json``): at 256 decoding sequences (16
    rows per slot on average, up to 25) 32-row blocks take 319 us against 425 us for 16-row ones; at 128
    sequences (8 on average, up to 16) 16-row blocks are 4% faster than 32-row ones (masked tensor-core work)."""
    mean = rows / max(slots, 1)
    need = mean + 2.5 * mean ** 0.5
    return next((b for b in ROW_BLOCKS if need <= b), ROW_BLOCKS[-1])


def available(x: torch.Tensor, w_gate: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether the kernels take these operands: CUDA, bf16 / fp16, contiguous [Q, f, d] / [Q, d, f] weights,
    d and f multiples of 16 (the tiles divide them), Triton importable."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16) or _kernels() is None:
        return False
    if not (x.is_contiguous() and w_gate.is_contiguous() and w_down.is_contiguous()):
        return False
    f, d = int(w_gate.shape[1]), int(w_gate.shape[2])
    return (_block(d, 128) is not None and _block(f, 128) is not None and _block(d, 64) is not None
            and _block(f, 64) is not None and w_gate.dtype == x.dtype)


def skinny_swiglu(x: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, *, block_m: int | None = None, order: torch.Tensor | None = None,
                  top_k: int = 1, weight_rows: torch.Tensor | None = None) -> torch.Tensor:
    """y [N, d] = per slot q: (silu(x_q W_g[q]^T) * x_q W_u[q]^T) W_d[q]^T over its rows (``offsets``).
    ``block_m``: rows per program block (None: ``row_block(N, Q)``; one of ``ROW_BLOCKS``).
    ``order``: [N] int32 route of each expert-major row: row r reads x[order[r] // top_k] (x is then
    token-major [T, d]; the gather happens in the kernel's loads). ``weight_rows``: [Q] int64 the weight row
    of each slot (slot weights over a larger buffer, [C, f, d]); None: slot q is row q."""
    gate_up, down = _kernels()
    n = int(order.numel()) if order is not None else int(x.shape[0])
    d = int(x.shape[1])
    q, f = int(offsets.shape[0]), int(w_gate.shape[1])
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n == 0 or q == 0:
        return y
    a = torch.empty((n, f), dtype=x.dtype, device=x.device)
    bm = row_block(n, q) if block_m is None else int(block_m)
    if bm not in ROW_BLOCKS:
        raise ValueError(f"block_m={block_m}: must be one of {ROW_BLOCKS}")
    tok = order if order is not None else offsets  # never read without GATHER
    wrow = weight_rows if weight_rows is not None else offsets  # never read without ROWS
    # tiles measured on H200 (python -m ray_moe_bench.skinny; bench/results/skinny-h200x1.json): 64 output columns, 128-deep K steps
    bn, bk = _block(f, 64), _block(d, 128)
    gate_up[(q, f // bn)](x, w_gate, w_up, offsets, a, tok, wrow, d, f, f * d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                          K=max(int(top_k), 1), GATHER=order is not None, ROWS=weight_rows is not None,
                          num_warps=4, num_stages=4)
    bn, bk = _block(d, 64), _block(f, 128)
    down[(q, d // bn)](a, w_down, offsets, y, wrow, d, f, d * f, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                       ROWS=weight_rows is not None, num_warps=4, num_stages=4)
    return y

__all__ = ["skinny_swiglu", "available", "row_block", "BLOCK_M", "ROW_BLOCKS"]
