"""Shared base of the analytical ledgers: the ``analytical`` evidence label, count-matrix and integer
checks, the ``as_dict`` record mixin and the declared ``Representation`` (element widths and the
transport metadata schema, spec 0x03D, 0x03D2). Pure: no Ray, no clocks.

Every ledger of ``ray_moe_dev.analysis`` is **analytical**: representation-level row slots, logical bytes and
live-allocation bytes COMPUTED from a count matrix, widths, dtypes and buffer declarations. None of them
is a measured fabric/HBM byte count and none is latency (spec 0x03D: five ledgers stay distinct; the last
two are deliberately unclaimed here). Each record carries ``evidence = "analytical"`` so a report can
never present it as a measurement.

Count matrix ``C``: [P, P] int, ``C[p, u]`` = routes from source rank p to destination rank u over
*global* ranks; the diagonal holds local (same-rank) routes, which stay in the staging layout but do not
traverse a link under the local-bypass policy (0x03D1).

=========================  =========  ====================================  ==========================
record                     spec       question answered                     module
=========================  =========  ====================================  ==========================
``RowSlotLedger``          0x03C1     useful vs uniform padded row slots    ``byte_ledgers``
``PayloadLedger``          0x03D1     staging vs remote row payload bytes   ``byte_ledgers``
``TransportLedger``        0x03D2     metadata, handle state, tables        ``byte_ledgers``
``PaddingLedger``          0x03D6     uniform padding reservation           ``byte_ledgers``
``LifetimeLedger``         0x03D3     half-open live bytes, peak, total     ``lifetime_ledger``
``check_release``          0x03D5     safe release as a last-reader check   ``lifetime_ledger``
``PrecisionPayloadLedger`` 0x0AB      BF16 vs FP8 + FP32 scale payload      ``precision_ledger``
``AlignmentLedger``        0x0AD      local rows under runner alignment     ``precision_ledger``
``StepLedger``             all        the above for one step                ``step_ledger``
=========================  =========  ====================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from numbers import Real
from typing import Any

import torch

ANALYTICAL = "analytical"
MIB = 1 << 20

CountMatrix = tuple[tuple[int, ...], ...]


# ------------------------------------------------------------------------------------------------------
#  helpers
# ------------------------------------------------------------------------------------------------------


def as_count_matrix(counts: Any, name: str = "counts") -> CountMatrix:
    """Normalise a [P, P] count matrix (tensor, ndarray or nested sequence) to a tuple of int tuples.

    Raises ValueError naming ``name`` for a non-square, non-integer or negative matrix.
    """
    if isinstance(counts, torch.Tensor):
        if counts.is_floating_point() or counts.is_complex():
            raise ValueError(f"{name}: expected an integer count matrix, got dtype {counts.dtype}")
        rows = counts.detach().cpu().tolist()
    else:
        rows = [list(r) for r in counts]
    p = len(rows)
    if p == 0:
        raise ValueError(f"{name}: empty count matrix")
    out: list[tuple[int, ...]] = []
    for i, r in enumerate(rows):
        if len(r) != p:
            raise ValueError(f"{name}: row {i} has {len(r)} entries, expected a square [{p}, {p}] matrix")
        vals: list[int] = []
        for j, v in enumerate(r):
            if isinstance(v, bool) or int(v) != v:
                raise ValueError(f"{name}[{i}][{j}]={v!r}: counts must be integers")
            if v < 0:
                raise ValueError(f"{name}[{i}][{j}]={v}: counts must be >= 0")
            vals.append(int(v))
        out.append(tuple(vals))
    return tuple(out)


def positive_int(name: str, value: Any, *, allow_zero: bool = False) -> int:
    """An integer (or integer-valued real) that is > 0, or >= 0 with ``allow_zero``; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, Real) or not float(value).is_integer():
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    v = int(value)
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r}: must be {'>= 0' if allow_zero else '> 0'}")
    return v


def dtype_width(dtype: torch.dtype) -> int:
    """Element width in bytes of a torch dtype (BF16 -> 2, FP8 e4m3 -> 1, INT64 -> 8)."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
    return int(dtype.itemsize)


def _plain(v: Any) -> Any:
    """JSON-ready view: ledgers -> dicts, enums -> values, tuples -> lists."""
    if isinstance(v, LedgerRecord):
        return v.as_dict()
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


class LedgerRecord:
    """Mixin: ``as_dict`` lists the input fields and the derived values named in ``_DERIVED``."""

    _DERIVED: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]
        for name in self._DERIVED:
            out[name] = _plain(getattr(self, name))
        return out


# ------------------------------------------------------------------------------------------------------
#  representation (which widths the byte ledgers assume)
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Representation(LedgerRecord):
    """Declared element widths and the transport metadata schema (spec 0x03D, 0x03D2).

    Defaults are the spec's baseline: BF16 activations and expert outputs, INT64 count/offset
    coordinates, INT32 transport metadata, two metadata fields per remote dispatch row, one handle index
    per remote combine row, eight INT32-sized semantic/physical fields per useful route in the handle.
    This is one selectable schema, not a universal ABI.
    """

    activation_bytes: int = 2  # b_a
    output_bytes: int = 2  # b_o
    coord_bytes: int = 8  # b_c (INT64 counts, offsets, splits)
    meta_bytes: int = 4  # INT32 transport metadata field
    dispatch_meta_fields: int = 2
    combine_meta_fields: int = 1
    handle_fields: int = 8
    evidence: str = ANALYTICAL

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "evidence":
                positive_int(f.name, getattr(self, f.name))

    @staticmethod
    def from_dtypes(activation: torch.dtype = torch.bfloat16, output: torch.dtype = torch.bfloat16,
                    coord: torch.dtype = torch.int64, meta: torch.dtype = torch.int32,
                    **schema: int) -> "Representation":
        """Widths from torch dtypes; ``schema`` overrides the field counts."""
        return Representation(activation_bytes=dtype_width(activation), output_bytes=dtype_width(output),
                              coord_bytes=dtype_width(coord), meta_bytes=dtype_width(meta), **schema)


BASELINE = Representation()
