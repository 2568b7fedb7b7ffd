# ======================================================================================================
#  TUNED LAUNCH SETTINGS OF THE BLOCK-FP8 KERNELS (one GPU model; pure Python + torch: no Ray)
#
#   ray_moe_bench.fp8_tune on a GPU ──> configs/fp8-<gpu model>.json (measured: the fastest candidate per
#       shape and row count, CUDA-graph replays of the serving entry points)
#   fp8_kernels.fp8_swiglu / fp8_linear (no explicit settings) ──> table_for_device(x.device)
#       ──> .swiglu(d, f, block, rows) / .linear(out, in, block, rows): the entry of the nearest tuned row
#           count at or above ``rows`` (else the largest) ──> SwigluChoice / LinearChoice
#       no table for this GPU model, or no entry for the shape ──> None: the kernels' own heuristics
# ======================================================================================================
"""Launch settings of the block-FP8 kernels chosen by measurement, one JSON table per GPU model (as vLLM keeps its
fused-MoE configs per device): the row tile, column tile, warps and pipeline stages of the expert kernels'
gate/up and down launches, and for a dense FP8 Linear the backend too (ray-moe's Triton kernel or
``torch._scaled_mm``'s blockwise cuBLASLt GEMM, whichever the tuner measured faster at that row count).

Tables are looked up by the exact GPU name CUDA reports (``torch.cuda.get_device_name``), so settings measured on
an H100 never drive an H200; a GPU without a table runs the heuristics of ``fp8_kernels`` (``row_block`` /
``launch_config``). A table is read once per GPU name (``functools.lru_cache``) and checked field by field: a
malformed table is an error naming the file and the field, never a silent fallback.

Table format (``dump_table`` / ``parse_table`` round-trip it)::

    {"device": "NVIDIA H100 80GB HBM3", "measured": {...provenance...},
     "swiglu": {"d=2048,f=768,block=128x128": {"2048": {"gate_up": {"block_m": 16, "block_n": 128, "warps": 4,
                                                                    "stages": 4},
                                                        "down": {...}}}},
     "linear": {"out=4096,in=2048,block=128x128": {"256": {"backend": "triton", "config": {...}},
                                                  "4096": {"backend": "scaled_mm"}}}}

(swiglu rows are routed rows: tokens x top-k.)
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Generic, Iterable, Mapping, TypeVar

import torch

CONFIG_DIR = Path(__file__).with_name("configs")
BLOCK_MS = (16, 32, 64, 128)  # 128: prefill-sized steps (more reuse of each weight tile)
BLOCK_NS = (32, 64, 128)
WARPS = (4, 8)
STAGES = (2, 3, 4, 5)
SPLIT_KS = (1, 2, 4, 8)  # a dense Linear's K blocks over this many programs per tile (FP32 partials, then summed)
T = TypeVar("T")


class LinearBackend(str, Enum):
    """Which GEMM computes a dense block-FP8 Linear."""

    TRITON = "triton"  # fp8_kernels' down kernel over one slot
    SCALED_MM = "scaled_mm"  # torch._scaled_mm, blockwise 1 x 128 by 128 x 128 (cuBLASLt; bf16 / fp16 out)


@dataclass(frozen=True)
class LaunchConfig:
    """One Triton launch: rows per program tile (``block_m``), columns per program (``block_n``; the gate/up
    kernel's is the activation group b1 by construction), warps, software-pipeline stages, and (dense Linears
    only) the programs sharing a tile's K blocks (``split_k``)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    split_k: int = 1

    def __post_init__(self) -> None:
        for name, value, allowed in (("block_m", self.block_m, BLOCK_MS), ("block_n", self.block_n, BLOCK_NS),
                                     ("warps", self.warps, WARPS), ("stages", self.stages, STAGES),
                                     ("split_k", self.split_k, SPLIT_KS)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: must be one of {allowed}")

    def to_json(self) -> dict[str, int]:
        out = {"block_m": self.block_m, "block_n": self.block_n, "warps": self.warps, "stages": self.stages}
        return {**out, "split_k": self.split_k} if self.split_k != 1 else out


@dataclass(frozen=True)
class SwigluChoice:
    """The expert kernels' two launches (they may tile differently: the down launch reads what gate/up wrote)."""

    gate_up: LaunchConfig
    down: LaunchConfig

    def __post_init__(self) -> None:
        if self.gate_up.split_k != 1 or self.down.split_k != 1:
            raise ValueError(f"split_k={self.gate_up.split_k} / {self.down.split_k}: the expert kernels take no split "
                             f"(gate/up's SiLU needs whole sums; a dense Linear's launch may split)")


@dataclass(frozen=True)
class LinearChoice:
    """A dense FP8 Linear: the backend, and the Triton launch when the backend is Triton."""

    backend: LinearBackend
    config: LaunchConfig | None = None

    def __post_init__(self) -> None:
        if (self.backend is LinearBackend.TRITON) != (self.config is not None):
            raise ValueError(f"backend={self.backend.value}: a Triton choice carries its launch config, "
                             f"scaled_mm none (config={self.config})")


@dataclass(frozen=True)
class RowTable(Generic[T]):
    """Choices by tuned row count: ``at(rows)`` is the entry of the smallest tuned count >= rows (a step's
    rows are padded up to the lattice's sizes), else of the largest."""

    rows: tuple[int, ...]
    choices: tuple[T, ...]

    def at(self, rows: int) -> T:
        i = bisect.bisect_left(self.rows, int(rows))
        return self.choices[min(i, len(self.rows) - 1)]


@dataclass(frozen=True)
class TunedTable:
    """One GPU model's measured settings (see the module docstring)."""

    device: str
    swiglu_rows: Mapping[str, RowTable[SwigluChoice]]
    linear_rows: Mapping[str, RowTable[LinearChoice]]
    measured: Mapping[str, Any]

    def swiglu(self, d: int, f: int, block: tuple[int, int], rows: int) -> SwigluChoice | None:
        t = self.swiglu_rows.get(swiglu_key(d, f, block))
        return None if t is None else t.at(rows)

    def linear(self, out_features: int, in_features: int, block: tuple[int, int], rows: int) -> LinearChoice | None:
        t = self.linear_rows.get(linear_key(out_features, in_features, block))
        return None if t is None else t.at(rows)


def swiglu_key(d: int, f: int, block: tuple[int, int]) -> str:
    return f"d={int(d)},f={int(f)},block={int(block[0])}x{int(block[1])}"


def linear_key(out_features: int, in_features: int, block: tuple[int, int]) -> str:
    return f"out={int(out_features)},in={int(in_features)},block={int(block[0])}x{int(block[1])}"


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (the table's file name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def table_path(device_name: str, directory: Path = CONFIG_DIR) -> Path:
    return directory / f"fp8-{device_slug(device_name)}.json"


def _launch(obj: Any, where: str) -> LaunchConfig:
    keys = {"block_m", "block_n", "warps", "stages"}
    if not isinstance(obj, dict) or not keys <= set(obj) <= keys | {"split_k"}:
        raise ValueError(f"{where}: expected {{block_m, block_n, warps, stages[, split_k]}}, got {obj!r}")
    try:
        return LaunchConfig(**{k: int(v) for k, v in obj.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _linear_choice(obj: Any, where: str) -> LinearChoice:
    if not isinstance(obj, dict) or "backend" not in obj:
        raise ValueError(f"{where}: expected {{backend[, config]}}, got {obj!r}")
    try:
        backend = LinearBackend(obj["backend"])
    except ValueError:
        raise ValueError(f"{where}.backend={obj['backend']!r}: must be one of "
                         f"{[b.value for b in LinearBackend]}") from None
    cfg = _launch(obj["config"], f"{where}.config") if obj.get("config") is not None else None
    try:
        return LinearChoice(backend, cfg)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _rows(obj: Any, where: str, parse) -> RowTable:
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"{where}: expected a non-empty {{rows: choice}} object, got {obj!r}")
    items = []
    for k, v in obj.items():
        if not str(k).isdigit() or int(k) < 1:
            raise ValueError(f"{where}: row count {k!r} is not a positive integer")
        items.append((int(k), parse(v, f"{where}[{k}]")))
    items.sort(key=lambda kv: kv[0])
    return RowTable(tuple(k for k, _ in items), tuple(v for _, v in items))


def parse_table(obj: Any, source: str = "<table>") -> TunedTable:
    """A table from its JSON object; a malformed one raises ValueError naming ``source`` and the field."""
    if not isinstance(obj, dict) or not isinstance(obj.get("device"), str):
        raise ValueError(f"{source}: expected an object with a 'device' name")

    def swiglu(v: Any, where: str) -> SwigluChoice:
        if not isinstance(v, dict) or set(v) != {"gate_up", "down"}:
            raise ValueError(f"{where}: expected {{gate_up, down}}, got {v!r}")
        try:
            return SwigluChoice(_launch(v["gate_up"], f"{where}.gate_up"), _launch(v["down"], f"{where}.down"))
        except ValueError as exc:
            raise ValueError(str(exc) if str(exc).startswith(source) else f"{where}: {exc}") from None

    sections = {}
    for name, parse in (("swiglu", swiglu), ("linear", _linear_choice)):
        sec = obj.get(name, {})
        if not isinstance(sec, dict):
            raise ValueError(f"{source}: '{name}' must be an object of shapes")
        sections[name] = {str(k): _rows(v, f"{source}: {name}[{k}]", parse) for k, v in sec.items()}
    return TunedTable(obj["device"], sections["swiglu"], sections["linear"], dict(obj.get("measured", {})))


def dump_table(table: TunedTable) -> dict[str, Any]:
    """The JSON object of ``table`` (``parse_table`` inverts it)."""
    def lin(c: LinearChoice) -> dict[str, Any]:
        return {"backend": c.backend.value, **({"config": c.config.to_json()} if c.config is not None else {})}

    return {"device": table.device, "measured": dict(table.measured),
            "swiglu": {k: {str(r): {"gate_up": c.gate_up.to_json(), "down": c.down.to_json()}
                           for r, c in zip(t.rows, t.choices)} for k, t in table.swiglu_rows.items()},
            "linear": {k: {str(r): lin(c) for r, c in zip(t.rows, t.choices)} for k, t in table.linear_rows.items()}}


@functools.lru_cache(maxsize=8)
def table_for(device_name: str, directory: Path = CONFIG_DIR) -> TunedTable | None:
    """The tuned table of one GPU model (None: none was measured); read once per name and directory."""
    path = table_path(device_name, directory)
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    table = parse_table(obj, str(path))
    if table.device != device_name:
        raise ValueError(f"{path}: device={table.device!r} is not the GPU it is named for ({device_name!r})")
    return table


def table_for_device(device: torch.device) -> TunedTable | None:
    """The table of ``device``'s GPU model (CPU and interpreted runs: None)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return table_for(torch.cuda.get_device_name(device))


def table_file(device: torch.device) -> str | None:
    """The file name of the tuned table that drives the FP8 launches on ``device`` (None: none here, or no CUDA GPU)."""
    table = table_for_device(device)
    return None if table is None else table_path(table.device).name


def untuned_reason(device: torch.device, swiglu: Iterable[tuple[int, int, Any]] = (),
                   linear: Iterable[tuple[int, int, Any]] = ()) -> str | None:
    """Why some FP8 kernel launches on ``device`` take the heuristic settings (None: the GPU model's table covers
    every shape given, or nothing is given, or the device is no CUDA GPU). swiglu: (d, f, block) expert shapes;
    linear: (out, in, block) dense GEMM shapes (a block of None: no FP8 there, skipped)."""
    sw = sorted({(int(d), int(f), tuple(b)) for d, f, b in swiglu if b is not None})
    li = sorted({(int(o), int(i), tuple(b)) for o, i, b in linear if b is not None})
    if device.type != "cuda" or not torch.cuda.is_available() or not (sw or li):
        return None
    name = torch.cuda.get_device_name(device)
    table = table_for(name)
    if table is None:
        return f"no tuned FP8 launch table for this GPU ({name}; {table_path(name).name})"
    missing = ([swiglu_key(*s) for s in sw if swiglu_key(*s) not in table.swiglu_rows] +
               [linear_key(*s) for s in li if linear_key(*s) not in table.linear_rows])
    return f"the tuned FP8 launch table of {name} has no entry for {', '.join(missing)}" if missing else None


__all__ = ["BLOCK_MS", "BLOCK_NS", "CONFIG_DIR", "SPLIT_KS", "LaunchConfig", "LinearBackend", "LinearChoice", "RowTable", "STAGES",
           "SwigluChoice", "TunedTable", "WARPS", "device_slug", "dump_table", "linear_key", "parse_table",
           "swiglu_key", "table_file", "table_for", "table_for_device", "table_path", "untuned_reason"]
