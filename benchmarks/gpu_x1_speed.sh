#!/usr/bin/env bash
# Issue #18 on 1 x H200: every speed candidate beside the plain jax.jit step and zerojax's current
# default (ZeRO-2, per-layer "full" remat). GPT-2 Large, seq 1024, micro 8, bf16. About 6 minutes
# (13 entries, each a fresh process: ~25 s of start-up and compile, 8 timed steps; a profile).
#   1. remat policies (activation_checkpointing.remat_policy): full, dots, save_qkv_attention,
#      save_attention, save_qkv; and "full" with the layer scan unrolled by 2 (GPT2 scan_unroll);
#   2. on the best of 1 that peaks at <= 16 GiB (else the best): one XLA flag at a time --
#      latency-hiding scheduler, cuDNN layer norm, dynamic-slice fusion, command buffers off -- and
#      JAX_OPTIMIZATION_LEVEL=O1 (jax_optimization_level; the level GPU users report using, said
#      to include the latency-hiding scheduler); and that best at micro-batch 16;
#   3. a profile of the best (profile_step.py).
# Then one table of everything (tokens/s, MFU, peak, ratio to plain and to the default); the JSON
# of each phase, the table's JSON and the profile go to $OUT. A flag XLA does not know fails its
# entry only ("Unknown flags in XLA_FLAGS"), the run goes on.
# BENCH_ARGS=--tiny runs the same on CPU (tiny GPT-2, no profile): a smoke test of the script.
#
# `gpu_x1_speed.sh loss` (session 6, ~140 s): the fused cross entropy (bench "loss_chunk":
# zerojax.models.chunked_gpt2_loss, 256 and 128 positions a chunk) beside the default and plain,
# the partial remat policies "dots_12" / "dots_24", micro 16 and cuBLASLt (its gemm epilogues can
# take the bias and gelu) on it; first a profile of the fused loss with its HLO (the element-wise
# bucket's kernels named).
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
B="$PY benchmarks/bench.py --steps 8 --warmup 2 --timeout 180 ${BENCH_ARGS:-}"
show() { grep -E "^(large|tiny|entry|ceiling)|FAIL"; }
s6_matrix() {  # $1: the JSON's name under $OUT, $2: the matrix; 6 timed steps, progress lines shown
  $PY benchmarks/bench.py --steps 6 --warmup 2 --timeout 55 ${BENCH_ARGS:-} --out "$OUT/$1.json" --matrix "$2" \
    2>&1 | grep -E "^ *(large|tiny|entry|ceiling)|FAIL"
}
profile_fused_loss() {  # $1: file prefix. ZeRO-2, remat, the fused loss (chunk 256), its HLO named
  local P S
  case "${BENCH_ARGS:-}" in *--tiny*) P="--cpu"; S='"size": "tiny", "seq": 32, "micro": 2, "loss_chunk": 8';;
    *) P=""; S='"loss_chunk": 256';; esac
  $PY benchmarks/profile_step.py "{\"stage\": 2, \"remat\": true, $S}" $P --steps 3 --warmup 2 \
    --hlo "$OUT/$1_profile_hlo.txt.gz" --json "$OUT/$1_profile.json" 2>/dev/null > "$OUT/$1_profile.md"
  head -45 "$OUT/$1_profile.md"
}
# entry pieces the variant sets share: an XLA flag A/B entry's "env" and label; the zero-init
# option plain jax.jit gets beside zerojax (Engine.compiler_options); the bf16 first moment; the
# fused loss at ZeRO-2; the micro-8 and micro-16 winners of sessions 8-11
FL() { echo "\"env\": {\"XLA_FLAGS\": \"$1\"}, \"label\": \"$2\""; }
ZI=$(FL --xla_gpu_enable_dus_accumulator_zero_init_elimination=true zi)
MU='"env": {"ZEROJAX_ADAM_MU_DTYPE": "bfloat16"}, "label": "mu_bf16"'
C='"stage": 2, "loss_chunk": 256'
W8='"stage": 2, "remat": "save_qkv_attention", "loss_chunk": 256'
W16='"stage": 2, "remat": "save_attention", "loss_chunk": 256, "micro": 16'

if [ "${1:-sweep}" = s13 ]; then
  # session 13's closing table (~3 min): issue #18's micro-8 rows side by side in one call -- plain
  # jax.jit, the default ("full" remat) with and without the split master, the micro-8 winner
  # ("dots" + ce + mu + split) -- and the best micro-batch candidates under 16 GiB with the split
  # master (save_attention_block at micro 12: 17.31 GiB without it; save_attention at micro 16)
  SP='"env": {"ZEROJAX_ADAM_MU_DTYPE": "bfloat16", "ZEROJAX_MASTER_SPLIT": "1"}, "label": "mu_bf16 split"'
  s6_matrix s13_speed "[
    {\"stage\": \"plain\", \"remat\": true, $ZI}, {\"stage\": 2, \"remat\": true},
    {\"stage\": 2, \"remat\": true, \"env\": {\"ZEROJAX_MASTER_SPLIT\": \"1\"}, \"label\": \"split\"},
    {$C, \"remat\": \"dots\", $SP},
    {$C, \"remat\": \"save_attention_block\", \"micro\": 12, $SP},
    {$C, \"remat\": \"save_attention\", \"micro\": 16, $SP}]"
  exit 0
fi

if [ "${1:-sweep}" = s12f ]; then
  # session 12 (~1 min): the split master on the default ("full" remat, micro 8) A/B in one call
  s6_matrix s12f_speed "[{\"stage\": 2, \"remat\": true},
    {\"stage\": 2, \"remat\": true, \"env\": {\"ZEROJAX_MASTER_SPLIT\": \"1\"}, \"label\": \"split\"}]"
  exit 0
fi

if [ "${1:-sweep}" = s12e ]; then
  # session 12 (~2 min): EngineOptions.master_split (the device master as bf16 params + int16
  # remainder: 1.44 GiB less on GPT-2 Large) on the micro-8 winner, "dots" and the default
  MS='"env": {"ZEROJAX_ADAM_MU_DTYPE": "bfloat16", "ZEROJAX_MASTER_SPLIT": "1"}, "label": "mu_bf16 split"'
  s6_matrix s12e_speed "[
    {$C, \"remat\": \"save_attention_block\", $MU}, {$C, \"remat\": \"save_attention_block\", $MS},
    {$C, \"remat\": \"dots\", $MS}, {\"stage\": 2, \"remat\": true, \"env\": {\"ZEROJAX_MASTER_SPLIT\": \"1\"}, \"label\": \"split\"}]"
  exit 0
fi

if [ "${1:-sweep}" = s12d ]; then
  # session 12's closing table (~4 min): issue #18's 1-GPU rows side by side with plain jax.jit --
  # the default, the micro-8 winners under 16 GiB, micro 12 / 16 candidates -- then a profile of the
  # micro-8 winner (save_attention_block + ce/256 + bf16 first moment)
  s6_matrix s12d_speed "[
    {\"stage\": \"plain\", \"remat\": true, $ZI}, {\"stage\": 2, \"remat\": true},
    {$C, \"remat\": \"save_attention_block\", $MU}, {$C, \"remat\": \"save_qkv_attention\"},
    {$C, \"remat\": \"save_attention_block\", \"micro\": 12, $MU},
    {$C, \"remat\": \"save_qkv_attention\", \"micro\": 16, $MU},
    {$C, \"remat\": \"save_attention\", \"micro\": 16, $MU},
    {\"stage\": \"plain\", \"remat\": true, \"micro\": 16, $ZI}]"
  ZEROJAX_ADAM_MU_DTYPE=bfloat16 $PY benchmarks/profile_step.py \
    '{"stage": 2, "remat": "save_attention_block", "loss_chunk": 256}' --steps 4 --warmup 2 \
    --json "$OUT/s12d_profile.json" 2>/dev/null > "$OUT/s12d_profile.md"
  head -32 "$OUT/s12d_profile.md"
  exit 0
fi

if [ "${1:-sweep}" = s12c ]; then
  # session 12 (~3 min): "save_attention_block" (save_qkv_attention + the residual after the
  # attention half: only the MLP half recomputed, +d per token and layer) at micro 8, with and
  # without the bf16 first moment, beside save_qkv_attention and "dots" with it
  s6_matrix s12c_speed "[
    {$C, \"remat\": \"save_qkv_attention\", $MU}, {$C, \"remat\": \"save_attention_block\", $MU},
    {$C, \"remat\": \"save_attention_block\"}, {$C, \"remat\": \"dots\", $MU},
    {$C, \"remat\": \"save_attention_block\", \"micro\": 16, $MU}]"
  exit 0
fi

if [ "${1:-sweep}" = s12b ]; then
  # session 12 (~3 min): the custom-VJP gelu_new on the default ("full" remat) A/B, and the winners
  # with the bf16 first moment (EngineOptions.adam_mu_dtype: 2 bytes a parameter less each way in
  # the AdamW pass, 1.44 GiB less state)
  s6_matrix s12b_speed "[
    {\"stage\": 2, \"remat\": true, \"gelu\": \"autodiff\"}, {\"stage\": 2, \"remat\": true},
    {$W8}, {$W8, $MU}, {$W16}, {$W16, $MU}]"
  exit 0
fi

if [ "${1:-sweep}" = s12 ]; then
  # session 12 (~4 min): the c_fc gemm's bias + gelu in cuBLASLt's epilogue. The model's gelu_new is
  # now a custom VJP (its backward keeps only its input, so the recompute's gelu can fold into the
  # gemm too); XLA folds it only where the dot is not taken by Triton's gemm rewriter first
  # (gelu_epilogue_probe.py). The micro-8 winner with: JAX's own gelu derivative (as before), the
  # custom VJP, and each with Triton gemms off / Triton only where it fuses (triton_gemm_any=false)
  NT=$(FL --xla_gpu_enable_triton_gemm=false no_triton_gemm)
  NA=$(FL --xla_gpu_triton_gemm_any=false triton_gemm_any_off)
  s6_matrix s12_speed "[
    {\"stage\": \"plain\", \"remat\": true, $ZI},
    {$W8, \"gelu\": \"autodiff\"}, {$W8}, {$W8, $NT}, {$W8, $NA}, {$W8, \"gelu\": \"autodiff\", $NT},
    {$W16}, {$W16, $NT}, {$W16, $NA}]"
  exit 0
fi

if [ "${1:-sweep}" = s10 ]; then
  # prepared in session 10, run in session 11 (~200 s; all three lost): the micro-8 winner A/B with the XLA GPU flags
  # JAX-Toolbox's GPT recipes set and no session has tried on it: Triton gemms off (cuBLAS for
  # every dot) and while-loop double buffering (the layer scan's slices of the saved stacks
  # prefetched one iteration ahead), each alone and together, beside plain jax.jit
  NT=$(FL --xla_gpu_enable_triton_gemm=false no_triton_gemm)
  DB=$(FL --xla_gpu_enable_while_loop_double_buffering=true double_buffer)
  BOTH=$(FL "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_while_loop_double_buffering=true" both)
  s6_matrix s10_speed "[
    {\"stage\": \"plain\", \"remat\": true, $ZI},
    {$W8}, {$W8, $NT}, {$W8, $DB}, {$W8, $BOTH}]"
  exit 0
fi

if [ "${1:-sweep}" = s9 ]; then
  # session 9 (~260 s): the micro-8 and micro-16 winners beside plain jax.jit, each A/B with XLA's
  # dynamic-slice fusion (the backward's slices of the saved stacks read in place by cuBLAS) and
  # cuDNN's layer norm (crashed on JAX 0.4.x in session 5), and the saved stack unrolled by 2.
  DSF=$(FL --xla_gpu_enable_dynamic_slice_fusion=true dsf)
  CLN=$(FL --xla_gpu_enable_cudnn_layer_norm=true cudnn_ln)
  s6_matrix s9_speed "[
    {\"stage\": \"plain\", \"remat\": true, $ZI},
    {\"stage\": 2, \"remat\": true},
    {$W8}, {$W8, $DSF}, {$W8, $CLN}, {$W8, \"unroll\": 2},
    {$W16}, {$W16, $DSF},
    {\"stage\": \"plain\", \"remat\": true, \"micro\": 16, $ZI}]"
  exit 0
fi

if [ "${1:-sweep}" = dsf ]; then
  # session 8 (~90 s): the winner's backward cuts each layer's saved activations out of their
  # stacks (dynamic-slice: 4.2 GB of copies a step, hlo_bytes on its GPU HLO); XLA's dynamic-slice
  # fusion lets cuBLAS read such a slice in place. A/B on the micro-8 and micro-16 winners.
  DSF='"env": {"XLA_FLAGS": "--xla_gpu_enable_dynamic_slice_fusion=true"}, "label": "dsf"'
  s6_matrix s8_dsf "[
    {\"stage\": 2, \"remat\": \"save_qkv_attention\", \"loss_chunk\": 256},
    {\"stage\": 2, \"remat\": \"save_qkv_attention\", \"loss_chunk\": 256, $DSF},
    {\"stage\": 2, \"remat\": \"save_attention\", \"loss_chunk\": 256, \"micro\": 16},
    {\"stage\": 2, \"remat\": \"save_attention\", \"loss_chunk\": 256, \"micro\": 16, $DSF}]"
  exit 0
fi

if [ "${1:-sweep}" = attn2 ]; then
  # session 8 (~260 s): as `attn`, after the fix that kept cuDNN's attention output twice under the
  # save_*attention policies (+0.7 GiB at micro 8); micro 8 at <= 16 GiB and the best micro-batch
  s6_matrix s8_attn2 "[
    {\"stage\": \"plain\", \"remat\": true, $ZI},
    {\"stage\": 2, \"remat\": true},
    {\"stage\": 2, \"remat\": \"save_attention\"},
    {\"stage\": 2, \"remat\": \"save_qkv_attention\"},
    {\"stage\": 2, \"remat\": \"save_qkv_attention\", \"loss_chunk\": 256},
    {\"stage\": 2, \"remat\": \"dots\"},
    {\"stage\": 2, \"remat\": \"save_attention\", \"loss_chunk\": 256, \"micro\": 16},
    {\"stage\": 2, \"remat\": \"save_qkv_attention\", \"loss_chunk\": 256, \"micro\": 12},
    {\"stage\": \"plain\", \"remat\": true, \"micro\": 16, $ZI}]"
  case "${BENCH_ARGS:-}" in *--tiny*) ;; *)
    $PY benchmarks/profile_step.py '{"stage": 2, "remat": "save_qkv_attention", "loss_chunk": 256}' --steps 3 \
      --warmup 2 --json "$OUT/s8_attn2_profile.json" 2>/dev/null > "$OUT/s8_attn2_profile.md"
    head -30 "$OUT/s8_attn2_profile.md" ;;
  esac
  exit 0
fi

if [ "${1:-sweep}" = attn ]; then
  # session 8 (~330 s): save_attention / save_qkv_attention now keep cuDNN attention's softmax
  # statistics (the attention forward is not run again in the backward); the engine compiles every
  # GPU step with the zero-init option (plain gets it through XLA_FLAGS, for a like-for-like
  # baseline). Micro 8 under 16 GiB, then the best micro-batch; a profile of save_attention.
  s6_matrix s8_attn "[
    {\"stage\": \"plain\", \"remat\": true, $ZI},
    {\"stage\": 2, \"remat\": true},
    {\"stage\": 2, \"remat\": \"save_attention\"},
    {\"stage\": 2, \"remat\": \"save_attention\", \"loss_chunk\": 256},
    {\"stage\": 2, \"remat\": \"save_qkv_attention\"},
    {\"stage\": 2, \"remat\": \"save_qkv_attention\", \"loss_chunk\": 256},
    {\"stage\": 2, \"remat\": \"save_qkv\", \"loss_chunk\": 256},
    {\"stage\": 2, \"remat\": \"save_attention\", \"loss_chunk\": 256, \"micro\": 12},
    {\"stage\": 2, \"remat\": \"save_attention\", \"loss_chunk\": 256, \"micro\": 16},
    {\"stage\": \"plain\", \"remat\": true, \"micro\": 16, $ZI}]"
  case "${BENCH_ARGS:-}" in *--tiny*) ;; *)
    $PY benchmarks/profile_step.py '{"stage": 2, "remat": "save_attention", "loss_chunk": 256}' --steps 3 \
      --warmup 2 --json "$OUT/s8_attn_profile.json" 2>/dev/null > "$OUT/s8_attn_profile.md"
    head -24 "$OUT/s8_attn_profile.md" ;;
  esac
  exit 0
fi

if [ "${1:-sweep}" = zi ]; then
  # session 8 (~330 s): XLA's `xla_gpu_enable_dus_accumulator_zero_init_elimination` (the pipelined
  # step's option since session 7: the saved-activation stacks are no longer zero-filled first) on
  # plain and non-pipelined steps, where the remat policies that save more (dots_<k>, save_*) stack
  # more; then profiles of dots_16 with and without it (where the dots layers' time goes)
  s6_matrix s8_zi "[
    {\"stage\": \"plain\", \"remat\": true},
    {\"stage\": 2, \"remat\": true},
    {\"stage\": \"plain\", \"remat\": true, $ZI},
    {\"stage\": 2, \"remat\": true, $ZI},
    {\"stage\": 2, \"remat\": \"dots_16\"},
    {\"stage\": 2, \"remat\": \"dots_16\", $ZI},
    {\"stage\": 2, \"remat\": \"dots\", $ZI},
    {\"stage\": 2, \"remat\": \"save_qkv_attention\", $ZI},
    {\"stage\": 2, \"remat\": \"save_qkv\", $ZI},
    {\"stage\": 2, \"remat\": true, \"loss_chunk\": 256, \"micro\": 16, $ZI}]"
  case "${BENCH_ARGS:-}" in *--tiny*) ;; *)
    for z in off on; do
      if [ $z = on ]; then export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dus_accumulator_zero_init_elimination=true"; fi
      $PY benchmarks/profile_step.py '{"stage": 2, "remat": "dots_16"}' --steps 3 --warmup 2 \
        --json "$OUT/s8_dots16_$z.json" 2>/dev/null > "$OUT/s8_dots16_$z.md"
      head -22 "$OUT/s8_dots16_$z.md"
    done ;;
  esac
  exit 0
fi

if [ "${1:-sweep}" = final ]; then
  # session 6, the tree as merged (~100 s): the default beside plain, dots_<k> at micro 8 where
  # 16 GiB allows it (0.1 GiB a dots layer over 13.1), the fused loss with it, micro 16
  s6_matrix s6_final '[
    {"stage": "plain", "remat": true},
    {"stage": 2, "remat": true},
    {"stage": 2, "remat": "dots_24"},
    {"stage": 2, "remat": "dots_28"},
    {"stage": 2, "remat": "dots_28", "loss_chunk": 256},
    {"stage": 2, "remat": true, "loss_chunk": 256, "micro": 16},
    {"stage": "plain", "remat": true, "micro": 16}]'
  (cd "$OUT" && tar -czf speed1_final.tgz s6_final* && rm -f s6_final*)
  exit 0
fi

if [ "${1:-sweep}" = tune ]; then
  # session 6, batch 2 (~170 s): the fused loss's chunk (512, 1024 = one piece), dots_<k> at the
  # budget, micro 12 / 16 with it (plain at 16 beside); the profile with its HLO first. Everything
  # under $OUT goes back as one tar.
  profile_fused_loss s6_tune
  s6_matrix s6_tune '[
    {"stage": "plain", "remat": true},
    {"stage": 2, "remat": true},
    {"stage": 2, "remat": true, "loss_chunk": 512},
    {"stage": 2, "remat": true, "loss_chunk": 1024},
    {"stage": 2, "remat": "dots_20", "loss_chunk": 256},
    {"stage": 2, "remat": true, "loss_chunk": 256, "micro": 16},
    {"stage": 2, "remat": "dots_2", "loss_chunk": 256, "micro": 16},
    {"stage": "plain", "remat": true, "micro": 16},
    {"stage": 2, "remat": true, "loss_chunk": 256, "micro": 12}]'
  (cd "$OUT" && tar -czf speed1_tune.tgz s6_tune* && rm -f s6_tune*)
  exit 0
fi

if [ "${1:-sweep}" = loss ]; then
  # the profile first: it is what the element-wise analysis needs, and the matrix prints as it goes
  profile_fused_loss s6_loss
  s6_matrix s6_loss '[
    {"stage": "plain", "remat": true},
    {"stage": 2, "remat": true},
    {"stage": 2, "remat": true, "loss_chunk": 256},
    {"stage": 2, "remat": "dots_24", "loss_chunk": 256},
    {"stage": 2, "remat": "dots_12", "loss_chunk": 256},
    {"stage": 2, "remat": true, "loss_chunk": 256, "micro": 16},
    {"stage": 2, "remat": true, "loss_chunk": 128},
    {"stage": 2, "remat": true, "loss_chunk": 256, "label": "cublaslt",
     "env": {"XLA_FLAGS": "--xla_gpu_enable_cublaslt=true"}}]'
  exit 0
fi

$B --out "$OUT/speed_x1_remat.json" --matrix '[
  {"stage": "plain", "remat": true},
  {"stage": 2, "remat": true},
  {"stage": 2, "remat": "dots"},
  {"stage": 2, "remat": "save_qkv_attention"},
  {"stage": 2, "remat": "save_attention"},
  {"stage": 2, "remat": "save_qkv"},
  {"stage": 2, "remat": true, "unroll": 2}]' 2>&1 | show

BEST=$($PY benchmarks/speed_pick.py best --max-gib 16 "$OUT/speed_x1_remat.json") || BEST='{"stage": 2, "remat": true}'
echo "best of the remat policies (<= 16 GiB): $BEST"

flag() {  # one A/B entry: the best spec plus an environment for its process only
  $PY -c "import json,sys; s=json.loads(sys.argv[1]); s.update(env=json.loads(sys.argv[2]), label=sys.argv[3]); print(json.dumps(s))" \
    "$BEST" "$1" "$2"
}
$B --out "$OUT/speed_x1_flags.json" --matrix "[
  $(flag '{"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true"}' lhs),
  $(flag '{"XLA_FLAGS": "--xla_gpu_enable_cudnn_layer_norm=true"}' cudnn-ln),
  $(flag '{"XLA_FLAGS": "--xla_gpu_enable_dynamic_slice_fusion=true"}' ds-fusion),
  $(flag '{"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}' no-cmd-buf),
  $(flag '{"JAX_OPTIMIZATION_LEVEL": "O1"}' O1),
  $($PY -c "import json,sys; s=json.loads(sys.argv[1]); s['micro']=16; print(json.dumps(s))" "$BEST")]" 2>&1 | show

case "${BENCH_ARGS:-}" in *--tiny*) ;; *)
  $PY benchmarks/profile_step.py "$BEST" --json "$OUT/speed_x1_profile.json" 2>/dev/null | head -30 ;;
esac

echo
$PY benchmarks/speed_pick.py table --max-gib 16 --json "$OUT/speed_x1_table.json" \
  "$OUT/speed_x1_remat.json" "$OUT/speed_x1_flags.json"
