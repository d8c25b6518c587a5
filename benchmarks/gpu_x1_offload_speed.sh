#!/usr/bin/env bash
# Issue #18 item 3 (full optimizer offload >= 35k tokens/s): GPT-2 Large, seq 1024, micro 8, bf16,
# remat, ZeRO-2 + offload_optimizer cpu on 1 x H200 under a 24 GB cap
# (XLA_PYTHON_CLIENT_MEM_FRACTION=0.17), one bench.py process per variant (its own peak).
# A variant is "name|ZEROJAX_* settings (space-separated)|extra XLA flags (space-separated)":
#   paired         EngineOptions.offload_loop="paired": one host chunk per layer, read whole, each
#                  read issued beside the previous layer's write-back (d2h_loop_probe.py "gated")
#   default        the in-place layer loop (offload_loop="in_place")
#   paired_mubf16  paired + adam_mu_dtype=bfloat16 (10 bytes a parameter each way instead of 12)
#   mubf16         adam_mu_dtype=bfloat16
# VARIANTS (newline-separated) replaces the list, BENCH the bench.py command (a CPU smoke test); BUDGET (seconds, default 190) stops before a
# variant that cannot finish (about 45 s each; 40 s are left to the last one). Prints a table: tokens/s, step, peak, and the
# host<->device GB/s each way (12 or 10 bytes a parameter each way / step time) against the
# link's measured 51-55 GB/s; JSON to $OUT.
#   OUT=/tmp/o bash benchmarks/gpu_x1_offload_speed.sh
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-190}
B=${BENCH:-"python3 benchmarks/bench.py --matrix custom --sizes large --remat on --micro 8 --stages 2 --offload optimizer --mem-fraction 0.17 --steps 4 --warmup 2"}
VARIANTS=${VARIANTS:-"paired|ZEROJAX_OFFLOAD_LOOP=paired|
default||
paired_mubf16|ZEROJAX_OFFLOAD_LOOP=paired ZEROJAX_ADAM_MU_DTYPE=bfloat16|
mubf16|ZEROJAX_ADAM_MU_DTYPE=bfloat16|"}
start=$(date +%s)
names=""
while IFS='|' read -r name vars flags; do
  [ -n "$name" ] || continue
  left=$(( BUDGET - ($(date +%s) - start) ))
  if [ "$left" -lt 40 ]; then echo "== $name: skipped (${left} s left)"; continue; fi
  names="$names $name"
  echo "== $name ${vars:-(defaults)} ${flags}"
  xla=${XLA_FLAGS:-}; [ -n "$flags" ] && xla="$xla $flags"
  # bench.py's own --timeout stops its children; its whole output goes to a log, the tail shown
  # when it printed no result line
  env $vars ${xla:+XLA_FLAGS="$xla"} $B --timeout $(( left - 10 )) --out "$OUT/offspeed_$name.json" \
    > "$OUT/offspeed_$name.log" 2>&1
  grep -E "^  large|FAILED" "$OUT/offspeed_$name.log" | head -3
  [ -f "$OUT/offspeed_$name.json" ] || { echo "-- no result; log tail:"; tail -8 "$OUT/offspeed_$name.log"; }
  echo "$name|$vars|$flags" >> "$OUT/offspeed_variants.txt"
done <<< "$VARIANTS"

python3 - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
rows = []
for line in open(os.path.join(out, "offspeed_variants.txt")).read().splitlines():
    name, env, flags = line.split("|")
    try:
        res = json.load(open(os.path.join(out, f"offspeed_{name}.json")))["entries"][0]["result"]
    except (OSError, KeyError, IndexError, ValueError) as e:
        res = {"error": f"no result ({e})"}
    row = {"name": name, "env": env, "flags": flags,
           **{k: res.get(k) for k in ("tokens_per_s_per_device", "step_s", "peak_bytes", "params", "error")}}
    if res.get("step_s") and res.get("params"):
        # fp32 master + Adam's two moments (fp32, or the first in bf16) cross PCIe each way every step
        row["bytes_each_way"] = (10 if "ADAM_MU_DTYPE=bfloat16" in env else 12) * res["params"]
        row["gbps_each_way"] = row["bytes_each_way"] / res["step_s"] / 1e9
    rows.append(row)
print("\n| variant | tokens/s | step ms | peak GiB | host<->device GB/s each way (link 51-55) |\n|---|---:|---:|---:|---:|")
for r in rows:
    label = f"{r['name']} ({' '.join(x for x in (r['env'], r['flags']) if x) or 'defaults'})"
    if r.get("tokens_per_s_per_device"):
        print(f"| {label} | {r['tokens_per_s_per_device']:,.0f} | {r['step_s'] * 1e3:.0f} "
              f"| {(r['peak_bytes'] or 0) / 2**30:.2f} | {r.get('gbps_each_way', 0):.1f} |")
    else:
        print(f"| {label} | failed: {str(r.get('error'))[:80]} | | | |")
json.dump({"rows": rows}, open(os.path.join(out, "offspeed_summary.json"), "w"), indent=1)
PYEOF
