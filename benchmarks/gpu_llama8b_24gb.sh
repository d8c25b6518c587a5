#!/usr/bin/env bash
# One GPU capped at 24 GB (XLA_PYTHON_CLIENT_MEM_FRACTION: 23.77 GiB of the card, benchmarks/cap24.sh), Llama-3.1-8B's shape, seq 2048,
# through examples/gpt2_large.py, each run in its own process (the example prints the host's peak RSS):
#   LoRA r16 alpha 32 on all linear layers, bf16 base, --micro-batch auto
#   QLoRA (nf4 base), micro 2, full remat
#   the full fine-tune: ZeRO-3 with parameters and optimizer offloaded, --micro-batch auto,
#     accumulation 1 (an fp32 accumulator for 8B would not fit 128 GB of host memory), bf16 first moment,
#     the host master split (bf16 copy + int16 remainder: 16 GB less host memory at 8B), lr 3e-5 (at
#     the example's 3e-4 the random-init model's loss rises after a few steps)
#   PYTHONPATH=. bash benchmarks/gpu_llama8b_24gb.sh     (about 15 minutes on an H200 with 128 GB RAM)
#   SMOKE=1 bash benchmarks/gpu_llama8b_24gb.sh          (CPU, tiny-llama, no cap)
set -u
. "$(dirname "$0")/cap24.sh"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -n "${SMOKE:-}" ]; then
  M="--model tiny-llama --seq-len 64 --steps 3"; export JAX_PLATFORMS=cpu
else
  M="--model llama-3.1-8b --seq-len 2048 --steps ${STEPS:-8}"; export XLA_PYTHON_CLIENT_MEM_FRACTION=$(cap24)
fi
TIME=$(command -v /usr/bin/time || true)
run() {
  echo "== $*"
  ${TIME:+$TIME -v} timeout ${RUN_TIMEOUT:-420} $PY examples/gpt2_large.py $M --eval-batches 0 "$@" 2>&1 \
    | grep -E "^micro-batch auto|^device memory|^optimizer offload|^step [0-9]+/|^error|Error|tokens/s|peak|Maximum resident" \
    | cut -c1-300
}
run --lora 16 --lora-alpha 32 --micro-batch auto
run --lora 16 --lora-alpha 32 --quantize nf4 --micro-batch 2 --remat full
run --config configs/zero3_offload_param_optimizer.json --micro-batch auto --grad-accum 1 --remat full \
  --adam-mu-dtype bfloat16 --master-split --lr 3e-5
