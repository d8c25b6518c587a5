#!/usr/bin/env bash
# NVMe offload (issue #16) on one H200 capped to 24 GB (XLA_PYTHON_CLIENT_MEM_FRACTION=0.17), 128 GiB RAM,
# 64 GiB disk: a GPT larger than the 7.06B that CPU offload could not fit (its ~105 GiB of host state was
# killed during init), trained with ZeRO-3 + offload_param cpu + the optimizer state split between host memory
# (offload_optimizer.host_layers) and NVMe swap files, micro 8 x accumulation 16 (MICRO, ACCUM). Neither the
# disk (12 B/param of master + moments: 85 GB for 7.06B) nor host memory holds that state alone; both together do.
# ACCUM > 1: the engine sums each micro-batch's gradients into an fp32 accumulator in pinned host memory
# (TrainState.grad_accumulator, 4 B/param: 30 GB at 7.46B), so the split keeps more layers on disk.
# XLA's pinned host pool (a BFC allocator that grows by doubling regions, never shrinking) is capped at what the
# pinned arrays need (HOST_LIMIT_GB, default: bf16 params + bf16 gradients + the accumulator + the non-layer
# state, +12%): left at a generous cap it grew to ~118 GiB RSS in one 7.46B step.
#   bash benchmarks/gpu_x1_nvme.sh big     # d 4096, L ${L:-36} (~7.46B; 35 if the disk is short), ~420 s: the disk
#       probe, init ~100 s, one step (~240 s) timed net of compilation (STEPS=0: a second step would pass the
#       device tool's 600 s); session 7 ran it as is (HOST_LAYERS=12 BUFFERS=2 ACCUM=16 were set by hand then)
#   bash benchmarks/gpu_x1_nvme.sh smoke   # a small GPT through the same path, <= 60 s
# First the disk's bandwidth through the swapper's I/O path (benchmarks/nvme_io.py), then the run: tokens/s,
# host RSS peak (and at the end of init), disk bytes, the update's achieved disk bandwidth.
# NVME: the swap directory (default /tmp, the machine's local disk). JSON lines in $OUT/nvme_gpt.json.
set -u
MODE=${1:-big}
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.17
NVME=${NVME:-/tmp}
df -B1 "$NVME" | tail -1; free -g | head -2

if [ "$MODE" = smoke ]; then
  # d 256, 4 layers, half of them on NVMe: the split, the streamed init and the update's I/O, end to end
  timeout 55 python3 benchmarks/nvme_gpt.py --n-embd 256 --n-layer 4 --n-head 4 --micro 1 --accum 2 --seq 128 \
    --offload nvme --param --host-layers 2 --nvme-path "$NVME" --steps 1 --warmup 1 --json "$OUT/nvme_gpt.json" 2>&1 \
    | grep -E "^NVME|Error|error:" | tail -3
else
  if [ -z "${SKIP_IO:-}" ]; then   # SKIP_IO=1: the disk measured already (a rerun with less time)
    echo "== disk bandwidth through the swapper (64 MiB blocks, 2 GiB; O_DIRECT and buffered; buffer_count 2 and 4)"
    timeout 100 python3 benchmarks/nvme_io.py --path "$NVME" --mib 64 --total-mib 2048 --buffer-count 2 4 --no-tensorstore --json "$OUT/nvme_io.json" 2>&1 | tail -6
  fi
  # the split: the fewest layers on disk that keep host memory under HOST_GIB (default 92 of the 128 GiB: the
  # estimate is rough), else the most the disk holds if host memory stays under 104 GiB; L 36, else 35.
  # Host state with CPU offload ~16 B/param (12 master + moments, 2 bf16 params, 2 bf16 gradients; 7.06B
  # measured 105 GiB); each layer on disk takes its 144 d^2 bytes of state out of it, and buffer_count + 2
  # layers come back as the swapper's buffers and the host callbacks' copies; 6 GiB for the process itself.
  # Disk: 85% of the free bytes at most.
  D_MODEL=4096
  FREE=$(df -B1 --output=avail "$NVME" | tail -1)
  MICRO=${MICRO:-8}; ACCUM=${ACCUM:-16}; BUFFERS=${BUFFERS:-2}
  read -r L HOST_LAYERS PINNED_GIB EST <<<"$(python3 - "${L:-36}" "$D_MODEL" "$FREE" "${HOST_GIB:-92}" "$ACCUM" "${HOST_LAYERS:-}" "${BUFFERS:-4}" <<'PY'
import math, sys
L0, d, free, host_gib, accum = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
forced = int(sys.argv[6]) if sys.argv[6] else None
buffers = int(sys.argv[7])
layer = 144 * d * d  # a layer's fp32 master + Adam moments: 12 B x 12 d^2
for L in (L0, L0 - 1):
    params = 12 * d * d * L + 50304 * d + 1024 * d
    rest = (50304 + 1024) * d
    pinned = (2 + 2 + (4 if accum > 1 else 0)) * params + 12 * rest  # params, gradients, accumulator, rest state
    host = lambda disk: pinned + (L - disk) * layer + (min(buffers, disk) + 2) * layer + 6 * 2**30  # noqa: E731
    fits = [disk for disk in range(1, L) if disk * layer <= 0.85 * free]
    if forced is not None:
        ok = [L - forced] if L - forced in fits else []
    else:
        ok = [disk for disk in fits if host(disk) <= host_gib * 2**30] or [
            disk for disk in fits[-1:] if host(disk) <= 104 * 2**30]
    if ok:
        disk = ok[0]
        print(L, L - disk, math.ceil(pinned * 1.12 / 2**30),
              f"{params / 1e9:.2f}B:host~{host(disk) / 2**30:.0f}GiB:pinned~{pinned / 2**30:.0f}GiB:disk~{disk * layer / 2**30:.0f}GiB")
        break
else:
    print(L0, -1, 0, "no split fits")
PY
)"
  echo "== GPT d$D_MODEL L$L ($EST), ZeRO-3 + offload_param cpu + optimizer host_layers $HOST_LAYERS / NVMe, micro $MICRO x accum $ACCUM, pinned pool cap ${HOST_LIMIT_GB:-$PINNED_GIB} GiB"
  if [ "$HOST_LAYERS" -ge 0 ]; then
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${HOST_LIMIT_GB:-$PINNED_GIB} timeout ${BIG_S:-420} python3 benchmarks/nvme_gpt.py \
      --n-embd $D_MODEL --n-layer $L --n-head 32 --micro $MICRO --accum $ACCUM --offload nvme --param --buffer-count ${BUFFERS:-4} \
      --host-layers $HOST_LAYERS --nvme-path "$NVME" --steps ${STEPS:-0} --warmup 1 --json "$OUT/nvme_gpt.json" 2>&1 \
      | grep -E "^NVME|Error|error:|Killed" | tail -8
    echo "exit ${PIPESTATUS[0]}"
  fi
fi
dmesg 2>/dev/null | grep -iE "out of memory|killed process" | tail -2
python3 - "$OUT/nvme_gpt.json" <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
print(f"{'model':<16} {'params':>7} {'host L':>6} {'tok/s':>7} {'step s':>6} {'init s':>6} {'RSS peak':>8} {'init RSS':>8} "
      f"{'disk GiB':>8} {'upd GB/s':>8} {'upd s':>6} {'dev GiB':>7}")
for r in rows:
    print(f"{r['model']:<16} {r['n_params']/1e9:>6.2f}B {r.get('host_layers') or 0:>6} {r['tokens_per_s']:>7.0f} {r['step_s']:>6.1f} "
          f"{r['init_s']:>6.0f} {r['peak_rss_gib']:>8.1f} {r.get('init_peak_rss_gib', 0):>8.1f} {r['disk_gib']:>8.1f} "
          f"{r.get('swap_GBps_in_update', 0):>8.2f} {r.get('update_io_s', 0):>6.1f} {r['peak_gib']:>7.1f}")
PY
