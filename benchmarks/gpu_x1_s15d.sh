#!/usr/bin/env bash
# Session 15, call 9 (~3 min): GPT-2 XL on the 24 GB cap (0.17) with --master-split alone (the
# near-lossless flag: 2 bytes a parameter less; call 3 had it with --adam-mu-dtype bfloat16), and
# without flags again to see the example's new note naming the flags.
set -u; export PYTHONUNBUFFERED=1
for flags in "--master-split" ""; do
  echo "== xl example auto, cap 0.17, flags: ${flags:-none}"
  start=$(date +%s)
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.17 timeout 170 python3 examples/gpt2_large.py --model xl --micro-batch auto \
    --loss-chunk 256 --steps 12 --eval-batches 0 $flags 2>&1 \
    | grep -E "^micro-batch auto|faster but|^SUMMARY|Error|error:" | sed -E 's/, "losses".*//' | cut -c1-700
  echo "   ($(( $(date +%s) - start )) s)"
done
