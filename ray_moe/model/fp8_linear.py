# ======================================================================================================
#  DENSE BLOCK-FP8 LINEARS (one rank's non-expert modules; pure torch + Triton: no Ray)
#
#   checkpoint X.weight [out, in] float8_e4m3fn + X.weight_scale_inv [ceil(out/b0), ceil(in/b1)] float32
#     ──> ModelHost._load: a swappable projection (``SWAPPABLE``, a plain nn.Linear) on a device where
#         ``fp8_linear_reason`` is None keeps its codes and scales: ``Fp8Linear`` replaces the module
#         (else the codes are dequantized into the module's weight, as before)
#     ──> forward: x [..., in] ──> quantize per row and b1-column group ──> block-FP8 GEMM (``fp8_linear``)
#         ──> y [..., out] in x's dtype (+ bias)
# ======================================================================================================
"""FP8 for the dense Linear layers an FP8 checkpoint stores in FP8 (attention projections, shared experts, dense
MLPs): their codes and block scales stay resident (half the bytes of bf16) and compute with the block-FP8 GEMM of
``moe.experts.runners.fp8_kernels.fp8_linear`` (activations quantized per 1 x b1 token group, as vLLM and SGLang run
these checkpoints), inside the captured step graphs (fixed grid, no host read).

Which modules: a plain ``torch.nn.Linear`` whose attribute name is one of ``SWAPPABLE`` (the projections transformers'
modeling code only calls, never reads the weight of; routers are not among them: ray-moe's fused router reads
its weight) and whose checkpoint weight is FP8. Where: CUDA, once ``fp8_linear_reason`` has reproduced
``fp8_linear_reference`` within ``CHECK_TOLERANCE`` on the shape; anywhere else the module is dequantized at load
(float32(code) x block scale, exactly), and the reason is kept (``ModelHost.fp8_dense``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ray_moe.moe.experts.fp8 import dequantize, quantize, round_trip_groups
from ray_moe.moe.experts.runners import fp8_configs, fp8_kernels
from ray_moe.moe.experts.runners.fp8_configs import LinearBackend
from ray_moe.moe.experts.runners.fp8 import CHECK_TOLERANCE, kernels_unavailable

# the projections swapped (their modules are only called): attention (Llama / Qwen / Mixtral names, DeepSeek's MLA),
# dense and shared-expert MLPs (Qwen / DeepSeek ``gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral-style w1-w3)
SWAPPABLE = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                       "kv_b_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})


def fp8_linear_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                         block: Sequence[int]) -> torch.Tensor:
    """The kernel's contract in torch (float32, any device): x [N, in] quantized per 1 x b1 group
    (``round_trip_groups``) and taken back to float32, times the dequantized weight [out, in] transposed
    -> [N, out] in x's dtype."""
    return (round_trip_groups(x, int(block[1])) @ dequantize(codes, scales, block).T).to(x.dtype)


def fp8_linear_reason(device: torch.device | str, dtype: torch.dtype, out_features: int, in_features: int,
                      block: Sequence[int]) -> str | None:
    """Why a dense FP8 Linear [out, in] in ``block`` blocks is dequantized here rather than computed in FP8 (None:
    the kernel serves it): CUDA, a supported block, Triton, and ``fp8_linear`` reproducing
    ``fp8_linear_reference`` within ``CHECK_TOLERANCE`` on seeded weights of the shape at 1, 37 and 300 rows."""
    device = torch.device(device)
    block = tuple(int(b) for b in block)
    why = kernels_unavailable("the FP8 dense kernels", device, dtype, block, out_features, in_features)
    return why if why is not None else check_fp8_linear(device, dtype, out_features, in_features, block)


def check_fp8_linear(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
                     block: Sequence[int]) -> str | None:
    """The kernel against its reference on ``device`` (None: within ``CHECK_TOLERANCE``, else why not): at 1, 37
    and 300 rows with the settings the calls pick, and every distinct setting the GPU's tuned table
    (``fp8_configs``) holds for the shape (a scaled_mm entry included) at its tuned row count."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        codes, scales = quantize((torch.randn(out_features, in_features, generator=g) / in_features ** 0.5)
                                 .to(device), block)
        table = fp8_configs.table_for_device(device)
        tuned = table.linear_rows.get(fp8_configs.linear_key(out_features, in_features, block)) if table else None
        cases: dict = {}
        for rows, choice in zip(tuned.rows, tuned.choices) if tuned is not None else ():
            cases.setdefault(choice, rows)
        err = 0.0
        for rows, choice in [(1, None), (37, None), (300, None), *((r, c) for c, r in cases.items())]:
            x = torch.randn(rows, in_features, generator=g).to(device, dtype)
            if choice is not None and choice.backend is LinearBackend.SCALED_MM and fp8_kernels.scaled_mm_reason(
                    x, out_features, in_features, block) is not None:
                continue  # never picked for such calls (linear_choice asks the same question)
            got = fp8_kernels.fp8_linear(x, codes, scales, block, choice=choice).float()
            want = fp8_linear_reference(x, codes, scales, block).float()
            err = max(err, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    except Exception as exc:  # noqa: BLE001 - the kernel is unavailable here: say why, keep the dequantized path
        return f"the FP8 dense kernel failed here: {type(exc).__name__}: {str(exc)[:200]}"
    if not (err < CHECK_TOLERANCE and math.isfinite(err)):
        return f"the FP8 dense kernel differs from the reference by {err:.3g} (relative) here"
    return None


class Fp8Linear(torch.nn.Module):
    """A Linear whose weight stays block-FP8: ``codes`` [out, in] float8_e4m3fn and ``scale_inv`` [ceil(out/b0),
    ceil(in/b1)] float32 (buffers: counted by ``ModelHost.memory``), ``bias`` [out] or None.
    forward: x [..., in] -> y [..., out] in x's dtype (``fp8_kernels.fp8_linear``)."""

    def __init__(self, codes: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int],
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = (int(v) for v in codes.shape)
        self.block = tuple(int(b) for b in block)
        self.register_buffer("codes", codes)
        self.register_buffer("scale_inv", scale_inv)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_kernels.fp8_linear(x.reshape(-1, self.in_features), self.codes, self.scale_inv, self.block)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={list(self.block)}"


__all__ = ["Fp8Linear", "SWAPPABLE", "check_fp8_linear", "fp8_linear_reason", "fp8_linear_reference"]
