#!/usr/bin/env bash
# Issue #12's check: the engine refactor (EngineOptions, build_layout, the planner split) keeps
# speed. GPT-2 Large, micro 8, bf16, per-layer remat, stages plain / 0-3, then ZeRO-2 with optimizer
# offload under a 24 GB cap; BASE (a copy of the tree before the change, default .base) and this
# tree side by side on one machine. About 8 minutes on one H200.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
BASE=${BASE:-.base}
export PYTHONUNBUFFERED=1
M="--matrix custom --sizes large --remat on --micro 8 --steps 6 --warmup 2 --timeout 120"
for tree in "$BASE" .; do
  name=$([ "$tree" = . ] && echo after || echo before)
  (cd "$tree" && python3 benchmarks/bench.py $M --stages plain,0,1,2,3 --out "$OUT/refactor_$name.json" 2>&1 \
     | grep -E "^large|FAIL|ceiling" | sed "s/^/$name /")
  (cd "$tree" && python3 benchmarks/bench.py $M --stages 2 --offload optimizer --mem-fraction 0.17 \
     --out "$OUT/refactor_offload_$name.json" 2>&1 | grep -E "^large|FAIL" | sed "s/^/$name /")
done
