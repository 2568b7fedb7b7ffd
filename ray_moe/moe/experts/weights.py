"""SwiGLU expert weights: seeded initialisation, a writer of legacy Mixtral-named safetensors folders,
digests, and the stacked per-rank layout the runners consume. Pure torch (no Ray).

Checkpoints are read by ``ray_moe.model`` (``CheckpointIndex`` / ``HFWeightSource``: Mixtral, Qwen-MoE,
DeepSeek and legacy folders, per-expert or fused layouts). ``experts_to_wire`` / ``experts_from_wire`` carry
weights between actors as NumPy payloads. A block-scaled FP8 expert (``ExpertWeights.scales``, see
``moe.experts.fp8``) is its float8_e4m3fn codes plus their float32 block scales, always together: in a
record, a slot stack, a digest and on the wire.

One expert computes ``E(x) = (silu(x Wg^T) * (x Wu^T)) Wd^T`` with nn.Linear layout
``w_gate [f, d]``, ``w_up [f, d]``, ``w_down [d, f]``. Mixtral checkpoint names map
``w1 -> w_gate``, ``w3 -> w_up``, ``w2 -> w_down``.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ray_moe.core.wire import pack, unpack
from ray_moe.moe.experts.fp8 import FP8_DTYPE, dequantize, scale_shape

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

MIXTRAL_EXPERT_KEY = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}.weight"
MIXTRAL_ROUTER_KEY = "model.layers.{layer}.block_sparse_moe.gate.weight"
_MIXTRAL_NAMES = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype={name!r} is not one of {sorted(DTYPES)}") from None


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """One logical expert of one layer.

    w_gate: [f, d]   w_up: [f, d]   w_down: [d, f]   (the model dtype; or, quantized, float8_e4m3fn codes)
    scales: None, or the block scales of an FP8 expert (``moe.experts.fp8``): (s_gate [ceil(f/b0), ceil(d/b1)],
        s_up [ceil(f/b0), ceil(d/b1)], s_down [ceil(d/b0), ceil(f/b1)]) float32, ``block`` = (b0, b1); the
        expert's values are codes x the scale of their block (``dequantized``). Codes never travel, sit in a
        slot or are digested without their scales.
    """

    layer: int
    expert: int
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if (self.scales is None) != (self.block is None):
            raise ValueError(f"expert ({self.layer}, {self.expert}): scales and block go together (scales "
                             f"{'set' if self.scales is not None else 'None'}, block={self.block})")
        if self.scales is not None:
            for name, w, s in zip(_WEIGHT_NAMES, self.tensors()[:3], self.scales):
                if w.dtype != FP8_DTYPE or tuple(s.shape) != scale_shape(w.shape, self.block):
                    raise ValueError(f"expert ({self.layer}, {self.expert}) {name}: {w.dtype} {list(w.shape)} with "
                                     f"scales {list(s.shape)}; expected float8_e4m3fn codes with scales "
                                     f"{list(scale_shape(w.shape, self.block))} (blocks of {list(self.block)})")

    @property
    def quantized(self) -> bool:
        """Whether the weights are FP8 codes with block scales."""
        return self.scales is not None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(w_gate, w_up, w_down) and, quantized, then (s_gate, s_up, s_down): the order they travel in."""
        return (self.w_gate, self.w_up, self.w_down, *(self.scales or ()))

    @staticmethod
    def from_tensors(layer: int, expert: int, tensors: Sequence[torch.Tensor],
                     block: Sequence[int] | None = None) -> "ExpertWeights":
        """Inverse of ``tensors()``: three dense tensors, or six (codes then scales) with ``block``."""
        ts = list(tensors)
        if len(ts) != (6 if block is not None else 3):
            raise ValueError(f"tensors: {len(ts)} for expert ({layer}, {expert}), expected "
                             f"{6 if block is not None else 3} (block={block})")
        return ExpertWeights(layer, expert, ts[0], ts[1], ts[2], tuple(ts[3:]) if block is not None else None,
                             tuple(int(b) for b in block) if block is not None else None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def digest(self) -> str:
        """Parameter-state digest: SHA-256 over (layer, expert, dtype, shapes) and a position-weighted
        block checksum of every tensor's bytes, reduced where the tensor lives (one pass over device
        memory, not a host copy). Identical on CPU and CUDA for the same bytes; any changed, swapped or
        shifted 32-bit word changes it. A quantized expert's digest also covers its block size and every
        scale (a scale that changed in a copy changes the digest)."""
        h = hashlib.sha256()
        h.update(f"L{self.layer}E{self.expert}:{self.w_gate.dtype}".encode())
        if self.block is not None:
            h.update(f"block{list(self.block)}".encode())
        for t in self.tensors():
            h.update(str(tuple(t.shape)).encode())
            h.update(block_checksum(t).numpy().tobytes())
        return h.hexdigest()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> "ExpertWeights":
        """Dense weights in ``dtype``: a quantized expert's codes x block scales (one float32 product each, then
        cast); an unquantized one cast."""
        if self.scales is None:
            return ExpertWeights(self.layer, self.expert, *(t.to(dtype) for t in self.tensors()))
        return ExpertWeights(self.layer, self.expert, *(dequantize(w, s, self.block, dtype)
                                                        for w, s in zip(self.tensors()[:3], self.scales)))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "ExpertWeights":
        """On ``device``; ``dtype`` given: the weights' values in that dtype (a quantized expert dequantized,
        never its codes cast). Without a dtype a quantized expert keeps its codes and scales."""
        if dtype is not None and self.scales is not None:
            return self.to(device).dequantized(dtype)
        kw: dict[str, Any] = {"device": device}
        if dtype is not None:
            kw["dtype"] = dtype
        if self.scales is not None:
            return ExpertWeights.from_tensors(self.layer, self.expert, [t.to(device) for t in self.tensors()],
                                              self.block)
        return ExpertWeights(self.layer, self.expert, self.w_gate.to(**kw), self.w_up.to(**kw), self.w_down.to(**kw))


_BLOCK = 4096
_MIX_A = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constants (as signed int64)
_MIX_B = 0xC2B2AE3D27D4EB4F - (1 << 64)


def block_checksum(t: torch.Tensor) -> torch.Tensor:
    """[ceil(nbytes / 16 KiB)] int64 on the CPU: per 4096-word block, sum_i word_i * (i * A + 1), then
    mixed with the block index; int64 arithmetic wraps, so the result is exact and order-free."""
    b = t.detach().contiguous().view(torch.uint8).reshape(-1)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    words = b.view(torch.int32).to(torch.int64)
    nb = -(-words.numel() // _BLOCK)
    if words.numel() < nb * _BLOCK:
        words = torch.cat([words, words.new_zeros(nb * _BLOCK - words.numel())])
    pos = torch.arange(_BLOCK, dtype=torch.int64, device=words.device) * _MIX_A + 1
    sums = (words.view(nb, _BLOCK) * pos).sum(1)
    idx = torch.arange(nb, dtype=torch.int64, device=words.device) * _MIX_B + 7
    return (sums * idx + sums).cpu()


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert on rows ``x`` [n, d] -> [n, d] (no gate applied)."""
    return (torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


@dataclass(eq=False)
class SlotWeights:
    """Weights of the physical slots of one rank for one layer.

    rows None (the plain layout): w_gate [Q_local, f, d], w_up [Q_local, f, d], w_down [Q_local, d, f] in local
    slot order (``stack`` copies, or views ``buf[:Q_local]`` of a shard's slot buffer).
    rows set (row-mapped over a slot buffer): w_gate [C, f, d], w_up [C, f, d], w_down [C, d, f] are the
    layer's whole slot buffer and local slot i lives at buffer row ``rows[i]`` (len Q_local, values in [0, C),
    two slots may share a row). Runners take the plain layout: ``moe.layer.run_experts`` translates a
    row-mapped one (``moe.experts.slab``), except where the skinny kernels read the buffer rows themselves
    (``ExpertRunner.run_indexed`` with ``weight_rows``).
    experts: logical expert per local slot; digests: parameter digest per local slot.
    ``cache`` holds derived layouts and indices (runner layouts, the slab index), built once.
    scales / block: None, or (FP8 slots: w_gate / w_up / w_down are float8_e4m3fn codes) their block scales
    s_gate [N, ceil(f/b0), ceil(d/b1)], s_up (same), s_down [N, ceil(d/b0), ceil(f/b1)] float32 with the same
    leading rows N as the codes (Q_local, or the buffer's C when row-mapped) and ``block`` = (b0, b1). Runners
    take them through ``moe.experts.runners.fp8.Fp8Runner`` (``moe.layer.run_experts`` wraps them).
    """

    layer: int
    slot_ids: tuple[int, ...]
    experts: tuple[int, ...]
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    digests: tuple[str, ...] = ()
    cache: dict[str, Any] = field(default_factory=dict)
    rows: tuple[int, ...] | None = None
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    block: tuple[int, int] | None = None

    @property
    def quantized(self) -> bool:
        """Whether the slots hold FP8 codes with block scales."""
        return self.scales is not None

    @property
    def num_slots(self) -> int:
        return len(self.slot_ids)

    @property
    def hidden_size(self) -> int:
        return int(self.w_gate.shape[2])

    @property
    def ffn_size(self) -> int:
        return int(self.w_gate.shape[1])

    @property
    def row_mapped(self) -> bool:
        """Whether w_gate / w_up / w_down are a whole slot buffer indexed through ``rows``."""
        return self.rows is not None

    def row_of(self, local: int) -> int:
        """The row of ``w_gate`` / ``w_up`` / ``w_down`` holding local slot ``local``."""
        return local if self.rows is None else self.rows[local]

    @staticmethod
    def stack(layer: int, slot_ids: Sequence[int], experts: Sequence[ExpertWeights], digests: Sequence[str] = ()) -> "SlotWeights":
        """A plain SlotWeights holding copies of ``experts`` stacked in local slot order."""
        if len(slot_ids) != len(experts):
            raise ValueError(f"slot_ids: {len(slot_ids)} slots but {len(experts)} expert weights")
        if not experts:
            raise ValueError("experts: a rank with no slot has no SlotWeights")
        if len({w.block for w in experts}) != 1:
            raise ValueError(f"experts: FP8 and dense experts (blocks {sorted({str(w.block) for w in experts})}) "
                             f"cannot share one layer's slots")
        q = experts[0].quantized
        return SlotWeights(
            layer=layer,
            slot_ids=tuple(int(s) for s in slot_ids),
            experts=tuple(w.expert for w in experts),
            w_gate=torch.stack([w.w_gate for w in experts]),
            w_up=torch.stack([w.w_up for w in experts]),
            w_down=torch.stack([w.w_down for w in experts]),
            digests=tuple(digests),
            scales=tuple(torch.stack([w.scales[i] for w in experts]) for i in range(3)) if q else None,  # type: ignore[index]
            block=experts[0].block,
        )

    @staticmethod
    def over_buffer(layer: int, slot_ids: Sequence[int], experts: Sequence[int], w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, rows: Sequence[int],
                    digests: Sequence[str] = (), scales: Sequence[torch.Tensor] | None = None,
                    block: Sequence[int] | None = None) -> "SlotWeights":
        """Slot weights over a slot buffer without a copy: buffers w_gate [C, f, d], w_up [C, f, d],
        w_down [C, d, f], local slot i at buffer row ``rows[i]``. Where rows == (0, ..., Q_local - 1) the
        result is plain (views ``buf[:Q_local]``), else row-mapped over the whole buffer. ``scales``: an FP8
        buffer's scale buffers [C, ...] (viewed alike: a slot's scales stay at its row), with ``block``."""
        rows = tuple(int(r) for r in rows)
        q, c = len(rows), int(w_gate.shape[0])
        if not rows:
            raise ValueError("rows: a rank with no slot has no SlotWeights")
        if len(slot_ids) != q or len(experts) != q:
            raise ValueError(f"rows: {q} rows but {len(slot_ids)} slot ids and {len(experts)} experts")
        if any(not 0 <= r < c for r in rows):
            raise ValueError(f"rows={list(rows)}: every row must lie in the buffer's [0, {c})")
        if tuple(w_up.shape) != tuple(w_gate.shape) or tuple(w_down.shape) != (c, w_gate.shape[2], w_gate.shape[1]):
            raise ValueError(f"w_up / w_down: shapes {tuple(w_up.shape)} / {tuple(w_down.shape)} do not match "
                             f"w_gate {tuple(w_gate.shape)}")
        ident = rows == tuple(range(q))
        if scales is not None and (block is None or len(scales) != 3 or any(int(t.shape[0]) != c for t in scales)):
            raise ValueError(f"scales: three [{c}, ...] scale buffers with a block expected, got "
                             f"{[tuple(t.shape) for t in scales]} and block={block}")
        return SlotWeights(
            layer=layer,
            slot_ids=tuple(int(s) for s in slot_ids),
            experts=tuple(int(e) for e in experts),
            w_gate=w_gate[:q] if ident else w_gate,
            w_up=w_up[:q] if ident else w_up,
            w_down=w_down[:q] if ident else w_down,
            digests=tuple(digests),
            rows=None if ident else rows,
            scales=None if scales is None else tuple(t[:q] if ident else t for t in scales),  # type: ignore[arg-type]
            block=None if block is None else tuple(int(b) for b in block),  # type: ignore[arg-type]
        )

    def expert_weights(self, local: int) -> ExpertWeights:
        r = self.row_of(local)
        return ExpertWeights(self.layer, self.experts[local], self.w_gate[r], self.w_up[r], self.w_down[r],
                             None if self.scales is None else tuple(s[r] for s in self.scales),  # type: ignore[arg-type]
                             self.block)


class WeightSource(ABC):
    """Where expert weights come from. Each rank loads only the experts it hosts."""

    hidden_size: int
    ffn_size: int
    num_experts: int
    num_layers: int
    # ``expert`` may be called from several threads at once (a shard reads its experts in parallel)
    concurrent_reads: bool = False
    # the scale block of the FP8 experts ``expert`` returns (ExpertWeights.block); None: dense experts
    fp8_block: tuple[int, int] | None = None

    @abstractmethod
    def expert(self, layer: int, expert: int) -> ExpertWeights:
        """Weights of one logical expert."""

    @abstractmethod
    def router(self, layer: int) -> torch.Tensor:
        """Router weight [E, d] float32 of one layer."""

    def describe(self) -> dict[str, Any]:
        return {"kind": type(self).__name__}


class SeededWeightSource(WeightSource):
    """Deterministic random weights: expert (layer, e) depends only on (seed, layer, e) (each call its own
    generator: safe to call from several threads).

    With ``tagged=True`` the down projection of expert e is scaled by ``(e + 1)``: every expert shares
    one base function and its output magnitude encodes its own id, so a misplaced slot is visible in the
    output (used by migration tests).

    ``device``: where the generator draws and the weights are returned ("cpu" by default). On "cuda" the
    values come from CUDA's generator (not the CPU draw's values; the same for every process and run on one
    device type): a shard of a checkpoint-sized random shape then draws its experts where they live (the
    CPU draw of Qwen3-30B-A3B's 6,144 experts takes minutes of CPU). The device is named, not held: the
    source pickles to every shard, which draws on its own GPU.
    """

    concurrent_reads = True

    def __init__(self, *, num_layers: int, num_experts: int, hidden_size: int, ffn_size: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32, tagged: bool = False, device: str = "cpu") -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_size = ffn_size
        self.seed = seed
        self.dtype = dtype
        self.tagged = tagged
        self.device = str(torch.device(device))

    def _gen(self, *key: int, device: str = "cpu") -> torch.Generator:
        h = hashlib.sha256(":".join(str(k) for k in (self.seed, *key)).encode()).digest()
        return torch.Generator(device=device).manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert={expert} is out of range [0, {self.num_experts})")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range [0, {self.num_layers})")
        d, f = self.hidden_size, self.ffn_size
        dev = self.device
        g = self._gen(layer, -1 if self.tagged else expert, device=dev)
        wg = torch.randn(f, d, generator=g, device=dev) / d**0.5
        wu = torch.randn(f, d, generator=g, device=dev) / d**0.5
        wd = torch.randn(d, f, generator=g, device=dev) / f**0.5
        if self.tagged:
            wd = wd * float(expert + 1)
        return ExpertWeights(layer, expert, wg.to(self.dtype), wu.to(self.dtype), wd.to(self.dtype))

    def router(self, layer: int) -> torch.Tensor:
        g = self._gen(layer, 10**6)
        return torch.randn(self.num_experts, self.hidden_size, generator=g) / self.hidden_size**0.5

    def describe(self) -> dict[str, Any]:
        return {"kind": "seeded", "seed": self.seed, "tagged": self.tagged, "dtype": str(self.dtype),
                "device": self.device}


def save_checkpoint(source: WeightSource, folder: str, *, shards: int = 1) -> list[str]:
    """Write every expert and router of ``source`` as a Mixtral-style safetensors folder."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(source.num_layers):
        tensors[MIXTRAL_ROUTER_KEY.format(layer=layer)] = source.router(layer).contiguous()
        for e in range(source.num_experts):
            w = source.expert(layer, e)
            for ours, theirs in _MIXTRAL_NAMES.items():
                tensors[MIXTRAL_EXPERT_KEY.format(layer=layer, expert=e, name=theirs)] = getattr(w, ours).contiguous()
    keys = sorted(tensors)
    files = []
    weight_map = {}
    for i in range(shards):
        part = keys[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(folder, fname))
        files.append(fname)
        weight_map.update({k: fname for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh, indent=1)
    return files


_WEIGHT_NAMES = ("w_gate", "w_up", "w_down")


_SCALE_NAMES = ("s_gate", "s_up", "s_down")


def experts_to_wire(weights: Mapping[tuple[int, int], ExpertWeights]) -> dict[str, Any]:
    """(layer, expert) -> ExpertWeights as NumPy payloads (zero-copy through the object store). An FP8 expert's
    codes travel with its scales (``s_gate`` / ``s_up`` / ``s_down``) and its ``block`` [2] int64, in one body."""
    out = {}
    for (l, e), w in weights.items():
        body = {n: t for n, t in zip(_WEIGHT_NAMES + _SCALE_NAMES, w.tensors())}
        if w.block is not None:
            body["block"] = torch.tensor(w.block, dtype=torch.int64)
        out[f"{l}:{e}"] = pack(body)
    return out


def experts_from_wire(payload: Mapping[str, Any]) -> dict[tuple[int, int], ExpertWeights]:
    out = {}
    for key, body in payload.items():
        l, e = (int(x) for x in key.split(":"))
        t = unpack(body)
        block = tuple(int(b) for b in t["block"].tolist()) if "block" in t else None
        names = _WEIGHT_NAMES + (_SCALE_NAMES if block is not None else ())
        out[(l, e)] = ExpertWeights.from_tensors(l, e, [t[n].clone() for n in names], block)
    return out
