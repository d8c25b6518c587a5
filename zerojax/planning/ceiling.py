"""The measured bf16 matmul ceiling: the denominator of every MFU zerojax reports.

A datasheet peak (989 TFLOP/s dense bf16 for an H100 / H200) is never reached by a real matmul
(an H200 measures 782-802), so MFU against it understates how close a step runs to what the
device can do. This measures it: one n^3 bf16 matmul per local device, all devices busy at once
(batched over a device axis, no collectives), as in a training step. On CPU the virtual devices
share the host's cores, so measuring one device alone would overstate each one's share.
"""
from __future__ import annotations

import time


def measure_matmul_ceiling(n: int | None = None, iters: int | None = None) -> dict:
    """Per-device bf16 matmul TFLOP/s -> {"ceiling_tflops", "matmul_n", "backend", "device_kind",
    "n_devices", "jax_version"}. n: the matmul's side (default 8192 on an accelerator, 512 on CPU,
    where it is only indicative); iters: timed repeats after one warm-up (default 20, CPU 3). Its
    buffers (3 n^2 bf16 a device, 400 MB at 8192) are freed on return."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    cpu = jax.default_backend() == "cpu"
    n = n or (512 if cpu else 8192)
    iters = iters or (3 if cpu else 20)
    devs = jax.local_devices()
    spread = NamedSharding(jax.sharding.Mesh(devs, ("d",)), P("d"))
    k1, k2 = jax.random.split(jax.random.key(0))
    init = jax.jit(lambda k: jax.random.normal(k, (len(devs), n, n), jnp.bfloat16), out_shardings=spread)
    a, b = init(k1), init(k2)
    mm = jax.jit(lambda a, b: jnp.einsum("dij,djk->dik", a, b), out_shardings=spread)
    mm(a, b).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(iters):
        c = mm(a, b)
    c.block_until_ready()
    dt = (time.perf_counter() - t0) / iters
    del a, b, c
    return {"ceiling_tflops": 2 * n**3 / dt / 1e12, "matmul_n": n, "backend": jax.default_backend(),
            "device_kind": devs[0].device_kind, "n_devices": len(devs), "jax_version": jax.__version__}
