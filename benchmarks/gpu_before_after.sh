#!/usr/bin/env bash
# Two trees side by side on one GPU (GPT-2 Large, seq 1024, bf16): an earlier checkout (BEFORE,
# e.g. `git archive <commit> zerojax examples configs benchmarks/bench.py | tar -x -C .before`)
# and this one, case by case, each case run for both trees back to back:
#   bench: plain jax.jit vs ZeRO stages 0 / 2 / 3, "full" remat, micro 8
#   the example's fastest flags (micro 8, dots, fused loss, bf16 first moment, split master)
#   the seed guide's config on a 24 GB cap with --micro-batch auto
#   the 24 GB optimizer-offload row (full remat) with no offload flags (this tree: offload_loop "auto"; the
#     earlier one's default and its explicit --offload-loop host beside it)
#   BEFORE=.before bash benchmarks/gpu_before_after.sh          (about 14 minutes on an H200)
#   SMOKE=1 BEFORE=.before bash benchmarks/gpu_before_after.sh  (CPU, tiny: does it run?)
#   PART=1 (bench, the example's flags), PART=2 (the 24 GB rows) or PART=3 (the offload rows alone)
set -u
. "$(dirname "$0")/cap24.sh"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BEFORE=${BEFORE:-.before}
AFTER=${AFTER:-.}
STEPS=${STEPS:-16}
if [ -n "${SMOKE:-}" ]; then
  MODEL="--model tiny"; BENCH="--tiny"; CAP=""; STEPS=3
else
  MODEL="--model large"; BENCH="--sizes large --steps 6 --warmup 2 --timeout 200"; CAP="XLA_PYTHON_CLIENT_MEM_FRACTION=$(cap24)"
fi
summary() { grep -E "^SUMMARY|^micro-batch auto|error:|Error" | $PY -c '
import json, sys
for line in sys.stdin:
    if not line.startswith("SUMMARY "):
        print("   ", line.strip()[:300]); continue
    s = json.loads(line[8:])
    keys = ("tokens_per_s_per_device", "mfu", "peak_gib_device0", "stage", "train_batch_size", "remat", "precision")
    print("   ", {k: s.get(k) for k in keys if k in s})'; }
if [ "${PART:-all}" = all ] || [ "${PART:-all}" = 1 ]; then
for tree in "$BEFORE" "$AFTER"; do
  echo "== [$tree] bench: plain vs stages 0 / 2 / 3, full remat, micro 8"
  PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} timeout 600 $PY $tree/benchmarks/bench.py --matrix custom --stages plain,0,2,3 --remat on \
    --micro 8 $BENCH --out /tmp/bench_$(basename $tree).json 2>&1 | grep -E "^ *(large|tiny)|FAIL|rror"
done
for tree in "$BEFORE" "$AFTER"; do
  echo "== [$tree] the example's fastest flags"
  PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} timeout 300 $PY $tree/examples/gpt2_large.py $MODEL --micro-batch 8 --remat dots \
    --loss-chunk 256 --adam-mu-dtype bfloat16 --master-split --steps $STEPS --eval-batches 0 2>&1 | summary
done
fi
if [ "${PART:-all}" = all ] || [ "${PART:-all}" = 2 ]; then
for tree in "$BEFORE" "$AFTER"; do
  echo "== [$tree] the guide's config, 24 GB, --micro-batch auto"
  env PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} $CAP timeout 400 $PY $tree/examples/gpt2_large.py $MODEL \
    --config $tree/configs/oom_guide_zero2_offload.json --micro-batch auto --steps $STEPS --eval-batches 0 2>&1 \
    | summary
done
fi
if [ "${PART:-all}" != 1 ]; then   # the 24 GB rows (2) and the offload rows alone (3)
for flags in "" "--offload-loop host"; do
  for tree in "$BEFORE" "$AFTER"; do
    echo "== [$tree] 24 GB optimizer offload, micro 8, flags: ${flags:-none}"
    env PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} $CAP timeout 300 $PY $tree/examples/gpt2_large.py $MODEL \
      --config $tree/configs/zero2_offload_optimizer.json --micro-batch 8 --remat full --steps $STEPS --eval-batches 0 $flags \
      2>&1 | summary
  done
done
fi
