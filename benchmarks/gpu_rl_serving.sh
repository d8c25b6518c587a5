#!/usr/bin/env bash
# GRPO rollouts where completions end at different lengths, on one GPU: zerojax.generate (one
# batch decoded to its longest row's end) beside the serving engine's continuous batching over the
# same live weights (RolloutOptions generator="serving"), random-init Llama-3.2-1B, group 8 x 8
# prompts of 256 tokens, up to 1,024 new tokens, every 256th token id a stop (lengths spread
# about 256), one warm-up step and 3 measured. Under 10 minutes.
#   PYTHONPATH=. bash benchmarks/gpu_rl_serving.sh          # results in $OUT (default benchmarks/results/)
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_rl_serving.sh  # CPU, tiny shapes: does it run?
set -euo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if [ -n "${SMOKE:-}" ]; then
  args=(--tiny --new 8 --stop-every 4 --steps 1)
else
  args=(--model llama-3.2-1b --new 1024 --stop-every 256 --steps 3)
fi
log="$OUT/rl_serving_$(date -u +%Y%m%dT%H%M%SZ).txt"
for generator in generate serving; do
  python benchmarks/rl_bench.py "${args[@]}" --generator "$generator" | tee -a "$log"
done
echo "raw output: $log"
