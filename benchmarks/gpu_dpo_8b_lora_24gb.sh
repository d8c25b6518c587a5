#!/usr/bin/env bash
# DPO on Llama-3.1-8B's shape with LoRA (r 16, alpha 32, all linear layers, bf16 base, random-init
# weights, no hub) on one GPU capped at 24 GB, seq 2048 pairs: zerojax (`zerojax train --method dpo`,
# the reference = the base with the adapters off, full remat) beside the PyTorch + PEFT anchor
# (benchmarks/dpo_bench_torch.py: the same loss, gradient checkpointing, the reference through
# `disable_adapter()`), each under the same cap (benchmarks/cap24.sh: XLA_PYTHON_CLIENT_MEM_FRACTION
# for JAX, torch.cuda.set_per_process_memory_fraction for torch: 23.77 GiB of the card).
#
# The same work a step on both sides: MICRO x ACCUM preference pairs (default 1 x 8 = 8 pairs; a pair
# is a chosen and a rejected row of 2048 tokens sharing their 1024-token prompt, only the 1024
# completion tokens scored), one optimizer step. zerojax's DPO reader counts train_batch_size in
# pairs (zerojax.data.preference: each pair gives one row in "chosen_ids" and one in
# "rejected_ids"), so --micro-batch MICRO --grad-accum ACCUM trains MICRO x ACCUM pairs = 2 x that
# many rows a step; the anchor runs --pairs MICRO*ACCUM --micro MICRO (TORCH_MICRO overrides its
# micro-batch; the step's pairs stay the same).
#
# tokens/s counts the same on both sides: pairs a step x 2 rows (chosen + rejected) x 2048 tokens
# (the prompt's and the completion's, the tokens every forward runs) per second of training.
# zerojax: the SUMMARY's tokens_per_s_per_device (one device; zerojax.train.monitor.SpeedMeter:
# train_batch_size x the chosen and rejected rows' tokens, the steps that compiled excluded, so
# STEPS - 1 measured steps; the JSON's steps_run counts the compiling one too; the run header's
# "tokens/step" is the same count). torch: the same count over STEPS - 1
# steps after one warm-up step. The rows fill the 2048 tokens exactly (no padding): the .jsonl
# written here has ASCII prompts and completions of 1024 characters, and the byte-level tokenizer
# (no --tokenizer) makes one token of each character and adds no BOS / EOS; the script checks the
# rows through zerojax's reader before training. peak: the allocator's peak over the whole run
# (building included) on both sides. first_loss: ln 2 on both (LoRA's B starts at 0).
#
#   PYTHONPATH=. bash benchmarks/gpu_dpo_8b_lora_24gb.sh          # results in $OUT (default benchmarks/results/)
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_dpo_8b_lora_24gb.sh  # CPU, tiny-llama, seq 64, no cap
#   PART=zerojax|torch: one side only (the ratio is printed once both JSON files are in $OUT)
#   STEPS (6), MICRO (1), ACCUM (8), TORCH_MICRO, ZJ_TIMEOUT (330 s), TORCH_TIMEOUT (210 s)
set -u
. "$(dirname "$0")/cap24.sh"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
PART=${PART:-both}
if [ -n "${SMOKE:-}" ]; then
  MODEL=tiny-llama; TORCH_MODEL="--tiny"; SEQ=64; MICRO=${MICRO:-2}; ACCUM=${ACCUM:-2}; STEPS=${STEPS:-4}
  DEVICE=cpu; export JAX_PLATFORMS=cpu
else
  MODEL=llama-3.1-8b; TORCH_MODEL="--model llama-3.1-8b --cap-24gb"; SEQ=2048; MICRO=${MICRO:-1}
  ACCUM=${ACCUM:-8}; STEPS=${STEPS:-6}
  DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  export XLA_PYTHON_CLIENT_MEM_FRACTION=$(cap24)
fi
PAIRS=$((MICRO * ACCUM))
DATA="$OUT/dpo-pairs-$SEQ.jsonl"
ZJ_JSON="$OUT/dpo-8b-lora-zerojax.json"; TORCH_JSON="$OUT/dpo-8b-lora-torch.json"

# 64 pairs (more than one step's; the trainer holds whole batches of ~5% out for validation and
# cycles through the rest), each row exactly SEQ byte tokens, checked through zerojax's reader
JAX_PLATFORMS=cpu $PY - "$DATA" "$SEQ" "$PAIRS" <<'PY' || exit 1
import json, random, string, sys
from zerojax.data.preference import load_preference_data
from zerojax.data.rows import ByteTokens
path, seq, pairs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
plen = seq // 2
rng = random.Random(0)
text = lambda n: "".join(rng.choices(string.ascii_letters + string.digits + " .,", k=n))  # noqa: E731
with open(path, "w") as f:
    for _ in range(max(64, 2 * pairs)):
        f.write(json.dumps({"prompt": text(plen), "chosen": text(seq - plen), "rejected": text(seq - plen)}) + "\n")
data = load_preference_data(path, ByteTokens(), seq, pairs)
for side in ("chosen", "rejected"):
    ids, labels = data.arrays[f"{side}_ids"], data.arrays[f"{side}_labels"]
    assert ids.shape[1] == seq and (ids != data.pad_id).all(), f"{side} rows are not {seq} tokens without padding"
    assert ((labels[:, 1:] != -100).sum(1) == seq - plen).all(), f"{side}: not {seq - plen} completion targets a row"
print(f"{path}: {len(ids)} pairs, rows of {seq} tokens ({plen} prompt + {seq - plen} completion), no padding")
PY

if [ "$PART" != torch ]; then
  echo "== zerojax: $MODEL LoRA r16 DPO, $PAIRS pairs a step ($MICRO x $ACCUM), seq $SEQ"
  rm -f "$OUT/dpo-8b-lora-summary.json" "$ZJ_JSON"
  timeout "${ZJ_TIMEOUT:-330}" $PY -m zerojax.cli train --model $MODEL --lora 16 --lora-alpha 32 --method dpo \
      --data "$DATA" --seq-len $SEQ --micro-batch $MICRO --grad-accum $ACCUM --remat full --steps $STEPS \
      --eval-batches 0 --summary-json "$OUT/dpo-8b-lora-summary.json" 2>&1 | tee "$OUT/dpo-8b-lora-zerojax.log" \
      | grep -E "^step [0-9]+/|^device memory|error|Error|^trained" | cut -c1-300
  [ -f "$OUT/dpo-8b-lora-summary.json" ] && $PY - "$OUT/dpo-8b-lora-summary.json" "$DEVICE" > "$ZJ_JSON" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(json.dumps({"framework": "zerojax", "model": s["model"], "seq_len": s["seq_len"],
                  "pairs_per_step": s["train_batch_size"], "steps_run": s["steps"],
                  "tokens_per_s": s.get("tokens_per_s_per_device"), "peak_gib": s.get("peak_gib_device0"),
                  "loss": s["last_loss"], "first_loss": s["first_loss"],
                  "rewards_margins": s.get("method_metrics", {}).get("rewards/margins"), "device": sys.argv[2]}))
PY
fi

if [ "$PART" != zerojax ]; then
  echo "== PyTorch + PEFT: the same pairs a step (micro ${TORCH_MICRO:-$MICRO}), seq $SEQ"
  rm -f "$TORCH_JSON"
  JAX_PLATFORMS=cpu timeout "${TORCH_TIMEOUT:-210}" $PY benchmarks/dpo_bench_torch.py $TORCH_MODEL --seq-len $SEQ \
      --pairs $PAIRS --micro ${TORCH_MICRO:-$MICRO} --steps $((STEPS - 1)) 2>&1 | tee "$OUT/dpo-8b-lora-torch.log" \
      | grep -v -i "warn" | grep -v '^{"framework"'
  grep -h '^{"framework"' "$OUT/dpo-8b-lora-torch.log" > "$TORCH_JSON"
fi

echo "== JSON lines"
$PY - "$ZJ_JSON" "$TORCH_JSON" "${SMOKE:-}" <<'PY'
import json, math, os, sys
runs = {}
for path in sys.argv[1:3]:
    if os.path.exists(path) and os.path.getsize(path):
        r = json.loads(open(path).read().strip().splitlines()[-1])
        runs[r["framework"]] = r
        print(json.dumps(r))
    else:
        print(f"no result in {path} (see the .log beside it)")
if len(runs) == 2:
    z, t = runs["zerojax"], runs["torch"]
    same = all(z[k] == t[k] for k in ("seq_len", "pairs_per_step"))
    ratio = z["tokens_per_s"] / t["tokens_per_s"] if z["tokens_per_s"] and t["tokens_per_s"] else None
    print(json.dumps({"ratio_zerojax_over_torch": round(ratio, 3) if ratio else None, "same_work": same}))
if sys.argv[3]:  # smoke: both first steps start at policy = reference
    for name, r in runs.items():
        ok = abs(r["first_loss"] - math.log(2)) < 1e-5
        print(f"sanity: {name} step-0 DPO loss {r['first_loss']:.6f} {'=' if ok else '!='} ln 2")
PY
