#!/usr/bin/env bash
# One H200 capped at 24 GB (XLA_PYTHON_CLIENT_MEM_FRACTION: 23.77 GiB of the card, benchmarks/cap24.sh), GPT-2 Large and XL through the
# example (20-40 steps each, ~10 minutes in all; PARTS selects, default "guide offload xl bench"):
#   guide:   configs/oom_guide_zero2_offload.json with --micro-batch auto and no other flag
#   offload: configs/zero2_offload_optimizer.json, micro 8, full remat: the in_place loop, the
#            automatic choice (host where it fits), host + the bf16 first moment
#   xl:      GPT-2 XL, --micro-batch auto --loss-chunk 256: no option flags, then --master-split
#   bench:   bench.py's offload rows: ZeRO-2 / 3 + optimizer offload, ZeRO-3 + param offload,
#            offload_optimizer.ratio 0.25
#   PYTHONPATH=. bash benchmarks/gpu_offload_24gb.sh [guide] [offload] [xl] [bench]
set -u
. "$(dirname "$0")/cap24.sh"
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=$(cap24)
PY=${PYTHON:-python3}
PARTS=" ${*:-guide offload xl bench} "
example() {  # example SECONDS ARGS...: one run of the example, its plan and summary lines
  local t=$1; shift
  echo "== example $*"
  timeout "$t" $PY examples/gpt2_large.py --eval-batches 0 "$@" 2>&1 \
    | grep -E "^micro-batch auto|faster but|^optimizer offload|^GPT-2|^SUMMARY|Error|error:" \
    | sed -E 's/, "losses".*//' | cut -c1-700
}
if [[ $PARTS == *" guide "* ]]; then
  example 180 --config configs/oom_guide_zero2_offload.json --micro-batch auto --steps 20
fi
if [[ $PARTS == *" offload "* ]]; then
  for flags in "--offload-loop in_place" "" "--offload-loop host --adam-mu-dtype bfloat16"; do
    example 150 --config configs/zero2_offload_optimizer.json --micro-batch 8 --remat full --steps 40 $flags
  done
fi
if [[ $PARTS == *" xl "* ]]; then
  for flags in "" "--master-split"; do
    example 280 --model xl --micro-batch auto --loss-chunk 256 --steps 12 $flags
  done
fi
if [[ $PARTS == *" bench "* ]]; then
  B="$PY benchmarks/bench.py --matrix custom --sizes large --remat on --micro 8 --mem-fraction $(cap24) --steps 5 --warmup 2 --timeout 150"
  $B --stages 2,3 --offload optimizer,optimizer:0.25 --out "$OUT/offload_optimizer.json" 2>&1 | grep -E "^large|FAIL"
  $B --stages 3 --offload param:0,param --out "$OUT/offload_param.json" 2>&1 | grep -E "^large|FAIL"
fi
