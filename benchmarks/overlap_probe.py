"""Do the runtime's host<->device transfers overlap a running jitted program?

Optimizer offload can only beat "forward/backward + transfers" if the transfers run while the
forward/backward computes. This probe times, on one device:

  compute       a jitted chain of bf16 matmuls (~--compute-ms)
  h2d / d2h     --pieces arrays of --piece-mib MiB, pinned host -> device / device -> pinned host,
                each one `jax.device_put` (the runtime's transfer), or `--via jit`: a jitted identity
                with the other memory kind as its output
  both          h2d and d2h at once
  compute+h2d, compute+d2h, compute+both
                the transfers dispatched right after the compute (nothing depends on it)
  h2d+compute   the transfers dispatched first

and prints each case's ms beside "serial" (the sum of its parts) and "ideal" (their max).

    PYTHONPATH=. python3 benchmarks/overlap_probe.py [--pieces 16] [--piece-mib 128] [--compute-ms 100]
JSON to $OUT/overlap_probe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pieces", type=int, default=16)
    ap.add_argument("--piece-mib", type=int, default=128)
    ap.add_argument("--compute-ms", type=float, default=100.0)
    ap.add_argument("--via", choices=("device_put", "jit"), default="device_put")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    on_dev = SingleDeviceSharding(dev, memory_kind="device")
    host_kind = "pinned_host" if "pinned_host" in {m.kind for m in dev.addressable_memories()} else "unpinned_host"
    on_host = SingleDeviceSharding(dev, memory_kind=host_kind)
    n = args.piece_mib * 2 ** 20 // 4
    host = [jax.device_put(jnp.full((n,), i, jnp.float32), on_host) for i in range(args.pieces)]
    devs = [jax.device_put(jnp.full((n,), i, jnp.float32), on_dev) for i in range(args.pieces)]
    jax.block_until_ready((host, devs))

    if args.via == "jit":
        to_dev = jax.jit(lambda x: x, out_shardings=on_dev)
        to_host = jax.jit(lambda x: x, out_shardings=on_host)
    else:
        to_dev = lambda x: jax.device_put(x, on_dev)  # noqa: E731
        to_host = lambda x: jax.device_put(x, on_host)  # noqa: E731

    size = 8192 if dev.platform == "gpu" else 512
    a = jax.device_put(jnp.ones((size, size), jnp.bfloat16) * 0.001, on_dev)

    def chain(x, k):
        def body(_, y):
            return (y @ x) * 0.5
        return jax.lax.fori_loop(0, k, body, x)

    def compute_fn(k):
        return jax.jit(chain, static_argnums=1).lower(a, k).compile()

    # calibrate the chain's length to about --compute-ms
    one = compute_fn(8)
    jax.block_until_ready(one(a))
    t0 = time.perf_counter()
    jax.block_until_ready(one(a))
    per = (time.perf_counter() - t0) / 8
    k = max(1, int(args.compute_ms / 1e3 / per))
    comp = compute_fn(k)
    jax.block_until_ready(comp(a))

    def h2d():
        return [to_dev(x) for x in host]

    def d2h():
        return [to_host(x) for x in devs]

    cases = {
        "compute": lambda: [comp(a)],
        "h2d": h2d,
        "d2h": d2h,
        "both": lambda: h2d() + d2h(),
        "compute+h2d": lambda: [comp(a)] + h2d(),
        "compute+d2h": lambda: [comp(a)] + d2h(),
        "compute+both": lambda: [comp(a)] + h2d() + d2h(),
        "h2d+compute": lambda: h2d() + [comp(a)],
        "both+compute": lambda: h2d() + d2h() + [comp(a)],
    }
    ms = {}
    for name, fn in cases.items():
        jax.block_until_ready(fn())
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best = min(best, time.perf_counter() - t0)
        ms[name] = best * 1e3
    gb = args.pieces * args.piece_mib * 2 ** 20 / 1e9
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, via {args.via}: {args.pieces} x "
          f"{args.piece_mib} MiB ({gb:.2f} GB) each way, compute {ms['compute']:.1f} ms ({k} matmuls)")
    print(f"{'case':14s} {'ms':>8s} {'serial':>8s} {'ideal':>8s}")
    parts = {"compute+h2d": ("compute", "h2d"), "compute+d2h": ("compute", "d2h"),
             "compute+both": ("compute", "both"), "h2d+compute": ("compute", "h2d"),
             "both+compute": ("compute", "both"), "both": ("h2d", "d2h")}
    for name, v in ms.items():
        p = parts.get(name)
        ser = f"{sum(ms[x] for x in p):8.1f}" if p else " " * 8
        ide = f"{max(ms[x] for x in p):8.1f}" if p else " " * 8
        extra = f"  {gb / ms[name] * 1e3:.1f} GB/s" if name in ("h2d", "d2h", "both") else ""
        print(f"{name:14s} {v:8.1f} {ser} {ide}{extra}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"overlap_probe_{args.via}.json"), "w") as f:
            json.dump({"ms": ms, "gb_each_way": gb, "matmuls": k, "via": args.via,
                       "device": jax.devices()[0].device_kind, "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
