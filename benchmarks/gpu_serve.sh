#!/usr/bin/env bash
# Serving on one GPU (H100 / H200), under 10 minutes: `zerojax serve`'s engine behind its HTTP
# server (in-process uvicorn, aiohttp load) on random-init Llama-3.1-8B (bf16) at concurrency 1, 16,
# 64 and 256 (prompt / output lengths like chat traffic, mean 512 / 256) and 64 with 3K-token
# prompts mixed in; then transformers' continuous batching (paged attention) on the same requests.
#   OUT=benchmarks/measured PYTHONPATH=. bash benchmarks/gpu_serve.sh
#   SMOKE=1 PYTHONPATH=. bash benchmarks/gpu_serve.sh     # CPU, tiny shapes: does it run?
# Needs fastapi, uvicorn, prometheus-client, pydantic, starlette, aiohttp beside jax and torch.
. "$(dirname "$0")/pair.sh"
run_pair serve benchmarks/serve_bench.py 360 benchmarks/serve_bench_hf.py 230
