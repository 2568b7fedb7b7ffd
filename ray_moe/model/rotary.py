"""Fused rotary position embedding for a transformers model's attention, through its modeling module's
``apply_rotary_pos_emb`` (the function transformers' kernels hub replaces: ``@use_kernel_forward_from_hub
("rotary_pos_emb")`` / ``@use_kernelized_func(apply_rotary_pos_emb)``).

transformers applies rotary as ``q * cos + rotate_half(q) * sin`` (and the same for k): a slice-and-cat for
rotate_half, a negation, four multiplies and two adds over the query and key tensors, about a dozen passes
over them. In a 4096-token prefill of a Qwen3-30B-A3B-shaped layer (norms already fused) that took about
0.26 ms of the layer's 1.9 ms of device time on an H200; fused, an 8-layer step went from 15.05 to 13.0 ms
(the query tensor alone: 283 us in torch's kernels, 46 us in this one; bench/results/logs/h200-s6-run6.log).
One Triton launch rotates both tensors (the query's head blocks and the key's side by side in its grid: one launch
a layer where there were two, ~2.6 us each at decode sizes on an H100, bench/results/serving-h100x1-0114027's kernel
mix of long). It reads each head row once and writes it once, with the same roundings (compiled without FMA
contraction, which would skip the rounding of the products: measured 23% of bf16 elements one unit off with it), so
the result is bit-identical in bf16 / fp16:

  for each (batch, position, head) row x = [x1 | x2] (two halves of the head dim), c, s = cos, sin at the position
    1. y1 = round(round(x1 * c1) + round(-x2 * s1))
    2. y2 = round(round(x2 * c2) + round(x1 * s2))          (round: to the input dtype; products in FP32)

``fuse_rotary(model)`` replaces ``apply_rotary_pos_emb`` in the modeling module of every attention class of
``model`` (process-wide: every model of that module in this process takes it), after checking, on the model's
device and dtype, that the kernel reproduces the module's own function (a module with another formula keeps
its own); the replacement takes the kernel for CUDA tensors it can take (head dim contiguous and even, cos /
sin of the inputs' dtype broadcast over heads at ``unsqueeze_dim=1``) and calls the original otherwise.
``unfuse_rotary`` puts the originals back.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ray_moe.core.env import triton_interpreted

FUNCTION = "apply_rotary_pos_emb"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _rope_heads(x_ptr, y_ptr, cos_ptr, sin_ptr, b, t, heads, H, HALF, sxb, sxh, sxt, syb, syh, syt, cs,
                    BLOCK_D: tl.constexpr):
        """Rows (b, t, heads) of one tensor: steps 1-2 of the module docstring."""
        d = tl.arange(0, BLOCK_D)
        dm = d < HALF
        m = (heads < H)[:, None] & dm[None, :]
        c1 = tl.load(cos_ptr + cs + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + cs + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + cs + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + cs + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        xo = b * sxb + t * sxt + heads[:, None] * sxh + d[None, :]
        x1 = tl.load(x_ptr + xo, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xo + HALF, mask=m, other=0.0).to(tl.float32)
        ty = y_ptr.dtype.element_ty
        y1 = ((x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)).to(ty)
        y2 = ((x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)).to(ty)
        yo = b * syb + t * syt + heads[:, None] * syh + d[None, :]
        tl.store(y_ptr + yo, y1, mask=m)
        tl.store(y_ptr + yo + HALF, y2, mask=m)

    globals().update(_rope_heads=_rope_heads)  # (a called jit function: a module global)

    @triton.jit
    def _rope(q_ptr, k_ptr, cos_ptr, sin_ptr, qy_ptr, ky_ptr, HQ, HK, QB, T, HALF,
              sqb, sqh, sqt, syqb, syqh, syqt, skb, skh, skt, sykb, sykh, sykt, scb, sct,
              BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
        # axis 0: (batch, position); axis 1: the query's QB head blocks, then the key's
        bt = tl.program_id(0)
        b = (bt // T).to(tl.int64)
        t = (bt % T).to(tl.int64)
        hb = tl.program_id(1)
        cs = b * scb + t * sct
        if hb < QB:
            heads = (hb * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)).to(tl.int64)
            _rope_heads(q_ptr, qy_ptr, cos_ptr, sin_ptr, b, t, heads, HQ, HALF, sqb, sqh, sqt, syqb, syqh, syqt, cs,
                        BLOCK_D)
        else:
            heads = ((hb - QB) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)).to(tl.int64)
            _rope_heads(k_ptr, ky_ptr, cos_ptr, sin_ptr, b, t, heads, HK, HALF, skb, skh, skt, sykb, sykh, sykt, cs,
                        BLOCK_D)

    return _rope


def available(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> bool:
    """Whether the kernel takes these operands: CUDA (any device under Triton's interpreter), q / k [B, H, T, D]
    with a contiguous even head dim, cos / sin [B or 1, T, D] of the same dtype (broadcast over heads:
    ``unsqueeze_dim=1``), Triton importable."""
    if unsqueeze_dim != 1 or not (q.is_cuda or triton_interpreted()) or q.dtype not in _DTYPES or _kernel() is None:
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    b, _, t, d = q.shape
    if d % 2 or k.shape[0] != b or k.shape[2:] != (t, d) or cos.shape[1:] != (t, d) or cos.shape[0] not in (1, b):
        return False
    return (all(x.dtype == q.dtype and x.device == q.device and x.stride(-1) == 1 for x in (k, cos, sin))
            and q.stride(-1) == 1 and cos.stride() == sin.stride())


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, T, D], k: [B, Hk, T, D], cos / sin: [B or 1, T, D] (all of one dtype, CUDA; any device under
    Triton's interpreter) -> (q, k) rotated, new tensors keeping q's / k's layout where it is dense (a [B, T, H, D]
    buffer viewed [B, H, T, D]). One launch for both: programs (batch x position, query head blocks + key head
    blocks)."""
    if not available(q, k, cos, sin):
        raise ValueError(f"q: {tuple(q.shape)} {q.dtype} on {q.device}, k: {tuple(k.shape)}, cos: {tuple(cos.shape)} "
                         f"{cos.dtype}: the fused rotary takes CUDA [B, H, T, D] tensors with cos / sin [B, T, D] "
                         f"of their dtype")
    qy, ky = torch.empty_like(q), torch.empty_like(k)
    b, hq, t, d = q.shape
    hk = int(k.shape[1])
    if q.numel() or k.numel():
        half = d // 2
        block_d = 1 << max(0, half - 1).bit_length()
        block_h = min(1 << max(0, max(hq, hk) - 1).bit_length(), max(1, 4096 // block_d))
        qb, kb = -(-hq // block_h), -(-hk // block_h)
        scb = cos.stride(0) if cos.shape[0] > 1 else 0
        _kernel()[(b * t, qb + kb)](q, k, cos, sin, qy, ky, hq, hk, qb, t, half, *q.stride()[:3], *qy.stride()[:3],
                                    *k.stride()[:3], *ky.stride()[:3], scb, cos.stride(1), BLOCK_HEADS=block_h,
                                    BLOCK_D=block_d, num_warps=4,
                                    enable_fp_fusion=False)  # no FMA: torch rounds each product
    return qy, ky


def _replacement(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if available(q, k, cos, sin, unsqueeze_dim):
            return rope(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.ray_moe_fused = True
    return apply_rotary_pos_emb


def _matches(original: Callable, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the kernel reproduces ``original`` (bit for bit in bf16 / fp16) on random operands."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    q = rand(2, 7, 3, 32).transpose(1, 2)  # [B, H, T, D] views of [B, T, H, D] buffers, as the models make them
    k = rand(2, 7, 2, 32).transpose(1, 2)
    ang = rand(2, 7, 16).float()
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    if not available(q, k, cos, sin):
        return f"{dtype} on {device}: not taken by the kernel"
    try:
        with torch.no_grad():
            want = original(q, k, cos, sin)
    except Exception as exc:  # noqa: BLE001 - another signature: keep the module's own
        return f"another signature: {type(exc).__name__}: {exc}"
    try:
        got = rope(q, k, cos, sin)
    except Exception as exc:  # noqa: BLE001 - the kernel does not compile or run here: keep the module's own
        return f"the kernel failed here: {type(exc).__name__}: {str(exc)[:200]}"
    tol = dict(rtol=0.0, atol=0.0) if dtype != torch.float32 else dict(rtol=1e-6, atol=1e-6)
    try:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol)
    except (AssertionError, TypeError, ValueError) as exc:
        return "another formula: " + str(exc).splitlines()[0]
    return None


@dataclass(frozen=True)
class FusedRotary:
    """What ``fuse_rotary`` did: ``modules``: the modeling modules whose ``apply_rotary_pos_emb`` now takes the
    kernel; ``skipped``: module name -> why it keeps its own."""

    modules: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)


def _modeling_modules(model: torch.nn.Module) -> dict[str, Any]:
    """{module name: module} of every attention class of ``model`` whose module defines the rotary function."""
    out = {}
    for m in model.modules():
        name = type(m).__module__
        mod = sys.modules.get(name)
        if (name not in out and mod is not None and "Attention" in type(m).__name__
                and callable(getattr(mod, FUNCTION, None))):
            out[name] = mod
    return out


def fuse_rotary(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> FusedRotary:
    """Replace ``apply_rotary_pos_emb`` of ``model``'s attention modules' modeling modules (process-wide)."""
    fused, skipped = [], {}
    for name, mod in _modeling_modules(model).items():
        fn = getattr(mod, FUNCTION)
        if getattr(fn, "ray_moe_fused", False):
            fused.append(name)
            continue
        why = _matches(fn, device, dtype)
        if why is None:
            setattr(mod, FUNCTION, _replacement(fn))
            fused.append(name)
        else:
            skipped[name] = why
    return FusedRotary(tuple(fused), skipped)


def unfuse_rotary(model: torch.nn.Module) -> int:
    """Put back the original ``apply_rotary_pos_emb`` of ``model``'s modeling modules; returns how many."""
    n = 0
    for mod in _modeling_modules(model).values():
        fn = getattr(mod, FUNCTION)
        if getattr(fn, "ray_moe_fused", False):
            setattr(mod, FUNCTION, fn.__wrapped__)
            n += 1
    return n


__all__ = ["FusedRotary", "available", "fuse_rotary", "rope", "unfuse_rotary"]
