# ======================================================================================================
#  FP8 SLOTS AT THE RUNNER BOUNDARY (pure torch + Triton: no Ray)
#
#   moe.layer.run_experts ──> Fp8Runner(inner) for slot weights holding e4m3 codes + block scales:
#       fast path (CUDA, Triton, block K 32 / 64 / 128, ``check_fp8_kernel`` passed on this device once):
#           every entry (counts, device offsets, capacity, indexed rows) ──> runners/fp8_kernels.py
#           (activations quantized per 1 x b1 group, FP8 GEMMs on the codes, block scales in FP32)
#       reference / fallback: the weights the call reads dequantized (codes x block scale, float32, then the
#           activation dtype: a temporary) ──> the same entry of ``inner`` on plain slot weights
# ======================================================================================================
"""The expert-runner entry of FP8 slot weights (block-scaled e4m3 codes, ``moe.experts.fp8``).

Why a runner wrapper (``Fp8Runner``) rather than FP8 branches in every runner: the slot buffers hold each
expert once, as codes plus scales (``SlotWeights.scales``); at the runner boundary (``moe.layer.run_experts``)
the wrapper takes every entry of the runner contract.

The fast path (``fast_path_reason`` None): the block-FP8 Triton kernels (``runners/fp8_kernels.py``) compute
the experts on the codes with the checkpoint's ``activation_scheme: dynamic`` (activations quantized per
token group of b1 = 128 columns, e4m3 with a float32 scale; the intermediate likewise), as vLLM / SGLang
serve these checkpoints: half the weight bytes of bf16 read per step, no dequantized copy, no host sync
(CUDA-graph capturable). It is taken on CUDA when Triton imports, the block is one the kernels take, and the
kernels reproduced ``fp8_swiglu_reference`` on this device at the layer's shape (``check_fp8_kernel``, once
per device / dtype / shape / block, at the first eager call: the warm-up of a step shape, before any capture).

The reference and fallback: the wrapper dequantizes the weight operands of exactly the call it serves into
the activation dtype and hands ``inner`` ordinary ``SlotWeights``: every runner and dispatch format then
computes on the same values as the dequantized model (float32(code) x block scale, exact in float32), with no
copy kept. On CPU (and wherever the fast path is unavailable, the reason in ``fast_path_reason``) this is the
path; it is correct and slow on a GPU (every call dequantizes all the slots it is handed).
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import accumulate
from typing import Sequence

import torch

from ray_moe.moe.experts.fp8 import dequantize, quantize, round_trip_groups
from ray_moe.moe.experts.runners import fp8_kernels
from ray_moe.moe.experts.runners.base import ExpertRunner, RunnerLedger
from ray_moe.moe.experts.runners.grouped import as_counts, device_tensor
from ray_moe.moe.experts.weights import SlotWeights

CHECK_TOLERANCE = 3e-2  # the start check: max |kernel - reference| / max |reference| below this
_REASONS: dict[tuple, str | None] = {}  # (device, dtype, d, f, block) -> why the fast path is off (None: on)


def dense_slots(weights: SlotWeights, dtype: torch.dtype) -> SlotWeights:
    """The same slot weights (slot ids, experts, rows, digests) with w_gate / w_up / w_down dequantized into
    ``dtype`` (stacks [N, f, d] / [N, d, f] like the codes; a temporary: nothing is cached) and no scales."""
    if weights.scales is None or weights.block is None:
        raise ValueError(f"weights: layer {weights.layer} slot weights hold no FP8 scales")
    sg, su, sd = weights.scales
    b = weights.block
    return replace(weights, w_gate=dequantize(weights.w_gate, sg, b, dtype), w_up=dequantize(weights.w_up, su, b, dtype),
                   w_down=dequantize(weights.w_down, sd, b, dtype), scales=None, block=None, cache={})


def fp8_swiglu_reference(x: torch.Tensor, counts: Sequence[int], codes: Sequence[torch.Tensor],
                         scales: Sequence[torch.Tensor], block: Sequence[int],
                         rows: Sequence[int] | None = None) -> torch.Tensor:
    """The FP8 kernels' contract in torch (float32, any device): x [N, d] expert-major rows, counts len Q rows
    per slot, codes (w_gate [C, f, d], w_up [C, f, d], w_down [C, d, f]) e4m3, scales their block scales,
    rows len Q buffer row of each slot (None: slot q is row q) -> [N, d] in x's dtype. Per slot:
      1. x quantized per 1 x b1 group and taken back to float32 (code x scale: ``round_trip_groups``)
      2. g, u = x_q Wg^T, x_q Wu^T with W = float32(code) x block scale (``dequantize``)
      3. h = silu(g) * u, quantized per 1 x b1 group and taken back to float32
      4. y = h_q Wd^T, cast to x's dtype"""
    b1 = int(block[1])
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xd = round_trip_groups(x, b1)
    start = 0
    for q, c in enumerate(counts):
        c = int(c)
        if c:
            r = q if rows is None else int(rows[q])
            wg, wu, wd = (dequantize(t[r], s[r], block) for t, s in zip(codes, scales))
            seg = xd[start:start + c]
            y[start:start + c] = round_trip_groups(torch.nn.functional.silu(seg @ wg.T) * (seg @ wu.T), b1) @ wd.T
        start += c
    return y.to(x.dtype)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def kernels_unavailable(what: str, device: torch.device, dtype: torch.dtype, block: Sequence[int], *dims: int
                        ) -> str | None:
    """Why ``what`` (a block-FP8 Triton kernel of ``fp8_kernels``) cannot run here at all, before any check of its
    numbers (None: it may): CUDA, a bfloat16 / float16 / float32 activation dtype, a block and shape ``supports``
    takes (``dims``: its two matrix dimensions), Triton importable and compiling (not its CPU interpreter)."""
    if torch.device(device).type != "cuda":
        return f"device {torch.device(device).type}: {what} need CUDA"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dtype}: {what} take bfloat16 / float16 / float32 activations"
    why = fp8_kernels.supports(tuple(int(b) for b in block), *dims)  # type: ignore[arg-type]
    if why is not None:
        return why
    if not fp8_kernels.available():
        return "Triton is not importable here"
    if fp8_kernels.interpreted():
        return "Triton runs its CPU interpreter here (TRITON_INTERPRET)"
    return None


def check_fp8_kernel(device: torch.device, dtype: torch.dtype, d: int, f: int, block: Sequence[int]) -> str | None:
    """Why the FP8 expert kernels cannot serve experts [f, d] in ``block`` blocks with ``dtype`` activations here
    (None: they can): CUDA, a supported block, Triton, and the kernels reproducing ``fp8_swiglu_reference``
    within ``CHECK_TOLERANCE`` on three seeded slots of this shape with ragged rows (5, 0, 37): expert-major
    rows, token-major rows read through a route order with row-mapped weights, and the capacity layout."""
    device = torch.device(device)
    why = kernels_unavailable("the FP8 expert kernels", device, dtype, block, d, f)
    if why is not None:
        return why
    block = tuple(int(b) for b in block)
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        dense = [torch.randn(3, f, d, generator=g) / d ** 0.5, torch.randn(3, f, d, generator=g) / d ** 0.5,
                 torch.randn(3, d, f, generator=g) / f ** 0.5]
        pairs = [quantize(w.to(device), block) for w in dense]
        codes, scales = [c for c, _ in pairs], [s for _, s in pairs]
        counts = [5, 0, 37]
        bounds = torch.tensor(list(accumulate(counts)), dtype=torch.int32, device=device)
        x = torch.randn(sum(counts), d, generator=g).to(device, dtype)
        err = _relative_error(fp8_kernels.fp8_swiglu(x, bounds, codes, scales, block),
                              fp8_swiglu_reference(x, counts, codes, scales, block))
        # 2. token-major rows through a route order (top-2), slots at buffer rows (2, 0, 1)
        hidden = torch.randn(24, d, generator=g).to(device, dtype)
        order = torch.randperm(48, generator=g)[:sum(counts)].to(torch.int32)
        got = fp8_kernels.fp8_swiglu(hidden, bounds, codes, scales, block, order=order.to(device), top_k=2,
                                     weight_rows=torch.tensor([2, 0, 1], device=device))
        want = fp8_swiglu_reference(hidden[order.to(device).long() // 2], counts, codes, scales, block, rows=(2, 0, 1))
        err = max(err, _relative_error(got, want))
        # 3. the capacity layout (padding positions zero)
        cap = torch.zeros(3, 40, d, dtype=dtype, device=device)
        for q, c in enumerate(counts):
            cap[q, :c] = torch.randn(c, d, generator=g).to(device, dtype)
        got = fp8_kernels.fp8_swiglu_capacity(cap, torch.tensor(counts, device=device), codes, scales, block)
        want = torch.stack([fp8_swiglu_reference(cap[q], [40 if q != 1 else 0], [t[q:q + 1] for t in codes],
                                                 [s[q:q + 1] for s in scales], block) for q in range(3)])
        err = max(err, _relative_error(got, want))
        if bool(got[1].any()) or bool(got[0, 5:].any()):
            return "FP8 expert kernels wrote into capacity padding here"
    except Exception as exc:  # noqa: BLE001 - the kernels are unavailable here: say why, keep the dequantized path
        return f"FP8 expert kernels failed here: {type(exc).__name__}: {str(exc)[:200]}"
    if not (err < CHECK_TOLERANCE and math.isfinite(err)):
        return f"FP8 expert kernels differ from the reference by {err:.3g} (relative) here"
    return None


def fast_path_reason(device: torch.device, dtype: torch.dtype, d: int, f: int,
                     block: Sequence[int] | None) -> str | None:
    """Why FP8 slots of this shape compute on their dequantized values here (None: the FP8 kernels serve them).
    ``check_fp8_kernel`` runs once per (device, dtype, d, f, block) and is remembered; never under a CUDA graph
    capture (a capture before any eager call of the shape takes the dequantized path and says so)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device.type}: the FP8 expert kernels need CUDA"
    if block is None:
        return "the slots hold no FP8 block scales"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), dtype, int(d), int(f), tuple(int(b) for b in block))
    if key not in _REASONS:
        if torch.cuda.is_current_stream_capturing():
            return "the FP8 expert kernels were not checked before this CUDA graph capture"
        _REASONS[key] = check_fp8_kernel(device, dtype, int(d), int(f), key[4])
    return _REASONS[key]


def _operands(weights: SlotWeights):
    return (weights.w_gate, weights.w_up, weights.w_down), weights.scales, weights.block


class Fp8Runner(ExpertRunner):
    """An expert runner over FP8 slot weights. ``kernels`` True: the FP8 kernels where ``fast_path_reason``
    says None (else, and with ``kernels`` False, the reference: every entry dequantizes the weights it is
    handed (codes x block scales, float32, then the activation dtype of ``x``) and calls the same entry of
    ``inner`` on plain slot weights). ``takes_indexed``: exactly when the kernels serve the call (they read
    token-major rows through the route order and row-mapped weights through their buffer rows)."""

    def __init__(self, inner: ExpertRunner, *, kernels: bool = True) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.kernels = kernels

    def fast(self, x: torch.Tensor, weights: SlotWeights) -> bool:
        """Whether this call runs the FP8 kernels."""
        return self.kernels and fast_path_reason(x.device, x.dtype, weights.hidden_size, weights.ffn_size,
                                                 weights.block) is None

    def run(self, x: torch.Tensor, counts: Sequence[int], weights: SlotWeights) -> torch.Tensor:
        if not self.fast(x, weights):
            return self.inner.run(x, counts, dense_slots(weights, x.dtype))
        counts = as_counts(counts)
        self._check(x, counts, weights)
        bounds = device_tensor(list(accumulate(counts)), torch.int32, x.device)
        return fp8_kernels.fp8_swiglu(x, bounds, *_operands(weights))

    def run_capacity(self, x: torch.Tensor, weights: SlotWeights, valid: torch.Tensor | None = None) -> torch.Tensor:
        if not self.fast(x, weights):
            return self.inner.run_capacity(x, dense_slots(weights, x.dtype), valid)
        if x.dim() != 3 or x.shape[0] != weights.num_slots or x.shape[2] != weights.hidden_size:
            raise ValueError(f"x: expected [{weights.num_slots}, C, {weights.hidden_size}], got {tuple(x.shape)}")
        if valid is None:  # every position a row
            valid = torch.full((weights.num_slots,), int(x.shape[1]), dtype=torch.int64, device=x.device)
        return fp8_kernels.fp8_swiglu_capacity(x, valid, *_operands(weights))

    def run_offsets(self, x: torch.Tensor, offsets: torch.Tensor, weights: SlotWeights) -> torch.Tensor:
        if not self.fast(x, weights):
            return self.inner.run_offsets(x, offsets, dense_slots(weights, x.dtype))
        if offsets.dim() != 1 or offsets.shape[0] != weights.num_slots:
            raise ValueError(f"offsets: expected [{weights.num_slots}] inclusive row ends, got {tuple(offsets.shape)}")
        return fp8_kernels.fp8_swiglu(x, offsets.to(torch.int32), *_operands(weights))

    def takes_indexed(self, hidden: torch.Tensor, rows: int, weights: SlotWeights) -> bool:
        return self.fast(hidden, weights)

    def run_indexed(self, hidden: torch.Tensor, order: torch.Tensor, top_k: int, offsets: torch.Tensor,
                    weights: SlotWeights, *, weight_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The FP8 kernels reading token-major rows through ``order`` (callers asked ``takes_indexed`` first)."""
        return fp8_kernels.fp8_swiglu(hidden, offsets.to(torch.int32), *_operands(weights), order=order,
                                      top_k=top_k, weight_rows=weight_rows)

    def ledger(self, counts: Sequence[int], d: int, f: int) -> RunnerLedger:
        return self.inner.ledger(counts, d, f)


__all__ = ["CHECK_TOLERANCE", "Fp8Runner", "check_fp8_kernel", "kernels_unavailable", "dense_slots", "fast_path_reason",
           "fp8_swiglu_reference"]
