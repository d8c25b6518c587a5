"""Host <-> device bandwidth inside one jitted program: in alone, out alone, and both at once.

Whether the two directions overlap decides how fast a streamed optimizer update can be: the
offloaded fp32 master and Adam moments go in and come back every step.

    PYTHONPATH=. python benchmarks/pcie_probe.py [--gib 2] [--pieces 8]
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def timed(f, *args, reps=5):
    out = f(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="bytes each way")
    ap.add_argument("--pieces", type=int, default=8, help="arrays per direction")
    args = ap.parse_args(argv)
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    dev = NamedSharding(mesh, P(), memory_kind="device")
    host = NamedSharding(mesh, P(), memory_kind="pinned_host")
    n = int(args.gib * 2**30 / 4 / args.pieces)
    make = jax.jit(lambda: [jnp.full((n,), i, jnp.float32) for i in range(args.pieces)],
                   out_shardings=[dev] * args.pieces)
    on_dev = make()
    on_host = jax.jit(lambda xs: xs, out_shardings=[host] * args.pieces)(make())
    k = args.pieces
    h2d = jax.jit(lambda xs: [x + 1 for x in xs], out_shardings=[dev] * k)          # in, then add on device
    d2h = jax.jit(lambda xs: [x + 1 for x in xs], out_shardings=[host] * k)         # add, then out
    both = jax.jit(lambda hs, ds: ([x + 1 for x in hs], [y + 1 for y in ds]),
                   out_shardings=([dev] * k, [host] * k))
    gb = k * n * 4 / 1e9
    t_in, t_out, t_both = timed(h2d, on_host), timed(d2h, on_dev), timed(both, on_host, on_dev)
    res = {"gb_each_way": gb, "in_s": t_in, "out_s": t_out, "both_s": t_both,
           "in_gbps": gb / t_in, "out_gbps": gb / t_out, "both_gbps_total": 2 * gb / t_both,
           "overlap": (t_in + t_out) / t_both, "device": jax.devices()[0].device_kind}
    print(f"{gb:.2f} GB each way: in {gb / t_in:.1f} GB/s, out {gb / t_out:.1f} GB/s, both at once "
          f"{2 * gb / t_both:.1f} GB/s total ({res['overlap']:.2f}x the serial time)")
    print("PCIE " + json.dumps(res))


if __name__ == "__main__":
    main()
