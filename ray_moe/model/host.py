"""One rank's replica of a model's non-expert modules, built with transformers' own classes (pure: no Ray).

Data-parallel attention, expert-parallel MoE: each rank holds embeddings, attention (with a paged KV cache),
norms, routers, shared experts, dense MLPs and the LM head, and runs them for its own sequences; the routed
experts of every MoE block run through the ``ray_moe`` experts implementation, bound here to the shard's
per-step executor (dispatch -> this rank's slots -> combine across ranks). The experts modules hold no
weights (``bind(..., drop_weights=True)``): a rank allocates only its own expert slots, in the shard core.

    host = ModelHost.from_checkpoint(folder, device="cpu", dtype=torch.float32, kv_tokens=4096)
    logits = host.forward(chunks, token_ids, executor)     # [S, V] float32: one row per sequence
    rows, plan = host.plan(chunks, ids)                    # a step's rows and attention plan (kv.plan_step)
    logits = host.forward_rows(rows, InlineAttention(plan, host.kernels), executor)
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch

from ray_moe.core.errors import ConfigError
from ray_moe.core.types import AttentionBackend
from ray_moe.model import attention as attn
from ray_moe.model import dense_prefill
from ray_moe.model import paged_decode as paged
from ray_moe.model import paged_varlen
from ray_moe.model.fp8_linear import Fp8Linear
from ray_moe.model.mla import AbsorbedMLA, absorb_mla
from ray_moe.model.norms import FusedNorms, fuse_rms_norms
from ray_moe.model.qkv import FusedQKV, fuse_qkv, is_fused
from ray_moe.model.router_topk import FusedRouters, fuse_routers
from ray_moe.model.rotary import FusedRotary, fuse_rotary
from ray_moe.model.kv import PagedKVCache, SeqChunk, StepRows, kv_blocks_for_memory


def _safetensors_files(folder: str) -> dict[str, str]:
    """checkpoint tensor name -> file, from the index when present."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            return {k: os.path.join(folder, f) for k, f in json.load(fh)["weight_map"].items()}
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            path = os.path.join(folder, name)
            with safe_open(path, framework="pt") as fh:
                out.update({k: path for k in fh.keys()})
    return out


def _read_tensor(files: dict[str, str], name: str) -> torch.Tensor | None:
    """Checkpoint tensor ``name`` from whichever file the index names for it (None: no file holds it)."""
    from safetensors import safe_open

    where = files.get(name)
    if where is None:
        return None
    with safe_open(where, framework="pt") as fh:
        return fh.get_tensor(name)


class ModelHost:
    """The non-expert modules of one model on one rank, a paged KV cache, and the step forward.

    The experts modules are bound to ``self.seam``, whose ``moe_forward`` is, during a step, the layer step's
    own entry (``MoEStep.moe_forward``, or the phase split's when a step mixes prefill and decode rows): a MoE
    block reaches its dispatcher in two calls, and outside a step it raises."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, dtype: torch.dtype, kv_tokens: int,
                 block_size: int = 16, attention: AttentionBackend = AttentionBackend.AUTO,
                 varlen_kernel: "attn.VarlenKernel | None" = None,
                 decode_kernel: "paged.DecodeKernel | None" = None,
                 dense_kernel: "attn.DenseKernel | None" = None,
                 dense_rows: int | None = dense_prefill.DENSE_MIN_ROWS) -> None:
        from ray_moe.model.seam import bind, register

        self.model = model
        self.config = model.config
        self.device = device
        self.dtype = dtype
        register()
        self.attention, self.attention_reason = self._pick_attention(AttentionBackend(attention), varlen_kernel)
        # a layer that transforms what it caches before attending (DeepSeek's MLA expands its latent): its
        # attention takes the step's contexts gathered by the cache; once its modules attend the latent
        # (``fuse_kernels``: ``model/mla.py``) its decode steps read the cache in place
        self.latent_cache = getattr(self.config, "kv_lora_rank", None) is not None
        self.mla = AbsorbedMLA()  # which MLA modules attend on their latent (``fuse_kernels``: decode absorbed)
        # a varlen decode step reads the cache in place when the kernel serves here (else it gathers)
        decode, self.decode_reason = self._pick_decode(decode_kernel, varlen_kernel)
        self.reference_decode = decode_kernel is not None  # a caller's decode kernel (MLA: its torch reference)
        # whole-step graphs of token sizes read every row in place where the paged varlen kernel serves here
        in_place, self.paged_reason = self._pick_paged(varlen_kernel)
        # long prompt chunks of eager steps attend through the dense kernel where it serves and is faster here
        # (``dense_rows``: chunks this long or longer, or longer where its start check measured it winning from
        # there; None: none)
        choice = (self._pick_dense(dense_kernel, varlen_kernel) if dense_rows is not None else
                  dense_prefill.DenseChoice(None, 0, "dense_rows=None"))
        dense, self.dense_reason = choice.kernel, choice.reason
        self.dense_rows = None if dense_rows is None else max(int(dense_rows), choice.min_rows)
        self.kernels = attn.Kernels(varlen_kernel or attn.flash_varlen, decode, in_place, dense)
        attn.register()
        self.model.config._attn_implementation = attn.ATTENTION_NAME
        self.seam = _StepSeam()
        self.moe_layers = len(bind(model, self.seam, drop_weights=True))
        self.kv = PagedKVCache(max(1, -(-kv_tokens // block_size)), block_size, device=device, dtype=dtype)
        self.vocab_size = int(self.config.vocab_size)
        self.norms = FusedNorms()  # fuse_kernels: which norm layers take the fused kernel
        self.rotary = FusedRotary()  # and which modeling modules' rotary embedding
        self.routers = FusedRouters()  # which routers take the fused softmax top-k
        self.qkv = FusedQKV()  # which attention modules run one Q/K/V GEMM
        # an FP8 checkpoint's dense projections kept in FP8 (``_load``): {"modules": n, "reasons": {(out, in): why
        # not (None: the kernel serves)}}
        self.fp8_dense: dict[str, Any] = {"modules": 0}

    # ------------------------------------------------------------------ construction
    def _pick_attention(self, want: AttentionBackend, kernel: Any) -> tuple[AttentionBackend, str | None]:
        """(the backend, why not VARLEN when MASKED). VARLEN asked for explicitly with no kernel of the
        caller's must pass the kernel check here, else ``ConfigError`` names the reason."""
        if want is AttentionBackend.MASKED:
            return want, "asked for"
        heads, kv_heads, dq, dv = _attention_dims(self.config)
        why = None if kernel is not None else attn.check_flash(self.device, self.dtype, heads, kv_heads, dq, dv)
        if why is None:
            return AttentionBackend.VARLEN, None
        if want is AttentionBackend.VARLEN:
            raise ConfigError(f"attention={want.value}: {why}")
        return AttentionBackend.MASKED, why

    def _pick_decode(self, kernel: Any, varlen_kernel: Any) -> tuple[Any, str | None]:
        """(the in-place decode kernel or None, why None): a caller's kernel as given; with a caller's varlen
        kernel and no decode kernel, none (the caller's kernel is the reference); else the Triton kernel
        where ``paged_decode.check_paged`` passes."""
        if self.attention is not AttentionBackend.VARLEN:
            return None, "the masked backend gathers the contexts"
        if self.latent_cache:
            return None, "the model's attention expands a latent cache (MLA): its contexts are gathered"
        if kernel is not None:
            return kernel, None
        if varlen_kernel is not None:
            return None, "a caller's varlen kernel attends the gathered contexts"
        heads, kv_heads, dq, dv = _attention_dims(self.config)
        why = paged.check_paged(self.device, self.dtype, heads, kv_heads, dq, dv)
        return (paged.paged_decode if why is None else None), why

    def _pick_paged(self, varlen_kernel: Any) -> tuple[Any, str | None]:
        """(the in-place varlen kernel or None, why None): where ``paged_varlen.check_paged_varlen`` passes on
        the varlen backend; none with a caller's varlen kernel (the caller's kernel is the reference) or a
        latent cache (its contexts are gathered and expanded)."""
        if self.attention is not AttentionBackend.VARLEN:
            return None, "the masked backend gathers the contexts"
        if self.latent_cache:
            return None, ("a latent cache (MLA): its prefill and mixed steps gather the prompt chunks' contexts "
                          "(no in-place varlen kernel on the latent)")
        if varlen_kernel is not None:
            return None, "a caller's varlen kernel attends the gathered contexts"
        heads, kv_heads, dq, dv = _attention_dims(self.config)
        why = paged_varlen.check_paged_varlen(self.device, self.dtype, heads, kv_heads, dq, dv)
        return (paged_varlen.paged_varlen if why is None else None), why

    def _pick_dense(self, kernel: Any, varlen_kernel: Any) -> "dense_prefill.DenseChoice":
        """Long prompt chunks' dense kernel (or None), from which length, and why: a caller's kernel as given; none
        off the varlen backend, for a latent cache (MLA expands its contexts run by run) or beside a caller's varlen
        kernel (the reference); else where ``dense_prefill.check_dense`` finds it equal and faster here."""
        choice = dense_prefill.DenseChoice
        if self.attention is not AttentionBackend.VARLEN:
            return choice(None, 0, "the masked backend attends every chunk")
        if self.latent_cache:
            return choice(None, 0, "a latent cache (MLA): its prompt chunks attend in expansion runs")
        if kernel is not None:
            return choice(kernel, 0, "a caller's dense kernel")
        if varlen_kernel is not None:
            return choice(None, 0, "a caller's varlen kernel attends every chunk")
        heads, kv_heads, dq, dv = _attention_dims(self.config)
        return dense_prefill.check_dense(self.device, self.dtype, heads, kv_heads, dq, dv, attn.flash_varlen,
                                         attn.sequence_reference)

    @staticmethod
    def skeleton(config: Any, dtype: torch.dtype) -> torch.nn.Module:
        """The transformers model on the meta device (no memory), eager attention over packed sequences."""
        from transformers import AutoModelForCausalLM

        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()

    @classmethod
    def from_checkpoint(cls, folder: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        kv_tokens: int = 4096, block_size: int = 16, fp8_dense: bool | None = None,
                        **kw: Any) -> "ModelHost":
        """Every non-expert tensor read from ``folder`` (names mapped with transformers' own renamings).
        ``fp8_dense``: an FP8 checkpoint's dense projections kept in FP8 (``_load``). ``kw``: the attention
        backend (``attention``, ``varlen_kernel``, ``decode_kernel``)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        host = cls(cls.skeleton(config, dtype), device=torch.device(device), dtype=dtype, kv_tokens=kv_tokens,
                   block_size=block_size, **kw)
        host._materialize()
        host._load(folder, fp8_dense)
        if os.path.exists(os.path.join(folder, "generation_config.json")):
            from transformers import GenerationConfig

            host.model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
        return host

    @classmethod
    def random(cls, config: Any, *, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
               kv_tokens: int = 4096, block_size: int = 16, **kw: Any) -> "ModelHost":
        """Seeded random non-expert weights for a config (benchmarks of checkpoint-sized shapes)."""
        host = cls(cls.skeleton(config, dtype), device=torch.device(device), dtype=dtype, kv_tokens=kv_tokens,
                   block_size=block_size, **kw)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            host._materialize()  # transformers' own initialisation, seeded
        return host

    def _materialize(self) -> None:
        """Allocate every (non-expert) tensor on the device and run transformers' own initialisation, which
        also recomputes the non-persistent buffers (rotary frequencies) the meta skeleton left empty."""
        self.model.to_empty(device=self.device)
        with torch.no_grad():
            self.model.initialize_weights()
        self.model.tie_weights()

    def _load(self, folder: str, fp8_dense: bool | None = None) -> None:
        """Every non-expert tensor of the model from the checkpoint's safetensors files. A block-scaled FP8
        checkpoint (``model.quant``): a swappable projection's float8_e4m3fn weight (``model/fp8_linear.py``:
        attention projections, shared experts, dense MLPs) keeps its codes and ``*_scale_inv`` block scales in an
        ``Fp8Linear`` where the FP8 dense kernel serves (``fp8_dense`` None: where ``fp8_linear_reason`` says so,
        once per shape; True / False: always / never); every other float8 tensor is dequantized here, at load,
        into the model dtype: float32(code) x the scale of its block, exactly, then cast (the routed experts keep
        codes and scales in the shard's slots). A quantization ray-moe does not serve (checked before any tensor
        is read), or a float8 tensor under a config that declares none, raises ConfigError naming the method /
        the tensor and the file."""
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        from ray_moe.model.quant import read_quantization

        scheme = read_quantization(folder)
        renamings = [w for w in get_model_conversion_mapping(self.model) if isinstance(w, WeightRenaming)]
        params = self.model.state_dict(keep_vars=True)  # parameters and persistent buffers (correction bias)
        wanted = {n for n, p in params.items() if p.numel()}
        files = _safetensors_files(folder)
        loaded: set[str] = set()
        kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module path -> (codes, scales) of an Fp8Linear
        by_file: dict[str, list[tuple[str, str]]] = {}
        for key, path in files.items():
            name, _ = rename_source_key(key, renamings, [])
            if name in wanted:
                by_file.setdefault(path, []).append((key, name))
        with torch.no_grad():
            for path, pairs in by_file.items():
                try:
                    with safe_open(path, framework="pt") as fh:
                        for key, name in pairs:
                            raw = fh.get_tensor(key)
                            module = self._fp8_swap(name, raw, scheme, fp8_dense)
                            if module is not None:  # codes and scales kept: swapped after every tensor is read
                                kept[module] = (raw, self._fp8_scale(key, raw, path, files, scheme))
                                loaded.add(name)
                                continue
                            t = self._dense(key, raw, path, files, folder, scheme)
                            if tuple(t.shape) != tuple(params[name].shape):
                                raise ConfigError(f"checkpoint {path!r}: tensor {key!r} has shape {list(t.shape)} but "
                                                  f"the model's {name!r} is {list(params[name].shape)}")
                            params[name].copy_(t.to(params[name].dtype))
                            loaded.add(name)
                except ConfigError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a truncated or unreadable file: name it
                    raise ConfigError(f"checkpoint file {path!r} cannot be read: {exc}") from None
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        missing = sorted(wanted - loaded - ({"lm_head.weight"} if tied else set()))
        if missing:
            raise ConfigError(f"checkpoint {folder!r} has no tensor for the model's {missing[:3]}"
                              f"{' ...' if len(missing) > 3 else ''} ({len(missing)} missing)")
        if tied:
            self.model.tie_weights()
        for path, (codes, scales) in kept.items():  # the modules' dense weights released with them
            parent, attr = path.rpartition(".")[::2]
            owner = self.model.get_submodule(parent)
            bias = getattr(owner, attr).bias
            setattr(owner, attr, Fp8Linear(codes.to(self.device), scales.to(self.device), scheme.block,
                                           None if bias is None else bias.detach()))
        self.fp8_dense["modules"] = len(kept)
        self.fp8_dense["paths"] = sorted(kept)

    def _fp8_swap(self, name: str, t: torch.Tensor, scheme: Any, fp8_dense: bool | None) -> str | None:
        """The module path of parameter ``name`` when its FP8 checkpoint tensor ``t`` stays FP8 (an ``Fp8Linear``),
        else None. The kernel's check runs once per (out, in) shape; a reason not to is kept in ``fp8_dense``."""
        from ray_moe.model.fp8_linear import SWAPPABLE, fp8_linear_reason
        from ray_moe.model.quant import is_fp8

        if fp8_dense is False or scheme is None or not is_fp8(t) or t.dim() != 2 or not name.endswith(".weight"):
            return None
        path = name[: -len(".weight")]
        if path.rpartition(".")[2] not in SWAPPABLE or type(self.model.get_submodule(path)) is not torch.nn.Linear:
            return None
        if fp8_dense is None:
            shape = (int(t.shape[0]), int(t.shape[1]))
            reasons = self.fp8_dense.setdefault("reasons", {})
            if shape not in reasons:
                reasons[shape] = fp8_linear_reason(self.device, self.dtype, *shape, scheme.block)
            if reasons[shape] is not None:
                return None
        return path

    @staticmethod
    def _fp8_scale(key: str, codes: torch.Tensor, path: str, files: dict[str, str], scheme: Any) -> torch.Tensor:
        """The checked float32 block scales of the FP8 tensor ``key`` (whichever file holds them)."""
        from ray_moe.model.quant import scale_name, scale_of

        return scale_of(key, codes, _read_tensor(files, scale_name(key)), path, scheme)

    @staticmethod
    def _dense(key: str, t: torch.Tensor, path: str, files: dict[str, str], folder: str, scheme: Any) -> torch.Tensor:
        """A non-expert checkpoint tensor's values: ``t``, or FP8 codes dequantized with their block scales (read
        from whichever file holds ``<key>_scale_inv``) into float32 (``model.quant.dense_tensor``)."""
        from ray_moe.model.quant import dense_tensor, is_fp8

        if not is_fp8(t):
            return t
        return dense_tensor(key, t, lambda name: _read_tensor(files, name), path, folder, scheme)

    def memory(self) -> dict[str, int]:
        """Bytes this host holds (MEASURED from the tensors): the model's non-expert parameters and buffers and
        absorbed MLA weights dequantized from FP8 (``module_bytes``; the routed experts live in the shard's slot
        buffers) and the KV cache's tensors allocated so far (``kv_bytes``: a layer's are allocated at its first
        step)."""
        seen: set[int] = set()
        module = 0
        for t in (*self.model.parameters(), *self.model.buffers()):
            if t.device.type != "meta" and t.untyped_storage().data_ptr() not in seen:  # (tied weights once)
                seen.add(t.untyped_storage().data_ptr())
                module += t.untyped_storage().nbytes()
        module += self.mla.dequantized_bytes  # an FP8 kv_b_proj's W_UK / W_UV, dequantized once
        return {"module_bytes": module, "kv_bytes": self.kv.allocated_bytes()}

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes over every attention layer (analytical, from the config: keys and values
        of every key/value head; a latent cache (MLA): what it holds, the latent and the rotary key, R + P)."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        layers = int(self.config.num_hidden_layers)
        if self.latent_cache:
            return layers * (int(self.config.kv_lora_rank) + int(self.config.qk_rope_head_dim)) * elem
        _, kv_heads, dq, dv = _attention_dims(self.config)
        return layers * kv_heads * (dq + dv) * elem

    def expansion_bytes(self) -> int:
        """Transient bytes one expansion run takes (a latent cache, MLA: ``EXPAND_KEYS`` gathered keys expanded
        through kv_b_proj into every head's keys [H, dq] and values [H, dv], the values padded to dq and the
        attention kernel's contiguous copies, counted twice); 0 for caches of keys and values. What the KV budget
        keeps beside the shared workspace for a prompt step's attention (82474f4's DeepSeek slice: 11 steps out
        of memory in one pass, its budget then backed off to a quarter)."""
        if not self.latent_cache:
            return 0
        heads, _, dq, dv = _attention_dims(self.config)
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * attn.EXPAND_KEYS * heads * (2 * dq + dv) * elem

    def size_kv(self, memory_fraction: float, workspace_bytes: int) -> int:
        """Re-make the (still empty) cache as large as this process's share of the GPU allows: ``memory_fraction``
        of the device's memory, less what is in use now (weights: this rank's non-expert modules and expert
        slots; other processes), less ``workspace_bytes`` kept for a step's activations and captured graphs.
        Returns the tokens it holds. Raises ``ConfigError`` when not one block fits."""
        if not 0.0 < memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction={memory_fraction}: must be in (0, 1]")
        if self.device.type != "cuda":
            raise ConfigError(f"device {self.device.type}: a memory-sized KV cache needs CUDA (give kv_tokens)")
        if self.kv.sequences():
            raise RuntimeError("size_kv: the cache already holds sequences")
        # the cache held so far goes first (a refit after captures: its layers' tensors are allocated), then the
        # blocks this process's allocator cached (e.g. a device draw's temporaries) count as free
        self.kv = PagedKVCache(1, self.kv.block_size, device=self.device, dtype=self.dtype)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(memory_fraction * total) - (total - free) - int(workspace_bytes)
        per_token = self.kv_bytes_per_token()
        blocks = kv_blocks_for_memory(budget, per_token, self.kv.block_size)
        if blocks < 1:
            raise ConfigError(f"memory_fraction={memory_fraction}: {(total - free) / 2**30:.1f} GiB of "
                              f"{total / 2**30:.1f} GiB are in use and {workspace_bytes / 2**30:.1f} GiB are kept for "
                              f"steps; no KV cache block of {per_token * self.kv.block_size} bytes fits")
        self.kv = PagedKVCache(blocks, self.kv.block_size, device=self.device, dtype=self.dtype)
        return self.kv.capacity_tokens

    def eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence ids (``generation_config`` first, as ``generate`` uses them)."""
        gc = getattr(self.model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def fuse_kernels(self) -> None:
        """The model's RMSNorm layers, rotary embedding and softmax top-k routers take fused kernels where
        those reproduce transformers' own (CUDA with Triton; checked per class / modeling module on this device
        and dtype: ``model.norms``, ``model.rotary``, ``model.router_topk``), and attention modules run one Q/K/V
        GEMM (``model.qkv``): bf16 / fp16 ``nn.Linear`` trios, and an FP8 checkpoint's ``Fp8Linear`` trios (one
        block-FP8 GEMM over the concatenated codes and scales; ``self.qkv.fp8_modules``). The fused weights are
        views of one buffer per module: ``memory`` counts the same bytes. On every device, MLA attention modules
        (DeepSeek) attend on their latent (``model.mla``: decode absorbed, no per-step expansion of the contexts;
        an FP8 kv_b_proj dequantized once, ``self.mla.dequantized_bytes``). Elsewhere nothing changes."""
        self.mla = absorb_mla(self.model, self.dtype, self.device, reference_in_place=self.reference_decode)
        if self.mla.modules and self.varlen:  # MLA decode steps read the latent in place, or say why not
            self.decode_reason = None if self.mla.in_place else (
                f"MLA decode attends its gathered latent: the in-place kernel does not serve here ({self.mla.reason})")
        if self.device.type == "cuda":
            self.norms = fuse_rms_norms(self.model)
            self.rotary = fuse_rotary(self.model, self.device, self.dtype)
            self.routers = fuse_routers(self.model)
            self.qkv = fuse_qkv(self.model)

    def fp8_gemm_shapes(self) -> set[tuple[int, int, tuple[int, int]]]:
        """(out, in, block) of every dense block-FP8 GEMM a step runs: each ``Fp8Linear``'s own, a fused Q/K/V
        trio's concatenated one in place of its three (what ``fp8_kernels.fp8_linear`` is called with)."""
        own = {(m.out_features, m.in_features, tuple(m.block)) for m in self.model.modules()
               if isinstance(m, Fp8Linear) and not is_fused(m)}
        return own | set(self.qkv.fp8_shapes)

    # ------------------------------------------------------------------ one step
    @property
    def varlen(self) -> bool:
        """Steps attend with the varlen backend (per-sequence offsets, no mask)."""
        return self.attention is AttentionBackend.VARLEN

    @property
    def cache_gathers(self) -> bool:
        """The cache hands attention the step's gathered contexts rather than its tensors: a latent cache whose
        modules expand it (transformers' own MLA; absorbed modules read the cache and gather what they need)."""
        return self.latent_cache and self.mla.modules == 0

    @property
    def paged_decode(self) -> bool:
        """One-row sequences read the cache in place (``AttentionPlan.slots``): the decode kernel, or MLA modules
        attending their latent in place (``model/mla.py``; their mixed steps gather only the other sequences')."""
        return self.kernels.decode is not None or (self.mla.in_place and self.varlen)

    @property
    def decode_kernel(self):
        return self.kernels.decode

    @property
    def paged_varlen(self) -> bool:
        """Whole-step graphs of token sizes can read every row in place (``Kernels.paged``)."""
        return self.kernels.paged is not None

    def attention_heads(self) -> tuple[int, int, int, int]:
        """(query heads, key/value heads, query/key head size, value head size)."""
        return _attention_dims(self.config)

    def plan(self, chunks: Sequence[SeqChunk], token_ids: Any, *, rows: int | None = None,
             last_rows: int | None = None) -> tuple[StepRows, "attn.AttentionPlan"]:
        """A step's rows and exact attention plan (``PagedKVCache.plan_step`` with this host's backend)."""
        ids = token_ids.numpy() if isinstance(token_ids, torch.Tensor) else token_ids
        return self.kv.plan_step(chunks, ids.astype("int64", copy=False), self.attention, paged=self.paged_decode,
                                 rows=rows, last_rows=last_rows, mask_dtype=self.dtype,
                                 expand_keys=attn.EXPAND_KEYS if self.latent_cache else None,
                                 dense_rows=self.dense_rows if self.kernels.dense is not None else None)

    @torch.no_grad()
    def forward(self, chunks: Sequence[SeqChunk], token_ids: torch.Tensor, executor: Any) -> torch.Tensor:
        """chunks: the step's sequences in packed order; token_ids: [N] int64 their new tokens (packed).
        Returns [S, V] float32 logits at each sequence's last new token. Positions must be reserved."""
        rows, plan = self.plan(chunks, token_ids.cpu())
        return self.forward_rows(rows, attn.InlineAttention(plan, self.kernels, self.cache_gathers), executor,
                                 gather=plan.gather if self.cache_gathers else None)

    @torch.no_grad()
    def forward_rows(self, rows: StepRows, attention: Any, executor: Any,
                     gather: torch.Tensor | None = None) -> torch.Tensor:
        """The model over one step's rows: logits [L, V] float32 at ``rows.last`` (None: [R, V], every row).
        ``attention``: the step's ``StepAttention`` (every attention layer calls it); ``gather``: a latent
        cache's contexts handed back by ``update`` (``cache_gathers``). No host sync: static rows run inside a
        CUDA graph capture as well."""
        self.seam.moe_forward = executor.layer_entry
        kv = self.kv
        kv.write_index, kv.gather = rows.write_index, gather
        try:
            out = self.model(input_ids=rows.token_ids[None], position_ids=rows.positions[None], attention_mask=None,
                             cache=kv, use_cache=True, logits_to_keep=0 if rows.last is None else rows.last,
                             **{attn.ATTENTION_KW: attention})
            return out.logits[0].float()
        finally:
            self.seam.moe_forward = _outside_step
            kv.write_index = kv.gather = None

    def idle(self, executor: Any, hidden_size: int, top_k: int) -> None:
        """A rank with no sequence this step still joins every MoE layer's collectives, with empty batches."""
        h = torch.zeros(0, hidden_size, dtype=self.dtype, device=self.device)
        ids = torch.zeros(0, top_k, dtype=torch.int64, device=self.device)
        w = torch.zeros(0, top_k, dtype=torch.float32, device=self.device)
        for layer in range(self.moe_layers):
            executor.moe_forward(layer, h, ids, w)


def _attention_dims(config: Any) -> tuple[int, int, int, int]:
    """(query heads, key/value heads, query/key head size, value head size) of a transformers config (MLA:
    the nope + rope query size and its own value size)."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if getattr(config, "qk_rope_head_dim", None) is not None:  # DeepSeek's MLA
        dq = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        return heads, heads, dq, int(getattr(config, "v_head_dim", dq))
    d = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return heads, kv_heads, d, d


def _outside_step(layer: int, *args: Any) -> torch.Tensor:
    raise RuntimeError(f"ModelHost: MoE layer {layer} ran outside a step")


class _StepSeam:
    """What the experts modules are bound to: ``moe_forward(layer, hidden [T, d], ids [T, k], gates [T, k])``
    is re-pointed at each step's layer entry (a plain attribute: no call of this object's own on the path)."""

    def __init__(self) -> None:
        self.moe_forward: Any = _outside_step


__all__ = ["ModelHost"]
