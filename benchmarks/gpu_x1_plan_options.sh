#!/usr/bin/env bash
# Session 13 (~6 min): the example's --micro-batch auto on GPT-2 Large (configs/zero2_bf16.json, the
# fused loss) under a 16 GiB and a 12.6 GiB cap (XLA_PYTHON_CLIENT_MEM_FRACTION 0.115 / 0.09 of an
# H200), without and with --adam-mu-dtype bfloat16 --master-split: the planner now compiles its
# candidates with the run's EngineOptions and explores none + its remat ladder (dots ... full).
# Prints the planner's choice (and the faster one that did not fit), the run header (MFU basis: the
# ceiling measured at start) and SUMMARY (tokens/s, peak, MFU) of 20 steps.
export PYTHONUNBUFFERED=1
for frac in 0.115 0.09; do
  for flags in "" "--adam-mu-dtype bfloat16 --master-split"; do
    echo "== cap $frac ${flags:-(no options)}"
    start=$(date +%s)
    XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 170 python3 examples/gpt2_large.py --micro-batch auto \
      --loss-chunk 256 --steps 20 --eval-batches 0 $flags 2>&1 \
      | grep -E "^micro-batch auto|faster but|^GPT-2|^SUMMARY|Error|error:" | sed -E 's/, "losses".*//' | cut -c1-700
    echo "   ($(( $(date +%s) - start )) s)"
  done
done
