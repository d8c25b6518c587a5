#!/usr/bin/env bash
# NVMe offload (issue #16) on one H200 capped to 24 GB (XLA_PYTHON_CLIENT_MEM_FRACTION=0.17): the disk's
# bandwidth through the swapper's I/O path (pread/pwrite pool) and tensorstore; GPT-2 Large with the
# optimizer state on NVMe vs in host memory (micro 8); the largest GPT (d 4096) whose layers' fp32
# master + Adam moments (12 B/param) fit the disk's free space, with accumulation 16. <= 8 minutes.
# NVME: the swap directory (default /tmp, the machine's local disk). JSON lines in $OUT/nvme_gpt.json.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.17
NVME=${NVME:-/tmp}
DEADLINE=${DEADLINE:-450}
df -B1 "$NVME" | tail -1; free -g | head -2
echo "== disk bandwidth (64 / 256 MiB blocks, 2 GiB each)"
timeout 90 python3 benchmarks/nvme_io.py --path "$NVME" --mib 64 256 --total-mib 2048 --json "$OUT/nvme_io.json"

echo "== GPT-2 Large, optimizer offload: host memory vs NVMe (micro 8, 3 steps)"
for off in cpu nvme; do
  timeout 150 python3 benchmarks/nvme_gpt.py --size large --micro 8 --offload $off --nvme-path "$NVME" \
    --steps 3 --warmup 1 --json "$OUT/nvme_gpt.json" 2>&1 | grep -E "^NVME|Error|error:" | tail -3
done

# the largest d=4096 GPT whose layer state fits 85% of the free disk: 12 B x 12 d^2 per layer, at most
# MAX_L (default 24, ~4.8B: a step streams 2 x 12 B/param through the disk, about a minute per step
# at ~2 GB/s). The initial state is built in pinned host memory before it is written to the files:
# more than XLA's 64 GB default pinned pool, hence XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (as gpu_x1_offload.sh)
FREE=$(df -B1 --output=avail "$NVME" | tail -1)
L=$(python3 -c "print(max(1, min(${MAX_L:-24}, int($FREE * 0.85 // (12 * 12 * 4096**2)))))")
left=$((DEADLINE - SECONDS))
echo "== GPT d4096 L$L (largest for ${FREE} free bytes), param + optimizer offload, NVMe optimizer, micro 1 x accum 16 ($left s left)"
if [ $left -gt 120 ]; then
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${HOST_LIMIT_GB:-116} timeout $left python3 benchmarks/nvme_gpt.py --n-embd 4096 --n-layer $L --n-head 32 --micro 1 --accum 16 \
    --offload nvme --param --nvme-path "$NVME" --steps 1 --warmup 1 --json "$OUT/nvme_gpt.json" 2>&1 \
    | grep -E "^NVME|Error|error:" | tail -3
else
  echo "skipped (time)"
fi
python3 - "$OUT/nvme_gpt.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
print(f"{'offload':<8} {'model':<16} {'params':>8} {'mb x acc':>8} {'tok/s':>8} {'swap GB/s':>9} {'stall s':>7} {'RSS GiB':>7} {'disk GiB':>8} {'peak GiB':>8}")
for r in rows:
    print(f"{r['offload']:<8} {r['model']:<16} {r['n_params']/1e9:>7.2f}B {r['micro']:>3} x {r['accum']:<3} {r['tokens_per_s']:>8.0f} "
          f"{r['swap_GBps_over_step']:>9.2f} {r['swap_stall_s_per_step']:>7.1f} {r['peak_rss_gib']:>7.1f} {r['disk_gib']:>8.1f} {r['peak_gib']:>8.1f}")
PY
