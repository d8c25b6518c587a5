#!/usr/bin/env bash
# Session 15, call 3 (~8 min): GPT-2 XL (1.56B) on a 24 GB card (cap 0.17 of an H200 = 23.6 GiB):
# the example's --micro-batch auto with and without --adam-mu-dtype bfloat16 --master-split.
# Model states alone: 16 bytes a parameter (bf16 params + fp32 master + Adam) = 23.3 GiB, so without
# the flags the planner must offload; with them 10 bytes (14.5 GiB) + gradients leave room.
set -u; export PYTHONUNBUFFERED=1
for flags in "--adam-mu-dtype bfloat16 --master-split" ""; do
  echo "== xl example auto, cap 0.17, flags: ${flags:-none}"
  start=$(date +%s)
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.17 timeout 280 python3 examples/gpt2_large.py --model xl --micro-batch auto \
    --loss-chunk 256 --steps 20 --eval-batches 0 $flags 2>&1 \
    | grep -E "^micro-batch auto|faster but|^GPT-2|^SUMMARY|Error|error:" | sed -E 's/, "losses".*//' | cut -c1-700
  echo "   ($(( $(date +%s) - start )) s)"
done
