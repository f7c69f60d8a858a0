#!/usr/bin/env bash
# One test-and-bench round on the GPU machine. From the repository root:
#   bash bench/gpu_round.sh tests     GPU tests + decode-step profile + engine-only throughput
#   bash bench/gpu_round.sh full      the generation benchmark against transformers (dynamic, static+compile)
# Logs and JSON lines go under $OUT (default ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
case "${1:-tests}" in
  tests)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_gpu_deterministic.py \
      tests/test_kernels_attention.py tests/test_kernels_sampling.py tests/test_kernels_matmul.py \
      > "$OUT/tests.log" 2>&1; tail -15 "$OUT/tests.log"
    timeout 120 python3 bench/profile_decode.py --batch 1 --batch 64 --batch 256 > "$OUT/profile.jsonl" 2> "$OUT/profile.err"
    cat "$OUT/profile.jsonl"; tail -5 "$OUT/profile.err"
    timeout 240 python3 bench/generate.py --batches 1,64,256 --no-hf --grpo --deterministic > "$OUT/bench.log" 2>&1
    grep '^{' "$OUT/bench.log"; grep -v '^{' "$OUT/bench.log" | grep -i -A3 "error\|traceback" | tail -20
    ;;
  full)
    timeout 540 python3 bench/generate.py --batches 1,64,256 --hf-static --grpo > "$OUT/bench.log" 2>&1
    grep '^{' "$OUT/bench.log"; grep -v '^{' "$OUT/bench.log" | grep -i -A3 "error\|traceback" | tail -20
    ;;
esac
