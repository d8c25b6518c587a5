"""Write-back inside a layer loop: which form of "update a slice of a pinned-host buffer from the
device" runs at the link's speed, and which runs the reads and the writes at once?

The optimizer-offload step reads each layer's fp32 state from pinned host memory, updates it and
writes it back. Session 5 found the writes on the compute stream at ~27 GB/s, serialised with the
reads (reads alone 54 GB/s; the link does 51 GB/s each way when both directions run at once,
benchmarks/pcie_probe.py). This probe times, over L layer slices of a stacked fp32 host buffer
(read slice -> device, +1, write back), one jitted form each:

  read_only    the reads and the +1 alone (no write-back: the H2D floor)
  write_only   a device value written into every slice (no reads: the D2H floor)
  dus_put      dynamic_update_slice(stack, device_put(x, host)) in a fori_loop (the library's
               form in session 5): read j+1 reads the buffer write j produced, a true dependency
  dus_direct   dynamic_update_slice(stack, x) with x on the device
  list         L separate donated host arrays, each replaced by device_put(x, host) (unrolled,
               no dependency between one array's write and the next one's read)
  pipelined    hand-pipelined fori_loop on one stack: iteration j reads j+1, writes j-1
  two_stacks   pipelined, reading one stack and writing a second
  pingpong     fori_loop reading slice j of `src` (not carried) and writing slice j of `dst`
               (carried, donated): no write waits for a read of the same buffer; the two
               buffers swap every call (twice the host memory)
  scan_ys      lax.scan with the stack as xs (each slice brought to the device) and the new
               slices as ys put in pinned_host: the shape of XLA's activation offloading (the
               host offloader makes the ys stack a host buffer written by async copies); the
               output is a fresh stack, the donated input freed after the loop
  scan_ys_u2   the same, unroll=2 (two layers a loop iteration: room to overlap one layer's
               write with the next one's read)
  scan_ys3     scan_ys over three stacks of a third of the bytes each (master and two moments)
  pingpong_u2  pingpong with the fori_loop unrolled by 2
  gated        L separate arrays, unrolled; array j+1's read gated on array j's result by an
               optimization barrier, so it is issued beside array j's write-back (whole-array
               copies, which benchmarks/pcie_probe.py saw overlap); gated2: the next update also
               waits for both; gated_stack: the same on slices of two stacks (static indices)
  host_loop    L separate arrays driven from Python, a layer at a time: device_put in, a jitted
               +1, device_put out (the runtime's transfers, not one XLA program's schedule);
               host_loop_jit: one small jitted program per layer doing the three

Measured on one H200 (JAX 0.11.2, 36 x 128 MiB, 4.8 GB each way; benchmarks/measured/2026-12-01-s6/):
reads alone 89 ms (54.3 GB/s), writes alone 90 ms (54.0); dus_put, list, pingpong, pingpong_u2
178 ms (27.2 GB/s each way = the two one after the other) under every flag set, also where the
pipelined-host-offloading flag did rotate the write of j-1 beside the read of j+1 in the loop body
(its optimised HLO); scan_ys / scan_ys3 727-829 ms (5.8-6.6 GB/s); scan_ys_u2 an XLA layout error.
Gated (batch 2): list 177 ms (27.3), gated 152 ms (31.7), gated2 100 ms (48.1 GB/s each way),
gated_stack 189 ms (25.6): whole-array copies paired by both barriers run at once; slices do not.

Flag sets (--sweep: one process each, since XLA reads XLA_FLAGS once): default, the latency-
hiding scheduler (lhs), lhs + while-loop double buffering (dbuf), lhs + pipelined host offloading
(the collective pipeliner rotating host writes / reads across scan iterations: pipe),
host-memory offloading (hmo).

    PYTHONPATH=. python3 benchmarks/d2h_loop_probe.py [--layers 36] [--mib 128] [--forms a,b]
    PYTHONPATH=. python3 benchmarks/d2h_loop_probe.py --sweep [--budget 140]
Prints GB/s each way per form; JSON to $OUT/d2h_loop_probe.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_FORMS = "read_only,write_only,dus_put,list,pingpong,pingpong_u2,scan_ys,scan_ys_u2,scan_ys3"
LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
FLAG_SETS = {   # name -> (XLA flags, forms worth timing under them), in the order --sweep runs them
    "default": ("", DEFAULT_FORMS),
    "pipe": (f"{LHS} --xla_gpu_enable_pipelined_host_offloading=true", "dus_put,pingpong,scan_ys,scan_ys_u2,scan_ys3"),
    "lhs": (LHS, "dus_put,list,pingpong,pingpong_u2,scan_ys,scan_ys_u2"),
    "dbuf": (f"{LHS} --xla_gpu_enable_while_loop_double_buffering=true", "dus_put,pingpong,scan_ys"),
    "hmo": ("--xla_gpu_enable_host_memory_offloading=true", "dus_put,scan_ys"),
    "gated": ("", "list,gated,gated2,gated_stack"),
    "gated_lhs": (LHS, "gated,gated_stack"),
}
SLOW_S = 3.0  # a first call slower than this is timed once (the pathological forms take 40 s a call)


def timed(f, x, reps=3, chained=False):
    """(seconds per call, the last output). chained: each call takes the previous call's output
    (the forms that donate their input and return the updated buffers). A first call (compile +
    run) over SLOW_S is timed alone again, once, instead of `reps` times."""
    import jax
    t0 = time.perf_counter()
    out = f(x)
    jax.block_until_ready(out)
    if time.perf_counter() - t0 > SLOW_S:
        reps = 1
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(out if chained else x)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps, out


def build_forms(L, n, dev, host):
    """name -> (jitted function, make its first input, chained)."""
    import jax
    import jax.numpy as jnp

    def zeros_stack():
        return jax.jit(lambda: jnp.zeros((L, n), jnp.float32), out_shardings=host)()

    def read(buf, j):
        return jax.device_put(jax.lax.dynamic_index_in_dim(buf, j, keepdims=False), dev)

    def back(b, x, j):
        return jax.lax.dynamic_update_index_in_dim(b, jax.device_put(x, host), j, 0)

    forms = {}
    forms["read_only"] = (jax.jit(lambda b: jax.lax.fori_loop(
        0, L, lambda j, acc: acc + read(b, j).sum(), jnp.float32(0)), out_shardings=dev), zeros_stack, False)

    def write_only(b):
        x = jnp.ones((n,), jnp.float32)
        return jax.lax.fori_loop(0, L, lambda j, b: back(b, x + j, j), b)
    forms["write_only"] = (jax.jit(write_only, donate_argnums=0, out_shardings=host), zeros_stack, True)

    def dus_put(b):
        return jax.lax.fori_loop(0, L, lambda j, b: back(b, read(b, j) + 1, j), b)
    forms["dus_put"] = (jax.jit(dus_put, donate_argnums=0, out_shardings=host), zeros_stack, True)

    def dus_direct(b):
        return jax.lax.fori_loop(0, L, lambda j, b: jax.lax.dynamic_update_index_in_dim(b, read(b, j) + 1, j, 0), b)
    forms["dus_direct"] = (jax.jit(dus_direct, donate_argnums=0, out_shardings=host), zeros_stack, True)

    def pipelined(b):
        def body(j, c):  # carry: (buffer, slice j on the device, result of slice j-1 on the device)
            b, cur, prev = c
            nxt = read(b, jnp.minimum(j + 1, L - 1))
            return back(b, prev, jnp.maximum(j - 1, 0)), nxt, cur + 1
        b, _, last = jax.lax.fori_loop(0, L, body, (b, read(b, 0), read(b, 0) + 1))
        return back(b, last, L - 1)
    forms["pipelined"] = (jax.jit(pipelined, donate_argnums=0, out_shardings=host), zeros_stack, True)

    def two_stacks(bs):
        src, dst = bs
        def body(j, c):
            dst, cur, prev = c
            nxt = read(src, jnp.minimum(j + 1, L - 1))
            return back(dst, prev, jnp.maximum(j - 1, 0)), nxt, cur + 1
        dst, _, last = jax.lax.fori_loop(0, L, body, (dst, read(src, 0), read(src, 0) + 1))
        return src, back(dst, last, L - 1)
    pair = lambda: (zeros_stack(), zeros_stack())  # noqa: E731
    # each output where its input was (a swapped output tuple made XLA copy both buffers: the 2.0 s
    # of session 5's two_stacks); the caller swaps them between calls
    def swapped(g):
        call = lambda bs: g(bs)[::-1]  # noqa: E731
        call.jitted = g
        return call
    forms["two_stacks"] = (swapped(jax.jit(two_stacks, donate_argnums=0, out_shardings=(host, host))), pair, True)

    def pingpong(bs, unroll=1):
        src, dst = bs
        return src, jax.lax.fori_loop(0, L, lambda j, dst: back(dst, read(src, j) + 1, j), dst, unroll=unroll)
    forms["pingpong"] = (swapped(jax.jit(pingpong, donate_argnums=0, out_shardings=(host, host))), pair, True)
    forms["pingpong_u2"] = (swapped(jax.jit(lambda bs: pingpong(bs, 2), donate_argnums=0,
                                            out_shardings=(host, host))), pair, True)

    def parts():
        return [jax.jit(lambda: jnp.zeros((n,), jnp.float32), out_shardings=host)() for _ in range(L)]
    forms["list"] = (jax.jit(lambda xs: [jax.device_put(jax.device_put(x, dev) + 1, host) for x in xs],
                             donate_argnums=0, out_shardings=[host] * L), parts, True)

    def gated(xs, done_too=False):
        """Unrolled over L separate arrays; array j+1's read is gated on array j's result by an
        optimization barrier, so it is issued beside array j's write-back (a pair of whole-array
        copies, which pcie_probe.py saw overlap at 51 GB/s each way); done_too: the next update
        also waits for both copies of the pair."""
        out, cur = [], jax.device_put(xs[0], dev) + 1
        for j in range(L):
            if j + 1 < L:
                h, cur = jax.lax.optimization_barrier((xs[j + 1], cur))
                nxt, back = jax.device_put(h, dev), jax.device_put(cur, host)
                if done_too:
                    nxt, back = jax.lax.optimization_barrier((nxt, back))
                out.append(back)
                cur = nxt + 1
            else:
                out.append(jax.device_put(cur, host))
        return out
    forms["gated"] = (jax.jit(gated, donate_argnums=0, out_shardings=[host] * L), parts, True)
    forms["gated2"] = (jax.jit(lambda xs: gated(xs, True), donate_argnums=0, out_shardings=[host] * L),
                       parts, True)

    add1 = jax.jit(lambda x: x + 1, donate_argnums=0)

    def host_loop(xs):
        """Driven from Python, one layer at a time: device_put to the device, a jitted +1,
        device_put back to pinned host; nothing waits (JAX dispatches asynchronously), so the
        runtime's own transfers decide whether reads, updates and writes overlap."""
        return [jax.device_put(add1(jax.device_put(x, dev)), host) for x in xs]
    forms["host_loop"] = (host_loop, parts, True)
    one_layer = jax.jit(lambda x: jax.device_put(jax.device_put(x, dev) + 1, host), donate_argnums=0,
                        out_shardings=host)
    forms["host_loop_jit"] = (lambda xs: [one_layer(x) for x in xs], parts, True)

    def gated_stack(bs):
        """gated on slices: read slice j+1 of `src` beside writing slice j into `dst` (static
        indices, unrolled), to tell whether slices of a stacked host buffer can overlap too."""
        src, dst = bs
        cur = jax.device_put(src[0], dev) + 1
        for j in range(L):
            if j + 1 < L:
                h, cur = jax.lax.optimization_barrier((src[j + 1], cur))
                nxt = jax.device_put(h, dev)
            dst = dst.at[j].set(jax.device_put(cur, host))
            if j + 1 < L:
                cur = nxt + 1
        return src, dst
    forms["gated_stack"] = (swapped(jax.jit(gated_stack, donate_argnums=0, out_shardings=(host, host))),
                            pair, True)

    def scan_ys(b, unroll=1):
        body = lambda c, x: (c, jax.device_put(jax.device_put(x, dev) + 1, host))  # noqa: E731
        return jax.lax.scan(body, None, b, unroll=unroll)[1]
    forms["scan_ys"] = (jax.jit(scan_ys, donate_argnums=0, out_shardings=host), zeros_stack, True)
    forms["scan_ys_u2"] = (jax.jit(lambda b: scan_ys(b, 2), donate_argnums=0, out_shardings=host),
                           zeros_stack, True)

    # the update's shape: three stacks (master, two moments), a third of the bytes each
    def three():
        return jax.jit(lambda: [jnp.zeros((L, n // 3), jnp.float32)] * 3, out_shardings=[host] * 3)()

    def scan_ys3(bs):
        body = lambda c, xs: (c, [jax.device_put(jax.device_put(x, dev) + 1, host) for x in xs])  # noqa: E731
        return jax.lax.scan(body, None, bs)[1]
    forms["scan_ys3"] = (jax.jit(scan_ys3, donate_argnums=0, out_shardings=[host] * 3), three, True)
    return forms


def save_hlo(f, make, path):
    """The form's optimised HLO (where XLA put the host copies: copy-start, async dynamic-(update-)
    slice on S(5) buffers, their stream ids), gzipped."""
    import gzip
    f = getattr(f, "jitted", f)
    with gzip.open(path, "wt") as fh:
        fh.write(f.lower(make()).compile().as_text())


def run_forms(args):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    kind = "pinned_host" if "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()} \
        else "unpinned_host"
    dev = NamedSharding(mesh, P(), memory_kind="device")
    host = NamedSharding(mesh, P(), memory_kind=kind)
    L, n = args.layers, int(args.mib * 2**20 / 4)
    gb = L * n * 4 / 1e9
    res = {"layers": L, "gb_each_way": gb, "device": jax.devices()[0].device_kind,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "forms": {}}
    forms = build_forms(L, n, dev, host)
    for name in args.forms.split(","):
        f, make, chained = forms[name]
        try:
            t, out = timed(f, make(), chained=chained)
            check = None
            if name not in ("read_only", "write_only"):  # every slice went through +1 (1 + reps) times
                first = out[0] if isinstance(out, (list, tuple)) else out
                check = float(jax.device_put(first[0, :1] if first.ndim == 2 else first[:1], dev)[0])
            del out
            if name in args.hlo_forms.split(",") and os.environ.get("OUT"):
                save_hlo(f, make, os.path.join(os.environ["OUT"], f"hlo_{args.tag}_{name}.txt.gz"))
            res["forms"][name] = {"s": t, "gbps_each_way": gb / t, "value": check}
            print(f"{name:<11} {t * 1e3:8.1f} ms  {gb / t:6.1f} GB/s each way ({gb:.1f} GB)", flush=True)
        except Exception as e:  # noqa: BLE001 -- a form XLA refuses is a result too
            res["forms"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name:<11} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    return res


def sweep(args):
    """Each flag set in its own process (its own XLA_FLAGS), stopping before `args.budget` s."""
    here, t_end = os.path.abspath(__file__), time.monotonic() + args.budget
    out, rows = {"sets": {}}, []
    for name in args.sets.split(","):
        flags, forms = FLAG_SETS[name]
        left = t_end - time.monotonic()
        if left < 15:
            print(f"== {name}: skipped, {left:.0f} s left", flush=True)
            continue
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        cmd = [sys.executable, here, "--layers", str(args.layers), "--mib", str(args.mib), "--forms", forms,
               "--json", "-", "--tag", name, "--hlo-forms", args.hlo_forms]
        print(f"== {name} ({flags or 'no flags'})", flush=True)
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left - 5)
            lines = p.stdout.splitlines()
            res = json.loads(next((ln[5:] for ln in lines if ln.startswith("JSON ")), "{}") or "{}")
            print("\n".join(ln for ln in lines if not ln.startswith("JSON ")), flush=True)
            if p.returncode:
                print(p.stderr[-600:], flush=True)
        except subprocess.TimeoutExpired as e:
            res = {"error": "timeout"}
            print((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""),
                  f"\n{name}: timed out", flush=True)
        out["sets"][name] = {"flags": flags, **res}
        for form, r in res.get("forms", {}).items():
            rows.append((name, form, r))
    print("\n| flags | form | ms | GB/s each way |\n|---|---|---:|---:|")
    for name, form, r in rows:
        print(f"| {name} | {form} | " + (f"{r['s'] * 1e3:.1f} | {r['gbps_each_way']:.1f} |" if "s" in r
                                         else f"failed: {r.get('error', '')[:60]} | |"))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--mib", type=float, default=128, help="bytes per layer slice")
    ap.add_argument("--forms", default=DEFAULT_FORMS)
    ap.add_argument("--sweep", action="store_true", help="every flag set, one process each")
    ap.add_argument("--sets", default="default,pipe,lhs,dbuf,hmo", help=f"flag sets for --sweep, of {list(FLAG_SETS)}")
    ap.add_argument("--budget", type=float, default=140, help="--sweep stops before this many seconds")
    ap.add_argument("--hlo-forms", default="", help="forms whose optimised HLO goes to $OUT/hlo_<tag>_<form>.txt.gz")
    ap.add_argument("--tag", default="run", help="name of this run in the HLO file names")
    ap.add_argument("--json", default=None, help="'-': print the result as one JSON line (for --sweep)")
    args = ap.parse_args(argv)
    res = sweep(args) if args.sweep else run_forms(args)
    if args.json == "-":
        print("JSON " + json.dumps(res), flush=True)
    elif os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "d2h_loop_probe.json"), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
