#!/usr/bin/env bash
# Session 15, call 4 (~3 min): GPT-2 XL's 24 GB winner (call 3: save_attention, micro 8, ZeRO-2, split
# master, bf16 first moment; cap 0.17) saved after 10 steps and resumed to 20 through the example,
# under the same cap: load_checkpoint's room check and repack on a second model.
set -u; export PYTHONUNBUFFERED=1
F="--model xl --micro-batch 8 --remat save_attention --loss-chunk 256 --adam-mu-dtype bfloat16 --master-split --schedule-steps 20 --eval-batches 0"
rm -rf /tmp/ckxl
for s in "--steps 10 --save /tmp/ckxl" "--steps 20 --save /tmp/ckxl --resume"; do
  echo "== $s"; start=$(date +%s)
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.17 timeout 200 python3 examples/gpt2_large.py $F $s 2>&1 \
    | grep -E "^SUMMARY|Error|error:|resum|saved" | sed -E 's/"first_loss"/\n  "first_loss"/' | cut -c1-900
  echo "   ($(( $(date +%s) - start )) s)"
done
