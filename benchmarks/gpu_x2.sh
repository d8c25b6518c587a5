#!/usr/bin/env bash
# Two GPUs of one host, GPT-2 Large, seq 1024, bf16 (~10 minutes in all; PARTS selects, default
# "zero tensor pipe launch"):
#   zero:   plain jax.jit and ZeRO stages 1-3, micro 8, with and without per-layer remat
#   tensor: TP 2 (tensor_parallel.autotp_size 2, one data rank) beside ZeRO-2 / ZeRO-3, no remat
#   pipe:   pipe 2 (ZeRO-1) at 16 micro-batches of 2 and 8 of 4, and with
#           activation_checkpoint_interval 18, beside ZeRO-1 on the same 32 rows
#   launch: the example under `zerojax launch` (2 processes x 1 GPU) against 1 process x 2 GPUs,
#           ZeRO-2 and ZeRO-3, 40 steps; the losses compared step by step
#   PYTHONPATH=. bash benchmarks/gpu_x2.sh [zero] [tensor] [pipe] [launch]
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
PARTS=" ${*:-zero tensor pipe launch} "
B="$PY benchmarks/bench.py --steps 6 --warmup 2 --timeout 150"
show() { grep -E "^ *large|FAILED|ceiling|entries"; }
if [[ $PARTS == *" zero "* ]]; then
  $B --matrix custom --stages plain,1,2,3 --remat on,off --out "$OUT/x2_zero.json" 2>&1 | show
fi
if [[ $PARTS == *" tensor "* ]]; then
  $B --out "$OUT/x2_tensor.json" --matrix '[{"stage": 2}, {"stage": 3}, {"stage": 0, "tp": 2}]' 2>&1 | show
fi
if [[ $PARTS == *" pipe "* ]]; then
  $B --out "$OUT/x2_pipe.json" --matrix '[
    {"stage": 1, "micro": 8, "accum": 2},
    {"stage": 1, "pipe": 2, "micro": 2, "accum": 16},
    {"stage": 1, "pipe": 2, "micro": 2, "accum": 16, "ckpt": 18},
    {"stage": 1, "pipe": 2, "micro": 4, "accum": 8}]' 2>&1 | show
fi
if [[ $PARTS == *" launch "* ]]; then
  ARGS="--model large --steps ${STEPS:-40} --micro-batch 8 --remat full --seq-len 1024 --eval-batches 0"
  for stage in 2 3; do
    for procs in 1 2; do
      name="zero${stage}_procs${procs}"
      $PY - "configs/zero${stage}_bf16.json" "$OUT/$name.json" "$OUT/logs" "$name" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["csv_monitor"] = {"enabled": True, "output_path": sys.argv[3], "job_name": sys.argv[4]}
json.dump(cfg, open(sys.argv[2], "w"))
PY
      rm -rf "$OUT/logs/$name"
      if [ "$procs" = 1 ]; then
        timeout 200 $PY examples/gpt2_large.py --config "$OUT/$name.json" $ARGS > "$OUT/$name.log" 2>&1
      else
        timeout 200 $PY -m zerojax.cli launch --proc_per_gpu --master_port $((29500 + stage)) \
          examples/gpt2_large.py --config "$OUT/$name.json" $ARGS > "$OUT/$name.log" 2>&1
      fi
      echo "$name: exit $?"
    done
  done
  $PY - "$OUT" <<'PY'
import csv, json, os, re, sys
out = sys.argv[1]
def summary(name):
    m = re.findall(r"^(?:\[0\] )?SUMMARY (.*)$", open(os.path.join(out, f"{name}.log")).read(), re.M)
    return json.loads(m[-1]) if m else {}
def losses(name):
    path = os.path.join(out, "logs", name, "Train_Samples_train_loss.csv")
    return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(open(path))} if os.path.exists(path) else {}
print(f"{'stage':>5} {'processes x GPUs':18} {'tok/s/GPU':>10} {'last loss':>10} {'max rel diff':>12}")
for stage in (2, 3):
    ref = losses(f"zero{stage}_procs1")
    for procs, label in ((1, "1 x 2"), (2, "2 x 1")):
        s, l = summary(f"zero{stage}_procs{procs}"), losses(f"zero{stage}_procs{procs}")
        diff = max((abs(l[k] - ref[k]) / abs(ref[k]) for k in set(ref) & set(l)), default=float("nan"))
        print(f"{stage:>5} {label:18} {s.get('tokens_per_s_per_device', 0):>10} "
              f"{s.get('last_loss', float('nan')):>10.4f} {diff:>12.2e}")
PY
fi
