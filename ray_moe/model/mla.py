# ======================================================================================================
#  MLA ATTENTION ON THE LATENT (one rank, one step; pure torch + Triton: no Ray)
#
#   DeepSeek's attention module (transformers') ──> cache.update hands back the step's contexts as the latent
#   c [K, R] (kv_lora_rank) and the rotary key kr [K, P], gathered ──> ``expand_kv`` (swapped here: the
#   latent passes through) ──> the ``ray_moe`` attention function, which finds the module's ``Absorbed``:
#     one-row sequences (decode):  q_lat = q_nope W_UK   [n, H, R]   (the key up-projection absorbed into the
#                                  query: no key or value is ever expanded)
#                                  o_lat = softmax((q_lat c^T + q_rot kr^T) * scale) c   [n, H, R]
#                                  out = o_lat W_UV^T   [n, H, V]
#     prefill chunks:              the module's own ``expand_kv`` on the gathered latent, then the varlen kernel
#     the masked backend (CPU):    every row absorbed, over the plan's mask
#   W_UK [H, N, R] / W_UV [H, V, R] are kv_b_proj's weight [H * (N + V), R] split per head (views of a bf16 /
#   float32 weight; an FP8 checkpoint's codes dequantized once at install)
# ======================================================================================================
"""Multi-head latent attention served on the latent (weight absorption), for DeepSeek-V2 / V3-style models.

transformers' ``DeepseekV3Attention`` caches the compressed latent and rotary key and expands them through
``kv_b_proj`` before attending: for a decode step that is a GEMM over every context token of every sequence
in every layer (the context x R x H(N + V) multiply-adds, ~1.2 TFLOP a layer at 35k context tokens), then keys
and values of H x (N + P) and H x V per token copied. Absorbing ``kv_b_proj`` into the query and the output
(as vLLM's and SGLang's MLA backends do for decode) makes decode attention a single-key-head attention over the
latent itself: R + P per key, no expansion. Prefill chunks keep the expansion (their queries outnumber the
heads' absorbed work there).

The decode kernel (``mla_decode``) is one Triton program per (16 heads, sequence) walking its sequence's latent
keys in tiles with an online softmax in fp32; its contract is ``mla_decode_reference`` (padded batch, torch),
which is also the path where Triton does not serve; ``check_mla_decode`` compares the two on the device at
install. Exactness against transformers' own forward is tested in float32 on CPU (the masked backend).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ray_moe.core.env import triton_interpreted
from ray_moe.core.types import AttentionBackend
from ray_moe.model.paged_decode import dot_precision, pow2_block
from ray_moe.model.swap import restore_forwards

ABSORBED_ATTR = "_ray_moe_mla_absorbed"
BLOCK_H = 16  # heads per program (the rows of its matrix products)
BLOCK_N = 32  # latent keys per inner iteration
MASKED_BLOCK_BYTES = 256 << 20  # the masked backend's scores at once (``attend_masked``)

# (q_lat [n, H, R], q_rot [n, H, P], c [K, R], kr [K, P], cu_k [n + 1] int32, max_k, scale) -> o_lat [n, H, R]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
# (q_lat, q_rot, c_cache [C, R], kr_cache [C, P], slots [K] int64, cu_k int32, k_end [n] int32 or None, scale)
#   -> o_lat [n, H, R]: the latent read in place
PagedFn = Callable[..., torch.Tensor]


@dataclass(frozen=True, eq=False)
class Absorbed:
    """One MLA module's absorbed projections and what the step's attention needs of it.

    w_uk:   [H, N, R] kv_b_proj's key rows per head (N = qk_nope_head_dim, R = kv_lora_rank)
    w_uv:   [H, V, R] its value rows per head (V = v_head_dim)
    expand: the module's own ``expand_kv`` (prefill chunks expand their gathered latent)
    decode: the decode attention on the gathered latent (``mla_decode`` or ``mla_decode_reference``)
    paged:  the decode attention reading the latent cache in place (``mla_decode_paged``; None: decode steps
            gather their contexts)
    """

    w_uk: torch.Tensor
    w_uv: torch.Tensor
    expand: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    decode: DecodeFn
    paged: PagedFn | None = None

    @property
    def nope(self) -> int:
        return int(self.w_uk.shape[1])


@dataclass(frozen=True)
class AbsorbedMLA:
    """What ``absorb_mla`` did: ``modules`` MLA modules attend on their latent; ``kernel``: the decode kernel's
    name, or why the padded-batch reference serves decode (``reason``); ``in_place``: decode steps read the
    latent cache in place (no gather: the steps a decode graph captures); ``dequantized_bytes``: bytes of FP8
    kv_b_proj weights dequantized to keep W_UK / W_UV (0 for bf16 / float32 weights: views)."""

    modules: int = 0
    kernel: str | None = None
    reason: str | None = None
    in_place: bool = False
    dequantized_bytes: int = 0


def is_mla(module: torch.nn.Module) -> bool:
    """A transformers MLA attention module whose latent this module can serve (DeepSeek-V2 / V3 layout)."""
    return all(hasattr(module, a) for a in ("kv_b_proj", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                            "v_head_dim", "num_heads")) and callable(getattr(module, "expand_kv", None))


def _dense_weight(proj: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """kv_b_proj's weight [out, in] in ``dtype`` (a view where it already is; an FP8 ``Fp8Linear``'s codes x block
    scales, dequantized once) and the bytes that took."""
    codes = getattr(proj, "codes", None)
    if codes is not None:
        from ray_moe.moe.experts.fp8 import dequantize

        w = dequantize(codes, proj.scale_inv, proj.block, dtype)
        return w, w.numel() * w.element_size()
    w = proj.weight.detach()  # (a Parameter's views would carry autograd into every absorbed product)
    return (w if w.dtype == dtype else w.to(dtype)), (0 if w.dtype == dtype else w.numel() * dtype.itemsize)


def absorb_mla(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, *,
               reference_in_place: bool = False) -> AbsorbedMLA:
    """Every MLA attention module of ``model`` attends on its latent: its ``expand_kv`` swapped on the instance
    for a pass-through (the original kept in its ``Absorbed``), W_UK / W_UV prepared. Modules already absorbed
    are left alone. The decode kernel where ``check_mla_decode`` passes on ``device``: decode steps then read the
    latent in place; else the reference over gathered contexts (``reference_in_place``: in place through the
    torch reference, a caller's reference kernels: tests)."""
    mods = [m for m in model.modules() if is_mla(m) and not hasattr(m, ABSORBED_ATTR)]
    if not mods:
        return AbsorbedMLA()
    m0 = mods[0]
    reason = check_mla_decode(device, dtype, int(m0.num_heads), int(m0.kv_lora_rank), int(m0.qk_rope_head_dim))
    decode: DecodeFn = mla_decode if reason is None else mla_decode_reference
    paged: PagedFn | None = (mla_decode_paged if reason is None else
                             mla_decode_paged_reference if reference_in_place else None)
    extra = 0
    for m in mods:
        h, n, v, r = int(m.num_heads), int(m.qk_nope_head_dim), int(m.v_head_dim), int(m.kv_lora_rank)
        w, nbytes = _dense_weight(m.kv_b_proj, dtype)
        w = w.view(h, n + v, r)
        extra += nbytes
        ab = Absorbed(w_uk=w[:, :n], w_uv=w[:, n:], expand=m.expand_kv, decode=decode, paged=paged)
        object.__setattr__(m, ABSORBED_ATTR, ab)
        object.__setattr__(m, "expand_kv", _pass_through)
    return AbsorbedMLA(len(mods), "mla_decode" if reason is None else None, reason, paged is not None, extra)


def restore_mla(model: torch.nn.Module) -> int:
    """Every absorbed module expands its latent again (transformers' own path); returns how many."""
    return restore_forwards(model, ABSORBED_ATTR, member="expand_kv")


def _pass_through(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_nope, k_rot


def absorbed_of(module: torch.nn.Module) -> Absorbed | None:
    """The module's ``Absorbed`` (None: it attends on expanded keys)."""
    return getattr(module, ABSORBED_ATTR, None)


def output_dim(module: torch.nn.Module, value: torch.Tensor) -> int:
    """The head size an attention call of ``module`` returns: V for an absorbed module (its ``value`` is the
    rotary key cache), else ``value``'s own."""
    ab = absorbed_of(module)
    return int(value.shape[-1]) if ab is None else int(ab.w_uv.shape[1])


# ---------------------------------------------------------------------------------------------- the math
def absorb_query(ab: Absorbed, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, N + P] -> (q_lat [n, H, R] = q_nope W_UK, q_rot [n, H, P]) in q's dtype: one batched GEMM per
    head in the weights' dtype (bf16 products accumulate in fp32 inside the GEMM; no widened weight copy)."""
    q_nope, q_rot = q[..., :ab.nope], q[..., ab.nope:]
    return torch.einsum("nhd,hdr->nhr", q_nope.to(ab.w_uk.dtype), ab.w_uk).to(q.dtype), q_rot


def absorb_output(ab: Absorbed, o_lat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """o_lat [n, H, R] -> [n, H, V] = o_lat W_UV^T in ``dtype`` (as ``absorb_query``)."""
    return torch.einsum("nhr,hvr->nhv", o_lat.to(ab.w_uv.dtype), ab.w_uv).to(dtype)


def attend_masked(ab: Absorbed, q: torch.Tensor, c: torch.Tensor, kr: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, block_bytes: int = MASKED_BLOCK_BYTES) -> torch.Tensor:
    """Every row absorbed over the gathered latent (the masked backend): q [n, H, N + P], c [K, R], kr [K, P],
    mask [n, K] additive (None: one sequence from position 0, n == K, causal) -> [n, H, V]. The scores [H, rows, K]
    are made a block of query rows at a time, each block's at most ``block_bytes`` (a 16,384-token step of 16
    heads at once: 16 GiB of float32 scores)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    q_lat, q_rot = absorb_query(ab, q)
    n, k, h = int(q.shape[0]), int(c.shape[0]), int(q.shape[1])
    c_acc, kr_acc = c.to(acc), kr.to(acc)
    rows = max(1, block_bytes // max(1, h * k * acc.itemsize))
    blocks = []
    for lo in range(0, n, rows):  # host ints from the shapes: the same blocks in a captured graph
        hi = min(n, lo + rows)
        scores = (torch.einsum("nhr,kr->hnk", q_lat[lo:hi].to(acc), c_acc)
                  + torch.einsum("nhp,kp->hnk", q_rot[lo:hi].to(acc), kr_acc)) * scale
        if mask is None:
            last = k - n + torch.arange(lo, hi, device=q.device)  # each row's last visible key
            scores = scores.masked_fill(torch.arange(k, device=q.device)[None, :] > last[:, None], float("-inf"))
        else:
            scores = scores + mask[lo:hi].to(acc)
        blocks.append(torch.einsum("hnk,kr->nhr", torch.softmax(scores, -1).nan_to_num(0.0), c_acc))
    o_lat = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return absorb_output(ab, o_lat, q.dtype)


def mla_decode_reference(q_lat: torch.Tensor, q_rot: torch.Tensor, c: torch.Tensor, kr: torch.Tensor,
                         cu_k: torch.Tensor, max_k: int, scale: float) -> torch.Tensor:
    """The decode contract as one padded batch (any device; a ``DecodeFn``): sequence i's single query attends
    its keys c / kr [cu_k[i]:cu_k[i + 1]] (every one: it is the last position); softmax in fp32 or wider.
    q_lat [n, H, R], q_rot [n, H, P], c [K, R], kr [K, P] -> o_lat [n, H, R] in q_lat's dtype; a sequence with
    no key gives zeros. Memory: n x max_k x (R + P) of the gathered latent."""
    acc = torch.promote_types(q_lat.dtype, torch.float32)
    n, lmax = int(q_lat.shape[0]), max(1, int(max_k))
    start, lens = cu_k[:-1].to(torch.int64), (cu_k[1:] - cu_k[:-1]).to(torch.int64)
    pos = torch.arange(lmax, device=c.device)
    valid = pos[None, :] < lens[:, None]  # [n, L]
    idx = (start[:, None] + pos[None, :]).clamp(max=max(int(c.shape[0]) - 1, 0))
    if c.shape[0] == 0:
        return torch.zeros_like(q_lat)
    cp, kp = c[idx].to(acc), kr[idx].to(acc)  # [n, L, R], [n, L, P]
    scores = (torch.einsum("nhr,nlr->nhl", q_lat.to(acc), cp) + torch.einsum("nhp,nlp->nhl", q_rot.to(acc), kp)) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("nhl,nlr->nhr", p, cp).to(q_lat.dtype)


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return None

    @triton.jit
    def _mla_decode(ql_ptr, qr_ptr, c_ptr, kr_ptr, o_ptr, cu_k_ptr, slots_ptr, k_end_ptr, scale, H,
                    sql_n, sql_h, sqr_n, sqr_h, sc_k, skr_k, so_n, so_h,
                    R: tl.constexpr, BR: tl.constexpr, P: tl.constexpr, BP: tl.constexpr,
                    BH: tl.constexpr, BN: tl.constexpr, SLOTS: tl.constexpr, END: tl.constexpr,
                    PRECISION: tl.constexpr):
        hb = tl.program_id(0)  # head blocks vary fastest: one sequence's programs run together, its latent in L2
        s = tl.program_id(1)
        heads = hb * BH + tl.arange(0, BH)
        h_ok = heads < H
        r = tl.arange(0, BR)
        p_ = tl.arange(0, BP)
        k0 = tl.load(cu_k_ptr + s).to(tl.int64)
        if END:
            kn = tl.load(k_end_ptr + s) - tl.load(cu_k_ptr + s)
        else:
            kn = tl.load(cu_k_ptr + s + 1) - tl.load(cu_k_ptr + s)
        ql = tl.load(ql_ptr + s * sql_n + heads[:, None] * sql_h + r[None, :], mask=h_ok[:, None] & (r[None, :] < R),
                     other=0.0)
        qr = tl.load(qr_ptr + s * sqr_n + heads[:, None] * sqr_h + p_[None, :], mask=h_ok[:, None] & (p_[None, :] < P),
                     other=0.0)
        qscale = scale * 1.4426950408889634  # the exp2 domain
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, BR], tl.float32)
        for start in range(0, kn, BN):
            keys = start + tl.arange(0, BN)
            k_ok = keys < kn
            rows = k0 + keys
            if SLOTS:  # the latent read in place: the rows the slots name
                rows = tl.load(slots_ptr + rows, mask=k_ok, other=0).to(tl.int64)
            ct = tl.load(c_ptr + rows[:, None] * sc_k + r[None, :], mask=k_ok[:, None] & (r[None, :] < R), other=0.0)
            kt = tl.load(kr_ptr + rows[:, None] * skr_k + p_[None, :], mask=k_ok[:, None] & (p_[None, :] < P),
                         other=0.0)
            sc = (tl.dot(ql, tl.trans(ct), input_precision=PRECISION)
                  + tl.dot(qr, tl.trans(kt), input_precision=PRECISION))
            sc = tl.where(k_ok[None, :], sc * qscale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            pr = tl.exp2(sc - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(pr, 1)
            acc = acc * alpha[:, None] + tl.dot(pr.to(ct.dtype), ct, input_precision=PRECISION)
            m_i = m_new
        res = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(o_ptr + s * so_n + heads[:, None] * so_h + r[None, :], res.to(o_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & (r[None, :] < R))

    return _mla_decode


def available() -> bool:
    """Whether Triton can be imported here (the kernel then still has to pass ``check_mla_decode``)."""
    return _kernel() is not None


def _launch(q_lat, q_rot, c, kr, cu_k, slots, k_end, scale) -> torch.Tensor:
    kern = _kernel()
    if kern is None:
        raise RuntimeError("Triton is not importable here")
    n, h, r = (int(v) for v in q_lat.shape)
    p = int(q_rot.shape[2])
    out = torch.empty_like(q_lat)
    if n == 0:
        return out
    kern[(-(-h // BLOCK_H), n)](q_lat, q_rot, c, kr, out, cu_k, cu_k if slots is None else slots,
                                cu_k if k_end is None else k_end, float(scale), h,
                                q_lat.stride(0), q_lat.stride(1), q_rot.stride(0), q_rot.stride(1),
                                c.stride(0), kr.stride(0), out.stride(0), out.stride(1),
                                R=r, BR=pow2_block(r), P=p, BP=pow2_block(p), BH=BLOCK_H, BN=BLOCK_N,
                                SLOTS=slots is not None, END=k_end is not None,
                                PRECISION=dot_precision(q_lat.dtype), num_warps=4)
    return out


def mla_decode(q_lat: torch.Tensor, q_rot: torch.Tensor, c: torch.Tensor, kr: torch.Tensor, cu_k: torch.Tensor,
               max_k: int, scale: float) -> torch.Tensor:
    """``mla_decode_reference``'s contract in one Triton launch, grid (ceil(H / BLOCK_H), n): the head blocks of a
    sequence are neighbours, so its latent is read from HBM about once and from L2 by the others; last dimensions
    contiguous. ``max_k`` is not needed (each program walks its own keys): kept for the contract."""
    return _launch(q_lat, q_rot, c, kr, cu_k, None, None, scale)


def mla_decode_paged(q_lat: torch.Tensor, q_rot: torch.Tensor, c_cache: torch.Tensor, kr_cache: torch.Tensor,
                     slots: torch.Tensor, cu_k: torch.Tensor, k_end: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The decode contract reading the latent cache in place (a ``PagedFn``): sequence i's keys are the cache
    rows ``slots[cu_k[i]:k_end[i]]`` (``k_end`` None: ``cu_k[i + 1]``); c_cache [C, R], kr_cache [C, P]. One
    launch, no host sync (CUDA-graph capturable: the grid depends on n and H only)."""
    return _launch(q_lat, q_rot, c_cache, kr_cache, cu_k, slots, k_end, scale)


def mla_decode_paged_reference(q_lat: torch.Tensor, q_rot: torch.Tensor, c_cache: torch.Tensor,
                               kr_cache: torch.Tensor, slots: torch.Tensor, cu_k: torch.Tensor,
                               k_end: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``mla_decode_paged``'s contract in torch (any device; reads its lengths on the host: not capturable): each
    sequence's slots gathered, then ``mla_decode_reference``."""
    starts = cu_k[:-1].to(torch.int64) if k_end is None else cu_k[:q_lat.shape[0]].to(torch.int64)
    ends = cu_k[1:].to(torch.int64) if k_end is None else k_end.to(torch.int64)
    pieces = [slots[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
    lens = [int(x.numel()) for x in pieces]
    idx = torch.cat(pieces) if pieces else slots[:0]
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                      device=q_lat.device)
    return mla_decode_reference(q_lat, q_rot, c_cache.index_select(0, idx), kr_cache.index_select(0, idx), cu,
                                max(lens, default=1), scale)


def check_mla_decode(device: torch.device, dtype: torch.dtype, heads: int, rank: int, rope: int) -> str | None:
    """Why ``mla_decode`` cannot serve decode here (None: it can): CUDA, Triton compiling (not its interpreter),
    and the kernel reproducing ``mla_decode_reference`` on a ragged batch (keys 1, 0, 77, 300) at this shape,
    over gathered contexts and in place (``mla_decode_paged``, with and without segment ends)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device.type}: the MLA decode kernel needs CUDA"
    if not available():
        return "Triton is not importable here"
    if triton_interpreted():
        return "Triton runs its CPU interpreter here (TRITON_INTERPRET)"
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        lens = [1, 0, 77, 300]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
        k = sum(lens)
        ql = torch.randn(len(lens), heads, rank, generator=g).to(device, dtype)
        qr = torch.randn(len(lens), heads, rope, generator=g).to(device, dtype)
        c = torch.randn(k, rank, generator=g).to(device, dtype)
        kr = torch.randn(k, rope, generator=g).to(device, dtype)
        scale = (rank + rope) ** -0.5
        want = mla_decode_reference(ql.float(), qr.float(), c.float(), kr.float(), cu, max(lens), scale)
        # over gathered contexts, and in place through slots (without and with segment ends): every variant a
        # step launches compiled here, at install, never on the request path
        perm = torch.randperm(k, generator=g).to(device)
        cc, kk = torch.empty_like(c), torch.empty_like(kr)
        cc[perm], kk[perm] = c, kr  # key j of the packed order lives in cache row perm[j]
        err = 0.0
        for got in (mla_decode(ql, qr, c, kr, cu, max(lens), scale),
                    mla_decode_paged(ql, qr, cc, kk, perm, cu, None, scale),
                    mla_decode_paged(ql, qr, cc, kk, perm, cu, cu[1:].contiguous(), scale)):
            err = max(err, float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    except Exception as exc:  # noqa: BLE001 - the kernel is unavailable here: say why, keep the reference
        return f"the MLA decode kernel failed here: {type(exc).__name__}: {str(exc)[:200]}"
    if not err < 2e-2:
        return f"the MLA decode kernel differs from the reference by {err:.3g} (relative) here"
    return None


def attend_in_place(ab: Absorbed, q: torch.Tensor, c_cache: torch.Tensor, kr_cache: torch.Tensor,
                    slots: torch.Tensor, cu_k: torch.Tensor, k_end: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A decode step over the latent cache read in place: q [n, H, N + P], c_cache [C, R], kr_cache [C, P],
    every row a one-row sequence whose keys the slots name -> [n, H, V]."""
    if ab.paged is None:
        raise RuntimeError("an in-place decode plan reached an MLA module whose decode gathers its contexts")
    q_lat, q_rot = absorb_query(ab, q)
    return absorb_output(ab, ab.paged(q_lat, q_rot, c_cache, kr_cache, slots, cu_k, k_end, scale), q.dtype)


def attend_step(ab: Absorbed, q: torch.Tensor, c_cache: torch.Tensor, kr_cache: torch.Tensor, plan: Any,
                scale: float, varlen: Any) -> torch.Tensor:
    """One attention layer of a step on the latent cache itself (the cache hands an absorbed module its tensors,
    never gathered contexts): q [n, H, N + P] the step's real rows, c_cache [C + 1, R], kr_cache [C + 1, P],
    ``plan`` the step's ``AttentionPlan`` -> [n, H, V].
      MASKED:           the plan's contexts gathered, every row absorbed over its mask
      in place:         a decode step: every row through the in-place decode kernel
      VARLEN + slots:   a mixed step: the leading one-row group in place; the other sequences' contexts (the plan's
                        ``gather``, and only those) gathered and expanded, then ``varlen`` (FlashAttention's contract)
      VARLEN:           the contexts gathered; the leading one-row group (every row when ``max_q`` is 1) absorbed
                        over them, the others expanded (every gathered context: the path without the kernel)"""
    if plan.backend is AttentionBackend.MASKED:
        mask = None if plan.mask is None else plan.mask[0, 0]
        return attend_masked(ab, q, c_cache.index_select(0, plan.gather), kr_cache.index_select(0, plan.gather),
                             mask, scale)
    if plan.in_place:
        return attend_in_place(ab, q, c_cache, kr_cache, plan.slots, plan.cu_k, plan.k_end, scale)
    n = int(q.shape[0])
    if plan.slots is not None:  # 1. the one-row group in place, 2. the others over their own gathered contexts
        nd = int(plan.single_rows)
        parts = [attend_in_place(ab, q[:nd], c_cache, kr_cache, plan.slots, plan.cu_k[:nd + 1], None, scale)]
        rest = plan.cu_q_rest if plan.cu_q_rest is not None else plan.cu_q[nd:] - nd
        parts.append(_expanded(ab, q[nd:], c_cache.index_select(0, plan.gather), kr_cache.index_select(0, plan.gather),
                               rest, plan.cu_k[nd + 1:], plan.max_q, plan.max_k, scale, varlen, plan.rest_groups))
        return torch.cat(parts)
    c, kr = c_cache.index_select(0, plan.gather), kr_cache.index_select(0, plan.gather)
    nd = n if plan.max_q <= 1 else int(plan.single_rows)
    parts = []
    if nd:
        q_lat, q_rot = absorb_query(ab, q[:nd])
        parts.append(absorb_output(ab, ab.decode(q_lat, q_rot, c, kr, plan.cu_k[:nd + 1], plan.max_k, scale), q.dtype))
    if nd < n:
        rest = plan.cu_q_rest if plan.cu_q_rest is not None else plan.cu_q[nd:] - nd
        parts.append(_expanded(ab, q[nd:], c, kr, rest, plan.cu_k[nd:], plan.max_q, plan.max_k, scale, varlen,
                               plan.rest_groups))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _expanded(ab: Absorbed, q: torch.Tensor, c: torch.Tensor, kr: torch.Tensor, cu_q: torch.Tensor,
              cu_k: torch.Tensor, max_q: int, max_k: int, scale: float, varlen: Any,
              groups: Any = None) -> torch.Tensor:
    """Rows over their contexts expanded by the module's own ``expand_kv``: q [m, H, N + P], c [K, R], kr [K, P]
    -> [m, H, V] (``varlen``: values zero-padded to the key head size, the output cut back). ``groups``: the
    plan's ``rest_groups`` (runs of sequences, their rows and keys): one run expanded at a time (~200 KB a key
    at DeepSeek-V3's shape: every context of a long-prompt step at once took gigabytes), None: all at once."""
    if groups is not None:
        return torch.cat([_expanded(ab, q[g.q_lo:g.q_hi], c[g.k_lo:g.k_hi], kr[g.k_lo:g.k_hi],
                                    cu_q[g.seq_lo:g.seq_hi + 1] - g.q_lo, cu_k[g.seq_lo:g.seq_hi + 1] - g.k_lo,
                                    g.max_q, g.max_k, scale, varlen) for g in groups])
    key, value = ab.expand(c[None, None], kr[None, None])  # [1, H, K, N + P], [1, H, K, V]
    kg, vg = key[0].transpose(0, 1), value[0].transpose(0, 1)
    d, dv = int(kg.shape[-1]), int(vg.shape[-1])
    if dv != d:
        vg = torch.nn.functional.pad(vg, (0, d - dv))
    return varlen(q, kg, vg, cu_q, cu_k, max_q, max_k, scale)[..., :dv]


__all__ = ["ABSORBED_ATTR", "Absorbed", "AbsorbedMLA", "absorb_mla", "absorbed_of", "attend_in_place", "attend_masked",
           "attend_step", "check_mla_decode", "is_mla", "output_dim", "mla_decode", "mla_decode_paged",
           "mla_decode_paged_reference", "mla_decode_reference", "restore_mla"]
