"""What one decode step of zerojax's generation moves, read from the compiled program (nothing is
allocated: the model is `nnx.eval_shape`'s, so the 8B shape compiles on any device).

    python benchmarks/decode_hlo_report.py                     # Llama-3.1-8B bf16, batch 1, 384 slots
    python benchmarks/decode_hlo_report.py --batch 64 --length 1024
    python benchmarks/decode_hlo_report.py --tiny              # CPU smoke test

Prints one JSON line: XLA's "bytes accessed" of one decode iteration (the layer loop's body counted
once), the bytes that iteration must read (the LM head, one layer's weights and cache), and the
optimized HLO's instructions of at least --min-mb that move data without computing (copy,
transpose, convert, dynamic-slice fusions): a layer's weights copied before a gemm, a weight
transposed or converted, the cache copied, each listed with its shape.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

MOVES = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* (copy|transpose|convert|fusion)\((.*)$")
ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "pred": 1, "s8": 1, "u8": 1}


def data_moves(hlo: str, min_bytes: int) -> list[dict]:
    """Kernels of the optimized HLO (instructions outside fused bodies) of at least min_bytes that
    copy, transpose, convert or slice (a fusion named for those ops) rather than compute."""
    out, fused = [], False
    for line in hlo.splitlines():
        if line.startswith("%") or line.startswith("ENTRY"):  # a computation's header
            fused = line.startswith(("%fused", "%wrapped"))
        m = None if fused else MOVES.match(line)
        if not m:
            continue
        name, dtype, dims, op, _ = m.groups()
        n = 1
        for d in dims.split(","):
            n *= int(d) if d else 1
        nbytes = n * ITEMSIZE.get(dtype, 4)
        if nbytes < min_bytes:
            continue
        if op == "fusion" and not re.search(r"copy|transpose|convert|dynamic-slice|slice", name):
            continue
        out.append({"name": name, "op": op, "shape": f"{dtype}[{dims}]", "bytes": nbytes})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=384, help="cache slots (prompt bucket + new-token bucket)")
    p.add_argument("--min-mb", type=float, default=1.0)
    p.add_argument("--tiny", action="store_true", help="the tiny Llama (CPU smoke test)")
    args = p.parse_args(argv)
    if args.batch < 1 or args.length < 1:
        p.error(f"--batch {args.batch} / --length {args.length}: both must be >= 1")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from zerojax.generation.program_cost import bytes_accessed, decode_program
    from zerojax.models import Llama, LlamaConfig

    config = LlamaConfig.named("tiny" if args.tiny else args.model)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    lowered, compiled = decode_program(model, batch=args.batch, length=args.length)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    layers = config.num_hidden_layers
    one_layer = nbytes(nnx.state(model.layers, nnx.Param)) // layers
    head = nbytes(model.lm_head.get_value() if not config.tie_word_embeddings else model.embed_tokens.get_value())
    cache_layer = 2 * args.batch * args.length * config.kv_heads * config.dim_per_head * 2
    moves = data_moves(compiled.as_text(), int(args.min_mb * 2**20))
    print(json.dumps({
        "device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": "tiny" if args.tiny else args.model,
        "batch": args.batch, "length": args.length,
        "bytes_accessed_one_layer_iteration": int(bytes_accessed(compiled)),
        "must_read_one_layer_iteration": head + one_layer + cache_layer,
        "layer_weight_bytes": one_layer, "head_bytes": head, "cache_bytes_per_layer": cache_layer,
        "data_moves": moves, "data_move_bytes": sum(m["bytes"] for m in moves)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
