"""The checkpoint's own routers: routes for requests that carry none, computed by the model's own code.

A deployment built from a checkpoint folder (``cfg.checkpoint`` set) routes a routeless step with each
MoE layer's router module as transformers builds it (DeepSeek ``DeepseekV3TopkRouter``: sigmoid scores,
``e_score_correction_bias``, grouped top-k over ``n_group`` / ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``; Mixtral / Qwen ``*TopKRouter``: softmax top-k), never a re-implementation:

* the causal-LM skeleton of the folder's config is built on the meta device (as ``ModelHost.skeleton``
  does, in the deployment's dtype), and for every MoE layer its router submodule
  (``ModelSpec.router_paths[l]``, e.g. ``model.layers.1.mlp.gate``) is materialised alone on the device;
* its parameters and buffers (router weight [E, d], correction bias [E], ...) are read from the checkpoint,
  names mapped with transformers' own load-time renamings (what ``from_pretrained`` applies);
* once, on a seeded probe, the MoE block's own forward is run with its experts module replaced by a
  recorder: the (top_k_index, top_k_weights) the block hands its experts must equal what the router module
  returns, so a block that post-processes its router's output is refused rather than mis-served.

Transformers-5 router modules return ``(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])``;
one that returns anything else (logits only, routing inside the block) is refused with a ConfigError naming
the family and what cannot be reproduced. Everything is built at the first routeless step
(``CheckpointRouter.prepare``), so deployments that always pass routes never pay for it.

The synthetic softmax router (``ray_moe.moe.router.Router``) serves synthetic deployments only.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ray_moe.core.errors import ConfigError
from ray_moe.model.checkpoint import CheckpointIndex
from ray_moe.model.config import RuntimeConfig
from ray_moe.moe.experts.weights import WeightSource

_PROBE_TOKENS = 16
_PROBE_SEED = 20231


class _Recorded(Exception):
    """Raised by the recording experts stub to stop the MoE block right after its routing."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("recorded")
        self.args_, self.kwargs_ = args, kwargs


class _RecordingExperts(torch.nn.Module):
    """Stands in for a MoE block's experts module during the probe: records the call, then stops."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Recorded(args, kwargs)


@dataclass(frozen=True)
class RouterLayer:
    """One MoE layer's router: ``module`` (the transformers class, on the device, eval mode) at ``path``."""

    layer: int
    path: str
    module: torch.nn.Module


class CheckpointRouter:
    """``router(layer, hidden [T, d]) -> (ids [T, k] int64, gates [T, k] float32)`` by the checkpoint's own
    router modules (see the module docstring), on ``device``; ``hidden`` is cast to ``dtype`` (the dtype the
    hosted model runs in) before the router module sees it, as it is inside the model.

    index: the checkpoint's tensor map; num_layers / top_k / hidden_size: what the deployment serves
    (checked against the model's router at build); router_skew: must be 0 (the Zipf bias is synthetic).
    """

    def __init__(self, index: CheckpointIndex, *, num_layers: int, top_k: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, router_skew: float = 0.0) -> None:
        self.index = index
        self.num_layers, self.top_k, self.hidden_size = num_layers, top_k, hidden_size
        self.dtype, self.device = dtype, torch.device(device)
        self.router_skew = router_skew
        self._layers: tuple[RouterLayer, ...] | None = None
        self._lock = threading.Lock()

    @property
    def family(self) -> str:
        spec = self.index.spec
        return f"{spec.model_type or 'unknown'} ({spec.architecture or 'no architecture'})"

    # ------------------------------------------------------------------------------------ calls
    def __call__(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, d] -> (topk_ids [T, k] int64, topk_weights [T, k] float32), the model's own routes."""
        layers = self._layers if self._layers is not None else self.prepare()
        if not 0 <= layer < len(layers):
            raise ConfigError(f"layer={layer} is out of range [0, {len(layers)}) MoE layers of {self.index.folder!r}")
        with torch.no_grad():
            out = layers[layer].module(hidden.to(self.dtype))
        ids, gates = _routes_of(out)
        return ids.to(torch.int64), gates.to(torch.float32)

    def prepare(self) -> tuple[RouterLayer, ...]:
        """Build every MoE layer's router module (once; thread-safe). ConfigError when this checkpoint's
        routing cannot be run by its own transformers modules."""
        with self._lock:
            if self._layers is None:
                self._layers = self._build()
            return self._layers

    # ------------------------------------------------------------------------------------ build
    def _refuse(self, what: str) -> ConfigError:
        return ConfigError(f"checkpoint={self.index.folder!r}, family {self.family}: {what}; a routeless step "
                           f"cannot reproduce the model's own routing (pass topk_ids / topk_weights)")

    def _build(self) -> tuple[RouterLayer, ...]:
        spec = self.index.spec
        if self.router_skew > 0:
            raise self._refuse(f"router_skew={self.router_skew} biases the synthetic router only, and a checkpoint "
                               f"deployment routes with the model's own router (set router_skew=0)")
        if spec.model_type is None or not os.path.isfile(os.path.join(self.index.folder, "config.json")):
            raise self._refuse("the folder has no config.json, so there is no transformers model whose router "
                               "could run")
        if spec.num_moe_layers != self.num_layers or spec.hidden_size != self.hidden_size:
            raise self._refuse(f"num_layers={self.num_layers}, hidden_size={self.hidden_size} but the model has "
                               f"{spec.num_moe_layers} MoE layers of hidden size {spec.hidden_size}")
        model = self._skeleton()
        params = self._checkpoint_tensors(model)
        built = []
        for layer in range(spec.num_moe_layers):
            path = spec.router_paths[layer]
            if path is None:
                raise self._refuse(f"MoE layer {layer} ({spec.experts_paths[layer]}) has no router submodule "
                                   f"with an [E, d] weight")
            gate = model.get_submodule(path)
            module = self._materialise(layer, path, gate, params)
            self._verify(layer, path, model, module)
            built.append(RouterLayer(layer, path, module))
        return tuple(built)

    def _skeleton(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        from ray_moe.model.spec import load_hf_config

        config = load_hf_config(self.index.folder)
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        except Exception as exc:  # transformers raises many kinds; name the family
            raise self._refuse(f"transformers cannot build the model ({exc})") from exc
        return model.eval()

    def _checkpoint_tensors(self, model: torch.nn.Module) -> dict[str, tuple[str, str]]:
        """model tensor name -> (checkpoint key, file) for every router tensor, renamed as ``from_pretrained``
        renames checkpoint keys (e.g. Mixtral ``block_sparse_moe.gate.weight`` -> ``mlp.gate.weight``)."""
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        wanted = set()
        for path in self.index.spec.router_paths:
            if path is not None:
                mod = model.get_submodule(path)
                wanted.update(f"{path}.{n}" for n, _ in mod.named_parameters())
                wanted.update(f"{path}.{n}" for n, _ in mod.named_buffers())
        renamings = [w for w in get_model_conversion_mapping(model) if isinstance(w, WeightRenaming)]
        found: dict[str, tuple[str, str]] = {}
        for fname in self.index.files:
            with safe_open(fname, framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                    name = key if key in wanted else rename_source_key(key, renamings, [])[0]
                    if name in wanted:
                        found.setdefault(name, (key, fname))
        return found

    def _materialise(self, layer: int, path: str, gate: torch.nn.Module,
                     found: dict[str, tuple[str, str]]) -> torch.nn.Module:
        """The router module on the device with every parameter and buffer read from the checkpoint."""
        gate.to_empty(device=self.device)
        tensors = dict(gate.named_parameters())
        tensors.update(dict(gate.named_buffers()))
        with torch.no_grad():
            for local, dst in tensors.items():
                name = f"{path}.{local}"
                hit = found.get(name)
                if hit is None and local == "weight" and self.index.layout(layer).router is not None:
                    src = self.index.read_router(layer)  # the spec's saved-name candidates (float32, lossless)
                elif hit is None:
                    raise self._refuse(f"MoE layer {layer}: the checkpoint has no tensor for the router's {name!r} "
                                       f"({type(gate).__name__}.{local})")
                else:  # (an FP8 router weight dequantized with its block scales)
                    src = self.index.read_tensor(hit[0])
                if tuple(src.shape) != tuple(dst.shape):
                    raise ConfigError(f"{hit[1] if hit else self.index.folder!r}: router tensor "
                                      f"{hit[0] if hit else name!r} has shape {list(src.shape)} but the model's "
                                      f"{name!r} is {list(dst.shape)}")
                dst.copy_(src.to(dst.dtype))
        return gate.eval().requires_grad_(False)

    def _verify(self, layer: int, path: str, model: torch.nn.Module, module: torch.nn.Module) -> None:
        """Probe once: the router module returns (logits, weights [T, k], index [T, k]) with k = top_k, and the
        MoE block's own forward hands its experts exactly those (index, weights)."""
        spec = self.index.spec
        g = torch.Generator().manual_seed(_PROBE_SEED + layer)
        probe = torch.randn(1, _PROBE_TOKENS, spec.hidden_size, generator=g).to(self.device, self.dtype)
        with torch.no_grad():
            try:
                out = module(probe.view(-1, spec.hidden_size))
            except Exception as exc:  # any failure of the model's own code is a refusal
                raise self._refuse(f"MoE layer {layer}: router {path} ({type(module).__name__}) fails on a "
                                   f"[T, d] hidden ({exc})") from exc
            try:
                ids, gates = _routes_of(out)
            except TypeError as exc:
                raise self._refuse(f"MoE layer {layer}: router {path} ({type(module).__name__}) {exc}; the top-k "
                                   f"selection is not the router module's own") from None
            if tuple(ids.shape) != (_PROBE_TOKENS, self.top_k):
                raise self._refuse(f"MoE layer {layer}: router {path} picks {ids.shape[-1]} experts per token but "
                                   f"top_k={self.top_k}")
            block_path, _, child = spec.experts_paths[layer].rpartition(".")
            block = model.get_submodule(block_path)
            experts = block._modules.get(child)
            if experts is None:
                raise self._refuse(f"MoE layer {layer}: {spec.experts_paths[layer]} is not a child of its block")
            block._modules[child] = _RecordingExperts()
            try:
                block(probe)
            except _Recorded as rec:
                args, kwargs = rec.args_, rec.kwargs_
            except Exception as exc:  # noqa: BLE001 - the block needs more than its router before its experts
                raise self._refuse(f"MoE layer {layer}: the MoE block {block_path} ({type(block).__name__}) does "
                                   f"not reach its experts on the router's output alone ({exc})") from None
            else:
                raise self._refuse(f"MoE layer {layer}: the MoE block {block_path} ({type(block).__name__}) never "
                                   f"calls its experts module {child!r}")
            finally:
                block._modules[child] = experts
        given = list(args[1:3]) + [kwargs.get("top_k_index"), kwargs.get("top_k_weights")]
        given = [t for t in given if isinstance(t, torch.Tensor)]
        if len(given) != 2 or not (torch.equal(given[0].to(ids.dtype), ids) and torch.equal(given[1], gates)):
            raise self._refuse(f"MoE layer {layer}: the MoE block {block_path} ({type(block).__name__}) does not "
                               f"hand its experts the router module's (top_k_index, top_k_weights) unchanged")


def _routes_of(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index [T, k], top_k_weights [T, k]) of a transformers-5 router module's output
    ``(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])``; TypeError for any other output."""
    if not isinstance(out, (tuple, list)) or len(out) != 3 or not all(isinstance(t, torch.Tensor) for t in out):
        raise TypeError(f"returns {type(out).__name__} rather than (router_logits, top_k_weights, top_k_index)")
    _, gates, ids = out
    if ids.is_floating_point() or not gates.is_floating_point() or ids.shape != gates.shape or ids.dim() != 2:
        raise TypeError(f"returns (logits, {gates.dtype} {list(gates.shape)}, {ids.dtype} {list(ids.shape)}) rather "
                        f"than (router_logits, top_k_weights [T, k] float, top_k_index [T, k] int)")
    return ids, gates


def checkpoint_router(cfg: RuntimeConfig, source: WeightSource, *, device: torch.device,
                      dtype: torch.dtype) -> CheckpointRouter:
    """The routeless-step router of a checkpoint deployment (``cfg.checkpoint`` set). Reuses the source's
    CheckpointIndex when it is an ``HFWeightSource``; builds lazily (see ``CheckpointRouter.prepare``)."""
    if not cfg.checkpoint:
        raise ConfigError("checkpoint=None: a synthetic deployment routes with ray_moe.moe.router.Router")
    index = getattr(source, "index", None)
    if not isinstance(index, CheckpointIndex) or os.path.abspath(index.folder) != os.path.abspath(cfg.checkpoint):
        index = CheckpointIndex(os.fspath(cfg.checkpoint))
    return CheckpointRouter(index, num_layers=cfg.num_layers, top_k=cfg.top_k, hidden_size=cfg.hidden_size,
                            dtype=dtype, device=device, router_skew=cfg.router_skew)
