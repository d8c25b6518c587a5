#!/usr/bin/env bash
# Four GPUs of one host: the layouts the planner's mesh search ranks, measured. bf16, seq 1024, AdamW,
# no remat, every entry on the same 64-row global batch (micro x accumulation x data x tensor = 64):
# ZeRO-2 / ZeRO-3 over data 4; TP 2 x data 2 with ZeRO-1 / ZeRO-3; pipe 2 x data 2 (ZeRO-1);
# TP 2 x pipe 2. GPT-2 XL's 25 heads allow no tensor split, so the tensor layouts run on Large only.
#   1. `zerojax plan --search-mesh` ranks every data x tensor x pipe shape for GPT-2 XL and Large;
#   2. planned_matrix.py turns its pick for each layout into bench.py entries; bench.py measures them.
#   PYTHONPATH=. bash benchmarks/gpu_x4.sh
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
for size in xl large; do
  $PY -m zerojax.cli plan --model $size --devices 4 --search-mesh --budget 120GiB --global-batch 64 \
    --top 8 --json "$OUT/plan_$size.json" 2>&1 | grep -v '^     {'
done
$PY benchmarks/planned_matrix.py "$OUT/plan_xl.json" "$OUT/plan_large.json" > "$OUT/matrix_x4.json" || exit 1
$PY benchmarks/bench.py --sizes xl --remat off --matrix "$OUT/matrix_x4.json" \
  --steps 5 --warmup 2 --timeout 240 --out "$OUT/x4.json" 2>&1 | grep -E "^(xl|large)|FAILED|ceiling|entries"
