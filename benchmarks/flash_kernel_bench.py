"""The attention alone, forward + backward, at one model's attention shape: the fused Pallas kernel
(`zerojax.models.flash_attention`, a few tile choices) beside the blockwise scan and, on rows of one
document, cuDNN's fused kernel; first a check that flash and blockwise agree on the GPU.

    PYTHONPATH=. python benchmarks/flash_kernel_bench.py --seq 32768 --docs 4 1

Prints one JSON line per (docs, implementation, tiles): seconds per forward + backward (median of
--steps after a warm-up) and TFLOP/s of the work the mask leaves (the visible query-key pairs:
4 x pairs x head_dim x heads for the forward's two products, x 3.5 with the backward's five).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from long_context_bench import batch_of  # benchmarks/ is sys.path[0] when run as a script

from zerojax.models.attention import blockwise_attention, causal_attention
from zerojax.models.flash_attention import FlashBlocks, flash_attention

# "default" is FlashBlocks() (backward tiles 64 x 64, 4 warps: 228 TFLOP/s at Llama-3.2-1B's shape and
# 32K on an H100, against 152 for "bwd64x128", the default before; benchmarks/RESULTS.md, 2026-12-06)
TILES = {
    "default": FlashBlocks(),
    "bwd64x128": FlashBlocks(q_dkv=64, kv_dkv=128, q_dq=128, kv_dq=64, warps_bwd=8),
    "q64k64": FlashBlocks(q=64, k=64),
    "q128k128": FlashBlocks(q=128, k=128, warps=8),
    "bwd128": FlashBlocks(q_dkv=128, kv_dkv=128, q_dq=128, kv_dq=128, warps_bwd=8),
}


def segments(seq: int, docs: int):
    """Segment ids [1, seq] of long_context_bench's packed rows (`docs` documents; None for 1)."""
    seg = batch_of(1, seq, 2, docs).get("segment_ids")
    return None if seg is None else jnp.asarray(seg)


def visible_pairs(seq: int, seg) -> int:
    """Query-key pairs the causal, per-document mask leaves: L (L + 1) / 2 per document."""
    lengths = np.array([seq]) if seg is None else np.unique(np.asarray(seg), return_counts=True)[1]
    return int((lengths * (lengths + 1) // 2).sum())


def fwd_bwd(attend, q, k, v):
    cot = jnp.ones(q.shape, q.dtype)
    return jax.jit(lambda q, k, v: jax.vjp(attend, q, k, v)[1](cot))


def timed(f, args, steps):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def check(heads, kv_heads, head_dim, seq=4096, docs=4):
    """flash against blockwise in bf16 on the GPU: output and gradients, error over each's scale."""
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, seq, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, seq, kv_heads, head_dim), jnp.bfloat16) for x in ks[1:3])
    seg = segments(seq, docs)
    cot = jax.random.normal(ks[3], q.shape, jnp.float32)
    out = {}
    for name, f in (("flash", lambda q, k, v: flash_attention(q, k, v, segment_ids=seg)),
                    ("blockwise", lambda q, k, v: blockwise_attention(q, k, v, segment_ids=seg))):
        o, pull = jax.vjp(f, q, k, v)
        out[name] = [np.asarray(x, np.float32) for x in (o, *pull(cot.astype(q.dtype)))]
    errs = {n: float(np.abs(a - b).max() / np.abs(b).max()) for n, a, b in zip("o dq dk dv".split(), out["flash"],
                                                                              out["blockwise"])}
    print(json.dumps({"bench": "flash-check", "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                      "seq": seq, "docs": docs, "max_err_over_scale": errs, "ok": max(errs.values()) < 0.02}),
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--docs", type=int, nargs="+", default=[4, 1])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tiles", nargs="+", default=list(TILES), choices=list(TILES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--check-seq", type=int, default=4096, help="row length of the flash / blockwise check")
    args = p.parse_args()
    check(args.heads, args.kv_heads, args.head_dim, args.check_seq)
    check(args.heads, args.kv_heads, 2 * args.head_dim, args.check_seq)
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (1, args.seq, args.heads, args.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, args.seq, args.kv_heads, args.head_dim), jnp.bfloat16) for x in ks[1:])
    for docs in args.docs:
        seg = segments(args.seq, docs)
        flops = 4 * visible_pairs(args.seq, seg) * args.head_dim * args.heads * 3.5
        cases = [(f"flash/{t}", lambda q, k, v, t=t: flash_attention(q, k, v, segment_ids=seg, blocks=TILES[t]))  # noqa: B023 - called within this iteration
                 for t in args.tiles]
        cases.append(("blockwise", lambda q, k, v: blockwise_attention(q, k, v, segment_ids=seg)))  # noqa: B023 - called within this iteration
        if docs <= 1:
            cases.append(("cudnn", lambda q, k, v: causal_attention(q, k, v, impl="cudnn")))
        for name, attend in cases:
            row = {"bench": "attention-fwd-bwd", "impl": name, "seq": args.seq, "docs": docs, "heads": args.heads,
                   "kv_heads": args.kv_heads, "head_dim": args.head_dim}
            try:
                s = timed(fwd_bwd(attend, q, k, v), (q, k, v), args.steps)
                row.update(seconds=round(s, 5), tflops=round(flops / s / 1e12, 2))
            except Exception as e:  # noqa: BLE001 - a tile choice that does not compile is a row, not the end
                row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
