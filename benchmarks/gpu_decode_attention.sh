#!/usr/bin/env bash
# The decode step's attention, XLA's products against the fused kernel (generate's
# decode_attention), on one GPU (H100 / H200), about 8 minutes: decode_profile.py at Llama-3.2-1B
# batch 64 (the kernel with its kernel table, then XLA's timing line), then GRPO (rl_bench.py, the
# Llama-3.2-1B shape) with each, then the PyTorch + transformers anchor (rl_bench_torch.py) in the
# same call.
#   PYTHONPATH=. bash benchmarks/gpu_decode_attention.sh          # results in $OUT (default benchmarks/results/)
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_decode_attention.sh  # CPU, tiny shapes: does it run?
. "$(dirname "$0")/pair.sh"  # PY, OUT, TINY
echo "== decode step, kernel (profiled)"
timeout 170 $PY benchmarks/decode_profile.py 1b64 --decode-attention kernel $TINY 2>&1 | grep -v "^WARNING" \
    | tee "$OUT/decode-kernel.log" | head -40
echo "== decode step, XLA"
timeout 100 $PY benchmarks/decode_profile.py 1b64 --decode-attention xla --lean $TINY 2>&1 | grep "^{" \
    | tee "$OUT/decode-xla.log"
for attention in kernel xla; do
    echo "== GRPO, decode_attention $attention"
    timeout 150 $PY benchmarks/rl_bench.py --model llama-3.2-1b --decode-attention $attention $TINY 2>&1 \
        | grep '^{"framework"' | tee -a "$OUT/rl-decode-attention.jsonl"
done
echo "== GRPO, PyTorch + transformers"
timeout 150 $PY benchmarks/rl_bench_torch.py --model llama-3.2-1b $TINY 2>&1 | grep '^{"framework"' \
    | tee -a "$OUT/rl-decode-attention.jsonl"
