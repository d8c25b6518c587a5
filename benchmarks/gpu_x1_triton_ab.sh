#!/usr/bin/env bash
# Issue #18, session 12: why XLA's Triton gemms off lost 2.7% on the micro-8 winner although it lets
# cuBLASLt take the c_fc gemm's bias + gelu (gelu_epilogue_probe.py: the forward MLP 0.335 -> 0.287 ms).
# Profiles of save_qkv_attention + ce/256 at micro 8 with Triton gemms on (default) and off, each
# with its compiled HLO (the gemm epilogues counted). ~3 min.
set -u; OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
S='{"stage": 2, "remat": "save_qkv_attention", "loss_chunk": 256}'
# "any_off": --xla_gpu_triton_gemm_any=false, Triton only where its fusion pays, cuBLAS (with its
# epilogues) for the plain dots
for v in ${VARIANTS:-on off any_off}; do
  case $v in on) unset XLA_FLAGS;; off) export XLA_FLAGS=--xla_gpu_enable_triton_gemm=false;;
    any_off) export XLA_FLAGS=--xla_gpu_triton_gemm_any=false;; esac
  python3 benchmarks/profile_step.py "$S" --steps 4 --warmup 2 --hlo "$OUT/tr_$v.hlo.txt.gz" \
    --json "$OUT/tr_$v.json" 2>/dev/null > "$OUT/tr_$v.md"
  head -30 "$OUT/tr_$v.md"
  echo "epilogues ($v):"; zcat "$OUT/tr_$v.hlo.txt.gz" | grep -o '"epilogue":"[A-Z_]*"' | sort | uniq -c
done
