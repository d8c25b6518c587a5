#!/usr/bin/env bash
# GRPO with the hybrid engine on one GPU (H100 / H200), under 8 minutes: zerojax
# (benchmarks/rl_bench.py) and the PyTorch + transformers anchor (benchmarks/rl_bench_torch.py) on
# random-init Qwen2.5-0.5B and Llama-3.2-1B shapes: group 8 x 8 prompts of 256 tokens + 256 new,
# one warm-up step and 3 measured; samples/s and the generation / training split.
#   PYTHONPATH=. bash benchmarks/gpu_rl.sh              # results in $OUT (default benchmarks/results/)
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_rl.sh      # CPU, tiny shapes: does it run?
. "$(dirname "$0")/pair.sh"
run_pair rl benchmarks/rl_bench.py 270 benchmarks/rl_bench_torch.py 190
