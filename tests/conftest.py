"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere."""
import os

# --xla_backend_optimization_level=0 skips LLVM's optimisation of the CPU machine code, which
# dominates compile time; the tests compile much and run little (CPU seconds, XLA's default
# level 3 -> 0: test_engine 118 -> 89, test_gpt2 206 -> 92, test_checkpoint 165 -> 77). It
# changes no program: the optimised HLO (fusion, collectives, buffer assignment, so every
# HLO-text and compiled-memory assertion) is the same text with and without it; only the
# machine code differs, i.e. at most the order of a vectorised sum, which no test may depend on.
# Subprocess tests pass these flags on to their children.
# A user's XLA_FLAGS (e.g. another CPU code path, --xla_cpu_max_isa=AVX) come after it, so they
# reach the tests and win on a repeated flag (XLA keeps the last); the suite must pass under any.
# --xla_cpu_use_fusion_emitters=false generates the fusions' machine code with XLA's older IR
# emitters instead of the MLIR fusion emitters, whose compile was most of a test's time:
# tests/models/test_llama_engine.py::test_feature_equals_stage0 34.5 s -> 20.1 s, the whole suite
# 11:48 -> 6:23 on 2 cores. It changes code generation only; what differs is at the last bit: where
# a fusion's multiply-adds are contracted and how a loop is vectorised now depend on the program,
# so one formula in two programs may round differently by an ulp (the tests' tolerances say so).
# --xla_cpu_parallel_codegen_split_count=1 hands LLVM each program's machine code as one module
# instead of XLA's default split into parts compiled on threads of their own and linked: on 2 cores
# with a worker on each there is no idle core for those threads, only the split's cost. Machine
# code only, function by function the same: tests/offload/test_engine_offload.py's
# test_offload_param_accumulates_in_host_memory 12.9 -> 11.9 CPU seconds (3 runs each).
# Only where this jaxlib knows a flag (XLA aborts on an unknown one): asked once, of a child
# process, and passed on to the xdist workers and subprocess tests through the environment.
_FAST_CODEGEN = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


def _xla_takes(flags: str) -> bool:
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True).returncode == 0


def _codegen_flags() -> str:
    """The flags of _FAST_CODEGEN this jaxlib takes: all at once (one child process), else one by one."""
    both = " ".join(_FAST_CODEGEN)
    return both if _xla_takes(both) else " ".join(f for f in _FAST_CODEGEN if _xla_takes(f))


if "ZEROJAX_TEST_CODEGEN_FLAGS" not in os.environ:
    os.environ["ZEROJAX_TEST_CODEGEN_FLAGS"] = _codegen_flags()
_user_flags = os.environ.get("XLA_FLAGS", "").strip()
os.environ["XLA_FLAGS"] = " ".join(f for f in ("--xla_backend_optimization_level=0",
                                               os.environ["ZEROJAX_TEST_CODEGEN_FLAGS"], _user_flags,
                                               "--xla_force_host_platform_device_count=8") if f)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compile per distinct program in the whole run: JAX's persistent compilation cache in a
# folder of the run's own (children, xdist workers and subprocess tests inherit it through the
# environment). The suite builds the same step again and again through fresh engines (one per
# option, per example run, per process count); JAX traces and lowers each again, but a later
# identical program (the same HLO, compile options and devices: the cache key) loads the
# executable XLA built first. No program and no result changes, nor what a test reads from a
# compiled step (memory analysis, HLO text); compile events (tracing, lowering) are still
# reported. Measured: tests/planning/test_memory.py 99.6 s cold, 31.6 s with its programs cached.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zerojax-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import gc  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
# Python's cyclic garbage collector, tuned for a run that traces much: JAX's tracing makes many
# short-lived objects, and the default thresholds (700 allocations) rescan them again and again.
# What is alive after the imports is frozen out of every scan, and a collection waits for 50,000
# allocations: test_split_master.py 74.7 -> 70.2 s, test_foreign_models.py + test_nvme.py 82.4 ->
# 77.3 s (about 6%, side by side). The cost is memory: a worker's peak rose from 1.4 to 2.2 GB on
# those files (about 6.3 GB at most over the whole run), within a 24 GB, 2-worker CI machine. No
# program or result changes; the tests that count live arrays or host bytes pass with it off.
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 50, 100)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny fp32 Llama folder with a byte-level tokenizer and a chat template, written once a
    session (tests/tiny_llama_folder.py); tests read it, never write into it."""
    from tiny_llama_folder import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "Llama-tiny")
