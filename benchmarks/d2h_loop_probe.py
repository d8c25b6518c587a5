"""Write-back inside a layer loop: which form of "update a slice of a pinned-host buffer from the
device" runs at the link's speed?

The optimizer-offload step spends 338 ms a step in `MemcpyOther` on the compute stream (profile,
benchmarks/measured/2026-12-01-s5/offload/), beside 150 ms each of H2D and D2H. The update loop
writes each layer's new state back by `dynamic_update_slice(host_stack, device_put(x, host))`:
if XLA materialises `device_put(x, host)` as a fresh host temporary and then copies it host->host
into the stack, every byte crosses twice, the second time as that slow "other" copy. This probe
times, over L layer slices of a stacked fp32 host buffer (read slice -> device, +1, write back):

  dus_put      dynamic_update_slice(stack, device_put(x, host))   (the library's form today)
  dus_direct   dynamic_update_slice(stack, x) with x on the device (JAX 0.10 refuses operands in
               two memory spaces; kept to see whether 0.11 does)
  list         L separate donated host arrays, each replaced by device_put(x, host) (no stack,
               no dynamic slices: the write-back aliases the donated input)
  read_only    the reads and the +1 alone (no write-back: the H2D floor)
  pipelined    software-pipelined loop: iteration j reads slice j+1 (carried to the next iteration)
               and writes slice j-1's result, so the read and the write of one iteration are
               independent and XLA may run them at once (both directions of the link)
  two_stacks   pipelined, reading from one stack and writing into a second (ping-pong between
               steps: twice the host memory), so no write waits for a read of the same buffer

    PYTHONPATH=. python3 benchmarks/d2h_loop_probe.py [--layers 36] [--mib 256]
Prints GB/s each way per form; JSON to $OUT/d2h_loop_probe.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def timed(f, x, reps=3, chained=False):
    """(seconds per call, the last output). chained: each call takes the previous call's output
    (the forms that donate their input and return the updated buffers)."""
    out = f(x)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(out if chained else x)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--mib", type=float, default=128, help="bytes per layer slice")
    ap.add_argument("--forms", default="read_only,dus_put,pipelined,two_stacks,list")
    args = ap.parse_args(argv)
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    kind = "pinned_host" if "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()} \
        else "unpinned_host"
    dev = NamedSharding(mesh, P(), memory_kind="device")
    host = NamedSharding(mesh, P(), memory_kind=kind)
    L, n = args.layers, int(args.mib * 2**20 / 4)
    stack = jax.jit(lambda: jnp.zeros((L, n), jnp.float32), out_shardings=host)()
    gb = L * n * 4 / 1e9
    res = {"layers": L, "gb_each_way": gb, "device": jax.devices()[0].device_kind, "forms": {}}

    def read(buf, j):
        return jax.device_put(jax.lax.dynamic_index_in_dim(buf, j, keepdims=False), dev)

    forms = {}
    forms["read_only"] = jax.jit(lambda b: jax.lax.fori_loop(
        0, L, lambda j, acc: acc + read(b, j).sum(), jnp.float32(0)), out_shardings=NamedSharding(mesh, P()))

    def dus_put(b):
        def body(j, b):
            x = read(b, j) + 1
            return jax.lax.dynamic_update_index_in_dim(b, jax.device_put(x, host), j, 0)
        return jax.lax.fori_loop(0, L, body, b)
    forms["dus_put"] = jax.jit(dus_put, donate_argnums=0, out_shardings=host)

    def dus_direct(b):
        def body(j, b):
            x = read(b, j) + 1
            return jax.lax.dynamic_update_index_in_dim(b, x, j, 0)
        return jax.lax.fori_loop(0, L, body, b)
    forms["dus_direct"] = jax.jit(dus_direct, donate_argnums=0, out_shardings=host)

    def pipelined(b):
        # carry: (buffer, slice j on the device, result of slice j-1 on the device)
        def body(j, c):
            b, cur, prev = c
            nxt = read(b, jnp.minimum(j + 1, L - 1))                     # read j+1 ...
            b = jax.lax.dynamic_update_index_in_dim(b, jax.device_put(prev, host), jnp.maximum(j - 1, 0), 0)
            return b, nxt, cur + 1                                         # ... write j-1, compute j
        first = read(b, 0)
        b, _, last = jax.lax.fori_loop(0, L, body, (b, first, read(b, 0) + 1))
        return jax.lax.dynamic_update_index_in_dim(b, jax.device_put(last, host), L - 1, 0)
    forms["pipelined"] = jax.jit(pipelined, donate_argnums=0, out_shardings=host)

    def two_stacks(bs):
        src, dst = bs
        def body(j, c):
            dst, cur, prev = c
            nxt = read(src, jnp.minimum(j + 1, L - 1))
            dst = jax.lax.dynamic_update_index_in_dim(dst, jax.device_put(prev, host), jnp.maximum(j - 1, 0), 0)
            return dst, nxt, cur + 1
        dst, _, last = jax.lax.fori_loop(0, L, body, (dst, read(src, 0), read(src, 0) + 1))
        return dst_last(dst, last), src                                     # swapped for the next call
    dst_last = lambda dst, last: jax.lax.dynamic_update_index_in_dim(dst, jax.device_put(last, host), L - 1, 0)  # noqa: E731
    forms["two_stacks"] = jax.jit(two_stacks, donate_argnums=0, out_shardings=(host, host))

    parts = [jax.jit(lambda: jnp.zeros((n,), jnp.float32), out_shardings=host)() for _ in range(L)]
    forms["list"] = jax.jit(lambda xs: [jax.device_put(jax.device_put(x, dev) + 1, host) for x in xs],
                            donate_argnums=0, out_shardings=[host] * L)

    for name in args.forms.split(","):
        f = forms[name]
        try:
            if name == "two_stacks":
                pair = (stack, jax.jit(lambda: jnp.zeros((L, n), jnp.float32), out_shardings=host)())
                t, out = timed(f, pair, chained=True)
                stack = out[0]
            elif name == "list":
                t, parts = timed(f, parts, chained=True)
            elif name == "read_only":
                t, _ = timed(f, stack)
            else:
                t, stack = timed(f, stack, chained=True)
            res["forms"][name] = {"s": t, "gbps_each_way": gb / t}
            print(f"{name:<11} {t * 1e3:8.1f} ms  {gb / t:6.1f} GB/s each way ({gb:.1f} GB)", flush=True)
        except Exception as e:  # noqa: BLE001 -- a form XLA refuses is a result too
            res["forms"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name:<11} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "d2h_loop_probe.json"), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
