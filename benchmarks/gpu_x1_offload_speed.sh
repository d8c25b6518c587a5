#!/usr/bin/env bash
# Issue #18 item 3 (full optimizer offload >= 35k tokens/s): GPT-2 Large, seq 1024, micro 8, bf16,
# remat, ZeRO-2 + offload_optimizer cpu on 1 x H200 under a 24 GB cap
# (XLA_PYTHON_CLIENT_MEM_FRACTION=0.17): one bench.py run (one ceiling measurement), one child
# process per variant (its own peak). A variant is "name|ZEROJAX_* settings (space-separated)|
# extra XLA flags (space-separated)":
#   default        the in-place layer loop (offload_loop="in_place")
#   host           EngineOptions.offload_loop="host": host chunks of layers updated after the
#                  step's jit from Python (offload/host_loop.py; session 9: +16%; session 10, with
#                  the first 2 chunks read during the jit and 3 write-backs beside the next one
#                  (offload_host_prefetch / offload_host_window, the defaults): 24.2k)
#                  (session 11, the defaults now: layer groups of offload_host_chunk_bytes, 4 layers
#                  for GPT-2 Large, and the split master with bf16: 32.2k at 9.6 GiB)
#   host_mubf16    host with adam_mu_dtype=bfloat16 (8 bytes a parameter each way with the split
#                  master): 36.3k at 8.5 GiB (session 11)
#   mubf16         adam_mu_dtype=bfloat16
# (sessions 5-6 also ran "paired": ZEROJAX_OFFLOAD_LOOP=paired, slower than the default)
# An optional fourth field is JSON merged into the bench.py entry, e.g. {"loss_chunk": 256} (the
# fused cross entropy: ~1.4 GiB less at micro 8, room for more chunks in flight).
# `gpu_x1_offload_speed.sh s11` (prepared in session 10, run in session 11; BUDGET=300): the fused loss
# with the last chunks prefetched too (offload_host_prefetch_last) or a deeper prefetch / window,
# and the master split (offload_master_split: 8 bytes a parameter each way instead of 10).
# VARIANTS (newline-separated) replaces the list, BENCH the bench.py command (a CPU smoke test);
# BUDGET (seconds, default 190): the variants kept are those that fit at PER seconds each (default
# 40) after 20 for the ceiling, and bench.py is stopped at BUDGET. Prints a table: tokens/s, step,
# peak, and the host<->device GB/s each way (12 or 10 bytes a parameter each way / step time)
# against the link's measured 51-55 GB/s; JSON to $OUT.
#   OUT=/tmp/o bash benchmarks/gpu_x1_offload_speed.sh
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-190}; PER=${PER:-40}
B=${BENCH:-"python3 benchmarks/bench.py --sizes large --micro 8 --mem-fraction 0.17 --steps 4 --warmup 2"}
VARIANTS=${VARIANTS:-"default||
host|ZEROJAX_OFFLOAD_LOOP=host|
host_mubf16|ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_ADAM_MU_DTYPE=bfloat16|
mubf16|ZEROJAX_ADAM_MU_DTYPE=bfloat16|"}
M4="ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_OFFLOAD_CHUNKS=9 ZEROJAX_ADAM_MU_DTYPE=bfloat16"
VARIANTS_S11="c9mu|$M4||
c9mu_ce|$M4||{\"loss_chunk\": 256}
c9mu_ce_last2|$M4 ZEROJAX_OFFLOAD_HOST_PREFETCH_LAST=2||{\"loss_chunk\": 256}
c9mu_ce_p3w4|$M4 ZEROJAX_OFFLOAD_HOST_PREFETCH=3 ZEROJAX_OFFLOAD_HOST_WINDOW=4||{\"loss_chunk\": 256}
c9mu_ce_last1w4|$M4 ZEROJAX_OFFLOAD_HOST_PREFETCH_LAST=1 ZEROJAX_OFFLOAD_HOST_WINDOW=4||{\"loss_chunk\": 256}
c9mu_split|$M4 ZEROJAX_OFFLOAD_MASTER_SPLIT=1|
c9mu_ce_split_last2|$M4 ZEROJAX_OFFLOAD_MASTER_SPLIT=1 ZEROJAX_OFFLOAD_HOST_PREFETCH_LAST=2||{\"loss_chunk\": 256}"
# s11b (session 11, after s11 showed the split master at 36.1k / 8.71 GiB): the split master beside
# the default in one run, with the last chunk(s) prefetched, the fused loss, 3- and 6-layer chunks,
# and the fp32 first moment (10 bytes a parameter each way, Adam's moments exact)
VARIANTS_S11B="default||
c9mu_split|$M4 ZEROJAX_OFFLOAD_MASTER_SPLIT=1|
c9mu_split_last1|$M4 ZEROJAX_OFFLOAD_MASTER_SPLIT=1 ZEROJAX_OFFLOAD_HOST_PREFETCH_LAST=1|
c9mu_ce_split_last1|$M4 ZEROJAX_OFFLOAD_MASTER_SPLIT=1 ZEROJAX_OFFLOAD_HOST_PREFETCH_LAST=1||{\"loss_chunk\": 256}
c9mu_ce_split|$M4 ZEROJAX_OFFLOAD_MASTER_SPLIT=1||{\"loss_chunk\": 256}
c12mu_split|ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_OFFLOAD_CHUNKS=12 ZEROJAX_ADAM_MU_DTYPE=bfloat16 ZEROJAX_OFFLOAD_MASTER_SPLIT=1|
c6mu_split|ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_OFFLOAD_CHUNKS=6 ZEROJAX_ADAM_MU_DTYPE=bfloat16 ZEROJAX_OFFLOAD_MASTER_SPLIT=1|
c9_split|ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_OFFLOAD_CHUNKS=9 ZEROJAX_OFFLOAD_MASTER_SPLIT=1|"
# s11c: the fastest under 10 GiB in s11b again, and the same with the fp32 first moment (Adam's
# moments exact; 10 bytes a parameter each way)
VARIANTS_S11C="c9mu_split_last1|$M4 ZEROJAX_OFFLOAD_MASTER_SPLIT=1 ZEROJAX_OFFLOAD_HOST_PREFETCH_LAST=1|
c9_split_last1|ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_OFFLOAD_CHUNKS=9 ZEROJAX_OFFLOAD_MASTER_SPLIT=1 ZEROJAX_OFFLOAD_HOST_PREFETCH_LAST=1|
c9_ce_split_last1|ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_OFFLOAD_CHUNKS=9 ZEROJAX_OFFLOAD_MASTER_SPLIT=1 ZEROJAX_OFFLOAD_HOST_PREFETCH_LAST=1||{\"loss_chunk\": 256}"
# s11d: the defaults since session 11 (offload_loop="host" alone: layer groups of >= 256 MiB of
# master, the split master with bf16), with the bf16 first moment, beside in_place; and on GPT-2 XL
# (48 layers of 123 MB: 3 a group)
VARIANTS_S11D="default||
host|ZEROJAX_OFFLOAD_LOOP=host|
host_mubf16|ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_ADAM_MU_DTYPE=bfloat16|
host_mubf16_last1|ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_ADAM_MU_DTYPE=bfloat16 ZEROJAX_OFFLOAD_HOST_PREFETCH_LAST=1|
xl_default|||{\"size\": \"xl\"}
xl_host|ZEROJAX_OFFLOAD_LOOP=host||{\"size\": \"xl\"}
xl_host_mubf16|ZEROJAX_OFFLOAD_LOOP=host ZEROJAX_ADAM_MU_DTYPE=bfloat16||{\"size\": \"xl\"}"
[ "${1:-}" = s11 ] && VARIANTS=$VARIANTS_S11
[ "${1:-}" = s11d ] && VARIANTS=$VARIANTS_S11D
[ "${1:-}" = s11c ] && VARIANTS=$VARIANTS_S11C
[ "${1:-}" = s11b ] && VARIANTS=$VARIANTS_S11B
SPEC=$(python3 - "$BUDGET" "$PER" "$VARIANTS" <<'PYEOF'
import json, sys
budget, per, variants = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
specs = []
for line in variants.splitlines():
    if not line.strip():
        continue
    name, env, flags, extra = (line.split("|", 3) + ["", "", ""])[:4]
    env = dict(kv.split("=", 1) for kv in env.split())
    if flags.strip():
        env["XLA_FLAGS"] = flags.strip()
    specs.append({"label": name, "env": env, "stage": 2, "offload": "optimizer", "remat": True,
                  **(json.loads(extra) if extra.strip() else {})})
keep = max(1, int((budget - 20) // per))
print(json.dumps(specs[:keep]))
PYEOF
)
echo "variants: $(python3 -c "import json,sys; print(' '.join(s['label'] for s in json.loads(sys.argv[1])))" "$SPEC")"
timeout "$BUDGET" $B --matrix "$SPEC" --timeout $(( BUDGET - 25 )) --out "$OUT/offspeed.json" > "$OUT/offspeed.log" 2>&1
rc=$?
grep -E "^  [a-z]" "$OUT/offspeed.log"
[ -f "$OUT/offspeed.json" ] || { echo "-- bench.py left no JSON (rc $rc); log tail:"; tail -12 "$OUT/offspeed.log"; }

python3 - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
try:
    entries = json.load(open(os.path.join(out, "offspeed.json")))["entries"]
except (OSError, KeyError, ValueError):
    sys.exit(0)
rows = []
for e in entries:
    res, spec = e["result"], e["spec"]
    env = spec.get("env") or {}
    row = {"name": spec.get("label"), "env": env,
           "extra": f", loss_chunk {spec['loss_chunk']}" if spec.get("loss_chunk") else "",
           **{k: res.get(k) for k in ("tokens_per_s_per_device", "step_s", "peak_bytes", "params", "error")}}
    if res.get("step_s") and res.get("params"):
        # fp32 master (or its 16-bit remainder) + Adam's two moments (fp32, or the first in bf16) cross PCIe each way
        settings = res.get("offload_settings") or {}  # the engine's own (split master by default since s11)
        split = settings.get("split_master", env.get("ZEROJAX_OFFLOAD_MASTER_SPLIT") in ("1", "true"))
        row["chunks"] = settings.get("chunks")
        row["bytes_each_way"] = ((10 if env.get("ZEROJAX_ADAM_MU_DTYPE") == "bfloat16" else 12)
                                 - (2 if split else 0)) * res["params"]
        row["gbps_each_way"] = row["bytes_each_way"] / res["step_s"] / 1e9
    rows.append(row)
print("\n| variant | groups | tokens/s | step ms | peak GiB | host<->device GB/s each way (link 51-55) |\n|---|---:|---:|---:|---:|---:|")
for r in rows:
    label = f"{r['name']} ({' '.join(f'{k}={v}' for k, v in r['env'].items()) or 'defaults'}{r['extra']})"
    if r.get("tokens_per_s_per_device"):
        print(f"| {label} | {r.get('chunks')} | {r['tokens_per_s_per_device']:,.0f} | {r['step_s'] * 1e3:.0f} "
              f"| {(r['peak_bytes'] or 0) / 2**30:.2f} | {r.get('gbps_each_way', 0):.1f} |")
    else:
        print(f"| {label} | | failed: {str(r.get('error'))[:80]} | | | |")
json.dump({"rows": rows}, open(os.path.join(out, "offspeed_summary.json"), "w"), indent=1)
PYEOF
