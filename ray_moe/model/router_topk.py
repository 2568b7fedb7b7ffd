# ======================================================================================================
#  FUSED SOFTMAX TOP-K FOR A TRANSFORMERS MODEL'S OWN ROUTERS (one rank; pure torch + Triton: no Ray)
#
#   hidden [T, d] ── the router's own F.linear ──> logits [T, E] (the model's dtype, as transformers computes)
#     ──> one Triton launch, one warp per token row:
#           1. p = softmax(logits) in FP32 (exp(x - max) / sum)
#           2. K times: the largest p (ties: the lowest expert id), recorded, then masked out
#           3. norm_topk_prob routers: the K values divided by their sum
#     ──> (logits [T, E], scores [T, K] (the dtype the router's own forward returns), ids [T, K] int64)
# ======================================================================================================
"""The softmax top-k routers of Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE, fused after their gate GEMM.

transformers' ``*TopKRouter.forward`` runs softmax, ``torch.topk`` (a radix select and a bitonic sort), the
renormalising sum and divide and a cast as separate kernels: about 18 us of every MoE layer at a 256-token
decode step on an H200 (bench/results/logs/step_profile-h200x1-48l-decode-heavy-6210425.json: gatherTopK 8.6,
bitonicSort 4.4, softmax 1.9, sum / divide / cast ~3.5), 0.85 ms of a ~22 ms 48-layer token step. One kernel
does all of it after the router's own GEMM, which stays the module's ``F.linear`` (its logits are bitwise
what the model returns).

``fuse_routers(model)`` gives every router module an instance ``forward`` that takes the kernel for CUDA
inputs of the weight's dtype, and the module's own forward otherwise. A class is recognised by running the
class's own forward on random rows once per class on the model's device and finding the kernel variant
(renormalised or not, the scores' dtype) that reproduces it: values to two units in the last place, ids equal
except between experts of equal probability (``torch.topk`` orders ties arbitrarily; the kernel takes the
lowest id). A router of another formula (DeepSeek-V3's sigmoid, grouped top-k and correction bias) fails the
check and keeps its forward. ``softmax_topk_reference`` is the contract in torch (any device; tests compare
the kernel with it on CUDA). ``unfuse_routers`` restores every replaced forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from ray_moe.model.swap import Fused, fuse_by_class, restore_forwards

_ORIGINAL_ATTR = "_ray_moe_unfused_router_forward"
# 2 ulps of the scores' dtype (relative): the kernel's exp and sums round apart from torch's by an ulp of FP32,
# which a cast to bf16 / fp16 can turn into one unit of the narrow type
_RTOL = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 1e-5}
_MAX_EXPERTS = 1024  # one warp holds a row; wider routers keep their own forward
_ROWS_PER_PROGRAM = 4  # one row per warp


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _softmax_topk(x_ptr, w_ptr, ids_ptr, T, E, stride_t, K: tl.constexpr, RENORM: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        rmask = rows < T
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :],
                    mask=rmask[:, None] & (cols[None, :] < E), other=float("-inf")).to(tl.float32)
        # 1. softmax in FP32 (rows past T: all -inf, kept finite and never stored)
        m = tl.where(rmask, tl.max(x, 1), 0.0)
        e = tl.exp(x - m[:, None])
        p = e / tl.where(rmask, tl.sum(e, 1), 1.0)[:, None]
        p = tl.where(cols[None, :] < E, p, -1.0)
        # 2. K rounds of the largest remaining probability (argmax: the lowest id among equals)
        ks = tl.arange(0, BLOCK_K)
        vals = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        idx = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
        for j in tl.static_range(K):
            i = tl.argmax(p, 1)
            v = tl.max(p, 1)
            vals = tl.where(ks[None, :] == j, v[:, None], vals)
            idx = tl.where(ks[None, :] == j, i[:, None], idx)
            p = tl.where(cols[None, :] == i[:, None], -1.0, p)
        # 3. renormalised over the K chosen (the padding lanes hold 0)
        if RENORM:
            vals = vals / tl.sum(vals, 1)[:, None]
        out = rows[:, None].to(tl.int64) * K + ks[None, :]
        omask = rmask[:, None] & (ks[None, :] < K)
        tl.store(w_ptr + out, vals.to(w_ptr.dtype.element_ty), mask=omask)
        tl.store(ids_ptr + out, idx.to(tl.int64), mask=omask)

    return _softmax_topk


def available(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether a router of ``weight`` [E, d] takes the kernel for rows ``x`` [T, d]: CUDA, rows of the
    weight's dtype (a floating one), 1 <= top_k <= E <= ``_MAX_EXPERTS``, Triton importable."""
    return (x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype and weight.dtype in _RTOL
            and x.shape[1] == weight.shape[1] and 1 <= int(top_k) <= int(weight.shape[0]) <= _MAX_EXPERTS
            and _kernel() is not None)


def softmax_topk(logits: torch.Tensor, top_k: int, renorm: bool, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (CUDA) -> (scores [T, top_k] ``out_dtype``, ids [T, top_k] int64), scores descending."""
    if not (logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and logits.dtype in _RTOL
            and 1 <= int(top_k) <= int(logits.shape[1]) <= _MAX_EXPERTS and _kernel() is not None):
        raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype} on {logits.device}, top_k={top_k}: the "
                         "fused softmax top-k takes CUDA rows with a contiguous last dim, top_k <= experts <= "
                         f"{_MAX_EXPERTS}")
    t, e = int(logits.shape[0]), int(logits.shape[1])
    k = int(top_k)
    scores = torch.empty(t, k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t:
        _kernel()[(-(-t // _ROWS_PER_PROGRAM),)](
            logits, scores, ids, t, e, logits.stride(0), K=k, RENORM=bool(renorm), BLOCK_T=_ROWS_PER_PROGRAM,
            BLOCK_E=max(32, 1 << (e - 1).bit_length()), BLOCK_K=max(2, 1 << (k - 1).bit_length()),
            num_warps=_ROWS_PER_PROGRAM)
    return scores, ids


def softmax_topk_reference(logits: torch.Tensor, top_k: int, renorm: bool, out_dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract in torch (any device): FP32 softmax, the ``top_k`` largest (ties: the lowest id first),
    optionally divided by their sum, cast to ``out_dtype``."""
    p = torch.softmax(logits.float(), dim=-1)
    # a stable descending order by probability puts equal probabilities in id order
    order = torch.sort(p, dim=-1, descending=True, stable=True)
    vals, ids = order.values[..., :top_k], order.indices[..., :top_k]
    if renorm:
        vals = vals / vals.sum(dim=-1, keepdim=True)
    return vals.to(out_dtype), ids


def _candidate(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module).__name__.endswith("Router") and isinstance(w, torch.nn.Parameter) and w.dim() == 2
            and isinstance(getattr(module, "top_k", None), int) and getattr(module, "bias", None) is None
            and getattr(module, "hidden_dim", w.shape[1]) == w.shape[1])


def _agrees(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
            logits: torch.Tensor) -> str | None:
    """None when the kernel's (scores, ids) reproduce the router's: values to two ulps, ids equal except
    between equally probable experts."""
    (gs, gi), (ws, wi) = got, want
    if gs.dtype != ws.dtype or gs.shape != ws.shape or wi.shape != gi.shape:
        return f"its forward returns {ws.dtype} {tuple(ws.shape)}, the kernel {gs.dtype} {tuple(gs.shape)}"
    try:
        torch.testing.assert_close(gs, ws, rtol=_RTOL[ws.dtype], atol=1e-6)
    except AssertionError as exc:
        return "another formula: " + str(exc).splitlines()[0]
    p = torch.softmax(logits.float(), dim=-1)
    differ = gi != wi.to(gi.dtype)
    if bool(differ.any()) and not torch.equal(p.gather(1, gi)[differ], p.gather(1, wi.to(gi.dtype))[differ]):
        return "other experts chosen (not a softmax top-k)"
    return None


def _matches(module: torch.nn.Module) -> tuple[bool, str | None]:
    """(renorm, None) when the kernel reproduces ``module``'s own forward on random rows, else (_, why)."""
    w = module.weight
    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(61, w.shape[1], generator=g, device=w.device, dtype=torch.float32).to(w.dtype)
    with torch.no_grad():
        try:
            out = module.forward(x)
        except Exception as exc:  # noqa: BLE001 - a forward of another shape: not this kernel's router
            return False, f"its forward failed on [61, {w.shape[1]}] rows: {type(exc).__name__}"
        if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(o, torch.Tensor) for o in out)):
            return False, "its forward does not return (logits, scores, ids)"
        logits, scores, ids = out
        if not available(x, w, int(module.top_k)):
            return False, f"weight {w.dtype} {tuple(w.shape)} on {w.device}: not taken by the kernel"
        if not torch.equal(logits, F.linear(x, w)):
            return False, "its logits are not its weight's linear map"
        why = None
        for renorm in (True, False):
            why = _agrees(softmax_topk(logits, int(module.top_k), renorm, scores.dtype), (scores, ids), logits)
            if why is None:
                return renorm, None
    return False, why


def _fused_forward(module: torch.nn.Module, original: Any, renorm: bool, out_dtype: torch.dtype):
    k = int(module.top_k)

    def forward(hidden_states: torch.Tensor) -> Any:
        w = module.weight
        x = hidden_states.reshape(-1, w.shape[1])
        if available(x, w, k):
            logits = F.linear(x, w)
            scores, ids = softmax_topk(logits, k, renorm, out_dtype)
            return logits, scores, ids
        return original(hidden_states)

    return forward


class FusedRouters(Fused):
    """What ``fuse_routers`` did: ``modules`` routers now take the kernel, of the classes ``classes``;
    ``skipped``: class name -> why its routers keep their own forward."""


def _verdict(module: torch.nn.Module) -> tuple[str | None, tuple[bool, torch.dtype] | None]:
    """(None, (renorm, the scores' dtype of the class's own forward)) when the kernel reproduces it."""
    renorm, why = _matches(module)
    if why is not None:
        return why, None
    with torch.no_grad():  # (one row)
        out = module.forward(torch.zeros(1, module.weight.shape[1], dtype=module.weight.dtype,
                                         device=module.weight.device))
    return None, (renorm, out[1].dtype)


def fuse_routers(model: torch.nn.Module) -> FusedRouters:
    """Replace the forward of every softmax top-k router of ``model`` (on CUDA) by its GEMM and the kernel."""
    return fuse_by_class(model, _ORIGINAL_ATTR, FusedRouters, _candidate, _verdict,
                         lambda m, original, info: _fused_forward(m, original, *info))


def unfuse_routers(model: torch.nn.Module) -> int:
    """Give every fused router its own forward back; returns how many."""
    return restore_forwards(model, _ORIGINAL_ATTR)


__all__ = ["FusedRouters", "available", "fuse_routers", "softmax_topk", "softmax_topk_reference",
           "unfuse_routers"]
