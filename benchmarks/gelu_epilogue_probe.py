"""Does XLA fuse GPT-2's bias + gelu_new into the c_fc gemm (cuBLASLt BIAS_GELU[_AUX] epilogue)?

Issue #18: the micro-8 step spends ~4.6 ms a step in the gelu's forward and recompute passes
(`loop_multiply_fusion` / `loop_convert_fusion`, [8,1024,5120] bf16 each, 36 launches) and the
optimized HLO of the whole step shows every gemm with `"epilogue":"DEFAULT"`: neither the bias nor
the gelu is fused, although XLA's GemmRewriter matches exactly this tanh form. This probe compiles
the MLP of one GPT-2 Large layer in several spellings, forward alone and forward + backward under
`jax.checkpoint`, and prints for each: the gemm epilogues XLA chose, how many fusions still hold
a tanh, and the time per call. Run it once plainly and once with XLA_FLAGS naming a flag to try.

    python3 benchmarks/gelu_epilogue_probe.py [--dump DIR] [--json FILE]
"""
from __future__ import annotations

import argparse
import collections
import json
import re

import jax
import jax.numpy as jnp

from pcie_probe import timed  # benchmarks/ is the script's directory

B, T, D, M = 8, 1024, 1280, 5120
C = 0.7978845608028654  # sqrt(2 / pi)


def gelu_jax(h):
    return jax.nn.gelu(h, approximate=True)


def gelu_f32(h):
    return jax.nn.gelu(h.astype(jnp.float32), approximate=True).astype(h.dtype)


def gelu_pattern(h):
    """GemmRewriter's own spelling: x * (0.5 * (1 + tanh(c * (x + 0.044715 * (x * (x * x))))))."""
    half, one = jnp.asarray(0.5, h.dtype), jnp.asarray(1.0, h.dtype)
    inner = jnp.asarray(C, h.dtype) * (h + jnp.asarray(0.044715, h.dtype) * (h * (h * h)))
    return h * (half * (one + jnp.tanh(inner)))


def mlp(x, w1, b1, w2, act, bias=True):
    h = jnp.einsum("btd,dm->btm", x, w1)
    if bias:
        h = h + b1
    return jnp.einsum("btm,md->btd", act(h), w2)


def mlp_2d(x, w1, b1, w2, act, bias=True):
    """The same on a [B*T, D] matrix (no batch dims for the rewriter to see through)."""
    h = x.reshape(B * T, D) @ w1
    if bias:
        h = h + b1
    return (act(h) @ w2).reshape(B, T, D)


def gelu_model(h):
    from zerojax.models.gpt2 import gelu_new  # the model's custom VJP (session 12)
    return gelu_new(h)


VARIANTS = {
    "model_gelu_new": (mlp, gelu_model, True),
    "jax_gelu": (mlp, gelu_jax, True),
    "jax_gelu_nobias": (mlp, gelu_jax, False),
    "f32_gelu": (mlp, gelu_f32, True),
    "pattern": (mlp, gelu_pattern, True),
    "pattern_2d": (mlp_2d, gelu_pattern, True),
    "jax_gelu_2d": (mlp_2d, gelu_jax, True),
}


def epilogues(hlo: str) -> dict:
    eps = collections.Counter(re.findall(r'"epilogue":"([A-Z_]+)"', hlo))
    fusions_with_tanh = len(re.findall(r"^fused_computation[^\n]*\{(?:(?!^\})[\s\S])*?tanh", hlo, re.M))
    return {"epilogues": dict(eps), "tanh_ops": hlo.count(" tanh("), "fusions_with_tanh": fusions_with_tanh,
            "cublas_lt": hlo.count("__cublas$lt$matmul"), "cublas": hlo.count('"__cublas$gemm"'),
            "triton_gemm": hlo.count("__triton_gemm")}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--only", default="")
    args = p.parse_args()
    k = jax.random.split(jax.random.key(0), 4)
    dt = jnp.bfloat16
    x = jax.random.normal(k[0], (B, T, D), dt)
    w1 = (0.02 * jax.random.normal(k[1], (D, M))).astype(dt)
    b1 = (0.02 * jax.random.normal(k[2], (M,))).astype(dt)
    w2 = (0.02 * jax.random.normal(k[3], (M, D))).astype(dt)
    rows = []
    for name, (body, act, bias) in VARIANTS.items():
        if args.only and name not in args.only.split(","):
            continue

        def fwd(x, w1, b1, w2, body=body, act=act, bias=bias):
            return body(x, w1, b1, w2, act, bias)

        def loss(x, w1, b1, w2, body=body, act=act, bias=bias):
            return jnp.sum(jax.checkpoint(lambda *a: body(*a, act, bias))(x, w1, b1, w2).astype(jnp.float32))

        grad = jax.grad(loss, argnums=(0, 1, 2, 3))
        for kind, fn in (("fwd", fwd), ("fwd_bwd", grad)):
            jf = jax.jit(fn)
            compiled = jf.lower(x, w1, b1, w2).compile()
            info = epilogues(compiled.as_text())
            ms = timed(compiled, x, w1, b1, w2, reps=args.iters) * 1e3
            row = {"variant": name, "kind": kind, "ms": ms, **info}
            rows.append(row)
            print(f"{name:>16} {kind:>8} {ms:7.3f} ms  epilogues {info['epilogues']}  tanh ops {info['tanh_ops']}"
                  f"  lt {info['cublas_lt']} gemm {info['cublas']} triton {info['triton_gemm']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
