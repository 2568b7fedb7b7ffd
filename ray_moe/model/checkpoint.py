"""CheckpointIndex: where every expert tensor of a safetensors checkpoint folder lives, and reads of one
expert at a time.

* The tensor -> file map comes from ``model.safetensors.index.json`` when present, else from every
  ``*.safetensors`` file in the folder (each scanned once for its keys). Every referenced file must exist
  and open (a truncated file raises ConfigError naming it).
* The layout is detected per MoE layer, from which names exist for that layer (never assuming layer 0 is
  MoE): ``per_expert`` (one [f, d] / [f, d] / [d, f] tensor per expert: Mixtral ``w1/w3/w2`` or
  ``gate_proj/up_proj/down_proj`` names) or ``fused`` (``gate_up_proj`` [E, 2f, d] with gate rows first and
  ``down_proj`` [E, d, f], as a model's live state dict holds them; ``[E, d, 2f]`` / ``[E, f, d]`` when the
  spec says ``is_transposed``).
* ``validate()`` checks every expert tensor's presence, shape and dtype from the file headers only.
* ``read_expert`` reads only that expert's bytes: per-expert tensors with ``get_tensor``, fused tensors
  with ``get_slice(name)[e]`` (never the whole stacked tensor).
* Block-scaled FP8 checkpoints (``spec.fp8_block``, ``model.quant``): an expert tensor stored as
  float8_e4m3fn codes is read with its scales, ``<name>_scale_inv`` (per-expert ``...gate_proj.weight`` [f, d]
  -> ``...gate_proj.weight_scale_inv`` [ceil(f/b0), ceil(d/b1)] float32; fused ``gate_up_proj`` [E, 2f, d] ->
  ``gate_up_proj_scale_inv`` [E, 2 ceil(f/b0), ceil(d/b1)]: the gate's scale rows then the up's, as
  transformers concatenates them, and ``down_proj_scale_inv`` [E, ceil(d/b0), ceil(f/b1)]), and returned as
  an ``ExpertWeights`` of codes with ``scales`` (never cast). ``read_tensor`` gives any other tensor's values
  (FP8 ones dequantized). A float8 tensor or a scale in a checkpoint that declares no quantization is refused
  (ConfigError naming the tensor and the file), by ``validate`` from the headers and by every read.

A folder without ``config.json`` (the legacy folders ``ray_moe.moe.experts.weights.save_checkpoint`` writes)
gets its spec from the tensor names: per-expert tensors under ``<prefix>.layers.<i>.<block>.experts.<e>``,
shapes from the headers, routers at ``<block>.gate.weight``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ray_moe.core.errors import ConfigError
from ray_moe.moe.experts.fp8 import scale_shape
from ray_moe.moe.experts.weights import ExpertWeights
from ray_moe.model.quant import Fp8Scheme, check_header, dense_tensor, is_fp8, scale_name, scale_of
from ray_moe.model.spec import LayerNames, ModelSpec

INDEX_FILE = "model.safetensors.index.json"

PER_EXPERT = "per_expert"
FUSED = "fused"


@dataclass(frozen=True)
class LayerLayout:
    """How one MoE layer is stored. per_expert: ``gate``/``up``/``down`` are patterns with ``{e}``;
    fused: ``gate``/``up`` both name the stacked gate_up tensor and ``down`` the stacked down tensor.
    router: checkpoint name of the router weight [E, d] (None when the checkpoint has none)."""

    moe_layer: int
    decoder_layer: int
    kind: str
    gate: str
    up: str
    down: str
    router: str | None

    def names(self, expert: int) -> tuple[str, str, str]:
        if self.kind == FUSED:
            return self.gate, self.up, self.down
        return self.gate.format(e=expert), self.up.format(e=expert), self.down.format(e=expert)


class CheckpointIndex:
    """Tensor map and per-layer layouts of one checkpoint folder (see the module docstring).

    ``spec=None``: built from the folder's config.json when there is one (``build_spec``), else inferred
    from the tensor names (legacy per-expert folders).
    """

    def __init__(self, folder: str, spec: ModelSpec | None = None) -> None:
        self.folder = os.fspath(folder)
        if not os.path.isdir(self.folder):
            raise ConfigError(f"checkpoint={self.folder!r}: no such folder")
        self.index_path: str | None = None
        self._where: dict[str, str] = {}  # tensor name -> file path (as the index / the scan says)
        self._file_keys: dict[str, set[str]] = {}  # file path -> names the file really holds
        self._handles: dict[str, Any] = {}
        self._scan()
        if spec is None:
            if os.path.isfile(os.path.join(self.folder, "config.json")):
                from ray_moe.model.spec import build_spec

                spec = build_spec(self.folder)
            else:
                spec = self._legacy_spec()
        self.spec = spec
        self.scheme = (Fp8Scheme(spec.fp8_block, os.path.join(self.folder, "config.json"))
                       if spec.fp8_block is not None else None)
        self.layouts: tuple[LayerLayout, ...] = tuple(self._detect(m) for m in range(spec.num_moe_layers))

    # ------------------------------------------------------------------------------------- file map
    def _scan(self) -> None:
        index = os.path.join(self.folder, INDEX_FILE)
        if os.path.exists(index):
            self.index_path = index
            try:
                with open(index) as fh:
                    weight_map = json.load(fh)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc
            for key, fname in weight_map.items():
                self._where[key] = os.path.join(self.folder, fname)
            files = sorted(set(self._where.values()))
        else:
            files = sorted(os.path.join(self.folder, f) for f in os.listdir(self.folder) if f.endswith(".safetensors"))
            if not files:
                raise ConfigError(f"checkpoint folder={self.folder!r} holds no *.safetensors file")
        for path in files:
            if not os.path.isfile(path):
                raise ConfigError(f"{path}: file named by {self.index_path} does not exist")
            keys = set(self._handle(path).keys())
            self._file_keys[path] = keys
            if self.index_path is None:
                for key in keys:
                    self._where.setdefault(key, path)

    def _handle(self, path: str) -> Any:
        """The open file (one per path per process; threads that read experts at once share it)."""
        h = self._handles.get(path)
        if h is None:
            try:
                h = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as exc:
                raise ConfigError(f"{path}: not a readable safetensors file (truncated or corrupt?): {exc}") from exc
            h = self._handles.setdefault(path, h)  # a thread that opened it too keeps the first handle
        return h

    def __getstate__(self) -> dict[str, Any]:  # open handles stay with the process that opened them
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def __contains__(self, name: str) -> bool:
        path = self._where.get(name)
        return path is not None and name in self._file_keys.get(path, ())

    @property
    def files(self) -> list[str]:
        return sorted(self._file_keys)

    def file_of(self, name: str) -> str:
        """The file holding tensor ``name``; ConfigError naming the tensor and where it was expected."""
        path = self._where.get(name)
        if path is None:
            where = self.index_path or f"any of {[os.path.basename(f) for f in self.files]}"
            raise ConfigError(f"checkpoint {self.folder!r}: tensor {name!r} is missing (not in {where})")
        if name not in self._file_keys[path]:
            raise ConfigError(f"checkpoint {self.folder!r}: tensor {name!r} is missing from {path} "
                              f"(where {self.index_path} says it is)")
        return path

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string such as ``"F32"``/``"BF16"``) from the file header only."""
        sl = self._handle(self.file_of(name)).get_slice(name)
        return tuple(int(x) for x in sl.get_shape()), str(sl.get_dtype())

    # ----------------------------------------------------------------------------------- layouts
    def _detect(self, m: int) -> LayerLayout:
        names: LayerNames = self.spec.names[m]
        decoder = self.spec.moe_layers[m]
        router = next((r for r in names.router if r in self), None)
        for gate, up, down in names.per_expert:
            if all(p.format(e=0) in self for p in (gate, up, down)):
                return LayerLayout(m, decoder, PER_EXPERT, gate, up, down, router)
        for gate_up, down in names.fused:
            if gate_up in self and down in self:
                return LayerLayout(m, decoder, FUSED, gate_up, gate_up, down, router)
        tried = [g.format(e=0) for g, _, _ in names.per_expert] + [gu for gu, _ in names.fused]
        where = self.index_path or f"{[os.path.basename(f) for f in self.files]}"
        raise ConfigError(f"checkpoint {self.folder!r}: MoE layer {m} (decoder layer {decoder}) has no expert "
                          f"tensors in {where}; looked for {tried}")

    def layout(self, moe_layer: int) -> LayerLayout:
        if not 0 <= moe_layer < len(self.layouts):
            raise ConfigError(f"layer={moe_layer} is out of range [0, {len(self.layouts)}) MoE layers of "
                              f"{self.folder!r}")
        return self.layouts[moe_layer]

    def _legacy_spec(self) -> ModelSpec:
        """Spec of a folder without config.json, from per-expert tensor names and header shapes."""
        pat = re.compile(r"^(?P<block>(?:.*\.)?layers\.(?P<layer>\d+)\..+?)\.experts\.(?P<e>\d+)\."
                         r"(?P<w>w1|gate_proj)\.weight$")
        found: dict[int, tuple[str, str]] = {}
        experts: set[int] = set()
        for key in self._where:
            mt = pat.match(key)
            if mt:
                found.setdefault(int(mt["layer"]), (mt["block"], mt["w"]))
                experts.add(int(mt["e"]))
        if not found:
            raise ConfigError(f"checkpoint folder={self.folder!r} has no config.json and holds no per-expert "
                              f"tensors named like 'model.layers.<i>.block_sparse_moe.experts.<e>.w1.weight' "
                              f"or '...mlp.experts.<e>.gate_proj.weight'")
        layers = sorted(found)
        trio = {"w1": ("w1", "w3", "w2"), "gate_proj": ("gate_proj", "up_proj", "down_proj")}
        names = []
        for layer in layers:
            block, w = found[layer]
            g, u, d = (f"{block}.experts.{{e}}.{x}.weight" for x in trio[w])
            names.append(LayerNames(per_expert=((g, u, d),), router=(f"{block}.gate.weight",)))
        first = names[0].per_expert[0][0].format(e=0)
        shape, _ = self.header(first)
        if len(shape) != 2:
            raise ConfigError(f"checkpoint {self.folder!r}: tensor {first!r} has shape {list(shape)}, not [f, d]")
        return ModelSpec(folder=self.folder, model_type=None, architecture=None,
                         num_decoder_layers=layers[-1] + 1, moe_layers=tuple(layers), num_experts=max(experts) + 1,
                         top_k=None, hidden_size=shape[1], ffn_size=shape[0],
                         experts_paths=tuple(n.per_expert[0][0].rsplit(".{e}.", 1)[0] for n in names),
                         router_paths=tuple(n.router[0].rsplit(".", 1)[0] for n in names), names=tuple(names))

    # ----------------------------------------------------------------------------------- validate
    def expected_shapes(self, kind: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(gate, up, down) header shapes of one layer's tensors for a layout kind."""
        e_count, d, f = self.spec.num_experts, self.spec.hidden_size, self.spec.ffn_size
        if kind == PER_EXPERT:
            return (f, d), (f, d), (d, f)
        if self.spec.is_transposed:
            return (e_count, d, 2 * f), (e_count, d, 2 * f), (e_count, f, d)
        return (e_count, 2 * f, d), (e_count, 2 * f, d), (e_count, d, f)

    def validate(self) -> dict[str, Any]:
        """Check, from headers only, that every expert tensor (and router) of every MoE layer exists with
        the expected shape and one common dtype (FP8 codes: with scales of the expected shape), and that no
        tensor of the folder is float8 (or a scale) unless the config declares FP8. Returns a summary; raises
        ConfigError naming the tensor and its file (or the index) on the first problem."""
        for path, keys in sorted(self._file_keys.items()):
            for key in sorted(keys):
                _, dt = self.header(key)
                check_header(key, dt, path, self.folder, self.scheme)
                if self.scheme is not None and is_fp8(dt) and not key.endswith("_scale_inv") \
                        and scale_name(key) not in self:
                    raise ConfigError(f"{path}: FP8 tensor {key!r} has no {scale_name(key)!r} (block scales) in "
                                      f"{self.index_path or 'the folder'}; it cannot be read without them")
        dtype: str | None = None
        e_count, d = self.spec.num_experts, self.spec.hidden_size
        counts = {PER_EXPERT: 0, FUSED: 0}
        for lay in self.layouts:
            want = self.expected_shapes(lay.kind)
            experts = range(e_count) if lay.kind == PER_EXPERT else range(1)
            for e in experts:
                for name, shape in zip(dict.fromkeys(lay.names(e)), (want[0], want[2]) if lay.kind == FUSED else want):
                    got, dt = self.header(name)
                    if got != shape:
                        raise ConfigError(f"{self.file_of(name)}: tensor {name!r} has shape {list(got)}, expected "
                                          f"{list(shape)} (MoE layer {lay.moe_layer}, {lay.kind} layout)")
                    if dtype is None:
                        dtype = dt
                    elif dt != dtype:
                        raise ConfigError(f"{self.file_of(name)}: tensor {name!r} has dtype {dt}, other expert "
                                          f"tensors are {dtype}")
                    if is_fp8(dt):
                        sgot, _ = self.header(scale_name(name))
                        swant = self._scale_shape(lay.kind, name == lay.down, shape)
                        if sgot != swant:
                            raise ConfigError(f"{self.file_of(scale_name(name))}: scales {scale_name(name)!r} have "
                                              f"shape {list(sgot)}, expected {list(swant)} for {name!r} "
                                              f"{list(shape)} in blocks of {list(self.scheme.block)} "  # type: ignore[union-attr]
                                              f"(weight_block_size of {self.scheme.config})")  # type: ignore[union-attr]
            if lay.router is None:
                raise ConfigError(f"checkpoint {self.folder!r}: MoE layer {lay.moe_layer} (decoder layer "
                                  f"{lay.decoder_layer}) has no router tensor; looked for "
                                  f"{list(self.spec.names[lay.moe_layer].router)}")
            got, _ = self.header(lay.router)
            if got != (e_count, d):
                raise ConfigError(f"{self.file_of(lay.router)}: router {lay.router!r} has shape {list(got)}, "
                                  f"expected {[e_count, d]}")
            counts[lay.kind] += 1
        return {"folder": self.folder, "moe_layers": len(self.layouts), "dtype": dtype, "layouts": counts,
                "files": len(self._file_keys), "fp8_block": list(self.scheme.block) if self.scheme else None}

    def _scale_shape(self, kind: str, down: bool, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Scales of one stored expert tensor of ``shape``: per-expert and fused down as ``scale_shape``; a fused
        gate_up [E, 2f, d] as the gate's and the up's scale rows concatenated: [E, 2 ceil(f/b0), ceil(d/b1)]."""
        block = self.scheme.block  # type: ignore[union-attr]
        if kind == FUSED and not down:
            e_count, two_f, d = shape
            half = scale_shape((two_f // 2, d), block)
            return (e_count, 2 * half[0], half[1])
        return scale_shape(shape, block)

    # -------------------------------------------------------------------------------------- reads
    def _get(self, name: str) -> torch.Tensor:
        return self._handle(self.file_of(name)).get_tensor(name)

    def _get_row(self, name: str, expert: int) -> torch.Tensor:
        """Row ``expert`` of a stacked tensor; only those bytes are read."""
        return self._handle(self.file_of(name)).get_slice(name)[expert]

    def read_tensor(self, name: str) -> torch.Tensor:
        """The values of any checkpoint tensor: as stored, or, for FP8 codes, dequantized with their block
        scales into float32 (``model.quant.dense_tensor``)."""
        return dense_tensor(name, self._get(name), lambda s: self._get(s) if s in self else None,
                            self.file_of(name), self.folder, self.scheme)

    def _codes(self, name: str, t: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor | None:
        """The float32 scales of an expert tensor read as ``t`` (None when it is not float8); ConfigError when
        the checkpoint declares no FP8 or the scales are missing / misshapen."""
        if not is_fp8(t):
            return None
        if self.scheme is None:
            from ray_moe.model.quant import refuse_unquantized_fp8

            raise refuse_unquantized_fp8(name, t.dtype, self.file_of(name), self.folder)
        return scale_of(name, t, scale, self.file_of(name), self.scheme)

    def read_expert(self, moe_layer: int, expert: int, dtype: torch.dtype | None = None) -> ExpertWeights:
        """One expert's weights (w_gate [f, d], w_up [f, d], w_down [d, f]), in the checkpoint's dtype unless
        ``dtype`` is given. Reads only this expert's bytes. FP8 experts come back as float8_e4m3fn codes with
        their float32 block scales (``ExpertWeights.scales``; ``dtype`` does not apply to codes)."""
        lay = self.layout(moe_layer)
        e_count, f = self.spec.num_experts, self.spec.ffn_size
        if not 0 <= expert < e_count:
            raise ConfigError(f"expert={expert} is out of range [0, {e_count}): checkpoint {self.folder!r} has no "
                              f"tensor {lay.names(expert)[0]!r}")
        names = lay.names(expert)
        if lay.kind == PER_EXPERT:
            g, u, dn = (self._get(n) for n in names)
            scales = [self._codes(n, t, self._get(scale_name(n)) if is_fp8(t) and scale_name(n) in self else None)
                      for n, t in zip(names, (g, u, dn))]
        else:
            gu = self._get_row(lay.gate, expert)  # [2f, d]  ([d, 2f] transposed)
            dn = self._get_row(lay.down, expert)  # [d, f]   ([f, d] transposed)
            if self.spec.is_transposed:
                gu, dn = gu.T, dn.T
            # get_slice rows are views of the whole (memory-mapped) stacked tensor: copy out this expert's
            # rows so each weight owns exactly its bytes and no view of the stack outlives the read
            g, u, dn = (t.clone(memory_format=torch.contiguous_format) for t in (gu[:f], gu[f:], dn))
            scales = [None, None, None]
            if is_fp8(gu):
                if self.scheme is None:
                    self._codes(lay.gate, g, None)  # refused: float8 codes under a config without quantization
                sgu = self._get_row(scale_name(lay.gate), expert) if scale_name(lay.gate) in self else None
                half = scale_shape((f, self.spec.hidden_size), self.scheme.block)  # type: ignore[union-attr]
                if sgu is not None and tuple(sgu.shape) != (2 * half[0], half[1]):
                    raise ConfigError(f"{self.file_of(scale_name(lay.gate))}: scales {scale_name(lay.gate)!r} row "
                                      f"{expert} has shape {list(sgu.shape)}, expected {[2 * half[0], half[1]]} (the "
                                      f"gate's {list(half)} scale rows, then the up's)")
                sg, su = (None, None) if sgu is None else (sgu[:half[0]].clone(), sgu[half[0]:].clone())
                scales[0], scales[1] = self._codes(lay.gate, g, sg), self._codes(lay.gate, u, su)
            if is_fp8(dn):
                sdn = self._get_row(scale_name(lay.down), expert).clone() if scale_name(lay.down) in self else None
                scales[2] = self._codes(lay.down, dn, sdn)
        quantized = [s is not None for s in scales]
        if any(quantized) and not all(quantized):
            raise ConfigError(f"checkpoint {self.folder!r}: MoE layer {moe_layer} expert {expert} stores "
                              f"{[n for n, q in zip(dict.fromkeys(names), quantized) if q]} in FP8 and the rest "
                              f"unquantized; an expert's three weights must share one format")
        want = self.expected_shapes(PER_EXPERT)
        ws = [t if all(quantized) or dtype is None else t.to(dtype) for t in (g, u, dn)]
        for name, t, shape in zip(("w_gate", "w_up", "w_down"), ws, want):
            if tuple(t.shape) != shape:
                raise ConfigError(f"checkpoint {self.folder!r}: MoE layer {moe_layer} expert {expert} {name} has "
                                  f"shape {list(t.shape)}, expected {list(shape)} ({lay.names(expert)})")
        ws = [t.contiguous() for t in ws]
        if all(quantized):
            return ExpertWeights(moe_layer, expert, ws[0], ws[1], ws[2],
                                 tuple(s.contiguous() for s in scales), self.scheme.block)  # type: ignore[union-attr, arg-type]
        return ExpertWeights(moe_layer, expert, ws[0], ws[1], ws[2])

    def read_router(self, moe_layer: int) -> torch.Tensor:
        """Router weight [E, d] float32 of one MoE layer (an FP8 router dequantized with its scales)."""
        lay = self.layout(moe_layer)
        if lay.router is None:
            raise ConfigError(f"checkpoint {self.folder!r}: MoE layer {moe_layer} has no router tensor; looked "
                              f"for {list(self.spec.names[moe_layer].router)}")
        return self.read_tensor(lay.router).to(torch.float32)

    def describe(self) -> dict[str, Any]:
        return {"folder": self.folder, "index": self.index_path, "files": len(self._file_keys),
                "layouts": [lay.kind for lay in self.layouts], **self.spec.describe()}
