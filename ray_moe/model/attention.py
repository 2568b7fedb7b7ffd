# ======================================================================================================
#  ATTENTION OVER THE PAGED CACHE (one rank, one step; pure torch: no Ray)
#
#   transformers' attention module ──> cache.update: the step's new keys / values written at their slots (every
#   row, padding rows to the trash slot); it hands back the cache tensors themselves [1, H, C + 1, D] (or, for
#   a layer that transforms what it caches before attending (MLA's latent), the step's contexts gathered)
#   ──> the ``ray_moe`` attention function: the step's ``StepAttention`` decides what runs
#       InlineAttention: ``attend`` now, with the step's AttentionPlan (eager steps; whole-step graphs, whose plan
#                        holds the captured shapes)
#       a hole of a piecewise graph (``model/piecewise.py``): the capture ends here; at replay ``attend`` runs
#                        between the pieces with each step's own plan
#   attend (the plan names the real rows; padding rows after them come out zero):
#     MASKED:  the contexts gathered, SDPA with the block-diagonal mask [1, 1, n, K]  (the reference path:
#              CPU, fp32, any head size; work ~ step rows x ALL contexts)
#     VARLEN:  FlashAttention-2 variable-length forward through PyTorch (aten._flash_attention_forward) over the
#              gathered contexts: each sequence's queries attend its own keys (cu_q / cu_k), causal aligned at
#              the bottom right, grouped-query heads without repeating keys; the leading one-row sequences run
#              as a call of their own (their grid does not take the prefill chunks' query runs) and, with the
#              in-place decode kernel (model/paged_decode.py), read their slots in place (nothing gathered)
#     VARLEN with work tables (a whole-step graph of a token size): every row read in place by the paged varlen
#              kernel (model/paged_varlen.py), its grids fixed by the tables' static lengths
#     VARLEN with prefill runs (an eager step holding a long prompt chunk, where the host's dense kernel serves):
#              the prompt chunks run by run, each long chunk through the dense kernel (cuDNN's fused attention,
#              model/dense_prefill.py), the stretches between them through FlashAttention-2's varlen call
#   ──> [1, n, H, Dv] back into the module (its output projection)
# ======================================================================================================
"""Attention backends of the model host, registered with transformers' ``AttentionInterface``.

The host sets ``config._attn_implementation`` to ``ray_moe`` and passes each step's ``StepAttention`` as the
keyword ``ray_moe_attention`` of the model's forward; transformers hands its keyword arguments through every
decoder layer to the attention function, so the model's own modules run everything else (projections, rotary
embeddings, norms, MLA's low-rank projections). The name is not a mask implementation of transformers', so it
builds no mask: the plan carries what the backend needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from ray_moe.core.types import AttentionBackend
from ray_moe.model import mla
from ray_moe.model.paged_decode import DecodeKernel
from ray_moe.model.paged_varlen import PagedVarlenKernel

ATTENTION_NAME = "ray_moe"
ATTENTION_KW = "ray_moe_attention"

# (q [Nq, Hq, D], k [Nk, Hk, D], v [Nk, Hk, D], cu_q [S + 1] int32, cu_k [S + 1] int32, max_q, max_k, scale)
#   -> [Nq, Hq, D]; causal, aligned at the bottom right of each sequence (query i of Lq sees keys <= Lk - Lq + i)
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float],
                        torch.Tensor]
# (q [Nq, Hq, D], k [Nk, Hk, D], v [Nk, Hk, Dv], scale) -> [Nq, Hq, Dv]: one chunk, causal aligned at the bottom right
# (``dense_prefill.dense_causal``)
DenseKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """PyTorch's FlashAttention-2 variable-length forward (CUDA, fp16 / bf16, head size <= 256, Hq % Hk == 0).
    q [Nq, Hq, D], k / v [Nk, Hk, D] (last dimension contiguous) -> [Nq, Hq, D]. A query row whose sequence
    offers it no key (a padding row) comes out zero."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
    return out[0]


@dataclass(frozen=True)
class Kernels:
    """The host's attention kernels: ``varlen`` (FlashAttention's contract, or a caller's reference),
    ``decode`` (the in-place decode kernel, or None: one-row sequences attend gathered contexts too) and
    ``paged`` (the in-place varlen kernel of whole-step token graphs, or None: those steps run piecewise) and
    ``dense`` (long prompt chunks' dense kernel, ``dense_prefill.dense_causal``, or None: every chunk varlen)."""

    varlen: VarlenKernel = flash_varlen
    decode: DecodeKernel | None = None
    paged: PagedVarlenKernel | None = None
    dense: DenseKernel | None = None


EXPAND_KEYS = 8192  # gathered keys one expansion run holds (MLA: ~200 KB a key at DeepSeek-V3's 128 heads)


@dataclass(frozen=True)
class SequenceRun:
    """A run of consecutive sequences after a plan's one-row group (one of its ``rest_groups`` or
    ``prefill_runs``): sequences [seq_lo, seq_hi) (indices after the one-row group), their query rows [q_lo, q_hi)
    (from the rest's first row), their keys [k_lo, k_hi) in the plan's gathered keys, and the run's longest query
    run and context (host ints); ``dense``: one chunk through ``Kernels.dense`` (a prefill run)."""

    seq_lo: int
    seq_hi: int
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    max_q: int
    max_k: int
    dense: bool = False


def runs_at(cuts: list[int], lens: np.ndarray, ends: np.ndarray, k_base: int,
            dense: list[bool] | None = None) -> tuple[SequenceRun, ...]:
    """The runs between consecutive ``cuts`` (sequence indices, from 0 to S) of sequences with query lengths
    ``lens`` [S] and contexts ``ends`` [S] (host), keys counted from ``k_base``; ``dense[i]``: the run starting at
    sequence i is a dense one."""
    cq = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ck = np.concatenate([[0], np.cumsum(ends)]).astype(np.int64)
    return tuple(SequenceRun(a, b, int(cq[a]), int(cq[b]), k_base + int(ck[a]), k_base + int(ck[b]),
                             int(lens[a:b].max()), int(ends[a:b].max()), bool(dense and dense[a]))
                 for a, b in zip(cuts, cuts[1:]))


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """How one step's real rows attend the paged cache (all tensors on the cache's device).

    rows:        n, the real query rows (the step's first n rows; padding rows after them are not attended)
    backend:     MASKED or VARLEN
    gather:      [K] int64 cache slots of the contexts to gather (packed, sequence after sequence), or None
    mask:        MASKED: [1, 1, n, K] additive float (0 attend, dtype min elsewhere), or None: one sequence from
                 position 0 (SDPA's causal kernel over its own rows)
    cu_q, cu_k:  VARLEN: [S + 1] int32 query-row / key offsets; with ``slots`` and ``single_rows`` (a mixed step
                 whose one-row group reads in place) cu_k is [single_rows + 1] into ``slots`` then [S2 + 1] into
                 the gathered keys, each from 0
    max_q, max_k: the longest query run and context (host ints, upper bounds)
    single_rows: the leading one-row sequences attended in a call of their own (0: one call); with ``slots``
                 and no ``gather``, every row is one (a decode step read in place)
    slots:       [K1] int64 cache slots the one-row sequences read in place (the decode kernel), or None
    k_end:       [S] int32 (a decode step in place whose segments have room after them): sequence i's keys are
                 ``slots[cu_k[i]:k_end[i]]``; None: ``cu_k[i + 1]`` ends them
    cu_q_rest:   [S - single_rows + 1] int32 the query offsets of the sequences after the one-row group, from 0
                 (planned once, not per layer); None: ``cu_q[single_rows:] - single_rows``
    tables:      (one [NA], seq [NB], first [NB]) int32 work tables (``paged_varlen.work_tables``): every row is
                 read in place by the paged varlen kernel over ``slots`` / ``cu_q`` / ``cu_k`` (all S + 1
                 sequences' offsets); ``rows`` then counts every row of the step (the tables name the real ones)
    rest_groups: VARLEN, the sequences after the one-row group cut into runs whose gathered keys stay within
                 ``EXPAND_KEYS`` (host ints, ``SequenceRun``; a longer context is a run of its own): a module
                 that expands its contexts before attending (MLA's prompt rows) expands one run at a time, so a
                 step's transient memory is bounded by the run, not by every context of the step. None: one run
    prefill_runs: VARLEN, the sequences after the one-row group cut into runs around each long chunk
                 (``dense_prefill.prefill_runs``: host ints; the dense ones attend through ``Kernels.dense``).
                 None: one varlen call
    """

    rows: int
    backend: AttentionBackend
    gather: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 1
    max_k: int = 1
    single_rows: int = 0
    slots: torch.Tensor | None = None
    k_end: torch.Tensor | None = None
    cu_q_rest: torch.Tensor | None = None
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    rest_groups: tuple[SequenceRun, ...] | None = None
    prefill_runs: tuple[SequenceRun, ...] | None = None

    @property
    def in_place(self) -> bool:
        """Every row is a one-row sequence read in place (nothing gathered)."""
        return self.slots is not None and self.gather is None


def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           plan: AttentionPlan, scaling: float | None, kernels: Kernels, *, gathered: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The plan's real rows of one attention layer: query [1, Hq, R >= n, D]; key [1, Hk, C + 1, D] / value
    [1, Hk, C + 1, Dv], the cache tensors (``gathered``: the contexts the plan's ``gather`` names, [1, Hk, K, D],
    already gathered by the cache; an MLA module absorbed by ``mla.absorb_mla`` is handed its latent cache
    [1, 1, C + 1, R] and rotary keys [1, 1, C + 1, P], never gathered: ``mla.attend_step`` reads them) ->
    [1, n, Hq, Dv]. ``out``: [1, n, Hq, Dv] to write the rows into (a piecewise graph's static output): a step
    attended in parts (a one-row group, prefill runs) writes each part at its rows, with no concatenation; it
    is what comes back."""
    got = _attend(module, query, key, value, plan, scaling, kernels, gathered, out)
    if out is None or got is out:
        return got
    return out.copy_(got)


def _attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            plan: AttentionPlan, scaling: float | None, kernels: Kernels, gathered: bool,
            out: torch.Tensor | None) -> torch.Tensor:
    """``attend``'s rows: a new [1, n, Hq, Dv] tensor, or ``out`` itself where the parts were written into it."""
    n = plan.rows
    q = query[:, :, :n]
    d, dv = int(query.shape[-1]), int(value.shape[-1])
    scale = float(scaling) if scaling is not None else d ** -0.5
    ab = mla.absorbed_of(module)
    if ab is not None:  # MLA on its latent: key / value are the cache's latent [1, 1, C + 1, R] and rotary keys
        return mla.attend_step(ab, q[0].transpose(0, 1), key[0, 0], value[0, 0], plan, scale, kernels.varlen)[None]
    if plan.backend is AttentionBackend.MASKED:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        k, v = (key, value) if gathered or plan.gather is None else (
            key.index_select(2, plan.gather), value.index_select(2, plan.gather))
        out, _ = sdpa_attention_forward(module, q, k, v, plan.mask, scaling=scale)
        return out
    qs = q[0].transpose(0, 1)  # [n, Hq, D]
    kc, vc = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [C + 1 (or K), Hk, D]
    s1 = plan.single_rows
    if plan.tables is not None:  # every row in place, the work tables naming the real ones
        return kernels.paged(qs, kc, vc, plan.slots, plan.cu_q, plan.cu_k, *plan.tables, scale)[None]
    if plan.in_place:  # a decode step read in place
        return kernels.decode(qs, kc, vc, plan.slots, plan.cu_k, plan.max_k, scale, plan.k_end)[None]
    parts = []
    rest = plan.cu_q_rest if plan.cu_q_rest is not None else plan.cu_q[s1:] - s1
    if plan.slots is not None:  # 1. the one-row group in place, 2. the others over their gathered contexts
        parts.append(kernels.decode(qs[:s1], kc, vc, plan.slots, plan.cu_k[:s1 + 1], plan.max_k, scale))
        cu_q, cu_k, qs = rest, plan.cu_k[s1 + 1:], qs[s1:]
        s1 = 0
    else:
        cu_q, cu_k = plan.cu_q, plan.cu_k
    kg, vg = (kc, vc) if gathered else (kc.index_select(0, plan.gather), vc.index_select(0, plan.gather))
    if dv != d:  # FlashAttention takes one head size: MLA's narrower values are zero-padded, the output cut back
        vg = torch.nn.functional.pad(vg, (0, d - dv))
    if s1:  # the one-row sequences (one query each: the decode grid), then the others over the same keys
        parts.append(kernels.varlen(qs[:s1], kg, vg, cu_q[:s1 + 1], cu_k[:s1 + 1], 1, plan.max_k, scale))
        qs, cu_q, cu_k = qs[s1:], rest, cu_k[s1:]
    if plan.prefill_runs is not None and kernels.dense is not None:
        parts.extend(_attend_runs(qs, kg, vg, cu_q, cu_k, plan.prefill_runs, scale, kernels))
    else:
        parts.append(kernels.varlen(qs, kg, vg, cu_q, cu_k, plan.max_q, plan.max_k, scale))
    if len(parts) == 1:
        return parts[0][..., :dv][None]
    if out is None:
        return torch.cat(parts)[..., :dv][None]
    row = 0
    for part in parts:  # each part at its rows of the caller's output: no concatenated copy
        out[0, row:row + part.shape[0]].copy_(part[..., :dv])
        row += int(part.shape[0])
    return out


def _attend_runs(qs: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 runs: tuple[SequenceRun, ...], scale: float, kernels: Kernels) -> list[torch.Tensor]:
    """The prompt chunks run by run: qs [Nq, Hq, D] (the chunks' rows from the first), kg / vg [K, Hk, D] the
    gathered keys, cu_q [S + 1] (from 0) / cu_k [S + 1] (into kg) int32 -> one [rows, Hq, D] per run, in order.
    A dense run's chunk is contiguous in both (host offsets, no sync); a varlen run passes its slice of the
    offsets, its queries from 0 and its keys as they are."""
    out = []
    for r in runs:
        if r.dense:
            out.append(kernels.dense(qs[r.q_lo:r.q_hi], kg[r.k_lo:r.k_hi], vg[r.k_lo:r.k_hi], scale))
        else:
            out.append(kernels.varlen(qs[r.q_lo:r.q_hi], kg, vg, cu_q[r.seq_lo:r.seq_hi + 1] - r.q_lo,
                                      cu_k[r.seq_lo:r.seq_hi + 1], r.max_q, r.max_k, scale))
    return out


class StepAttention(Protocol):
    """What a step's attention layers call (the ``ray_moe_attention`` keyword): -> [1, R, Hq, Dv]."""

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float | None) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class InlineAttention:
    """``attend`` right away with ``plan`` (padding rows past ``plan.rows`` come out zero). ``gathered``: the
    cache hands back the plan's gathered contexts (a layer that transforms its cache before attending)."""

    plan: AttentionPlan
    kernels: Kernels
    gathered: bool = False

    def __call__(self, module, query, key, value, scaling):
        out = attend(module, query, key, value, self.plan, scaling, self.kernels, gathered=self.gathered)
        pad = int(query.shape[2]) - self.plan.rows
        return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, pad)) if pad else out


def step_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, Hq, R, D], key / value what the cache handed
    back -> ([1, R, Hq, Dv], None), by the step's ``StepAttention``."""
    call: StepAttention | None = kwargs.get(ATTENTION_KW)
    if call is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention ran without a step's attention (a forward outside a step)")
    if query.shape[0] != 1:
        raise ValueError(f"query: steps are one packed batch row, got {tuple(query.shape)}")
    return call(module, query, key, value, scaling), None


def register() -> None:
    """Make ``ray_moe`` an attention implementation transformers' modules can select."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, step_attention)


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


__all__ = ["AttentionBackend", "AttentionPlan", "EXPAND_KEYS", "SequenceRun", "InlineAttention", "Kernels",
           "StepAttention", "VarlenKernel", "DenseKernel", "attend", "runs_at", "flash_varlen", "step_attention", "register",
           "check_flash", "sequence_reference", "ATTENTION_NAME", "ATTENTION_KW"]
