#!/usr/bin/env bash
# Two-GPU session, issue #14: tensor parallelism (tensor_parallel.autotp_size 2: Megatron splits,
# vocab-parallel embedding / LM head, sequence parallelism; data axis 1) against data-parallel
# ZeRO-2 and ZeRO-3, GPT-2 Large and XL, micro-batch 8 per GPU (the global batch is 8 x 2 rows in
# every entry: DeepSpeed's batch rule counts tensor ranks), bf16, remat on and off, the vocabulary
# padded to a multiple of 128 (GPT-2's default now) and one TP row with GPT-2's exact 50257
# ("vocab/1": the embedding stays replicated, the logits gemm unaligned). Then one profile of TP 2
# (benchmarks/profile_step.py: kernels bucketed, collectives included).
# Targets (issue #14): TP 2 within 15% of ZeRO-3's tokens/s per GPU, and a lower peak per GPU than
# ZeRO-2 without remat. Usage: benchmarks/gpu_x2_tp.sh [large|overlap|profile|quick|all] (default
# all; quick: the target rows with and without the collective-matmul flags, one call; each part fits one 10-minute call: large 7 entries, overlap 2, profile 1). "overlap":
# TP 2 on Large again with XLA's collective matmul (windowed einsum: the sequence all-gather /
# reduce-scatter split into steps overlapped with the matmul; flags as in NVIDIA's JAX-Toolbox
# collective-matmul test), to see what the exposed collectives cost. JSON and the table land in $OUT.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PART=${1:-all}

bench() {  # $1: size, $2: matrix, $3: seconds for the whole part, $4: JSON name suffix
  timeout "$3" python3 benchmarks/bench.py --matrix "$2" --sizes "$1" --micro 8 --dtypes bf16 \
      --steps 5 --warmup 2 --timeout 80 --out "$OUT/tp_2gpu_$1${4:-}.json" 2>&1 | grep -E "^$1|FAILED|ceiling|entries"
}

if [[ $PART == large || $PART == all ]]; then
  bench large '[{"stage": 2, "remat": false}, {"stage": 2, "remat": true},
                {"stage": 3, "remat": false}, {"stage": 3, "remat": true},
                {"stage": 0, "tp": 2, "remat": false}, {"stage": 0, "tp": 2, "remat": true},
                {"stage": 0, "tp": 2, "remat": false, "vocab_multiple": 1}]' 560
fi
# GPT-2 XL (25 heads) cannot take TP 2: the head split is refused with a ConfigError naming the
# sizes that work (5, 25), so the xl part is gone; TP on XL needs 5 GPUs.
if [[ $PART == overlap || $PART == all ]]; then
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true" \
    bench large '[{"stage": 0, "tp": 2, "remat": false}, {"stage": 0, "tp": 2, "remat": true}]' 300 _overlap
fi
if [[ $PART == quick ]]; then  # one call: the targets' rows, collective-matmul flags as labelled entries
  W='"env": {"XLA_FLAGS": "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true --xla_gpu_enable_latency_hiding_scheduler=true"}, "label": "wEinsum+LHS"'
  bench large "[{\"stage\": 3, \"remat\": false}, {\"stage\": 0, \"tp\": 2, \"remat\": false},
                {\"stage\": 0, \"tp\": 2, \"remat\": false, $W},
                {\"stage\": 3, \"remat\": true}, {\"stage\": 0, \"tp\": 2, \"remat\": true},
                {\"stage\": 0, \"tp\": 2, \"remat\": true, $W}]" 330
  # GPT-2 XL has 25 heads: TP 2 is refused before any device work (ConfigError naming 5 and 25)
fi
if [[ $PART == profile || $PART == all ]]; then
  timeout 300 python3 benchmarks/profile_step.py '{"stage": 0, "tp": 2, "remat": false}' \
      --json "$OUT/profile_tp2_large.json" 2>&1 | tail -30
fi

# The short table: per size, each entry against ZeRO-3 (same remat) and ZeRO-2 without remat.
python3 - "$OUT" <<'PY'
import glob, json, os, sys
GiB = 2**30
paths = sorted(glob.glob(os.path.join(sys.argv[1], "tp_2gpu_*.json")))
# the ZeRO references of a size, from the runs without extra XLA flags
refs = [e for p in paths if "_overlap" not in p for e in json.load(open(p))["entries"] if "error" not in e["result"]]
for path in paths:
    entries = json.load(open(path))["entries"]
    def find(size, stage, remat):
        for e in refs:
            s = e["spec"]
            if (s["size"], s["stage"], bool(s["remat"]), s.get("tp", 1), s.get("vocab_multiple")) == \
                    (size, stage, remat, 1, None):
                return e["result"]
    print(f"\n{os.path.basename(path)}" + (" (collective matmul XLA flags)" if "_overlap" in path else ""))
    print(f"{'entry':<40}{'tok/s/GPU':>11}{'vs zero3':>10}{'peak GiB':>10}{'MFU':>7}  targets")
    for e in entries:
        r, s = e["result"], e["spec"]
        if "error" in r:
            print(f"{e['name']:<40} FAILED {r['error'][:80]}"); continue
        z3 = (find(s["size"], 3, bool(s["remat"])) or {}).get("tokens_per_s_per_device")
        z2_peak = (find(s["size"], 2, False) or {}).get("peak_bytes")
        tok, peak = r["tokens_per_s_per_device"], r.get("peak_bytes")
        ratio = tok / z3 if z3 else None
        note = ""
        if s.get("tp", 1) > 1:
            note = (f"speed {'ok' if ratio and ratio >= 0.85 else 'MISS'} (>= 85% of zero3)"
                    + (f", peak {'ok' if peak < z2_peak else 'MISS'} (< zero2 no-remat {z2_peak / GiB:.1f})"
                       if peak and z2_peak else ""))
        print(f"{e['name']:<40}{tok:>11,.0f}{(f'{ratio:.1%}' if ratio else '-'):>10}"
              f"{(peak or 0) / GiB:>10.2f}{r.get('mfu', float('nan')):>7.1%}  {note}")
PY
