"""Optimizer offload's update with GPT-2-shaped layers: one jitted program, or driven from Python?

`d2h_loop_probe.py` found (session 9, one H200) that 36 x 128 MiB arrays read to the device, +1,
and written back run both ways at once when Python drives each layer through the runtime's own
transfers (`host_loop`, 39.5 GB/s each way) and one after the other inside one jitted program
(`list`, 27.2). The real update differs: each layer is 12 leaves of 5 KB to 26 MB, in three fp32
copies (master, Adam's two moments), plus a bf16 gradient in and a bf16 compute copy out. This
probe times that update over L layers of GPT-2 shapes (d_model d), state in pinned host memory:

  in_jit     one jitted program, each layer's state device_put in, AdamW, device_put out (the
             form of zerojax's paired loop without its barriers)
  gated2     the same with zerojax's paired barriers (offload.update._paired_update)
  host_loop  Python per layer: jax.device_put of the layer's state to the device, a jitted
             AdamW (state donated), jax.device_put of the new state back to pinned host
  host_loop_tree  the same, each layer's state moved by one device_put of its whole tree

  --packed   each state of a layer as one flat array (3 copies each way a layer instead of 36)

    PYTHONPATH=. python3 benchmarks/host_update_probe.py [--layers 36] [--d 1280] [--forms a,b] [--packed]
Prints ms per update and GB/s each way (12 bytes a parameter); JSON to $OUT/host_update_probe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

FORMS = "in_jit,gated2,host_loop,host_loop_tree"


def layer_shapes(d):
    return {"ln_1": {"scale": (d,), "bias": (d,)}, "attn": {"c_attn": {"kernel": (d, 3 * d), "bias": (3 * d,)},
                                                          "c_proj": {"kernel": (d, d), "bias": (d,)}},
            "ln_2": {"scale": (d,), "bias": (d,)}, "mlp": {"c_fc": {"kernel": (d, 4 * d), "bias": (4 * d,)},
                                                           "c_proj": {"kernel": (4 * d, d), "bias": (d,)}}}


def adamw(g, m, mu, nu, lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, count=1):
    """Elementwise AdamW on one leaf (bias-corrected at `count`) -> (master, mu, nu, bf16 copy)."""
    import jax.numpy as jnp
    g = g.astype(jnp.float32)
    mu = b1 * mu + (1 - b1) * g
    nu = b2 * nu + (1 - b2) * g * g
    upd = (mu / (1 - b1 ** count)) / (jnp.sqrt(nu / (1 - b2 ** count)) + eps) + wd * m
    m = m - lr * upd
    return m, mu, nu, m.astype(jnp.bfloat16)


def update_tree(g, st):
    import jax
    m, mu, nu = st
    out = jax.tree.map(adamw, g, m, mu, nu)
    pick = lambda i: jax.tree.map(lambda t: t[i], out, is_leaf=lambda t: isinstance(t, tuple))  # noqa: E731
    return (pick(0), pick(1), pick(2)), pick(3)


def run(args):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    kind = "pinned_host" if "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()} \
        else "unpinned_host"
    dev, host = NamedSharding(mesh, P(), memory_kind="device"), NamedSharding(mesh, P(), memory_kind=kind)
    shapes = layer_shapes(args.d)
    if args.packed:  # each state of a layer as one flat array: 3 copies each way a layer, not 36
        shapes = {"flat": (sum(int(jnp.prod(jnp.array(s))) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))),)}
    L = args.layers
    n_params = L * sum(int(jnp.prod(jnp.array(s))) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
    gb = 12 * n_params / 1e9
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731

    def make_state():
        mk = jax.jit(lambda: jax.tree.map(lambda s: jnp.full(s, 0.5, jnp.float32), shapes, is_leaf=is_shape),
                     out_shardings=host)
        return [(mk(), mk(), mk()) for _ in range(L)]
    grads = [jax.jit(lambda: jax.tree.map(lambda s: jnp.full(s, 0.01, jnp.bfloat16), shapes, is_leaf=is_shape),
                     out_shardings=dev)() for _ in range(L)]

    def to(tree, s):
        return jax.tree.map(lambda x: jax.device_put(x, s), tree)

    def in_jit(states, gs, gated=False):
        new, cps = [], []
        cur = to(states[0], dev)
        for j in range(L):
            st, cp = update_tree(gs[j], cur)
            cps.append(cp)
            if j + 1 < L and gated:
                nxt_h, st = jax.lax.optimization_barrier((states[j + 1], st))
                back, cur = jax.lax.optimization_barrier((to(st, host), to(nxt_h, dev)))
            else:
                back = to(st, host)
                if j + 1 < L:
                    cur = to(states[j + 1], dev)
            new.append(back)
        return new, cps
    forms = {
        "in_jit": jax.jit(lambda s, g: in_jit(s, g), donate_argnums=0, out_shardings=([(host,) * 3] * L, [dev] * L)),
        "gated2": jax.jit(lambda s, g: in_jit(s, g, True), donate_argnums=0,
                          out_shardings=([(host,) * 3] * L, [dev] * L)),
    }
    one = jax.jit(update_tree, donate_argnums=1)

    def host_loop(states, gs):
        new, cps = [], []
        for st, g in zip(states, gs):
            st, cp = one(g, to(st, dev))
            new.append(to(st, host))
            cps.append(cp)
        return new, cps
    forms["host_loop"] = host_loop

    def host_loop_tree(states, gs):
        """host_loop with each layer's state moved by one device_put of the whole tree (JAX's
        batched transfer) rather than one call a leaf."""
        new, cps = [], []
        for st, g in zip(states, gs):
            st, cp = one(g, jax.device_put(st, dev))
            new.append(jax.device_put(st, host))
            cps.append(cp)
        return new, cps
    forms["host_loop_tree"] = host_loop_tree

    res = {"layers": L, "d": args.d, "packed": args.packed, "params": n_params, "gb_each_way": gb,
           "device": jax.devices()[0].device_kind, "forms": {}}
    for name in args.forms.split(","):
        try:
            states = make_state()
            states, cps = forms[name](states, grads)  # compile + first run
            jax.block_until_ready((states, cps))
            t0 = time.perf_counter()
            for _ in range(args.reps):
                states, cps = forms[name](states, grads)
            jax.block_until_ready((states, cps))
            t = (time.perf_counter() - t0) / args.reps
            leaf = jax.tree.leaves(states[0][0])[0]
            value = float(jax.device_put(leaf, dev)[0])  # 0.5 after 1 + reps updates of AdamW
            res["forms"][name] = {"s": t, "gbps_each_way": gb / t, "master_0": value}
            print(f"{name:<10} {t * 1e3:8.1f} ms  {gb / t:6.1f} GB/s each way ({gb:.2f} GB, master[0] {value:.6f})",
                  flush=True)
            del states, cps
        except Exception as e:  # noqa: BLE001 -- a form the runtime refuses is a result too
            res["forms"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name:<10} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--d", type=int, default=1280, help="d_model (GPT-2 Large: 1280)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--forms", default=FORMS)
    ap.add_argument("--packed", action="store_true", help="one flat array per state a layer (not 12 leaves)")
    args = ap.parse_args(argv)
    res = run(args)
    if os.environ.get("OUT"):
        name = "host_update_probe_packed.json" if args.packed else "host_update_probe.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
