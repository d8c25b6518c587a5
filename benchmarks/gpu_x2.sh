#!/usr/bin/env bash
# Two-GPU session: plain jax.jit and ZeRO stages 1-3 (GPT-2 Large, micro 8, bf16, with and without
# remat), then the ZeRO configs in configs/ through the example. Results land in $OUT.
# (benchmarks/x2_stage3_probe.sh looks inside stage 3: its collectives and XLA-flag variants.)
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 benchmarks/bench.py --matrix custom --stages plain,1,2,3 --remat on,off --timeout 150 --out "$OUT/bench_2gpu.json" 2>&1 | grep -E "^large|FAILED|ceiling"
python3 benchmarks/configs_sweep.py --configs 'configs/zero[123]_*bf16.json' --steps 12 --timeout 150 --out "$OUT/configs_sweep_2gpu.json" 2>&1 | tail -5
