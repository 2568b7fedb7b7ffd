"""``ray-moe serve``'s options, spelled as ``vllm serve`` spells them where ray-moe has the same knob.

    ray-moe serve MODEL [--served-model-name NAME] [--max-model-len N] [--gpu-memory-utilization F]
                        [--max-num-seqs N] [--max-num-batched-tokens N] [--data-parallel-size N]
                        [--enable-expert-parallel] [--api-key KEY] [--host H] [--port P] [--dtype auto|...]

``MODEL`` is positional (``--checkpoint`` and ``--model`` name it too). ray-moe's own spellings stay as
aliases of the vLLM ones (``--model-name``, ``--max-running``, ``--step-tokens``, ``--ranks``). ray-moe runs
data-parallel attention with expert parallelism over its ranks: ``--data-parallel-size N`` is N ranks (one
shard actor each), ``--enable-expert-parallel`` is accepted (it always is expert-parallel), and
``--tensor-parallel-size`` above 1 is refused, saying so. No option is ever matched by a prefix
(``allow_abbrev=False``: ``--model`` is not ``--model-name``).
"""

from __future__ import annotations

import argparse
import re

DEFAULT_RANKS = 2
DEFAULT_START_TIMEOUT_S = 300.0
# vLLM's spelling -> what it sets in ray-moe (the README's table; tests/apps/test_cli_vllm_flags.py parses each)
VLLM_FLAGS = {
    "MODEL": "the Hugging Face folder (config.json + safetensors); also --checkpoint / --model",
    "--served-model-name": "the model id clients send (--model-name)",
    "--max-model-len": "prompt + max_tokens beyond it refused (400 naming the field)",
    "--gpu-memory-utilization": "the share of each GPU a shard takes: weights, KV cache, step workspace",
    "--max-num-seqs": "sequences running at once over every rank (--max-running)",
    "--max-num-batched-tokens": "prefill tokens per rank per step (--step-tokens)",
    "--data-parallel-size": "ranks: one shard actor (one GPU) each, attention data-parallel, experts spread (--ranks)",
    "--enable-expert-parallel": "accepted: ray-moe is always expert-parallel across its ranks",
    "--tensor-parallel-size": "1 only (above 1 is refused: use --data-parallel-size)",
    "--api-key": "required bearer key (also --api-key-file, RAY_MOE_API_KEY)",
    "--host": "listen address (default 127.0.0.1)",
    "--port": "listen port (default 8000); an address something listens on is refused",
    "--dtype": "auto (bfloat16 on cuda, float32 on cpu), bfloat16, float16 / half, float32 / float",
}


def human_int(text: str) -> int:
    """An integer, with vLLM's suffixes: ``32k`` = 32,000, ``32K`` = 32,768 (k/m/g decimal, K/M/G binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (e.g. 4096, 32k, 32K)")
    scale = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]
    value = float(m.group(1)) * scale
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds > 0")
    return value


def add_serve_arguments(sv: argparse.ArgumentParser, bounded_int, eplb_flag) -> None:
    from ray_moe.model.config import AutopilotPolicy, EplbMode

    sv.add_argument("model_path", nargs="?", metavar="MODEL", default=None,
                    help="Hugging Face model folder (config.json + safetensors), as vllm serve MODEL")
    sv.add_argument("--checkpoint", "--model", dest="checkpoint", default=None, metavar="MODEL",
                    help="the model folder (the positional MODEL's other spellings)")
    sv.add_argument("--data-parallel-size", "-dp", "--ranks", dest="ranks", type=bounded_int(1), default=None,
                    metavar="N", help=f"ranks: one shard actor (a GPU on cuda) each, attention data-parallel, the "
                                      f"experts spread over them (expert-parallel); default {DEFAULT_RANKS}")
    sv.add_argument("--enable-expert-parallel", action="store_true",
                    help="accepted for vLLM's command lines: ray-moe is always expert-parallel across its ranks")
    sv.add_argument("--tensor-parallel-size", "-tp", type=bounded_int(1), default=None, metavar="N",
                    help="1 only: ray-moe runs data-parallel attention + expert parallelism, not tensor "
                         "parallelism (use --data-parallel-size)")
    sv.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu (default) or cuda (a GPU per rank; on a machine without one it fails at once)")
    sv.add_argument("--dtype", default=None, choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                    help="default (auto): bfloat16 on cuda, float32 on cpu")
    sv.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000,
                    help="listen port (default 8000); refused when anything already listens on --host:--port")
    sv.add_argument("--api-key-file", default=None, metavar="PATH",
                    help="require 'Authorization: Bearer KEY', KEY read from this file (kept out of the command line "
                         "and job logs); or set RAY_MOE_API_KEY")
    sv.add_argument("--api-key", default=None, help="the key on the command line (visible in process lists and "
                    "`ray job logs`: prefer --api-key-file or RAY_MOE_API_KEY)")
    sv.add_argument("--quantization", "-q", choices=["fp8"], default=None,
                    help="fp8: quantize an unquantized checkpoint's routed experts at load to block-scaled FP8 (128 x "
                         "128 blocks), as vllm serve --quantization fp8; an FP8 checkpoint is served in FP8 without it")
    sv.add_argument("--payload-format", choices=["native", "fp8_row", "fp8_block128"], default=None,
                    help="how routed rows cross ranks (default native: the activation dtype); fp8_block128: e4m3 rows "
                         "with a float32 scale per 128 values (half the bytes; the engine dispatch path), the format "
                         "an FP8 checkpoint's experts quantize their inputs to")
    sv.add_argument("--name", default="serve", help="deployment name (ray-moe status/scale/rebalance --name)")
    sv.add_argument("--served-model-name", "--model-name", dest="model_name", default=None, metavar="NAME",
                    help="the model id clients send (default: the folder name)")
    sv.add_argument("--max-model-len", type=human_int, default=None, metavar="N",
                    help="longest prompt + max_tokens a request may ask for (default: the model's positions); "
                         "longer requests get 400")
    sv.add_argument("--address", default=None,
                    help="Ray: HOST:PORT joins that cluster, 'auto' the one `ray start` runs on this machine, 'local' "
                         "a private instance (default: RAY_ADDRESS, else a private instance, stopped with the server)")
    sv.add_argument("--kv-tokens", type=int, default=None,
                    help="KV cache tokens per rank (default: what --gpu-memory-utilization of each GPU leaves after "
                         "the weights; 8192 on cpu)")
    sv.add_argument("--gpu-memory-utilization", dest="memory_fraction", type=float, default=None,
                    help="the share of each GPU the shard may take, weights + KV cache + step workspace (default 0.9)")
    sv.add_argument("--attention", choices=["auto", "varlen", "masked"], default="auto",
                    help="attention over the paged cache: FlashAttention varlen per sequence (cuda, bf16/fp16), or "
                         "SDPA with a block mask (the reference); auto: varlen where its check passes")
    sv.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    sv.add_argument("--max-num-batched-tokens", "--step-tokens", dest="step_tokens", type=int, default=None,
                    metavar="N", help="prefill tokens per rank per step, beside the decoding sequences' tokens "
                                      "(default: 16384 on CUDA, as vLLM's offline LLM; 2048 on CPU; "
                                      "8192, as vllm serve, stalls decoding sequences less under a prompt backlog)")
    sv.add_argument("--max-num-seqs", "--max-running", dest="max_running", type=int, default=None, metavar="N",
                    help="sequences running at once over every rank (default: 1024 on CUDA, as vllm serve on >= 70 "
                         "GB GPUs; 256 on CPU)")
    sv.add_argument("--decode-steps", type=int, default=None,
                    help="multi-step decode: decode tokens per sequence per step when every sequence is decoding "
                         "and none waits (1: one token per step; default 2 on cuda, 1 on cpu)")
    sv.add_argument("--no-fused-kernels", dest="fused_kernels", action="store_false",
                    help="keep transformers' own RMSNorm and rotary embedding on cuda (default: the fused kernels, "
                         "each taken only where it reproduces transformers' own)")
    sv.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                    help="compute every prompt's KV cache (default: full KV blocks of identical prompt prefixes are "
                         "shared within a rank, and requests go to the rank that holds their prefix)")
    sv.add_argument("--start-timeout", type=positive_seconds, default=DEFAULT_START_TIMEOUT_S, metavar="SECONDS",
                    help="how long the start may wait for resources and for the shard actors to come up (default "
                         f"{DEFAULT_START_TIMEOUT_S:g}: a cluster node may first set up a job's runtime environment "
                         "and start a worker process that imports torch); past it the start is undone, saying so")
    sv.add_argument("--max-queued", type=int, default=1024,
                    help="requests in flight before new ones get 503 (overload)")
    # (the default is built here, not parsed from "auto": parsing imports the autopilot, and with it torch)
    sv.add_argument("--eplb", type=eplb_flag, default=AutopilotPolicy(mode=EplbMode.AUTO),
                    metavar="off|auto|periodic:N",
                    help="automatic rebalance: auto (default) when an EPLB solve predicts a gain worth its copies, "
                         "with hysteresis; periodic:N every N load steps; off only on `ray-moe rebalance`")
    sv.add_argument("--heal-retries", type=bounded_int(0), default=2, metavar="N",
                    help="self-healing ranks: a dead shard is replaced, up to N start attempts per lost rank "
                         "(0: off, the deployment runs one rank short)")
    sv.add_argument("--min-ranks", type=bounded_int(1), default=None, metavar="N",
                    help="load-driven scaling: never fewer ranks (default 1; the replica floors and the ranks "
                         "that hold every expert once are kept too); giving it or --max-ranks turns scaling on")
    sv.add_argument("--max-ranks", type=bounded_int(1), default=None, metavar="N",
                    help="load-driven scaling: never more ranks (default --data-parallel-size); a rank is added "
                         "when the oldest waiting request waits past the target, one removed when idle")


def normalize_serve_args(args: argparse.Namespace, bad_input: type[ValueError]) -> argparse.Namespace:
    """One model folder (MODEL, --checkpoint or --model: the same one), the ranks (default 2), and
    --tensor-parallel-size refused above 1; raises ``bad_input`` naming the flag."""
    given = [v for v in (getattr(args, "model_path", None), getattr(args, "checkpoint", None)) if v is not None]
    if not given:
        raise bad_input("MODEL: the model folder is missing (ray-moe serve MODEL, e.g. ray-moe serve ./tiny-moe)")
    if len(set(given)) > 1:
        raise bad_input(f"MODEL={given[0]!r} and --checkpoint/--model={given[1]!r}: name the model folder once")
    args.checkpoint = given[0]
    if getattr(args, "ranks", None) is None:
        args.ranks = DEFAULT_RANKS
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None and tp > 1:
        raise bad_input(f"--tensor-parallel-size={tp}: ray-moe runs data-parallel attention with expert "
                        f"parallelism over its ranks, not tensor parallelism: pass --data-parallel-size {tp} "
                        f"({tp} ranks, a GPU each)")
    return args


__all__ = ["DEFAULT_RANKS", "VLLM_FLAGS", "add_serve_arguments", "human_int", "normalize_serve_args"]
