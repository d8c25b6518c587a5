#!/usr/bin/env bash
# A reward model (DeepSpeed-Chat's step 2) on Llama-3.2-1B's shape (random-init weights, no hub),
# full fine-tune, bf16, ZeRO-2, through `zerojax train --method reward` on a toy preference set that
# a model can learn in a few dozen steps: each pair's chosen completion is lower-case letters, its
# rejected one the same letters upper-case (byte-level tokenizer: one token a character; id 0, which
# the data never uses, is the pad that marks each sequence's end). Prints the log lines (loss,
# rewards/accuracies and margins rising) and one JSON line: tokens/s per device (chosen + rejected
# rows), the first and last loss and accuracy, the device peak.
#   PYTHONPATH=. bash benchmarks/gpu_reward_1b.sh           # results in $OUT (default benchmarks/results/)
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_reward_1b.sh   # CPU, tiny-llama
set -u
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
if [ -n "${SMOKE:-}" ]; then
  M="--model tiny-llama --seq-len 64 --micro-batch 8 --steps 12"; HALF=24; export JAX_PLATFORMS=cpu
else
  M="--model llama-3.2-1b --seq-len 1024 --micro-batch 8 --steps ${STEPS:-40}"; HALF=500
fi
DATA="$OUT/reward-pairs.jsonl"
$PY - "$DATA" "$HALF" <<'PY'
import json, random, sys
path, half = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
low = "abcdefghijklmnopqrstuvwxyz "
with open(path, "w") as f:
    for _ in range(1024):
        chosen = "".join(rng.choices(low, k=half))
        f.write(json.dumps({"prompt": "".join(rng.choices(low, k=half)), "chosen": chosen,
                            "rejected": chosen.upper()}) + "\n")
PY
timeout "${RUN_TIMEOUT:-300}" $PY -m zerojax.cli train $M --method reward --method-option pad_token_id=0 \
    --data "$DATA" --lr 5e-5 --eval-batches 0 --summary-json "$OUT/reward-1b-summary.json" 2>&1 \
    | tee "$OUT/reward-1b.log" | grep -E "^step [0-9]+/|^device memory|error|Error|^trained" | cut -c1-300
$PY - "$OUT/reward-1b-summary.json" "$OUT/reward-1b.log" <<'PY'
import json, re, sys
s = json.load(open(sys.argv[1]))
acc = [float(a) for a in re.findall(r"rewards/accuracies ([\d.]+)", open(sys.argv[2]).read())]
print(json.dumps({"framework": "zerojax", "run": f"reward model {s['model']} full fine-tune", "seq_len": s["seq_len"],
                  "pairs_per_step": s["train_batch_size"], "steps": s["steps"],
                  "tokens_per_s": s.get("tokens_per_s_per_device"), "peak_gib": s.get("peak_gib_device0"),
                  "first_loss": s["first_loss"], "last_loss": s["last_loss"],
                  "accuracies_logged": acc, "last_accuracy": s.get("method_metrics", {}).get("rewards/accuracies")}))
PY
