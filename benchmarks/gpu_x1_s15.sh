#!/usr/bin/env bash
# Session 15 (~5 min a model): the step-time model (estimate.Hardware, fitted to GPT-2 Large only)
# against GPT-2 Medium and XL, predicted before they ran (bf16 ZeRO-2, seq 1024, one H200):
#   medium: full 8 152,324  full 16 166,261  dots 8 163,920
#   xl:     full 8  35,711  full 4   30,583  dots 8  38,856
# Usage: gpu_x1_s15.sh medium|xl
set -u; export PYTHONUNBUFFERED=1
MODEL=$1
case "$1" in
  medium) runs=("full 8" "full 16" "dots 8");;
  xl) runs=("full 8" "full 4" "dots 8");;
esac
for run in "${runs[@]}"; do
  set -- $run
  echo "== $MODEL remat $1 micro $2"
  timeout 170 python3 examples/gpt2_large.py --model $MODEL --micro-batch $2 --remat $1 --loss-chunk 256 --steps 20 --eval-batches 0 2>&1 \
    | grep -E "^SUMMARY|Error|error:" | sed -E 's/, "losses".*//' | cut -c1-600
done
