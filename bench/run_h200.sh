#!/usr/bin/env bash
# The one-GPU evidence run (the device tool's nvidia-h200), sessions 3-4: GPU tests on one H200, the per-layer
# MoE benchmark against transformers' block, and generation against transformers' generate. Each step is
# time-boxed; JSON goes to $RAY_MOE_RESULTS_DIR, logs to $LOG. Usage: bash bench/run_h200.sh tests|tests-model|tests-rest|tests-runtime|skinny|attn|fp8|route-plan|host-profile|fp8-dense|fp8-tune|fp8-ds-tune|layer|generate|serving-ray|serving-vllm|serving-tf|substeps|fp8-write|fp8-ray|fp8-vllm|fp8-ds-write|fp8-ds-ray|fp8-ds-vllm-warm|fp8-ds-vllm|fp8-profile|profile|kernel-mix-ray|kernel-mix-vllm|rebalance|pack
# (serving-ray / serving-vllm: offline and online in one call; serving-{ray,vllm}-{offline,online}: one half each)
set -u
export RAY_MOE_RESULTS_DIR=${RAY_MOE_RESULTS_DIR:-bench/results}
LOG=${LOG:-/dev/stdout}
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
run() { local t=$1; shift; echo "=== $* (timeout ${t}s) $(date +%T)" >>"$LOG"; timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? $(date +%T)" >>"$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
# vLLM on the DeepSeek slice: its defaults (gpu_memory_utilization 0.9) on an 80 GB card ran out of memory capturing
# its graphs (FA3's MLA decode workspace, 3.9 GiB outside its budget; d67ffcc's H100 lease), and at 0.85 its engine
# died serving; 0.8 there (a non-default, listed in the JSON), its defaults on larger cards
vllm_ds_args() {
  local mib; mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  if [ "${mib:-0}" -lt 100000 ]; then echo '{"gpu_memory_utilization": 0.8}'; else echo '{}'; fi
}
for what in "$@"; do
  case $what in
    tests)    run 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests -W ignore ;;
    # the whole suite outgrew one 280 s box (session 16: ~140 of ~160 tests in 270 s): three boxes, by directory
    tests-model) run 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model tests/dev -W ignore ;;
    # tests/runtime apart since dde2069's lease (its generation tests capture the 16,384-token lattice: the
    # box of all four directories ran 260 of its 280 s)
    tests-rest)  run 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe tests/shard tests/driver -W ignore ;;
    tests-runtime) run 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime -W ignore ;;
    skinny)   run 120 python3 -m ray_moe_bench.skinny ;;
    # one layer's attention of a step: a piecewise hole (decode kernel + gathered FlashAttention-2) against the
    # paged varlen kernel of whole-step token graphs (the lattice's WHOLE_ROWS reads it)
    attn)     run 120 python3 -m ray_moe_bench.paged_varlen ;;
    fp8)      run 270 python3 -m ray_moe_bench.fp8_experts ;;
    # the one-rank route plan by route count: one program / blocked / torch, and the old general path's order + gather
    route-plan) run 120 python3 -m ray_moe_bench.route_plan ;;
    # the shard's host work per step kind and phase on the GPU (chat: ~1,000 running sequences, 2 sub-steps; the
    # CPU run of the same workload is bench/results/logs/host_profile-chat-cpu-s36.json)
    host-profile) run 300 python3 -m ray_moe_bench.host_profile --device cuda --layers "${LAYERS:-48}" --workload chat \
                    --requests 1000 --max-running 1024 --decode-steps 2 --new-tokens 160 --prompt-mean 480 \
                    --record "$RAY_MOE_RESULTS_DIR/host_profile-chat-cuda.json" --label "cuda-${LAYERS:-48}l" ;;
    # the dense FP8 GEMM: ray-moe's Triton kernel against torch._scaled_mm blockwise (a library kernel) and bf16
    fp8-dense) run 200 python3 -m ray_moe_bench.fp8_dense ;;
    # the FP8 kernels' launch settings tuned on this GPU (experts and dense projections of the Qwen3-30B-A3B shape),
    # written into the package's table (ray_moe/moe/experts/runners/configs/fp8-<gpu>.json: later steps read it;
    # commit it from the copy beside the result JSON) and the result JSON with every candidate's time
    fp8-tune) run 420 python3 -m ray_moe_bench.fp8_tune ;;
    # the same for the DeepSeek-V3 slice's shapes (256 experts of 7168 x 2048, MLA and shared-expert projections):
    # before fp8-ds-ray on a GPU whose table lacks them (the start warns which shapes run heuristic settings)
    fp8-ds-tune) run 540 python3 -m ray_moe_bench.fp8_tune --shape deepseek-v3 ;;
    layer)    run 250 python3 -m ray_moe_bench.moe_layer --layers 4 --iters 30 ;;
    generate) run 330 python3 -m ray_moe_bench.generate --layers 8 --prefill 4096 --batches 1 32 128 --new-tokens 17 --reps 3 ;;
    # the serving comparison: the whole 48-layer Qwen3-30B-A3B shape (--config-only), each system in its own process
    # with its own defaults; one process per system and mode: one start, every workload's disjoint warm-up, then
    # each workload's timed pass (--workloads). Offline: mixed, decode-heavy, chat, long (mixed first: its prompts
    # are those of sessions 14-17, none shifted); online in-process: chat at $ONLINE_RATE req/s (Poisson arrivals;
    # 1,000 requests: ~125 s of arrivals at 8). Each workload's JSON in its own folder:
    # $RAY_MOE_RESULTS_DIR/<system>/<workload>[-online]/. Starts on the H200: ray-moe ~30-60 s, vLLM ~90-110 s; each
    # half has its own box (the driver's --timeout 30 s under it, so a late worker's finished passes are still
    # written); one call of serving-ray or serving-vllm stays under 600 s. vLLM needs ../shared/tools/device-vllm's
    # install (PYTHONPATH as it prints); --vllm-args FLASH_ATTN: no FlashInfer there
    serving-ray|serving-vllm|serving-ray-offline|serving-ray-online|serving-vllm-offline|serving-vllm-online)
      sys=${what#serving-}; half=${sys#*-}; sys=${sys%%-*}; [ "$half" = "$sys" ] && half=both
      sys=${sys/ray/ray_moe}
      extra=(); [ "$sys" = vllm ] && extra=(--vllm-args '{"attention_backend": "FLASH_ATTN"}')
      common=(--config-only --layers "${LAYERS:-48}" --systems "$sys" "${extra[@]}" --out "$RAY_MOE_RESULTS_DIR/$sys")
      [ "$sys" = vllm ] && box=(300 270 400 370) || box=(320 290 300 270)
      if [ "$half" != online ]; then
        run "${box[0]}" python3 -m ray_moe_bench.serving "${common[@]}" --workloads mixed decode-heavy chat long \
          --timeout "${box[1]}"
      fi
      # online: ~125 s of arrivals at 8/s after the start and the warm-up; vLLM's first start on a fresh machine
      # took 112 s in b994b30's lease, and its pass ran past the 270 s box both systems had then (vLLM's halves are
      # separate calls; ray-moe's two took ~310 s together there)
      if [ "$half" != offline ]; then
        run "${box[2]}" python3 -m ray_moe_bench.serving "${common[@]}" --workloads chat --online-inprocess \
          --rate "${ONLINE_RATE:-8}" --timeout "${box[3]}"
      fi ;;
    # decode sub-steps per call against online TTFT (issue 39; cebd5aa's H100 lease: TTFT p99 81 ms against vLLM's
    # 73): a request arriving mid-call waits for up to two launched calls of 4 sub-steps. What a shorter call costs
    # now that decode steps replay graphs: decode-heavy at 1 / 2 / 4 sub-steps in one process (step profile), then
    # the online chat at 2 (a non-default, listed in its JSON; compare serving-ray-online's 4)
    substeps)
      run 200 python3 -m ray_moe_bench.step_profile --layers "${LAYERS:-48}" --workload decode-heavy \
        --variants 8192:1,8192:2,8192:4 --out "$RAY_MOE_RESULTS_DIR"
      run 270 python3 -m ray_moe_bench.serving --config-only --layers "${LAYERS:-48}" --systems ray_moe \
        --workloads chat --online-inprocess --rate "${ONLINE_RATE:-8}" --decode-steps 2 --timeout 240 \
        --out "$RAY_MOE_RESULTS_DIR/ray_moe-decode2" ;;
    # transformers' continuous batching: the one-length workloads only (generate_batch takes one max_new_tokens
    # per call), its timed passes alone (its warm pass costs as much as the timed one), one model build for both
    serving-tf)
      run 330 python3 -m ray_moe_bench.serving --config-only --layers 48 --systems transformers --no-warmup \
        --workloads mixed decode-heavy --timeout 310 --out "$RAY_MOE_RESULTS_DIR/transformers" ;;
    # FP8 (issue 41 item 7): ray-moe and vLLM on the same random block-FP8 checkpoint (e4m3 codes + float32 scales
    # per 128 x 128 block, the Qwen3-30B-A3B-FP8 / DeepSeek-V3 layout), each in its own process with its own
    # defaults. fp8-ray / fp8-vllm: the whole 48-layer Qwen3-30B-A3B shape (~31 GB of tensors), mixed, decode-heavy
    # and chat. fp8-ds-ray / fp8-ds-vllm: a DeepSeek-V3 slice (MLA, 256 routed + 1 shared experts, grouped top-8,
    # 3 dense layers first) at as many layers as one GPU holds leaving 25% for KV cache and activations, and the
    # disk takes (printed and in the JSON's model.layers_fit: ~11.5 GB per MoE layer, so the 64 GB disk, not the
    # H200's 141 GB, bounds it), mixed and decode-heavy. The checkpoint of a shape is written once under
    # $FP8_ROOT/<shape> (drawn on the GPU in its own process) and reused by every later step (its marker):
    # fp8-write / fp8-ds-write write it in a box of their own (then the timed steps only check it), else the first
    # timed step writes it inside its box. The other shape's checkpoint is removed first (the disk holds one).
    # JSON: $RAY_MOE_RESULTS_DIR/fp8-<shape>/<system>/<workload>/ (the write: .../fp8-<shape>/checkpoint.json).
    # Each step one box under 600 s (the driver's --timeout per worker: the writer, then the system). vLLM as
    # serving-vllm (Qwen: attention_backend FLASH_ATTN; DeepSeek: its own MLA default). vLLM's start of the DeepSeek
    # slice outran the 440 s box on an H100 (50a7d4d: still capturing): fp8-ds-vllm-warm in one device call (vLLM's
    # caches filled on the machine's disk), then fp8-ds-vllm in the next. vLLM's PYTHONPATH must
    # not put ray-moe's wheel site (/tmp/site: another transformers) before its own
    fp8-write|fp8-ray|fp8-vllm|fp8-ds-write|fp8-ds-ray|fp8-ds-vllm)
      sys=${what##*-}; sys=${sys/ray/ray_moe}
      fp8_root=${FP8_ROOT:-/tmp/ray-moe-fp8}
      case $what in
        fp8-ds-*) shape=deepseek-v3; other=qwen3-30b-a3b; works=(mixed decode-heavy) ;;
        *)        shape=qwen3-30b-a3b; other=deepseek-v3; works=(mixed decode-heavy chat) ;;
      esac
      rm -rf "${fp8_root:?}/$other" "$fp8_root/$other.partial"
      if [ "$sys" = write ]; then
        run 590 python3 -m ray_moe_bench.fp8_checkpoint --shape "$shape" --dir "$fp8_root/$shape" \
          --report "$RAY_MOE_RESULTS_DIR/fp8-$shape/checkpoint.json"
      else
        extra=(); [ "$sys" = vllm ] && [ "$shape" = qwen3-30b-a3b ] && extra=(--vllm-args '{"attention_backend": "FLASH_ATTN"}')
        [ "$sys" = vllm ] && [ "$shape" = deepseek-v3 ] && extra=(--vllm-args "$(vllm_ds_args)")
        run 590 python3 -m ray_moe_bench.serving --config-only --quantization fp8 --shape "$shape" \
          --fp8-dir "$fp8_root/$shape" --systems "$sys" "${extra[@]}" --workloads "${works[@]}" --timeout 440 \
          --out "$RAY_MOE_RESULTS_DIR/fp8-$shape/$sys"
      fi ;;
    # vLLM's start of the DeepSeek slice alone (4 requests, no warm-up; its JSON under /tmp, not a figure): fills its
    # torch.compile and Triton caches on the machine's disk so that fp8-ds-vllm, in the next device call, starts
    # within its box (50a7d4d: a cold start was still capturing graphs at 440 s on an H100)
    fp8-ds-vllm-warm)
      run 590 python3 -m ray_moe_bench.serving --config-only --quantization fp8 --shape deepseek-v3 \
        --fp8-dir "${FP8_ROOT:-/tmp/ray-moe-fp8}/deepseek-v3" --systems vllm --vllm-args "$(vllm_ds_args)" \
        --workloads mixed --requests 4 \
        --no-warmup --timeout 560 --out /tmp/vllm-ds-warm ;;
    profile)  run 200 python3 -m ray_moe_bench.step_profile --layers 48 --windows 3:4,20:21 ;;
    # where each system's device time goes on the same requests, by kind of kernel (issue 39: long prompts and
    # mixed run below vLLM with the experts and attention at library speed): ray-moe's step profile over every
    # step of a ${MIX_REQUESTS:-8}-request pass of ${MIX_WORKLOAD:-long}, vLLM's torch profiler over its first
    # timed pass of the same lengths (its own process; those figures are not benchmark figures), then
    # kernel_mix side by side ($RAY_MOE_RESULTS_DIR/kernel_mix-<workload>.json). vLLM's PYTHONPATH as serving-vllm;
    # MIX_RAY_PROFILE names ray-moe's profile where an earlier machine took it (else the newest in the results)
    kernel-mix-ray)
      run 300 python3 -m ray_moe_bench.step_profile --layers "${LAYERS:-48}" --workload "${MIX_WORKLOAD:-long}" \
        --requests "${MIX_REQUESTS:-8}" --windows 0:100000 --out "$RAY_MOE_RESULTS_DIR" ;;
    kernel-mix-vllm)
      rm -rf /tmp/vllm-profile
      run 400 python3 -m ray_moe_bench.serving --config-only --layers "${LAYERS:-48}" --systems vllm \
        --vllm-args '{"attention_backend": "FLASH_ATTN"}' --workloads "${MIX_WORKLOAD:-long}" \
        --requests "${MIX_REQUESTS:-8}" --vllm-profile /tmp/vllm-profile --timeout 370 \
        --out "$RAY_MOE_RESULTS_DIR/vllm-profiled"
      prof=${MIX_RAY_PROFILE:-$(ls -t "$RAY_MOE_RESULTS_DIR"/step_profile-*-"${MIX_WORKLOAD:-long}".json 2>/dev/null | head -1)}
      run 120 python3 -m ray_moe_bench.kernel_mix --vllm-trace /tmp/vllm-profile ${prof:+--ray-moe "$prof"} \
        --out "$RAY_MOE_RESULTS_DIR/kernel_mix-${MIX_WORKLOAD:-long}.json" ;;
    # where an FP8 decode step's time goes: the FP8 checkpoint fp8-write made (the whole 48-layer shape), in process
    # (WORKLOAD=chat WINDOWS=40:42: steps with a few hundred prompt tokens beside the decoding sequences)
    fp8-profile) run 300 python3 -m ray_moe_bench.step_profile --checkpoint "${FP8_ROOT:-/tmp/ray-moe-fp8}/qwen3-30b-a3b" \
                   --workload "${WORKLOAD:-decode-heavy}" --windows "${WINDOWS:-20:21}" --out "$RAY_MOE_RESULTS_DIR" ;;
    rebalance) run 200 python3 -m ray_moe_bench.rebalance_memory --layers 48 --stall-dump 150 ;;
    # the device tool returns files at most two folders below $OUT (8 files): every result so far and the log
    # in one archive there, $OUT/results-<step>.tgz (run it last in each call; PACK_NAME names the step)
    pack)
      if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/results-${PACK_NAME:-$(date +%H%M%S)}.tgz" -C "$(dirname "$RAY_MOE_RESULTS_DIR")" \
          "$(basename "$RAY_MOE_RESULTS_DIR")"
        if [ "$LOG" != /dev/stdout ]; then cp "$LOG" "$OUT/"; fi
      fi ;;
  esac
done
