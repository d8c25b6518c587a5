#!/usr/bin/env bash
# Issue #18 item 3 (full optimizer offload >= 35k tokens/s): GPT-2 Large, seq 1024, micro 8, bf16,
# remat, ZeRO-2 + offload_optimizer cpu on 1 x H200 under a 24 GB cap
# (XLA_PYTHON_CLIENT_MEM_FRACTION=0.17). The current default against each EngineOption of the
# streamed update (zerojax/offload/update.py), one bench.py process each (its own peak):
#   default      the "loop" update as measured before (18.4k tokens/s, 0.45 s a step)
#   pieces8      offload_write_pieces=8: the non-layer chunk (wte: 64M of the 774M parameters)
#                written into its donated host buffers in 8 pieces, not into fresh pinned outputs
#   streams2     offload_streams=2: the 36 layers as 2 host chunks of 18, one loop over both
#   mubf16       adam_mu_dtype=bfloat16: Adam's first moment stored in bf16 (10 bytes a parameter
#                each way instead of 12; changes training slightly, default off)
#   all          pieces8 + streams2 + mubf16
# then benchmarks/profile_step.py of the fastest, with its optimised HLO (the copies XLA kept on
# the compute stream are read there: copy-start / async dynamic-slice / dynamic-update-slice on
# S(5) buffers). Prints a table (tokens/s, step, peak, host<->device GB/s each way = 12 bytes per
# parameter (10 with mubf16) moved each way / step time, against the link's measured 51-55 GB/s);
# JSON to $OUT.
# About 6-7 minutes of GPU time (5 x ~60 s + the profile).
#   OUT=/tmp/o bash benchmarks/gpu_x1_offload_speed.sh            # PROFILE=0 skips the profile
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
B="python3 benchmarks/bench.py --matrix custom --sizes large --remat on --micro 8 --stages 2 --offload optimizer --mem-fraction 0.17 --steps 5 --warmup 2 --timeout 150"
VARIANTS="default: pieces8:ZEROJAX_OFFLOAD_WRITE_PIECES=8 streams2:ZEROJAX_OFFLOAD_STREAMS=2 mubf16:ZEROJAX_ADAM_MU_DTYPE=bfloat16 all:ZEROJAX_OFFLOAD_WRITE_PIECES=8,ZEROJAX_OFFLOAD_STREAMS=2,ZEROJAX_ADAM_MU_DTYPE=bfloat16"
for v in $VARIANTS; do
  name=${v%%:*}; vars=${v#*:}
  echo "== $name ${vars:-(defaults)}"
  env ${vars//,/ } $B --out "$OUT/offspeed_$name.json" 2>&1 | grep -E "^large|FAIL|Error"
done

python3 - "$OUT" "$VARIANTS" <<'EOF'
import json, os, sys
out, variants = sys.argv[1], sys.argv[2].split()
rows = []
for v in variants:
    name, env = v.split(":", 1)
    try:
        res = json.load(open(os.path.join(out, f"offspeed_{name}.json")))["entries"][0]["result"]
    except (OSError, KeyError, IndexError, ValueError) as e:
        res = {"error": f"no result ({e})"}
    row = {"name": name, "env": env, **{k: res.get(k) for k in ("tokens_per_s_per_device", "step_s", "peak_bytes", "params", "error")}}
    if res.get("step_s") and res.get("params"):
        # fp32 master + Adam's two moments (fp32, or the first in bf16) cross PCIe each way every step
        row["bytes_each_way"] = (10 if "ADAM_MU_DTYPE=bfloat16" in env else 12) * res["params"]
        row["gbps_each_way"] = row["bytes_each_way"] / res["step_s"] / 1e9
    rows.append(row)
print(f"\n| variant | tokens/s | step ms | peak GiB | host<->device GB/s each way (link 51-55) |\n|---|---:|---:|---:|---:|")
for r in rows:
    if r.get("tokens_per_s_per_device"):
        print(f"| {r['name']} ({r['env'] or 'defaults'}) | {r['tokens_per_s_per_device']:,.0f} | {r['step_s'] * 1e3:.0f} "
              f"| {(r['peak_bytes'] or 0) / 2**30:.2f} | {r.get('gbps_each_way', 0):.1f} |")
    else:
        print(f"| {r['name']} ({r['env'] or 'defaults'}) | failed: {str(r.get('error'))[:80]} | | | |")
ok = [r for r in rows if r.get("tokens_per_s_per_device")]
best = max(ok, key=lambda r: r["tokens_per_s_per_device"]) if ok else None
json.dump({"rows": rows, "best": best and best["name"]}, open(os.path.join(out, "offspeed_summary.json"), "w"), indent=1)
open(os.path.join(out, "offspeed_best_env"), "w").write(best["env"].replace(",", " ") if best else "")
print("best:", best and best["name"])
EOF

if [ "${PROFILE:-1}" = 1 ]; then
  best_env=$(cat "$OUT/offspeed_best_env" 2>/dev/null)
  echo "== profile of the best (${best_env:-defaults}), optimised HLO in $OUT/hlo_best"
  env $best_env XLA_PYTHON_CLIENT_MEM_FRACTION=0.17 \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$OUT/hlo_best --xla_dump_hlo_module_re=.*train_step.* --xla_dump_hlo_as_text" \
    python3 benchmarks/profile_step.py '{"stage": 2, "offload": "optimizer", "remat": true}' --steps 3 --warmup 2 \
      --title "offload ${best_env:-defaults}" --json "$OUT/offspeed_profile_best.json" 2>&1 | grep -vE "^(W|I)[0-9]{4}" | head -60
  # keep the optimised HLO and buffer assignment only (LLVM IR / PTX are large), and count its host transfers
  find "$OUT/hlo_best" -type f ! -name "*after_optimizations.txt" ! -name "*buffer-assignment.txt" -delete 2>/dev/null
  for f in "$OUT"/hlo_best/*train_step*after_optimizations.txt; do
    [ -f "$f" ] || continue
    echo "$(basename "$f"): copy-start $(grep -c 'copy-start(' "$f"), async dynamic-slice $(grep -cE 'dynamic-slice-start|async-start.*dynamic-slice' "$f"), dynamic-update-slice on S(5) $(grep -E 'dynamic-update-slice' "$f" | grep -c 'S(5)'), copies on S(5) $(grep -E '= .*S\(5\).* copy\(' "$f" | wc -l)"
  done
fi

# EXTRA=1 (about 3 more minutes): the update alone without the engine (benchmarks/offload_probe.py),
# the in-place layer loop against one whole-array transfer per layer ("chunked/36": async
# copy-start / copy-done, the kind pcie_probe.py measured overlapping both ways at 51 GB/s) and
# everything at once ("whole"), to tell whether the loop's dynamic slices are what serialises
if [ "${EXTRA:-0}" = 1 ]; then
  python3 benchmarks/offload_probe.py --mem-fraction 0.17 --configs loop/36,chunked/36,whole --steps 3 --warmup 1 2>&1 | grep -E "^(loop|chunked|whole)|FAIL"
  cp "$OUT/offload_probe.json" "$OUT/offspeed_probe.json" 2>/dev/null
fi
