"""One decode step's attention over the serving engine's paged pool, Llama-3.1-8B's shape (32 query /
8 kv heads of 128, bf16, pages of 16 slots): the fused kernel reading each row's pages through its
page table (`zerojax.generation.decode_attention(..., pages=)`) beside XLA's products over the rows'
pages gathered first (the engine's other path, `zerojax.serving.step`), both under plain `jax.jit`,
one layer of an 8-layer pool. Per (rows, context, table width): the largest difference between the
two, the microseconds a call and the bytes a call must read (the rows' visible keys and values)
over that time. A row's visible slots lie in pages drawn at random from the pool (no two rows
share one); the rest of its table names the scratch page 0, as in the engine.

Then a prompt chunk's attention (`chunk_attention`): C tokens a row after a prefix already in the
pages, each token over its own slots, beside XLA's products over the gathered pages with the
[C, table] scores in memory (the engine's XLA path).

    PYTHONPATH=. python benchmarks/paged_attention_bench.py            # one GPU
    PYTHONPATH=. python benchmarks/paged_attention_bench.py --tiny     # CPU: Pallas' interpreter, small shapes
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _time(fn, *args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zerojax.generation import cache
    from zerojax.generation.decode_attention import chunk_attention, decode_attention

    if args.tiny:
        L, K, H, Dh, ps, cases, reps = 2, 2, 8, 16, 16, [(2, 40, 64)], 2
        chunks = [(1, 16, 8, 64)]
    else:  # (rows, visible slots a row, the table's width in slots)
        L, K, H, Dh, ps, reps = 8, 8, 32, 128, 16, 20
        cases = [(1, 768, 4096), (16, 768, 4096), (64, 768, 4096), (256, 768, 4096), (64, 3072, 4096),
                 (64, 768, 2048)]
        # (rows, chunk tokens, prefix slots before the chunk, the table's width in slots)
        chunks = [(1, 512, 0, 4096), (1, 2048, 0, 4096), (4, 512, 1024, 4096), (1, 512, 3072, 4096)]
    N = max(max(r * -(-v // ps) for r, v, _ in cases), max(r * -(-(p + c) // ps) for r, c, p, _ in chunks)) + 1
    rng = np.random.default_rng(0)
    keys, values = jax.random.normal(jax.random.key(0), (2, L, N, K, ps, Dh), jnp.bfloat16)
    layer = jnp.int32(L // 2)

    @jax.jit
    def kernel(q, keys, values, first, last, pages):
        return decode_attention(q, keys, values, layer, first, last, pages=pages)

    def gathered_attention(q, keys, values, first, last, pages):
        """XLA's products over the rows' pages gathered first (the engine's XLA path): q [R, C, H,
        Dh], token c of row r over slots first[r, c] .. last[r, c]."""
        R, P = pages.shape

        def rows(pool):
            x = pool[layer][pages]
            return x.swapaxes(1, 2).reshape(R, K, P * ps, Dh)

        span = jnp.arange(P * ps)
        mask = (span >= first[..., None]) & (span <= last[..., None])  # [R, C, slots]
        return cache.attend(q, rows(keys), rows(values), mask[:, None])

    @jax.jit
    def gathered(q, keys, values, first, last, pages):  # one token a row
        return gathered_attention(q[:, None], keys, values, first[:, None], last[:, None], pages)[:, 0]

    def table(R, P, used):
        """R rows' page tables P wide: `used` pages drawn at random (no page in two rows), then the
        scratch page 0."""
        pages = np.zeros((R, P), np.int32)
        pages[:, :used] = rng.permutation(np.arange(1, N))[:R * used].reshape(R, used)
        return jnp.asarray(pages)

    def print_table(rows, cols):
        print(" | ".join(cols))
        for r in rows:
            print(" | ".join(str(r[c]) for c in cols))

    out = []
    for R, visible, width in cases:
        pages = table(R, width // ps, -(-visible // ps))
        q = jnp.asarray(rng.standard_normal((R, H, Dh)), jnp.bfloat16)
        first, last = jnp.zeros(R, jnp.int32), jnp.full(R, visible - 1, jnp.int32)
        a = kernel(q, keys, values, first, last, pages)
        b = gathered(q, keys, values, first, last, pages)
        diff = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
        must_read = 2 * R * visible * K * Dh * 2
        row = {"rows": R, "visible": visible, "width": width, "max_abs_diff": round(diff, 4),
               "device": str(jax.devices()[0].device_kind)}
        for name, fn in (("kernel", kernel), ("xla_gather", gathered)):
            t = _time(fn, q, keys, values, first, last, pages, reps=reps)
            row[f"{name}_us"] = round(t * 1e6, 1)
            row[f"{name}_gbps"] = round(must_read / t / 1e9, 1)
        print(json.dumps(row), flush=True)
        out.append(row)
    print_table(out, ["rows", "visible", "width", "max_abs_diff", "kernel_us", "kernel_gbps", "xla_gather_us",
                      "xla_gather_gbps"])

    @jax.jit
    def chunk_kernel(q, keys, values, first, last, pages):
        return chunk_attention(q, keys, values, layer, first, last, pages=pages)

    chunk_gathered = jax.jit(gathered_attention)

    chunk_rows = []
    for R, C, prefix, width in chunks:
        pages = table(R, width // ps, -(-(prefix + C) // ps))
        q = jnp.asarray(rng.standard_normal((R, C, H, Dh)), jnp.bfloat16)
        last = jnp.asarray(np.broadcast_to(prefix + np.arange(C), (R, C)), jnp.int32)
        first = jnp.zeros_like(last)
        a = chunk_kernel(q, keys, values, first, last, pages)
        b = chunk_gathered(q, keys, values, first, last, pages)
        diff = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
        row = {"rows": R, "chunk": C, "prefix": prefix, "width": width, "max_abs_diff": round(diff, 4),
               "device": str(jax.devices()[0].device_kind)}
        for name, fn in (("kernel", chunk_kernel), ("xla_gather", chunk_gathered)):
            row[f"{name}_us"] = round(_time(fn, q, keys, values, first, last, pages, reps=reps) * 1e6, 1)
        print(json.dumps(row), flush=True)
        chunk_rows.append(row)
    print_table(chunk_rows, ["rows", "chunk", "prefix", "width", "max_abs_diff", "kernel_us", "xla_gather_us"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
