#!/usr/bin/env bash
# Session 14, call 6 (~4 min): the refitted step-time model (estimate.Hardware, fitted to seven
# runs) against four runs it was not fitted to, predicted before they ran: GPT-2 Large, seq 1024,
# bf16 ZeRO-2, the example with --loss-chunk 256, 20 steps: full micro 4 (predicted 65,297; the
# old model 42,840), full micro 16 (76,565; 81,312), save_qkv micro 8 (73,604; 66,006), dots micro 4
# (69,870; 54,081).
set -u; export PYTHONUNBUFFERED=1
for run in "full 4" "full 16" "save_qkv 8" "dots 4"; do
  set -- $run
  echo "== remat $1 micro $2"
  timeout 80 python3 examples/gpt2_large.py --micro-batch $2 --remat $1 --loss-chunk 256 --steps 20 --eval-batches 0 2>&1 \
    | grep -E "^SUMMARY|Error|error:" | sed -E 's/, "losses".*//' | cut -c1-600
done
