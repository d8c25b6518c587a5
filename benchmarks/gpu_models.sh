#!/usr/bin/env bash
# One GPU, models other than GPT-2, each entry in its own process (benchmarks/models_bench.py):
#   the matmul ceiling (bf16), then
#   Qwen3-0.6B's shape as a list of 28 blocks (the model contract alone): build time, plain jax.jit
#     vs zerojax without remat, zerojax with "full" remat (the peak it lowers)
#   Llama-3.2-1B, seq 2048, micro 4: plain jax.jit vs zerojax at the same remat, and zerojax "dots"
#   PYTHONPATH=. bash benchmarks/gpu_models.sh          (about 8 minutes on an H200)
#   SMOKE=1 bash benchmarks/gpu_models.sh               (CPU, tiny shapes)
#   BEFORE=.before bash benchmarks/gpu_models.sh        each entry for an earlier tree, then this one
#     (`git archive <commit> zerojax tests/foreign_models.py benchmarks/models_bench.py | tar -x -C .before`)
#   ONLY="list-zerojax llama-zerojax" ...               the entries named (default: all)
set -u
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -n "${SMOKE:-}" ]; then T="--tiny --steps 2"; PEAK=1; else
  T="--steps ${STEPS:-8}"
  PEAK=$($PY -c "from zerojax.planning.ceiling import measure_matmul_ceiling as m; print(m(8192)['ceiling_tflops'])" 2>/dev/null | tail -1)
fi
echo "ceiling: ${PEAK} TFLOP/s (bf16 matmul)"
one() {  # one tree ($1), one entry
  local tree=$1; shift
  PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} timeout ${RUN_TIMEOUT:-300} $PY $tree/benchmarks/models_bench.py $T \
    --peak-tflops "$PEAK" "$@" 2>&1 | grep -E "^MODELS_BENCH|Error" | sed -E "s|^MODELS_BENCH |[$tree] |" | cut -c1-400
}
run() {  # run NAME ARGS...: the entry for the earlier tree (BEFORE) and this one, back to back
  local name=$1; shift
  case " ${ONLY:-$name} " in *" $name "*) ;; *) return ;; esac
  [ -n "${BEFORE:-}" ] && one "$BEFORE" "$@"
  one . "$@"
}
run list-plain --model qwen3-0.6b-list --mode plain --micro 4 --seq 1024
run list-zerojax --model qwen3-0.6b-list --mode zerojax --micro 4 --seq 1024
run list-remat --model qwen3-0.6b-list --mode zerojax --micro 4 --seq 1024 --remat full
run llama-plain-full --model llama-3.2-1b --mode plain --micro 4 --seq 2048 --remat full
run llama-zerojax-full --model llama-3.2-1b --mode zerojax --micro 4 --seq 2048 --remat full
run llama-plain --model llama-3.2-1b --mode plain --micro 4 --seq 2048
run llama-zerojax --model llama-3.2-1b --mode zerojax --micro 4 --seq 2048
run llama-dots --model llama-3.2-1b --mode zerojax --micro 4 --seq 2048 --remat dots
