"""Where can an offloaded AdamW update run fast enough? Times one AdamW step over N fp32 params.

Full optimizer offload that streams master + moments through PCIe moves 12 bytes per parameter
each way per step; computing the update in host memory moves only the bf16 gradient down and the
bf16 weights up (2 + 2 bytes). That only pays if the host computes the update quickly. Candidates:

- `xla_cpu`:    the update as a jit on the CPU backend (`jax.devices("cpu")`), state donated;
- `xla_cpu_kN`: the same split into N independent jits dispatched back to back (PJRT CPU runs
                them concurrently if it can);
- `compute_on`: inside the accelerator's jit, `compute_on("device_host")` over pinned_host state;
- `stream`:     the state streamed in and out of the accelerator in one jit (today's "whole").

    PYTHONPATH=. python benchmarks/host_adam_probe.py [--params 774e6] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

B1, B2, EPS, WD, LR = 0.9, 0.999, 1e-8, 0.01, 1e-4


def adamw(g, w, m, v, count):
    """One AdamW step (optax.adamw's formula) on fp32 state; g may be bf16. Returns bf16 weights too."""
    g = g.astype(jnp.float32)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    mh = m / (1 - B1 ** count)
    vh = v / (1 - B2 ** count)
    w = w - LR * (mh / (jnp.sqrt(vh) + EPS) + WD * w)
    return w, m, v, w.astype(jnp.bfloat16)


def timed(f, reps):
    f()  # compile + warm
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(f())
    return (time.perf_counter() - t0) / reps


def run_xla_cpu(n, k, reps):
    cpu = jax.devices("cpu")[0]
    sizes = [len(a) for a in np.array_split(np.arange(n // 1024), k)]
    step = jax.jit(adamw, donate_argnums=(1, 2, 3))
    st = []
    for s in sizes:
        z = jax.device_put(np.zeros(s * 1024, np.float32), cpu)
        st.append([jax.device_put(np.full(s * 1024, 0.01, jnp.bfloat16), cpu), z, z + 0, z + 0])
    cnt = jax.device_put(np.float32(1), cpu)

    def once():
        outs = []
        for i, (g, w, m, v) in enumerate(st):
            w, m, v, b = step(g, w, m, v, cnt)
            st[i][1:] = [w, m, v]
            outs.append(b)
        return outs
    return timed(once, reps)


def _time_in_jit(n, reps, make_body):
    """Time one AdamW step as a jit over pinned_host state: `make_body(host, dev)` returns
    body(g, w, m, v, count) -> (w, m, v, bf16 weights) with the state in and out of host memory."""
    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
    host = NamedSharding(mesh, P(), memory_kind="pinned_host")
    dev = NamedSharding(mesh, P(), memory_kind="device")
    step = jax.jit(make_body(host, dev), donate_argnums=(1, 2, 3), out_shardings=(host, host, host, dev))
    g = jax.device_put(jnp.full((n,), 0.01, jnp.bfloat16), dev)
    st = [jax.device_put(jnp.zeros((n,), jnp.float32), host) for _ in range(3)]

    def once():
        w, m, v, b = step(g, *st, jnp.float32(1))
        st[:] = [w, m, v]
        return b
    return timed(once, reps)


def run_compute_on(n, reps):
    from jax._src import compute_on as co  # 0.10: compute_on2; 0.11: compute_on (decorator form)
    on2 = getattr(co, "compute_on2", None) or co.compute_on
    hostfn = on2(compute_type="device_host", out_memory_spaces=(jax.memory.Space.Host,) * 4)(adamw)

    def make_body(host, dev):
        def body(g, w, m, v, c):
            w, m, v, b = hostfn(jax.device_put(g, host), w, m, v, c)
            return w, m, v, jax.device_put(b, dev)
        return body
    return _time_in_jit(n, reps, make_body)


def run_device_stream(n, reps):
    def make_body(host, dev):
        def body(g, w, m, v, c):
            w, m, v = (jax.device_put(x, dev) for x in (w, m, v))
            w, m, v, b = adamw(g, w, m, v, c)
            return (*(jax.device_put(x, host) for x in (w, m, v)), b)
        return body
    return _time_in_jit(n, reps, make_body)


def run_transfer(n, reps):
    """bf16 gradient accelerator -> CPU backend and bf16 weights back, as PJRT copies."""
    cpu, acc = jax.devices("cpu")[0], jax.devices()[0]
    g = jax.device_put(jnp.full((n,), 0.01, jnp.bfloat16), acc)
    b = jax.device_put(np.full((n,), 0.01, jnp.bfloat16), cpu)
    down = timed(lambda: jax.device_put(g, cpu), reps)
    up = timed(lambda: jax.device_put(b, acc), reps)
    return down, up


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=774e6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma list of candidates")
    args = ap.parse_args(argv)
    n = int(args.params) // 1024 * 1024
    cands = {
        "xla_cpu": lambda: run_xla_cpu(n, 1, args.reps),
        "xla_cpu_k16": lambda: run_xla_cpu(n, 16, args.reps),
        "xla_cpu_k64": lambda: run_xla_cpu(n, 64, args.reps),
        "compute_on": lambda: run_compute_on(n, args.reps),
        "stream": lambda: run_device_stream(n, args.reps),
    }
    only = [c for c in args.only.split(",") if c] or list(cands)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, "
          f"{n / 1e6:.0f}M params")
    res = {"params": n, "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for name in only:
        try:
            t = cands[name]()
            res[name] = t
            print(f"{name:12s} {t * 1e3:9.1f} ms  ({n * 28 / t / 1e9:6.1f} GB/s of state traffic)")
        except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
            res[name] = repr(e).splitlines()[0][:300]
            print(f"{name:12s} FAILED {res[name]}")
            traceback.print_exc(limit=2)
    if jax.devices()[0].platform != "cpu":
        d, u = run_transfer(n, args.reps)
        res["bf16_down_s"], res["bf16_up_s"] = d, u
        print(f"bf16 {n * 2 / 1e9:.2f} GB: to CPU {n * 2 / d / 1e9:.1f} GB/s, back {n * 2 / u / 1e9:.1f} GB/s")
    print("HOSTADAM " + json.dumps(res))


if __name__ == "__main__":
    main()
