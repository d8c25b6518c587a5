#!/usr/bin/env bash
# Session 12, call 3: the gelu epilogue probe with the model's custom-VJP gelu_new under the three
# Triton settings (~1 min), then gpu_x1_speed.sh s12 (~4 min).
set -u; OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
P="python3 benchmarks/gelu_epilogue_probe.py --iters 30 --only model_gelu_new,jax_gelu"
echo "== default"; $P --json $OUT/gelu2_default.json 2>&1 | grep -v Warning
echo "== no triton gemm"; XLA_FLAGS=--xla_gpu_enable_triton_gemm=false $P --json $OUT/gelu2_notriton.json 2>&1 | grep -v Warning
echo "== triton_gemm_any=false"; XLA_FLAGS=--xla_gpu_triton_gemm_any=false $P --json $OUT/gelu2_anyoff.json 2>&1 | grep -v Warning
bash benchmarks/gpu_x1_speed.sh s12
