#!/usr/bin/env bash
# Session 14, call 4 (~4 min): (1) resume_memory_probe.py under the 16 GiB cap after the room check
# counts the restore's conversions and the state is repacked; (2) the example's from-scratch loss
# spike at step 10 (GPT-2 Large, lr 3e-4, 4-step warmup; session 11): the same 40 steps at stage 0
# in fp32 (the reference: no bf16, no sharding) and in bf16 at lr 1e-4, against the default run.
set -u; export PYTHONUNBUFFERED=1
echo "== resume under cap 0.115"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.115 timeout 200 python3 benchmarks/resume_memory_probe.py /tmp/ck 2>&1 \
  | grep -v Warning | grep -v "^W1" | tail -12
rm -rf /tmp/ck
python3 - <<'PY'
import json
c = json.load(open("configs/zero0_bf16.json")); c["bf16"] = {"enabled": False}
json.dump(c, open("/tmp/zero0_fp32.json", "w"))
PY
for run in "configs/zero2_bf16.json|" "/tmp/zero0_fp32.json|--remat full" "configs/zero2_bf16.json|--lr 1e-4"; do
  config=${run%%|*}; flags=${run#*|}
  echo "== example $config $flags (40 steps)"
  timeout 120 python3 examples/gpt2_large.py --config $config --micro-batch 8 --steps 40 --eval-batches 0 $flags 2>&1 \
    | grep -E "^SUMMARY|Error|error:" | python3 -c "
import json, sys
for line in sys.stdin:
    if line.startswith('SUMMARY'):
        s = json.loads(line[8:]); print('losses', [round(x, 3) for x in s['losses']]); print('tokens/s', s.get('tokens_per_s_per_device'), 'peak', s.get('peak_gib_device0'), 'precision', s['precision'])
    else: print(line[:300])"
done
