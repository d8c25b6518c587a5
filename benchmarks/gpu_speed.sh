#!/usr/bin/env bash
# One GPU, GPT-2 Large, seq 1024, bf16, ZeRO-2: the speed table of benchmarks/RESULTS.md side by side
# in one run (~4 minutes on an H200), then the same best row through the example (40 steps).
#   plain jax.jit (full remat; XLA's zero-init option, which the engine sets itself on GPU)
#   zerojax's default (ZeRO-2, per-layer "full" remat), with and without --split-master on
#   remat "dots" + the fused loss (chunk 256) + bf16 first moment + split master, micro 8
#   save_attention_block at micro 12 and save_attention at micro 16, the same options
# JSON and the table go to $OUT. BENCH_ARGS=--tiny runs the matrix on CPU as a smoke test.
#   PYTHONPATH=. bash benchmarks/gpu_speed.sh
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
ZI='"env": {"XLA_FLAGS": "--xla_gpu_enable_dus_accumulator_zero_init_elimination=true"}, "label": "zero-init"'
BEST='"options": {"adam_mu_dtype": "bfloat16", "split_master": "on"}'
C='"stage": 2, "loss_chunk": 256'
$PY benchmarks/bench.py --steps 6 --warmup 2 --timeout 180 ${BENCH_ARGS:-} --out "$OUT/speed.json" --matrix "[
  {\"stage\": \"plain\", \"remat\": true, $ZI},
  {\"stage\": 2, \"remat\": true},
  {\"stage\": 2, \"remat\": true, \"options\": {\"split_master\": \"on\"}},
  {$C, \"remat\": \"dots\", $BEST},
  {$C, \"remat\": \"save_attention_block\", \"micro\": 12, $BEST},
  {$C, \"remat\": \"save_attention\", \"micro\": 16, $BEST}]" 2>&1 | grep -E "^ *(large|tiny|entry|ceiling)|FAIL"

case "${BENCH_ARGS:-}" in *--tiny*) exit 0 ;; esac
echo "== the example, the best micro-8 row"
timeout 300 $PY examples/gpt2_large.py --micro-batch 8 --remat dots --loss-chunk 256 \
  --adam-mu-dtype bfloat16 --master-split --steps 40 --eval-batches 0 2>&1 \
  | grep -E "^GPT-2|^SUMMARY|Error|error:" | sed -E 's/, "losses".*//' | cut -c1-700
