"""Serving throughput and latency on seeded workloads: ray-moe, transformers' continuous batching and vLLM side by side, offline or online (Poisson arrivals in-process, or HTTP to ray-moe serve).

    python -m ray_moe_bench.serving --quick                      # CPU smoke: tiny Qwen3-MoE, 8 requests, 2 ranks
    python -m ray_moe_bench.serving --layers 8 --ranks 2         # CUDA: a random 8-layer Qwen3-30B-A3B slice
    python -m ray_moe_bench.serving --model DIR --workload decode-heavy
    python -m ray_moe_bench.serving --config-only --workloads mixed decode-heavy chat long --systems ray_moe
    python -m ray_moe_bench.serving --config-only --workloads chat --online-inprocess --rate 8 --systems vllm
    python -m ray_moe_bench.serving --online --url http://127.0.0.1:8000 --model DIR --rate 4

Honest by construction:
  settings      every system runs with its own defaults; a ray-moe setting is passed only when its flag is given
                (``non_defaults`` in the JSON lists exactly those), the effective values are read back from the
                engine (``settings``); vLLM gets only what it needs to run here (model folder, dtype, seed,
                tensor_parallel_size, ``load_format=dummy`` for ``--config-only``) and ``--vllm-args``
                (``llm_kwargs``; its effective scheduler / cache / graph settings in ``effective``)
  warm-up       one untimed warm-up per workload, before any timed pass (``--no-warmup``: none), that shares no
                step shape with the timed passes: its own seed streams, ceil(requests / 4) requests clipped to
                [16, 64] and to at most half of the timed count, lengths from the same family each moved to the
                nearest length that no timed prompt has (likewise every output length to one no timed request
                has), and its prompts open with token ids no timed prompt opens with (prefix caches hash chained
                blocks: no warm block can serve a timed one). The JSON's ``warmup`` records it and the checks
  captures      ray-moe captures every CUDA graph at start; each shard's graph counters are read before and
                after every timed pass (``timed_pass_graphs``: captures, decode-graph / piecewise / eager steps,
                replays); a capture while serving (``graphs_captured_serving`` grew) fails the run (status
                "error", exit code 1). ``step_paths``: how each step kind runs (rank 0's ``steps`` report)
  second pass   ``--second-pass``: the same timed requests once more, reported as ``second_pass`` beside the
                first (prefix caches may then serve its prompts: its ``prefix_hit_tokens`` say how many)
Several workloads (``--workloads``): one worker process per system starts once, runs every workload's warm-up,
then each workload's timed pass in turn; each workload's JSON goes to its own folder ``<out>/<workload>``
(online in-process: ``<out>/<workload>-online``). A timed prompt that opens with the token id of a prompt of an
earlier pass of the same process is shifted (every id + k mod the vocabulary; ``first_token_shifts``), so no
pass is served from an earlier one's cache.

Offline: the same prompts (seeded) go to every system, each in its own subprocess (so each one's start time and
memory are its own), all submitted at once, greedy, exactly each request's own new-token count (EOS ignored):
  ray-moe       ``Runtime.start(RuntimeConfig.from_pretrained(folder, num_ranks=R))``, ``rt.serving()``; every
                request submitted to the generation loop with a token callback (host timestamps per token),
                ``SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)``
  transformers  ``AutoModelForCausalLM.from_pretrained(folder)`` on one device, ``model.generate_batch`` with
                ``record_timestamps`` (its continuous batching; eos_token_id=-1); skipped when it does not fit,
                and for workloads of per-request output lengths (one ``max_new_tokens`` per call)
  vLLM          ``LLM(model=folder).generate`` on token-id prompts, ``SamplingParams(temperature=0, max_tokens=n,
                ignore_eos=True)``, when ``import vllm`` works; offline vLLM gives throughput only
Online in-process (``--online-inprocess --rate R``): Poisson arrivals (seeded gaps, R req/s) of the workload's
requests inside each system's worker: ray-moe ``engine.submit(prompt, params, on_event=...)`` at each arrival
(a host time per token), vLLM ``AsyncLLM.generate`` (``RequestOutputKind.DELTA``: a host time per output
chunk; the ``vllm serve`` defaults: usage context OPENAI_API_SERVER) at each arrival.
``--random-model`` (the default without ``--model``): Qwen3-30B-A3B's shapes with random weights, ``--layers``
decoder layers, written with ``save_pretrained`` (and a word-level tokenizer) to a temporary folder that all
three load; ``--config-only`` writes the config (and tokenizer) only: ray-moe builds the seeded model in its
shards, transformers builds it on the device with its own initialisation (``from_config``), vLLM takes
``load_format=dummy`` (the same shapes, each system its own random weights: throughput, not token equality).
``--quantization fp8`` (with ``--config-only``): a random block-FP8 checkpoint of the shape (``--shape``
qwen3-30b-a3b, or deepseek-v3 at as many layers as one GPU holds), written once under ``--fp8-dir`` and reused
(``fp8_checkpoint.py``), loaded by ray-moe (``RuntimeConfig.from_pretrained(folder)``) and vLLM (``LLM(model=
folder)``, no dummy weights) alike; the JSON adds the checkpoint's bytes and seconds and ray-moe's memory after
start over them (``serving_fp8.py``).
Workloads: mixed (256 requests, lognormal prompt lengths, mean 480, clipped to [16, 3.2 x mean], 128 new tokens),
decode-heavy (256 x 32-token prompts, 256 new), prefill-heavy (64, uniform in [2/3, 4/3] x 1536, 16 new), chat
(1,000 requests, prompts like mixed, lognormal output lengths of mean 160 clipped to [8, 6.4 x mean] = [8, 1024]),
long (48 requests, prompts uniform in [6/7, 8/7] x 7168 = [6144, 8192], 192 new).
Latency as vLLM's benchmark_serving defines it: TTFT = first token - request sent; TPOT = (last token - first
token) / (output tokens - 1) per request; ITL = every gap between consecutive tokens (chunks: online vLLM, HTTP);
e2e = last token - request sent. Throughput: output tokens / wall (offline: from the submission to the last
token; online: from the first arrival to the last token).
Online over HTTP (``--online``): Poisson arrivals at ``--rate`` req/s (inf: all at once) to a running ``ray-moe
serve``, streaming ``/v1/completions`` with token-id prompts and ``ignore_eos``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import glob
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

import numpy as np

from ray_moe_bench import serving_fp8
from ray_moe_bench.common import (
    GpuMemorySampler,
    add_output_argument,
    latency_summary_ms,
    results_dir,
    write_result,
)


class Workload(str, Enum):
    MIXED = "mixed"
    DECODE_HEAVY = "decode-heavy"
    PREFILL_HEAVY = "prefill-heavy"
    CHAT = "chat"
    LONG = "long"


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


class Mode(str, Enum):
    """How a timed pass submits its requests: all at once (offline) or at Poisson arrivals (online, in-process)."""

    OFFLINE = "offline"
    ONLINE = "online-inprocess"


#: workload -> (requests, new tokens (chat: the mean of its output lengths), prompt mean)
WORKLOAD_DEFAULTS = MappingProxyType({
    Workload.MIXED: (256, 128, 480), Workload.DECODE_HEAVY: (256, 256, 32), Workload.PREFILL_HEAVY: (64, 16, 1536),
    Workload.CHAT: (1000, 160, 480), Workload.LONG: (48, 192, 7168)})
LOGNORMAL_SIGMA = 0.8  # prompt lengths (mixed, chat)
OUTPUT_SIGMA = 0.8  # output lengths (chat)
MIN_PROMPT = 16
PROMPT_CLIP = 3.2  # lognormal prompt lengths: at most 3.2 x the mean
MIN_OUTPUT = 8
OUTPUT_CLIP = 6.4  # chat's output lengths: at most 6.4 x the mean (1,024 at 160)
WARMUP_FRACTION, WARMUP_MIN, WARMUP_MAX = 4, 16, 64
#: the seed streams of the workloads whose draws sessions 14-17 measured (lengths: seed, tokens: seed + 1)
LEGACY_STREAMS = frozenset({Workload.MIXED, Workload.DECODE_HEAVY, Workload.PREFILL_HEAVY})
#: salts of every other stream (np.random.SeedSequence entropy): no two streams share a draw
STREAM_SALT = MappingProxyType({Workload.MIXED: 11, Workload.DECODE_HEAVY: 12, Workload.PREFILL_HEAVY: 13,
                                Workload.CHAT: 14, Workload.LONG: 15})
ARRIVAL_SALT = 21
GRAPH_KEYS = ("graphs_captured_start", "graphs_captured_serving", "decode_graph_steps", "token_graph_steps",
              "piecewise_steps", "eager_steps", "graph_replays", "completions_between_pieces")
SHARD_GC_KEYS = ("gc_collections", "gc_full_collections", "gc_pause_us", "gc_safe_point_collections")  # a shard's collector, summed since start
MAX_QUEUED_DEFAULT = 4096  # GenerationLoop's max_queued (passed only when a pass has more requests)


@dataclass(frozen=True)
class WorkloadSpec:
    """A seeded workload: ``requests`` requests; ``new_tokens`` each (chat: the mean of its lognormal output
    lengths); prompt lengths of mean ``prompt_mean`` tokens. ``warmup``: the warm-up's draw (other seed
    streams than the timed pass's, never its numbers)."""

    kind: Workload
    requests: int
    new_tokens: int
    prompt_mean: int
    seed: int
    warmup: bool = False

    def _rng(self, stream: int) -> np.random.Generator:
        """Stream 0: prompt lengths, 1: token ids, 2: output lengths."""
        if self.kind in LEGACY_STREAMS and not self.warmup:
            return np.random.default_rng(self.seed + stream)
        return np.random.default_rng([STREAM_SALT[self.kind], int(self.warmup), self.seed, stream])

    def prompt_lengths(self) -> list[int]:
        """Seeded prompt lengths, tokens (see the module docstring)."""
        rng = self._rng(0)
        m = self.prompt_mean
        if self.kind is Workload.DECODE_HEAVY:
            return [m] * self.requests
        if self.kind is Workload.PREFILL_HEAVY:
            return rng.integers(max(1, (2 * m) // 3), (4 * m) // 3 + 1, self.requests).tolist()
        if self.kind is Workload.LONG:
            lo = max(1, round(6 * m / 7))
            return rng.integers(lo, max(lo, round(8 * m / 7)) + 1, self.requests).tolist()
        mu = math.log(m) - LOGNORMAL_SIGMA ** 2 / 2  # the lognormal's mean is m before clipping
        xs = rng.lognormal(mu, LOGNORMAL_SIGMA, self.requests)
        return np.clip(np.rint(xs), min(MIN_PROMPT, m), max(MIN_PROMPT, int(PROMPT_CLIP * m))).astype(int).tolist()

    def new_tokens_list(self) -> list[int]:
        """Each request's new-token count: ``new_tokens`` for every request, except chat's seeded lognormal
        output lengths of mean ``new_tokens`` (before clipping) clipped to [min(8, mean), 6.4 x mean]."""
        n = self.new_tokens
        if self.kind is not Workload.CHAT:
            return [n] * self.requests
        mu = math.log(n) - OUTPUT_SIGMA ** 2 / 2
        lo = min(MIN_OUTPUT, n)
        xs = self._rng(2).lognormal(mu, OUTPUT_SIGMA, self.requests)
        return np.clip(np.rint(xs), lo, max(lo, round(OUTPUT_CLIP * n))).astype(int).tolist()

    def prompts(self, vocab_size: int, lengths: Sequence[int] | None = None) -> list[list[int]]:
        """Token-id prompts, uniform over the vocabulary (stream 1), of ``lengths`` (default: prompt_lengths)."""
        rng = self._rng(1)
        lengths = self.prompt_lengths() if lengths is None else lengths
        return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


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
    if seed < 0:
        raise ValueError(f"--seed={seed}: must be >= 0")
    return spec


@dataclass(frozen=True)
class Requests:
    """One pass's requests: token-id prompts and each request's new-token count (same length, same order)."""

    prompts: list[list[int]]
    new_tokens: list[int]

    def summary(self) -> dict[str, Any]:
        """Counts (tokens) of the pass: requests, prompt tokens, [min, mean, max] prompt and output lengths, and
        the output tokens a system must make (the sum of the counts)."""
        lens = [len(p) for p in self.prompts]
        return {"requests": len(lens), "prompt_tokens": sum(lens), "prompt_len_min_mean_max": _min_mean_max(lens),
                "new_tokens_min_mean_max": _min_mean_max(self.new_tokens),
                "expected_output_tokens": sum(self.new_tokens)}

    def as_spec(self, name: str) -> dict[str, Any]:
        return {"name": name, "prompts": self.prompts, "new_tokens": self.new_tokens}

    @staticmethod
    def of(d: dict) -> Requests:
        return Requests(d["prompts"], d["new_tokens"])


def _min_mean_max(xs: Sequence[float]) -> list[float] | None:
    return [min(xs), sum(xs) / len(xs), max(xs)] if xs else None


def _nearest_free(n: int, taken: set[int], lo: int, hi: int) -> int:
    """``n`` (clamped into [lo, hi]) when no timed request has it, else the nearest value of [lo, hi] that none
    has (the smaller one on a tie); ValueError when every value is taken."""
    n = min(max(n, lo), hi)
    if n not in taken:
        return n
    for d in range(1, hi - lo + 1):
        for c in (n - d, n + d):
            if lo <= c <= hi and c not in taken:
                return c
    raise ValueError(f"every length in [{lo}, {hi}] is a timed request's: no disjoint warm-up length exists")


def _open_with_free_id(prompt: list[int], taken: set[int], vocab: int) -> tuple[list[int], bool]:
    """``prompt`` with every id shifted by the smallest k >= 0 (mod ``vocab``) that makes its first id one no
    prompt of ``taken`` opens with; (the prompt, whether it was shifted)."""
    for k in range(vocab):
        if (prompt[0] + k) % vocab not in taken:
            return ([(t + k) % vocab for t in prompt] if k else prompt), k > 0
    raise ValueError(f"every one of the {vocab} token ids opens a prompt already: no prompt can be kept apart "
                     f"from the others' cached blocks (fewer --requests)")


def timed_requests(specs: Sequence[WorkloadSpec], vocab: int) -> tuple[list[Requests], list[int]]:
    """Each workload's timed requests, in run order, and how many of each pass's prompts were shifted so that
    none opens with the first token id of a prompt of an earlier pass (a prefix cache would otherwise serve it
    from that pass's blocks; the first workload's prompts are never shifted)."""
    seen: set[int] = set()
    out, shifts = [], []
    for spec in specs:
        prompts, moved = [], 0
        for p in spec.prompts(vocab):
            q, shifted = _open_with_free_id(p, seen, vocab)
            prompts.append(q)
            moved += shifted
        seen |= {p[0] for p in prompts}
        out.append(Requests(prompts, spec.new_tokens_list()))
        shifts.append(moved)
    return out, shifts


def warmup_count(requests: int) -> int:
    """The warm-up's requests for a pass of ``requests``: ceil(requests / 4) clipped to [16, 64], and at most half
    the timed count (at least 1): always fewer than the timed pass."""
    return max(1, min(max(WARMUP_MIN, -(-requests // WARMUP_FRACTION)), WARMUP_MAX, requests // 2))


def warmup_requests(specs: Sequence[WorkloadSpec], timed: Sequence[Requests], vocab: int,
                    max_context: int) -> tuple[list[Requests], dict[str, Any]]:
    """Each workload's warm-up (its own seed streams, ``warmup_count`` requests) sharing no prompt length, no
    output length and no first token id with any timed request of the run (``_nearest_free``,
    ``_open_with_free_id``), and the record of it: per workload its counts, the checks over the whole run
    (disjoint prompt lengths, disjoint output lengths, shared first ids: 0), each computed, not assumed."""
    taken_len = {len(p) for r in timed for p in r.prompts}
    taken_new = {n for r in timed for n in r.new_tokens}
    taken_first = {p[0] for r in timed for p in r.prompts}
    warm, info = [], {}
    for spec in specs:
        w = dataclasses.replace(spec, requests=warmup_count(spec.requests), warmup=True)
        lens = [_nearest_free(n, taken_len, 1, max_context - 1) for n in w.prompt_lengths()]
        news = [_nearest_free(n, taken_new, 1, max_context - ln) for n, ln in zip(w.new_tokens_list(), lens)]
        prompts = [_open_with_free_id(p, taken_first, vocab)[0] for p in w.prompts(vocab, lens)]
        r = Requests(prompts, news)
        warm.append(r)
        info[spec.kind.value] = r.summary()
    lens_w = {len(p) for r in warm for p in r.prompts}
    news_w = {n for r in warm for n in r.new_tokens}
    firsts_w = {p[0] for r in warm for p in r.prompts}
    record = {"requests": sum(len(r.prompts) for r in warm), "by_workload": info,
              "disjoint_prompt_lengths": not (lens_w & taken_len), "disjoint_new_tokens": not (news_w & taken_new),
              "shared_first_tokens": len(firsts_w & taken_first),
              "how": "per workload: its own seed streams, ceil(requests / 4) requests in [16, 64] (at most half "
                     "the timed ones), lengths of the same family each moved to the nearest length no timed "
                     "prompt has, output lengths likewise, prompts opening with ids no timed prompt opens with; "
                     "run (each workload's set at once) before any timed pass"}
    if not (record["disjoint_prompt_lengths"] and record["disjoint_new_tokens"]) or record["shared_first_tokens"]:
        raise RuntimeError(f"the warm-up is not disjoint from the timed passes: {record}")
    return warm, record


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Arrival times (s from the first, which is 0) of ``n`` requests at ``rate`` req/s: seeded exponential
    gaps (a Poisson process); inf: all at 0."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng([ARRIVAL_SALT, seed]).exponential(1.0 / rate, n)
    return np.cumsum(gaps) - gaps[0]


# ================================================================ metrics (shared by every system)
def token_metrics(prompts: list[list[int]], outputs: list[list[int]], wall_s: float, sent: list[float] | None = None,
                  stamps: list[list[float]] | None = None, expected: Sequence[int] | None = None) -> dict[str, Any]:
    """Counts (tokens) and throughput (per s over ``wall_s``) of one timed pass; with ``expected`` (each
    request's new-token count) the requests whose output has another length (``mismatched_requests``); with
    ``sent`` (per request, s) and ``stamps`` (per request, one host time per token or chunk, s, same clock):
    TTFT / TPOT / ITL / e2e p50 / p99 / mean in ms (benchmark_serving's definitions: TPOT = (last - first) /
    (output tokens - 1), over requests of two or more tokens)."""
    out_tokens = sum(len(o) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    counts = sorted({len(o) for o in outputs})
    res: dict[str, Any] = {"requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
                           "output_tokens_per_request": counts if len(counts) <= 16 else None,
                           "output_tokens_min_mean_max": _min_mean_max([len(o) for o in outputs]),
                           "wall_s": wall_s, "output_tokens_per_s": out_tokens / wall_s,
                           "total_tokens_per_s": (out_tokens + prompt_tokens) / wall_s,
                           "request_throughput_per_s": len(prompts) / wall_s, "streams": stamps is not None}
    if expected is not None:
        res["expected_output_tokens"] = sum(expected)
        res["mismatched_requests"] = (sum(len(o) != n for o, n in zip(outputs, expected))
                                      + abs(len(outputs) - len(expected)))
    if stamps is None or sent is None:
        return res
    ttft = [ts[0] - s for s, ts in zip(sent, stamps) if ts]
    tpot = [(ts[-1] - ts[0]) / (len(o) - 1) for o, ts in zip(outputs, stamps) if ts and len(o) > 1]
    itl = [b - a for ts in stamps for a, b in itertools.pairwise(ts)]
    e2e = [ts[-1] - s for s, ts in zip(sent, stamps) if ts]
    res["latency"] = {"ttft": latency_summary_ms(ttft), "tpot": latency_summary_ms(tpot),
                      "itl": latency_summary_ms(itl), "e2e": latency_summary_ms(e2e)}
    return res


def _check_pass(res: dict[str, Any], problems: list[str] | None = None) -> dict[str, Any]:
    """``res`` with ``status`` "ok", or "error" and ``error`` naming what was wrong (a request whose output is
    not its own count of tokens, and ``problems``)."""
    problems = list(problems or [])
    if res.get("mismatched_requests"):
        problems.append(f"{res['mismatched_requests']} requests did not make exactly their own new-token count "
                        f"({res['output_tokens']} of {res['expected_output_tokens']} output tokens)")
    res["status"] = "error" if problems else "ok"
    if problems:
        res["error"] = "; ".join(problems)
    return res


def _with_second(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """``first`` with ``second`` (the same requests once more) beside it as ``second_pass``; a failed second pass
    fails the pair."""
    first["second_pass"] = second
    if second.get("status") != "ok" and first.get("status") == "ok":
        first["status"], first["error"] = "error", f"second pass: {second.get('error')}"
    return first


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


def _digest(outs: list[list[int]]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]


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


# ================================================================ ray-moe (one worker process)
def start_runtime(cfg: Any) -> Any:
    """``ray_moe.Runtime.start(cfg)`` (one function, so tests can hand several runs one deployment)."""
    import ray_moe

    return ray_moe.Runtime.start(cfg)


def stop_runtime(rt: Any) -> None:
    rt.shutdown()


def read_graph_counters(rt: Any) -> dict[str, dict[str, int]]:
    """Each shard's graph and collector counters now: {rank: {GRAPH_KEYS / SHARD_GC_KEYS key: count}} (a key the
    shard has not counted: 0), from ``rt.shard_status()[rank]["counters"]``."""
    return {str(r): {k: int((st.get("counters") or {}).get(k, 0)) for k in GRAPH_KEYS + SHARD_GC_KEYS}
            for r, st in rt.shard_status().items()}


def shard_gc_deltas(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Each shard's collections and their summed pause over a pass (``read_graph_counters`` before and after):
    {rank: {SHARD_GC_KEYS key: growth}} (MEASURED by the shard's gc.callbacks: a pause between two launches leaves
    its GPU idle)."""
    return {r: {k: a.get(k, 0) - before.get(r, {}).get(k, 0) for k in SHARD_GC_KEYS} for r, a in after.items()}


def graph_deltas(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, Any]:
    """What each shard's graph counters did over a pass (``read_graph_counters`` before and after):
    ``captures`` (graphs captured, at start or while serving: a pass should capture none), ``captures_serving``
    (``graphs_captured_serving``'s growth: the benchmark asserts 0), steps run as a whole-step decode graph,
    as a whole-step token graph, as piecewise graphs, eagerly, graph replays, and steps completed between a
    piecewise launch's pieces (``completions_between_pieces``); per shard and summed."""
    per: dict[str, dict[str, int]] = {}
    for r, a in after.items():
        b = before.get(r, {})
        d = {k: a.get(k, 0) - b.get(k, 0) for k in GRAPH_KEYS}
        per[r] = {"captures": d["graphs_captured_start"] + d["graphs_captured_serving"],
                  "captures_serving": d["graphs_captured_serving"], "decode_graph_steps": d["decode_graph_steps"],
                  "token_graph_steps": d["token_graph_steps"], "piecewise_steps": d["piecewise_steps"],
                  "eager_steps": d["eager_steps"],
                  "graph_replays": d["graph_replays"], "completions_between_pieces": d["completions_between_pieces"]}
    total = {k: sum(s[k] for s in per.values()) for k in next(iter(per.values()), {})}
    return {"per_shard": per, "total": total,
            "serving_captures_ok": all(s["captures_serving"] == 0 for s in per.values())}


def _ray_moe_kwargs(spec: dict, cfg_only: dict | None) -> tuple[dict, dict]:
    """(``rt.serving`` keyword arguments the user's flags set, ones the benchmark itself must pass): the random
    model's config under ``--config-only``, ``max_queued`` only when a pass holds more than its default."""
    bench: dict[str, Any] = {}
    if cfg_only is not None:
        bench["random_model"] = cfg_only
    most = max([len(p["prompts"]) for p in spec["passes"] + spec["warm"]] or [0])
    if most > MAX_QUEUED_DEFAULT:
        bench["max_queued"] = most
    return dict(spec["ray_moe_serving"]), bench


def run_ray_moe(spec: dict, save: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """One ray-moe deployment for every pass of ``spec``: start (``start_s``: Runtime.start + rt.serving, whose
    CUDA graph capture is ``capture_s``), the warm-ups, then each workload's timed pass (``passes``). The
    effective settings are read back from the engine (``settings``); ``non_defaults``: exactly the settings
    the flags changed. A pass whose shards captured a graph (``graphs_captured_serving`` grew) or whose requests
    did not make their own counts has status "error", and so has the run. ``save``: called with the result so
    far after every pass (a worker killed later keeps what it measured)."""
    import ray_moe

    save = save or (lambda res: None)
    ranks = spec["ranks"]
    conf = spec.get("random_model")  # no weights in the folder: seeded experts, random non-expert modules
    cfg_kw = dict(spec["ray_moe_config"])  # the user's: decode_token_capacity under --decode-capacity only
    if conf is not None:
        cfg = ray_moe.RuntimeConfig(num_ranks=ranks, num_experts=conf["num_experts"], hidden_size=conf["hidden_size"],
                                    ffn_size=conf["moe_intermediate_size"], top_k=conf["num_experts_per_tok"],
                                    slots_per_rank=-(-conf["num_experts"] // ranks),
                                    num_layers=conf["num_hidden_layers"], device=spec["device"], dtype=spec["dtype"],
                                    seed=0, name="bench-serving", seeded_on_device=spec["device"] == "cuda",
                                    **cfg_kw)  # seeded_on_device: drawn on the GPU, no CPU draw
    else:
        cfg = ray_moe.RuntimeConfig.from_pretrained(spec["folder"], num_ranks=ranks, device=spec["device"],
                                                    dtype=spec["dtype"], seed=0, name="bench-serving", **cfg_kw)
    user_kw, bench_kw = _ray_moe_kwargs(spec, conf)
    t0 = time.perf_counter()
    rt = start_runtime(cfg)
    try:
        engine = rt.serving(**user_kw, **bench_kw)
        start_s = time.perf_counter() - t0
        status = rt.shard_status()
        first = status[min(status)] if status else {}
        res: dict[str, Any] = {
            "status": "ok", "start_s": start_s, "capture_s": engine.capture_s,
            "engine_warnings": [str(w) for w in engine.warnings],
            "memory_after_start": memory_after_start(status), "step_paths": first.get("steps"),
            "settings": {"ranks": ranks, "step_tokens": engine.scheduler.configured[0],
                         "max_running": engine.scheduler.configured[1], "rank_running": engine.rank_running,
                         "decode_steps": engine.scheduler.decode_steps, "kv_tokens_per_rank": engine.kv_tokens,
                         "kv_tokens_per_running_sequence": engine.capacity.tokens_per_sequence,
                         "attention": engine.attention_backend, "prefix_caching": engine.prefix_caching,
                         "block_size": engine.block_size, "max_queued": engine.max_queued,
                         "decode_token_capacity": cfg.decode_token_capacity,
                         "seeded_on_device": cfg.seeded_on_device},
            "non_defaults": {**cfg_kw, **user_kw},
            "bench_passed": {k: ("the random model's config (--config-only)" if k == "random_model" else v)
                             for k, v in bench_kw.items()},
            "settings_note": "settings: read back from the engine after start (the product's defaults unless "
                             "non_defaults names the setting); bench_passed: what the benchmark itself must pass",
            "latency_note": "host timestamps of the generation loop's token events in the driver; with multi-step "
                            "decode (decode_steps > 1) tokens arrive in bursts (ITL ~0 inside one)",
            "passes": {}}
        mode = Mode(spec["mode"])
        timeout = spec["timeout_s"]
        if spec["warmup"]:
            res["warmup_s"] = {}
            for w in spec["warm"]:
                t = time.perf_counter()
                _ray_moe_offline(engine, Requests.of(w), timeout)
                res["warmup_s"][w["name"]] = time.perf_counter() - t
        for p in spec["passes"]:
            reqs = Requests.of(p)
            try:
                one = _ray_moe_pass(rt, engine, reqs, mode, spec, p["name"])
                if spec["second_pass"]:
                    _with_second(one, _ray_moe_pass(rt, engine, reqs, mode, spec, p["name"]))
            except Exception as exc:  # noqa: BLE001 - this pass failed; the others are still measured
                one = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            res["passes"][p["name"]] = one
            if one["status"] != "ok":
                res["status"] = "error"
                res.setdefault("error", f"{p['name']}: {one['error']}")
            save(res)
        res["memory"] = {**_cuda_peak(), "note": "torch counters of the driver process only: the model lives in "
                                                 "the shard actors, whose allocator peak ray-moe does not report; "
                                                 "see nvidia_smi"}
        shards = rt.shard_status()
        res["shards"] = {str(r): {"counters": st.get("counters"), "capture_error": st.get("capture_error"),
                                  "weight_bytes": st.get("weight_bytes"), "slot_buffers": st.get("slot_buffers"),
                                  # the FP8 launch settings' table (None: the kernels' heuristics, or no FP8)
                                  "fp8_launch_table": (st.get("fused_kernels") or {}).get("fp8_launch_table")}
                         for r, st in shards.items()}
        res["memory_events"] = list(engine.memory_events)
        return res
    finally:
        stop_runtime(rt)


def _ray_moe_params(news: Sequence[int]) -> list[Any]:
    """Greedy, exactly n new tokens each (EOS ignored): one ``SamplingParams`` per distinct n."""
    from ray_moe.model.sampling import SamplingParams

    made = {n: SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in set(news)}
    return [made[n] for n in news]


def _stamper(stamps: list[float]) -> Callable[[Any], None]:
    """A token callback: a host time (perf_counter, s) per token (an int; None ends, an exception fails)."""
    return lambda item: stamps.append(time.perf_counter()) if isinstance(item, int) else None


def _ray_moe_offline(engine: Any, reqs: Requests, timeout_s: float
                     ) -> tuple[list[list[int]], float, list[float], list[list[float]], dict[str, Any]]:
    """Every request submitted at once (one batch, as vLLM's LLM.generate adds every request before it steps):
    (outputs, wall s from the submission to the last result, sent times, per-token host times, extras)."""
    stamps: list[list[float]] = [[] for _ in reqs.prompts]
    params = _ray_moe_params(reqs.new_tokens)
    t = time.perf_counter()
    handles = engine.submit_many([(p, sp, _stamper(stamps[i])) for i, (p, sp) in enumerate(zip(reqs.prompts, params))])
    outs = [h.result(timeout_s) for h in handles]
    return outs, time.perf_counter() - t, [t] * len(reqs.prompts), stamps, {}


def _ray_moe_online(engine: Any, reqs: Requests, rate: float, seed: int, timeout_s: float
                    ) -> tuple[list[list[int]], float, list[float], list[list[float]], dict[str, Any]]:
    """Each request submitted to the generation loop at its Poisson arrival (``poisson_arrivals``): (outputs, wall
    s from the first arrival to the last result, sent times (the submission, s), per-token host times, extras:
    the rate, the largest lag of a submission behind its arrival, the requests that failed)."""
    n = len(reqs.prompts)
    arrivals = poisson_arrivals(n, rate, seed)
    params = _ray_moe_params(reqs.new_tokens)
    stamps: list[list[float]] = [[] for _ in range(n)]
    sent = [0.0] * n
    handles = []
    start = time.perf_counter()
    for i in range(n):
        wait = start + arrivals[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        sent[i] = time.perf_counter()
        handles.append(engine.submit(reqs.prompts[i], params[i], on_event=_stamper(stamps[i])))
    outs, errors = [], []
    for i, h in enumerate(handles):
        try:
            outs.append(h.result(timeout_s))
        except Exception as exc:  # noqa: BLE001 - recorded; its tokens so far count
            errors.append(f"request {i}: {type(exc).__name__}: {exc}")
            outs.append(list(h.tokens))
    wall = time.perf_counter() - start
    extra = {"rate_per_s": rate, "arrival_span_s": float(arrivals[-1]) if n else 0.0,
             "max_submit_lag_ms": max((s - (start + a)) * 1e3 for s, a in zip(sent, arrivals)) if n else 0.0,
             "errors": errors[:10]}
    return outs, wall, sent, stamps, extra


def _ray_moe_pass(rt: Any, engine: Any, reqs: Requests, mode: Mode, spec: dict, name: str) -> dict[str, Any]:
    """One timed pass and what the deployment did in it: token metrics, the shards' graph counter deltas
    (``timed_pass_graphs``), the engine's steps, prompt tokens served from the prefix cache, the driver's
    collector pauses and the step timings / host work of the pass's steps."""
    before, use0 = read_graph_counters(rt), rt.stats()["expert_use"]
    steps0, gc0, pre0 = engine.steps, engine.gc_counters(), engine.prefix_stats()
    for dq in engine.timings.values():  # the timed pass's steps only
        dq.clear()
    if mode is Mode.OFFLINE:
        outs, wall, sent, stamps, extra = _ray_moe_offline(engine, reqs, spec["timeout_s"])
    else:
        outs, wall, sent, stamps, extra = _ray_moe_online(engine, reqs, spec["rate"], spec["seed"], spec["timeout_s"])
    after, use1 = read_graph_counters(rt), rt.stats()["expert_use"]
    gc1, pre1 = engine.gc_counters(), engine.prefix_stats()
    res = token_metrics(reqs.prompts, outs, wall, sent, stamps, expected=reqs.new_tokens)
    res.update(extra)
    graphs = graph_deltas(before, after)
    res["timed_pass_graphs"] = graphs
    res["shard_gc"] = shard_gc_deltas(before, after)
    res["engine_steps"] = engine.steps - steps0
    res["prefix_hit_tokens"] = pre1["hit_tokens"] - pre0["hit_tokens"]
    res["prefix_lookup_tokens"] = pre1["lookup_tokens"] - pre0["lookup_tokens"]
    res["outputs_digest"] = _digest(outs)
    # the experts each (step, MoE layer) of the pass touched, from the shards' per-layer route counts (a
    # multi-step decode request's sub-steps together); peak_over_mean: the busiest expert's routes over the mean's
    from ray_moe.driver.books import expert_use

    d = {k: use1[k] - use0[k] for k in ("layer_steps", "touched", "routes", "peak_routes")}
    res["expert_use"] = expert_use(d["layer_steps"], use1["experts"], d["touched"], d["routes"], d["peak_routes"])
    # the driver process's garbage-collector pauses in the pass (MEASURED: gc.callbacks; the shards' in the pass
    # are shard_gc, since their start shards[*].counters: gc_*)
    res["driver_gc"] = {k: (gc1[k] if k in ("gc_pause_max_us", "gc_frozen_objects") else gc1[k] - gc0[k])
                        for k in gc1}
    # where a step's time goes (median ms per step: plan, launch, wait, shard, device, idle, ...), over the last
    # 1,024 steps of the pass at most (the loop keeps no more: host_work["steps"] says how many)
    res["step_timings_ms"] = engine.timing_summary()
    res["host_work"] = host_share(engine.timings)
    res["host_work_by_kind"] = host_share_by_kind(engine.timings, engine.step_shapes)
    problems = [f"errors: {extra['errors'][:3]}"] if extra.get("errors") else []
    grew = {r: d["captures_serving"] for r, d in graphs["per_shard"].items() if d["captures_serving"]}
    if grew:
        problems.append(f"graphs captured while serving in the timed pass of {name} (graphs_captured_serving grew: "
                        f"{grew} by shard; the benchmark asserts 0: every step shape is captured at start)")
    return _check_pass(res, problems)


def memory_after_start(status: dict) -> dict[str, Any]:
    """Each shard's device memory right after start, before any request (MEASURED by the shard,
    ``ShardCore._memory``), read after ``rt.serving()``: the KV cache (``kv_bytes``) and the step graphs are
    allocated by then. ``allocated_over_weights``: allocated bytes over the weights it holds (expert slot buffers +
    the model's other modules); ``allocated_beside_kv_over_weights``: the same without the KV cache (weights, graph
    buffers, workspaces)."""
    out: dict[str, Any] = {}
    for r, st in status.items():
        m = dict(st.get("memory") or {})
        weights = m.get("expert_bytes", 0) + m.get("module_bytes", 0)
        if "allocated_bytes" in m and weights:
            m["allocated_over_weights"] = m["allocated_bytes"] / weights
            m["allocated_beside_kv_over_weights"] = (m["allocated_bytes"] - m.get("kv_bytes", 0)) / weights
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


# ================================================================ transformers (one worker process)
def random_model_bytes(folder: str, dtype: Any) -> int:
    """The parameter bytes of the folder's config at ``dtype`` (counted on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    return sum(p.numel() for p in model.parameters()) * torch.empty(0, dtype=dtype).element_size()


def run_transformers(spec: dict, save: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """transformers' continuous batching (``generate_batch``) on one device: the model built once (``start_s``),
    then per workload of one output length a paged cache sized for its timed and warm requests, its warm-up
    (persistent manager) and its timed pass; a workload of per-request output lengths is skipped (one
    ``max_new_tokens`` per call). Online mode: skipped (it takes a whole batch per call)."""
    import torch
    from transformers import AutoModelForCausalLM

    save = save or (lambda res: None)
    if Mode(spec["mode"]) is not Mode.OFFLINE:
        return {"status": "skipped", "reason": "transformers' generate_batch takes a whole batch per call: no "
                                               "requests arriving over time (online mode)"}
    device = spec["device"]
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
    res: dict[str, Any] = {"status": "ok", "start_s": time.perf_counter() - t0, "passes": {},
                           "latency_note": "generate_batch(record_timestamps=True): a host time per token; all "
                                           "requests sent when generate_batch was called"}
    warm = {w["name"]: Requests.of(w) for w in spec["warm"]} if spec["warmup"] else {}
    for p in spec["passes"]:
        reqs = Requests.of(p)
        if len(set(reqs.new_tokens)) > 1:
            res["passes"][p["name"]] = {"status": "skipped", "reason": "per-request output lengths: transformers' "
                                        "generate_batch takes one max_new_tokens per call"}
            continue
        try:
            one = _transformers_workload(model, reqs, warm.get(p["name"]), spec)
        except Exception as exc:  # noqa: BLE001 - this workload failed; the others are still measured
            one = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        res["passes"][p["name"]] = one
        if one["status"] == "error":
            res["status"] = "error"
            res.setdefault("error", f"{p['name']}: {one['error']}")
        save(res)
    res["memory"] = _cuda_peak()
    return res


def _transformers_workload(model: Any, reqs: Requests, warm: Requests | None, spec: dict) -> dict[str, Any]:
    """One workload of one output length: warm-up (when given, its own output length) and timed pass(es)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from ray_moe.driver.defaults import DEFAULT_STEP_TOKENS

    new = reqs.new_tokens[0]
    gen = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=-1, pad_token_id=0)
    # the paged cache sized for every request at once (its own default sizing from free memory takes tens of
    # seconds on CPU); prefill chunk = ray-moe's step tokens (--step-tokens, else ray-moe's default)
    batch_tokens = spec["step_tokens"] or DEFAULT_STEP_TOKENS["cuda" if spec["device"] == "cuda" else "cpu"]
    page = 256

    def blocks(r: Requests) -> int:
        return sum(math.ceil((len(p) + n) / page) for p, n in zip(r.prompts, r.new_tokens))

    nblocks = max(blocks(reqs), blocks(warm) if warm else 0) + 1
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=nblocks, max_batch_tokens=batch_tokens)
    keep = warm is not None or spec["second_pass"]
    warm_s = None
    if warm is not None:
        if len(set(warm.new_tokens)) > 1:
            raise ValueError("a warm-up of per-request output lengths for a one-length workload")
        t0 = time.perf_counter()
        model.generate_batch(warm.prompts, generation_config=gen, continuous_batching_config=cb,
                             persistent_manager=True, progress_bar=False, max_new_tokens=warm.new_tokens[0])
        warm_s = time.perf_counter() - t0

    def one_pass() -> dict[str, Any]:
        t = time.perf_counter()
        out = model.generate_batch(reqs.prompts, generation_config=gen, continuous_batching_config=cb,
                                   record_timestamps=True, persistent_manager=keep, progress_bar=False,
                                   max_new_tokens=new)
        wall = time.perf_counter() - t
        results = list(out.values())
        if len(results) != len(reqs.prompts) or any(r.error for r in results):
            bad = [r.error for r in results if r.error][:3]
            raise RuntimeError(f"generate_batch returned {len(results)} of {len(reqs.prompts)} requests; errors {bad}")
        outs = [list(r.generated_tokens) for r in results]
        stamps = [list(x.timestamps or []) for x in results]
        r = token_metrics(reqs.prompts, outs, wall, [t] * len(reqs.prompts), stamps, expected=reqs.new_tokens)
        r["outputs_digest"] = _digest(outs)
        return _check_pass(r)

    try:
        res = one_pass()
        if spec["second_pass"]:
            _with_second(res, one_pass())
    finally:
        if keep:
            model.destroy_cached_continuous_batching_manager()
    res["settings"] = {"attn_implementation": getattr(model.config, "_attn_implementation", None),
                       "page_size": page, "num_blocks": nblocks, "max_batch_tokens": batch_tokens,
                       "experts_implementation": "grouped_mm" if spec["device"] == "cuda" else "default"}
    res["warmup_s"] = warm_s  # (this workload's own warm-up, on the manager the timed pass then reuses)
    res["non_defaults"] = {"page_size": page, "num_blocks": nblocks, "max_batch_tokens": batch_tokens,
                           **({"experts_implementation": "grouped_mm"} if spec["device"] == "cuda" else {})}
    return res


# ================================================================ vLLM (one worker process; imported lazily)
def vllm_kwargs(spec: dict) -> dict[str, Any]:
    """What vLLM is given: the model / tokenizer folder, dtype, seed, tensor_parallel_size, and ``vllm_args``
    (``load_format=dummy`` under ``--config-only`` without ``--quantization``, then ``--vllm-args``); everything
    else its own default
    (no max_model_len: the model's own context)."""
    return {"model": spec["folder"], "tokenizer": spec["folder"], "dtype": spec["dtype"], "seed": 0,
            "tensor_parallel_size": spec["vllm_tp"], **spec["vllm_args"]}


def vllm_non_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The settings vLLM is given beyond its model folder (each may equal vLLM's own default: listed anyway)."""
    return {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")}


def vllm_effective(vllm_config: Any) -> dict[str, Any]:
    """The engine's effective settings (its defaults resolved): context, batch budgets, cache, CUDA graphs,
    attention backend (None where an attribute is absent in this vLLM)."""
    def get(obj: Any, *names: str) -> Any:
        for n in names:
            obj = getattr(obj, n, None)
            if obj is None:
                return None
        return obj if isinstance(obj, (int, float, str, bool, list, type(None))) else str(obj)

    vc = vllm_config
    return {"max_model_len": get(vc, "model_config", "max_model_len"), "dtype": get(vc, "model_config", "dtype"),
            "max_num_batched_tokens": get(vc, "scheduler_config", "max_num_batched_tokens"),
            "max_num_seqs": get(vc, "scheduler_config", "max_num_seqs"),
            "enable_chunked_prefill": get(vc, "scheduler_config", "enable_chunked_prefill"),
            "enable_prefix_caching": get(vc, "cache_config", "enable_prefix_caching"),
            "block_size": get(vc, "cache_config", "block_size"),
            "gpu_memory_utilization": get(vc, "cache_config", "gpu_memory_utilization"),
            "num_gpu_blocks": get(vc, "cache_config", "num_gpu_blocks"),
            "tensor_parallel_size": get(vc, "parallel_config", "tensor_parallel_size"),
            "compilation_mode": get(vc, "compilation_config", "mode"),
            "cudagraph_mode": get(vc, "compilation_config", "cudagraph_mode"),
            "cudagraph_capture_sizes": get(vc, "compilation_config", "cudagraph_capture_sizes"),
            "attention_backend": get(vc, "attention_config", "backend")}


def wait_for_traces(folder: str, timeout_s: float = 120.0, settle_s: float = 3.0) -> list[str]:
    """The trace files vLLM's profiler wrote under ``folder`` once their sizes stop changing (its engine process
    writes them after ``stop_profile`` returns; vLLM's own example waits too), at most ``timeout_s``."""
    deadline, last, stable_since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        now = sorted((f, os.path.getsize(f)) for f in glob.glob(os.path.join(folder, "**", "*.json*"), recursive=True))
        if now != last:
            last, stable_since = now, time.monotonic()
        elif now and time.monotonic() - stable_since >= settle_s:
            break
        time.sleep(0.5)
    return [f for f, _ in last or []]


def run_vllm(spec: dict, save: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """vLLM in this process with its own defaults (``vllm_kwargs``): offline ``LLM`` (usage context LLM_CLASS, as
    ``LLM(...)`` always is), or online ``AsyncLLM`` (``run_vllm_online``); the warm-ups, then each timed pass."""
    if Mode(spec["mode"]) is Mode.ONLINE:
        return asyncio.run(run_vllm_online(spec, save))
    from vllm import LLM, SamplingParams

    save = save or (lambda res: None)
    kwargs = vllm_kwargs(spec)
    profile_dir = spec.get("vllm_profile")
    if profile_dir:  # its torch profiler over the first timed pass (kernel_mix.py reads the traces)
        kwargs["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": profile_dir}
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except TypeError:  # a vLLM without profiler_config reads the folder from its environment
        if not profile_dir:
            raise
        os.environ["VLLM_TORCH_PROFILER_DIR"] = kwargs.pop("profiler_config")["torch_profiler_dir"]
        llm = LLM(**kwargs)
    res: dict[str, Any] = {"status": "ok", "start_s": time.perf_counter() - t0, "llm_kwargs": kwargs,
                           "non_defaults": vllm_non_defaults(kwargs), "usage_context": "LLM_CLASS (LLM's own)",
                           "effective": vllm_effective(llm.llm_engine.vllm_config),
                           "latency_note": "offline LLM.generate returns whole requests: throughput only",
                           "passes": {}}

    def params(news: Sequence[int]) -> list[Any]:
        made = {n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in set(news)}
        return [made[n] for n in news]

    def one_pass(reqs: Requests) -> dict[str, Any]:
        inputs = [{"prompt_token_ids": p} for p in reqs.prompts]
        sp = params(reqs.new_tokens)
        t = time.perf_counter()
        got = llm.generate(inputs, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        outs = [list(g.outputs[0].token_ids) for g in got]
        r = token_metrics(reqs.prompts, outs, wall, expected=reqs.new_tokens)
        r["prefix_hit_tokens"] = sum(g.num_cached_tokens or 0 for g in got)  # RequestOutput.num_cached_tokens
        r["outputs_digest"] = _digest(outs)
        return _check_pass(r)

    if spec["warmup"]:
        res["warmup_s"] = {}
        for w in spec["warm"]:
            t = time.perf_counter()
            reqs = Requests.of(w)
            llm.generate([{"prompt_token_ids": p} for p in reqs.prompts], params(reqs.new_tokens), use_tqdm=False)
            res["warmup_s"][w["name"]] = time.perf_counter() - t
    for i, p in enumerate(spec["passes"]):
        reqs = Requests.of(p)
        try:
            if profile_dir and i == 0:
                llm.start_profile()
            one = one_pass(reqs)
            if profile_dir and i == 0:
                llm.stop_profile()
                one["profiled"] = {"note": "torch profiler on: not a benchmark figure",
                                   "traces": wait_for_traces(profile_dir)}
            if spec["second_pass"]:
                _with_second(one, one_pass(reqs))
        except Exception as exc:  # noqa: BLE001 - this pass failed; the others are still measured
            one = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        res["passes"][p["name"]] = one
        if one["status"] != "ok":
            res["status"] = "error"
            res.setdefault("error", f"{p['name']}: {one['error']}")
        save(res)
    res["memory"] = _cuda_peak()
    return res


async def run_vllm_online(spec: dict, save: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """vLLM's ``AsyncLLM`` in this process (``AsyncLLM.from_engine_args(AsyncEngineArgs(**vllm_kwargs))`` with
    usage context OPENAI_API_SERVER: the defaults ``vllm serve`` runs with), built inside the event loop as
    vLLM's API server builds it; the warm-ups all at once, then each timed pass at Poisson arrivals."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    save = save or (lambda res: None)
    kwargs = vllm_kwargs(spec)
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=UsageContext.OPENAI_API_SERVER)
    try:
        res: dict[str, Any] = {"status": "ok", "start_s": time.perf_counter() - t0, "llm_kwargs": kwargs,
                               "non_defaults": vllm_non_defaults(kwargs),
                               "usage_context": "OPENAI_API_SERVER (vllm serve's)",
                               "effective": vllm_effective(engine.vllm_config),
                               "latency_note": "host times in this process of AsyncLLM.generate's outputs "
                                               "(RequestOutputKind.DELTA): TTFT from the request sent, ITL per "
                                               "output chunk", "passes": {}}
        if spec["warmup"]:
            res["warmup_s"] = {}
            for w in spec["warm"]:
                t = time.perf_counter()
                await _vllm_async_pass(engine, Requests.of(w), math.inf, spec["seed"], f"warm-{w['name']}")
                res["warmup_s"][w["name"]] = time.perf_counter() - t
        for p in spec["passes"]:
            reqs = Requests.of(p)
            try:
                one = await _vllm_async_pass(engine, reqs, spec["rate"], spec["seed"], p["name"])
                if spec["second_pass"]:
                    _with_second(one, await _vllm_async_pass(engine, reqs, spec["rate"], spec["seed"],
                                                             f"{p['name']}-2"))
            except Exception as exc:  # noqa: BLE001 - this pass failed; the others are still measured
                one = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            res["passes"][p["name"]] = one
            if one["status"] != "ok":
                res["status"] = "error"
                res.setdefault("error", f"{p['name']}: {one['error']}")
            save(res)
        res["memory"] = _cuda_peak()
        return res
    finally:
        engine.shutdown()


async def _vllm_async_pass(engine: Any, reqs: Requests, rate: float, seed: int, tag: str) -> dict[str, Any]:
    """One pass through ``AsyncLLM.generate`` at Poisson arrivals (inf: all at once): each request's output
    chunks (DELTA) stamped with host times as they arrive; token metrics of the pass, the rate, the largest lag
    of a request behind its arrival, prompt tokens vLLM served from its prefix cache (``num_cached_tokens``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    n = len(reqs.prompts)
    arrivals = poisson_arrivals(n, rate, seed)
    stamps: list[list[float]] = [[] for _ in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]
    sent = [0.0] * n
    cached = [0] * n
    errors: list[str] = []
    start = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        sp = SamplingParams(temperature=0.0, max_tokens=reqs.new_tokens[i], ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        sent[i] = time.perf_counter()
        try:
            async for out in engine.generate(prompt={"prompt_token_ids": reqs.prompts[i]}, sampling_params=sp,
                                             request_id=f"{tag}-{i}"):
                ids = list(out.outputs[0].token_ids) if out.outputs else []
                if ids:
                    stamps[i].append(time.perf_counter())
                    outs[i].extend(ids)
                if out.finished:
                    cached[i] = out.num_cached_tokens or 0
        except Exception as exc:  # noqa: BLE001 - recorded; its tokens so far count
            errors.append(f"request {i}: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - start
    res = token_metrics(reqs.prompts, outs, wall, sent, stamps, expected=reqs.new_tokens)
    res.update(rate_per_s=rate, arrival_span_s=float(arrivals[-1]) if n else 0.0,
               max_submit_lag_ms=max((s - (start + a)) * 1e3 for s, a in zip(sent, arrivals)) if n else 0.0,
               errors=errors[:10], prefix_hit_tokens=sum(cached), outputs_digest=_digest(outs))
    return _check_pass(res, [f"errors: {errors[:3]}"] if errors else [])


# ================================================================ worker processes
WORKERS = MappingProxyType({Role.RAY_MOE: run_ray_moe, Role.TRANSFORMERS: run_transformers, Role.VLLM: run_vllm})


def worker_main(role: Role, spec_path: str) -> int:
    """A worker subprocess: run ``role`` on the spec, write its result JSON (after every pass too); exit code 1
    when its status is "error"."""
    with open(spec_path) as fh:
        spec = json.load(fh)

    def save(res: dict[str, Any]) -> None:
        tmp = spec["result_path"] + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(res, fh, default=str)
        os.replace(tmp, spec["result_path"])

    if role is Role.PREPARE:
        res = prepare_random_model(spec["model"], spec["folder"], spec["device"], spec["dtype"], spec["seed"],
                                   spec.get("weights", True))
    else:
        res = {"status": "ok", **WORKERS[role](spec, save)}
    save(res)
    return 1 if res.get("status") == "error" else 0


def run_worker(role: Role, spec: dict, workdir: str, timeout_s: float, *, in_process: bool = False) -> dict[str, Any]:
    """Run one worker subprocess on ``spec``; its JSON result (what it saved when it failed or ran past
    ``timeout_s``: status "error"), or {"status": "error"} with its stderr's tail. Adds the worker's wall time
    and nvidia-smi's peak used memory while it ran. ``in_process``: run it here instead (tests: no interpreter
    start per system, an already running Ray; start times and memory then include what this process holds)."""
    if in_process:
        import traceback

        t0 = time.perf_counter()
        try:
            fn = WORKERS.get(role)
            res = (prepare_random_model(spec["model"], spec["folder"], spec["device"], spec["dtype"], spec["seed"],
                                        spec.get("weights", True))
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
        # its own session: a worker that runs late is killed with every process it started (Ray's, vLLM's
        # engine core), so none of them keeps the GPU from the next run
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                 start_new_session=True)
        late = False
        try:
            stdout, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            late = True
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                stdout, stderr = child.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # (a process outside the group holds the pipes)
                stdout = stderr = ""
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout or "", stderr or "")
    took = time.perf_counter() - t0
    saved = None
    if os.path.exists(spec["result_path"]):
        with open(spec["result_path"]) as fh:
            saved = json.load(fh)
    if late:
        why = f"{role.value} worker ran past {timeout_s} s"
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        if saved is None:
            return {"status": "error", "error": why, "stderr_tail": tail, "stderr_errors": _error_lines(proc),
                    "process_s": took}
        res = {**saved, "status": "error", "error": f"{why} (the passes it finished are kept)", "stderr_tail": tail,
               "stderr_errors": _error_lines(proc)}
    elif saved is None or (proc.returncode != 0 and saved.get("status") == "ok"):
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-15:]
        return {**(saved or {}), "status": "error", "error": f"{role.value} worker exited {proc.returncode}",
                "stderr_tail": tail, "stderr_errors": _error_lines(proc), "process_s": took}
    else:
        res = {**saved, "exit_code": proc.returncode}
        if proc.returncode or saved.get("status") != "ok":
            res["stderr_errors"] = _error_lines(proc)
    res["process_s"] = took
    if mem.report() is not None:
        res.setdefault("memory", {})["nvidia_smi"] = mem.report()
    return res


def _error_lines(proc: subprocess.CompletedProcess, keep: int = 20) -> list[str]:
    """The worker's lines naming an error or exception (the first ``keep``): a root cause printed long before
    its last lines (vLLM's engine core: the OutOfMemoryError of its graph capture, then a page of re-raises),
    which ``stderr_tail`` alone loses."""
    text = (proc.stderr or "") + "\n" + (proc.stdout or "")
    return [ln[:400] for ln in text.splitlines() if "Error" in ln or "Exception" in ln][:keep]


def system_entry(res: dict[str, Any], name: str, workloads: list[str]) -> dict[str, Any]:
    """One system's entry in workload ``name``'s JSON: that workload's pass (its status its own), beside what
    the worker process shared by every workload it ran (start, settings, memory: ``process`` says which)."""
    passes = res.get("passes")
    if passes is None:  # skipped or failed before any pass
        return dict(res)
    shared = {k: v for k, v in res.items() if k not in ("passes", "status", "error")}
    proc = {"workloads": workloads, "shared": len(workloads) > 1, "status": res.get("status"),
            "error": res.get("error")}
    one = passes.get(name)
    if one is None:
        return {**shared, "status": "error", "error": res.get("error") or f"{name}: not run", "process": proc}
    return {**shared, **one, "process": proc}


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """ray-moe / baseline output tokens/s (and, where both stream, TTFT and TPOT p50 ray-moe / baseline), only
    where both were measured in this run (else None and why)."""
    out: dict[str, Any] = {}
    ours = systems.get(System.RAY_MOE.value, {})
    for base in (System.VLLM, System.TRANSFORMERS):
        other = systems.get(base.value, {})
        key = f"ray_moe_over_{base.value}_output_tokens_per_s"
        if ours.get("status") == "ok" and other.get("status") == "ok":
            out[key] = ours["output_tokens_per_s"] / other["output_tokens_per_s"]
            for lat in ("ttft", "tpot"):
                a, b = ((s.get("latency") or {}).get(lat) or {} for s in (ours, other))
                if a.get("p50_ms") and b.get("p50_ms"):
                    out[f"ray_moe_over_{base.value}_{lat}_p50"] = a["p50_ms"] / b["p50_ms"]
        else:
            out[key] = None
            out[f"{key}_why_none"] = (f"ray_moe: {ours.get('status', 'not run')}, "
                                      f"{base.value}: {other.get('status', 'not run')}")
    return out


# ================================================================ online: HTTP against ray-moe serve
async def run_online(url: str, prompts: list[list[int]], new_tokens: int | Sequence[int], rate: float, seed: int, *,
                     model: str | None = None, api_key: str | None = None, transport: Any = None,
                     timeout_s: float = 600.0) -> dict[str, Any]:
    """Poisson arrivals (``rate`` req/s, inf: all at once; ``poisson_arrivals``) of streaming ``/v1/completions``
    requests (``new_tokens``: one count for all, or each request's; ``ignore_eos``); per-chunk host timestamps
    give TTFT / TPOT / ITL (vLLM benchmark_serving's definitions)."""
    import httpx

    news = [new_tokens] * len(prompts) if isinstance(new_tokens, int) else list(new_tokens)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    arrivals = poisson_arrivals(len(prompts), rate, seed)
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
            body = {"model": model, "prompt": prompts[i], "max_tokens": news[i], "temperature": 0.0,
                    "stream": True, "ignore_eos": True}
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
    res = token_metrics(prompts, outs, wall, sent, stamps, expected=news)
    res.update(status="ok" if not errors else "error", errors=errors[:10], url=url, model=model, rate_per_s=rate,
               stopped_early=sum(len(o) < n for o, n in zip(outs, news)),
               finish_reasons={r: finish.count(r) for r in set(finish)},
               latency_note="host times in this client: TTFT from request sent, ITL per streamed chunk; requests "
                            "ask ignore_eos (a server without it may stop at EOS: stopped_early)")
    return res


# ================================================================ the driver
def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The model slice and workload flags (--layers, --workload, --requests, --new-tokens, --prompt-mean), shared
    with the in-process step profile."""
    p.add_argument("--layers", type=int, default=48, help="decoder layers of the random Qwen3-30B-A3B slice")
    p.add_argument("--workload", type=Workload, choices=list(Workload), default=Workload.MIXED,
                   metavar="{" + ",".join(w.value for w in Workload) + "}")
    p.add_argument("--requests", type=int)
    p.add_argument("--new-tokens", type=int, help="new tokens per request (chat: the mean of its output lengths)")
    p.add_argument("--prompt-mean", type=int)


#: ray-moe flag -> (where it goes: RuntimeConfig or rt.serving, its keyword)
RAY_MOE_FLAGS = MappingProxyType({
    "decode_capacity": ("config", "decode_token_capacity"), "step_tokens": ("serving", "step_tokens"),
    "decode_steps": ("serving", "decode_steps"), "max_running": ("serving", "max_running"),
    "kv_tokens": ("serving", "kv_tokens"), "attention": ("serving", "attention")})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny Qwen3-MoE, 8 requests, 2 ranks")
    p.add_argument("--model", metavar="DIR", help="a Hugging Face model folder (default: --random-model)")
    p.add_argument("--random-model", action="store_true", help="random Qwen3-30B-A3B-shaped weights (default)")
    add_workload_arguments(p)
    p.set_defaults(workload=None)  # (--workload or --workloads; mixed when neither)
    p.add_argument("--workloads", nargs="+", type=Workload, choices=list(Workload), metavar="WORKLOAD",
                   help="several workloads in one worker process per system (one start, every warm-up, then "
                        "each timed pass; a JSON per workload in <out>/<workload>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=None, help="ray-moe ranks (default: every GPU, 2 on CPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--max-running", type=int, default=None, help="ray-moe max_running (default: its own: 1024 on CUDA, 256 on CPU)")
    p.add_argument("--step-tokens", type=int, default=None,
                   help="ray-moe prefill tokens per step (default: its own; also transformers' max_batch_tokens)")
    p.add_argument("--decode-steps", type=int, default=None, help="ray-moe multi-step decode (default: its own)")
    p.add_argument("--decode-capacity", type=int, default=None,
                   help="ray-moe decode_token_capacity (default: its own, the running sequences per rank)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="ray-moe KV tokens per rank (default: its own, sized from memory; 8192 on CPU)")
    p.add_argument("--attention", choices=["auto", "varlen", "masked"], default=None,
                   help="ray-moe attention backend (default: its own, auto)")
    p.add_argument("--systems", nargs="+", type=System, choices=list(System), default=list(System),
                   metavar="SYSTEM", help="of " + ", ".join(s.value for s in System) + " (default: all)")
    p.add_argument("--vllm-tp", type=int, default=None, help="vLLM tensor_parallel_size (default: --ranks)")
    p.add_argument("--vllm-args", type=json.loads, default={}, help="extra LLM(...) keyword arguments, JSON")
    p.add_argument("--vllm-profile", metavar="DIR", default=None,
                   help="vLLM offline: its torch profiler over the first timed pass, traces into DIR (that pass's "
                        "figures are not benchmark figures; python -m ray_moe_bench.kernel_mix reads the traces)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--second-pass", action="store_true",
                   help="run every timed pass twice; the second is reported as second_pass beside the first")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="ray-moe without prefix caching (the warm-up's prompts share no block with the timed "
                        "ones either way)")
    p.add_argument("--in-process", action="store_true",
                   help="run every system in this process (tests; start times and memory are then shared)")
    p.add_argument("--keep-model", metavar="DIR", help="write the random model here and keep it")
    p.add_argument("--config-only", action="store_true",
                   help="random model: write no weights (ray-moe builds them in its shards, transformers on "
                        "the device with its own init, vLLM takes load_format=dummy)")
    serving_fp8.add_arguments(p)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker process")
    p.add_argument("--online", action="store_true", help="HTTP against a running ray-moe serve (--url)")
    p.add_argument("--online-inprocess", action="store_true",
                   help="each system in its worker: the timed requests arrive at Poisson times at --rate")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--rate", type=float, default=math.inf, help="online request rate, req/s (inf: all at once)")
    p.add_argument("--vocab-size", type=int, help="online without --model: token ids are drawn below this")
    p.add_argument("--api-key", default=None)
    p.add_argument("--worker", type=Role, choices=list(Role), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    add_output_argument(p)
    return p


def ray_moe_flags(a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ray-moe settings the flags change, and only those: (``RuntimeConfig`` keyword arguments,
    ``rt.serving`` keyword arguments); every other setting is left to the product's default."""
    given = {flag: getattr(a, flag) for flag in RAY_MOE_FLAGS if getattr(a, flag) is not None}
    cfg = {RAY_MOE_FLAGS[f][1]: v for f, v in given.items() if RAY_MOE_FLAGS[f][0] == "config"}
    srv = {RAY_MOE_FLAGS[f][1]: v for f, v in given.items() if RAY_MOE_FLAGS[f][0] == "serving"}
    if not a.prefix_caching:
        srv["prefix_caching"] = False
    return cfg, srv


def _plain(v: Any) -> Any:
    """A flag's value for the JSON (an enum member: its value)."""
    return [_plain(x) for x in v] if isinstance(v, list) else getattr(v, "value", v)


def _check_flags(a: argparse.Namespace, p: argparse.ArgumentParser) -> list[Workload]:
    """Every flag checked before anything runs (``p.error`` names the flag); the workloads in run order."""
    if a.model and a.random_model:
        p.error("--model and --random-model: give one")
    if a.layers is not None and a.layers < 1:
        p.error(f"--layers={a.layers}: must be >= 1")
    if a.workload is not None and a.workloads:
        p.error("--workload and --workloads: give one")
    kinds = list(a.workloads or [a.workload or Workload.MIXED])
    if len(set(kinds)) < len(kinds):
        p.error(f"--workloads {' '.join(k.value for k in kinds)}: a workload is named twice")
    for flag in ("ranks", "max_running", "step_tokens", "decode_steps", "decode_capacity", "kv_tokens", "vllm_tp"):
        v = getattr(a, flag)
        if v is not None and v < 1:
            p.error(f"--{flag.replace('_', '-')}={v}: must be >= 1")
    if a.decode_steps is not None and a.decode_steps > 64:
        p.error(f"--decode-steps={a.decode_steps}: must be in [1, 64]")
    if not isinstance(a.vllm_args, dict):
        p.error(f"--vllm-args={a.vllm_args!r}: must be a JSON object of LLM(...) keyword arguments")
    if not a.timeout > 0:
        p.error(f"--timeout={a.timeout}: must be > 0")
    if not a.rate > 0:
        p.error(f"--rate={a.rate}: must be > 0 (inf: all at once)")
    if a.online and a.online_inprocess:
        p.error("--online and --online-inprocess: give one (HTTP to a running server, or each system in-process)")
    if a.online and (len(kinds) > 1 or a.second_pass):
        p.error("--online (HTTP): one --workload, no --second-pass")
    serving_fp8.check_flags(a, p)
    return kinds


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.worker is not None:
        return worker_main(a.worker, a.spec)
    kinds = _check_flags(a, p)
    flags = {k: v for k, v in vars(a).items() if k not in ("out", "worker", "spec") and v != p.get_default(k)}
    if a.quick:
        a.requests = 8 if a.requests is None else a.requests
        a.new_tokens = 4 if a.new_tokens is None else a.new_tokens
        a.prompt_mean = 24 if a.prompt_mean is None else a.prompt_mean
    try:
        works = [workload_spec(k, a.requests, a.new_tokens, a.prompt_mean, a.seed) for k in kinds]
    except ValueError as exc:
        p.error(str(exc))
    if a.online:
        return main_online(a, p, works[0])
    import torch

    device = a.device or ("cpu" if a.quick or not torch.cuda.is_available() else "cuda")
    dtype = a.dtype or ("bfloat16" if device == "cuda" else "float32")
    ranks = a.ranks or (max(1, torch.cuda.device_count()) if device == "cuda" else 2)
    mode = Mode.ONLINE if a.online_inprocess else Mode.OFFLINE
    # the model's vocabulary and context, before anything runs
    if a.model:
        try:
            with open(os.path.join(a.model, "config.json")) as fh:
                cfg_json = json.load(fh)
        except OSError as exc:
            p.error(f"--model {a.model}: no readable config.json ({exc})")
        text = cfg_json.get("text_config", {})
        conf = fit = None
        vocab = int(cfg_json.get("vocab_size") or text["vocab_size"])
        max_ctx = int(cfg_json.get("max_position_embeddings") or text.get("max_position_embeddings") or 1 << 20)
    else:
        conf, fit = serving_fp8.random_config(a, device)
        vocab, max_ctx = conf["vocab_size"], conf["max_position_embeddings"]
    try:
        timed, shifts = timed_requests(works, vocab)
    except ValueError as exc:
        p.error(str(exc))
    for w, r in zip(works, timed):
        longest = max(len(q) + n for q, n in zip(r.prompts, r.new_tokens))
        if longest > max_ctx:
            p.error(f"--workload {w.kind.value}: a request of {longest} tokens (prompt + new) exceeds the model's "
                    f"context, {max_ctx} (--prompt-mean / --new-tokens)")
    if a.no_warmup:
        warm: list[Requests] = []
        warm_info: dict[str, Any] = {"requests": 0, "skipped": "--no-warmup"}
    else:
        warm, warm_info = warmup_requests(works, timed, vocab, max_ctx)
    names = [w.kind.value for w in works]
    cfg_kw, serving_kw = ray_moe_flags(a)
    spec = {"device": device, "dtype": dtype, "ranks": ranks, "mode": mode.value, "rate": a.rate, "seed": a.seed,
            "warmup": not a.no_warmup, "warm": [r.as_spec(n) for n, r in zip(names, warm)],
            "passes": [r.as_spec(n) for n, r in zip(names, timed)], "second_pass": a.second_pass,
            "timeout_s": a.timeout, "step_tokens": a.step_tokens,
            "ray_moe_config": cfg_kw, "ray_moe_serving": serving_kw,
            "vllm_tp": a.vllm_tp or ranks, "vllm_profile": a.vllm_profile,
            "vllm_args": {**({"load_format": "dummy"} if a.config_only and not (a.model or a.quantization) else {}),
                          **a.vllm_args}}
    head: dict[str, Any] = {"mode": mode.value, "quick": a.quick, "in_process": a.in_process, "device": device,
                            "dtype": dtype, "versions": _versions(),
                            "run": {"flags_changed": {k: _plain(v) for k, v in flags.items()},
                                    "workloads": names, "second_pass": a.second_pass, "warmup": not a.no_warmup,
                                    "systems": [s.value for s in a.systems],
                                    **({"rate_per_s": a.rate, "arrivals": "poisson_arrivals(requests, rate, --seed)"}
                                       if mode is Mode.ONLINE else {})},
                            "warmup": warm_info}
    workdir = tempfile.mkdtemp(prefix="ray-moe-serving-")
    results: dict[str, dict[str, Any]] = {}
    try:
        if a.model:
            folder = a.model
            head["model"] = {"folder": folder, "random": False}
        elif a.quantization:  # the FP8 checkpoint both systems load (written once, then reused)
            head["quantization"] = a.quantization
            head["model"] = serving_fp8.prepare(a, conf, fit, device, workdir, a.timeout, a.in_process)
            folder = head["model"]["folder"]
        else:
            folder = a.keep_model or os.path.join(workdir, "model")
            built = run_worker(Role.PREPARE, {"model": conf, "folder": folder, "device": device, "dtype": dtype,
                                              "seed": a.seed, "weights": not a.config_only}, workdir, a.timeout,
                               in_process=a.in_process)
            if built.get("status") == "error":
                raise RuntimeError(f"writing the random model failed: {built}")
            head["model"] = {"folder": folder if a.keep_model else None, "random": True, "config": conf, **built}
        spec.update(folder=folder, random_model=conf if a.config_only and not (a.model or a.quantization) else None)
        for system in a.systems:
            if system is System.VLLM and importlib.util.find_spec("vllm") is None:
                results[system.value] = {"status": "skipped", "reason": "vllm is not installed (import vllm fails)"}
                continue
            if (why := serving_fp8.skipped(system.value, a)) is not None:
                results[system.value] = why
                continue
            print(f"{system.value}: running {', '.join(names)} ({mode.value}) ...", flush=True)
            results[system.value] = run_worker(Role(system.value), spec, workdir, a.timeout, in_process=a.in_process)
            if a.quantization and system is System.RAY_MOE and "memory_after_start" in results[system.value]:
                results[system.value]["fp8_memory"] = serving_fp8.memory_check(results[system.value],
                                                                                head["model"]["checkpoint"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    failed = False
    for w, r, moved in zip(works, timed, shifts):
        name = w.kind.value
        body = {**head, "workload": {**asdict(w), "kind": name, **r.summary(), "first_token_shifts": moved}}
        systems = {s: system_entry(res, name, names) for s, res in results.items()}
        for s, e in systems.items():
            if e.get("status") == "ok" and e["expected_output_tokens"] != body["workload"]["expected_output_tokens"]:
                e["status"], e["error"] = "error", (f"expected_output_tokens {e['expected_output_tokens']} is not the "
                                                    f"workload's {body['workload']['expected_output_tokens']}")
            if e.get("status") == "ok":
                lat = (e.get("latency") or {}).get("ttft") or {}
                print(f"{name} {s}: {e['output_tokens_per_s']:.1f} output tok/s, wall {e['wall_s']:.2f} s, start "
                      f"{e['start_s']:.1f} s" + (f", TTFT p50 {lat['p50_ms']:.1f} ms" if lat else ""), flush=True)
            else:
                failed |= e.get("status") == "error"
                print(f"{name} {s}: {e.get('status')}: {e.get('reason') or e.get('error')}", flush=True)
        body["systems"] = systems
        body["ratios"] = ratios(systems)
        digests = {k: v["outputs_digest"] for k, v in systems.items() if v.get("status") == "ok"}
        body["same_tokens"] = {"systems": sorted(digests), "identical": len(set(digests.values())) <= 1,
                               "note": "greedy on the same weights: equal in float32, bf16 kernels may differ"}
        print(f"{name} ratios:", {k: round(v, 3) for k, v in body["ratios"].items() if isinstance(v, float)},
              flush=True)
        online = "online-" if mode is Mode.ONLINE else ""
        suffix = f"{online}{name}-cpu-quick" if a.quick else None
        out = os.path.join(results_dir(a.out), name + ("-online" if online else "")) if a.workloads else a.out
        path = write_result("serving", body, suffix=suffix, out=out)
        print(f"wrote {path}")
    return 1 if failed else 0


def main_online(a: argparse.Namespace, p: argparse.ArgumentParser, work: WorkloadSpec) -> int:
    if a.model:
        with open(os.path.join(a.model, "config.json")) as fh:
            vocab = int(json.load(fh)["vocab_size"])
    elif a.vocab_size:
        vocab = a.vocab_size
    else:
        p.error("--online needs --model DIR (its vocab_size) or --vocab-size N for the token-id prompts")
    prompts = work.prompts(vocab)
    news = work.new_tokens_list()
    res = asyncio.run(run_online(a.url, prompts, news, a.rate, a.seed, api_key=a.api_key, timeout_s=a.timeout))
    body = {"mode": "online", "workload": {**asdict(work), "kind": work.kind.value,
                                           **Requests(prompts, news).summary()},
            "versions": _versions(), "systems": {"ray_moe_serve": res}}
    print(f"online: {res['output_tokens_per_s']:.1f} output tok/s, status {res['status']}", flush=True)
    path = write_result("serving", body, suffix=f"online-{work.kind.value}", out=a.out)
    print(f"wrote {path}")
    return 0 if res["status"] == "ok" else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
