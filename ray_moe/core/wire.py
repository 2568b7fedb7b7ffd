"""Wire codecs: how tensors and expert weights travel between the driver and the actors (one module).

Ray pickles torch tensors (slow) but hands NumPy arrays through the object store zero-copy, so every
payload is a NumPy array plus the torch dtype name; dtypes NumPy lacks (bf16, fp8) travel as same-width
integer views.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import numpy as np
import torch

_VIEW_AS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}

Wire = tuple[np.ndarray, str]


def tensor_to_wire(t: torch.Tensor) -> Wire:
    """Tensor -> (NumPy array, torch dtype name)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    view = _VIEW_AS.get(t.dtype)
    arr = (t.view(view) if view is not None else t).numpy()
    return arr, str(t.dtype).removeprefix("torch.")


def wire_to_tensor(arr: np.ndarray, dtype: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse of ``tensor_to_wire`` (read-only object-store arrays are wrapped without a copy)."""
    want = getattr(torch, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    if t.dtype != want:
        t = t.view(want)
    return t.to(device) if str(device) != "cpu" else t


def as_tensor(x: Any, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor from a wire pair, a NumPy array (read-only object-store views are copied) or a tensor."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str):
        return wire_to_tensor(x[0], x[1], device)
    arr = np.asarray(x)
    with np.errstate(all="ignore"):
        t = torch.from_numpy(np.array(arr, copy=not arr.flags.writeable))
    return t.to(device)


def pack(tensors: Mapping[str, torch.Tensor]) -> dict[str, Wire]:
    return {k: tensor_to_wire(v) for k, v in tensors.items()}


def unpack(payload: Mapping[str, Wire], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    return {k: wire_to_tensor(a, d, device) for k, (a, d) in payload.items()}


#: an integer column's wire form: (NumPy dtype string, its bytes)
IntColumn = tuple[str, bytes]


def pack_ints(a: np.ndarray) -> IntColumn:
    """[n] integers -> the narrowest of int16 / int32 / int64 that holds every value (exact), as bytes: the step
    records' columns cross Ray every step, and arguments over 100 KB leave Ray's inline path."""
    a = np.asarray(a)
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    for code, bits in (("<i2", 16), ("<i4", 32)):
        if -(1 << (bits - 1)) <= lo and hi < 1 << (bits - 1):
            return code, a.astype(code).tobytes()
    return "<i8", a.astype("<i8").tobytes()


def unpack_ints(col: IntColumn) -> np.ndarray:
    """``pack_ints``' inverse: [n] int64 (a new, writable array)."""
    return np.frombuffer(col[1], dtype=col[0]).astype(np.int64)


__all__ = ["tensor_to_wire", "wire_to_tensor", "as_tensor", "pack", "unpack", "IntColumn", "pack_ints", "unpack_ints"]
