#!/usr/bin/env bash
# One-GPU session: host offload under a 24 GB cap (XLA_PYTHON_CLIENT_MEM_FRACTION=0.17), the
# figures of README "Measured" (about 20 minutes of GPU time in all):
#   GPT-2 Large micro 8: optimizer offload (ZeRO-2 / 3), param + optimizer, param alone, ratios;
#   the same param rows without the prefetching layer scan; GPT-2 XL; 6.25B / 6.65B GPT shapes;
#   where an offloaded AdamW update can run (host_adam_probe).
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
B="python3 benchmarks/bench.py --matrix custom --sizes large --remat on --micro 8 --mem-fraction 0.17 --steps 5 --warmup 2 --timeout 150"
$B --stages 2,3 --offload optimizer,param,optimizer:0.5,optimizer:0.25 --out "$OUT/bench_offload_large.json" 2>&1 | grep -E "^large|FAIL"
$B --stages 3 --offload param:0 --out "$OUT/bench_offload_param_only.json" 2>&1 | grep -E "^large|FAIL"
ZEROJAX_OFFLOAD_PREFETCH=0 $B --stages 3 --offload param:0,param --out "$OUT/bench_offload_noprefetch.json" 2>&1 | grep -E "^large|FAIL"
python3 benchmarks/offload_probe.py --size xl --micro 8 --mem-fraction 0.17 --remat full --configs engine-param --steps 3 --warmup 1 --timeout 150 2>&1 | grep -E "^engine"
cp "$OUT/offload_probe.json" "$OUT/offload_probe_xl.json" 2>/dev/null
# GPT shapes of 6.25B (30 layers) and 6.65B (32): more pinned host memory than XLA's 64 GB default
for L in 30 32; do
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=116 python3 benchmarks/offload_probe.py --size xl --n-embd 4096 --n-layer $L --n-head 32 --micro 8 --mem-fraction 0.17 --remat full --loss-chunk 128 --configs engine-param --steps 2 --warmup 1 --timeout 300 2>&1 | grep -E "^engine"
  cp "$OUT/offload_probe.json" "$OUT/offload_probe_gpt_L$L.json" 2>/dev/null
done
python3 benchmarks/host_adam_probe.py 2>&1 | grep -vE "^  File|^    " | tail -8
