#!/usr/bin/env bash
# One GPU, models other than GPT-2, each entry in its own process (benchmarks/models_bench.py):
#   the matmul ceiling (bf16), then
#   Qwen3-0.6B's shape as a list of 28 blocks (the model contract alone): build time, plain jax.jit
#     vs zerojax without remat, zerojax with "full" remat (the peak it lowers)
#   Llama-3.2-1B, seq 2048, micro 4: plain jax.jit vs zerojax at the same remat, and zerojax "dots"
#   PYTHONPATH=. bash benchmarks/gpu_models.sh          (about 8 minutes on an H200)
#   SMOKE=1 bash benchmarks/gpu_models.sh               (CPU, tiny shapes)
set -u
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -n "${SMOKE:-}" ]; then T="--tiny --steps 2"; PEAK=1; else
  T="--steps ${STEPS:-8}"
  PEAK=$($PY -c "from zerojax.planning.ceiling import measure_matmul_ceiling as m; print(m(8192)['ceiling_tflops'])" 2>/dev/null | tail -1)
fi
echo "ceiling: ${PEAK} TFLOP/s (bf16 matmul)"
run() { timeout ${RUN_TIMEOUT:-300} $PY benchmarks/models_bench.py $T --peak-tflops "$PEAK" "$@" 2>&1 \
  | grep -E "^MODELS_BENCH|Error" | sed -E 's/^MODELS_BENCH //' | cut -c1-400; }
run --model qwen3-0.6b-list --mode plain --micro 4 --seq 1024
run --model qwen3-0.6b-list --mode zerojax --micro 4 --seq 1024
run --model qwen3-0.6b-list --mode zerojax --micro 4 --seq 1024 --remat full
run --model llama-3.2-1b --mode plain --micro 4 --seq 2048 --remat full
run --model llama-3.2-1b --mode zerojax --micro 4 --seq 2048 --remat full
run --model llama-3.2-1b --mode plain --micro 4 --seq 2048
run --model llama-3.2-1b --mode zerojax --micro 4 --seq 2048
run --model llama-3.2-1b --mode zerojax --micro 4 --seq 2048 --remat dots
