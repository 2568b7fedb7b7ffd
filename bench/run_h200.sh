#!/usr/bin/env bash
# The one-GPU evidence run (the device tool's nvidia-h200), sessions 3-4: GPU tests on one H200, the per-layer
# MoE benchmark against transformers' block, and generation against transformers' generate. Each step is
# time-boxed; JSON goes to $RAY_MOE_RESULTS_DIR, logs to $LOG. Usage: bash bench/run_h200.sh tests|skinny|layer|generate
set -u
export RAY_MOE_RESULTS_DIR=${RAY_MOE_RESULTS_DIR:-bench/results}
LOG=${LOG:-/dev/stdout}
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
run() { local t=$1; shift; echo "=== $* (timeout ${t}s) $(date +%T)" >>"$LOG"; timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? $(date +%T)" >>"$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
for what in "$@"; do
  case $what in
    tests)    run 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests -W ignore ;;
    skinny)   run 120 python3 -m ray_moe_bench.skinny ;;
    layer)    run 250 python3 -m ray_moe_bench.moe_layer --layers 4 --iters 30 ;;
    generate) run 330 python3 -m ray_moe_bench.generate --layers 8 --prefill 4096 --batches 1 32 128 --new-tokens 17 --reps 3 ;;
  esac
done
