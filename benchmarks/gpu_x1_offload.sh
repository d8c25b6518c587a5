#!/usr/bin/env bash
# One-GPU session: the configs that failed before the out_shardings fix, then host offload under
# a 24 GB cap (XLA_PYTHON_CLIENT_MEM_FRACTION=0.17): GPT-2 Large micro 8 (stage 2 + optimizer
# offload, stage 3 + param + optimizer offload), GPT-2 XL micro 8, a 6.2B GPT shape.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 benchmarks/configs_sweep.py --configs 'configs/zero[123]_*bf16.json' --steps 12 --timeout 120 --out "$OUT/sweep_x1.json" 2>&1 | tail -4
python3 benchmarks/configs_sweep.py --configs 'configs/zero3_off*.json' --steps 12 --timeout 120 2>&1 | tail -3
python3 benchmarks/bench.py --matrix custom --sizes large --stages 2,3 --offload optimizer,param --remat on --micro 8 --mem-fraction 0.17 --steps 5 --warmup 2 --timeout 120 --out "$OUT/bench_offload_large.json" 2>&1 | tail -5
python3 benchmarks/offload_probe.py --size xl --micro 8 --mem-fraction 0.17 --remat full --configs engine-param --steps 3 --warmup 1 --timeout 150 2>&1 | tail -4
cp "$OUT/offload_probe.json" "$OUT/offload_probe_xl.json" 2>/dev/null
# partial optimizer offload (DeepSpeed's ratio, stage 3): the memory / speed trade-off
python3 benchmarks/bench.py --matrix custom --sizes large --stages 3 --offload optimizer:0.5,optimizer:0.25 --remat on --micro 8 --mem-fraction 0.17 --steps 5 --warmup 2 --timeout 150 --out "$OUT/bench_offload_ratio.json" 2>&1 | grep -E "^large|FAIL"
# 6.2B GPT shape: needs more pinned host memory than XLA's 64 GB default; its buffers reported
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=112 XLA_FLAGS="--xla_dump_to=/tmp/dump6b" python3 benchmarks/offload_probe.py --size xl --n-embd 4096 --n-layer 30 --n-head 32 --micro 8 --mem-fraction 0.17 --remat full --loss-chunk 128 --configs engine-param --steps 2 --warmup 1 --timeout 300 2>&1 | tail -4
python3 benchmarks/buffer_report.py /tmp/dump6b --top 12 > "$OUT/buffers_6b.txt"
