"""Row-movement kernels of the direct data path: Triton on CUDA, torch everywhere else. Pure: no Ray.

Two memory-bound operations the torch op set only offers as two passes:

* ``move_rows(src, src_idx, dst, dst_idx)``: ``dst[dst_idx[i]] = src[src_idx[i]]`` in one pass (torch:
  ``index_select`` into a temporary, then ``index_copy_``).
* ``quantize_fp8`` / ``dequantize_fp8``: FP8 e4m3 rows with per-row or per-128-column FP32 scales in one
  pass each (torch: FP32 temporaries of the whole payload and five elementwise passes); same math as
  ``precision.quantize`` / ``dequantize``, which call them on CUDA.
* ``gated_combine(a, b, route_src, gate, out_dtype)``: ``out[t] = sum_j gate[t, j] * row(t, j)`` with
  ``row(t, j) = a[s]`` when ``s = route_src[t, j] >= 0`` and ``b[-1 - s]`` otherwise, accumulated in FP32
  and stored once in ``out_dtype`` (torch: k gathers, k FP32 conversions and k multiply-adds over
  ``[T, d]``). ``a`` holds this rank's own expert-major rows, ``b`` the rows that came back from peers.

The Triton kernels read each source row once and write each output row once (one program per output
row and column block). The torch versions are the reference the kernels are tested against and the path
on CPU. ``use_triton`` decides per call (CUDA tensor, contiguous, Triton importable).
"""

from __future__ import annotations

import functools

import torch

BLOCK_COLS = 1024


@functools.lru_cache(maxsize=1)
def _triton_kernels():
    """(move_rows kernel, gated_combine kernel) or None when Triton is unavailable."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _move_rows(src_ptr, src_idx_ptr, dst_ptr, dst_idx_ptr, width, BLOCK: tl.constexpr, GATHER: tl.constexpr):
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        if GATHER:
            s = tl.load(src_idx_ptr + i).to(tl.int64)
        else:
            s = i.to(tl.int64)
        t = tl.load(dst_idx_ptr + i).to(tl.int64)
        v = tl.load(src_ptr + s * width + cols, mask=mask)
        tl.store(dst_ptr + t * width + cols, v, mask=mask)

    @triton.jit
    def _gated_combine(a_ptr, b_ptr, src_ptr, gate_ptr, out_ptr, width, K: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            s = tl.load(src_ptr + t * K + j)
            g = tl.load(gate_ptr + t * K + j)
            own = s >= 0
            ra = tl.load(a_ptr + tl.where(own, s, 0) * width + cols, mask=mask & own, other=0.0)
            rb = tl.load(b_ptr + tl.where(own, 0, -1 - s) * width + cols, mask=mask & (~own), other=0.0)
            acc += g * (ra.to(tl.float32) + rb.to(tl.float32))
        tl.store(out_ptr + t * width + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quant_fp8(x_ptr, q_ptr, s_ptr, width, groups, G: tl.constexpr, FP8_MAX: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        cols = g * G + tl.arange(0, G)
        mask = cols < width
        x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        # correctly rounded divisions (Triton's "/" is an approximate fp32 divide): the codes and scales
        # then equal the torch math bit for bit
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(tl.div_rn(amax, tl.full([], FP8_MAX, tl.float32)), 1e-12)
        q = tl.div_rn(x, tl.zeros_like(x) + scale)
        tl.store(q_ptr + row * width + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * groups + g, scale)

    @triton.jit
    def _dequant_fp8(q_ptr, s_ptr, out_ptr, width, groups, G: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        cols = g * G + tl.arange(0, G)
        mask = cols < width
        scale = tl.load(s_ptr + row * groups + g)
        q = tl.load(q_ptr + row * width + cols, mask=mask).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quant_fp8_rows_of_blocks(x_ptr, q_ptr, s_ptr, width, groups, NG: tl.constexpr, B: tl.constexpr,
                                  FP8_MAX: tl.constexpr):
        # one program per row: [NG, B] tile, one scale per B-column block
        row = tl.program_id(0).to(tl.int64)
        gi = tl.arange(0, NG)
        cols = gi[:, None] * B + tl.arange(0, B)[None, :]
        mask = (gi[:, None] < groups) & (cols < width)
        x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.maximum(tl.div_rn(amax, tl.zeros_like(amax) + FP8_MAX), 1e-12)
        q = tl.div_rn(x, tl.zeros_like(x) + scale[:, None])
        tl.store(q_ptr + row * width + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * groups + gi, scale, mask=gi < groups)

    @triton.jit
    def _dequant_fp8_rows_of_blocks(q_ptr, s_ptr, out_ptr, width, groups, NG: tl.constexpr, B: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        gi = tl.arange(0, NG)
        cols = gi[:, None] * B + tl.arange(0, B)[None, :]
        mask = (gi[:, None] < groups) & (cols < width)
        scale = tl.load(s_ptr + row * groups + gi, mask=gi < groups, other=1.0)
        q = tl.load(q_ptr + row * width + cols, mask=mask).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)

    return _move_rows, _gated_combine, _quant_fp8, _dequant_fp8, _quant_fp8_rows_of_blocks, _dequant_fp8_rows_of_blocks


def triton_available() -> bool:
    return _triton_kernels() is not None


def use_triton(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda and t.is_contiguous() for t in tensors) and triton_available()


def _word_view(t: torch.Tensor) -> torch.Tensor:
    """A 2-D row-major tensor as rows of 4-, 2- or 1-byte words (a bitwise copy needs no dtype)."""
    row_bytes = t.shape[1] * t.element_size()
    flat = t.view(torch.uint8)  # [rows, row_bytes]
    for word in (torch.int32, torch.int16):
        size = torch.empty(0, dtype=word).element_size()
        if row_bytes % size == 0:
            return flat.view(word)
    return flat


def move_rows(src: torch.Tensor, src_idx: torch.Tensor | None, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for every i (rows; bitwise); ``src_idx=None`` means
    ``src_idx[i] = i`` (a scatter of ``src``'s rows in order).

    src: [S, d], dst: [D, d] same dtype; src_idx, dst_idx: [n] int64. Destination rows must be distinct.
    """
    n = int(dst_idx.numel())
    if src_idx is not None and n != int(src_idx.numel()):
        raise ValueError(f"src_idx has {int(src_idx.numel())} entries but dst_idx has {n}")
    if src_idx is None and n != src.shape[0]:
        raise ValueError(f"src has {src.shape[0]} rows but dst_idx has {n} entries")
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src {src.dtype}{tuple(src.shape)} and dst {dst.dtype}{tuple(dst.shape)} rows differ")
    if n == 0:
        return
    if use_triton(src, dst, dst_idx) and (src_idx is None or src_idx.is_contiguous()) and src.dim() == 2:
        kernel = _triton_kernels()[0]
        s, d = _word_view(src), _word_view(dst)
        width = s.shape[1]
        gather = src_idx is not None
        kernel[(n, triton_cdiv(width, BLOCK_COLS))](s, src_idx if gather else dst_idx, d, dst_idx, width,
                                                    BLOCK=BLOCK_COLS, GATHER=gather)
        return
    dst.index_copy_(0, dst_idx, src if src_idx is None else src.index_select(0, src_idx))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gated_combine(a: torch.Tensor, b: torch.Tensor, route_src: torch.Tensor, gate: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """Gated FP32 combine of k rows per token from two row sources.

    a: [Na, d], b: [Nb, d] (same dtype); route_src: [T, k] int64 (>= 0: row of ``a``; < 0: row -1-s of
    ``b``); gate: [T, k] float32. Returns [T, d] ``out_dtype``.
    """
    t, k = route_src.shape
    d = a.shape[1]
    if gate.shape != route_src.shape:
        raise ValueError(f"gate: shape {tuple(gate.shape)} != route_src shape {tuple(route_src.shape)}")
    if b.numel() and (b.dtype != a.dtype or b.shape[1] != d):
        raise ValueError(f"b {b.dtype}{tuple(b.shape)} rows differ from a {a.dtype}{tuple(a.shape)}")
    out = torch.empty(t, d, dtype=out_dtype, device=a.device)
    if t == 0 or d == 0:
        return out.zero_()
    gate = gate.to(torch.float32).contiguous()
    route_src = route_src.contiguous()
    b_arg = b if b.numel() else a  # never read: every route_src is >= 0 then
    if use_triton(a, b_arg, route_src, gate):
        kernel = _triton_kernels()[1]
        kernel[(t, triton_cdiv(d, BLOCK_COLS))](a, b_arg, route_src, gate, out, d, K=k, BLOCK=BLOCK_COLS)
        return out
    return gated_combine_torch(a, b, route_src, gate, out_dtype)


def _group_width(d: int, group: int | None) -> int:
    """Columns per scale: ``group`` (block scales) or the whole row padded to a power of two (row scales)."""
    if group is not None:
        return group
    g = 1
    while g < d:
        g *= 2
    return g


def quantize_fp8(x: torch.Tensor, group: int | None, fp8_dtype: torch.dtype, fp8_max: float):
    """One-pass FP8 quantisation on CUDA: x [N, d] -> (q [N, d] ``fp8_dtype``, scales [N, S] float32) with
    S = 1 (``group=None``: one scale per row) or ceil(d / group); the same math as ``precision.quantize``
    (scale = max(amax / fp8_max, 1e-12), q = x / scale). Returns None where the kernel does not apply
    (CPU, non-contiguous rows, no Triton, rows wider than 65536 for row scales)."""
    if x.dim() != 2 or not use_triton(x) or (group is None and x.shape[1] > 65536):
        return None
    n, d = x.shape
    g = _group_width(d, group)
    groups = 1 if group is None else -(-d // group)
    q = torch.empty(n, d, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(n, groups, dtype=torch.float32, device=x.device)
    if n and d:
        if group is not None and groups * group <= 65536:  # block scales: one program per row
            ng = _group_width(groups, None)
            _triton_kernels()[4][(n,)](x, q, scales, d, groups, NG=ng, B=group, FP8_MAX=fp8_max,
                                       num_warps=8 if ng * group >= 4096 else 4)
        else:
            _triton_kernels()[2][(n, groups)](x, q, scales, d, groups, G=g, FP8_MAX=fp8_max,
                                              num_warps=8 if g >= 4096 else 4)
    return q, scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, group: int | None, out_dtype: torch.dtype):
    """Inverse of ``quantize_fp8`` on CUDA: [N, d] fp8 + [N, S] scales -> [N, d] ``out_dtype``, or None
    where the kernel does not apply."""
    if q.dim() != 2 or not use_triton(q, scales) or (group is None and q.shape[1] > 65536):
        return None
    n, d = q.shape
    g = _group_width(d, group)
    groups = scales.shape[1]
    out = torch.empty(n, d, dtype=out_dtype, device=q.device)
    if n and d:
        if group is not None and groups * group <= 65536:
            ng = _group_width(groups, None)
            _triton_kernels()[5][(n,)](q, scales, out, d, groups, NG=ng, B=group,
                                       num_warps=8 if ng * group >= 4096 else 4)
        else:
            _triton_kernels()[3][(n, groups)](q, scales, out, d, groups, G=g, num_warps=8 if g >= 4096 else 4)
    return out


def gated_combine_torch(a: torch.Tensor, b: torch.Tensor, route_src: torch.Tensor, gate: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """The torch version of ``gated_combine`` (CPU path and the kernel's test oracle)."""
    t, k = route_src.shape
    rows = torch.cat([a, b]) if b.numel() else a
    idx = torch.where(route_src >= 0, route_src, a.shape[0] - 1 - route_src)
    acc = torch.zeros(t, a.shape[1], dtype=torch.float32, device=a.device)
    gate = gate.to(torch.float32)
    for j in range(k):
        acc.addcmul_(rows.index_select(0, idx[:, j]).to(torch.float32), gate[:, j:j + 1])
    return acc.to(out_dtype)
