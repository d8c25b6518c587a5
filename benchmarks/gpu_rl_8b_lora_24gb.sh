#!/usr/bin/env bash
# GRPO on Llama-3.1-8B's shape with LoRA (r 16, alpha 32, all linear layers, bf16 base) on one GPU
# capped at 24 GB (benchmarks/cap24.sh), through `zerojax train --method grpo`: the built-in
# arithmetic task (byte-level prompts of 6 tokens), group 8 x 4 prompts, 256 new tokens, micro 4 x 8
# accumulation, full remat, random-init weights (no hub). The SUMMARY's "rollouts" gives samples/s
# and the generation / training split over the steps that compiled nothing, "peak_gib_device0" the
# device peak.
#   PYTHONPATH=. bash benchmarks/gpu_rl_8b_lora_24gb.sh     # results in $OUT (default benchmarks/results/)
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_rl_8b_lora_24gb.sh   # CPU, tiny-llama, no cap
set -u
. "$(dirname "$0")/cap24.sh"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
if [ -n "${SMOKE:-}" ]; then
  M="--model tiny-llama --seq-len 24 --steps 4 --micro-batch 2 --grad-accum 4"; NEW=8; export JAX_PLATFORMS=cpu
else
  M="--model llama-3.1-8b --seq-len 262 --steps ${STEPS:-5} --micro-batch 4 --grad-accum 8"; NEW=256
  export XLA_PYTHON_CLIENT_MEM_FRACTION=$(cap24)
fi
timeout "${RUN_TIMEOUT:-480}" $PY -m zerojax.cli train $M --lora 16 --lora-alpha 32 --remat full --eval-batches 0 \
    --method grpo --data arithmetic --method-option group=8 --method-option max_new_tokens=$NEW \
    --summary-json "$OUT/rl-8b-lora-summary.json" 2>&1 | tee "$OUT/rl-8b-lora.log" \
    | grep -E "^step [0-9]+/|^device memory|error|Error|^trained" | cut -c1-300
$PY - "$OUT/rl-8b-lora-summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(json.dumps({"framework": "zerojax", "run": "grpo llama-3.1-8b lora r16, 24 GB cap", **s.get("rollouts", {}),
                  "peak_gib_device0": s.get("peak_gib_device0"), "reward": s.get("method_metrics", {}).get("reward/mean")}))
PY
