#!/usr/bin/env bash
# Issue #18 on 2 x H200: per-GPU tokens/s of ZeRO-1/2/3 against the plain jax.jit step, with the
# current default (per-layer "full" remat) and with POLICY (the remat policy that won on one GPU;
# default "dots" with the fused loss, chunk 256: sessions 13-14's best micro-8 entry on one GPU,
# 76,909-78,121 tokens/s, under 16 GiB there only with the split master and bf16 first moment, which
# ZeRO-2 over two GPUs does not need: the master and moments are halved), alone and with XLA's latency-hiding scheduler (which lets the
# gradient reduce-scatter / the stage-3 all-gather overlap the layers' compute). GPT-2 Large, seq
# 1024, micro 8 per GPU, bf16. Then a profile of ZeRO-2 with POLICY (collective time per step).
# Last, the same with XLA's pipelined collectives (a layer's reduce-scatter / all-gather issued in
# the next loop iteration). About 6-7 minutes (9 entries of ~35 s and a profile). Targets (issue): stage 1/2 >= 95% of one GPU's tokens/s; stage 2 >= 72k,
# stage 3 >= 65k per GPU. JSON of the run, the table's JSON and the profile go to $OUT.
# BENCH_ARGS=--tiny runs the same on 2 virtual CPU devices (no profile): a smoke test of the script.
set -u
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
P=${POLICY:-dots}
LC=${LOSS_CHUNK:-256}  # chunked_gpt2_loss(LC) on the POLICY entries; 0: the plain loss
LHS='"env": {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true"}, "label": "lhs"'
# the per-layer gradient reduction sits inside the backward layer loop (compiled HLO, 2 CPU devices):
# XLA's loop pipelining moves a layer's collective into the next iteration so that it overlaps compute
PIPE_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_pipelined_reduce_scatter=true --xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_pipelined_all_gather=true"
PIPE="\"env\": {\"XLA_FLAGS\": \"$PIPE_FLAGS\"}, \"label\": \"lhs+pipelined\""
$PY benchmarks/bench.py --steps 8 --warmup 2 --timeout 180 ${BENCH_ARGS:-} --out "$OUT/speed_x2.json" --matrix "[
  {\"stage\": \"plain\", \"remat\": true},
  {\"stage\": 1, \"remat\": true},
  {\"stage\": 2, \"remat\": true},
  {\"stage\": 3, \"remat\": true},
  {\"stage\": 2, \"remat\": \"$P\", \"loss_chunk\": $LC},
  {\"stage\": 3, \"remat\": \"$P\", \"loss_chunk\": $LC},
  {\"stage\": 2, \"remat\": \"$P\", \"loss_chunk\": $LC, $LHS},
  {\"stage\": 2, \"remat\": \"$P\", \"loss_chunk\": $LC, $PIPE},
  {\"stage\": 3, \"remat\": \"$P\", \"loss_chunk\": $LC, $PIPE},
  {\"stage\": 2, \"remat\": \"save_qkv_attention\", \"loss_chunk\": $LC}]" 2>&1 | grep -E "^(large|tiny|entry|ceiling)|FAIL"

case "${BENCH_ARGS:-}" in *--tiny*) ;; *)
  $PY benchmarks/profile_step.py "{\"stage\": 2, \"remat\": \"$P\", \"loss_chunk\": $LC}" --json "$OUT/speed_x2_profile.json" \
    2>/dev/null | head -30 ;;
esac

echo
$PY benchmarks/speed_pick.py table --max-gib 16 --json "$OUT/speed_x2_table.json" "$OUT/speed_x2.json"
