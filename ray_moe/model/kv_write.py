# ======================================================================================================
#  A STEP'S KEYS AND VALUES INTO THE PAGED CACHE (one rank, one attention layer; torch + Triton: no Ray)
#
#   cache.update (model/kv.py), per layer:
#     a [1, Ha, R, Da], b [1, Hb, R, Db]   the layer's two cached tensors for the step's R rows (keys and values;
#                                           MLA: latent and rotary key), any row / head strides, last dim
#                                           contiguous (a [1, R, H, D] projection viewed head-major, as
#                                           transformers' attention hands them)
#     index [R] int64                       each row's cache slot (padding rows: the trash slot)
#   ──> write_rows: ONE kernel; program i copies rows [i * BLOCK_R, (i + 1) * BLOCK_R) of both tensors to
#       their slots of the buffers  A [C + 1, Ha, Da], B [C + 1, Hb, Db] (contiguous)
#
#  Why: torch writes the two tensors with two ``index_copy_`` launches of a generic indexing kernel. On an H100
#  an 8,192-row prefill step of the Qwen3-30B-A3B shape spent ~24 us in each (4 MB a tensor: a few us of HBM
#  traffic), ~2.6 us each at 48 decode rows, in every layer (bench/results/serving-h100x1-29844fa,
#  step_profile-h100x1-24l-long.json). One kernel reads each row once and writes it once, for both tensors.
#  Same bytes, same slots: ``write_rows_reference`` (the two ``index_copy_`` calls) is the oracle.
# ======================================================================================================
"""One kernel that writes a step's rows of a layer's two cached tensors at their cache slots."""

from __future__ import annotations

import functools

import torch

from ray_moe.core.env import triton_interpreted

ELEMENTS_PER_PROGRAM = 4096  # rows x (heads x dim) one program copies for each tensor, at most


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _write_kv(a_ptr, b_ptr, idx_ptr, ca_ptr, cb_ptr, n_rows, sa_h, sa_r, sb_h, sb_r, WA: tl.constexpr,
                  DA: tl.constexpr, WB: tl.constexpr, DB: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
        # element e of a row of a: head e // DA, dim e % DA (WA = heads x dim; the model's sizes, compiled in); the
        # cache row of slot s starts at s * WA (contiguous [C + 1, Ha, Da])
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        slots = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        r64 = rows.to(tl.int64)
        ea = tl.arange(0, BLOCK_A)
        ma = rmask[:, None] & (ea < WA)[None, :]
        xa = tl.load(a_ptr + r64[:, None] * sa_r + ((ea // DA) * sa_h + ea % DA)[None, :], mask=ma)
        tl.store(ca_ptr + slots[:, None] * WA + ea[None, :], xa, mask=ma)
        eb = tl.arange(0, BLOCK_B)
        mb = rmask[:, None] & (eb < WB)[None, :]
        xb = tl.load(b_ptr + r64[:, None] * sb_r + ((eb // DB) * sb_h + eb % DB)[None, :], mask=mb)
        tl.store(cb_ptr + slots[:, None] * WB + eb[None, :], xb, mask=mb)

    return _write_kv


def available(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, buffers: tuple[torch.Tensor, torch.Tensor]
              ) -> bool:
    """Whether the kernel takes these operands: CUDA tensors (any device under Triton's interpreter), a / b
    [1, H, R, D] with a contiguous last dimension and the dtype of their buffer, buffers [C + 1, H, D] contiguous
    of the same H and D, an int64 index of R slots, Triton importable."""
    ca, cb = buffers
    tensors = (a, b, index, ca, cb)
    if not all(t.is_cuda for t in tensors) and not triton_interpreted():
        return False
    if a.dim() != 4 or b.dim() != 4 or a.shape[0] != 1 or b.shape[0] != 1 or a.shape[2] != b.shape[2]:
        return False
    if index.dtype != torch.int64 or index.dim() != 1 or index.shape[0] != a.shape[2] or not index.is_contiguous():
        return False
    for x, buf in ((a, ca), (b, cb)):
        if (x.dtype != buf.dtype or x.stride(-1) != 1 or not buf.is_contiguous() or buf.dim() != 3
                or tuple(buf.shape[1:]) != (x.shape[1], x.shape[3])):
            return False
    return len({t.device for t in tensors}) == 1 and _kernel() is not None


def write_rows(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor,
               buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Row r of a [1, Ha, R, Da] and of b [1, Hb, R, Db] into ``buffers[0][index[r]]`` / ``buffers[1][index[r]]``
    ([C + 1, H, D] each), in one launch (operands ``available`` takes). Rows sharing a slot (padding rows at
    the trash slot) leave one of theirs, as ``index_copy_`` does."""
    if not available(a, b, index, buffers):
        raise ValueError(f"a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}, index {tuple(index.shape)} "
                         f"{index.dtype}, buffers {[tuple(t.shape) for t in buffers]}: the cache write takes [1, H, R, D] "
                         f"rows of their buffer's dtype (contiguous last dim), int64 slots and contiguous [C + 1, H, D] "
                         f"buffers on one CUDA device")
    _launch(a, b, index, buffers)


def write(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, buffers: tuple[torch.Tensor, torch.Tensor], *,
          fused: bool) -> None:
    """The cache's write of a step's rows: the kernel where ``fused`` (its ``check`` passed) and it takes the
    operands, else ``write_rows_reference`` (which casts and copies whatever arrives). One operand check a call."""
    if fused and available(a, b, index, buffers):
        _launch(a, b, index, buffers)
    else:
        write_rows_reference(a, b, index, buffers)


def _launch(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The kernel over operands ``available`` took."""
    n = int(a.shape[2])
    if n == 0:
        return
    wa, wb = int(a.shape[1] * a.shape[3]), int(b.shape[1] * b.shape[3])
    block_a, block_b = (1 << max(0, w - 1).bit_length() for w in (wa, wb))
    block_r = max(1, min(64, ELEMENTS_PER_PROGRAM // max(block_a, block_b)))
    _kernel()[(-(-n // block_r),)](a, b, index, buffers[0], buffers[1], n, a.stride(1), a.stride(2), b.stride(1),
                                   b.stride(2), WA=wa, DA=int(a.shape[3]), WB=wb, DB=int(b.shape[3]),
                                   BLOCK_R=block_r, BLOCK_A=block_a, BLOCK_B=block_b, num_warps=4)


@functools.lru_cache(maxsize=None)
def check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel does not write this device's caches of ``dtype`` (None: it does), decided once a process per
    device and dtype, when a cache is made (at load, before any capture): it must run here and write what
    ``write_rows_reference`` writes, bit for bit, on strided rows of two head shapes."""
    if device.type != "cuda" and not triton_interpreted():
        return f"device {device.type}: the kernel serves CUDA (index_copy_ writes the cache)"
    if _kernel() is None:
        return "Triton is not importable here (index_copy_ writes the cache)"
    try:
        g = torch.Generator().manual_seed(0)
        wide = torch.randn(1, 37, 5, 16, generator=g).to(device, dtype)
        a, b = wide[:, :, :2].transpose(1, 2), torch.randn(1, 37, 1, 8, generator=g).to(device, dtype).transpose(1, 2)
        index = torch.randperm(64, generator=g)[:37].to(device)
        got = (torch.zeros(65, 2, 16, device=device, dtype=dtype), torch.zeros(65, 1, 8, device=device, dtype=dtype))
        want = tuple(t.clone() for t in got)
        write_rows(a, b, index, got)
        write_rows_reference(a, b, index, want)
        if not all(torch.equal(x, y) for x, y in zip(got, want)):
            return "the kernel's writes differ from index_copy_'s here (index_copy_ writes the cache)"
    except Exception as exc:  # noqa: BLE001 - the kernel does not run here: say why, keep index_copy_
        return f"the kernel failed here: {type(exc).__name__}: {str(exc)[:200]} (index_copy_ writes the cache)"
    return None


def write_rows_reference(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor,
                         buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The same writes with torch (every device and dtype: the CPU path and the kernel's oracle): one
    ``index_copy_`` a tensor, the rows cast to the buffer's dtype."""
    for x, buf in zip((a, b), buffers):  # [1, H, R, D] rows -> [R, H, D] at their slots
        buf.index_copy_(0, index, x.transpose(1, 2).reshape(-1, *buf.shape[1:]).to(buf.dtype))


__all__ = ["ELEMENTS_PER_PROGRAM", "available", "check", "write", "write_rows", "write_rows_reference"]
