#!/usr/bin/env bash
# Two-GPU probe of ZeRO-3 (GPT-2 Large, micro 8, bf16): tokens/s, the collectives XLA emitted in
# the compiled step (per computation), and XLA-flag variants. Results land in $OUT.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PIPE="--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true --xla_gpu_enable_while_loop_double_buffering=true"
b() { name=$1; shift; python3 benchmarks/bench.py --matrix custom --timeout 120 --steps 8 --warmup 2 --out "$OUT/$name.json" "$@" 2>&1 | grep -E "^large|FAILED" | sed "s/^/$name: /"; }
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*" b s3 --stages 3 --remat on,off
f=$(ls -S /tmp/dump/*train_step*after_optimizations.txt 2>/dev/null | head -1)
if [ -n "$f" ]; then
  cp "$f" "$OUT/s3_hlo.txt"
  awk '/^[%a-zA-Z].*\{$/{c=$1} / (all-gather|reduce-scatter|all-reduce|all-to-all)(-start)?\(/{n[c]++} END{for(k in n) print n[k], k}' "$f" | sort -rn | head -8
fi
[ "${1:-}" = flags ] && XLA_FLAGS="$PIPE" b s3_pipe --stages 3 --remat on
true
