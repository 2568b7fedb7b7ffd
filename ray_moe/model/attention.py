# ======================================================================================================
#  ATTENTION OVER THE PAGED CACHE (one rank, one step; pure torch: no Ray)
#
#   transformers' attention module ──> cache.update: new keys / values written at their slots, every
#   sequence's context gathered in packed order [1, H, K, D]
#     MASKED:  SDPA over the packed contexts with the block-diagonal mask [1, 1, N, K]   (the reference path:
#              CPU, fp32, any head size; work ~ step tokens x ALL contexts)
#     VARLEN:  FlashAttention-2 variable-length forward through PyTorch (aten._flash_attention_forward):
#              each sequence's queries attend its own keys only (cu_seq_q / cu_seq_k), causal aligned at the
#              bottom right, grouped-query attention without repeating keys; no mask is built (work ~ per
#              sequence); capturable in a CUDA graph (the lengths live in device tensors, the maxima are
#              the captured shape's); a mixed step's one-row (decode) sequences come first and run as a call
#              of their own, so the prefill chunks' long query runs do not size the grid of every decode row
#     PAGED DECODE (VARLEN, a step of one-row sequences only): nothing gathered; cache.update hands back the
#              cache tensors and the in-place decode kernel (model/paged_decode.py) reads each sequence's
#              slots [1, H, C + 1, D]; a captured mixed step's one-row group too (its other sequences' contexts
#              are gathered out of the cache tensors for FlashAttention)
#   ──> [1, N, H, Dv] back into the module (its output projection)
# ======================================================================================================
"""Attention backends of the model host, registered with transformers' ``AttentionInterface``.

The host sets ``config._attn_implementation`` to ``ray_moe_varlen`` for the VARLEN backend and passes each
step's ``VarlenPlan`` as the keyword ``ray_moe_varlen`` of the model's forward; transformers hands its keyword
arguments through every decoder layer to the attention function, so the model's own modules run everything
else (projections, rotary embeddings, norms, MLA's low-rank projections). The implementation name is not a
mask implementation of transformers', so it builds no mask for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ray_moe.core.types import AttentionBackend
from ray_moe.model.paged_decode import DecodeKernel

VARLEN_NAME = "ray_moe_varlen"

# (q [Nq, Hq, D], k [Nk, Hk, D], v [Nk, Hk, D], cu_q [S + 1] int32, cu_k [S + 1] int32, max_q, max_k, scale)
#   -> [Nq, Hq, D]; causal, aligned at the bottom right of each sequence (query i of Lq sees keys <= Lk - Lq + i)
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float],
                        torch.Tensor]


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """PyTorch's FlashAttention-2 variable-length forward (CUDA, fp16 / bf16, head size <= 256, Hq % Hk == 0).
    q [Nq, Hq, D], k / v [Nk, Hk, D] (last dimension contiguous) -> [Nq, Hq, D]. A query row whose sequence
    offers it no key (a padding row) comes out zero."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
    return out[0]


@dataclass(frozen=True, eq=False)
class VarlenPlan:
    """The per-sequence geometry of one step for the VARLEN backend.

    cu_q: [S + 1] int32 query row offsets of each sequence in the packed step (device)
    cu_k: [S + 1] int32 key offsets of each sequence in the packed gathered context (device)
    max_q, max_k: the longest query run and context (host ints; upper bounds are fine)
    kernel: the varlen kernel (``flash_varlen`` on the device; tests pass a per-sequence reference)
    single_rows: the first ``single_rows`` query rows are as many one-row sequences (the first ``single_rows``
        entries of the offsets): they run as one decode-shaped call (one query per sequence) and the other
        sequences as a second call; 0: one call for all
    slots: [K] int64 (a paged decode step: every row one sequence, the keys / values handed in are the whole
        cache and sequence i's context is at ``slots[cu_k[i]:cu_k[i + 1]]``), read in place by
        ``decode_kernel``; None: the keys are the packed gathered contexts
    gather: [K2] int64 (with ``slots`` and ``single_rows``: a mixed step whose one-row group reads the cache in
        place): the cache rows of the other sequences' contexts, gathered for ``kernel``; their key offsets are
        ``cu_k[single_rows + 1:]`` (from 0), the one-row group's ``cu_k[:single_rows + 1]`` into ``slots``
    slots_max_k: the longest context the one-row group's slots hold (an upper bound; 0: ``max_k``)
    k_end: [S] int32 (a paged decode step, ``slots`` without ``single_rows``): sequence i's keys are
        ``slots[cu_k[i]:k_end[i]]`` (segments with room after them); None: ``cu_k[i + 1]`` ends them
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    kernel: VarlenKernel = flash_varlen
    single_rows: int = 0
    slots: torch.Tensor | None = None
    decode_kernel: DecodeKernel | None = None
    gather: torch.Tensor | None = None
    slots_max_k: int = 0
    k_end: torch.Tensor | None = None


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, Hq, N, D], key [1, Hk, K, D], value
    [1, Hk, K, Dv] (the packed contexts ``cache.update`` returned) -> ([1, N, Hq, Dv], None). A value head
    narrower than the query's (DeepSeek's MLA) is zero-padded for the kernel and the output cut back."""
    plan: VarlenPlan | None = kwargs.get(VARLEN_NAME)
    if plan is None:
        raise RuntimeError(f"{VARLEN_NAME} attention ran without a VarlenPlan (a forward outside a planned step)")
    if query.shape[0] != 1:
        raise ValueError(f"query: the varlen backend takes one packed batch row, got {tuple(query.shape)}")
    d, dv = int(query.shape[-1]), int(value.shape[-1])
    q = query[0].transpose(0, 1)  # [N, Hq, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = float(scaling) if scaling is not None else d ** -0.5
    if plan.slots is not None and not plan.single_rows:  # a decode step over the cache itself ([C + 1, H, D]
        if plan.k_end is not None:  # rows), segments with room after them
            return plan.decode_kernel(q, k, v, plan.slots, plan.cu_k, plan.max_k, scale, plan.k_end)[None], None
        return plan.decode_kernel(q, k, v, plan.slots, plan.cu_k, plan.max_k, scale)[None], None
    if plan.slots is not None:  # a mixed step over the cache itself
        # 1. the one-row group: one query per sequence, its keys read in place
        # 2. the other sequences over their own contexts, gathered out of the cache (keys from offset 0)
        s1 = plan.single_rows
        first = plan.decode_kernel(q[:s1], k, v, plan.slots, plan.cu_k[: s1 + 1], plan.slots_max_k or plan.max_k,
                                   scale)
        kg, vg = k.index_select(0, plan.gather), v.index_select(0, plan.gather)
        if dv != d:
            vg = torch.nn.functional.pad(vg, (0, d - dv))
        rest = plan.kernel(q[s1:], kg, vg, plan.cu_q[s1:] - s1, plan.cu_k[s1 + 1:], plan.max_q, plan.max_k, scale)
        return torch.cat([first, rest[..., :dv]])[None], None
    if dv != d:
        v = torch.nn.functional.pad(v, (0, d - dv))
    s1 = plan.single_rows
    if s1:
        # 1. the one-row sequences: one query each (the kernel's decode shape: a grid of one query block per
        #    sequence instead of max_q / block rows for every sequence)
        # 2. the others over the same packed keys (absolute key offsets), query offsets shifted to their rows
        out = torch.cat([plan.kernel(q[:s1], k, v, plan.cu_q[: s1 + 1], plan.cu_k[: s1 + 1], 1, plan.max_k, scale),
                         plan.kernel(q[s1:], k, v, plan.cu_q[s1:] - s1, plan.cu_k[s1:], plan.max_q, plan.max_k,
                                     scale)])
    else:
        out = plan.kernel(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale)
    if dv != d:
        out = out[..., :dv]
    return out[None], None


def register() -> None:
    """Make ``ray_moe_varlen`` an attention implementation transformers' modules can select."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_NAME, varlen_attention)


def check_flash(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                value_dim: int | None = None) -> str | None:
    """Why the VARLEN backend cannot serve this model here (None: it can). Runs the kernel once on a small
    ragged batch (two sequences, a chunk continuing a context and a fresh one) and compares it with SDPA per
    sequence: the kernel is used only where it reproduces the reference on this device and dtype."""
    if device.type != "cuda":
        return f"device {device.type}: FlashAttention needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype}: FlashAttention takes float16 / bfloat16 (the masked path keeps {dtype})"
    if head_dim > 256 or head_dim % 8 or num_heads % num_kv_heads:
        return f"head_dim={head_dim}, heads {num_heads}/{num_kv_heads}: outside FlashAttention-2's shapes"
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        lq, lk = [3, 5], [7, 5]
        q = torch.randn(sum(lq), num_heads, head_dim, generator=g).to(device, dtype)
        k = torch.randn(sum(lk), num_kv_heads, head_dim, generator=g).to(device, dtype)
        v = torch.randn(sum(lk), num_kv_heads, head_dim, generator=g).to(device, dtype)
        cu_q = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 7, 12], dtype=torch.int32, device=device)
        got = flash_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), head_dim ** -0.5).float()
        want = sequence_reference(q.float(), k.float(), v.float(), cu_q, cu_k, max(lq), max(lk), head_dim ** -0.5)
        err = float((got - want).abs().max())
    except Exception as exc:  # noqa: BLE001 - the kernel is unavailable here: say why, keep the masked path
        return f"FlashAttention varlen failed here: {type(exc).__name__}: {str(exc)[:200]}"
    if not err < 0.05:
        return f"FlashAttention varlen differs from SDPA by {err:.3g} here"
    return None


def sequence_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                       max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """The varlen contract one sequence at a time with SDPA (a VarlenKernel; the kernel check's reference):
    causal aligned at the bottom right, grouped-query heads repeated, rows with no key zero."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    rep = q.shape[1] // k.shape[1]
    for i in range(len(bq) - 1):
        nq, nk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        if nq == 0 or nk == 0:
            continue
        qi = q[bq[i]:bq[i + 1]].transpose(0, 1)
        ki = k[bk[i]:bk[i + 1]].repeat_interleave(rep, 1).transpose(0, 1)
        vi = v[bk[i]:bk[i + 1]].repeat_interleave(rep, 1).transpose(0, 1)
        allowed = torch.arange(nk, device=q.device)[None, :] <= (nk - nq + torch.arange(nq, device=q.device))[:, None]
        scores = (qi @ ki.transpose(1, 2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, -1).nan_to_num(0.0)  # a row with no allowed key: zero, as the kernel gives
        out[bq[i]:bq[i + 1]] = (p @ vi).transpose(0, 1)
    return out


__all__ = ["AttentionBackend", "VarlenPlan", "VarlenKernel", "flash_varlen", "varlen_attention", "register",
           "check_flash", "sequence_reference", "VARLEN_NAME"]
