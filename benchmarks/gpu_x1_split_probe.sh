#!/usr/bin/env bash
# Session 13 (~1.5 min): split_memory_probe.py at a 12.6 GiB cap (save_attention) and 16.1 GiB (dots),
# split master vs not (both with the bf16 first moment)
export PYTHONUNBUFFERED=1
for mode in split plain; do
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.09 timeout 60 python3 benchmarks/split_memory_probe.py $mode save_attention 2>&1 | grep -vE "Warning|warn"
done
XLA_PYTHON_CLIENT_MEM_FRACTION=0.115 timeout 60 python3 benchmarks/split_memory_probe.py split dots 2>&1 | grep -vE "Warning|warn"
