#!/usr/bin/env bash
# Session 15, calls 3 and 9 (~2 min a flag set): GPT-2 XL (1.56B) on a 24 GB card (cap 0.17 of an
# H200 = 23.8 GiB): the example's --micro-batch auto with each flag set given (default: both options,
# then none). Model states alone: 16 bytes a parameter (bf16 params + fp32 master + Adam) = 23.3 GiB,
# so without flags the planner must offload; --master-split takes 2 bytes a parameter off,
# --adam-mu-dtype bfloat16 2 more.
#   call 3: gpu_x1_s15b.sh                                   (20 steps)
#   call 9: STEPS=12 gpu_x1_s15b.sh "--master-split" ""      (the near-lossless flag alone; the note)
set -u; export PYTHONUNBUFFERED=1
[[ $# -gt 0 ]] || set -- "--adam-mu-dtype bfloat16 --master-split" ""
for flags in "$@"; do
  echo "== xl example auto, cap 0.17, flags: ${flags:-none}"
  start=$(date +%s)
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.17 timeout 280 python3 examples/gpt2_large.py --model xl --micro-batch auto \
    --loss-chunk 256 --steps "${STEPS:-20}" --eval-batches 0 $flags 2>&1 \
    | grep -E "^micro-batch auto|faster but|^GPT-2|^SUMMARY|Error|error:" | sed -E 's/, "losses".*//' | cut -c1-700
  echo "   ($(( $(date +%s) - start )) s)"
done
