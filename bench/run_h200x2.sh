#!/usr/bin/env bash
# The GPU evidence run on a 2 x H200 machine (the device tool's nvidia-h200-x2), in priority order, each
# step time-boxed. Results (JSON) go to $RAY_MOE_RESULTS_DIR, here by default the repository's recorded
# bench/results/ (benchmarks write there only when told so), the log to $LOG.
set -u
export RAY_MOE_RESULTS_DIR=${RAY_MOE_RESULTS_DIR:-bench/results}
LOG=${LOG:-/dev/stdout}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
run() { local t=$1; shift; echo "=== $* (timeout ${t}s) $(date +%T)" >>"$LOG"; timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? $(date +%T)" >>"$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
nvidia-smi topo -m >>"$LOG" 2>&1
run 130 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_gpu_runtime.py -k TestTwoGpusBf16
run 125 python3 -m ray_moe_bench.layer_step --gpus 2 --models mixtral:1 --prefill-tokens 4096 --decode-tokens 1,8,32 \
        --decode-steps 40 --prefill-steps 5 --paths graph,eager,variable --no-baseline --budget-s 100
run 100 python3 -m ray_moe_bench.migration --layers 1 --steady-s 3 --post-s 2 --raw-reps 3
run 70 python3 -m ray_moe_bench.overlap --world 2 --iters 10 --warmup 3
run 70 python3 -m ray_moe_bench.dispatch_combine --world 2 --tokens 128,1024,4096,8192 --iters 10 --stage-iters 5
run 60 python3 -m ray_moe_bench.runners
# session 2 (direct path, FP8 on NCCL, interleaved runners, stage marks); every command below wrote the
# JSON now in bench/results/ (logs: bench/results/logs/h200x2-s2-*.log)
run 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests
run 120 python3 -m ray_moe_bench.dispatch_combine --world 2 --tokens 512,1024,2048,4096,8192 --iters 15 --warmup 3 \
        --no-stages --no-proposed --direct-chunks 1,2
run 120 python3 -m ray_moe_bench.direct_profile --world 2 --tokens 128,4096,8192 --chunks 1
run 150 python3 -m ray_moe_bench.fp8_dispatch --world 2 --tokens 128,1024,4096 --iters 20
run 120 python3 -m ray_moe_bench.runners
run 240 python3 -m ray_moe_bench.layer_step --gpus 2 --models deepseek:1 mixtral:1,4 --prefill-tokens 4096,8192 \
        --decode-tokens 1,32 --decode-steps 30 --prefill-steps 6 --paths graph,variable --no-baseline --budget-s 200
for p in engine direct; do
  run 150 python3 -m ray_moe_bench.layer_step --gpus 2 --models deepseek:1 --prefill-tokens 4096,8192 --decode-tokens 1,32 \
          --decode-steps 30 --prefill-steps 6 --paths variable --no-baseline --budget-s 100 --dispatch-path $p
done
