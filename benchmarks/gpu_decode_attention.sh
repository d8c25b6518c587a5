#!/usr/bin/env bash
# The decode step's attention, XLA's products against the fused kernel (generate's
# decode_attention), on one GPU (H100 / H200). PART=decode (~5 min): decode_profile.py at
# Llama-3.2-1B batch 64 (the kernel with its kernel table, then XLA's timing line) and at
# Llama-3.1-8B batch 1 (both timing lines: 8 (row, kv head) pairs there, their slots split), then
# both with XLA's command buffers over the step's body and over the while loop. PART=rl (~9 min): GRPO (rl_bench.py, the
# Llama-3.2-1B shape) with the kernel, then one change at a time (whole rows in the log-prob passes,
# XLA's attention, no remat; RL_CASES picks), then the PyTorch + transformers anchor
# (rl_bench_torch.py) in the same call (NO_ANCHOR=1: not; PART=anchor: it alone; ANCHOR_RUNS=N: N times). Without PART: both (over 10 minutes).
#   PYTHONPATH=. bash benchmarks/gpu_decode_attention.sh          # results in $OUT (default benchmarks/results/)
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_decode_attention.sh  # CPU, tiny shapes: does it run?
. "$(dirname "$0")/pair.sh"  # PY, OUT, TINY
PART=${PART:-decode rl}
if [[ $PART == *decode* ]]; then
    echo "== decode step, 1b64, kernel (profiled)"
    timeout 170 $PY benchmarks/decode_profile.py 1b64 --decode-attention kernel $TINY 2>&1 | grep -v "^WARNING" \
        | tee "$OUT/decode-kernel.log" | head -40
    echo "== decode step, 1b64 xla; 8b1 kernel, xla"
    for case in "1b64 xla" "8b1 kernel" "8b1 xla"; do
        set -- $case
        timeout 100 $PY benchmarks/decode_profile.py "$1" --decode-attention "$2" --lean $TINY 2>&1 | grep "^{" \
            | tee -a "$OUT/decode-attention.jsonl"
    done
    # XLA's command buffers (CUDA graphs): "body" adds the cuBLAS gemms on slices of the stacked
    # weights (DYNAMIC_SLICE_FUSION; without it each gemm ends a graph), "while" the decode loop
    # itself (XLA's default leaves WHILE out: each token's ~15 kernels a layer launched one by one)
    echo "== decode step, 1b64, both, command buffers over the step's body / the while loop"
    body=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,DYNAMIC_SLICE_FUSION
    for buffers in "body $body" "while $body,WHILE,CONDITIONAL"; do
        set -- $buffers
        for attention in kernel xla; do
            XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=$2" \
                timeout 100 $PY benchmarks/decode_profile.py 1b64 --decode-attention $attention --lean $TINY 2>&1 \
                | grep "^{" | sed "s/^{/{\"command_buffer\": \"$1\", /" | tee -a "$OUT/decode-attention.jsonl"
        done
    done
fi
# GRPO cases, ";" between them: the default (each prompt run once per group in the log-prob passes),
# then one change at a time (whole rows, XLA's decode attention, no remat)
RL_CASES=${RL_CASES:-"--decode-attention kernel;--decode-attention kernel --whole-rows;--decode-attention xla;--decode-attention kernel --remat none"}
if [[ $PART == *rl* ]]; then
    IFS=';' read -ra cases <<< "$RL_CASES"
    for flags in "${cases[@]}"; do
        echo "== GRPO, $flags"
        timeout 140 $PY benchmarks/rl_bench.py --model llama-3.2-1b $flags $TINY 2>&1 \
            | grep -E '^\{"framework"|Error|error:' | tee -a "$OUT/rl-decode-attention.jsonl"
    done
fi
if [[ $PART == *anchor* || $PART == *rl* && -z ${NO_ANCHOR:-} ]]; then
    # ANCHOR_RUNS > 1: its spread in one call (its time is transformers' generate, bound by the host)
    for _ in $(seq "${ANCHOR_RUNS:-1}"); do
        echo "== GRPO, PyTorch + transformers"
        timeout 150 $PY benchmarks/rl_bench_torch.py --model llama-3.2-1b $TINY 2>&1 | grep '^{"framework"' \
            | tee -a "$OUT/rl-decode-attention.jsonl"
    done
fi
