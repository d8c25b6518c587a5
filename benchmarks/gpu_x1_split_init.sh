#!/usr/bin/env bash
# Session 13 (~4 min): the split master's initial state allocated longest-lived first (engine
# _init_split_master). Before it, under a cap, the planner's dots / save_attention choices with
# --adam-mu-dtype bfloat16 --master-split ran out of memory in the step's first allocation though
# their compiled peaks fit (call 2). Reruns those two (GPT-2 Large, --micro-batch auto, caps 0.115 /
# 0.09 of an H200), then a save and a resume under the 16 GiB cap with the micro-8 winner's flags
# (load_checkpoint with the split master, under the same cap).
export PYTHONUNBUFFERED=1
E="python3 examples/gpt2_large.py --loss-chunk 256 --eval-batches 0 --adam-mu-dtype bfloat16 --master-split"
F='^micro-batch auto|^SUMMARY|Error|error:|resumed|checkpoint saved'
for frac in 0.115 0.09; do
  echo "== cap $frac, --micro-batch auto"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 150 $E --micro-batch auto --steps 20 2>&1 \
    | grep -E "$F" | sed -E 's/, "losses".*//' | cut -c1-600
done
rm -rf /tmp/zj_ck
echo "== cap 0.115: save at step 5, then resume to step 10"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.115 timeout 120 $E --micro-batch 8 --remat dots --steps 5 --save /tmp/zj_ck 2>&1 \
  | grep -E "$F" | sed -E 's/, "losses".*//' | cut -c1-400
XLA_PYTHON_CLIENT_MEM_FRACTION=0.115 timeout 120 $E --micro-batch 8 --remat dots --steps 10 --save /tmp/zj_ck --resume 2>&1 \
  | grep -E "$F" | sed -E 's/, "losses".*//' | cut -c1-400
