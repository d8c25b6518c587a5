#!/usr/bin/env bash
# The long-context rows, one GPU, in one call of at most 560 s (or two, by PART=):
#   part 1: Llama-3.2-1B throughput at seq 2048 (MLP untiled) and 32768 (ALST's tiled MLP, 2048 positions a
#     piece): `long_context_bench.py throughput` (ZeRO-2, bf16, full remat, chunked loss, micro 1, ATTENTION1
#     attention, default blockwise, DOCS1 = 4 packed documents a row). Printed for each length: tokens/s x
#     FLOPs/token = achieved TFLOP/s, FLOPs/token being `zerojax estimate`'s "GFLOPs per training token at
#     seq N" (zerojax.planning.estimate.train_flops_per_token: 6N + 12·L·w·T, attention's quadratic term
#     counted); then the ratio 32K / 2K of the achieved FLOP/s (goal: >= 0.90, 32K within 10% of 2K).
#   part 2: Llama-3.1-8B LoRA r16 alpha 32 (bf16 base) under the 24 GB cap (benchmarks/cap24.sh: 23.77 GiB;
#     the same figure as the search's --cap-gib): `long_context_bench.py longest` (remat "offload" then
#     "full" x cuDNN then blockwise attention, one document a row, MLP tile 2048, from 65,536 up to LIMIT2,
#     halving where 65,536 does not fit, then a real step there) beside the PyTorch + PEFT anchor
#     `long_context_torch.py longest` (gradient checkpointing, sdpa flash / memory-efficient, the same cap,
#     4096 doubling until a step runs out of memory, up to LIMIT2); both longest lengths side by side
#     (goal: zerojax >= 65,536). Expected (arithmetic, not measured): the bf16 base (15.0 GiB) and the
#     adapters with their Adam state (~0.5) leave ~8 GiB; "offload" with cuDNN keeps one layer's
#     recomputation, ~4 GiB at 65,536, on the device (the 16 GiB of layer inputs go to the host): 65,536;
#     "full" keeps the layer inputs (256 KiB a token) on the device: 16,384; the anchor (checkpointed layer
#     inputs and Hugging Face's fp32 logits, ~1.5 MB a token): 4,096.
#   part 3: Llama-3.1-8B full fine-tune on the whole card (XLA_PYTHON_CLIENT_MEM_FRACTION 0.95):
#     `long_context_bench.py longest-full`: the fp32 master and Adam m, v in pinned host memory
#     (offload_optimizer cpu, the in_place loop), bf16 compute, ZeRO-2, remat "full" then "offload" x cuDNN
#     then blockwise attention, MLP tile 2048, chunked loss, micro 1, from 65,536 up to LIMIT3 (131,072 where
#     part 3 has >= 400 s, else 65,536), then real steps at the longest that fits the device and the host
#     (the bench's docstring gives the host-memory arithmetic and the lengths expected: 65,536 for both
#     policies). FULL_ARGS adds flags, e.g. FULL_ARGS="--split-master --adam-mu-dtype bfloat16" (8 bytes a
#     parameter on the host instead of 12: 131,072 with "offload" expected to fit).
#
#   PYTHONPATH=. bash benchmarks/gpu_long_context.sh               # all three parts, one call, < 560 s
#   PART=12 PYTHONPATH=. bash benchmarks/gpu_long_context.sh       # two calls: parts 1 and 2 ...
#   PART=3 PYTHONPATH=. bash benchmarks/gpu_long_context.sh        # ... then part 3 with the whole budget
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_long_context.sh       # CPU, tiny shapes, no cap, < 2 min
# Results: JSON lines in $OUT (default benchmarks/results/): long-context-throughput.jsonl,
# long-context-longest-zerojax.jsonl, long-context-longest-torch.jsonl, long-context-longest-full.jsonl
# (each bench's .log and --out .json beside them), and the comparison lines at the end.
#
# Timeouts (seconds; the zerojax benches also get --deadline 10 s under theirs, so that they print a
# {"timed_out": true, "phase": ...} row before `timeout` would kill them silently, and --length-timeout
# PHASE_TIMEOUT (300) for each compile / build / step of parts 2 and 3; the torch anchor has `timeout`
# alone, its rows printed a length at a time). The parts chosen share
# BUDGET (550) in proportion to these estimates for an H100 (all three: exactly these; PART=12: 161 + 275 +
# 113; PART=3: 550); T1, T2, T2_TORCH, T3 override:
#   part 1, 100 s: JAX start ~10 s; per length the 1B build ~4 s and compile ~6 s (models_bench Llama-3.2-1B
#     at seq 2048 on an H100: build 3.4 s, first step 6.3 s, benchmarks/measured/2026-12-03/models.txt), the
#     32K compile taken as ~15 s; 1 warm-up + 4 timed steps: at 2K ~0.05 s each, at 32K 9.2e14 FLOPs run a
#     step (28 GFLOPs a token with the remat and the tile's recompute) at 150-300 TFLOP/s = 3-6 s each,
#     15-30 s: ~70 s in all.
#   part 2, zerojax 170 s: start ~10 s; one abstract compile of the 8B LoRA step at 65,536 ~30 s (the 8B LoRA
#     DPO run compiled and ran 4 steps in 31 s at seq 2048, benchmarks/measured/2026-12-06/dpo-8b-lora-summary.json);
#     build ~20 s; the real step's compile is the probe's program, read back from the persistent
#     compilation cache (JAX_COMPILATION_CACHE_DIR below; checked on CPU: no second compile); a step at
#     65,536 runs ~1.2e16 FLOPs (LoRA: 2N + 2N + the remat's 2N + attention 16·L·w·T) at 300-450 TFLOP/s =
#     27-40 s; two steps ~70 s: ~130 s in all (the timed step is skipped where the deadline would pass).
#   part 2, torch 70 s: start and the 8B build on the GPU ~25 s, the 512 warm-up step, 4096 (~2 s), 8192
#     (Hugging Face's loss makes [T, 128256] logits in bf16, fp32 and their fp32 gradient, ~1.25 MB a token:
#     expected out of memory at 8192 beside the 15 GiB base), ~40 s.
#   part 3, 210 s: start ~10 s; one abstract compile at 65,536 ~40 s ("full" reaching LIMIT3 = 65,536 ends
#     the search); the build writes 96 GB of fp32 master, m and v into pinned host memory, ~60 s; the first
#     step (compile cached) runs 1.38e16 FLOPs at 150-300 TFLOP/s = 46-92 s, plus the optimizer's 96 GB
#     streamed to the device and back, ~5-10 s: ~170-210 s, the timed second step only where time is left.
#     PART=3 alone (550 s, LIMIT3 131,072): 3 compiles ("full" x cuDNN at 65,536 and 131,072, "full" x
#     blockwise at 131,072; the "offload" ones at 131,072 are refused by the host arithmetic before
#     compiling), the build and two steps: ~380 s.
set -u
. "$(dirname "$0")/cap24.sh"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
PART=${PART:-123}
BENCH=benchmarks/long_context_bench.py
# the abstract probe's compiled step is the real engine's: the real step's compile is then a cache read
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/zerojax-long-context-cache}
want() { case "$PART" in *"$1"*) return 0 ;; esac; return 1; }

E1=100; E2=170; E2_TORCH=70; E3=210; BUDGET=${BUDGET:-550}
SUM=0
want 1 && SUM=$((SUM + E1)); want 2 && SUM=$((SUM + E2 + E2_TORCH)); want 3 && SUM=$((SUM + E3))
[ "$SUM" -gt 0 ] || { echo "PART=$PART: name parts 1, 2 and / or 3 (e.g. PART=12)"; exit 2; }
T1=${T1:-$((BUDGET * E1 / SUM))}; T2=${T2:-$((BUDGET * E2 / SUM))}
T2_TORCH=${T2_TORCH:-$((BUDGET * E2_TORCH / SUM))}; T3=${T3:-$((BUDGET * E3 / SUM))}
LIMIT2=${LIMIT2:-65536}
if [ "$T3" -ge 400 ]; then LIMIT3=${LIMIT3:-131072}; else LIMIT3=${LIMIT3:-65536}; fi
PHASE_TIMEOUT=${PHASE_TIMEOUT:-300}   # each compile / build / step of parts 2 and 3 (--length-timeout)

if [ -n "${SMOKE:-}" ]; then
  export JAX_PLATFORMS=cpu
  TINY="--tiny"; ATTN=${ATTN:-"xla blockwise"}   # cuDNN's place taken by XLA's dense path on the CPU
  CAP24=""; FRACTION=""
else
  TINY=""; ATTN=${ATTN:-"cudnn blockwise"}
  CAP24=$(cap24); FRACTION=${FRACTION:-0.95}
fi
ATTENTION1=${ATTENTION1:-blockwise}; DOCS1=${DOCS1:-4}
echo "PART=$PART: timeouts T1 $T1, T2 $T2, T2_TORCH $T2_TORCH, T3 $T3 s; LIMIT2 $LIMIT2, LIMIT3 $LIMIT3" \
  "${SMOKE:+(SMOKE: CPU, tiny shapes)}"

# run NAME TIMEOUT FRACTION CMD...: CMD under `timeout` (and the memory fraction, when given), its output in
# $OUT/NAME.log, its JSON lines in $OUT/NAME.jsonl, those and any error lines printed
run() {
  local name=$1 limit=$2 fraction=$3; shift 3
  rm -f "$OUT/$name.jsonl"
  ${fraction:+env XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction} timeout -k 5 "$limit" "$@" 2>&1 \
    | tee "$OUT/$name.log" | grep -E '^\{|Error|error|Killed' | cut -c1-600
  grep -h '^{' "$OUT/$name.log" > "$OUT/$name.jsonl"
}

if want 1; then
  echo "== part 1: Llama-3.2-1B throughput, seq 2048 (MLP untiled) and 32768 (MLP tile 2048)," \
    "$ATTENTION1 attention, $DOCS1 documents a row"
  run long-context-throughput "$T1" "$FRACTION" $PY $BENCH throughput $TINY --seq 2048 32768 --mlp-tile 0 2048 \
    --attention $ATTENTION1 --docs $DOCS1 --warmup 1 --steps 4 --deadline $((T1 - 10)) \
    --out "$OUT/long-context-throughput.json"
fi

if want 2; then
  echo "== part 2: Llama-3.1-8B LoRA r16, the longest row under 23.77 GiB: zerojax"
  run long-context-longest-zerojax "$T2" "$CAP24" $PY $BENCH longest $TINY --cap-gib 23.77 --remat offload full \
    --attention $ATTN --docs 1 --mlp-tile 2048 --start 65536 --limit $LIMIT2 --real-steps 2 \
    --deadline $((T2 - 10)) --length-timeout $PHASE_TIMEOUT --out "$OUT/long-context-longest-zerojax.json"
  echo "== part 2: the same, PyTorch + PEFT"
  run long-context-longest-torch "$T2_TORCH" "" env JAX_PLATFORMS=cpu $PY benchmarks/long_context_torch.py longest \
    $TINY --cap-gib 23.77 --limit $LIMIT2 --out "$OUT/long-context-longest-torch.json"
fi

if want 3; then
  echo "== part 3: Llama-3.1-8B full fine-tune, optimizer offloaded to host memory, the longest row on the card"
  run long-context-longest-full "$T3" "$FRACTION" $PY $BENCH longest-full $TINY --remat full offload --attention $ATTN \
    --docs 1 --mlp-tile 2048 --start 65536 --limit $LIMIT3 --real-steps 2 --deadline $((T3 - 10)) \
    --length-timeout $PHASE_TIMEOUT --out "$OUT/long-context-longest-full.json" ${FULL_ARGS:-}
fi

echo "== comparisons"
$PY - "$OUT" "$PART" <<'PY'
import json, os, sys

out, part = sys.argv[1], sys.argv[2]


def rows(name):
    path = os.path.join(out, f"{name}.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def timed_out(rs):
    return next((r for r in rs if r.get("timed_out")), None)


if "1" in part:
    rs = rows("long-context-throughput")
    tp = [r for r in rs if r.get("bench") == "throughput"]
    achieved = lambda r: r["tokens_per_s_per_device"] * r["flops_per_token"]  # noqa: E731 - FLOP/s
    for r in tp:
        print(f"throughput seq {r['seq']}: {r['tokens_per_s_per_device']:,.0f} tokens/s x "
              f"{r['flops_per_token'] / 1e9:.4g} GFLOPs/token = {achieved(r) / 1e12:.4g} TFLOP/s achieved "
              f"({r['attention']} attention, MLP {'tile %d' % r['mlp_tile'] if r['mlp_tile'] else 'untiled'}, "
              f"peak {r['peak_gib']} GiB)")
    if len(tp) >= 2:
        short, long_ = min(tp, key=lambda r: r["seq"]), max(tp, key=lambda r: r["seq"])
        ratio = achieved(long_) / achieved(short) if achieved(short) else None
        print(json.dumps({"comparison": "achieved FLOP/s, long row over short row",
                          "seq": [short["seq"], long_["seq"]],
                          "achieved_tflops": [round(achieved(short) / 1e12, 4), round(achieved(long_) / 1e12, 4)],
                          "tokens_per_s": [short["tokens_per_s_per_device"], long_["tokens_per_s_per_device"]],
                          "flops_per_token": [short["flops_per_token"], long_["flops_per_token"]],
                          "ratio": None if ratio is None else round(ratio, 3), "goal": ">= 0.90",
                          "met": None if ratio is None else ratio >= 0.90}))
    else:
        print(json.dumps({"comparison": "achieved FLOP/s, long row over short row", "ratio": None,
                          "rows": len(tp), "timed_out": timed_out(rs)}))

if "2" in part:
    zr, tr = rows("long-context-longest-zerojax"), rows("long-context-longest-torch")
    z = next((r for r in reversed(zr) if r.get("bench") == "longest"), None)
    t = next((r for r in reversed(tr) if "longest_seq" in r), None)
    fits = [r["seq"] for r in zr if r.get("bench") == "longest-probe" and r.get("fits")]
    zseq = z["seq"] if z else None
    tseq = t["longest_seq"] if t else None
    print(json.dumps({"comparison": "longest row, Llama-3.1-8B LoRA r16, 23.77 GiB cap",
                      "zerojax": zseq, "torch+peft": tseq,
                      "zerojax_over_torch": round(zseq / tseq, 2) if zseq and tseq else None,
                      "zerojax_config": z and f"{z.get('remat')}/{z.get('attention')}",
                      "zerojax_predicted_fit": max(fits) if fits else None,
                      "zerojax_peak_gib": z and z.get("peak_gib"), "zerojax_step_s": z and z.get("step_s"),
                      "torch_first_oom": t and t.get("first_oom_seq"), "torch_peak_gib": t and t.get("peak_gib"),
                      "limit": (z or {}).get("limit"), "goal": "zerojax >= 65536",
                      "met": None if zseq is None else zseq >= 65536,
                      "timed_out": timed_out(zr) or timed_out(tr)}))

if "3" in part:
    fr = rows("long-context-longest-full")
    f = next((r for r in reversed(fr) if r.get("bench") == "longest-full"), None)
    probes = [r for r in fr if r.get("bench") == "longest-full-probe"]
    print(json.dumps({"comparison": "longest row, Llama-3.1-8B full fine-tune, one GPU, optimizer in host memory",
                      "seq": f and f.get("seq"), "config": f and f"{f.get('remat')}/{f.get('attention')}",
                      "found": f and f.get("found"),
                      "predicted_fit": max((r["seq"] for r in probes if r.get("fits")), default=None),
                      "predicted_peak_gib": f and f.get("predicted_peak_gib"), "peak_gib": f and f.get("peak_gib"),
                      "predicted_host_gib": f and f.get("predicted_host_gib"),
                      "host_rss_peak_gib": f and f.get("host_rss_peak_gib"),
                      "first_step_s": f and f.get("first_step_s"), "step_s": f and f.get("step_s"),
                      "tokens_per_s": f and f.get("tokens_per_s_per_device"), "limit": f and f.get("limit"),
                      "timed_out": timed_out(fr)}))
PY
