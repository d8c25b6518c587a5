#!/usr/bin/env bash
# Issue #18's offload bar through the product's own path: examples/gpt2_large.py on GPT-2 Large
# (seq 1024, micro 8, "full" remat) with configs/zero2_offload_optimizer.json under a 24 GB cap, runs
# of 40 steps: --offload-loop in_place, no flag (the example's own choice since session 11: "host"
# where its step fits), and --offload-loop host --adam-mu-dtype bfloat16. Prints each run's offload
# line (with why) and SUMMARY (tokens/s after the first step, peak GiB). ~150 s.
# Session 11 (before the automatic choice; no flag then meant in_place): in_place 17,907 / 5.54 GiB,
# --offload-loop host 31,912 / 9.78, + bf16 first moment 36,039 / 8.90 (measured/2026-12-02-s11/call6/).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.17 PYTHONUNBUFFERED=1
for flags in "--offload-loop in_place" "" "--offload-loop host --adam-mu-dtype bfloat16"; do
  echo "== $flags"
  timeout 110 python3 examples/gpt2_large.py --config configs/zero2_offload_optimizer.json --micro-batch 8 \
    --remat full --steps 40 --eval-batches 0 $flags 2>&1 | grep -E "^optimizer offload|^SUMMARY|Error|error" | cut -c1-600
done
