# ======================================================================================================
#  LONG PROMPT CHUNKS THROUGH A DENSE ATTENTION KERNEL (one rank, one eager step; pure torch: no Ray)
#
#   kv.plan_step (host, per step): the prompt chunks after the one-row group cut into runs ──> SequenceRun
#       a chunk of >= ``min_rows`` query rows whose context before it is short enough (the padded square
#       costs <= MAX_PAD_WORK x the causal work): a DENSE run of its own; the sequences between them: one
#       varlen run each stretch
#   attention.attend (per layer): each run over the step's gathered keys
#       varlen run:  FlashAttention-2's variable-length forward (``attention.flash_varlen``) on the run's rows
#       dense run:   ``dense_causal``: the chunk's queries placed at the bottom of a square of its context length
#                    (the rows above them zero), the keys / values repeated to the query heads (or read in place,
#                    ``dense_causal_gqa``, where SDPA's enable_gqa serves: the start check keeps the faster), one
#                    causal dense SDPA call (cuDNN's fused attention on Hopper), the chunk's rows cut back out
#   ──> [n, Hq, D] in the step's row order
#
#  Why: PyTorch ships FlashAttention-2 only; on Hopper its forward runs at ~310-340 TF/s, cuDNN's dense fused
#  attention at ~600 (an H100, bench/results/dense-h100x1-03bdc85: this path at 0.65-0.71x FlashAttention-2's time
#  on 6-8k chunks), and a 6-8k prompt's step spends ~45% of its device time in attention. The host picks the dense
#  kernel at start only where ``check_dense`` finds it equal to the reference and faster than FlashAttention-2 on
#  this device, from the chunk length it measured it winning at.
# ======================================================================================================
"""Dense causal attention for long prompt chunks of eager steps, and the runs a step's chunks are cut into."""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ray_moe.core.cuda_timing import best_ms
from ray_moe.model.attention import DenseKernel, SequenceRun, runs_at

DENSE_MIN_ROWS = 1024  # the shortest chunk the dense kernel may serve (its start check may raise it)
MAX_PAD_WORK = 1.25  # the padded square's work over the chunk's causal work, at most
# the start-time timings' fresh chunks (the shortest from which it wins is the threshold). 6,144 and 8,192: at 4,096 the
# dense kernel's lead is thin and moved between two checks on one H100 (1.21x, then 1.07x against MIN_SPEEDUP's 1.1,
# b994b30's lease), which left 6-8k prompt chunks, where it leads by ~1.4x, on FlashAttention-2
CHECK_SIZES = (1024, 2048, 4096, 6144, 8192)
WARM_ROWS = 16384  # squares planned at start: to the default step's token count (driver/defaults.py, CUDA)
SQUARE_ROWS = 256  # the dense kernel's squares are multiples of this (cuDNN plans one shape at a time)
MIN_SPEEDUP = 1.1  # the dense kernel must beat FlashAttention-2 by this much on a chunk length to serve it


def dense_worthy(rows: int, context: int, min_rows: int) -> bool:
    """Whether a chunk of ``rows`` new rows over ``context`` keys (its own included) takes the dense kernel: long
    enough, and the padded square (context^2 / 2 pairs) within MAX_PAD_WORK of the causal work
    (rows * (context - rows / 2) pairs)."""
    if rows < min_rows or context < rows:
        return False
    return context * context <= MAX_PAD_WORK * rows * (2 * context - rows)


def prefill_runs(lens: np.ndarray, ends: np.ndarray, k_base: int, min_rows: int) -> tuple[SequenceRun, ...] | None:
    """A step's prompt chunks (query lengths ``lens`` [S], contexts ``ends`` [S], host; after the one-row group)
    cut into runs, keys counted from ``k_base`` in the gathered keys. None where no chunk is ``dense_worthy``
    (the step keeps its one varlen call).
      1. mark the dense chunks
      2. each dense chunk a run; each stretch of others between them one varlen run"""
    dense = [dense_worthy(int(q), int(e), min_rows) for q, e in zip(lens.tolist(), ends.tolist())]
    if not any(dense):
        return None
    cuts = [0] + [i for i in range(1, len(dense)) if dense[i] or dense[i - 1]] + [len(dense)]
    return runs_at(cuts, lens, ends, k_base, dense)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool = False) -> torch.Tensor:
    """One chunk's causal attention through PyTorch's dense SDPA (cuDNN's fused kernel on CUDA; the math kernel
    on CPU, the reference): q [Nq, Hq, D] over k [Nk, Hk, D] / v [Nk, Hk, Dv], Nk >= Nq, causal aligned at the
    bottom right (query i sees keys <= Nk - Nq + i) -> [Nq, Hq, Dv]. ``gqa``: the kernel reads the Hk key / value
    heads itself (SDPA's ``enable_gqa``) instead of copies repeated to Hq heads.
      1. a square of L = Nk rounded up to SQUARE_ROWS: the queries at rows [Nk - Nq, Nk) (zero rows around them,
         their outputs dropped), so the dense kernel's top-left causal mask is the chunk's bottom-right one; the
         zero keys after Nk are later than every real query, which the mask hides from them (cuDNN builds one
         execution plan per shape: a bounded set of squares, not one per prompt length); each byte written once.
         A fresh chunk (Nq = Nk) whose rows are followed in memory by L - Nq more of the same layout (the step's
         other rows, or its padding: a captured step's static query rows) is read in place, those rows' outputs
         dropped (no copy: ~1.5% of long prompts' device time on an H100, b994b30's step profile)
      2. keys / values into the square's first Nk rows (repeated to the query heads unless ``gqa``: head h of the
         query reads key head h // (Hq / Hk))
      3. one SDPA call on [1, H, L, D] views; the chunk's rows cut back out"""
    nq, nk = int(q.shape[0]), int(k.shape[0])
    hq = int(q.shape[1])
    rep = 1 if gqa else hq // int(k.shape[1])
    side = -(-nk // SQUARE_ROWS) * SQUARE_ROWS
    ks, vs = k.new_empty(side, k.shape[1], rep, k.shape[2]), v.new_empty(side, v.shape[1], rep, v.shape[2])
    ks[:nk], vs[:nk] = k[:, :, None], v[:, :, None]  # 2.
    ks[nk:].zero_()
    vs[nk:].zero_()
    heads = int(k.shape[1]) * rep
    kd, vd = (t.reshape(side, heads, -1).transpose(0, 1)[None] for t in (ks, vs))
    kw = {"enable_gqa": True} if gqa else {}

    def attend(qd: torch.Tensor) -> torch.Tensor:  # 3.
        with _cudnn_only() if q.device.type == "cuda" else contextlib.nullcontext():
            return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, **kw)

    room = rows_in_place(q, side) if nq == nk else None  # 1. (the copied square's strides: the same plan)
    if room is not None:
        return attend(room.transpose(0, 1)[None])[0].transpose(0, 1)[:nq]
    qs = q.new_empty(side, hq, q.shape[2])
    qs[:nk - nq].zero_()
    qs[nk - nq:nk] = q
    qs[nk:].zero_()
    return attend(qs.transpose(0, 1)[None])[0].transpose(0, 1)[nk - nq:nk]


def rows_in_place(q: torch.Tensor, rows: int) -> torch.Tensor | None:
    """q [N, H, D] with dense rows (strides (H * D, D, 1)) -> a [rows, H, D] view from q's first row over the rows
    its storage holds after it (rows >= N), or None where the storage ends sooner or the rows are not dense."""
    n, h, d = (int(x) for x in q.shape)
    if rows < n or q.stride() != (h * d, d, 1):
        return None
    if q.untyped_storage().nbytes() // q.element_size() < q.storage_offset() + rows * h * d:
        return None
    return q.as_strided((rows, h, d), q.stride())


def _cudnn_only() -> contextlib.AbstractContextManager:
    """SDPA restricted to cuDNN's fused kernel (a shape it cannot take raises rather than running another)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)


def dense_causal_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``dense_causal`` reading the key / value heads in place of repeated copies (a ``DenseKernel``)."""
    return dense_causal(q, k, v, scale, gqa=True)


@dataclass(frozen=True)
class DenseChoice:
    """What ``check_dense`` decided: the kernel (None: FlashAttention-2 for every chunk), the shortest chunk it
    serves (measured: the dense kernel won from there up) and why, in words (with the timings)."""

    kernel: DenseKernel | None
    min_rows: int
    reason: str


def threshold(times: dict[int, tuple[float, float]]) -> int | None:
    """The shortest measured chunk length from which the dense kernel beats FlashAttention-2 by MIN_SPEEDUP at
    every longer measured length: ``times`` {rows: (dense ms, FlashAttention-2 ms)}. None: it loses at the
    longest."""
    best = None
    for rows in sorted(times, reverse=True):
        dense_ms, flash_ms = times[rows]
        if dense_ms * MIN_SPEEDUP > flash_ms:
            break
        best = rows
    return best


@functools.lru_cache(maxsize=None)
def check_dense(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                value_dim: int, varlen: Callable[..., torch.Tensor],
                reference: Callable[..., torch.Tensor]) -> DenseChoice:
    """Whether and from which chunk length long chunks attend through the dense kernel, decided once a process for
    each device, dtype, head shape and varlen kernel (a property of the device: every host of the process reads the
    same answer). Used only where
      1. it reproduces the reference on this device (a fresh chunk and one over earlier context, against
         ``reference``: the varlen contract sequence by sequence, ``attention.sequence_reference``): of the
         variants that do (key / value heads read in place, ``dense_causal_gqa``, or repeated), the faster one
         on the longest check chunk,
      2. it beats ``varlen`` (FlashAttention-2) by MIN_SPEEDUP on fresh chunks of CHECK_SIZES rows (CUDA events,
         the best of 5 each): from the shortest of them it wins at and above (``threshold``), and
      3. every square from there to WARM_ROWS plans (run once each, here at start: cuDNN builds an execution plan
         per shape; a longer context's square is planned when first seen)."""
    if device.type != "cuda":
        return _off(f"device {device.type}: the dense kernel is cuDNN's (CUDA)")
    if dtype not in (torch.float16, torch.bfloat16) or head_dim != value_dim or num_heads % num_kv_heads:
        return _off(f"dtype {dtype}, head sizes {head_dim}/{value_dim}, heads {num_heads}/{num_kv_heads}: not served")
    g = torch.Generator(device="cpu").manual_seed(0)
    scale = head_dim ** -0.5

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    top = max(CHECK_SIZES)
    usable, why = {}, {}  # 1. each variant equal to the reference, and its time on the longest check chunk
    for kernel in (dense_causal_gqa, dense_causal):
        try:  # a fresh chunk, one over earlier context, and a fresh one read in place (rows after it)
            err = max(_error(kernel, draw, reference, nq, nk, num_heads, num_kv_heads, head_dim, scale, after)
                      for nq, nk, after in ((160, 160, 0), (96, 200, 0), (200, 200, 100)))
            if not err < 0.05:
                why[kernel.__name__] = f"differs from the reference by {err:.3g}"
                continue
            q, k, v = draw(top, num_heads, head_dim), draw(top, num_kv_heads, head_dim), draw(top, num_kv_heads,
                                                                                             head_dim)
            usable[kernel] = best_ms(lambda: kernel(q, k, v, scale))
        except Exception as exc:  # noqa: BLE001 - this variant is unavailable here: say why, try the next
            why[kernel.__name__] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
    if not usable:
        return _off("the dense kernel does not serve here: " + "; ".join(f"{name} {w}" for name, w in why.items()))
    kernel = min(usable, key=usable.get)
    times = {}  # 2. faster than FlashAttention-2, from which length (the longest's dense time is step 1's)
    try:
        q, k, v = draw(top, num_heads, head_dim), draw(top, num_kv_heads, head_dim), draw(top, num_kv_heads, head_dim)
        for n in CHECK_SIZES:
            cu = torch.tensor([0, n], dtype=torch.int32, device=device)
            dense_ms = usable[kernel] if n == top else best_ms(lambda: kernel(q[:n], k[:n], v[:n], scale))
            times[n] = (dense_ms, best_ms(lambda: varlen(q[:n], k[:n], v[:n], cu, cu, n, n, scale)))
    except Exception as exc:  # noqa: BLE001 - a length the kernels cannot run: keep FlashAttention-2
        return _off(f"the dense timing failed here: {type(exc).__name__}: {str(exc)[:200]}")
    timing = f"{kernel.__name__}; fresh chunks, dense / FlashAttention-2 ms: " + ", ".join(
        f"{n} rows {d:.3f} / {f:.3f}" for n, (d, f) in sorted(times.items())) + "".join(
        f"; {name} {w}" for name, w in why.items())
    rows = threshold(times)
    if rows is None:
        return _off(f"not faster here ({timing})")
    try:  # 3. every square from there to WARM_ROWS planned now, not on a request's step
        t0 = time.perf_counter()
        q = torch.randn(WARM_ROWS, num_heads, head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(WARM_ROWS, num_kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
        for side in range(SQUARE_ROWS * -(-rows // SQUARE_ROWS), WARM_ROWS + 1, SQUARE_ROWS):
            kernel(q[:side], k[:side], v[:side], scale)
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - a square the kernel cannot plan: keep FlashAttention-2
        return _off(f"the dense kernel failed planning its squares: {type(exc).__name__}: {str(exc)[:200]}")
    return DenseChoice(kernel, rows, f"{timing}; squares from {rows} to {WARM_ROWS} rows planned in "
                                     f"{time.perf_counter() - t0:.1f} s")


def _off(reason: str) -> DenseChoice:
    """No dense kernel, and why."""
    return DenseChoice(None, DENSE_MIN_ROWS, reason)


def _error(kernel: DenseKernel, draw: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor], nq: int,
           nk: int, heads: int, kv_heads: int, head_dim: int, scale: float, after: int = 0) -> float:
    """The largest difference of ``kernel`` from ``reference`` on one drawn chunk of ``nq`` rows over ``nk`` keys
    (``after``: drawn rows following the chunk's queries in memory, not part of it)."""
    q, k, v = draw(nq + after, heads, head_dim)[:nq], draw(nk, kv_heads, head_dim), draw(nk, kv_heads, head_dim)
    cu_q = torch.tensor([0, nq], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, nk], dtype=torch.int32, device=q.device)
    want = reference(q.float(), k.float(), v.float(), cu_q, cu_k, nq, nk, scale)
    return float((kernel(q, k, v, scale).float() - want).abs().max())


__all__ = ["CHECK_SIZES", "DENSE_MIN_ROWS", "DenseChoice", "MAX_PAD_WORK", "MIN_SPEEDUP", "SQUARE_ROWS", "WARM_ROWS",
           "check_dense", "dense_causal", "dense_causal_gqa", "dense_worthy", "prefill_runs", "rows_in_place",
           "threshold"]
