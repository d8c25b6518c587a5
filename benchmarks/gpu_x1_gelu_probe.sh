#!/usr/bin/env bash
# Issue #18: does XLA fuse bias + gelu into the c_fc gemm? (benchmarks/gelu_epilogue_probe.py, ~1 min)
set -u; OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"

nvidia-smi --query-gpu=name --format=csv,noheader
P="python3 benchmarks/gelu_epilogue_probe.py --iters 30"
echo "== default"; $P --json $OUT/gelu_default.json 2>&1 | grep -v Warning
echo "== cublaslt"; XLA_FLAGS=--xla_gpu_enable_cublaslt=true $P --json $OUT/gelu_lt.json 2>&1 | grep -v Warning
echo "== no triton gemm"; XLA_FLAGS=--xla_gpu_enable_triton_gemm=false $P --json $OUT/gelu_notriton.json 2>&1 | grep -v Warning
echo "== dump"; XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=jit_fwd --xla_dump_hlo_pass_re=.*" $P --only jax_gelu --iters 2 2>&1 | grep -v Warning
ls /tmp/dump | wc -l; ls /tmp/dump | grep -i -E "gemm|cublas|normaliz|triton" | head -40
tar czf $OUT/dump.tgz -C /tmp dump
