#!/usr/bin/env bash
# NVMe offload (ZeRO-Infinity) on one H200 capped at 24 GB (XLA_PYTHON_CLIENT_MEM_FRACTION: 23.77 GiB of the card, benchmarks/cap24.sh):
#   smoke  a small GPT (d 256, 4 layers, 2 of them on NVMe) through the whole path, < 1 minute
#   big    first the disk through the swapper's I/O path (nvme_io.py), then a GPT of d 4096 x 36
#          layers (7.46B; L to change) with ZeRO-3 + offload_param cpu + the optimizer state split
#          between host memory (HOST_LAYERS, default 12) and NVMe swap files, micro 8 x accumulation
#          16, one step timed net of compilation (~420 s; needs ~105 GiB RAM and ~60 GiB of disk)
# XLA's pinned host pool grows by doubling and never shrinks: HOST_LIMIT_GB (default 65) caps it near
# what the pinned arrays need. NVME: the swap directory (default /tmp). JSON lines in $OUT.
#   PYTHONPATH=. bash benchmarks/gpu_nvme.sh [smoke|big]
set -u
. "$(dirname "$0")/cap24.sh"
MODE=${1:-big}
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=$(cap24)
PY=${PYTHON:-python3}
NVME=${NVME:-/tmp}
df -h "$NVME" | tail -1; free -g | head -2
if [ "$MODE" = smoke ]; then
  timeout 60 $PY benchmarks/nvme_gpt.py --n-embd 256 --n-layer 4 --n-head 4 --micro 1 --accum 2 --seq 128 \
    --offload nvme --param --host-layers 2 --nvme-path "$NVME" --steps 1 --warmup 1 \
    --json "$OUT/nvme_gpt.json" 2>&1 | grep -E "^NVME|Error|error:" | tail -3
  exit 0
fi
echo "== disk bandwidth through the swapper (64 MiB blocks, 2 GiB; O_DIRECT and buffered; buffer_count 2 and 4)"
timeout 100 $PY benchmarks/nvme_io.py --path "$NVME" --mib 64 --total-mib 2048 --buffer-count 2 4 \
  --no-tensorstore --json "$OUT/nvme_io.json" 2>&1 | tail -6
L=${L:-36}
echo "== GPT d4096 L$L, ZeRO-3 + offload_param cpu + optimizer ${HOST_LAYERS:-12} layers host / rest NVMe"
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${HOST_LIMIT_GB:-65} timeout ${BIG_S:-420} $PY benchmarks/nvme_gpt.py \
  --n-embd 4096 --n-layer "$L" --n-head 32 --micro ${MICRO:-8} --accum ${ACCUM:-16} --offload nvme --param \
  --buffer-count ${BUFFERS:-2} --host-layers ${HOST_LAYERS:-12} --nvme-path "$NVME" --steps ${STEPS:-0} \
  --warmup 1 --json "$OUT/nvme_gpt.json" 2>&1 | grep -E "^NVME|Error|error:|Killed" | tail -8
