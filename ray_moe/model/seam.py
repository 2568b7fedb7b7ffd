"""The transformers seam: routed experts of a transformers MoE model run by a ray-moe executor.

Every transformers-5 MoE block calls ``self.experts(hidden_states [T, d], top_k_index [T, k],
top_k_weights [T, k])``; experts classes decorated by ``use_experts_implementation`` dispatch that call
through ``ALL_EXPERTS_FUNCTIONS`` by ``config._experts_implementation``. ``register()`` adds the
implementation ``"ray_moe"``; ``bind(model, executor)`` attaches ``(MoE layer index, executor)`` to each
experts module and selects ``"ray_moe"``. Routing (softmax / sigmoid, correction bias, grouped top-k,
renormalisation, routed scaling) and shared experts stay the model's own code: the executor receives the
router's ``top_k_weights`` exactly as produced (they need not sum to 1) and returns
``sum_j w[t, j] * E_{ids[t, j]}(h_t)``.

    register()
    bind(model, rt.moe_executor())       # or any MoEExecutor
    model.generate(...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ray_moe.core.errors import ConfigError, RayMoEError

IMPLEMENTATION = "ray_moe"
_BINDING_ATTR = "_ray_moe_binding"
_PREVIOUS_ATTR = "_ray_moe_previous_experts_implementation"


@runtime_checkable
class MoEExecutor(Protocol):
    """What runs the routed experts of one MoE layer.

    moe_forward(layer, hidden [T, d], topk_ids [T, k] int64, topk_weights [T, k]) -> [T, d] in hidden's dtype:
    ``out[t] = sum_j topk_weights[t, j] * E_{topk_ids[t, j]}(hidden[t])`` for MoE layer ``layer``
    (the l-th MoE layer, not the decoder layer index). The weights are applied exactly once, after the expert.
    """

    def moe_forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Binding:
    """Attached to one experts module: its MoE layer index and the executor that serves it."""

    layer: int
    executor: MoEExecutor


def ray_moe_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"ray_moe"`` experts implementation: hidden_states [T, d], top_k_index [T, k],
    top_k_weights [T, k] -> [T, d] in hidden_states' dtype, computed by the bound executor."""
    binding: Binding | None = getattr(self, _BINDING_ATTR, None)
    if binding is None:
        raise RayMoEError(f"{type(self).__name__}: experts_implementation='ray_moe' but this experts module is not "
                          f"bound to an executor (call ray_moe.model.seam.bind(model, executor))")
    out = binding.executor.moe_forward(binding.layer, hidden_states, top_k_index.to(torch.int64), top_k_weights)
    if tuple(out.shape) != tuple(hidden_states.shape):
        raise RayMoEError(f"executor returned {list(out.shape)} for hidden_states {list(hidden_states.shape)} "
                          f"(MoE layer {binding.layer})")
    return out.to(hidden_states.dtype)


def register() -> None:
    """Register ``"ray_moe"`` in transformers' ALL_EXPERTS_FUNCTIONS (idempotent, process-wide)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if ALL_EXPERTS_FUNCTIONS.get(IMPLEMENTATION) is not ray_moe_experts_forward:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, ray_moe_experts_forward)


def model_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(path, experts module)`` of every MoE layer of a transformers model, in decoder-layer order."""
    from ray_moe.model.spec import decoder_layer_of, experts_modules

    mods = experts_modules(model)
    return sorted(mods, key=lambda pm: decoder_layer_of(pm[0], mods.index(pm)))


def bind(model: torch.nn.Module, executor: MoEExecutor, *, drop_weights: bool = False) -> list[str]:
    """Serve every routed-experts module of ``model`` with ``executor``; returns the experts paths in MoE
    layer order (path i is MoE layer i).

    Registers ``"ray_moe"`` and calls ``model.set_experts_implementation("ray_moe")``. With
    ``drop_weights=True`` each experts module's ``gate_up_proj`` / ``down_proj`` become empty (0-element,
    same dtype and device) parameters, so the model replica holds no routed-expert weights at all (the
    executor owns them); such a model can no longer run its own experts (``unbind`` refuses), and
    ``save_pretrained`` of it would write no experts.
    """
    if not hasattr(executor, "moe_forward"):
        raise ConfigError(f"executor={type(executor).__name__}: has no moe_forward(layer, hidden, ids, weights)")
    from ray_moe.model.spec import check_experts_kind

    mods = model_experts(model)
    if not mods:
        raise ConfigError(f"model {type(model).__name__} has no routed experts module to bind")
    for path, mod in mods:
        check_experts_kind(type(model).__name__, path, mod, getattr(mod, "config", model.config))
    register()
    if not hasattr(model, _PREVIOUS_ATTR):
        object.__setattr__(model, _PREVIOUS_ATTR, model.get_experts_implementation())
    for layer, (_, mod) in enumerate(mods):
        object.__setattr__(mod, _BINDING_ATTR, Binding(layer, executor))
        if drop_weights:
            for name in ("gate_up_proj", "down_proj"):
                old = getattr(mod, name)
                setattr(mod, name, torch.nn.Parameter(torch.empty(0, dtype=old.dtype, device=old.device),
                                                      requires_grad=False))
            object.__setattr__(mod, "_ray_moe_dropped", True)
    model.set_experts_implementation(IMPLEMENTATION)
    return [p for p, _ in mods]


def unbind(model: torch.nn.Module) -> None:
    """Detach the executor and restore the experts implementation the model had before ``bind``.
    Refused (RayMoEError) when ``bind(..., drop_weights=True)`` dropped the expert weights."""
    mods = model_experts(model)
    if any(getattr(m, "_ray_moe_dropped", False) for _, m in mods):
        raise RayMoEError("unbind: the model's expert weights were dropped by bind(drop_weights=True); reload it")
    previous = getattr(model, _PREVIOUS_ATTR, None)
    for _, mod in mods:
        if hasattr(mod, _BINDING_ATTR):
            object.__delattr__(mod, _BINDING_ATTR)
    if previous is not None:
        model.set_experts_implementation(previous)
        object.__delattr__(model, _PREVIOUS_ATTR)


def binding_of(module: torch.nn.Module) -> Binding | None:
    return getattr(module, _BINDING_ATTR, None)


def describe_binding(model: torch.nn.Module) -> dict[str, Any]:
    """Which experts modules are bound to which executor (for logs)."""
    return {p: (b.layer, type(b.executor).__name__) if (b := binding_of(m)) else None for p, m in model_experts(model)}
