#!/usr/bin/env bash
# Session 14, call 7 (~3 min): the example's save / --resume of the micro-8 winner under the 16 GiB cap
# (0.115 of an H200), against the same 20 steps uninterrupted: the resumed steps' losses and peaks.
set -u; export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.115
flags="--micro-batch 8 --remat dots --loss-chunk 256 --adam-mu-dtype bfloat16 --master-split --eval-batches 0 --schedule-steps 20"
show() { grep -E "^SUMMARY|^resumed|Error|error:" | python3 -c "
import json, sys
for line in sys.stdin:
    if line.startswith('SUMMARY'):
        s = json.loads(line[8:]); print('  losses', [round(x, 4) for x in s['losses']], 'tokens/s', s.get('tokens_per_s_per_device'), 'peak', s.get('peak_gib_device0'))
    else: print('  ' + line[:300].rstrip())"; }
echo "== 20 steps uninterrupted"; timeout 100 python3 examples/gpt2_large.py $flags --steps 20 2>&1 | show
echo "== 10 steps, saved"; timeout 100 python3 examples/gpt2_large.py $flags --steps 10 --save /tmp/ck 2>&1 | show
echo "== resumed to 20"; timeout 100 python3 examples/gpt2_large.py $flags --steps 20 --save /tmp/ck --resume 2>&1 | show
