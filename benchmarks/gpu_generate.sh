#!/usr/bin/env bash
# Generation on one GPU (H100 / H200), under 8 minutes: zerojax's decoder on random-init
# Llama-3.1-8B (bf16; batch 1 x 128 + 256 with its share of the HBM bound, batch 64 x 512 + 512) and
# a Llama-3.2-1B engine (ZeRO-2, LoRA r 16) that trains, generates from its live weights and trains
# again; then transformers' generate (sdpa, static cache, bf16) on the same 8B shapes.
#   PYTHONPATH=. bash benchmarks/gpu_generate.sh          # results in $OUT (default benchmarks/results/)
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_generate.sh  # CPU, tiny shapes: does it run?
set -u
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
TINY=""
[ -n "${SMOKE:-}" ] && TINY="--tiny"
stamp=$(date +%Y%m%d-%H%M%S)
echo "== zerojax generate (cases a, b, c)"
timeout 270 $PY benchmarks/generate_bench.py $TINY 2>&1 | tee "$OUT/generate-zerojax-$stamp.log" | grep -v "^WARNING"
echo "== transformers generate (cases a, b)"
timeout 200 $PY benchmarks/hf_generate_bench.py $TINY 2>&1 | tee "$OUT/generate-hf-$stamp.log" | grep -v "^WARNING"
echo "== JSON lines"
grep -h '^{"framework"' "$OUT/generate-zerojax-$stamp.log" "$OUT/generate-hf-$stamp.log"
