"""zerojax against a plain `jax.jit` step on models other than GPT-2, one entry per process.

    python benchmarks/models_bench.py --model llama-3.2-1b --mode zerojax --remat full --micro 4 --seq 2048
    python benchmarks/models_bench.py --model qwen3-0.6b-list --mode plain --micro 4 --seq 1024
    python benchmarks/models_bench.py --tiny ...                 # CPU smoke test (tiny shapes)

Models: the Llama family's named shapes (zerojax.models.LlamaConfig.named: llama-3.2-1b,
llama-3.1-8b, qwen3-0.6b, ...), and "qwen3-0.6b-list": Qwen3-0.6B's shape written as another
project writes it (tests/foreign_models.py's ListQwen: a Python list of 28 blocks, [d, heads,
head_dim] kernels, no logical names), which zerojax serves through the model contract alone.

Both modes: bf16 compute, fp32 master weights, AdamW with clipping 1.0, the same loss (the Llama
family: the fused chunked loss; ListQwen: its plain loss). plain: replicated optax state, the step
casts the fp32 params to bf16, the model's own remat (the Llama family's `remat_policy`; ListQwen
has none, so its plain entries run without remat). zerojax: `zerojax.shard`
with a ZeRO-2 bf16 config, the remat policy through activation_checkpointing.

Prints one JSON line: build seconds (shard() or the plain setup, until the first step can run),
first step (compile) seconds, tokens/s per device after warm-up, MFU against --peak-tflops
(6N + 12 L (heads x head_dim) T FLOPs per token), peak bytes in use.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

QWEN3_06B = dict(vocab=151936, d=1024, heads=16, kv_heads=8, head_dim=128, mlp=3072, layers=28,
                 rope_theta=1_000_000.0)


def build(name: str, tiny: bool):
    """(factory(dtype, remat_policy), loss_fn, vocab)."""
    import jax.numpy as jnp
    from flax import nnx

    if name == "qwen3-0.6b-list":
        from foreign_models import ListQwen, QwenShape, lm_loss

        shape = QwenShape() if tiny else QwenShape(**QWEN3_06B)
        return (lambda dtype, remat=None: ListQwen(shape, rngs=nnx.Rngs(0), dtype=dtype)), lm_loss, shape.vocab
    from zerojax.models import Llama, LlamaConfig, chunked_llama_loss

    cfg = LlamaConfig.named("tiny") if tiny else LlamaConfig.named(name)
    return ((lambda dtype, remat=None: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32,
                                             remat_policy=remat)),
            chunked_llama_loss(256), cfg.vocab_size)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--mode", choices=("plain", "zerojax"), required=True)
    p.add_argument("--remat", default="none", help="none, full, dots (zerojax: activation_checkpointing)")
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None, help="the matmul ceiling MFU is counted against")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--unroll", type=int, default=None,
                   help="zerojax: layers per iteration of a stacked list's scan (0 = all; default: the engine's)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import zerojax
    from zerojax import model as contract

    factory, loss_fn, vocab = build(args.model, args.tiny)
    if args.unroll is not None:
        contract.StackedBlocks.scan_unroll = args.unroll or True
    seq = 16 if args.tiny else args.seq
    rows = args.micro * jax.device_count()
    batch = {"input_ids": np.random.default_rng(0).integers(0, vocab, (rows, seq), dtype=np.int32)}
    remat = None if args.remat == "none" else args.remat
    t0 = time.perf_counter()
    if args.mode == "zerojax":
        cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
               "bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
               "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}}}
        if remat:
            cfg["activation_checkpointing"] = {"remat_policy": remat}
        engine = zerojax.shard(lambda: factory(jnp.bfloat16), cfg, loss_fn=loss_fn)
        jax.block_until_ready(engine.state)
        dims = contract.model_dims(engine.model)
        step = lambda: engine.train_step(batch)["loss"]  # noqa: E731
        block = lambda: jax.block_until_ready(engine.state)  # noqa: E731
    else:
        model = factory(jnp.bfloat16, remat)   # the Llama family remats natively; ListQwen has no remat
        dims = contract.model_dims(model)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.01))
        state = {"params": params, "opt": tx.init(params)}

        @jax.jit
        def train(state, batch):
            def loss_of(p):
                p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
                out = loss_fn(nnx.merge(graphdef, p16, rest), batch)
                return out[0] if isinstance(out, tuple) else out
            loss, g = jax.value_and_grad(loss_of)(state["params"])
            updates, opt = tx.update(g, state["opt"], state["params"])
            return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

        box = {"state": jax.device_put(state)}

        def step():
            box["state"], loss = train(box["state"], batch)
            return loss

        block = lambda: jax.block_until_ready(box["state"])  # noqa: E731
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    losses = [step()]
    block()
    first_s = time.perf_counter() - t1
    for _ in range(args.warmup - 1):
        losses.append(step())
    block()
    t2 = time.perf_counter()
    for _ in range(args.steps):
        losses.append(step())
    block()
    dt = time.perf_counter() - t2
    tps = args.steps * rows * seq / dt / jax.device_count()
    fpt = dims.flops_per_token(seq)
    stats = jax.local_devices()[0].memory_stats() or {}
    out = {"model": args.model, "mode": args.mode, "remat": args.remat, "unroll": args.unroll, "micro": args.micro,
           "seq": seq,
           "params": dims.params, "build_s": round(build_s, 1), "first_step_s": round(first_s, 1),
           "tokens_per_s_per_device": round(tps), "tflops": round(tps * fpt / 1e12, 1),
           "mfu": round(tps * fpt / 1e12 / args.peak_tflops, 4) if args.peak_tflops else None,
           "peak_gib": round(stats["peak_bytes_in_use"] / 2**30, 2) if "peak_bytes_in_use" in stats else None,
           "losses": [round(float(x), 4) for x in jax.device_get(losses)[-3:]]}
    print("MODELS_BENCH " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
