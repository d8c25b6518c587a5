"""XLA's pinned host memory pool on GPU, where CPU offload keeps its states (memory kind pinned_host).

XLA's GPU client serves pinned host memory from one pool capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
(64 GiB where unset), read once when the client starts. The pool grows on demand (XLA's host BFC
allocator has allow_growth): Llama-3.1-8B's offloaded state (90 GiB on a 125 GiB host) died at its
first step at the default cap with "Out of host memory ... xla_gpu_host_bfc". But the pool grows by
doubling regions, so it may pin up to the cap, pages the kernel can neither swap nor give the rest of
the process: at a cap of all 125 GiB the same run was killed while building; at 112 GiB it trained.
`import zerojax` sets the cap to 90% of the host's physical memory where the user has not set it and
no JAX backend has started yet; the planner counts the cap in effect as host memory an offloading
plan may hold.
No jax import here: `zerojax/__init__.py` runs this before anything starts a backend."""
from __future__ import annotations

import os

from zerojax._jax_compat import backends_started

ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_GIB = 64
HOST_FRACTION = 0.9  # of physical memory; the rest for the process's unpinned memory (see above)


def physical_gib() -> int:
    """The host's physical memory in whole GiB."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**30


def raise_cap() -> None:
    """The pool's cap set to HOST_FRACTION of the host's physical memory, unless the user set it or a
    backend already read it (then setting it now would misreport the cap in effect)."""
    if ENV not in os.environ and not backends_started():
        os.environ[ENV] = str(max(int(physical_gib() * HOST_FRACTION), XLA_DEFAULT_GIB))


def cap_bytes() -> int:
    """The cap in effect: the variable as the GPU client read it at its start (XLA's default where it
    is unset or not an integer, which XLA ignores with an error line)."""
    try:
        return int(os.environ.get(ENV, XLA_DEFAULT_GIB)) * 2**30
    except ValueError:
        return XLA_DEFAULT_GIB * 2**30
