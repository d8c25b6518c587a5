#!/usr/bin/env bash
# Two-GPU pipeline session (issue #15), GPT-2 Large, bf16, 1024 tokens a row, AdamW, ZeRO-1:
#   zero1            data 2: micro 8 x accum 2 x 2 GPUs            = 32 rows a step
#   pipe2 M8  mb4    pipe 2 (data 1): 8 micro-batches of 4 rows    = 32 rows
#   pipe2 M16 mb2    pipe 2: 16 micro-batches of 2 rows            = 32 rows
#   pipe2 M8  mb2    pipe 2: 8 micro-batches of 2 rows (16 rows; for the bubble fit below)
# Per entry: tokens/s per GPU, peak bytes per GPU, the engine's predicted bubble (S-1)/(M+S-1).
# Measured bubble: at micro-batch 2 the step time is t(M) = alpha M + beta; beta / t(M) is the
# time no micro-batch accounts for -- the bubble plus the per-step fixed cost (optimizer update),
# so an upper bound on the measured bubble. No model remat: every pipeline iteration is
# rematerialised by the pipeline itself. Results land in $OUT.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 benchmarks/bench.py --matrix '[
  {"stage": 1, "micro": 8, "accum": 2},
  {"stage": 1, "pipe": 2, "micro": 4, "accum": 8},
  {"stage": 1, "pipe": 2, "micro": 2, "accum": 16},
  {"stage": 1, "pipe": 2, "micro": 2, "accum": 8}]' \
  --steps 6 --warmup 2 --timeout 150 --out "$OUT/pipe_2gpu.json" 2>&1 | grep -E "^large|FAILED|ceiling|entries"
python3 - "$OUT/pipe_2gpu.json" <<'PY'
import json, sys
rows = {(e["spec"].get("pipe", 1), e["spec"]["micro"], e["spec"]["accum"]): e["result"]
        for e in json.load(open(sys.argv[1]))["entries"]}
base = rows.get((1, 8, 2), {}).get("tokens_per_s_per_device")
fit = [rows.get((2, 2, m), {}).get("step_s") for m in (8, 16)]
alpha = (fit[1] - fit[0]) / 8 if None not in fit else None
print(f"{'entry':<18}{'tok/s/GPU':>11}{'vs zero1':>10}{'peak GiB':>10}{'pred bubble':>13}{'meas bubble<=':>15}")
for (pipe, micro, accum), r in rows.items():
    if "error" in r:
        print(f"pipe{pipe} mb{micro}x{accum}: FAILED {r['error']}"); continue
    tok = r["tokens_per_s_per_device"]
    meas = "-"
    if pipe > 1 and micro == 2 and alpha is not None:
        meas = f"{(r['step_s'] - alpha * accum) / r['step_s']:.1%}"
    pred = r.get("predicted_bubble")
    print(f"{'pipe%d mb%dx%d' % (pipe, micro, accum):<18}{tok:>11,.0f}"
          f"{(f'{tok / base:.1%}' if base else '-'):>10}{(r.get('peak_bytes') or 0) / 2**30:>10.2f}"
          f"{(f'{pred:.1%}' if pred is not None else '-'):>13}{meas:>15}")
PY
