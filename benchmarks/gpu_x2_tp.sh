#!/usr/bin/env bash
# Two-GPU session, issue #14: tensor parallelism (tensor_parallel.autotp_size 2, Megatron splits,
# data axis 1) against data-parallel ZeRO-2 and ZeRO-3 on GPT-2 Large, micro-batch 8 per GPU
# (the global batch is 8 x 2 rows in every entry: DeepSpeed's batch rule counts tensor ranks),
# bf16, remat on and off. Columns: tokens/s per GPU, peak per GPU, MFU against the measured
# bf16 matmul ceiling. Six entries of 2 warm-up + 5 timed steps, one process each; under 6 minutes
# on 2 x H200 (each entry's compile is most of its time). Results land in $OUT.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MATRIX='[{"stage": 2, "remat": false}, {"stage": 2, "remat": true},
         {"stage": 3, "remat": false}, {"stage": 3, "remat": true},
         {"stage": 0, "tp": 2, "remat": false}, {"stage": 0, "tp": 2, "remat": true}]'
timeout 350 python3 benchmarks/bench.py --matrix "$MATRIX" --sizes large --micro 8 --dtypes bf16 \
    --steps 5 --warmup 2 --timeout 55 --out "$OUT/bench_2gpu_tp.json" 2>&1 | grep -E "^large|FAILED|ceiling|MFU"
