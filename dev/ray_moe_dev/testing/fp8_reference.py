# ======================================================================================================
#  THE FP8 SERVING PATH'S ARITHMETIC, IN TRANSFORMERS' OWN FORWARD (tests: no Ray)
#
#   transformers model of the dequantized checkpoint (code x scale, float32)
#     -> within ``fp8_activations``: every F.linear whose weight is FP8-served in ray-moe (the routed experts'
#        gate_up / down, the dense projections swapped to ``Fp8Linear``) sees its input x [..., in] quantized
#        per 1 x b1 group (``round_trip_groups``: e4m3 codes, float32 scales) and taken back to float32
#     -> logits as the block-FP8 kernels compute them (their torch contracts: ``fp8_swiglu_reference``,
#        ``fp8_linear_reference``), routers, norms, attention and the LM head untouched
# ======================================================================================================
"""A naive reference for the FP8 GPU path: transformers' forward of the dequantized model with the activations of
every FP8 GEMM quantized the way the kernels quantize them (dynamic, per token and group of ``block[1]``).

The FP8 path differs from the dequantized model by its activation quantization (e4m3: 3 mantissa bits); this
reference carries that same quantization, so the served logits must agree with it within float32 noise, and its
own distance from the dequantized model is the intrinsic FP8 error a tolerance against the dequantized model
states."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ray_moe.model.fp8_linear import SWAPPABLE
from ray_moe.moe.experts.fp8 import round_trip_groups


def fp8_dense_modules(model: Any) -> list[str]:
    """The module paths ray-moe swaps to ``Fp8Linear`` in an FP8 checkpoint of ``model``'s family where the dense
    kernel serves: plain ``nn.Linear`` decoder-layer projections named in ``SWAPPABLE`` (the checkpoint stores
    every decoder Linear but the routers in FP8)."""
    return [name for name, mod in model.named_modules()
            if type(mod) is torch.nn.Linear and ".layers." in name and name.rpartition(".")[2] in SWAPPABLE]


def quantized_inputs(dense: Iterable[str]) -> list[str]:
    """The served FP8 projections whose inputs the path quantizes where every MLA row attends on the latent (the
    masked backend: float32): ``dense`` but the ``kv_b_proj`` modules. Absorbed attention reads kv_b_proj's weight
    dequantized once (W_UK against the query, W_UV on the output, ``model.mla``: as vLLM's and SGLang's MLA do), so
    the latent is never quantized; kv_b_proj's FP8 kernel serves only prompt chunks expanded on the varlen backend."""
    return [name for name in dense if name.rpartition(".")[2] != "kv_b_proj"]


def _expert_params(model: Any) -> list[torch.Tensor]:
    """The routed experts' 3-D weights ([E, out, in]: transformers' fused ``gate_up_proj`` / ``down_proj``)."""
    return [p for name, p in model.named_parameters()
            if p.dim() == 3 and name.endswith((".gate_up_proj", ".down_proj"))]


def _round_trip(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., in] -> x quantized per 1 x ``group`` (``quantize_groups``) and taken back, float32, same shape."""
    return round_trip_groups(x.reshape(-1, x.shape[-1]), group).reshape(x.shape).to(x.dtype)


@contextlib.contextmanager
def fp8_activations(model: Any, block: Iterable[int], dense: Iterable[str] | None = None) -> Iterator[None]:
    """Within the block, ``model``'s forward quantizes the input of every F.linear over an FP8-served weight: the
    routed experts' (any view of their 3-D parameters) and the ``dense`` modules' (default
    ``fp8_dense_modules``). Needs transformers' eager experts (``set_experts_implementation("eager")``: the
    grouped kernels call no F.linear). Restores ``torch.nn.functional.linear`` on exit."""
    group = int(list(block)[1])
    names = fp8_dense_modules(model) if dense is None else list(dense)
    weights = [model.get_submodule(n).weight for n in names] + _expert_params(model)
    storages = {w.untyped_storage().data_ptr() for w in weights}
    original = torch.nn.functional.linear

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.untyped_storage().data_ptr() in storages:
            x = _round_trip(x, group)
        return original(x, weight, bias)

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = original


def eager_experts(model: Any) -> Any:
    """``model`` with transformers' eager experts (one F.linear per expert), where the model offers the choice."""
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        setter("eager")
    return model
