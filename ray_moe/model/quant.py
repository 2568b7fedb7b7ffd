"""Quantized checkpoints: the one format ray-moe serves, and a refusal, at load, for every other.

Served: block-scaled FP8 as DeepSeek-V3 / R1 and Qwen3-FP8 ship it. ``config.json`` declares

    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

(``fmt: "e4m3"``, ``scale_fmt: "float"`` / ``"ue8m0"`` accepted) and each quantized Linear weight ``X.weight``
[out, in] is stored as float8_e4m3fn codes with ``X.weight_scale_inv`` [ceil(out / b0), ceil(in / b1)] beside
it (float32; bf16 / fp16 / e8m0 scales convert to float32 exactly); a fused experts tensor ``<experts>.gate_up_proj``
[E, 2f, d] has ``<experts>.gate_up_proj_scale_inv`` (see ``CheckpointIndex``). The value of a weight is
float32(code) x the scale of its block (``moe.experts.fp8.dequantize``): the routed experts keep codes and
scales in their slots; every other quantized tensor is dequantized at load (``dense_tensor``).

Refused with a ``ConfigError`` naming the method (or the field and value) and the file, before any actor
starts (``build_spec`` reads it first; ``ModelHost`` reads it again before loading): any other
``quant_method`` (gptq, awq, bitsandbytes, compressed-tensors, mxfp4, fbgemm_fp8, ...), a
``compression_config``, a ``quantize_config.json`` / ``quant_config.json`` beside the weights (AutoGPTQ /
AutoAWQ), fp8 with static activation scales, fp8 without ``weight_block_size`` (per-tensor scales), a block
size that is not two integers >= 1, experts in another format (``expert_dtype``), e5m2 codes; and a
checkpoint holding float8 tensors or ``*_scale_inv`` scales whose config declares no quantization (the tensor
and file named): such values are never read as if they were unquantized.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ray_moe.core.errors import ConfigError
from ray_moe.moe.experts.fp8 import FP8_DTYPE, check_block, dequantize, scale_shape

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv; <experts>.gate_up_proj -> ..._scale_inv
#: side files of quantization toolkits whose weights ray-moe cannot read
SIDE_FILES = ("quantize_config.json", "quant_config.json")
#: safetensors header dtypes of float8 tensors
FP8_HEADERS = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
SERVED = ("ray-moe serves block-scaled FP8 only: quant_method='fp8' with activation_scheme='dynamic' and "
          "weight_block_size=[rows, cols] (DeepSeek-V3 / Qwen3-FP8 layout), or an unquantized checkpoint")


@dataclass(frozen=True)
class Fp8Scheme:
    """A block-scaled FP8 checkpoint: scales per ``block`` = (rows, cols) of a weight [out, in]; ``config``
    is the config.json that declared it."""

    block: tuple[int, int]
    config: str
    scale_fmt: str = "float"


def scale_name(name: str) -> str:
    """The checkpoint name of the scales of tensor ``name``."""
    return name + SCALE_SUFFIX


def is_fp8(t: torch.Tensor | str) -> bool:
    """A float8 tensor (or safetensors header dtype string)."""
    if isinstance(t, str):
        return t in FP8_HEADERS
    return t.dtype.is_floating_point and t.element_size() == 1


def read_quantization(folder: str) -> Fp8Scheme | None:
    """The quantization a checkpoint folder declares: None (unquantized), an ``Fp8Scheme``, or a ConfigError
    naming the method / field and the file (see the module docstring)."""
    folder = os.fspath(folder)
    for side in SIDE_FILES:
        if os.path.isfile(os.path.join(folder, side)):
            raise ConfigError(f"{os.path.join(folder, side)}: a quantization toolkit's config (GPTQ / AWQ packed "
                              f"weights) is not served; {SERVED}")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    qc = raw.get("quantization_config")
    if qc is None and isinstance(text, dict):
        qc = text.get("quantization_config")
    if raw.get("compression_config") is not None:
        method = (raw["compression_config"] or {}).get("quant_method", "compressed-tensors") \
            if isinstance(raw["compression_config"], dict) else "compressed-tensors"
        raise ConfigError(f"{path}: compression_config (quant_method={method!r}) is not served; {SERVED}")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"{path}: quantization_config={qc!r} is not an object; {SERVED}")
    method = qc.get("quant_method")
    if method != "fp8":
        extra = f" (format={qc['format']!r})" if qc.get("format") else ""
        raise ConfigError(f"{path}: quantization_config.quant_method={method!r}{extra} is not served; {SERVED}")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(f"{path}: quantization_config.activation_scheme={act!r} (static activation scales) is "
                          f"not served (quant_method='fp8'); {SERVED}")
    block = qc.get("weight_block_size")
    if block is None:
        raise ConfigError(f"{path}: quantization_config.weight_block_size=None (quant_method='fp8' with "
                          f"per-tensor scales) is not served; {SERVED}")
    try:
        b = check_block(block, "quantization_config.weight_block_size")
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc} (quant_method='fp8')") from None
    for field, ok in (("expert_dtype", ("fp8",)), ("fmt", ("e4m3",)), ("scale_fmt", ("float", "ue8m0"))):
        value = qc.get(field)
        if value is not None and value not in ok:
            raise ConfigError(f"{path}: quantization_config.{field}={value!r} is not served (quant_method='fp8' "
                              f"needs {field} in {list(ok)}); {SERVED}")
    return Fp8Scheme(block=b, config=path, scale_fmt=str(qc.get("scale_fmt") or "float"))


def refuse_unquantized_fp8(name: str, dtype: Any, where: str, folder: str) -> ConfigError:
    """The error for a float8 tensor (or a scale) in a checkpoint whose config declares no quantization."""
    what = "holds scales" if name.endswith(SCALE_SUFFIX) else f"is {dtype} (FP8 codes)"
    config = os.path.join(folder, "config.json")
    says = f"{config} declares no quantization_config" if os.path.isfile(config) else \
        f"the folder has no config.json declaring a quantization_config"
    return ConfigError(f"{where}: tensor {name!r} {what} but {says}; its values cannot be read without their "
                       f"scales ({SERVED})")


def check_header(name: str, dtype: str, where: str, folder: str, scheme: Fp8Scheme | None) -> None:
    """Header-only check of one tensor's dtype string (safetensors ``F8_E4M3``...): float8 tensors and scales
    need an FP8 scheme, and codes must be e4m3."""
    if scheme is None and (dtype in FP8_HEADERS or name.endswith(SCALE_SUFFIX)):
        raise refuse_unquantized_fp8(name, dtype, where, folder)
    if scheme is not None and dtype in FP8_HEADERS and dtype != "F8_E4M3" and not name.endswith(SCALE_SUFFIX):
        raise ConfigError(f"{where}: tensor {name!r} is {dtype}; FP8 codes must be float8_e4m3fn ({SERVED})")


def scale_of(name: str, codes: torch.Tensor, scale: torch.Tensor | None, where: str,
             scheme: Fp8Scheme) -> torch.Tensor:
    """The float32 scales of FP8 ``codes`` (tensor ``name``) after checking their presence, dtype and shape
    [..., ceil(out / b0), ceil(in / b1)]; ConfigError naming the tensor and the file."""
    if codes.dtype != FP8_DTYPE:
        raise ConfigError(f"{where}: tensor {name!r} is {codes.dtype}; FP8 codes must be float8_e4m3fn ({SERVED})")
    if scale is None:
        raise ConfigError(f"{where}: FP8 tensor {name!r} has no {scale_name(name)!r} (block scales); it cannot be "
                          f"read without them")
    want = scale_shape(codes.shape, scheme.block)
    if tuple(scale.shape) != want:
        raise ConfigError(f"{where}: scales {scale_name(name)!r} have shape {list(scale.shape)}, expected "
                          f"{list(want)} for {name!r} {list(codes.shape)} in blocks of {list(scheme.block)} "
                          f"(weight_block_size of {scheme.config})")
    if not scale.dtype.is_floating_point:
        raise ConfigError(f"{where}: scales {scale_name(name)!r} are {scale.dtype}, not floating point")
    return scale.to(torch.float32)


def dense_tensor(name: str, t: torch.Tensor, scale: Callable[[str], torch.Tensor | None], where: str,
                 folder: str, scheme: Fp8Scheme | None) -> torch.Tensor:
    """A checkpoint tensor's values: ``t`` itself unless it is float8, whose codes are dequantized with their
    block scales (``scale(scale_name(name))`` reads them, None when absent) into float32, exactly
    (float32(code) x scale). ConfigError when the config declares no quantization or the scales are wrong."""
    if not is_fp8(t):
        return t
    if scheme is None:
        raise refuse_unquantized_fp8(name, t.dtype, where, folder)
    s = scale_of(name, t, scale(scale_name(name)), where, scheme)
    return dequantize(t, s, scheme.block)


__all__ = ["Fp8Scheme", "SCALE_SUFFIX", "check_header", "dense_tensor", "is_fp8", "read_quantization",
           "refuse_unquantized_fp8", "scale_name", "scale_of"]
