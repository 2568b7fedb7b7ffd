"""ModelSpec: what ray-moe needs to know about a Hugging Face MoE checkpoint folder, built from its
``config.json`` alone (no tensor data is read).

The spec comes from transformers itself, not from per-family rules: the config is loaded with
``AutoConfig``, the model skeleton is built on the meta device with ``AutoModelForCausalLM.from_config``
and every experts module is found by what ``transformers.integrations.moe.use_experts_implementation``
puts on it (``gate_up_proj`` / ``down_proj`` parameters and the ``_is_expert_parallel`` flag). Dense
decoder layers (DeepSeek ``first_k_dense_replace``, Qwen ``mlp_only_layers`` / ``decoder_sparse_step``)
therefore simply have no experts module.

Checkpoint tensor names come from transformers as well: the skeleton's save-time weight conversion
(``revert_weight_conversion``, what ``save_pretrained`` applies) is run on tiny coded probe tensors, which
yields the per-expert names ``save_pretrained`` writes (Mixtral ``block_sparse_moe.experts.{e}.w1``,
Qwen / DeepSeek ``mlp.experts.{e}.gate_proj`` ...) and the router's saved name. The live (fused) names
``<experts>.gate_up_proj`` / ``<experts>.down_proj`` are always candidates too. ``CheckpointIndex``
picks, per MoE layer, the candidates that exist.

A layer ``l`` in ray-moe is the l-th MoE layer (``moe_layers[l]`` is its decoder layer index).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ray_moe.core.errors import ConfigError

#: activations ray-moe's experts compute (``silu(x Wg^T) * (x Wu^T)``); transformers' ACT2FN names
SILU_NAMES = ("silu", "swish")

_GATE, _UP, _DOWN = 0, 1, 2
_PROBE_GATE_UP = 1_000_000.0  # code of (expert e, half h) = base + 2e + h
_PROBE_DOWN = 2_000_000.0  # code of expert e = base + e
_PROBE_ROUTER = 3_000_000.0


@dataclass(frozen=True)
class LayerNames:
    """Checkpoint names one MoE layer's tensors may have; the index uses the first candidate that exists.

    per_expert: ``(gate, up, down)`` name patterns with an ``{e}`` field, e.g.
        ``("model.layers.1.block_sparse_moe.experts.{e}.w1.weight", "...w3.weight", "...w2.weight")``;
        gate/up: [f, d], down: [d, f] (nn.Linear layout)
    fused: ``(gate_up_proj, down_proj)`` names of stacked tensors; gate_up: [E, 2f, d] (gate rows first),
        down: [E, d, f] (``[E, d, 2f]`` / ``[E, f, d]`` when ``ModelSpec.is_transposed``)
    router: names of the router weight [E, d]
    """

    per_expert: tuple[tuple[str, str, str], ...] = ()
    fused: tuple[tuple[str, str], ...] = ()
    router: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the routed experts of one checkpoint folder.

    moe_layers[l]: decoder layer index of MoE layer l (ascending); experts_paths[l]: module path of its
    experts module in the transformers model (``"model.layers.1.mlp.experts"``); router_paths[l]: module
    path of its router (``"model.layers.1.mlp.gate"``) or None; names[l]: checkpoint name candidates.
    Every expert is gated SwiGLU: w_gate [ffn_size, hidden_size], w_up [ffn_size, hidden_size],
    w_down [hidden_size, ffn_size]. ``is_transposed`` is how the *fused* tensors are stored.
    ``fp8_block``: (rows, cols) of the scale blocks of a block-scaled FP8 checkpoint (``model.quant``; its
    float8 tensors are codes with ``*_scale_inv`` scales), None for an unquantized one.
    """

    folder: str
    model_type: str | None
    architecture: str | None
    num_decoder_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int | None
    hidden_size: int
    ffn_size: int
    experts_paths: tuple[str, ...]
    router_paths: tuple[str | None, ...]
    names: tuple[LayerNames, ...] = field(repr=False)
    is_transposed: bool = False
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    fp8_block: tuple[int, int] | None = None

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def moe_index(self, decoder_layer: int) -> int:
        """MoE layer index of a decoder layer (ConfigError if that decoder layer is dense)."""
        try:
            return self.moe_layers.index(decoder_layer)
        except ValueError:
            raise ConfigError(f"decoder layer {decoder_layer} of {self.folder!r} has no routed experts "
                              f"(MoE layers: {list(self.moe_layers)})") from None

    def describe(self) -> dict[str, Any]:
        return {"folder": self.folder, "model_type": self.model_type, "architecture": self.architecture,
                "num_decoder_layers": self.num_decoder_layers, "moe_layers": list(self.moe_layers),
                "num_experts": self.num_experts, "top_k": self.top_k, "hidden_size": self.hidden_size,
                "ffn_size": self.ffn_size, "is_transposed": self.is_transposed,
                "fp8_block": list(self.fp8_block) if self.fp8_block else None}


# --------------------------------------------------------------------------------------------- helpers
def load_hf_config(folder: str) -> Any:
    """``AutoConfig`` of a checkpoint folder, offline. ConfigError names the folder / file."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ConfigError(f"checkpoint={folder!r}: no such folder")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint={folder!r}: no config.json in the folder ({path} is missing)")
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable JSON file ({exc})") from exc
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError / KeyError / OSError for unknown types
        raise ConfigError(f"{path}: transformers cannot load this config (model_type="
                          f"{raw.get('model_type')!r}, architectures={raw.get('architectures')}): {exc}") from exc


def build_skeleton(cfg: Any, where: str) -> Any:
    """The causal-LM model of ``cfg`` on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:
        raise ConfigError(f"{where}: transformers cannot build a causal LM for model_type="
                          f"{getattr(cfg, 'model_type', None)!r} (architectures="
                          f"{getattr(cfg, 'architectures', None)}): {exc}") from exc


def is_experts_module(module: Any) -> bool:
    """A module decorated by ``use_experts_implementation`` (it sets ``_is_expert_parallel``) with stacked
    ``down_proj`` and ``gate_up_proj`` (or, for non-gated experts, ``up_proj``) weights."""
    import torch

    return (hasattr(module, "_is_expert_parallel")
            and isinstance(getattr(module, "down_proj", None), torch.Tensor)
            and (isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
                 or isinstance(getattr(module, "up_proj", None), torch.Tensor)))


def experts_modules(model: Any) -> list[tuple[str, Any]]:
    """Every ``(path, experts module)`` of a transformers model, in module order (= decoder-layer order)."""
    return [(name, mod) for name, mod in model.named_modules() if is_experts_module(mod)]


def decoder_layer_of(path: str, ordinal: int) -> int:
    """Decoder layer index in a module path (the integer after the last ``layers`` / ``h`` / ``blocks``)."""
    parts = path.split(".")
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in ("layers", "h", "blocks", "layer") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return ordinal


def check_experts_kind(arch: str, path: str, mod: Any, cfg: Any) -> None:
    """ConfigError unless ``mod`` holds bias-free gated SwiGLU experts ([gate; up] rows, silu gate)."""
    from transformers.integrations.moe import _default_apply_gate

    if getattr(mod, "has_bias", False):
        raise ConfigError(f"architecture {arch}: experts module {path} has biases (has_bias=True); ray-moe runs "
                          f"bias-free gated SwiGLU experts only")
    if not getattr(mod, "has_gate", True):
        raise ConfigError(f"architecture {arch}: experts module {path} is not gated (has_gate=False); ray-moe runs "
                          f"gated SwiGLU experts only")
    if getattr(mod, "has_post_expert_norm", False):
        raise ConfigError(f"architecture {arch}: experts module {path} applies a post-expert norm; ray-moe runs "
                          f"plain gated SwiGLU experts only")
    if not getattr(mod, "is_concatenated", True) or getattr(type(mod), "_apply_gate", _default_apply_gate) \
            is not _default_apply_gate:
        raise ConfigError(f"architecture {arch}: experts module {path} uses a custom gate layout or gating "
                          f"function ({type(mod).__name__}); ray-moe runs silu(gate) * up with [gate; up] rows")
    act = getattr(cfg, "hidden_act", None)
    fn = getattr(mod, "act_fn", None)
    # the experts module's own activation is authoritative (e.g. Aria's routed experts are always SiLU);
    # without one, config.hidden_act is what transformers' gate applies
    silu = _is_silu(fn) if fn is not None else act in SILU_NAMES
    if not silu:
        raise ConfigError(f"architecture {arch}: config.hidden_act={act!r} (experts activation "
                          f"{type(fn).__name__ if fn is not None else None}); ray-moe experts compute "
                          f"silu(x Wg^T) * (x Wu^T) Wd^T and need hidden_act in {list(SILU_NAMES)}")


def _is_silu(fn: Any) -> bool:
    import torch

    from transformers.activations import ACT2CLS

    return isinstance(fn, (ACT2CLS["silu"], torch.nn.SiLU)) or fn is torch.nn.functional.silu


def _router_path(model: Any, block_path: str, num_experts: int, hidden: int) -> str | None:
    """The child of the MoE block whose ``weight`` is [E, d] (``gate`` / ``router`` preferred)."""
    import torch

    block = model.get_submodule(block_path)
    found = []
    for name, child in block.named_children():
        w = getattr(child, "weight", None)
        if isinstance(w, torch.Tensor) and tuple(w.shape) == (num_experts, hidden):
            found.append(name)
    if not found:
        return None
    found.sort(key=lambda n: (n not in ("gate", "router"), n))
    return f"{block_path}.{found[0]}" if block_path else found[0]


def _pattern(names: dict[int, str], num_experts: int) -> str | None:
    """``{e: name}`` -> one pattern with ``{e}`` (the last ``.e.`` component) that reproduces every name."""
    if sorted(names) != list(range(num_experts)):
        return None
    name0 = names[0]
    i = name0.rfind(".0.")
    if i < 0 or "{" in name0 or "}" in name0:
        return None
    pat = name0[:i] + ".{e}." + name0[i + 3:]
    return pat if all(pat.format(e=e) == names[e] for e in range(num_experts)) else None


def saved_names(model: Any, paths: list[str], router_paths: list[str | None], num_experts: int,
                is_transposed: bool) -> list[LayerNames]:
    """Name candidates per MoE layer: what ``save_pretrained`` would write (found by running transformers'
    save-time conversion on coded probe tensors) and the live fused names."""
    import torch

    probes: dict[str, torch.Tensor] = {}
    e_count = num_experts
    for path, rpath in zip(paths, router_paths):
        gu = (_PROBE_GATE_UP + torch.arange(2 * e_count, dtype=torch.float64)).view(e_count, 2, 1)
        probes[f"{path}.gate_up_proj"] = gu.transpose(1, 2).contiguous() if is_transposed else gu
        probes[f"{path}.down_proj"] = (_PROBE_DOWN + torch.arange(e_count, dtype=torch.float64)).view(e_count, 1, 1)
        if rpath is not None:
            probes[f"{rpath}.weight"] = torch.full((1,), _PROBE_ROUTER, dtype=torch.float64)
    reverted: dict[str, Any] = {}
    try:
        from transformers.core_model_loading import revert_weight_conversion

        reverted = revert_weight_conversion(model, dict(probes))
    except Exception:  # an unusual conversion: keep the live names only
        reverted = {}
    # decode each reverted tensor: which probe (and expert / half) it came from
    per_layer: list[dict[str, Any]] = [{"g": {}, "u": {}, "d": {}, "fgu": None, "fd": None, "r": None} for _ in paths]
    # a reverted name belongs to the MoE layer in the same decoder layer (renames may move the block)
    owner_of = {k: i for i, p in enumerate(paths) if (k := _layer_key(p.rsplit(".", 1)[0] + ".")) is not None}
    for name, t in reverted.items():
        t = t[0] if isinstance(t, list) else t
        key = _layer_key(name)
        owner = owner_of.get(key) if key is not None else None
        if owner is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        slot = per_layer[owner]
        if t.numel() == 1:
            code = float(t.reshape(-1)[0])
            if _PROBE_GATE_UP <= code < _PROBE_DOWN:
                e, h = divmod(int(code - _PROBE_GATE_UP), 2)
                slot["g" if h == 0 else "u"][e] = name
            elif _PROBE_DOWN <= code < _PROBE_ROUTER:
                slot["d"][int(code - _PROBE_DOWN)] = name
            elif code == _PROBE_ROUTER:
                slot["r"] = name
            continue
        path = paths[owner]
        if torch.equal(t.reshape(-1), probes[f"{path}.gate_up_proj"].reshape(-1)):
            slot["fgu"] = name
        elif torch.equal(t.reshape(-1), probes[f"{path}.down_proj"].reshape(-1)):
            slot["fd"] = name
    out = []
    for i, (path, rpath) in enumerate(zip(paths, router_paths)):
        slot = per_layer[i]
        per_expert: list[tuple[str, str, str]] = []
        pats = [_pattern(slot[k], e_count) for k in ("g", "u", "d")]
        if all(pats):
            per_expert.append((pats[0], pats[1], pats[2]))  # type: ignore[arg-type]
        fused = [(f"{path}.gate_up_proj", f"{path}.down_proj")]
        if slot["fgu"] and slot["fd"] and (slot["fgu"], slot["fd"]) not in fused:
            fused.append((slot["fgu"], slot["fd"]))
        # fallbacks: the two per-expert conventions of transformers' MoE conversions, under the live path
        # and under the saved block path (not per family: tried only when present in the checkpoint)
        for base in dict.fromkeys([path] + [p.rsplit(".{e}.", 1)[0] for p in (pats[0],) if p]):
            for trio in ((".{e}.gate_proj.weight", ".{e}.up_proj.weight", ".{e}.down_proj.weight"),
                         (".{e}.w1.weight", ".{e}.w3.weight", ".{e}.w2.weight")):
                cand = tuple(base + s for s in trio)
                if cand not in per_expert:
                    per_expert.append(cand)  # type: ignore[arg-type]
            fcand = (f"{base}.gate_up_proj", f"{base}.down_proj")
            if fcand not in fused:
                fused.append(fcand)
        router: list[str] = []
        if rpath is not None:
            for cand in (slot["r"], f"{rpath}.weight"):
                if cand and cand not in router:
                    router.append(cand)
        out.append(LayerNames(per_expert=tuple(per_expert), fused=tuple(fused), router=tuple(router)))
    return out


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def _layer_key(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(text before the first ``.layers.``, layer indices in the name): equal for a module path and the
    checkpoint names of tensors inside it, also after a rename such as ``mlp`` -> ``block_sparse_moe``."""
    idx = tuple(_LAYER_RE.findall(name))
    return (name.split(".layers.")[0], idx) if idx else None


# ------------------------------------------------------------------------------------------------ build
def build_spec(folder: str) -> ModelSpec:
    """ModelSpec of a Hugging Face checkpoint folder from its config.json (no tensor data read).

    Raises ConfigError (naming the folder / file) when the folder or config.json is missing, transformers
    cannot build the model, no experts module exists, or the experts are not bias-free gated SwiGLU; and, first
    of all, when the config declares a quantization ray-moe does not serve (``model.quant.read_quantization``).
    """
    from ray_moe.model.quant import read_quantization

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ConfigError(f"checkpoint={folder!r}: no such folder")
    scheme = read_quantization(folder)
    cfg = load_hf_config(folder)
    path = os.path.join(folder, "config.json")
    arch = (getattr(cfg, "architectures", None) or [None])[0] or type(cfg).__name__
    model = build_skeleton(cfg, path)
    arch = type(model).__name__
    mods = experts_modules(model)
    if not mods:
        raise ConfigError(f"{path}: architecture {arch} (model_type={getattr(cfg, 'model_type', None)!r}) has no "
                          f"routed experts module (transformers' use_experts_implementation); ray-moe serves MoE models")
    shapes = set()
    paths, moe_layers, transposed = [], [], set()
    for i, (p, mod) in enumerate(mods):
        check_experts_kind(arch, p, mod, getattr(mod, "config", cfg))
        gu, dn = tuple(mod.gate_up_proj.shape), tuple(mod.down_proj.shape)
        tr = bool(getattr(mod, "is_transposed", False))
        e_count = gu[0]
        d, two_f = (gu[1], gu[2]) if tr else (gu[2], gu[1])
        if two_f % 2 or dn != ((e_count, two_f // 2, d) if tr else (e_count, d, two_f // 2)):
            raise ConfigError(f"{path}: experts module {p} has gate_up_proj {list(gu)} and down_proj {list(dn)}, "
                              f"not a gated [gate; up] / down pair")
        shapes.add((e_count, d, two_f // 2))
        transposed.add(tr)
        paths.append(p)
        moe_layers.append(decoder_layer_of(p, i))
    if len(shapes) != 1 or len(transposed) != 1:
        raise ConfigError(f"{path}: MoE layers differ in (num_experts, hidden, ffn) {sorted(shapes)}; ray-moe "
                          f"needs one expert shape for every MoE layer")
    if sorted(moe_layers) != moe_layers or len(set(moe_layers)) != len(moe_layers):
        raise ConfigError(f"{path}: experts modules {paths} do not map to distinct ascending decoder layers")
    e_count, d, f = shapes.pop()
    is_transposed = transposed.pop()
    if scheme is not None and is_transposed:
        raise ConfigError(f"{path}: architecture {arch} stores its experts transposed (gate_up [E, d, 2f]); block-scaled "
                          f"FP8 experts (quant_method='fp8') are served in the [E, 2f, d] / per-expert [out, in] layout only")
    router_paths = [_router_path(model, p.rsplit(".", 1)[0] if "." in p else "", e_count, d) for p in paths]
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if top_k is None:
        gate = model.get_submodule(router_paths[0]) if router_paths[0] else None
        top_k = getattr(gate, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= e_count:
        raise ConfigError(f"{path}: num_experts_per_tok={top_k!r} is not a top-k in [1, {e_count}]")
    num_decoder = getattr(cfg, "num_hidden_layers", None)
    dtype = getattr(cfg, "dtype", None)
    return ModelSpec(
        folder=folder,
        model_type=getattr(cfg, "model_type", None),
        architecture=arch,
        num_decoder_layers=int(num_decoder) if num_decoder is not None else max(moe_layers) + 1,
        moe_layers=tuple(moe_layers),
        num_experts=int(e_count),
        top_k=int(top_k),
        hidden_size=int(d),
        ffn_size=int(f),
        experts_paths=tuple(paths),
        router_paths=tuple(router_paths),
        names=tuple(saved_names(model, paths, router_paths, int(e_count), is_transposed)),
        is_transposed=is_transposed,
        hidden_act=str(getattr(cfg, "hidden_act", "silu")),
        torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
        fp8_block=scheme.block if scheme is not None else None,
    )
