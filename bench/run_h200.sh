#!/usr/bin/env bash
# The one-GPU evidence run (the device tool's nvidia-h200), sessions 3-4: GPU tests on one H200, the per-layer
# MoE benchmark against transformers' block, and generation against transformers' generate. Each step is
# time-boxed; JSON goes to $RAY_MOE_RESULTS_DIR, logs to $LOG. Usage: bash bench/run_h200.sh tests|tests-model|tests-rest|skinny|layer|generate|serving-ray|serving-vllm|serving-tf|profile|rebalance
set -u
export RAY_MOE_RESULTS_DIR=${RAY_MOE_RESULTS_DIR:-bench/results}
LOG=${LOG:-/dev/stdout}
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
run() { local t=$1; shift; echo "=== $* (timeout ${t}s) $(date +%T)" >>"$LOG"; timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? $(date +%T)" >>"$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
for what in "$@"; do
  case $what in
    tests)    run 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests -W ignore ;;
    # the whole suite outgrew one 280 s box (session 16: ~140 of ~160 tests in 270 s): two boxes, by directory
    tests-model) run 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model tests/dev -W ignore ;;
    tests-rest)  run 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe tests/runtime tests/shard tests/driver -W ignore ;;
    skinny)   run 120 python3 -m ray_moe_bench.skinny ;;
    layer)    run 250 python3 -m ray_moe_bench.moe_layer --layers 4 --iters 30 ;;
    generate) run 330 python3 -m ray_moe_bench.generate --layers 8 --prefill 4096 --batches 1 32 128 --new-tokens 17 --reps 3 ;;
    # the serving comparison (session 14): the whole 48-layer Qwen3-30B-A3B shape, each system in its own process,
    # one after the other in one lease; vLLM needs ../shared/tools/device-vllm's install (PYTHONPATH as it prints)
    serving-vllm|serving-ray|serving-tf)
      sys=${what#serving-}; sys=${sys/ray/ray_moe}; sys=${sys/tf/transformers}
      extra=(); [ "$sys" = transformers ] && extra=(--no-warmup)  # its warm pass costs as much as the timed one
      [ "$sys" = vllm ] && extra=(--vllm-args '{"attention_backend": "FLASH_ATTN"}')  # (no FlashInfer there)
      for w in mixed decode-heavy; do
        run 330 python3 -m ray_moe_bench.serving --config-only --layers 48 --workload "$w" --systems "$sys" \
          "${extra[@]}" --out "$RAY_MOE_RESULTS_DIR/$sys/$w"  # (one file name per run: a folder per workload)
      done ;;
    profile)  run 200 python3 -m ray_moe_bench.step_profile --layers 48 --windows 3:4,20:21 ;;
    rebalance) run 200 python3 -m ray_moe_bench.rebalance_memory --layers 48 --stall-dump 150 ;;
  esac
done
