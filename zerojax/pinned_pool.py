"""XLA's pinned host memory pool on GPU, where CPU offload keeps its states (memory kind pinned_host).

XLA's GPU client serves pinned host memory from one pool capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
(64 GiB where unset), read once when the client starts. The pool grows on demand (XLA's host BFC
allocator has allow_growth), so the cap reserves nothing; it only refuses: Llama-3.1-8B's offloaded
state (92 GiB on a 128 GB host) died at its first step with "Out of host memory ... xla_gpu_host_bfc".
`import zerojax` sets the cap to the host's physical memory where the user has not set it and no JAX
backend has started yet; the planner counts the cap in effect as host memory an offloading plan may hold.
No jax import here: `zerojax/__init__` runs this before anything starts a backend."""
from __future__ import annotations

import os
import sys

ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_GIB = 64


def physical_gib() -> int:
    """The host's physical memory in whole GiB."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**30


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


def raise_cap() -> None:
    """The pool's cap set to the host's physical memory, unless the user set it or a backend already
    read it (then setting it now would misreport the cap in effect)."""
    if ENV not in os.environ and not _backends_started():
        os.environ[ENV] = str(max(physical_gib(), XLA_DEFAULT_GIB))


def cap_bytes() -> int:
    """The cap in effect: the variable as the GPU client read it at its start (XLA's default where it
    is unset or not an integer, which XLA ignores with an error line)."""
    try:
        return int(os.environ.get(ENV, XLA_DEFAULT_GIB)) * 2**30
    except ValueError:
        return XLA_DEFAULT_GIB * 2**30
