#!/usr/bin/env bash
# Session 13, one call (~8 min): issue #18's one-GPU rows side by side -- gpu_x1_speed.sh s13 (plain
# jax.jit, the default, the micro-8 winner, micro 12/16 with the split master), then full optimizer
# offload under the 24 GB cap (the example's defaults: offload_loop "host"; and with the bf16 first
# moment), then the example itself with the micro-8 winner's flags (40 steps, bf16 ZeRO-2).
set -u; OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
bash benchmarks/gpu_x1_speed.sh s13
VARIANTS="host|ZEROJAX_OFFLOAD_LOOP=host|
host_mubf16|ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_ADAM_MU_DTYPE=bfloat16|" BUDGET=120 PER=45 \
  bash benchmarks/gpu_x1_offload_speed.sh
echo "== example: --remat dots --loss-chunk 256 --adam-mu-dtype bfloat16 --master-split"
PYTHONUNBUFFERED=1 timeout 150 python3 examples/gpt2_large.py --micro-batch 8 --remat dots --loss-chunk 256 \
  --adam-mu-dtype bfloat16 --master-split --steps 40 --eval-batches 0 2>&1 \
  | grep -E "^SUMMARY|^step|Error|error|plan|memory" | cut -c1-400 | tail -20
