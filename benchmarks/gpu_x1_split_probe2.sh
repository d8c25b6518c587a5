#!/usr/bin/env bash
# Session 13 (~1 min): split_memory_probe.py again after the init's donation fix (keep_unused)
export PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_MEM_FRACTION=0.09 timeout 50 python3 benchmarks/split_memory_probe.py split save_attention 2>&1 | grep -E "^split|Error"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.115 timeout 50 python3 benchmarks/split_memory_probe.py split dots 2>&1 | grep -E "^split|Error"
