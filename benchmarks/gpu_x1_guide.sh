#!/usr/bin/env bash
# Issue #13's user case on one H200 capped to 24 GB (XLA_PYTHON_CLIENT_MEM_FRACTION=0.17): GPT-2
# Large with the guide's own config (configs/oom_guide_zero2_offload.json, fp16 "auto") through the
# example with --micro-batch auto and no other flag. Prints the plan chosen, the time from start
# to the first step done, tokens/s; then the planner's top three plans with predicted tokens/s
# (zerojax estimate --json) and each of them run for a few steps, measured. About 7 minutes.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.17
GUIDE=configs/oom_guide_zero2_offload.json
STEPS=${STEPS:-20}
DEADLINE=${DEADLINE:-440}  # seconds: plans not started by then are skipped (whole run < 8 min)

# the example, timed from the start of the process to the end of its first step
run_example() {  # run_example LABEL ARGS... -> one "GUIDE {json}" line
  local label=$1; shift
  timeout ${RUN_TIMEOUT:-180} python3 - "$label" "$@" <<'PY' 2>&1 | grep -E "^(micro-batch auto|  \(faster|GUIDE|error)"
import json, sys, time
T0 = time.perf_counter()
sys.path[:0] = ["examples", "."]
import jax
import gpt2_large as example
import zerojax.engine as E

first = {}
step = E.Engine.train_step
def timed(self, batch):
    metrics = step(self, batch)
    if not first:
        jax.block_until_ready(metrics)
        first["s"] = round(time.perf_counter() - T0, 1)
    return metrics
E.Engine.train_step = timed
summary = example.main(sys.argv[2:])
keep = ("tokens_per_s_per_device", "mfu", "peak_gib_device0", "stage", "train_batch_size", "remat",
        "precision", "last_loss")
print("GUIDE " + json.dumps({"label": sys.argv[1], "first_step_s": first.get("s"),
                              **{k: summary.get(k) for k in keep}}))
PY
}

echo "== the guide's config, --micro-batch auto (no other flag)"
run_example auto --config $GUIDE --micro-batch auto --steps $STEPS --eval-batches 0 | tee "$OUT/guide_auto.txt"

echo "== the planner's top three (predicted), then each run for $STEPS steps"
timeout 180 python3 -m zerojax.cli estimate --model large --gpus 1 --aot --config $GUIDE \
  --micro-batch auto --max-plans 3 --json "$OUT/guide_plans.json" 2>/dev/null | sed -n '/^Plans under/,$p'
for i in 0 1 2; do
  left=$((DEADLINE - SECONDS))
  if [ $left -lt 60 ]; then echo "plan $((i + 1)): skipped (time)"; continue; fi
  export RUN_TIMEOUT=$left
  python3 - "$i" "$OUT" $GUIDE <<'PY' || continue
import json, sys
i, out, guide = int(sys.argv[1]), sys.argv[2], sys.argv[3]
plans = json.load(open(f"{out}/guide_plans.json")).get("plans", [])
if i >= len(plans):
    sys.exit(1)
sys.path.insert(0, ".")
import hjson
from zerojax.planner import _merge
cfg = _merge(hjson.load(open(guide)), plans[i]["config_patch"])
cfg.pop("train_batch_size", None)  # micro-batch x accumulation decide it
json.dump(cfg, open(f"{out}/guide_plan{i}.json", "w"), indent=1)
print(f"plan {i + 1}: {plans[i]['describe']}")
PY
  run_example "plan$((i + 1))" --config "$OUT/guide_plan$i.json" --steps $STEPS --eval-batches 0 \
    | tee -a "$OUT/guide_plans_measured.txt"
done
