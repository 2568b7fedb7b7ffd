# ======================================================================================================
#  RANDOM BLOCK-FP8 CHECKPOINT WRITER (benchmarks: no Ray)
#
#   config dict -> meta model (transformers) -> checkpoint names and shapes (transformers' own
#   ``revert_weight_conversion``: per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, as save_pretrained
#   writes and as Qwen3-30B-A3B-FP8 / DeepSeek-V3 ship) -> shards planned by bytes -> per tensor, on the device:
#       W [out, in] ~ N(0, 1/in) (seeded by (seed, name))  --quantize-->  codes [out, in] float8_e4m3fn
#                                                                       + X.weight_scale_inv [ceil(out/b0),
#                                                                         ceil(in/b1)] float32
#   -> CPU -> one safetensors shard at a time (a writer thread saves shard k while shard k + 1 is drawn)
#   -> model.safetensors.index.json, config.json (quantization_config), tokenizer -> the marker (last).
# ======================================================================================================
"""Random block-FP8 checkpoints of a transformers config, in the layout Qwen3-30B-A3B-FP8 and DeepSeek-V3 ship,
for the serving benchmark's ``--quantization fp8`` (both systems load the same folder).

    python -m ray_moe_bench.fp8_checkpoint --shape qwen3-30b-a3b --layers 48 --dir /tmp/ray-moe-fp8/qwen3-30b-a3b
    python -m ray_moe_bench.fp8_checkpoint --shape deepseek-v3 --fit      # the layer count one GPU holds, no write

What is FP8 (``is_fp8_weight``): every decoder Linear weight (2-D ``model.layers.*.weight``): attention
projections (Qwen3 q/k/v/o; DeepSeek MLA q_a/q_b/kv_a_proj_with_mqa/kv_b/o), each routed expert's
gate/up/down_proj, shared experts, dense MLPs: float8_e4m3fn codes plus ``<name>_scale_inv`` float32 of shape
[ceil(out / 128), ceil(in / 128)] (``ray_moe.moe.experts.fp8.quantize``: scale = block amax / 448). Kept in
bf16: the routers (``mlp.gate.weight``), norms, embeddings and lm_head; DeepSeek's ``e_score_correction_bias`` in
float32, as DeepSeek-V3 ships it. ``config.json``: the config with ``quantization_config`` {quant_method fp8,
activation_scheme dynamic, fmt e4m3, weight_block_size [128, 128], modules_to_not_convert: every module kept in
high precision (as Qwen3-FP8 lists them; vLLM builds Qwen3-MoE's router with the quantization config and skips
exactly the modules listed)}.

Values (numerically sane, ray-moe's seeded scale): every Linear W [out, in] ~ N(0, 1/in) (the scale of ray-moe's
seeded experts, ``SeededWeightSource``), routers included; embeddings ~ N(0, initializer_range^2) (transformers'
own init); norms 1; correction bias 0. Each tensor is drawn by its own generator on the draw device, seeded by
(seed, name): the same folder for the same (config, seed, device type) whatever the shard size (CUDA's values
are not the CPU's).

Reuse (``ensure_checkpoint``): the folder's marker ``ray_moe_fp8.json`` holds a digest of (config, seed, block,
draw device type, writer version) and every file's size; a folder whose marker matches is reused (nothing
written), any other folder this writer made is replaced, a folder it did not make is refused. The marker is
written last: an interrupted write is never reused. One writer at a time per folder (``<dir>.lock``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

import torch

from ray_moe_bench.generate import QUICK, QWEN3_30B_A3B

BLOCK = (128, 128)
MARKER = "ray_moe_fp8.json"
WRITER_VERSION = 1
SHARD_BYTES = 4 << 30  # a few GB per safetensors file
DISK_MARGIN = 2 << 30  # free disk left after a write
KV_SHARE = 0.25  # of the GPU's memory left for KV cache and activations when fitting layers
QWEN3_LAYERS = 48  # Qwen3-30B-A3B's decoder layers: the default for that shape
FP8_ROOT = "/tmp/ray-moe-fp8"  # the checkpoints' default home
#: an H200's memory (141 GB): the fit's GPU when no CUDA device is visible
H200_BYTES = 141 * 10**9
#: tensors kept in float32 (DeepSeek-V3 ships its correction bias so); every other non-FP8 tensor: bf16
FP32_SUFFIXES = (".e_score_correction_bias",)
#: 2-D decoder weights that stay in high precision (routers)
PLAIN_SUFFIXES = (".mlp.gate.weight", ".shared_expert_gate.weight")

#: DeepSeek-V3's shapes (671B): MLA, 256 routed experts + 1 shared, top-8 of 8 groups (4 picked), sigmoid scores
#: with a correction bias, 3 dense layers first; ``num_hidden_layers`` is set by the caller (``layers_that_fit``).
#: No YaRN rope scaling (plain rope at base 10000) and no MTP layer: neither changes a step's work.
DEEPSEEK_V3 = MappingProxyType(dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, topk_method="noaux_tc",
    scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
    num_nextn_predict_layers=0, tie_word_embeddings=False, initializer_range=0.02, num_hidden_layers=4))
DEEPSEEK_V3_QUICK = MappingProxyType(dict(
    DEEPSEEK_V3, vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    max_position_embeddings=2048, num_hidden_layers=2))


class Shape(str, Enum):
    """The model shapes the serving benchmark runs (``--shape``)."""

    QWEN3_30B_A3B = "qwen3-30b-a3b"
    DEEPSEEK_V3 = "deepseek-v3"


#: shape -> (full config, tiny config of ``--quick``)
SHAPES = MappingProxyType({Shape.QWEN3_30B_A3B: (QWEN3_30B_A3B, QUICK),
                           Shape.DEEPSEEK_V3: (dict(DEEPSEEK_V3), dict(DEEPSEEK_V3_QUICK))})


class Kind(str, Enum):
    """How a checkpoint tensor is stored."""

    FP8 = "fp8"  # float8_e4m3fn codes + float32 ``*_scale_inv``
    BF16 = "bf16"
    FP32 = "fp32"


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name, shape and storage; ``layer``: its decoder layer (None: outside them)."""

    name: str
    shape: tuple[int, ...]
    kind: Kind
    layer: int | None

    def nbytes(self, block: Sequence[int] = BLOCK) -> tuple[int, int, int]:
        """(code bytes, scale bytes, other bytes) this tensor takes in the checkpoint."""
        n = math.prod(self.shape)
        if self.kind is Kind.FP8:
            return n, 4 * math.prod((-(-self.shape[0] // block[0]), -(-self.shape[1] // block[1]))), 0
        return 0, 0, n * (4 if self.kind is Kind.FP32 else 2)


@dataclass(frozen=True)
class CheckpointBytes:
    """Tensor bytes of a checkpoint (headers not counted): FP8 codes, their float32 scales, every other tensor."""

    codes: int = 0
    scales: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return self.codes + self.scales + self.other

    def __add__(self, o: CheckpointBytes) -> CheckpointBytes:
        return CheckpointBytes(self.codes + o.codes, self.scales + o.scales, self.other + o.other)

    def as_dict(self) -> dict[str, int]:
        return {"codes": self.codes, "scales": self.scales, "other": self.other, "total": self.total}


@dataclass
class WriteReport:
    """What ``ensure_checkpoint`` did: the folder, whether it was reused, its seconds (the check for a reuse, the
    whole write otherwise; ``write_s``: the write that made the folder), the tensor bytes, the files, and the
    counters (tensors drawn by kind, shards written, bytes written; all 0 on a reuse)."""

    folder: str
    reused: bool
    seconds: float
    write_s: float
    bytes: CheckpointBytes
    files: list[str]
    digest: str
    seed: int
    draw_device: str
    counters: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes"] = self.bytes.as_dict()
        return d


# ================================================================ what the checkpoint holds
def checkpoint_config(conf: dict) -> Any:
    """The transformers config of ``conf`` (a config dict with ``model_type``), no BOS / EOS token (every request
    runs to its budget), ``architectures`` set (vLLM picks its model class by it)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    c = dict(conf)
    config = AutoConfig.for_model(c.pop("model_type"), **c)
    config.eos_token_id = config.bos_token_id = None
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return config


def is_fp8_weight(name: str, shape: Sequence[int]) -> bool:
    """A decoder Linear weight (2-D ``model.layers.*.weight``) other than a router: stored as FP8."""
    return (".layers." in name and name.endswith(".weight") and len(shape) == 2
            and not name.endswith(PLAIN_SUFFIXES))


def tensor_plan(config: Any) -> list[TensorSpec]:
    """Every tensor of the checkpoint of ``config``, in the order written: the names and shapes transformers'
    ``save_pretrained`` writes (its meta model's state dict through ``revert_weight_conversion``: no memory),
    each with its storage kind."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = revert_weight_conversion(model, model.state_dict())
    out = []
    for name, t in state.items():
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        shape = tuple(int(s) for s in t.shape)
        kind = (Kind.FP8 if is_fp8_weight(name, shape) else
                Kind.FP32 if name.endswith(FP32_SUFFIXES) else Kind.BF16)
        parts = name.split(".")
        layer = int(parts[2]) if parts[:2] == ["model", "layers"] else None
        out.append(TensorSpec(name, shape, kind, layer))
    return out


def plan_bytes(plan: Sequence[TensorSpec], block: Sequence[int] = BLOCK) -> CheckpointBytes:
    """The tensor bytes of ``plan`` (codes, scales, other)."""
    total = CheckpointBytes()
    for t in plan:
        total += CheckpointBytes(*t.nbytes(block))
    return total


def shard_plan(plan: Sequence[TensorSpec], max_bytes: int, block: Sequence[int] = BLOCK) -> list[list[TensorSpec]]:
    """``plan`` cut in order into shards of at most ``max_bytes`` tensor bytes (a tensor larger than that alone;
    an FP8 weight and its scales always in one shard)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for t in plan:
        n = sum(t.nbytes(block))
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def modules_kept(plan: Sequence[TensorSpec]) -> list[str]:
    """The modules whose weights stay in high precision (``modules_to_not_convert``)."""
    return [t.name.removesuffix(".weight") for t in plan if t.kind is not Kind.FP8 and t.name.endswith(".weight")]


def quantization_config(plan: Sequence[TensorSpec], block: Sequence[int] = BLOCK) -> dict[str, Any]:
    """config.json's ``quantization_config`` of the checkpoint (Qwen3-FP8's keys)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block),
            "modules_to_not_convert": modules_kept(plan)}


# ================================================================ drawing one tensor
def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))


def draw(t: TensorSpec, *, seed: int, device: torch.device, init_std: float,
         block: Sequence[int] = BLOCK) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of ``t`` on the CPU, drawn on ``device``: an FP8 weight -> {name: codes [out, in]
    float8_e4m3fn, name_scale_inv: [ceil(out/b0), ceil(in/b1)] float32}; else {name: values} (bf16 or float32).
    Linear weights ~ N(0, 1/in); a 2-D tensor outside the decoder layers whose name says embedding ~ N(0,
    init_std^2); norms 1; correction biases 0."""
    from ray_moe.moe.experts.fp8 import quantize

    name, shape = t.name, t.shape
    if len(shape) == 1:
        value = torch.zeros(shape) if name.endswith(FP32_SUFFIXES) else torch.ones(shape)
        return {name: value.to(torch.float32 if t.kind is Kind.FP32 else torch.bfloat16)}
    g = _generator(seed, name, device)
    w = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    w.mul_(init_std if "embed" in name else shape[-1] ** -0.5)
    if t.kind is Kind.FP8:
        codes, scale = quantize(w, block)
        return {name: codes.cpu(), name + "_scale_inv": scale.cpu()}
    return {name: w.to(torch.float32 if t.kind is Kind.FP32 else torch.bfloat16).cpu()}


# ================================================================ reuse
def digest(conf: dict, seed: int, device_type: str, block: Sequence[int] = BLOCK) -> str:
    """The identity of a checkpoint: its config dict, seed, block, draw device type and this writer's version."""
    key = {"config": conf, "seed": seed, "block": list(block), "draw_device": device_type, "writer": WRITER_VERSION}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


def read_marker(folder: str) -> dict[str, Any] | None:
    """The folder's marker (None: no readable marker)."""
    try:
        with open(os.path.join(folder, MARKER)) as fh:
            marker = json.load(fh)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def reusable(folder: str, want: str) -> dict[str, Any] | None:
    """The folder's marker when it names digest ``want`` and every file it lists is there at its size."""
    marker = read_marker(folder)
    if marker is None or marker.get("digest") != want:
        return None
    for name, size in (marker.get("file_sizes") or {}).items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return None
    return marker


def replaceable_bytes(folder: str) -> int:
    """Bytes on disk of the checkpoint this writer made in ``folder`` (0: none), which a new write replaces."""
    marker = read_marker(folder)
    return sum((marker or {}).get("file_sizes", {}).values()) if marker else 0


@contextlib.contextmanager
def _folder_lock(folder: str) -> Iterator[None]:
    """One writer per folder (an exclusive lock on ``<folder>.lock``)."""
    os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
    with open(os.path.abspath(folder) + ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _clear(folder: str) -> None:
    """Remove ``folder`` when this writer made it (its marker) or it is empty; ValueError for any other."""
    if not os.path.exists(folder):
        return
    if os.path.isdir(folder) and (read_marker(folder) is not None or not os.listdir(folder)):
        shutil.rmtree(folder)
        return
    raise ValueError(f"{folder}: exists and holds no {MARKER} (not a checkpoint this writer made); refusing to "
                     f"replace it (give another --fp8-dir)")


# ================================================================ writing
def ensure_checkpoint(conf: dict, folder: str, *, seed: int = 0, device: str | torch.device = "cpu",
                      shard_bytes: int = SHARD_BYTES, block: Sequence[int] = BLOCK, tokenizer: bool = True,
                      log: Any = print) -> WriteReport:
    """The random FP8 checkpoint of ``conf`` (a transformers config dict) drawn with ``seed`` on ``device`` in
    ``folder``: reused when its marker matches, else written (``write_checkpoint``) after removing the checkpoint
    this writer made there before."""
    t0 = time.perf_counter()
    device = torch.device(device)
    want = digest(conf, seed, device.type, block)
    folder = os.path.abspath(folder)
    with _folder_lock(folder):
        marker = reusable(folder, want)
        if marker is not None:
            took = time.perf_counter() - t0
            got = CheckpointBytes(**{k: marker["bytes"][k] for k in ("codes", "scales", "other")})
            log(f"fp8 checkpoint: reused {folder} ({got.total / 1e9:.2f} GB of tensors, written in "
                f"{marker['write_s']:.1f} s), checked in {took:.2f} s")
            return WriteReport(folder, True, took, marker["write_s"], got, sorted(marker["file_sizes"]), want, seed,
                               device.type, {"reused": 1})
        return write_checkpoint(conf, folder, seed=seed, device=device, shard_bytes=shard_bytes, block=block,
                                tokenizer=tokenizer, log=log, want=want)


def write_checkpoint(conf: dict, folder: str, *, seed: int, device: torch.device, shard_bytes: int = SHARD_BYTES,
                     block: Sequence[int] = BLOCK, tokenizer: bool = True, log: Any = print,
                     want: str | None = None) -> WriteReport:
    """Write the checkpoint (callers hold the folder's lock: ``ensure_checkpoint``).

    1. the config, the tensor plan (meta model) and the shards by bytes; the disk must hold it (ValueError);
    2. the old checkpoint this writer made in ``folder`` removed; everything goes to ``<folder>.partial``;
    3. per shard: each tensor drawn and quantized on ``device`` and moved to the CPU (``draw``); the shard handed
       to the writer thread once the previous one is on disk (at most two shards in CPU memory);
    4. the index (``model.safetensors.index.json``), config.json with ``quantization_config``, the tokenizer
       (one word per token id, as ``--config-only`` gives both systems);
    5. the marker (the digest, bytes, file sizes, seconds), then ``<folder>.partial`` renamed to ``folder``."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    want = want or digest(conf, seed, device.type, block)
    # 1. what to write, and room for it
    config = checkpoint_config(conf)
    plan = tensor_plan(config)
    shards = shard_plan(plan, shard_bytes, block)
    total = plan_bytes(plan, block)
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # (an interrupted write's)
    free = shutil.disk_usage(os.path.dirname(folder)).free + replaceable_bytes(folder)
    if total.total + DISK_MARGIN > free:
        raise ValueError(f"{folder}: the checkpoint takes {total.total / 1e9:.1f} GB but the disk has "
                         f"{free / 1e9:.1f} GB free (with {DISK_MARGIN / 1e9:.1f} GB to spare): fewer --layers")
    # 2. the old checkpoint out, a clean partial folder
    _clear(folder)
    os.makedirs(partial)
    # 3. shard by shard
    counters: Counter[str] = Counter()
    weight_map: dict[str, str] = {}
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    init_std = float(getattr(config, "initializer_range", 0.02))
    pending: Future | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp8-shard-writer") as pool:
        for fname, shard in zip(names, shards):
            t = time.perf_counter()
            tensors: dict[str, torch.Tensor] = {}
            for spec in shard:
                tensors.update(draw(spec, seed=seed, device=device, init_std=init_std, block=block))
                counters[f"{spec.kind.value}_tensors"] += 1
            weight_map.update(dict.fromkeys(tensors, fname))
            if pending is not None:
                pending.result()  # the previous shard is on disk: at most this one and the one being written
            pending = pool.submit(save_file, tensors, os.path.join(partial, fname), {"format": "pt"})
            counters["shards_written"] += 1
            size = sum(x.numel() * x.element_size() for x in tensors.values())
            counters["bytes_written"] += size
            log(f"fp8 checkpoint: {fname} {size / 1e9:.2f} GB drawn in {time.perf_counter() - t:.1f} s "
                f"({time.perf_counter() - t0:.1f} s so far)")
        if pending is not None:
            pending.result()
    # 4. index, config, tokenizer
    with open(os.path.join(partial, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total.total}, "weight_map": weight_map}, fh, indent=1)
    body = config.to_dict()
    body["quantization_config"] = quantization_config(plan, block)
    with open(os.path.join(partial, "config.json"), "w") as fh:
        json.dump(body, fh, indent=1)
    if tokenizer:
        from ray_moe_bench.serving import save_word_tokenizer

        save_word_tokenizer(partial, int(conf["vocab_size"]))
    # 5. the marker last, then the folder in place
    took = time.perf_counter() - t0
    sizes = {f: os.path.getsize(os.path.join(partial, f)) for f in sorted(os.listdir(partial))}
    with open(os.path.join(partial, MARKER), "w") as fh:
        json.dump({"digest": want, "seed": seed, "draw_device": device.type, "block": list(block),
                   "writer": WRITER_VERSION, "config": conf, "bytes": total.as_dict(), "write_s": took,
                   "file_sizes": sizes}, fh, indent=1, default=str)
    os.rename(partial, folder)
    log(f"fp8 checkpoint: wrote {folder}: {total.total / 1e9:.2f} GB of tensors (codes {total.codes / 1e9:.2f}, "
        f"scales {total.scales / 1e9:.3f}, other {total.other / 1e9:.2f}) in {len(shards)} shards, {took:.1f} s "
        f"({total.total / 1e9 / max(took, 1e-9):.2f} GB/s)")
    return WriteReport(folder, False, time.perf_counter() - t0, took, total, sorted(sizes), want, seed,
                       device.type, dict(counters))


# ================================================================ how many layers one GPU holds
@dataclass(frozen=True)
class LayerFit:
    """The decoder layers of a shape that one GPU holds in FP8 and the disk can take (``layers_that_fit``)."""

    layers: int
    dense_layers: int
    moe_layers: int
    moe_layers_gpu: int
    moe_layers_disk: int | None
    bound: str
    gpu_bytes: int
    gpu_assumed: bool
    budget_bytes: int
    resident_fixed_bytes: int
    resident_per_moe_layer: int
    checkpoint_fixed_bytes: int
    checkpoint_per_moe_layer: int
    disk_free_bytes: int | None
    how: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _resident(t: TensorSpec) -> int:
    """Device bytes ray-moe holds for ``t``: routed expert codes + scales as stored, every other FP8 weight
    dequantized at load (bf16, 2 bytes per value), the rest as stored."""
    codes, scales, other = t.nbytes()
    if t.kind is Kind.FP8 and ".experts." not in t.name:
        return 2 * codes
    return codes + scales + other


def layers_that_fit(conf: dict, *, gpu_bytes: int | None = None, disk_free: int | None = None,
                    kv_share: float = KV_SHARE) -> LayerFit:
    """The decoder layer count of ``conf`` (its ``first_k_dense_replace`` dense layers, then MoE layers) whose
    weights fit (1 - ``kv_share``) of one GPU of ``gpu_bytes`` (default: GPU 0's total as nvidia-smi reports it,
    else an H200's 141 GB) as ray-moe holds them (``_resident``: the larger of the two systems' footprints: vLLM
    keeps every FP8 weight in FP8), and, with ``disk_free``, whose checkpoint the disk takes (``DISK_MARGIN`` to
    spare).

    1. the plan of a model of the dense layers and one MoE layer (meta: no memory); its bytes split into the
       fixed part (embeddings, lm_head, final norm, the dense layers) and one MoE layer;
    2. MoE layers on the GPU = floor((budget - fixed) / per layer), on disk likewise; at least one;
    3. layers = dense + min of the two."""
    dense = int(conf.get("first_k_dense_replace", 0))
    plan = tensor_plan(checkpoint_config(dict(conf, num_hidden_layers=dense + 1)))
    moe = [t for t in plan if t.layer == dense]
    fixed = [t for t in plan if t.layer != dense]
    assumed = False
    if gpu_bytes is None:  # (nvidia-smi: no CUDA context in the benchmark's driver process)
        from ray_moe_bench.common import nvidia_smi_mib

        totals = nvidia_smi_mib("memory.total")
        assumed = not totals
        gpu_bytes = totals[0] << 20 if totals else H200_BYTES
    budget = int((1 - kv_share) * gpu_bytes)
    res_fixed, res_layer = sum(map(_resident, fixed)), sum(map(_resident, moe))
    ck_fixed, ck_layer = plan_bytes(fixed).total, plan_bytes(moe).total
    on_gpu = max(1, (budget - res_fixed) // res_layer)
    on_disk = None if disk_free is None else max(1, (disk_free - DISK_MARGIN - ck_fixed) // ck_layer)
    n = on_gpu if on_disk is None else min(on_gpu, on_disk)
    bound = "gpu" if on_disk is None or on_gpu <= on_disk else "disk"
    return LayerFit(dense + n, dense, n, on_gpu, on_disk, bound, gpu_bytes, assumed, budget, res_fixed, res_layer,
                    ck_fixed, ck_layer, disk_free,
                    how=f"MoE layers: floor(({1 - kv_share:.2f} x GPU bytes - fixed) / per MoE layer) as ray-moe "
                        f"holds them (routed experts FP8 + scales, other FP8 weights dequantized to bf16), and "
                        f"floor((free disk - {DISK_MARGIN >> 30} GiB - fixed) / per MoE layer) of checkpoint; "
                        f"layers = {dense} dense + the smaller")


def default_layers(conf: dict, folder: str, seed: int, device_type: str) -> LayerFit:
    """The default layer count of ``conf`` for a checkpoint in ``folder``: as many as fit the GPU and the disk
    (the bytes of the checkpoint this writer made there count as free: it is replaced), except that a complete
    checkpoint of this shape already there (its marker: the same config but for the layer count, the same seed
    and draw device) is kept when the GPU holds it, so that a second process reuses it."""
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    free = shutil.disk_usage(parent).free + replaceable_bytes(folder)
    fit = layers_that_fit(conf, disk_free=free)
    marker = read_marker(folder)
    if marker is not None:
        layers = int((marker.get("config") or {}).get("num_hidden_layers", 0))
        same = dict(conf, num_hidden_layers=layers)
        if (0 < layers - fit.dense_layers <= fit.moe_layers_gpu
                and reusable(folder, digest(same, seed, device_type, marker.get("block", BLOCK))) is not None):
            return LayerFit(**{**fit.as_dict(), "layers": layers, "moe_layers": layers - fit.dense_layers,
                               "bound": "existing checkpoint"})
    return fit


def default_folder(shape: Shape, quick: bool = False) -> str:
    """The checkpoint folder of a shape: one per shape under /tmp (a new layer count replaces it)."""
    return os.path.join(FP8_ROOT, shape.value + ("-quick" if quick else ""))


def shape_config(shape: Shape, *, folder: str, seed: int, device_type: str, layers: int | None = None,
                 quick: bool = False, log: Any = print) -> tuple[dict, LayerFit | None]:
    """(the config dict of ``shape``, the layer fit when its default count was computed): ``quick``: the tiny
    config, 2 layers; ``layers``; else Qwen3's 48, or the DeepSeek-V3 layers one GPU and the disk hold
    (``default_layers`` for a checkpoint in ``folder``, logged). The writer's command line and the serving
    benchmark both take it, so both name one checkpoint (the marker's digest)."""
    full, tiny = SHAPES[shape]
    if quick:
        return dict(tiny, num_hidden_layers=2), None
    if layers is not None or shape is Shape.QWEN3_30B_A3B:
        return dict(full, num_hidden_layers=layers or QWEN3_LAYERS), None
    fit = default_layers(dict(full), folder, seed, device_type)
    log(f"{shape.value}: {fit.layers} layers ({fit.dense_layers} dense + {fit.moe_layers} MoE); one GPU of "
        f"{fit.gpu_bytes / 1e9:.0f} GB{' (assumed)' if fit.gpu_assumed else ''} holds {fit.moe_layers_gpu} MoE layers "
        f"leaving {1 - fit.budget_bytes / fit.gpu_bytes:.0%}, the disk {fit.moe_layers_disk}: bound by {fit.bound}")
    return dict(full, num_hidden_layers=fit.layers), fit


# ================================================================ command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fp8_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=Shape, choices=list(Shape), default=Shape.QWEN3_30B_A3B,
                   metavar="{" + ",".join(s.value for s in Shape) + "}")
    p.add_argument("--config-json", help="a transformers config dict (JSON file) instead of --shape")
    p.add_argument("--layers", type=int, help="decoder layers (default: Qwen3 48; DeepSeek-V3: as many as fit)")
    p.add_argument("--dir", help=f"the checkpoint folder (default {FP8_ROOT}/<shape>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="where tensors are drawn (default: cuda when available)")
    p.add_argument("--shard-gb", type=float, default=SHARD_BYTES / 1e9)
    p.add_argument("--fit", action="store_true", help="print the config's layers and write nothing")
    p.add_argument("--report", help="write the config, the layer fit and the WriteReport to this JSON file")
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    folder = a.dir or default_folder(a.shape)
    fit = None
    if a.config_json:
        with open(a.config_json) as fh:
            conf = json.load(fh)
    else:
        conf, fit = shape_config(a.shape, folder=folder, seed=a.seed, device_type=device.type, layers=a.layers)
    print(f"config: {conf['model_type']}, {conf['num_hidden_layers']} layers", flush=True)
    out: dict[str, Any] = {"config": conf, "fit": fit.as_dict() if fit else None}
    if not a.fit:
        rep = ensure_checkpoint(conf, folder, seed=a.seed, device=device, shard_bytes=int(a.shard_gb * 1e9))
        out["checkpoint"] = rep.as_dict()
    if a.report:
        os.makedirs(os.path.dirname(os.path.abspath(a.report)), exist_ok=True)
        with open(a.report, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
