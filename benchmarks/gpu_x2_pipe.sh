#!/usr/bin/env bash
# Two-GPU pipeline session (issue #15): pipe 2 against data-parallel ZeRO-1 on the same global
# batch (32 rows of 1024 tokens a step), bf16, AdamW, GPT-2 Large and XL.
#   benchmarks/gpu_x2_pipe.sh [ab] [large] [xl] [profile] [one]   (no argument: large xl profile,
#   ~8 minutes if entries take s4's 20-30 s; under a 10-minute limit run "large profile", then "xl")
# ab:      the before/after of issue #15's stage loop in under 300 s: Large zero1 mb8x2 vs pipe 2 at 16
#          micro-batches of 2 with a stage's layers unrolled, their weights sliced out of the stage's
#          stack every iteration (EngineOptions.pipeline_stage_loop "unrolled_sliced", session 6's form)
#          and cut once before the loop (the default now), and pipe 2 at 8 of 4 (default)
# large:   zero1 data 2, micro 8 x accum 2, no remat (the target's baseline)
#          pipe 2 at 8 micro-batches of 4, 16 of 2, 32 of 1, and 8 of 2 (16 rows: the bubble fit),
#          no checkpoints (pipeline.activation_checkpoint_interval 0, DeepSpeed's default);
#          pipe 2, 16 of 2 with interval 18 (one checkpoint per stage iteration: the previous
#          session's per-iteration remat, +1 forward of the layers); pipe 2, 16 of 2 with
#          data_types.grad_accum_dtype bf16 (the stages' weight gradients summed over the 16
#          micro-batches in bf16, as the previous session did: the cost of the fp32 default)
# xl:      zero1 micro 8 x 2, with and without per-layer remat; pipe 2 at 16 of 2 and 8 of 4 without
#          checkpoints (the memory guard refuses an entry that would not fit: FAILED WillNotFit),
#          and 16 of 2 with interval 1 (every layer checkpointed, the remat'd zero1's counterpart)
# profile: benchmarks/profile_step.py on Large pipe 2, 16 of 2: kernels bucketed per step
# one:     ONE GPU (under 300 s): benchmarks/pipe_stage_loop_1gpu.py on Large, 16 rows of 1024: the
#          plain model at 2 micro-batches of 8 vs the pipeline's schedule (2 stages on the one device,
#          8 micro-batches of 2) with the weights sliced every iteration ("unrolled_sliced", session
#          6's 425 ms) and cut once (the default): ms per step, peak, bytes written by kind of op
# Columns: tokens/s per GPU, vs the same size's ZeRO-1 (no remat), peak GiB per GPU, matmul TFLOP
# per GPU per step from the compiled step (benchmarks/hlo_flops.py: every loop iteration counted,
# so recomputation, bubble iterations and replicated work show; equal global batches, so ZeRO-1's
# figure is the no-overhead reference), predicted bubble (S-1)/(M+S-1), and the measured bubble's
# bound: at micro-batch 2 the step time is t(M) = alpha M + beta; beta / t(M) is the time no
# micro-batch accounts for (bubble plus per-step fixed cost such as the optimizer). JSON in $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PARTS=" ${*:-large xl profile} "

run() {  # run <name> <matrix json> [seconds for all, default 590]
  timeout "${3:-590}" python3 benchmarks/bench.py --matrix "$2" --steps 6 --warmup 2 --timeout 150 \
      --out "$OUT/pipe_2gpu_$1.json" 2>&1 | grep -E "^ *(large|xl)|FAILED|ceiling|entries"
  table "$OUT/pipe_2gpu_$1.json"
}

table() {
python3 - "$1" <<'PY'
import json, sys
entries = json.load(open(sys.argv[1]))["entries"]
key = lambda s: (s.get("size"), s.get("pipe", 1), s["micro"], s["accum"], s.get("ckpt", 0), bool(s.get("remat")),
                 s.get("grad_accum") or "", (s.get("env") or {}).get("ZEROJAX_PIPELINE_STAGE_LOOP", ""))
rows = {key(e["spec"]): e["result"] for e in entries}
def base(size):
    return rows.get((size, 1, 8, 2, 0, False, "", ""), {})
print(f"{'entry':<28}{'tok/s/GPU':>11}{'vs zero1':>10}{'peak GiB':>10}{'TFLOP/GPU':>11}{'vs zero1':>10}"
      f"{'bubble pred':>13}{'meas <=':>9}")
for (size, pipe, micro, accum, ckpt, remat, gacc, loop), r in rows.items():
    name = (f"{size} {'zero1' if pipe == 1 else 'pipe%d' % pipe} mb{micro}x{accum}" + (f" ckpt{ckpt}" if ckpt else "")
            + (" remat" if remat else "") + (f" acc-{gacc}" if gacc else "") + (f" {loop}" if loop else ""))
    if "error" in r:
        print(f"{name:<28}FAILED {str(r['error'])[:150]}"); continue
    b = base(size)
    tok, flops = r["tokens_per_s_per_device"], r.get("matmul_flops_per_device_step")
    fit = [rows.get((size, pipe, 2, m, ckpt, remat, gacc, loop), {}).get("step_s") for m in (8, 16)]
    meas = "-"
    if pipe > 1 and micro == 2 and None not in fit:
        alpha = (fit[1] - fit[0]) / 8
        meas = f"{(r['step_s'] - alpha * accum) / r['step_s']:.1%}"
    pct = lambda x, y: f"{x / y:.1%}" if x and y else "-"
    pred = r.get("predicted_bubble")
    print(f"{name:<28}{tok:>11,.0f}{pct(tok, b.get('tokens_per_s_per_device')):>10}"
          f"{(r.get('peak_bytes') or 0) / 2**30:>10.2f}{(flops or 0) / 1e12:>11.1f}"
          f"{pct(flops, b.get('matmul_flops_per_device_step')):>10}"
          f"{(f'{pred:.1%}' if pred else '-'):>13}{meas:>9}")
PY
}

SCAN='"env": {"ZEROJAX_PIPELINE_STAGE_LOOP": "scan"}'
SLICED='"env": {"ZEROJAX_PIPELINE_STAGE_LOOP": "unrolled_sliced"}'
if [[ "$PARTS" == *" ab "* ]]; then
  echo "== part ab: Large zero1 vs pipe 2, weights sliced every iteration vs cut once"
  run ab '[
    {"size": "large", "stage": 1, "micro": 8, "accum": 2},
    {"size": "large", "stage": 1, "pipe": 2, "micro": 2, "accum": 16, '"$SLICED"'},
    {"size": "large", "stage": 1, "pipe": 2, "micro": 2, "accum": 16},
    {"size": "large", "stage": 1, "pipe": 2, "micro": 4, "accum": 8}]' 290
fi
if [[ "$PARTS" == *" large "* ]]; then
  run large '[
    {"size": "large", "stage": 1, "micro": 8, "accum": 2},
    {"size": "large", "stage": 1, "pipe": 2, "micro": 4, "accum": 8},
    {"size": "large", "stage": 1, "pipe": 2, "micro": 2, "accum": 16},
    {"size": "large", "stage": 1, "pipe": 2, "micro": 2, "accum": 16, '"$SCAN"'},
    {"size": "large", "stage": 1, "pipe": 2, "micro": 1, "accum": 32},
    {"size": "large", "stage": 1, "pipe": 2, "micro": 2, "accum": 8},
    {"size": "large", "stage": 1, "pipe": 2, "micro": 2, "accum": 16, "ckpt": 18},
    {"size": "large", "stage": 1, "pipe": 2, "micro": 2, "accum": 16, "grad_accum": "bf16"}]'
fi
if [[ "$PARTS" == *" xl "* ]]; then
  run xl '[
    {"size": "xl", "stage": 1, "micro": 8, "accum": 2},
    {"size": "xl", "stage": 1, "micro": 8, "accum": 2, "remat": true},
    {"size": "xl", "stage": 1, "pipe": 2, "micro": 2, "accum": 16},
    {"size": "xl", "stage": 1, "pipe": 2, "micro": 4, "accum": 8},
    {"size": "xl", "stage": 1, "pipe": 2, "micro": 2, "accum": 16, "ckpt": 1}]'
fi
if [[ "$PARTS" == *" one "* ]]; then
  echo "== part one: pipe_stage_loop_1gpu.py, Large"
  timeout 290 python3 benchmarks/pipe_stage_loop_1gpu.py --size large --rows 16 --micro 2 --plain-micro 8 \
      --json "$OUT/pipe_stage_loop_1gpu_large.json" 2>&1 | grep --line-buffered -v "^WARNING\|^I0000\|^E0000\|^W0000"
  echo "== part one: done (rc ${PIPESTATUS[0]})"
fi
if [[ "$PARTS" == *" profile "* ]]; then
  timeout 300 python3 benchmarks/profile_step.py \
      '{"size": "large", "stage": 1, "pipe": 2, "micro": 2, "accum": 16, "remat": false}' \
      --json "$OUT/profile_pipe2_large_mb2x16.json" 2>&1 | grep -v "^/device\|^/host"
fi
