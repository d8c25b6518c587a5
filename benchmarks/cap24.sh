# Sourced by the benchmark scripts that emulate a 24 GB card: cap24 prints the
# XLA_PYTHON_CLIENT_MEM_FRACTION that leaves 23.77 GiB of this GPU to JAX (0.17 of an H200's
# 141 GB, 0.30 of an H100's 80 GB: a fixed 0.17 would give an H100 only 13.5 GiB).
cap24() {
    nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 \
        | awk '{ printf "%.3f", 23.77 * 1024 / $1 }'
}
