# ======================================================================================================
#  SERVING BENCHMARK, FP8 (the random block-FP8 checkpoint both systems load)
#
#   --quantization fp8 --config-only [--shape S] [--layers N]
#     -> config of the shape (DeepSeek-V3: N = the layers one GPU holds, ``layers_that_fit``)
#     -> ensure_checkpoint(config, --fp8-dir, seed 0) in its own process (its CUDA memory freed before any
#        system starts), or reused (its marker)
#     -> ray-moe: RuntimeConfig.from_pretrained(folder) (the --model path); vLLM: LLM(model=folder) (no dummy
#        weights); transformers: skipped
#     -> JSON: quantization, the checkpoint (path, bytes, seconds), ray-moe's memory after start over it
# ======================================================================================================
"""The serving benchmark's FP8 mode (``serving.py --quantization fp8``): its flags, the model config, the
checkpoint both systems load, and ray-moe's memory after start against the checkpoint's bytes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from ray_moe_bench.fp8_checkpoint import FP8_ROOT, Shape, default_folder, ensure_checkpoint, shape_config

WEIGHTS_SEED = 0  # the checkpoint's seed (the bf16 --config-only models are drawn with seed 0 too)
MEMORY_TARGET = 1.05  # issue 41: ray-moe's memory after start <= the checkpoint's weights + scales + 5%


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--quantization``, ``--fp8-dir``, ``--shape``; ``--layers`` defaults to None (the shape's own count)."""
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="with --config-only: write (or reuse) a random block-FP8 checkpoint of the shape "
                        "(--fp8-dir) and have ray-moe and vLLM both load it")
    p.add_argument("--fp8-dir", metavar="DIR", default=None,
                   help=f"the FP8 checkpoint's folder (default {FP8_ROOT}/<shape>; reused when it holds this "
                        f"config's checkpoint)")
    p.add_argument("--shape", type=Shape, choices=list(Shape), default=Shape.QWEN3_30B_A3B,
                   metavar="{" + ",".join(s.value for s in Shape) + "}", help="the random model's shape (deepseek-v3: --quantization fp8 only; its --layers default: "
                        "as many as one GPU holds in FP8, leaving 25%% for KV cache and activations)")
    p.set_defaults(layers=None)


def check_flags(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """The FP8 flags' combinations (``p.error`` names the flag)."""
    if a.quantization and (a.model or not a.config_only):
        p.error("--quantization fp8 writes a random FP8 checkpoint of the shape: give --config-only (and no --model; "
                "a real FP8 model folder is served as it is with --model DIR)")
    if a.fp8_dir and not a.quantization:
        p.error("--fp8-dir: with --quantization fp8 only")
    if a.shape is not Shape.QWEN3_30B_A3B and not a.quantization:
        p.error(f"--shape {a.shape.value}: with --quantization fp8 only")


def fp8_dir(a: argparse.Namespace) -> str:
    """The checkpoint's folder: ``--fp8-dir``, else one per shape under /tmp (a new layer count replaces it)."""
    return os.path.abspath(a.fp8_dir or default_folder(a.shape, a.quick))


def random_config(a: argparse.Namespace, device: str) -> tuple[dict, dict | None]:
    """(the random model's config dict, the layer fit when the shape's default count was computed):
    ``shape_config`` of ``--shape`` (``--quick``: its tiny config, 2 layers; ``--layers``; else Qwen3's 48 or the
    DeepSeek-V3 layers one GPU and the disk hold, printed)."""
    conf, fit = shape_config(a.shape, folder=fp8_dir(a), seed=WEIGHTS_SEED, device_type=device, layers=a.layers,
                             quick=a.quick, log=lambda line: print(line, flush=True))
    return conf, fit.as_dict() if fit is not None else None


def prepare(a: argparse.Namespace, conf: dict, fit: dict | None, device: str, workdir: str, timeout_s: float,
            in_process: bool) -> dict[str, Any]:
    """Write or reuse the checkpoint (``ensure_checkpoint``) in its own process (``in_process``: here); the JSON's
    ``model`` entry: the folder, the config, the layer fit, and the checkpoint's report (reused or not, seconds,
    tensor bytes: codes, scales, other)."""
    folder = fp8_dir(a)
    if in_process:
        report = ensure_checkpoint(conf, folder, seed=WEIGHTS_SEED, device=device).as_dict()
    else:
        spec, out = os.path.join(workdir, "fp8-config.json"), os.path.join(workdir, "fp8-report.json")
        with open(spec, "w") as fh:
            json.dump(conf, fh)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(__file__)),
                                                          env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "ray_moe_bench.fp8_checkpoint", "--config-json", spec, "--dir", folder,
               "--seed", str(WEIGHTS_SEED), "--device", device, "--report", out]
        try:
            rc = subprocess.run(cmd, env=env, timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"writing the FP8 checkpoint ran past {timeout_s} s (--timeout): {cmd}") from None
        if rc != 0 or not os.path.exists(out):
            raise RuntimeError(f"writing the FP8 checkpoint failed (exit code {rc}; its output is above): {cmd}")
        with open(out) as fh:
            report = json.load(fh)["checkpoint"]
    return {"folder": folder, "random": True, "config": conf, "quantization": "fp8", "layers_fit": fit,
            "checkpoint": report}


def skipped(system: str, a: argparse.Namespace) -> dict[str, Any] | None:
    """A system the FP8 comparison does not run, and why (None: it runs)."""
    if a.quantization and system == "transformers":
        return {"status": "skipped", "reason": "--quantization fp8: ray-moe against vLLM on the FP8 checkpoint; "
                                               "transformers' FP8 load is not part of this comparison"}
    return None


def memory_check(res: dict[str, Any], checkpoint: dict[str, Any]) -> dict[str, Any]:
    """ray-moe's memory right after start (``memory_after_start``, summed over its ranks) against the checkpoint's
    tensor bytes (FP8 codes + scales + the bf16 / float32 rest): allocated device bytes beside the KV cache (CUDA:
    weights, graph buffers, workspaces; the KV cache takes what is left of the GPU's memory fraction, as vLLM's) and
    the bytes of the tensors it holds (expert slots + other modules), each over the checkpoint; ``within_target``:
    allocated beside the KV cache (else held) <= 1.05 x the checkpoint (issue 41), judged on one rank only (None
    for several: each rank holds every non-expert module, and the default slots add expert replicas)."""
    ranks = res.get("memory_after_start") or {}
    total = int(checkpoint["bytes"]["total"])

    def summed(key: str) -> int | None:
        vals = [m.get(key) for m in ranks.values()]
        return sum(vals) if vals and all(v is not None for v in vals) else None

    allocated, kv = summed("allocated_bytes"), summed("kv_bytes") or 0
    beside_kv = allocated - kv if allocated is not None else None
    held = (summed("expert_bytes") or 0) + (summed("module_bytes") or 0)
    measure = beside_kv if beside_kv is not None else held
    return {"checkpoint_bytes": checkpoint["bytes"], "ranks": len(ranks), "allocated_bytes": allocated,
            "kv_bytes": kv, "allocated_beside_kv_bytes": beside_kv,
            "allocated_beside_kv_over_checkpoint": beside_kv / total if beside_kv is not None else None,
            "expert_bytes": summed("expert_bytes"), "module_bytes": summed("module_bytes"), "held_bytes": held,
            "held_over_checkpoint": held / total, "target_over_checkpoint": MEMORY_TARGET,
            "within_target": bool(measure <= MEMORY_TARGET * total) if len(ranks) == 1 else None,
            "measured_by": "allocated_beside_kv_bytes" if beside_kv is not None else "held_bytes",
            "note": "after Runtime.start + rt.serving (the KV cache allocated, CUDA graphs captured); ray-moe holds "
                    "the routed experts as FP8 codes + scales, the dense projections too where the FP8 dense "
                    "kernel serves them (Fp8Linear), the rest (embeddings, LM head, norms, routers) as the "
                    "checkpoint stores them; with several ranks each holds every non-expert module and the "
                    "default slots add expert replicas (within_target: one rank only)"}
