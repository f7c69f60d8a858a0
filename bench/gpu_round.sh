#!/usr/bin/env bash
# One test-and-bench round on the GPU machine. From the repository root:
#   bash bench/gpu_round.sh tests     GPU tests + decode-step profile
#   bash bench/gpu_round.sh engine    engine-only throughput: fast vs deterministic mode (and a profile of the
#                                     deterministic step), then with sync scheduling
#   bash bench/gpu_round.sh full      the generation benchmark against transformers (dynamic, static+compile)
#   bash bench/gpu_round.sh spec      speculative decoding: target + online drafters, with/without speculation
#   bash bench/gpu_round.sh tp        tensor parallelism on 2 GPUs (the nvidia-h200-x2 kind): tests + decode bench
#   bash bench/gpu_round.sh weights   weight-sync benchmark on the GPU, with an operator profile of one round
#   bash bench/gpu_round.sh scale     real policy sizes (issue 20): loader tests on CUDA, then bench/scale.py for
#                                     each shape in $SCALE_SHAPES (default qwen3-8b; about 3 min an 8B shape, so
#                                     one or two per call), extra arguments in $SCALE_ARGS (e.g. --with-32b)
#   bash bench/gpu_round.sh first     a session's first call (< 10 min): GPU tests, weight sync (0.5B and 1.5B
#                                     shapes), decode-step profile (batch 256 also with cuBLASLt)
#   bash bench/gpu_round.sh verify-gpu      the tests/test_gpu_*.py files (about 5 min on an H200), and
#   bash bench/gpu_round.sh verify-kernels  every other test that runs on the GPU (kernels, models, prompt
#                                     embeddings, weight updates, loader; about 6 min): one call each, a
#                                     540 s limit, each test's id and outcome in
#                                     $OUT/verify.log (-v), failures and errors listed at the end (-rfE)
#   bash bench/gpu_round.sh measure   the real-size figures: bench/scale.py at 8B and 0.5B, bench/moe.py,
#                                     bench/lora.py --profile, into four JSON-lines files and one log
#   bash bench/gpu_round.sh decode    the batch-1/2 MoE decode path in the whole engine (off vs on), the LoRA
#                                     kernels alone and in the engine, and the 8B weight sync (< 8 min)
#   bash bench/gpu_round.sh lora      the LoRA round (< 10 min): its GPU tests, the kernels alone (the default
#                                     hook and the side-stream delta left to the consumer, 1 and 16 adapters, 0
#                                     and 8 SMs left out of the GEMMs), the engine with 16 adapters loaded and 1 /
#                                     16 in the batch (default hooks and lora_deferred, profiled) and merged mode;
#                                     LORA_BASELINE=FILE adds another kernels/lora.py to the kernels' systems
#                                     (`git show REV:kernels/lora.py > bench/lora_baseline.py` here first)
#   bash bench/gpu_round.sh lora-linear  the one-launch linear + LoRA kernel (kernels/lora_linear.py, < 10 min):
#                                     its CUDA tests (the engine's fused-linear test included), the kernels alone
#                                     with 0 / 1 / 4 / 16 adapters in the batch against cuBLAS + the default hooks
#                                     (the tile by layer shape; the expand's first chunk loaded before the wait, in
#                                     every projection or all but gate_up_proj; the launch-wide count; down_proj in
#                                     five stages; the expand in chunks of 4 slots; SYSTEMS= names others), and the
#                                     engine with `lora_fused_linear` against the base (LORAS=64 adapters loaded,
#                                     DISTINCT=1,4,16 of them in the batch; ENGINE_SYSTEM= names bench/lora_kernels.py
#                                     systems for its configs, one engine each, e.g. linear_by_shape,linear_by_shape_chunk4;
#                                     `best` the linear_by_shape* one fastest at the most adapters; ENGINE_TIMEOUT= / TEST_TIMEOUT= seconds, 240 / 200);
#                                     LINEAR_BASELINE=FILE adds another kernels/lora_linear.py
#                                     (`git show REV:kernels/lora_linear.py > bench/lora_linear_baseline.py` here
#                                     first)
#   bash bench/gpu_round.sh lora-linear-parts  where the fused linear's time goes at DISTINCT=1,16 adapters: copies of
#                                     kernels/lora_linear.py without the epilogue's wait on the step's count
#                                     (nowait), with shrink programs that do no work (noshrink), with none
#                                     (noshrinkprograms), without the expand (noexpand), against the kernel
#   bash bench/gpu_round.sh lora-roles   the two launches (default) against one launch with ticketed roles and with
#                                     block-id roles, the fused linear likewise, at 1 / 4 / 16 distinct adapters,
#                                     each case in its own process under a hard limit (block ids not at 16: hung)
#   bash bench/gpu_round.sh lora-linear-narrow  each projection alone at 0 / 16 adapters (DISTINCT=), the tiles of
#                                     one program an SM (o_proj, down_proj) in deeper pipelines with the shrink's
#                                     programs in 4 / 6 / 8 stages or splits of 1024 (SYSTEMS= names others)
#   bash bench/gpu_round.sh lora-linear-sweep  each projection alone, every tile of the sweep, 0 and 1 adapters
#                                     (SYSTEMS= shell patterns of bench/lora_kernels.py systems, e.g.
#                                     'default,linear_by_shape,linear_bn*_w4'; DISTINCT= e.g. 0)
# Logs and JSON lines go under $OUT (default ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
case "${1:-tests}" in
  tests)
    timeout 360 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_gpu_deterministic.py \
      tests/test_gpu_spec_decode.py tests/test_kernels_*.py tests/test_weight_updates.py \
      tests/test_weight_updates_ipc.py > "$OUT/tests.log" 2>&1; tail -15 "$OUT/tests.log"
    timeout 120 python3 bench/profile_decode.py --batch 1 --batch 64 --batch 256 > "$OUT/profile.jsonl" 2> "$OUT/profile.err"
    cat "$OUT/profile.jsonl"; tail -5 "$OUT/profile.err"
    ;;
  engine)
    timeout 300 python3 bench/generate.py --batches 1,64,256 --no-hf --grpo --deterministic > "$OUT/bench.log" 2>&1
    grep '^{' "$OUT/bench.log"; grep -v '^{' "$OUT/bench.log" | grep -i -A3 "error\|traceback" | tail -20
    timeout 90 python3 bench/profile_decode.py --batch 64 --deterministic > "$OUT/profile_det.jsonl" 2> "$OUT/profile_det.err"
    cat "$OUT/profile_det.jsonl"
    timeout 260 python3 bench/generate.py --batches 1,64,256 --no-hf --grpo --sync-scheduling > "$OUT/bench_sync.log" 2>&1
    grep '^{' "$OUT/bench_sync.log"; grep -v '^{' "$OUT/bench_sync.log" | grep -i -A3 "error\|traceback" | tail -20
    ;;
  full)
    timeout 540 python3 bench/generate.py --batches 1,64,256 --hf-static --grpo > "$OUT/bench.log" 2>&1
    grep '^{' "$OUT/bench.log"; grep -v '^{' "$OUT/bench.log" | grep -i -A3 "error\|traceback" | tail -20
    ;;
  spec)
    timeout 560 python3 bench/spec_decode.py --device cuda ${SPEC_ARGS:-} > "$OUT/spec.log" 2>&1
    grep '^{' "$OUT/spec.log"; grep -v '^{' "$OUT/spec.log" | grep -i -A3 "error\|traceback" | tail -20
    ;;
  first)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_gpu_deterministic.py \
      tests/test_gpu_spec_decode.py tests/test_kernels_*.py tests/test_weight_updates.py \
      tests/test_weight_updates_ipc.py > "$OUT/tests.log" 2>&1; tail -15 "$OUT/tests.log"
    for model in 0.5b 1.5b; do
      timeout 100 python3 bench/weight_sync.py --device cuda --model $model > "$OUT/weight_sync_$model.jsonl" 2> "$OUT/weight_sync_$model.err"
      grep -E '"push"|summary' "$OUT/weight_sync_$model.jsonl"; tail -3 "$OUT/weight_sync_$model.err"
    done
    timeout 120 python3 bench/profile_decode.py --batch 1 --batch 256 > "$OUT/profile.jsonl" 2> "$OUT/profile.err"
    timeout 90 python3 bench/profile_decode.py --batch 256 --blas cublaslt >> "$OUT/profile.jsonl" 2>> "$OUT/profile.err"
    cat "$OUT/profile.jsonl"; tail -5 "$OUT/profile.err"
    ;;
  weights)
    timeout 300 python3 bench/weight_sync.py --device cuda --profile > "$OUT/weight_sync.jsonl" 2> "$OUT/weight_sync.err"
    grep -v '"profile"' "$OUT/weight_sync.jsonl"; grep '"profile"' "$OUT/weight_sync.jsonl" | head -30; tail -3 "$OUT/weight_sync.err"
    ;;
  scale)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_loader.py > "$OUT/loader_tests.log" 2>&1
    tail -3 "$OUT/loader_tests.log"
    for shape in ${SCALE_SHAPES:-qwen3-8b}; do
      timeout 540 python3 bench/scale.py --shapes "$shape" ${SCALE_ARGS:-} > "$OUT/scale_$shape.jsonl" 2> "$OUT/scale_$shape.err"
      cat "$OUT/scale_$shape.jsonl"; grep -i -A3 "error\|traceback" "$OUT/scale_$shape.err" | tail -20
    done
    ;;
  verify-gpu|verify-kernels)
    if [ "$1" = verify-gpu ]; then
      group="tests/test_gpu_*.py"
    else
      group="tests/test_kernels_*.py tests/test_models.py tests/test_prompt_embeds.py tests/test_weight_updates.py \
        tests/test_weight_updates_ipc.py tests/test_loader.py"
    fi
    timeout 540 python3 -m pytest -v -rfE -p no:cacheprovider $group > "$OUT/verify.log" 2>&1
    echo "pytest rc=$? (124: stopped at 540 s; the last line of $OUT/verify.log names the test it was in)"
    grep -E "^(FAILED|ERROR) |passed|failed|error" "$OUT/verify.log" | cut -c 1-300; tail -n 1 "$OUT/verify.log"
    ;;
  measure)
    timeout 200 python3 bench/scale.py --shapes qwen3-8b --repeats 1 --hf-batches "" > "$OUT/scale8b.jsonl" 2>> "$OUT/measure.log"
    timeout 60 python3 bench/scale.py --shapes qwen2.5-0.5b --hf-batches "" --no-grpo --no-load > "$OUT/scale05.jsonl" 2>> "$OUT/measure.log"
    timeout 180 python3 bench/moe.py --device cuda --hf-batches 1 > "$OUT/moe.jsonl" 2>> "$OUT/measure.log"
    timeout 130 python3 bench/lora.py --device cuda --profile > "$OUT/lora.jsonl" 2>> "$OUT/measure.log"
    grep -i -B2 -A3 "error\|traceback" "$OUT/measure.log" | tail -20
    ;;
  decode)
    timeout 130 python3 bench/profile_decode.py --shape qwen3-30b-a3b --batch 1 --batch 2 --moe-decode off \
      --moe-decode on --steps 32 > "$OUT/moe_decode.jsonl" 2>> "$OUT/decode.log"
    timeout 90 python3 bench/lora_kernels.py > "$OUT/lora_kernels.jsonl" 2>> "$OUT/decode.log"
    timeout 140 python3 bench/lora.py --device cuda --profile > "$OUT/lora.jsonl" 2>> "$OUT/decode.log"
    timeout 100 python3 bench/weight_sync.py --device cuda --model 8b > "$OUT/weight_sync_8b.jsonl" 2>> "$OUT/decode.log"
    grep -h -E '"moe_decode"|overhead|summary' "$OUT"/*.jsonl | cut -c 1-400
    grep -i -B2 -A3 "error\|traceback" "$OUT/decode.log" | tail -20
    ;;
  lora)
    timeout 230 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_lora_kernels.py tests/test_gpu_lora_engine.py \
      tests/test_kernels_lora.py > "$OUT/lora_tests.log" 2>&1; grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/lora_tests.log" | tail -8
    timeout 120 python3 bench/lora_kernels.py --systems "default,side_delta_deferred${LORA_BASELINE:+,baseline}" \
      ${LORA_BASELINE:+--baseline "$LORA_BASELINE"} --distinct 1,16 --carveouts 0,8 --streams \
      > "$OUT/lora_kernels.jsonl" 2>> "$OUT/lora.log"
    timeout 220 python3 bench/lora.py --device cuda --merged --deferred --loras 16 --distinct 1,16 --profile \
      > "$OUT/lora.jsonl" 2>> "$OUT/lora.log"
    grep -h -E '"lora_kernels"|"decode"|"lora_push"' "$OUT"/lora_kernels.jsonl "$OUT"/lora.jsonl | cut -c 1-300
    grep -i -B2 -A3 "error\|traceback" "$OUT/lora.log" | tail -20
    ;;
  lora-linear)
    timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -rfE -p no:cacheprovider tests/test_kernels_lora_linear.py -k "cuda or fused_linear_modes" \
      "tests/test_gpu_lora_engine.py::test_deferred_and_fused_linear_modes_through_graphs_and_eagerly_give_peft_tokens" \
      > "$OUT/lora_linear_tests.log" 2>&1; grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/lora_linear_tests.log" | tail -8
    systems="default,linear_by_shape,linear_by_shape_early,linear_by_shape_early_narrow,linear_by_shape_launch_count"
    systems=${SYSTEMS:-$systems,linear_by_shape_long_s5,linear_by_shape_chunk4}  # the others: SYSTEMS=
    timeout 220 python3 bench/lora_kernels.py --systems "$systems${LINEAR_BASELINE:+,baseline_linear_by_shape}" \
      ${LINEAR_BASELINE:+--baseline-linear "$LINEAR_BASELINE"} --replays 3 --distinct 0,1,4,16 \
      > "$OUT/lora_linear.jsonl" 2>> "$OUT/lora.log"
    if [ "${ENGINE_SYSTEM:-}" = best ]; then  # the engine's tiles, or the system of theirs fastest at the most adapters
      ENGINE_SYSTEM=$(python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
rows = [r for r in rows if r.get("system", "").startswith("linear_by_shape") and "lora_us_per_hook" in r]
most = max(r["distinct"] for r in rows)
print(min((r for r in rows if r["distinct"] == most), key=lambda r: r["lora_us_per_hook"])["system"])' \
        "$OUT/lora_linear.jsonl" 2>/dev/null || echo linear_by_shape)
      echo "lora-linear: the engine with $ENGINE_SYSTEM"
    fi
    timeout ${ENGINE_TIMEOUT:-240} python3 bench/lora.py --device cuda --fused-linear only --loras ${LORAS:-64} --distinct ${DISTINCT:-1,4,16} \
      ${ENGINE_SYSTEM:+--linear-system "$ENGINE_SYSTEM"} > "$OUT/lora_linear_engine.jsonl" 2>> "$OUT/lora.log"
    grep -h -E '"lora_kernels"|"decode"' "$OUT/lora_linear.jsonl" "$OUT/lora_linear_engine.jsonl" | cut -c 1-420
    grep -i -B2 -A3 "error\|traceback" "$OUT/lora.log" | tail -20
    ;;
  lora-linear-parts)
    # copies of kernels/lora_linear.py with one part of its work taken out (their outputs are wrong: timing only)
    k=kernels/lora_linear.py parts="$OUT/parts"
    mkdir -p "$parts"
    sed 's/        while arrived < wait_for:/        while arrived < 0:/' $k > "$parts/nowait.py"
    sed 's/batch.tile_slot.shape\[0\], groups, shrink_programs/0, groups, shrink_programs/' $k > "$parts/noshrink.py"
    sed 's/shrink_programs, gemm_programs = splits \* groups/shrink_programs, gemm_programs = 0 * splits * groups/' \
      $k > "$parts/noshrinkprograms.py"
    sed 's/num_used = tl.load(num_used_ptr)  # the slots the step uses/num_used = tl.load(num_used_ptr) * 0/' \
      $k > "$parts/noexpand.py"
    args=()
    for part in nowait noshrink noshrinkprograms noexpand; do
      if cmp -s $k "$parts/$part.py"; then echo "lora-linear-parts: $part did not change $k" >&2; exit 1; fi
      args+=(--baseline-linear "$part=$parts/$part.py")
    done
    timeout 300 python3 bench/lora_kernels.py --systems "linear_by_shape,baseline_*" "${args[@]}" --replays 3 \
      --distinct ${DISTINCT:-1,16} > "$OUT/lora_linear_parts.jsonl" 2>> "$OUT/lora.log"
    grep -h '"lora_kernels"' "$OUT/lora_linear_parts.jsonl" | cut -c 1-200
    grep -i -B2 -A3 "error\|traceback" "$OUT/lora.log" | tail -20
    ;;
  lora-roles)
    for case in "default,one_launch,block_ids,linear_by_shape,linear_by_shape_block_ids 1,4 200" \
                "default,one_launch,linear_by_shape 16 120"; do
      set -- $case
      timeout -k 5 ${3:-90} python3 bench/lora_kernels.py --systems "$1" --replays 5 --distinct "$2" \
        >> "$OUT/lora_roles.jsonl" 2>> "$OUT/lora.log" || echo "{\"systems\": \"$1\", \"distinct\": \"$2\", \"killed\": true}"
    done
    grep -h '"lora_kernels"' "$OUT/lora_roles.jsonl" | cut -c 1-200
    ;;
  lora-linear-narrow)
    n=linear_by_shape_narrow_s
    systems=linear_by_shape,linear_by_shape_square_shrink_stages4,linear_by_shape_square_shrink_stages6
    systems=$systems,${n}6_shrink_stages8,${n}7_shrink_stages8,${n}6_split1024_shrink_stages4,${n}7_split1024_shrink_stages4
    timeout 200 python3 bench/lora_kernels.py --per-linear --systems "${SYSTEMS:-$systems,${n}7_shrink_stages6}" \
      --replays 3 --distinct ${DISTINCT:-0,16} > "$OUT/lora_linear_narrow.jsonl" 2>> "$OUT/lora.log"
    grep -h '"lora_kernels"' "$OUT/lora_linear_narrow.jsonl" | cut -c 1-220
    grep -i -B2 -A3 "error\|traceback" "$OUT/lora.log" | tail -20
    ;;
  lora-linear-sweep)
    timeout 570 python3 bench/lora_kernels.py --per-linear --sweep --systems "${SYSTEMS:-default,linear*}" \
      --distinct ${DISTINCT:-0,1} \
      --replays 5 > "$OUT/lora_linear_sweep.jsonl" 2>> "$OUT/lora.log"
    grep -h '"lora_kernels"' "$OUT/lora_linear_sweep.jsonl" | cut -c 1-220
    ;;
  tp)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout 320 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_tensor_parallel.py > "$OUT/tp_tests.log" 2>&1
    grep '^{' "$OUT/tp_tests.log"; tail -5 "$OUT/tp_tests.log"
    timeout 230 python3 bench/tp_decode.py --device cuda --shape qwen2.5-0.5b --batch 256 --profile > "$OUT/tp.log" 2>&1 \
      || timeout 120 python3 bench/tp_decode.py --device cuda --shape qwen2.5-0.5b --batch 256 --enforce-eager \
      > "$OUT/tp_eager.log" 2>&1
    grep -h "^{" "$OUT"/tp.log "$OUT"/tp_eager.log 2>/dev/null; tail -n 5 "$OUT"/tp.log
    ;;
esac
