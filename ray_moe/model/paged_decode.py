# ======================================================================================================
#  DECODE ATTENTION READING THE PAGED CACHE IN PLACE (one rank, one step; pure torch + Triton: no Ray)
#
#   a decode step: one new query row per sequence, its keys anywhere in the cache
#   q [S, Hq, D] ── slots [K] (the cache slot of every context position, sequence after sequence; cu_k
#   [S + 1] cuts it, or cu_k[:S] and k_end [S] when segments have room after them) ──> grid (sequence, kv head, split): each program loads its kv head's Hq / Hk query
#   heads once, walks its share of the sequence's slots BLOCK_N at a time (keys / values loaded straight
#   from the cache rows the slots name: no gathered copy of the contexts), online softmax in fp32
#   ──> one split: the output written directly; several (short batches, long contexts): per-split partial
#   sums [S, Hq, splits, Dv] + their running max / denominator, combined by a second kernel
#   ──> [S, Hq, Dv]
# ======================================================================================================
"""Flash-decoding over the paged KV cache for the VARLEN backend's decode steps.

PyTorch 2.11's FlashAttention op takes packed contiguous keys (no block table) and FlashInfer is not on the
serving machines, so a decode step used to gather every sequence's whole context out of the cache in every
layer (an ``index_select`` of all the rank's keys and values, ~55 us a layer for 256 sequences on an H200)
before the kernel read it again. This kernel reads the cache rows in place through the slot vector the step's
plan already holds (``StepLayout.read_index``), split over the context for short batches (flash-decoding), with
grouped-query heads sharing each key load. No library covers that here, so it is written once and compared
with ``paged_decode_reference`` (the contract one sequence at a time) on the GPU; ``check_paged`` runs that
comparison on the serving device before the host uses it.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

import torch

# (q [S, Hq, D], k_cache [C, Hk, D], v_cache [C, Hk, Dv], slots [K] int64, cu_k [S + 1] int32, max_k, scale,
#  k_end=None) -> [S, Hq, Dv]; sequence i's one query attends every key at slots[cu_k[i]:cu_k[i + 1]] (with
#  ``k_end`` [S] int32: slots[cu_k[i]:k_end[i]], a segment with room after it); no key: zero
DecodeKernel = Callable[..., torch.Tensor]

BLOCK_N = 64  # keys per inner iteration (three pipeline stages: 78 us for 256 sequences of ~512 keys on an
# H200, 3.5 TB/s, against 112 us with two; bench/results/logs/paged_decode-grid-h200x1-s13.json)
MAX_SPLITS = 16
_SMS_H200 = 132


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           cu_k: torch.Tensor, max_k: int, scale: float,
                           k_end: torch.Tensor | None = None) -> torch.Tensor:
    """The contract one sequence at a time (a ``DecodeKernel``; any device and dtype): gather the sequence's
    keys, repeat grouped-query heads, softmax in fp32. A sequence with no key comes out zero."""
    s, hq = q.shape[0], q.shape[1]
    hk, dv = k_cache.shape[1], v_cache.shape[2]
    out = torch.zeros(s, hq, dv, dtype=q.dtype, device=q.device)
    lo = cu_k[:s].tolist()
    hi = cu_k[1:s + 1].tolist() if k_end is None else k_end[:s].tolist()
    rep = hq // hk
    acc = torch.promote_types(q.dtype, torch.float32)
    for i in range(s):
        idx = slots[lo[i]:hi[i]]
        if idx.numel() == 0:
            continue
        k = k_cache.index_select(0, idx).to(acc).repeat_interleave(rep, 1)  # [n, Hq, D]
        v = v_cache.index_select(0, idx).to(acc).repeat_interleave(rep, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].to(acc), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v).to(q.dtype)
    return out


def decode_splits(rows: int, kv_heads: int, max_k: int, sms: int = _SMS_H200) -> int:
    """How many programs share one (sequence, kv head): enough for about four waves of programs over the
    device's multiprocessors, never more than the longest context has key blocks (a power of two <= 16).
    A function of static shapes only (a captured step keeps its grid)."""
    want = max(1, -(-4 * sms // max(1, rows * kv_heads)))
    cap = max(1, -(-max(1, max_k) // (2 * BLOCK_N)))
    n = min(want, cap, MAX_SPLITS)
    return 1 << (n.bit_length() - 1)


def pow2_block(n: int, floor: int = 16) -> int:
    """The smallest power of two >= ``n`` and >= ``floor``: a Triton block over a dimension of ``n`` (``tl.dot``
    takes dimensions of 16 and up; the attention kernels of this package share it)."""
    return max(floor, 1 << (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' ``tl.dot`` input precision for ``dtype`` activations: float32 in full IEEE float32 (Triton's
    default for float32 is TF32, 10 mantissa bits: a float32 deployment would attend at bf16-like precision);
    bf16 / fp16 as Triton's default (their products are exact in the FP32 accumulator)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=1)
def _kernels():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _decode(q_ptr, k_ptr, v_ptr, slots_ptr, lo_ptr, hi_ptr, o_ptr, part_ptr, ml_ptr, scale,
                sq_s, sq_h, sk_t, sk_h, sv_t, sv_h, so_s, so_h,
                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, DV: tl.constexpr,
                BDV: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr):
        s = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        k0 = tl.load(lo_ptr + s).to(tl.int64)
        n = tl.load(hi_ptr + s).to(tl.int64) - k0
        per = tl.cdiv(tl.cdiv(n, SPLITS), BN) * BN
        lo = sp * per
        hi = tl.minimum(lo + per, n)
        g = tl.arange(0, GP)
        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        heads = h * G + g
        q = tl.load(q_ptr + s * sq_s + heads[:, None] * sq_h + d[None, :],
                    mask=(g[:, None] < G) & (d[None, :] < D), other=0.0)
        qscale = scale * 1.4426950408889634  # scores in the exp2 domain, scaled in fp32
        m = tl.full([GP], float("-inf"), tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BDV], tl.float32)
        for start in range(lo, hi, BN):
            offs = start + tl.arange(0, BN)
            valid = offs < hi
            slot = tl.load(slots_ptr + k0 + offs, mask=valid, other=0).to(tl.int64)
            kt = tl.load(k_ptr + slot[:, None] * sk_t + h * sk_h + d[None, :],
                         mask=valid[:, None] & (d[None, :] < D), other=0.0)
            qk = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qscale  # [GP, BN] fp32
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            lsum = lsum * alpha + tl.sum(p, 1)
            vt = tl.load(v_ptr + slot[:, None] * sv_t + h * sv_h + dv[None, :],
                         mask=valid[:, None] & (dv[None, :] < DV), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            m = m_new
        out_mask = (g[:, None] < G) & (dv[None, :] < DV)
        if SPLITS == 1:
            res = acc / tl.maximum(lsum, 1e-30)[:, None]
            tl.store(o_ptr + s * so_s + heads[:, None] * so_h + dv[None, :], res.to(o_ptr.dtype.element_ty),
                     mask=out_mask)
        else:
            # partials [S, Hq, SPLITS, BDV] fp32; (max, sum) [S, Hq, SPLITS, 2]
            row = (s * (tl.num_programs(1) * G) + heads) * SPLITS + sp
            tl.store(part_ptr + row[:, None] * BDV + dv[None, :], acc, mask=out_mask)
            tl.store(ml_ptr + row * 2, m, mask=g < G)
            tl.store(ml_ptr + row * 2 + 1, lsum, mask=g < G)

    @triton.jit
    def _decode_combine(part_ptr, ml_ptr, o_ptr, so_s, so_h, HQ: tl.constexpr, DV: tl.constexpr,
                        BDV: tl.constexpr, SPLITS: tl.constexpr):
        s = tl.program_id(0)
        hq = tl.program_id(1)
        row = (s * HQ + hq) * SPLITS + tl.arange(0, SPLITS)
        m = tl.load(ml_ptr + row * 2)
        lsum = tl.load(ml_ptr + row * 2 + 1)
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp2(m - top)  # an empty split: exp2(-inf) = 0
        dv = tl.arange(0, BDV)
        part = tl.load(part_ptr + row[:, None] * BDV + dv[None, :], mask=dv[None, :] < DV, other=0.0)
        num = tl.sum(part * w[:, None], 0)
        den = tl.maximum(tl.sum(lsum * w, 0), 1e-30)
        tl.store(o_ptr + s * so_s + hq * so_h + dv, (num / den).to(o_ptr.dtype.element_ty), mask=dv < DV)

    return _decode, _decode_combine


def available() -> bool:
    """Whether Triton can be imported here (the kernel then still has to pass ``check_paged``)."""
    return _kernels() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 cu_k: torch.Tensor, max_k: int, scale: float, k_end: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton ``DecodeKernel`` (CUDA; fp16 / bf16; Hq % Hk == 0; last dims contiguous). ``max_k`` bounds
    the longest context (it picks the split count: a static shape, so the call is capturable). ``k_end``
    [S] int32: each sequence's keys end there instead of at ``cu_k[i + 1]`` (the kernel reads two offset
    vectors: ``cu_k[:S]`` and ``k_end``, or ``cu_k[1:]``, both views)."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("paged_decode: Triton is not importable here")
    decode, combine = kernels
    s, hq, d = q.shape
    hk, dv = k_cache.shape[1], v_cache.shape[2]
    if hq % hk or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}: "
                         "query heads a multiple of key heads, contiguous last dimensions")
    out = torch.empty(s, hq, dv, dtype=q.dtype, device=q.device)
    if s == 0:
        return out
    g = hq // hk
    gp = max(16, 1 << (g - 1).bit_length())
    bd, bdv = max(16, 1 << (d - 1).bit_length()), max(16, 1 << (dv - 1).bit_length())  # tl.dot: dims >= 16
    splits = decode_splits(s, hk, max_k)
    if splits > 1:
        part = torch.empty(s * hq * splits, bdv, dtype=torch.float32, device=q.device)
        ml = torch.empty(s * hq * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    hi = cu_k[1:s + 1] if k_end is None else k_end
    decode[(s, hk, splits)](q, k_cache, v_cache, slots, cu_k, hi, out, part, ml, scale,
                            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
                            v_cache.stride(1), out.stride(0), out.stride(1),
                            G=g, GP=gp, D=d, BD=bd, DV=dv, BDV=bdv, BN=BLOCK_N, SPLITS=splits,
                            PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=3)
    if splits > 1:
        combine[(s, hq)](part, ml, out, out.stride(0), out.stride(1), HQ=hq, DV=dv, BDV=bdv, SPLITS=splits,
                         num_warps=4)
    return out


def check_paged(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                value_dim: int | None = None) -> str | None:
    """Why the in-place decode kernel cannot serve this model here (None: it can): CUDA, fp16 / bf16,
    Triton, and the kernel reproducing ``paged_decode_reference`` on a small ragged batch (scattered slots,
    one sequence without keys, one split and several)."""
    if device.type != "cuda":
        return f"device {device.type}: the in-place decode kernel needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype}: the in-place decode kernel takes float16 / bfloat16"
    if num_heads % num_kv_heads or head_dim > 256 or (value_dim or head_dim) > 256:
        return f"heads {num_heads}/{num_kv_heads}, head_dim {head_dim}: outside the in-place decode kernel's shapes"
    if not available():
        return "Triton is not importable here"
    dv = value_dim or head_dim
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        lens = [5, 0, 300, 1]
        cap = 1024
        k = torch.randn(cap, num_kv_heads, head_dim, generator=g).to(device, dtype)
        v = torch.randn(cap, num_kv_heads, dv, generator=g).to(device, dtype)
        slots = torch.randperm(cap, generator=g)[: sum(lens)].to(device)
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        err = 0.0
        for rows in (len(lens), 1):  # several splits for four sequences, one program per head for one
            q = torch.randn(rows, num_heads, head_dim, generator=g).to(device, dtype)
            c = cu[: rows + 1]
            got = paged_decode(q, k, v, slots, c, max(lens), head_dim ** -0.5).float()
            want = paged_decode_reference(q, k, v, slots, c, max(lens), head_dim ** -0.5).float()
            err = max(err, float((got - want).abs().max()))
        # segments with room after them (a multi-step decode plan): each sequence ends short of the next one
        q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(device, dtype)
        end = torch.tensor([max(0, n - r) for n, r in zip(lens, (2, 0, 37, 1))], dtype=torch.int32,
                           device=device) + cu[:-1]
        got = paged_decode(q, k, v, slots, cu, max(lens), head_dim ** -0.5, end).float()
        want = paged_decode_reference(q, k, v, slots, cu, max(lens), head_dim ** -0.5, end).float()
        err = max(err, float((got - want).abs().max()))
    except Exception as exc:  # noqa: BLE001 - the kernel is unavailable here: say why, keep the gathered path
        return f"in-place decode kernel failed here: {type(exc).__name__}: {str(exc)[:200]}"
    if not (err < 0.05 and math.isfinite(err)):
        return f"in-place decode kernel differs from the reference by {err:.3g} here"
    return None


__all__ = ["DecodeKernel", "pow2_block", "paged_decode", "paged_decode_reference", "decode_splits", "check_paged",
           "available", "BLOCK_N"]
