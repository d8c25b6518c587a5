#!/usr/bin/env bash
# Two-GPU session: ZeRO stages 1-3 vs plain jax.jit (GPT-2 Large, micro 8, bf16), the stage-3
# per-layer gather against GSPMD's own choice, and every config in configs/ on 2 GPUs.
# Run from the repo root with the project importable (PYTHONPATH=.); results land in $OUT.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 benchmarks/bench.py --matrix custom --stages plain,1,2,3 --remat on --timeout 150 --out "$OUT/bench_2gpu.json" 2>&1 | tail -12
ZEROJAX_STAGE3_GATHER=auto python3 benchmarks/bench.py --matrix custom --stages 3 --remat on --timeout 150 --out "$OUT/bench_2gpu_stage3_auto.json" 2>&1 | tail -3
python3 benchmarks/configs_sweep.py --steps 12 --timeout 150 --out "$OUT/configs_sweep_2gpu.json" 2>&1 | tail -12
