#!/usr/bin/env bash
# Generation on one GPU (H100 / H200), under 8 minutes: zerojax's decoder on random-init
# Llama-3.1-8B (bf16; batch 1 x 128 + 256 with its share of the HBM bound, batch 64 x 512 + 512) and
# a Llama-3.2-1B engine (ZeRO-2, LoRA r 16) that trains, generates from its live weights and trains
# again; then transformers' generate (sdpa, static cache, bf16) on the same 8B shapes.
#   PYTHONPATH=. bash benchmarks/gpu_generate.sh          # results in $OUT (default benchmarks/results/)
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_generate.sh  # CPU, tiny shapes: does it run?
. "$(dirname "$0")/pair.sh"
run_pair generate benchmarks/generate_bench.py 270 benchmarks/hf_generate_bench.py 200
# the 8B decode program compiled from shapes (nothing allocated): XLA's bytes per iteration and
# the kernels that only move data
timeout 60 $PY benchmarks/decode_hlo_report.py $TINY 2>&1 | grep '^{' | tee -a "$OUT/generate-decode-hlo.jsonl"
