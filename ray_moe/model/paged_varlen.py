# ======================================================================================================
#  VARLEN ATTENTION READING THE PAGED CACHE IN PLACE (one rank, one step; pure torch + Triton: no Ray)
#
#   a step of any sequences (one-row decode tokens and prefill chunks side by side), every key where the cache
#   keeps it: q [N, Hq, D] ── slots [K] (every sequence's context slots, sequence after sequence; cu_k [S + 1]
#   cuts it) ── cu_q [S + 1] (query rows, packed) ── two work tables (``work_tables``, static lengths):
#     one-row table  [NA] int32: the sequences with one query row (-1: an empty entry)
#     block table    [NB] int32 sequence, [NB] int32 first query row: ``block_rows`` rows of a longer sequence
#   ──> launch 1, grid (NA, Hk): each program one decode row, its kv head's Hq / Hk query heads at once
#   ──> launch 2, grid (NB, Hk): each program ``block_rows`` query rows x the Hq / Hk heads (BLOCK_M rows of
#       one matrix product), causal aligned at the bottom right (query i of Lq sees keys <= Lk - Lq + i): the keys
#       every row sees first (no mask), then the diagonal tiles masked; online softmax in fp32 (exp2)
#   ──> out [N, Hq, Dv]: the rows the tables name; every other row zero
#   the grids and the tables' lengths depend only on a step SIZE (rows, sequences), never on its sequences:
#   one CUDA graph of a token size serves every step of that size (``shard/graph_runner.py``, TOKEN_GRAPH)
# ======================================================================================================
"""Attention of a whole step over the paged KV cache read in place, for whole-step graphs of token sizes.

PyTorch's FlashAttention-2 takes packed contiguous keys and host ints for the longest query run and context, so a
mixed step (prefill chunks beside decode rows) could only run as a piecewise graph with attention launched from
Python between the pieces: on the H200 a step of ~500 prompt tokens beside ~250 decoding sequences took ~48 ms
of device time against ~24 ms for the decode step alone, the device waiting on the host's 48 holes. FlashInfer
(which plans such steps) is not on the serving machines and FlashAttention-3 is not in PyTorch, so this kernel is
written once: its contract is ``paged_varlen_reference`` (one sequence at a time, SDPA-equivalent math), and
``check_paged_varlen`` compares the two on the serving device before a host uses it.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

import numpy as np
import torch

from ray_moe.model.paged_decode import dot_precision, pow2_block

BLOCK_M = 128  # rows of one program's products: query rows x the Hq / Hk heads of its kv head
BLOCK_N = 64  # keys per inner iteration

# (q [N, Hq, D], k_cache [C, Hk, D], v_cache [C, Hk, Dv], slots [K] int64, cu_q [S + 1] int32, cu_k [S + 1] int32,
#  one [NA] int32, seq [NB] int32, first [NB] int32, scale) -> [N, Hq, Dv]
PagedVarlenKernel = Callable[..., torch.Tensor]


def block_rows(num_heads: int, num_kv_heads: int) -> int:
    """Query rows of one program of a longer sequence: ``BLOCK_M`` product rows over the kv head's query heads
    (16 at Hq / Hk = 8), at most 64."""
    return max(1, min(64, BLOCK_M // pow2_block(num_heads // num_kv_heads, 1)))


def table_sizes(rows: int, sequences: int, block_q: int) -> tuple[int, int]:
    """(one-row entries, blocks) a step of at most ``rows`` rows and ``sequences`` sequences can need: one entry
    per one-row sequence, and sum(ceil(len / block_q)) <= rows / block_q + (sequences of two rows or more)."""
    rows, sequences = int(rows), int(sequences)
    return max(1, min(rows, sequences)), max(1, rows // block_q + min(sequences, rows // 2) + 1)


def work_tables(lens: np.ndarray, one: np.ndarray, seq: np.ndarray, first: np.ndarray, block_q: int) -> None:
    """Fill a step's work tables in place (``one`` [NA], ``seq`` / ``first`` [NB] int64 views; -1 / 0 where
    empty) from its sequences' query rows ``lens`` [S]: the one-row sequences, then ceil(len / block_q) blocks
    of every longer one. ``ValueError`` when a table is too short for the step (a size it was not made for)."""
    ones = np.flatnonzero(lens == 1)
    multi = np.flatnonzero(lens > 1)
    per = -(-lens[multi] // block_q)
    nb = int(per.sum())
    if ones.size > one.size or nb > seq.size:
        raise ValueError(f"{ones.size} one-row sequences and {nb} query blocks: the tables hold {one.size} and "
                         f"{seq.size}")
    one[:ones.size], one[ones.size:] = ones, -1
    seq[:nb] = np.repeat(multi, per)
    first[:nb] = (np.arange(nb, dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)) * block_q
    seq[nb:], first[nb:] = -1, 0


def paged_varlen_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           cu_q: torch.Tensor, cu_k: torch.Tensor, one: torch.Tensor, seq: torch.Tensor,
                           first: torch.Tensor, scale: float) -> torch.Tensor:
    """The contract one sequence at a time (a ``PagedVarlenKernel``; any device and dtype): every sequence a
    table names, its keys gathered from their slots, grouped-query heads repeated, causal at the bottom right,
    softmax in fp32 or wider. Rows no table names, and rows with no key, come out zero."""
    n, hq = q.shape[0], q.shape[1]
    hk, dv = k_cache.shape[1], v_cache.shape[2]
    out = torch.zeros(n, hq, dv, dtype=q.dtype, device=q.device)
    named = sorted({int(s) for s in itertools.chain(one.tolist(), seq.tolist()) if s >= 0})
    bq, bk = cu_q.tolist(), cu_k.tolist()
    rep = hq // hk
    acc = torch.promote_types(q.dtype, torch.float32)
    for i in named:
        nq, nk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        if nq <= 0 or nk <= 0:
            continue
        idx = slots[bk[i]:bk[i + 1]]
        k = k_cache.index_select(0, idx).to(acc).repeat_interleave(rep, 1)  # [nk, Hq, D]
        v = v_cache.index_select(0, idx).to(acc).repeat_interleave(rep, 1)
        qi = q[bq[i]:bq[i + 1]].to(acc)  # [nq, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        allowed = (torch.arange(nk, device=q.device)[None, :]
                   <= (nk - nq + torch.arange(nq, device=q.device))[:, None])
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out[bq[i]:bq[i + 1]] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _attend(q_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, cu_q_ptr, cu_k_ptr, seq_ptr, first_ptr, scale,
                sq_n, sq_h, sk_t, sk_h, sv_t, sv_h, so_n, so_h,
                G: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                DV: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr, BLOCKS: tl.constexpr,
                PRECISION: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s_raw = tl.load(seq_ptr + b)
        live = s_raw >= 0
        s = tl.maximum(s_raw, 0)
        q0 = 0
        if BLOCKS:
            q0 = tl.load(first_ptr + b)
        qs = tl.load(cu_q_ptr + s)
        qn = tl.where(live, tl.load(cu_q_ptr + s + 1) - qs, 0)
        ks = tl.load(cu_k_ptr + s).to(tl.int64)
        kn = tl.where(live, tl.load(cu_k_ptr + s + 1) - tl.load(cu_k_ptr + s), 0)
        M: tl.constexpr = BQ * GP
        m = tl.arange(0, M)
        tok = q0 + m // GP  # the row's query index within its sequence
        g = m % GP
        row_ok = (tok < qn) & (g < G)
        heads = h * G + g
        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        qrow = (qs + tok).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * sq_n + heads[:, None] * sq_h + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        qscale = scale * 1.4426950408889634  # scores in the exp2 domain, scaled in fp32
        lim = kn - qn + tok  # [M] the last key each row sees
        hi = tl.minimum(kn, kn - qn + q0 + BQ)  # keys any row of the program sees
        full = tl.maximum(kn - qn + q0 + 1, 0) // BN * BN  # keys every row sees, whole tiles
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, BDV], tl.float32)
        # 1. the tiles every row sees: no mask
        for start in range(0, full, BN):
            offs = start + tl.arange(0, BN)
            slot = tl.load(slots_ptr + ks + offs).to(tl.int64)
            kt = tl.load(k_ptr + slot[:, None] * sk_t + h * sk_h + d[None, :], mask=d[None, :] < D, other=0.0)
            qk = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qscale
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_ptr + slot[:, None] * sv_t + h * sv_h + dv[None, :], mask=dv[None, :] < DV, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            m_i = m_new
        # 2. the diagonal and the context's tail: masked (causal, and the keys past the context)
        for start in range(full, hi, BN):
            offs = start + tl.arange(0, BN)
            valid = offs < hi
            slot = tl.load(slots_ptr + ks + offs, mask=valid, other=0).to(tl.int64)
            kt = tl.load(k_ptr + slot[:, None] * sk_t + h * sk_h + d[None, :],
                         mask=valid[:, None] & (d[None, :] < D), other=0.0)
            qk = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qscale
            see = valid[None, :] & (offs[None, :] <= lim[:, None])
            qk = tl.where(see, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_ptr + slot[:, None] * sv_t + h * sv_h + dv[None, :],
                         mask=valid[:, None] & (dv[None, :] < DV), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            m_i = m_new
        res = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(o_ptr + qrow[:, None] * so_n + heads[:, None] * so_h + dv[None, :], res.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < DV))

    return _attend


def available() -> bool:
    """Whether Triton can be imported here (the kernel then still has to pass ``check_paged_varlen``)."""
    return _kernel() is not None


def paged_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 cu_q: torch.Tensor, cu_k: torch.Tensor, one: torch.Tensor, seq: torch.Tensor, first: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """The Triton ``PagedVarlenKernel`` (CUDA, or Triton's interpreter; fp16 / bf16 / fp32; Hq % Hk == 0; last
    dimensions contiguous). Two launches of static grids (module banner): capturable, no host sync."""
    attend = _kernel()
    if attend is None:
        raise RuntimeError("paged_varlen: Triton is not importable here")
    n, hq, d = q.shape
    hk, dv = k_cache.shape[1], v_cache.shape[2]
    if hq % hk or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}: "
                         "query heads a multiple of key heads, contiguous last dimensions")
    out = torch.zeros(n, hq, dv, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    g = hq // hk
    bd, bdv = pow2_block(d), pow2_block(dv)  # tl.dot: dimensions >= 16
    common = (q, k_cache, v_cache, out, slots, cu_q, cu_k)
    strides = (scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
               v_cache.stride(1), out.stride(0), out.stride(1))
    # 1. one-row sequences: G query heads padded to 16 rows of one product (as the decode kernel does)
    attend[(one.numel(), hk)](*common, one, one, *strides, G=g, GP=pow2_block(g), BQ=1, D=d, BD=bd, DV=dv, BDV=bdv,
                              BN=BLOCK_N, BLOCKS=False, PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=3)
    # 2. blocks of ``block_rows`` query rows of the longer sequences (the tables' block size)
    gp, bq = pow2_block(g, 1), block_rows(hq, hk)
    attend[(seq.numel(), hk)](*common, seq, first, *strides, G=g, GP=gp, BQ=bq, D=d, BD=bd, DV=dv, BDV=bdv,
                              BN=BLOCK_N, BLOCKS=True, PRECISION=dot_precision(q.dtype),
                              num_warps=8 if gp * bq >= 128 else 4, num_stages=3)
    return out


def check_paged_varlen(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                       head_dim: int, value_dim: int | None = None) -> str | None:
    """Why the in-place varlen kernel cannot serve this model here (None: it can): CUDA, fp16 / bf16, Triton,
    and the kernel reproducing ``paged_varlen_reference`` on a small ragged step (scattered slots, decode rows
    and chunks continuing a context and starting one, a chunk longer than a block, empty table entries)."""
    if device.type != "cuda":
        return f"device {device.type}: the in-place varlen kernel needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype}: the in-place varlen kernel takes float16 / bfloat16"
    if num_heads % num_kv_heads or head_dim > 256 or (value_dim or head_dim) > 256:
        return f"heads {num_heads}/{num_kv_heads}, head_dim {head_dim}: outside the in-place varlen kernel's shapes"
    if not available():
        return "Triton is not importable here"
    try:
        err = reference_error(device, dtype, num_heads, num_kv_heads, head_dim, value_dim or head_dim)
    except Exception as exc:  # noqa: BLE001 - the kernel is unavailable here: say why, keep the piecewise path
        return f"in-place varlen kernel failed here: {type(exc).__name__}: {str(exc)[:200]}"
    if not (err < 0.05 and math.isfinite(err)):
        return f"in-place varlen kernel differs from the reference by {err:.3g} here"
    return None


def reference_error(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                    value_dim: int, kernel: PagedVarlenKernel | None = None, seed: int = 0) -> float:
    """The largest absolute difference between ``kernel`` (default the Triton one) and the reference on one
    ragged step: contexts / query rows (5, 1), (0, 0)... decode rows, a fresh 37-row chunk, a 70-row chunk
    continuing a 200-key context, slots scattered over the cache, tables with empty entries."""
    kernel = kernel or paged_varlen
    g = torch.Generator(device="cpu").manual_seed(seed)
    qlens = [1, 37, 1, 70, 1, 3]
    klens = [5, 37, 300, 270, 1, 3]
    cap = 1024
    k = torch.randn(cap, num_kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(cap, num_kv_heads, value_dim, generator=g).to(device, dtype)
    slots = torch.randperm(cap, generator=g)[: sum(klens)].to(device)
    n = sum(qlens)
    q = torch.randn(n, num_heads, head_dim, generator=g).to(device, dtype)
    cu_q = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(klens)], dtype=torch.int32, device=device)
    bq = block_rows(num_heads, num_kv_heads)
    na, nb = table_sizes(n, len(qlens), bq)
    tabs = np.zeros(na + 2 * nb, dtype=np.int64)
    work_tables(np.asarray(qlens), tabs[:na], tabs[na:na + nb], tabs[na + nb:], bq)
    one, seq, first = (torch.from_numpy(x).to(device, torch.int32) for x in np.split(tabs, [na, na + nb]))
    got = kernel(q, k, v, slots, cu_q, cu_k, one, seq, first, head_dim ** -0.5).float()
    want = paged_varlen_reference(q, k, v, slots, cu_q, cu_k, one, seq, first, head_dim ** -0.5).float()
    return float((got - want).abs().max())


__all__ = ["PagedVarlenKernel", "paged_varlen", "paged_varlen_reference", "check_paged_varlen", "available",
           "table_sizes", "work_tables", "block_rows", "reference_error", "BLOCK_M", "BLOCK_N"]
