#!/usr/bin/env bash
# Four-GPU session (issue #19): the layouts users pick on one node, measured, next to the planner's
# predicted ranking. bf16, 1024 tokens a row, AdamW, each entry on the same 64-row global batch:
#   zero2 / zero3        data 4: micro 8 x accum 2 x 4              = 64 rows
#   tp2 zero1 / zero3    tensor 2 x data 2: micro 8 x accum 2 x 4   = 64 rows (tensor ranks counted)
#   pipe2 zero1          pipe 2 x data 2: micro 2 x accum 16 x 2    = 64 rows
#   tp2 pipe2 zero1      tensor 2 x pipe 2 (data 1): micro 4 x 16 x 1 x 2 tensor = 64 rows
# GPT-2 XL has 25 attention heads: no tensor size above 1 divides them (zerojax splits attention on
# heads and refuses, as `zerojax plan --search-mesh` reports), so the tensor layouts run on GPT-2
# Large (20 heads), with its own data / pipe baselines; XL runs the data and pipe layouts.
# Non-pipe entries use per-layer remat; pipe entries checkpoint each stage's layers per iteration
# (pipeline.activation_checkpoint_interval = layers / 2): on 2 x H200 as fast, a fifth of the memory.
# Then: the planner's mesh search for both models (formula peaks, printed) and its predicted
# ranking of the measured entries next to the measured one (benchmarks/rank_check.py), as JSON in
# $OUT and as markdown blocks for benchmarks/RESULTS.md (the lead pastes them).
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for size in xl large; do
  python3 -m zerojax.cli plan --model $size --devices 4 --search-mesh --budget 139GiB --global-batch 64 \
    --remat on --top 6 --json "$OUT/plan_$size.json" 2>&1 | grep -v '^     {'
done
python3 benchmarks/bench.py --sizes xl --remat on --matrix '[
  {"size": "xl", "stage": 2, "micro": 8, "accum": 2},
  {"size": "xl", "stage": 3, "micro": 8, "accum": 2},
  {"size": "xl", "stage": 1, "pipe": 2, "micro": 2, "accum": 16, "remat": false, "ckpt": 24},
  {"size": "large", "stage": 2, "micro": 8, "accum": 2},
  {"size": "large", "stage": 3, "micro": 8, "accum": 2},
  {"size": "large", "stage": 1, "tp": 2, "micro": 8, "accum": 2},
  {"size": "large", "stage": 3, "tp": 2, "micro": 8, "accum": 2},
  {"size": "large", "stage": 1, "pipe": 2, "micro": 2, "accum": 16, "remat": false, "ckpt": 18},
  {"size": "large", "stage": 1, "pipe": 2, "tp": 2, "micro": 4, "accum": 16, "remat": false, "ckpt": 18}]' \
  --steps 5 --warmup 2 --timeout 240 --out "$OUT/x4.json" 2>&1 | grep -E "^(xl|large)|FAILED|ceiling|entries"
python3 benchmarks/rank_check.py "$OUT/x4.json" --out "$OUT/rank_x4.json" --markdown
