#!/usr/bin/env bash
# Session 14, one call (~8 min): (1) save + resume GPT-2 Large's micro-8 winner (split master, bf16
# first moment, "dots", fused loss) under the 16 GiB cap: load_checkpoint releases the live state
# first where the device lacks room (session 13, CPU-tested only); memory stats at each stage;
# (2) the example's --micro-batch auto with --adam-mu-dtype bfloat16 --master-split under the 16.08
# and 12.58 GiB caps, after the split-init fix (session 13's call 2 ran out of memory there).
set -u; export PYTHONUNBUFFERED=1
echo "== resume under cap 0.115"
start=$(date +%s)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.115 timeout 260 python3 benchmarks/resume_memory_probe.py /tmp/ck 2>&1 | grep -v Warning | tail -12
echo "   ($(( $(date +%s) - start )) s)"
rm -rf /tmp/ck
for frac in 0.115 0.09; do
  echo "== example auto, cap $frac, --adam-mu-dtype bfloat16 --master-split"
  start=$(date +%s)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 150 python3 examples/gpt2_large.py --micro-batch auto \
    --loss-chunk 256 --steps 20 --eval-batches 0 --adam-mu-dtype bfloat16 --master-split 2>&1 \
    | grep -E "^micro-batch auto|faster but|^GPT-2|^SUMMARY|Error|error:" | sed -E 's/, "losses".*//' | cut -c1-700
  echo "   ($(( $(date +%s) - start )) s)"
done
