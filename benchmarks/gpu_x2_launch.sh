#!/usr/bin/env bash
# Two H200s: 2 processes x 1 GPU through `zerojax launch --proc_per_gpu` against 1 process x 2
# GPUs, GPT-2 Large, ZeRO-2 and ZeRO-3 (configs/zero{2,3}_bf16.json), micro-batch 8, full remat,
# bf16. Same losses step by step (csv_monitor) and tokens/s per GPU. Four runs of ~1 minute each
# (each capped at 200 s), so the whole script stays well under 9 minutes. Results land in $OUT.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-40}
ARGS="--model large --steps $STEPS --micro-batch 8 --remat full --seq-len 1024 --eval-batches 0"
for stage in 2 3; do
  for layout in one_process two_processes; do
    name="zero${stage}_${layout}"
    python3 - "configs/zero${stage}_bf16.json" "$OUT/$name.json" "$OUT/logs" "$name" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["csv_monitor"] = {"enabled": True, "output_path": sys.argv[3], "job_name": sys.argv[4]}
json.dump(cfg, open(sys.argv[2], "w"))
EOF
    rm -rf "$OUT/logs/$name"
    if [ "$layout" = one_process ]; then
      timeout 200 python3 examples/gpt2_large.py --config "$OUT/$name.json" $ARGS > "$OUT/$name.log" 2>&1
    else
      timeout 200 python3 -m zerojax.launch --proc_per_gpu --master_port $((29500 + stage)) \
        examples/gpt2_large.py --config "$OUT/$name.json" $ARGS > "$OUT/$name.log" 2>&1
    fi
    echo "$name: exit $?"
  done
done
python3 - "$OUT" <<'EOF'
import csv, json, os, re, sys
out = sys.argv[1]
def summary(name):
    text = open(os.path.join(out, f"{name}.log")).read()
    m = re.findall(r"^(?:\[0\] )?SUMMARY (.*)$", text, re.M)
    return json.loads(m[-1]) if m else {}
def losses(name):
    path = os.path.join(out, "logs", name, "Train_Samples_train_loss.csv")
    if not os.path.exists(path):
        return {}
    return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(open(path))}
rows = []
print(f"{'stage':>5} {'layout':24} {'tok/s/GPU':>10} {'first loss':>10} {'last loss':>10} {'max rel diff':>12}")
for stage in (2, 3):
    ref = losses(f"zero{stage}_one_process")
    for layout, label in (("one_process", "1 process x 2 GPUs"), ("two_processes", "2 processes x 1 GPU")):
        name = f"zero{stage}_{layout}"
        s, l = summary(name), losses(name)
        common = sorted(set(ref) & set(l))
        diff = max((abs(l[k] - ref[k]) / abs(ref[k]) for k in common), default=float("nan"))
        rows.append({**s, "stage": stage, "layout": label, "steps_compared": len(common), "max_rel_loss_diff": diff})
        print(f"{stage:>5} {label:24} {s.get('tokens_per_s_per_device', 0):>10} "
              f"{s.get('first_loss', float('nan')):>10.4f} {s.get('last_loss', float('nan')):>10.4f} {diff:>12.2e}")
json.dump(rows, open(os.path.join(out, "launch_2xh200.json"), "w"), indent=1)
EOF
