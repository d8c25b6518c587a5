#!/usr/bin/env bash
# Four-GPU session (issue #19): the layouts users pick on one node, with the micro-batch the planner
# chooses, measured, next to the planner's predicted ranking. bf16, 1024 tokens a row, AdamW, no
# remat, every entry on the same 64-row global batch (DeepSpeed's rule: micro x accumulation x data x
# tensor = 64):
#   ZeRO-2 / ZeRO-3 over data 4; TP 2 x data 2 with ZeRO-1 / ZeRO-3; pipe 2 x data 2 (ZeRO-1);
#   TP 2 x pipe 2 (one data rank).
# 1. `zerojax plan --search-mesh` ranks every data x tensor x pipe shape for GPT-2 XL and Large
#    (formula peaks, estimate.mesh_peak_bytes; budget 120 GiB = 139 / 1.16, as the formula erred up
#    to 16% low on the 2-GPU pipeline rows). GPT-2 XL has 25 attention heads: no tensor size above 1
#    divides them (zerojax splits attention on heads and refuses), so the tensor layouts run on
#    Large (20 heads) only, next to Large's own data / pipe layouts.
# 2. benchmarks/planned_matrix.py turns the planner's pick for each layout into bench.py entries;
#    bench.py measures them.
# 3. benchmarks/rank_check.py prints the predicted ranking next to the measured one per model
#    (JSON: $OUT/rank_x4.json) and markdown blocks for benchmarks/RESULTS.md (the lead pastes them).
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for size in xl large; do
  python3 -m zerojax.cli plan --model $size --devices 4 --search-mesh --budget 120GiB --global-batch 64 \
    --top 8 --json "$OUT/plan_$size.json" 2>&1 | grep -v '^     {'
done
python3 benchmarks/planned_matrix.py "$OUT/plan_xl.json" "$OUT/plan_large.json" > "$OUT/matrix_x4.json" || {
  echo "no planned entries: the session-5 matrix instead"
  echo '[{"size": "xl", "stage": 2, "micro": 8, "accum": 2}, {"size": "xl", "stage": 3, "micro": 8, "accum": 2},
    {"size": "xl", "stage": 1, "pipe": 2, "micro": 2, "accum": 16, "ckpt": 24}]' > "$OUT/matrix_x4.json"; }
python3 benchmarks/bench.py --sizes xl --remat off --matrix "$OUT/matrix_x4.json" \
  --steps 5 --warmup 2 --timeout 240 --out "$OUT/x4.json" 2>&1 | grep -E "^(xl|large)|FAILED|ceiling|entries"
python3 benchmarks/rank_check.py "$OUT/x4.json" --out "$OUT/rank_x4.json" --markdown
