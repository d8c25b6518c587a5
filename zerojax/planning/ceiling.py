"""The measured matmul ceiling: the denominator of every MFU zerojax reports.

A datasheet peak (989 TFLOP/s dense bf16 for an H100 / H200) is never reached by a real matmul
(an H200 measures 782-802), so MFU against it understates how close a step runs to what the
device can do. This measures it: one n^3 matmul per local device in the run's compute dtype
(bf16 by default; an fp32 run is measured against fp32), all devices busy at once (batched over
a device axis, no collectives), as in a training step.

On CPU the number is not a ceiling: the virtual devices share the host's cores with everything
else running there, and repeated measurements of the same host differed 8x (0.0125 to 0.103
TFLOP/s), so `ceiling_is_stable()` is False there and callers report no MFU unless given a peak.
"""
from __future__ import annotations

import time


def ceiling_is_stable(backend: str | None = None) -> bool:
    """Whether a measured ceiling means anything on this backend (not on CPU: see the module)."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return backend != "cpu"


def measure_matmul_ceiling(n: int | None = None, iters: int | None = None, dtype="bfloat16") -> dict:
    """Per-device matmul TFLOP/s in `dtype` -> {"ceiling_tflops", "dtype", "matmul_n", "backend",
    "device_kind", "n_devices", "jax_version"}. n: the matmul's side (default 8192 on an
    accelerator, 512 on CPU, where it is only indicative); iters: timed repeats after one warm-up
    (default 20, CPU 3). Its buffers (3 n^2 elements a device, 400 MB at 8192 in bf16) are freed
    on return."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cpu = jax.default_backend() == "cpu"
    n = n or (512 if cpu else 8192)
    iters = iters or (3 if cpu else 20)
    dtype = jnp.dtype(dtype)
    devs = jax.local_devices()
    spread = NamedSharding(jax.sharding.Mesh(devs, ("d",)), P("d"))
    k1, k2 = jax.random.split(jax.random.key(0))
    init = jax.jit(lambda k: jax.random.normal(k, (len(devs), n, n), dtype), out_shardings=spread)
    a, b = init(k1), init(k2)
    mm = jax.jit(lambda a, b: jnp.einsum("dij,djk->dik", a, b), out_shardings=spread)
    mm(a, b).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(iters):
        c = mm(a, b)
    c.block_until_ready()
    dt = (time.perf_counter() - t0) / iters
    del a, b, c
    return {"ceiling_tflops": 2 * n**3 / dt / 1e12, "dtype": dtype.name, "matmul_n": n,
            "backend": jax.default_backend(),
            "device_kind": devs[0].device_kind, "n_devices": len(devs), "jax_version": jax.__version__}
