"""Serving throughput and latency on one seeded workload: ray-moe, transformers' continuous batching and vLLM side by side in one run (or ray-moe serve online over HTTP).

    python -m ray_moe_bench.serving --quick                      # CPU smoke: tiny Qwen3-MoE, 8 requests, 2 ranks
    python -m ray_moe_bench.serving --layers 8 --ranks 2         # CUDA: a random 8-layer Qwen3-30B-A3B slice
    python -m ray_moe_bench.serving --model DIR --workload decode-heavy
    python -m ray_moe_bench.serving --online --url http://127.0.0.1:8000 --model DIR --rate 4

Offline: the same prompts (seeded) go to every system, each in its own subprocess (so each one's start time and
memory are its own), all submitted at once, greedy, exactly ``new_tokens`` per request (EOS ignored):
  ray-moe       ``Runtime.start(RuntimeConfig.from_pretrained(folder, num_ranks=R))``, ``rt.serving()``; every
                request submitted to the generation loop with a token callback (host timestamps per token)
  transformers  ``AutoModelForCausalLM.from_pretrained(folder)`` on one device, ``model.generate_batch`` with
                ``record_timestamps`` (its continuous batching; eos_token_id=-1); skipped when it does not fit
  vLLM          ``LLM(model=folder).generate`` on token-id prompts, ``SamplingParams(temperature=0, ignore_eos=True)``,
                when ``import vllm`` works; offline vLLM gives throughput only (no per-token times)
``--random-model`` (the default without ``--model``): Qwen3-30B-A3B's shapes with random weights, ``--layers``
decoder layers, written with ``save_pretrained`` (and a word-level tokenizer) to a temporary folder that all
three load; ``--config-only`` writes the config (and tokenizer) only: ray-moe builds the seeded model in its
shards, transformers builds it on the device with its own initialisation (``from_config``), vLLM takes
``load_format=dummy`` (the same shapes, each system its own random weights: throughput, not token equality).
One untimed pass warms every system up first (``--no-warmup``: none) on prompts of the same lengths whose token
ids are shifted by one (``warmup_prompts``): the same step shapes, no shared block, so no system's prefix cache
(vLLM's is on by default, ray-moe's too) serves the timed pass from the warm one.
Workloads: mixed (lognormal prompt lengths, mean 480, clipped to [16, 3.2 x mean], 128 new tokens),
decode-heavy (32-token prompts, 256 new), prefill-heavy (uniform in [2/3, 4/3] x 1536, 16 new).
Latency as vLLM's benchmark_serving defines it: TTFT = first token - request sent; TPOT = (last token - first
token) / (tokens - 1) per request; ITL = every gap between consecutive tokens (chunks online).
Online: Poisson arrivals at ``--rate`` req/s (inf: all at once) to a running ``ray-moe serve``, streaming
``/v1/completions`` with token-id prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import numpy as np

from ray_moe_bench.common import (
    GpuMemorySampler,
    add_output_argument,
    latency_summary_ms,
    write_result,
)
from ray_moe_bench.generate import QUICK, QWEN3_30B_A3B


class Workload(str, Enum):
    MIXED = "mixed"
    DECODE_HEAVY = "decode-heavy"
    PREFILL_HEAVY = "prefill-heavy"


class System(str, Enum):
    RAY_MOE = "ray_moe"
    TRANSFORMERS = "transformers"
    VLLM = "vllm"


class Role(str, Enum):
    """What a worker subprocess does (``--worker``): write the random model, or measure one system."""

    PREPARE = "prepare"
    RAY_MOE = "ray_moe"
    TRANSFORMERS = "transformers"
    VLLM = "vllm"


#: workload -> (requests, new tokens, prompt mean)
WORKLOAD_DEFAULTS = {Workload.MIXED: (256, 128, 480), Workload.DECODE_HEAVY: (256, 256, 32),
                     Workload.PREFILL_HEAVY: (64, 16, 1536)}
LOGNORMAL_SIGMA = 0.8
MIN_PROMPT = 16


@dataclass(frozen=True)
class WorkloadSpec:
    kind: Workload
    requests: int
    new_tokens: int
    prompt_mean: int
    seed: int

    def prompt_lengths(self) -> list[int]:
        """Seeded prompt lengths (see the module docstring)."""
        rng = np.random.default_rng(self.seed)
        m = self.prompt_mean
        if self.kind is Workload.DECODE_HEAVY:
            return [m] * self.requests
        if self.kind is Workload.PREFILL_HEAVY:
            return rng.integers(max(1, (2 * m) // 3), (4 * m) // 3 + 1, self.requests).tolist()
        mu = math.log(m) - LOGNORMAL_SIGMA ** 2 / 2  # the lognormal's mean is m before clipping
        xs = rng.lognormal(mu, LOGNORMAL_SIGMA, self.requests)
        return np.clip(np.rint(xs), min(MIN_PROMPT, m), max(MIN_PROMPT, int(3.2 * m))).astype(int).tolist()

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Token-id prompts, uniform over the vocabulary (seed + 1)."""
        rng = np.random.default_rng(self.seed + 1)
        return [rng.integers(0, vocab_size, n).tolist() for n in self.prompt_lengths()]


def workload_spec(kind: Workload, requests: int | None, new_tokens: int | None, prompt_mean: int | None,
                  seed: int) -> WorkloadSpec:
    """The workload with overrides; a bad value raises ValueError naming the flag."""
    r0, n0, m0 = WORKLOAD_DEFAULTS[kind]
    spec = WorkloadSpec(kind, r0 if requests is None else requests, n0 if new_tokens is None else new_tokens,
                        m0 if prompt_mean is None else prompt_mean, seed)
    for name, v in (("--requests", spec.requests), ("--new-tokens", spec.new_tokens),
                    ("--prompt-mean", spec.prompt_mean)):
        if v < 1:
            raise ValueError(f"{name}={v}: must be >= 1")
    return spec


# ================================================================ metrics (shared by every system)
def token_metrics(prompts: list[list[int]], outputs: list[list[int]], wall_s: float, sent: list[float] | None = None,
                  stamps: list[list[float]] | None = None) -> dict[str, Any]:
    """Counts and throughput of one timed pass; with ``sent`` (per request, s) and ``stamps`` (per request, one
    host time per token or chunk, s, same clock): TTFT / TPOT / ITL p50 / p99 / mean in ms."""
    out_tokens = sum(len(o) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    res: dict[str, Any] = {"requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
                           "output_tokens_per_request": sorted({len(o) for o in outputs}), "wall_s": wall_s,
                           "output_tokens_per_s": out_tokens / wall_s,
                           "total_tokens_per_s": (out_tokens + prompt_tokens) / wall_s,
                           "request_throughput_per_s": len(prompts) / wall_s, "streams": stamps is not None}
    if stamps is None or sent is None:
        return res
    ttft = [ts[0] - s for s, ts in zip(sent, stamps) if ts]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in stamps if len(ts) > 1]
    itl = [b - a for ts in stamps for a, b in itertools.pairwise(ts)]
    e2e = [ts[-1] - s for s, ts in zip(sent, stamps) if ts]
    res["latency"] = {"ttft": latency_summary_ms(ttft), "tpot": latency_summary_ms(tpot),
                      "itl": latency_summary_ms(itl), "e2e": latency_summary_ms(e2e)}
    return res


def _cuda_peak() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"torch_max_memory_allocated_bytes": [torch.cuda.max_memory_allocated(i)
                                                 for i in range(torch.cuda.device_count())]}


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for mod in ("torch", "transformers", "ray", "ray_moe", "vllm", "httpx"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", None)
        except Exception:  # noqa: BLE001 - absent or broken: reported as None
            out[mod] = None
    return out


# ================================================================ the model folder
def save_word_tokenizer(folder: str, vocab_size: int) -> None:
    """A word-level tokenizer with one entry per model token id (``t<i>``, id 0 ``<unk>``), so vLLM and
    ``AutoTokenizer`` load the folder offline and every id is in its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)


def prepare_random_model(conf: dict, folder: str, device: str, dtype: str, seed: int,
                         weights: bool = True) -> dict[str, Any]:
    """Build ``conf`` (a transformers config dict) with random weights on ``device`` and ``save_pretrained`` it
    with no EOS token (every request runs to its token budget) and a word-level tokenizer. ``weights`` False:
    the config and tokenizer only (ray-moe builds the random model in its shards, vLLM takes dummy weights:
    the whole 48-layer shape is 61 GB, near the GPU machine's disk)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    c = dict(conf)
    config = AutoConfig.for_model(c.pop("model_type"), **c)
    config.eos_token_id = config.bos_token_id = None
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    if not weights:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]  # vLLM picks its model by it
        config.save_pretrained(folder)
        save_word_tokenizer(folder, conf["vocab_size"])
        return {"parameters": None, "weights_saved": False, "build_and_save_s": time.perf_counter() - t0}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    model.save_pretrained(folder)
    save_word_tokenizer(folder, conf["vocab_size"])
    params = sum(p.numel() for p in model.parameters())
    return {"parameters": params, "build_and_save_s": time.perf_counter() - t0}


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


# ================================================================ one system per worker process
def run_ray_moe(spec: dict) -> dict[str, Any]:
    import ray_moe
    from ray_moe.model.sampling import SamplingParams

    prompts, new = spec["prompts"], spec["new_tokens"]
    ranks = spec["ranks"]
    busiest = sum(len(p) + new for p in prompts)
    cap = spec.get("decode_capacity") or max(1, math.ceil(min(len(prompts), spec["max_running"]) / ranks))
    conf = spec.get("random_model")  # no weights in the folder: seeded experts, random non-expert modules
    if conf is not None:
        cfg = ray_moe.RuntimeConfig(num_ranks=ranks, num_experts=conf["num_experts"], hidden_size=conf["hidden_size"],
                                    ffn_size=conf["moe_intermediate_size"], top_k=conf["num_experts_per_tok"],
                                    slots_per_rank=-(-conf["num_experts"] // ranks),
                                    num_layers=conf["num_hidden_layers"], device=spec["device"], dtype=spec["dtype"],
                                    seed=0, decode_token_capacity=cap, name="bench-serving",
                                    seeded_on_device=spec["device"] == "cuda")  # drawn on the GPU: no CPU draw
    else:
        cfg = ray_moe.RuntimeConfig.from_pretrained(spec["folder"], num_ranks=ranks, device=spec["device"],
                                                    dtype=spec["dtype"], decode_token_capacity=cap, seed=0,
                                                    name="bench-serving")
    t0 = time.perf_counter()
    rt = ray_moe.Runtime.start(cfg)
    try:
        # kv_tokens None: the product's default, a cache sized from the memory the weights leave (on CUDA)
        engine = rt.serving(kv_tokens=spec.get("kv_tokens") or (None if spec["device"] == "cuda" else busiest + 64 * len(prompts)),
                            block_size=16, attention=spec.get("attention") or "auto", random_model=conf,
                            step_tokens=spec["step_tokens"], max_running=spec["max_running"],
                            max_queued=max(4096, len(prompts)), decode_steps=spec.get("decode_steps"),
                            prefix_caching=spec.get("prefix_caching", True))
        start_s = time.perf_counter() - t0
        after_start = memory_after_start(rt.shard_status())
        # the product has no ignore_eos: the scheduler's EOS set is emptied so every request makes its budget
        engine.scheduler.eos = frozenset()
        params = SamplingParams(max_new_tokens=new, temperature=0.0)

        def one_pass(prompts: list[list[int]]) -> tuple[list[list[int]], float, list[float], list[list[float]]]:
            stamps: list[list[float]] = [[] for _ in prompts]

            def on_event(i: int) -> Callable[[Any], None]:
                return lambda item: stamps[i].append(time.perf_counter()) if isinstance(item, int) else None

            t = time.perf_counter()  # one batch, as vLLM's LLM.generate adds every request before it steps
            handles = engine.submit_many([(p, params, on_event(i)) for i, p in enumerate(prompts)])
            sent = [t] * len(prompts)
            outs = [h.result(spec["timeout_s"]) for h in handles]
            return outs, time.perf_counter() - t, sent, stamps

        if spec["warmup"]:
            one_pass(spec["warm_prompts"])
        steps0, gc0 = engine.steps, engine.gc_counters()
        for dq in engine.timings.values():  # the timed pass's steps only
            dq.clear()
        outs, wall, sent, stamps = one_pass(prompts)
        gc1 = engine.gc_counters()
        res = token_metrics(prompts, outs, wall, sent, stamps)
        res.update(start_s=start_s, memory_after_start=after_start, engine_steps=engine.steps - steps0, decode_steps=engine.scheduler.decode_steps,
                   settings={"ranks": ranks, "decode_token_capacity": cap, "kv_tokens_per_rank": engine.kv_tokens,
                             "attention": engine.attention_backend,
                             "step_tokens": engine.scheduler.configured[0], "max_running": spec["max_running"],
                             "prefix_caching": spec.get("prefix_caching", True),
                             "seeded_on_device": cfg.seeded_on_device},
                   latency_note="host timestamps of the generation loop's token events in the driver; with "
                                "multi-step decode (decode_steps > 1) tokens arrive in bursts (ITL ~0 inside one)",
                   memory={**_cuda_peak(), "note": "torch counters of the driver process only: the model lives "
                                                  "in the shard actors, whose allocator peak ray-moe does not "
                                                  "report; see nvidia_smi"})
        res["outputs_digest"] = _digest(outs)
        # the driver process's garbage-collector pauses in the timed pass (MEASURED: gc.callbacks; the shards'
        # own, since their start, are in shards[*].counters: gc_*)
        res["driver_gc"] = {k: (gc1[k] if k in ("gc_pause_max_us", "gc_frozen_objects") else gc1[k] - gc0[k])
                            for k in gc1}
        # where a step's time goes (median ms per step: plan, launch, wait, shard, device, idle, ...) and what the
        # shards counted (graphs captured / replayed, fallbacks, out-of-memory steps), for the next profile
        res["step_timings_ms"] = engine.timing_summary()
        res["host_work"] = host_share(engine.timings)
        res["host_work_by_kind"] = host_share_by_kind(engine.timings, engine.step_shapes)
        shards = rt.shard_status()
        res["shards"] = {str(r): {"counters": st.get("counters"), "capture_error": st.get("capture_error"),
                                  "weight_bytes": st.get("weight_bytes"), "slot_buffers": st.get("slot_buffers")}
                         for r, st in shards.items()}
        res["memory_events"] = list(engine.memory_events)
        return res
    finally:
        rt.shutdown()


def memory_after_start(status: dict) -> dict[str, Any]:
    """Each shard's device memory right after start, before any step (MEASURED by the shard, ``ShardCore._memory``):
    allocated bytes over the weights it holds (expert slot buffers + the model's other modules); the KV cache's
    tensors are allocated at the first step (``kv_bytes`` 0 here)."""
    out: dict[str, Any] = {}
    for r, st in status.items():
        m = dict(st.get("memory") or {})
        weights = m.get("expert_bytes", 0) + m.get("module_bytes", 0)
        if "allocated_bytes" in m and weights:
            m["allocated_over_weights"] = m["allocated_bytes"] / weights
        out[str(r)] = m
    return out


def host_share_by_kind(timings: dict, shapes: Any) -> dict[str, Any]:
    """``host_share`` per step kind of the timed pass (``GenerationLoop.step_shapes``, aligned with the timings):
    decode (decode rows only, one step), multi_decode (decode sub-steps), prefill (prompt tokens, with or without
    decode rows); and every step's (prompt tokens, decode rows, sub-steps, host ms, device ms, replay ms, host CPU
    ms)."""
    keys = ("host", "device", "idle", "replay", "host_cpu")
    series = {k: list(timings.get(k, ())) for k in keys}
    shapes = list(shapes)[-len(series["device"]):] if series["device"] else []
    kinds: dict[str, dict[str, list]] = {}
    for i, (prompt, rows, steps) in enumerate(shapes):
        kind = "prefill" if prompt else ("multi_decode" if steps > 1 else "decode")
        for k in keys:
            kinds.setdefault(kind, {x: [] for x in keys})[k].append(series[k][i])
    out = {kind: {k: v for k, v in host_share(t).items() if k != "note"} for kind, t in kinds.items()}
    out["steps"] = [[p, r, n, round(series["host"][i], 2), round(series["device"][i], 2), round(series["replay"][i], 2),
                     round(series["host_cpu"][i], 2) if i < len(series["host_cpu"]) else None]
                    for i, (p, r, n) in enumerate(shapes)]
    return out


def host_share(timings: dict) -> dict[str, Any]:
    """The shards' host work over their device time in the timed pass (sums over its steps of the busiest
    rank's ``host_s`` and ``device_s``) and the device's idle gaps between steps over the same device time."""
    host, device, idle, replay, cpu = (sum(timings.get(k, ())) for k in ("host", "device", "idle", "replay", "host_cpu"))
    return {"host_ms": host, "device_ms": device, "idle_ms": idle, "replay_ms": replay, "host_cpu_ms": cpu,
            "steps": len(timings.get("device", ())),
            "host_over_device": host / device if device else None,
            "host_outside_replays_over_device": (host - replay) / device if device else None,
            "host_cpu_over_device": cpu / device if device else None,
            "idle_over_device": idle / device if device else None,
            "note": "host: the shard's wall time in each step's launch (plan, staging, issuing or replaying kernels, "
                    "captures; blocking inside it included, e.g. a full kernel queue) and completion (reading tokens), "
                    "not the wait between: an upper bound of the host work; replay: its part inside captured-graph "
                    "replays (input copies and the graph launch, which blocks while the device's queue is full); "
                    "host - replay: planning, staging, eager kernels and captures, sampling, completion; host_cpu: "
                    "the shard thread's CPU time over the same spans (time.thread_time: GIL waits and sleeping "
                    "waits not in it, spinning CUDA waits are); idle: the "
                    "device's gaps between steps (the host work the device waited for)"}


def random_model_bytes(folder: str, dtype: Any) -> int:
    """The parameter bytes of the folder's config at ``dtype`` (counted on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    return sum(p.numel() for p in model.parameters()) * torch.empty(0, dtype=dtype).element_size()


def warmup_prompts(prompts: list[list[int]], vocab: int) -> list[list[int]]:
    """The warm pass's prompts: the timed prompts' lengths (the same step shapes, so every system has captured
    / compiled them) with every token id shifted by one, so no cache block of the warm pass equals one of the
    timed pass (a prefix cache would otherwise serve the timed prompts from the warm-up)."""
    return [[(t + 1) % vocab for t in p] for p in prompts]


def run_transformers(spec: dict) -> dict[str, Any]:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        ContinuousBatchingConfig,
        GenerationConfig,
    )

    prompts, new, device = spec["prompts"], spec["new_tokens"], spec["device"]
    dtype = getattr(torch, spec["dtype"])
    from_config = spec.get("random_model") is not None  # --config-only: transformers' own init, built on the device
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info(0)
        need = random_model_bytes(spec["folder"], dtype) if from_config else folder_bytes(spec["folder"])
        if need > 0.85 * free:
            return {"status": "skipped", "reason": f"weights {need / 2**30:.1f} GiB do not fit one GPU "
                                                   f"({free / 2**30:.1f} GiB free) with room for a KV cache"}
    t0 = time.perf_counter()
    if from_config:
        from transformers import AutoConfig

        torch.manual_seed(0)
        with torch.device(device):  # like vLLM's load_format=dummy: the shapes, no weights on disk
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec["folder"]), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=dtype)
    model = model.to(device).eval()
    if device == "cuda":
        model.set_experts_implementation("grouped_mm")
    start_s = time.perf_counter() - t0
    gen = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=-1, pad_token_id=0)
    # the paged cache sized like ray-moe's (every request at once; its own default sizing from free memory
    # takes tens of seconds on CPU); prefill chunk = ray-moe's step tokens (its default when none is given:
    # before session 14's last commit this was 2,048, the setting of the session-14 transformers figures)
    from ray_moe.driver.loop import DEFAULT_STEP_TOKENS

    batch_tokens = spec["step_tokens"] or DEFAULT_STEP_TOKENS["cuda" if device == "cuda" else "cpu"]
    page = 256
    blocks = sum(math.ceil((len(p) + new) / page) for p in prompts) + 1
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=batch_tokens)
    warm = spec["warmup"]
    if warm:  # the same lengths: its manager (sized for these requests) is kept for the timed pass
        model.generate_batch(spec["warm_prompts"], generation_config=gen, continuous_batching_config=cb, persistent_manager=True,
                             progress_bar=False)
    t = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, record_timestamps=True,
                               persistent_manager=warm, progress_bar=False)
    wall = time.perf_counter() - t
    if warm:
        model.destroy_cached_continuous_batching_manager()
    results = list(out.values())
    if len(results) != len(prompts) or any(r.error for r in results):
        bad = [r.error for r in results if r.error][:3]
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} requests; errors {bad}")
    outs = [list(r.generated_tokens) for r in results]
    res = token_metrics(prompts, outs, wall, [t] * len(prompts), [list(r.timestamps or []) for r in results])
    res.update(start_s=start_s, latency_note="generate_batch(record_timestamps=True): a host time per token; "
                                             "all requests sent when generate_batch was called",
               settings={"attn_implementation": getattr(model.config, "_attn_implementation", None),
                         "page_size": page, "num_blocks": blocks, "max_batch_tokens": batch_tokens,
                         "experts_implementation": "grouped_mm" if device == "cuda" else "default"},
               memory=_cuda_peak())
    res["outputs_digest"] = _digest(outs)
    return res


def run_vllm(spec: dict) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    prompts, new = spec["prompts"], spec["new_tokens"]
    t0 = time.perf_counter()
    llm = LLM(model=spec["folder"], tokenizer=spec["folder"], dtype=spec["dtype"], seed=0,
              tensor_parallel_size=spec["vllm_tp"], max_model_len=max(len(p) for p in prompts) + new + 16,
              **spec["vllm_args"])
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    if spec["warmup"]:
        llm.generate([{"prompt_token_ids": p} for p in spec["warm_prompts"]], params, use_tqdm=False)
    t = time.perf_counter()
    got = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t
    outs = [list(g.outputs[0].token_ids) for g in got]
    res = token_metrics(prompts, outs, wall)
    res.update(start_s=start_s, latency_note="offline LLM.generate returns whole requests: throughput only",
               settings={"tensor_parallel_size": spec["vllm_tp"], **spec["vllm_args"]}, memory=_cuda_peak())
    res["outputs_digest"] = _digest(outs)
    return res


def _digest(outs: list[list[int]]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]


WORKERS: dict[Role, Callable[[dict], dict[str, Any]]] = {Role.RAY_MOE: run_ray_moe, Role.TRANSFORMERS: run_transformers,
                                                         Role.VLLM: run_vllm}


def worker_main(role: Role, spec_path: str) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    if role is Role.PREPARE:
        res = prepare_random_model(spec["model"], spec["folder"], spec["device"], spec["dtype"], spec["seed"], spec.get("weights", True))
    else:
        res = {"status": "ok", **WORKERS[role](spec)}
    with open(spec["result_path"], "w") as fh:
        json.dump(res, fh, default=str)
    return 0


def run_worker(role: Role, spec: dict, workdir: str, timeout_s: float, *, in_process: bool = False) -> dict[str, Any]:
    """Run one worker subprocess on ``spec``; its JSON result, or {"status": "error"} with its stderr's tail.
    Adds the worker's wall time and nvidia-smi's peak used memory while it ran. ``in_process``: run it here
    instead (tests: no interpreter start per system, an already running Ray; start times and memory then
    include what this process already holds)."""
    if in_process:
        import traceback

        t0 = time.perf_counter()
        try:
            fn = WORKERS.get(role)
            res = (prepare_random_model(spec["model"], spec["folder"], spec["device"], spec["dtype"], spec["seed"], spec.get("weights", True))
                   if fn is None else {"status": "ok", **fn(spec)})
        except Exception as exc:  # noqa: BLE001 - recorded in the result like a failed subprocess
            return {"status": "error", "error": f"{role.value}: {exc!r}",
                    "stderr_tail": traceback.format_exc().splitlines()[-15:]}
        return {**res, "process_s": time.perf_counter() - t0}
    spec_path = os.path.join(workdir, f"{role.value}-spec.json")
    spec = {**spec, "result_path": os.path.join(workdir, f"{role.value}-result.json")}
    with open(spec_path, "w") as fh:
        json.dump(spec, fh)
    cmd = [sys.executable, "-m", "ray_moe_bench.serving", "--worker", role.value, "--spec", spec_path]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(__file__)),
                                                      env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    with GpuMemorySampler() as mem:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"status": "error", "error": f"{role.value} worker ran past {timeout_s} s"}
    took = time.perf_counter() - t0
    if proc.returncode != 0 or not os.path.exists(spec["result_path"]):
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-15:]
        return {"status": "error", "error": f"{role.value} worker exited {proc.returncode}", "stderr_tail": tail}
    with open(spec["result_path"]) as fh:
        res = json.load(fh)
    res["process_s"] = took
    if mem.report() is not None:
        res.setdefault("memory", {})["nvidia_smi"] = mem.report()
    return res


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """ray-moe / baseline output tokens/s, only where both were measured in this run (else None and why)."""
    out: dict[str, Any] = {}
    ours = systems.get(System.RAY_MOE.value, {})
    for base in (System.VLLM, System.TRANSFORMERS):
        other = systems.get(base.value, {})
        key = f"ray_moe_over_{base.value}_output_tokens_per_s"
        if ours.get("status") == "ok" and other.get("status") == "ok":
            out[key] = ours["output_tokens_per_s"] / other["output_tokens_per_s"]
        else:
            out[key] = None
            out[f"{key}_why_none"] = (f"ray_moe: {ours.get('status', 'not run')}, "
                                      f"{base.value}: {other.get('status', 'not run')}")
    return out


# ================================================================ online: HTTP against ray-moe serve
async def run_online(url: str, prompts: list[list[int]], new_tokens: int, rate: float, seed: int, *,
                     model: str | None = None, api_key: str | None = None, transport: Any = None,
                     timeout_s: float = 600.0) -> dict[str, Any]:
    """Poisson arrivals (``rate`` req/s, inf: all at once; seeded gaps) of streaming ``/v1/completions``
    requests; per-chunk host timestamps give TTFT / TPOT / ITL (vLLM benchmark_serving's definitions)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = np.random.default_rng(seed + 2)
    gaps = np.zeros(len(prompts)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(prompts))
    arrivals = np.cumsum(gaps) - gaps[0]
    async with httpx.AsyncClient(base_url=url, headers=headers, transport=transport,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        if model is None:
            listed = (await client.get("/v1/models")).raise_for_status().json()
            model = listed["data"][0]["id"]
        sent = [0.0] * len(prompts)
        stamps: list[list[float]] = [[] for _ in prompts]
        outs: list[list[int]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * len(prompts)
        errors: list[str] = []
        start = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            body = {"model": model, "prompt": prompts[i], "max_tokens": new_tokens, "temperature": 0.0,
                    "stream": True}
            sent[i] = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    errors.append(f"request {i}: HTTP {resp.status_code} {(await resp.aread())[:200]!r}")
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        errors.append(f"request {i}: {chunk['error'].get('message')}")
                        return
                    choice = chunk["choices"][0]
                    ids = choice.get("token_ids") or []
                    if ids:
                        stamps[i].append(time.perf_counter())
                        outs[i].extend(ids)
                    finish[i] = choice.get("finish_reason") or finish[i]

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - start
    res = token_metrics(prompts, outs, wall, sent, stamps)
    res.update(status="ok" if not errors else "error", errors=errors[:10], url=url, model=model, rate_per_s=rate,
               stopped_early=sum(len(o) < new_tokens for o in outs),
               finish_reasons={r: finish.count(r) for r in set(finish)},
               latency_note="host times in this client: TTFT from request sent, ITL per streamed chunk; the "
                            "server has no ignore_eos, so a request may stop at EOS (stopped_early)")
    return res


# ================================================================ the driver
def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The model slice and workload flags (--layers, --workload, --requests, --new-tokens, --prompt-mean), shared
    with the in-process step profile."""
    p.add_argument("--layers", type=int, default=48, help="decoder layers of the random Qwen3-30B-A3B slice")
    p.add_argument("--workload", type=Workload, choices=list(Workload), default=Workload.MIXED,
                   metavar="{" + ",".join(w.value for w in Workload) + "}")
    p.add_argument("--requests", type=int)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--prompt-mean", type=int)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny Qwen3-MoE, 8 requests, 2 ranks")
    p.add_argument("--model", metavar="DIR", help="a Hugging Face model folder (default: --random-model)")
    p.add_argument("--random-model", action="store_true", help="random Qwen3-30B-A3B-shaped weights (default)")
    add_workload_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=None, help="ray-moe ranks (default: every GPU, 2 on CPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--step-tokens", type=int, default=None,
                   help="prefill tokens per step (default: ray-moe's own; transformers' max_batch_tokens: 2048)")
    p.add_argument("--decode-steps", type=int, default=None, help="ray-moe multi-step decode (default: its own)")
    p.add_argument("--decode-capacity", type=int, default=None,
                   help="ray-moe decode_token_capacity (default: requests in flight / ranks)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="ray-moe KV tokens per rank (default: every request's prompt + new tokens, plus slack)")
    p.add_argument("--attention", choices=["auto", "varlen", "masked"], default=None, help="ray-moe attention backend")
    p.add_argument("--systems", nargs="+", type=System, choices=list(System), default=list(System),
                   metavar="SYSTEM", help="of " + ", ".join(s.value for s in System) + " (default: all)")
    p.add_argument("--vllm-tp", type=int, default=None, help="vLLM tensor_parallel_size (default: --ranks)")
    p.add_argument("--vllm-args", type=json.loads, default={}, help="extra LLM(...) keyword arguments, JSON")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="ray-moe without prefix caching (the warm pass's prompts share no block with the timed "
                        "ones either way)")
    p.add_argument("--in-process", action="store_true",
                   help="run every system in this process (tests; start times and memory are then shared)")
    p.add_argument("--keep-model", metavar="DIR", help="write the random model here and keep it")
    p.add_argument("--config-only", action="store_true",
                   help="random model: write no weights (ray-moe builds them in its shards, transformers on "
                        "the device with its own init, vLLM takes load_format=dummy)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker process")
    p.add_argument("--online", action="store_true", help="HTTP against a running ray-moe serve (--url)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--rate", type=float, default=math.inf, help="online request rate, req/s (inf: all at once)")
    p.add_argument("--vocab-size", type=int, help="online without --model: token ids are drawn below this")
    p.add_argument("--api-key", default=None)
    p.add_argument("--worker", type=Role, choices=list(Role), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    add_output_argument(p)
    a = p.parse_args(argv)
    if a.worker is not None:
        return worker_main(a.worker, a.spec)
    if a.model and a.random_model:
        p.error("--model and --random-model: give one")
    if a.layers < 1:
        p.error(f"--layers={a.layers}: must be >= 1")
    if a.quick:
        a.requests = 8 if a.requests is None else a.requests
        a.new_tokens = 4 if a.new_tokens is None else a.new_tokens
        a.prompt_mean = 24 if a.prompt_mean is None else a.prompt_mean
    try:
        work = workload_spec(a.workload, a.requests, a.new_tokens, a.prompt_mean, a.seed)
    except ValueError as exc:
        p.error(str(exc))
    if a.online:
        return main_online(a, p, work)
    import torch

    device = a.device or ("cpu" if a.quick or not torch.cuda.is_available() else "cuda")
    dtype = a.dtype or ("bfloat16" if device == "cuda" else "float32")
    ranks = a.ranks or (max(1, torch.cuda.device_count()) if device == "cuda" else 2)
    if ranks < 1:
        p.error(f"--ranks={ranks}: must be >= 1")
    workdir = tempfile.mkdtemp(prefix="ray-moe-serving-")
    res: dict[str, Any] = {"mode": "offline", "quick": a.quick, "in_process": a.in_process, "device": device,
                           "dtype": dtype,
                           "workload": {**asdict(work), "kind": work.kind.value}, "versions": _versions()}
    try:
        if a.model:
            folder = a.model
            res["model"] = {"folder": folder, "random": False}
        else:
            folder = a.keep_model or os.path.join(workdir, "model")
            conf = dict(QUICK if a.quick else QWEN3_30B_A3B, num_hidden_layers=2 if a.quick else a.layers)
            built = run_worker(Role.PREPARE, {"model": conf, "folder": folder, "device": device, "dtype": dtype,
                                              "seed": a.seed, "weights": not a.config_only}, workdir, a.timeout,
                               in_process=a.in_process)
            if built.get("status") == "error":
                raise RuntimeError(f"writing the random model failed: {built}")
            res["model"] = {"folder": folder if a.keep_model else None, "random": True, "config": conf, **built}
        with open(os.path.join(folder, "config.json")) as fh:
            cfg_json = json.load(fh)
        vocab = int(cfg_json.get("vocab_size") or cfg_json.get("text_config", {})["vocab_size"])
        prompts = work.prompts(vocab)
        res["workload"]["prompt_tokens"] = sum(len(x) for x in prompts)
        res["workload"]["prompt_len_min_mean_max"] = [min(map(len, prompts)), sum(map(len, prompts)) / len(prompts),
                                                      max(map(len, prompts))]
        spec = {"folder": folder, "prompts": prompts, "warm_prompts": warmup_prompts(prompts, vocab),
                "new_tokens": work.new_tokens, "device": device,
                "dtype": dtype, "ranks": ranks, "max_running": a.max_running, "step_tokens": a.step_tokens,
                "decode_steps": a.decode_steps, "decode_capacity": a.decode_capacity, "kv_tokens": a.kv_tokens, "attention": a.attention,
                "warmup": not a.no_warmup, "timeout_s": a.timeout, "prefix_caching": a.prefix_caching,
                "vllm_tp": a.vllm_tp or ranks,
                "vllm_args": {**({"load_format": "dummy"} if a.config_only else {}), **a.vllm_args},
                "random_model": res["model"]["config"] if a.config_only and not a.model else None}
        systems: dict[str, dict[str, Any]] = {}
        for system in a.systems:
            if system is System.VLLM and importlib.util.find_spec("vllm") is None:
                systems[system.value] = {"status": "skipped", "reason": "vllm is not installed (import vllm fails)"}
                continue
            print(f"{system.value}: running {work.requests} requests ...", flush=True)
            systems[system.value] = r = run_worker(Role(system.value), spec, workdir, a.timeout,
                                                          in_process=a.in_process)
            if r.get("status") == "ok":
                r["expected_output_tokens"] = work.requests * work.new_tokens
                print(f"{system.value}: {r['output_tokens_per_s']:.1f} output tok/s, wall {r['wall_s']:.2f} s, "
                      f"start {r['start_s']:.1f} s", flush=True)
            else:
                print(f"{system.value}: {r.get('status')}: {r.get('reason') or r.get('error')}", flush=True)
        res["systems"] = systems
        res["ratios"] = ratios(systems)
        digests = {k: v["outputs_digest"] for k, v in systems.items() if v.get("status") == "ok"}
        res["same_tokens"] = {"systems": sorted(digests), "identical": len(set(digests.values())) <= 1,
                              "note": "greedy on the same weights: equal in float32, bf16 kernels may differ"}
        print("ratios:", {k: round(v, 3) for k, v in res["ratios"].items() if isinstance(v, float)}, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    suffix = (f"{work.kind.value}-cpu-quick" if a.quick else None)
    path = write_result("serving", res, suffix=suffix, out=a.out)
    print(f"wrote {path}")
    return 0 if res["systems"].get(System.RAY_MOE.value, {}).get("status", "ok") == "ok" else 1


def main_online(a: argparse.Namespace, p: argparse.ArgumentParser, work: WorkloadSpec) -> int:
    if a.model:
        with open(os.path.join(a.model, "config.json")) as fh:
            vocab = int(json.load(fh)["vocab_size"])
    elif a.vocab_size:
        vocab = a.vocab_size
    else:
        p.error("--online needs --model DIR (its vocab_size) or --vocab-size N for the token-id prompts")
    if not a.rate > 0:
        p.error(f"--rate={a.rate}: must be > 0 (inf: all at once)")
    prompts = work.prompts(vocab)
    res = asyncio.run(run_online(a.url, prompts, work.new_tokens, a.rate, a.seed, api_key=a.api_key,
                                 timeout_s=a.timeout))
    res["expected_output_tokens"] = work.requests * work.new_tokens
    body = {"mode": "online", "workload": {**asdict(work), "kind": work.kind.value}, "versions": _versions(),
            "systems": {"ray_moe_serve": res}}
    print(f"online: {res['output_tokens_per_s']:.1f} output tok/s, status {res['status']}", flush=True)
    path = write_result("serving", body, suffix=f"online-{work.kind.value}", out=a.out)
    print(f"wrote {path}")
    return 0 if res["status"] == "ok" else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
