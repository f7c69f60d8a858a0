#!/usr/bin/env bash
# One test-and-bench round on the GPU machine: GPU tests, then the generation benchmark.
# Usage (from the repository root): bash bench/gpu_round.sh [quick]
# Writes logs and JSON lines under $OUT (or ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout 420 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_engine.py tests/test_kernels_*.py 2>&1 | tee "$OUT/tests.log" | tail -30
if [ "${1:-}" = "quick" ]; then
  timeout 300 python3 bench/generate.py --batches 1,64 --new-tokens 128 --no-hf 2>&1 | grep '^{' | tee "$OUT/bench.jsonl"
else
  timeout 900 python3 bench/generate.py --batches 1,64,256 --hf-static --grpo 2>&1 | grep '^{' | tee "$OUT/bench.jsonl"
fi
