#!/usr/bin/env bash
# The GPU evidence run on a 2 x H200 machine (the device tool's nvidia-h200-x2), in priority order, each
# step time-boxed. Results (JSON) go to $RAY_MOE_RESULTS_DIR (default bench/results), the log to $LOG.
set -u
LOG=${LOG:-/dev/stdout}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
run() { local t=$1; shift; echo "=== $* (timeout ${t}s) $(date +%T)" >>"$LOG"; timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? $(date +%T)" >>"$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
nvidia-smi topo -m >>"$LOG" 2>&1
run 130 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_gpu_runtime.py -k TestTwoGpusBf16
run 125 python3 -m bench.layer_step --gpus 2 --models mixtral:1 --prefill-tokens 4096 --decode-tokens 1,8,32 \
        --decode-steps 40 --prefill-steps 5 --paths graph,eager,variable --no-baseline --budget-s 100
run 100 python3 -m bench.migration --layers 1 --steady-s 3 --post-s 2 --raw-reps 3
run 70 python3 -m bench.overlap --world 2 --iters 10 --warmup 3
run 70 python3 -m bench.dispatch_combine --world 2 --tokens 128,1024,4096,8192 --iters 10 --stage-iters 5
run 60 python3 -m bench.runners
