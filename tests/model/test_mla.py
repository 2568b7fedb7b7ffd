"""MLA attention on the latent (model/mla.py), on CPU: the absorbed math against transformers' own expansion.

A host whose DeepSeek attention modules are absorbed (``absorb_mla``: ``expand_kv`` passes the latent through,
the attention function attends it) gives the logits of the same host on transformers' path (every context
expanded through kv_b_proj), over prefill, mixed and decode steps, on the masked backend (every row absorbed)
and on the varlen backend (the leading one-row group absorbed through the decode contract, the other rows over
their expanded contexts). The Triton decode kernel is compared with its reference under Triton's interpreter
(``TRITON_INTERPRET=1``; skipped where Triton is not installed) and on the GPU (``check_mla_decode``).
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch

from ray_moe.core.types import AttentionBackend
from ray_moe.model import mla
from ray_moe.model.attention import sequence_reference
from ray_moe.model.host import ModelHost
from ray_moe.model.kv import SeqChunk
from ray_moe.model.source import HFWeightSource
from ray_moe_dev.testing.local_executor import LocalExecutor

pytestmark = pytest.mark.triton  # its Triton kernels also run under the CPU interpreter (TRITON_INTERPRET=1)

STEPS = [
    [SeqChunk("a", 0, 5), SeqChunk("b", 0, 9)],
    [SeqChunk("a", 5, 1), SeqChunk("b", 9, 4), SeqChunk("c", 0, 7)],  # a decode row first, a chunk, a new prompt
    [SeqChunk("a", 6, 1), SeqChunk("b", 13, 1), SeqChunk("c", 7, 1)],  # a decode step
    [SeqChunk("c", 8, 1), SeqChunk("a", 7, 1)],
]


def _decode_loop(q_lat, q_rot, c, kr, cu_k, scale):
    """The decode contract one sequence at a time, float64: its one query sees every key of its context."""
    out = torch.zeros(q_lat.shape, dtype=torch.float64)
    b = cu_k.tolist()
    for i in range(q_lat.shape[0]):
        if b[i + 1] > b[i]:
            ci, ki = c[b[i]:b[i + 1]].double(), kr[b[i]:b[i + 1]].double()
            s = (q_lat[i].double() @ ci.T + q_rot[i].double() @ ki.T) * scale  # [H, L]
            out[i] = torch.softmax(s, -1) @ ci
    return out


def _case(seed: int, lens: list[int], h: int = 4, r: int = 32, p: int = 16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    k = int(sum(lens))
    return (torch.randn(len(lens), h, r, generator=g).to(dtype), torch.randn(len(lens), h, p, generator=g).to(dtype),
            torch.randn(k, r, generator=g).to(dtype), torch.randn(k, p, generator=g).to(dtype), cu)


def test_the_padded_batch_reference_is_the_per_sequence_softmax():
    ql, qr, c, kr, cu = _case(0, [3, 0, 11, 1, 6])
    got = mla.mla_decode_reference(ql, qr, c, kr, cu, 11, 0.2)
    want = _decode_loop(ql, qr, c, kr, cu, 0.2)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert not got[1].any()  # a sequence with no key: zeros


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("h,r,p,lens", [(4, 32, 16, [3, 0, 40, 1]), (20, 64, 16, [70, 2])])
def test_the_decode_kernel_equals_its_reference_under_the_interpreter(h, r, p, lens):
    pytest.importorskip("triton")
    ql, qr, c, kr, cu = _case(1, lens, h, r, p)
    got = mla.mla_decode(ql, qr, c, kr, cu, max(lens), 0.3)
    want = _decode_loop(ql, qr, c, kr, cu, 0.3)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("masked", [False, True])
def test_the_masked_backend_blocks_its_scores_by_query_rows(masked):
    """attend_masked a few query rows at a time (its scores bounded: a 16,384-token float32 step otherwise took
    4.5 GiB at once and its capture ran out of memory) equals one block of every row, causal or masked."""
    g = torch.Generator().manual_seed(7)
    h, nope, v, r, p, n, k = 4, 8, 6, 32, 16, 9, 13
    w = torch.randn(h, nope + v, r, generator=g)
    ab = mla.Absorbed(w_uk=w[:, :nope], w_uv=w[:, nope:], expand=None, decode=mla.mla_decode_reference)
    q, c, kr = torch.randn(n, h, nope + p, generator=g), torch.randn(k, r, generator=g), torch.randn(k, p, generator=g)
    mask = None
    if masked:
        mask = torch.where(torch.rand(n, k, generator=g) < 0.3, torch.finfo(torch.float32).min, 0.0)
        mask[:, 0] = 0.0
    whole = mla.attend_masked(ab, q, c, kr, mask, 0.3)
    blocked = mla.attend_masked(ab, q, c, kr, mask, 0.3, block_bytes=2 * h * k * 4)  # two rows a block
    assert blocked.shape == (n, h, v)
    torch.testing.assert_close(blocked, whole, atol=1e-6, rtol=1e-6)
    if not masked:  # causal at the bottom right: the first row sees the keys up to k - n
        s = (torch.einsum("hr,kr->hk", mla.absorb_query(ab, q[:1])[0][0], c[:k - n + 1])
             + q[0, :, nope:] @ kr[:k - n + 1].T) * 0.3
        want = torch.einsum("hk,kr,hvr->hv", torch.softmax(s, -1), c[:k - n + 1], ab.w_uv)
        torch.testing.assert_close(blocked[0], want, atol=1e-5, rtol=1e-5)


def test_the_kernel_is_refused_off_cuda_with_the_reason():
    assert "needs CUDA" in mla.check_mla_decode(torch.device("cpu"), torch.float32, 4, 32, 16)


def _executor(folder):
    return types.SimpleNamespace(layer_entry=LocalExecutor(HFWeightSource(folder)).moe_forward)


def _run(host, ex, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    outs = []
    for chunks in STEPS:
        ids = torch.randint(0, host.vocab_size, (sum(c.num_tokens for c in chunks),), generator=g)
        for c in chunks:
            host.kv.reserve(c.seq_id, c.start + c.num_tokens)
        outs.append(host.forward(chunks, ids, ex))
    return outs


@pytest.mark.parametrize("family,backend", [("deepseek_v3", "masked"), ("deepseek_v3", "varlen"),
                                            ("deepseek_v2", "masked"), ("deepseek_v2", "varlen")])
def test_an_absorbed_host_gives_the_logits_of_transformers_expansion(hf_checkpoint, family, backend):
    """The same DeepSeek checkpoint (V3; V2: its own rotary), two hosts: transformers' path (every context expanded
    each step) and the absorbed one; fp32 logits equal over prefill, mixed and decode steps. Varlen: the
    per-sequence reference is the varlen kernel (the GPU's FlashAttention contract); the one-row group goes through
    the decode contract."""
    _, folder = hf_checkpoint(family)
    kw = dict(attention=AttentionBackend(backend), kv_tokens=512)
    if backend == "varlen":
        kw["varlen_kernel"] = sequence_reference
    plain = ModelHost.from_checkpoint(folder, **kw)
    absorbed = ModelHost.from_checkpoint(folder, **kw)
    assert absorbed.latent_cache and absorbed.mla.modules == 0
    absorbed.mla = mla.absorb_mla(absorbed.model, absorbed.dtype, absorbed.device)
    layers = int(absorbed.config.num_hidden_layers)
    assert absorbed.mla.modules == layers and absorbed.mla.kernel is None and "CUDA" in absorbed.mla.reason
    assert absorbed.mla.dequantized_bytes == 0  # fp32 weights: W_UK / W_UV are views of kv_b_proj's
    m = next(m for m in absorbed.model.modules() if mla.is_mla(m))
    ab = mla.absorbed_of(m)
    assert ab.w_uk.data_ptr() == m.kv_b_proj.weight.data_ptr() and ab.decode is mla.mla_decode_reference
    ex = _executor(folder)
    for got, want in zip(_run(absorbed, ex), _run(plain, ex)):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    # absorbing again changes nothing; restoring gives transformers' path back
    assert mla.absorb_mla(absorbed.model, absorbed.dtype, absorbed.device).modules == 0
    assert mla.restore_mla(absorbed.model) == layers and mla.absorbed_of(m) is None


@pytest.mark.parametrize("in_place", [False, True])
def test_prompt_rows_expand_their_contexts_one_run_at_a_time(hf_checkpoint, monkeypatch, in_place):
    """A step whose prompt sequences' contexts exceed the expansion bound (here 12 keys, as 8,192 on a GPU)
    expands them run by run (``AttentionPlan.rest_groups``), and its logits still equal transformers' expansion
    of every context at once; with the one-row group read in place (gathered keys from the rest) or gathered."""
    from ray_moe.model import attention as attn
    from ray_moe.model.paged_decode import paged_decode_reference

    _, folder = hf_checkpoint("deepseek_v3")
    kw = dict(attention=AttentionBackend.VARLEN, varlen_kernel=sequence_reference, kv_tokens=512)
    plain = ModelHost.from_checkpoint(folder, **kw)
    host = ModelHost.from_checkpoint(folder, **kw, **({"decode_kernel": paged_decode_reference} if in_place else {}))
    host.fuse_kernels()
    assert host.paged_decode is in_place
    monkeypatch.setattr(attn, "EXPAND_KEYS", 12)
    seen = []
    real = mla._expanded

    def spy(*args, **kw):
        if len(args) > 10 and args[10] is not None:
            seen.append([(g.seq_lo, g.seq_hi, g.k_hi - g.k_lo) for g in args[10]])
        return real(*args, **kw)

    monkeypatch.setattr(mla, "_expanded", spy)
    ex = _executor(folder)
    for got, want in zip(_run(host, ex), _run(plain, ex)):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    layers = int(host.config.num_hidden_layers)
    # step 0: a (5 keys) and b (9) in two runs; step 1: b (13: alone, over the bound) then c (7)
    assert seen == [[(0, 1, 5), (1, 2, 9)]] * layers + [[(0, 1, 13), (1, 2, 7)]] * layers


def test_the_latent_cache_is_sized_by_what_it_holds(hf_checkpoint):
    """A latent cache holds R + P numbers per token and layer (not the expanded keys and values of every head):
    the bytes per token the KV budget divides by, against what the cache allocated after a step."""
    _, folder = hf_checkpoint("deepseek_v3")
    host = ModelHost.from_checkpoint(folder, attention=AttentionBackend.MASKED, kv_tokens=64)
    conf = host.config
    want = int(conf.num_hidden_layers) * (int(conf.kv_lora_rank) + int(conf.qk_rope_head_dim)) * 4
    assert host.kv_bytes_per_token() == want
    _run(host, _executor(folder))
    tokens = host.kv.capacity_tokens + 1  # (the trash slot)
    assert host.kv.allocated_bytes() == want * tokens


def test_the_decode_kernel_compiles_for_hopper_at_deepseek_v3s_shape():
    """Triton's compiler (no GPU needed) builds the decode kernel for sm_90 at DeepSeek-V3's latent (R 512,
    P 64, bf16) and its shared memory and registers fit one program (the compile fails otherwise)."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("the kernel is built for the interpreter here, or runs for real (the GPU test)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = mla._kernel()
    for in_place in (False, True):  # over gathered contexts, and the cache read in place (slots, k_end)
        consts = dict(R=512, BR=512, P=64, BP=64, BH=mla.BLOCK_H, BN=mla.BLOCK_N, SLOTS=in_place, END=in_place,
                      PRECISION="tf32")
        types = "*bf16 *bf16 *bf16 *bf16 *bf16 *i32 *i64 *i32 fp32 i32 i32 i32 i32 i32 i32 i32 i32 i32".split()
        sig = dict(zip([a for a in fn.arg_names if a not in consts], types))
        out = triton.compile(ASTSource(fn, {**sig, **{c: "constexpr" for c in consts}}, consts),
                             target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert "mma" in out.asm["ptx"]  # tensor-core products (wgmma or mma), not scalar FMAs


@pytest.mark.gpu
@pytest.mark.parametrize("h,r,p", [(128, 512, 64), (16, 512, 64), (4, 32, 16)])
def test_the_decode_kernel_on_the_gpu(h, r, p):
    """The check the host runs at install, at DeepSeek-V3's shape and the tiny models', then a ragged batch
    with long contexts against the float64 loop (bf16 inputs)."""
    dev = torch.device("cuda")
    assert mla.check_mla_decode(dev, torch.bfloat16, h, r, p) is None
    ql, qr, c, kr, cu = _case(2, [1, 700, 0, 33, 2049], h, r, p, torch.bfloat16)
    args = [t.to(dev) for t in (ql, qr, c, kr, cu)]
    got = mla.mla_decode(*args[:4], args[4], 2049, (r + p) ** -0.5).cpu()
    want = _decode_loop(ql, qr, c, kr, cu, (r + p) ** -0.5)
    assert float((got.double() - want).abs().max() / want.abs().max()) < 2e-2


def test_an_fp8_kv_b_proj_is_dequantized_once_and_counted(hf_checkpoint):
    """An FP8 checkpoint's kv_b_proj (``Fp8Linear``: e4m3 codes + 128 x 128 block scales) gives W_UK / W_UV as
    codes x scales in the host's dtype, held once per module and counted in the host's memory."""
    from ray_moe.model.fp8_linear import Fp8Linear
    from ray_moe.moe.experts.fp8 import dequantize, quantize

    _, folder = hf_checkpoint("deepseek_v3")
    host = ModelHost.from_checkpoint(folder, attention=AttentionBackend.MASKED, kv_tokens=64)
    mods = [m for m in host.model.modules() if mla.is_mla(m)]
    codes, scales = quantize(mods[0].kv_b_proj.weight.detach(), (128, 128))
    mods[0].kv_b_proj = Fp8Linear(codes, scales, (128, 128))
    before = host.memory()["module_bytes"]
    host.mla = mla.absorb_mla(host.model, host.dtype, host.device)
    dense = dequantize(codes, scales, (128, 128), torch.float32)
    assert host.mla.dequantized_bytes == dense.numel() * 4 and host.mla.modules == len(mods)
    ab = mla.absorbed_of(mods[0])
    h, n = int(mods[0].num_heads), int(mods[0].qk_nope_head_dim)
    torch.testing.assert_close(ab.w_uk, dense.view(h, -1, dense.shape[1])[:, :n], rtol=0, atol=0)
    assert host.memory()["module_bytes"] == before + dense.numel() * 4


def test_absorbed_products_carry_no_autograd_from_the_weights_they_view(hf_checkpoint):
    """W_UK / W_UV view a bf16 / float32 kv_b_proj that transformers loads as a Parameter requiring grad: the
    views are detached, so an absorbed product made with grad enabled (a piecewise graph's hole runs between
    replayed pieces) needs no autograd and copies into a static buffer made under ``no_grad`` (the GPU failure of
    82474f4: "a view was created in no_grad mode and is being modified inplace with grad mode enabled")."""
    _, folder = hf_checkpoint("deepseek_v3")
    host = ModelHost.from_checkpoint(folder, attention=AttentionBackend.MASKED, kv_tokens=64)
    mods = [m for m in host.model.modules() if mla.is_mla(m)]
    mods[0].kv_b_proj.weight.requires_grad_(True)
    host.mla = mla.absorb_mla(host.model, host.dtype, host.device)
    ab = mla.absorbed_of(mods[0])
    assert not ab.w_uk.requires_grad and not ab.w_uv.requires_grad
    assert ab.w_uk.data_ptr() == mods[0].kv_b_proj.weight.data_ptr()  # still a view: no second copy
    h, r = int(mods[0].num_heads), int(mods[0].kv_lora_rank)
    q = torch.randn(3, h, ab.nope + int(mods[0].qk_rope_head_dim))
    with torch.no_grad():
        static = torch.zeros(2, 3, h, r)[0]
    with torch.enable_grad():
        q_lat, _ = mla.absorb_query(ab, q)
        assert not q_lat.requires_grad
        static.copy_(q_lat)
        out = mla.absorb_output(ab, q_lat, q.dtype)
    assert not out.requires_grad
    torch.testing.assert_close(static, q_lat)


def test_decode_steps_read_the_latent_in_place_and_mixed_steps_gather(hf_checkpoint):
    """Where the decode attention reads the latent cache in place (the kernel on a GPU; here its torch reference,
    as a caller's reference kernels ask), a decode step's plan names slots and gathers nothing (the steps a decode
    graph captures); a mixed step reads its one-row group in place and gathers (then expands) only the other
    sequences' contexts; logits equal transformers' expansion throughout."""
    from ray_moe.model.paged_decode import paged_decode_reference

    _, folder = hf_checkpoint("deepseek_v3")
    kw = dict(attention=AttentionBackend.VARLEN, varlen_kernel=sequence_reference, kv_tokens=512)
    plain = ModelHost.from_checkpoint(folder, **kw)
    host = ModelHost.from_checkpoint(folder, decode_kernel=paged_decode_reference, **kw)
    assert not host.paged_decode and "latent cache" in host.decode_reason
    host.fuse_kernels()
    assert host.mla.in_place and host.paged_decode and host.decode_reason is None
    ex = _executor(folder)
    for got, want in zip(_run(host, ex), _run(plain, ex)):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    for c in STEPS[1] + STEPS[2]:
        host.kv.reserve(c.seq_id, c.start + c.num_tokens + 8)
    _, decode = host.plan([SeqChunk("a", 8, 1), SeqChunk("b", 14, 1)], np.zeros(2, dtype=np.int64))
    assert decode.in_place and decode.gather is None
    _, mixed = host.plan([SeqChunk("a", 8, 1), SeqChunk("b", 14, 3)], np.zeros(4, dtype=np.int64))
    assert mixed.single_rows == 1 and mixed.slots.numel() == 9 and mixed.gather.numel() == 17  # a's 9 keys, b's 17
    assert not host.cache_gathers and plain.cache_gathers


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on CPU needs TRITON_INTERPRET=1")
def test_the_in_place_kernel_equals_its_reference_under_the_interpreter():
    """Keys through scattered slots, segments with room after them (``k_end``), a sequence with no key."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(4)
    h, r, p, cap = 20, 64, 16, 400
    c, kr = torch.randn(cap, r, generator=g), torch.randn(cap, p, generator=g)
    lens, room = [5, 0, 70, 1], [3, 2, 0, 4]
    slots = torch.randperm(cap, generator=g)[:sum(lens) + sum(room)]
    starts = np.concatenate([[0], np.cumsum(np.add(lens, room))])[:-1]
    cu_k = torch.tensor(np.concatenate([starts, [starts[-1] + lens[-1] + room[-1]]]), dtype=torch.int32)
    k_end = torch.tensor(starts + np.array(lens), dtype=torch.int32)
    ql, qr = torch.randn(4, h, r, generator=g), torch.randn(4, h, p, generator=g)
    got = mla.mla_decode_paged(ql, qr, c, kr, slots, cu_k, k_end, 0.25)
    want = mla.mla_decode_paged_reference(ql, qr, c, kr, slots, cu_k, k_end, 0.25)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not want[1].any()


def test_the_kv_budget_keeps_one_expansion_run(hf_checkpoint):
    """``ModelHost.expansion_bytes``: what expanding one run of ``EXPAND_KEYS`` keys allocates (measured here
    from the module's own expansion of 64 keys: keys, values, values padded to the key size, the kernel's
    contiguous copies), with at most 2x to spare; a cache of keys and values (Qwen3-MoE) keeps none."""
    from ray_moe.model.attention import EXPAND_KEYS

    _, folder = hf_checkpoint("deepseek_v3")
    host = ModelHost.from_checkpoint(folder, attention=AttentionBackend.MASKED, kv_tokens=64)
    host.fuse_kernels()
    m = next(m for m in host.model.modules() if mla.is_mla(m))
    ab = mla.absorbed_of(m)
    c, kr = torch.zeros(64, int(m.kv_lora_rank)), torch.zeros(64, int(m.qk_rope_head_dim))
    key, value = ab.expand(c[None, None], kr[None, None])
    kg, vg = key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous()
    padded = torch.nn.functional.pad(vg, (0, kg.shape[-1] - vg.shape[-1]))
    per_key = sum(t.numel() * t.element_size() for t in (key, value, kg, vg, padded)) / 64
    assert EXPAND_KEYS * per_key <= host.expansion_bytes() <= 2 * EXPAND_KEYS * per_key
    _, qwen = hf_checkpoint("qwen3_moe")
    assert ModelHost.from_checkpoint(qwen, kv_tokens=64).expansion_bytes() == 0


def test_a_refit_measures_the_device_without_the_cache_it_replaces(hf_checkpoint, monkeypatch):
    """``size_kv`` over a cache whose layers are allocated (a refit after the start captures) releases that cache
    before it reads the device's free memory: the new budget counts the old cache's bytes as free. (The device is
    simulated: free memory falls by the old cache's bytes while any reference to it lives.)"""
    import weakref

    _, folder = hf_checkpoint("deepseek_v3")
    host = ModelHost.from_checkpoint(folder, attention=AttentionBackend.MASKED, kv_tokens=256)
    _run(host, _executor(folder))
    for c in STEPS[0] + STEPS[1]:
        host.kv.free(c.seq_id)
    old_bytes, old = host.kv.allocated_bytes(), weakref.ref(host.kv)
    assert old_bytes > 0
    total, used = 1 << 30, 100 << 20  # weights and the rest: 100 MiB of a 1 GiB device

    def mem_get_info(device=None):
        return total - used - (old_bytes if old() is not None else 0), total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    host.device = torch.device("cuda")  # (nothing is allocated on it: the cache allocates at a step)
    tokens = host.size_kv(0.5, 64 << 20)
    per_token = host.kv_bytes_per_token()
    want = ((total // 2) - used - (64 << 20)) // (per_token * host.kv.block_size) * host.kv.block_size
    assert old() is None and tokens == want and host.kv.capacity_tokens == want
