"""Per-device bytes of the compiled training step (XLA's memory analysis), no step run: tensor
parallelism (with / without sequence parallelism, vocab padding on / off) against data-parallel
ZeRO-2 / ZeRO-3 on the same devices, micro-batch per device equal (DeepSpeed's batch rule).

    python benchmarks/tp_memory.py --cpu                      # 2 virtual CPU devices, a narrow GPT-2
    python benchmarks/tp_memory.py --size large --seq 1024    # on 2 GPUs: GPT-2 Large's real figures

Columns: arguments (the sharded state + batch), temporaries (activations, gradients, collectives'
buffers), their sum. CPU's figures show the layouts' difference, not a GPU's peak (other fusion and
scheduling); the GPU peak is benchmarks/gpu_x2_tp.sh's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="2 virtual CPU devices and a narrow model")
    p.add_argument("--size", default=None, help="GPT-2 size (default: large on GPU; with --cpu a 4-layer d=256 model)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--remat", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.cpu:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from zerojax import partition
    from zerojax.planner import abstract_engine
    from zerojax.models.gpt2 import GPT2, GPT2Config, gpt2_loss

    if args.size or not args.cpu:
        base = GPT2Config.named(args.size or "large")
    else:
        base = GPT2Config(n_embd=256, n_layer=4, n_head=8)
    seq = args.seq or (256 if args.cpu else 1024)
    dtype = jnp.float32 if args.cpu else jnp.bfloat16
    n = jax.device_count()
    sp_rules = partition.ACTIVATION_RULES
    no_sp_rules = tuple(r for r in sp_rules if r[0] != "seq")
    entries = [("zero2", 2, 1, 128, sp_rules), ("zero3", 3, 1, 128, sp_rules),
               ("tp2 + sp", 0, 2, 128, sp_rules), ("tp2, no sp", 0, 2, 128, no_sp_rules),
               ("tp2 + sp, vocab/1", 0, 2, 1, sp_rules)]
    original = partition.activation_constraint
    rows = []
    print(f"GPT-2 d={base.n_embd} L={base.n_layer} seq {seq}, micro {args.micro} per device, {n} x "
          f"{jax.devices()[0].device_kind}, {'remat full' if args.remat else 'no remat'}")
    print(f"{'entry':<20}{'args MiB':>10}{'temp MiB':>10}{'sum MiB':>10}")
    for name, stage, tp, multiple, rules in entries:
        config = GPT2Config(**{**base.__dict__, "make_vocab_size_divisible_by": multiple})
        partition.activation_constraint = lambda mesh, rules=rules: original(mesh, rules)  # noqa: E731
        try:
            model = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0), dtype=dtype,  # noqa: B023
                                                remat_policy="full" if args.remat else None))
            cfg = {"train_micro_batch_size_per_gpu": args.micro,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                   "bf16": {"enabled": dtype == jnp.bfloat16},
                   "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp}}
            eng = abstract_engine(model, cfg, loss_fn=gpt2_loss)
            batch = {"input_ids": jax.ShapeDtypeStruct((args.micro * n, seq), jnp.int32)}
            m = eng.compiled_step(batch).memory_analysis()
        finally:
            partition.activation_constraint = original
        row = {"entry": name, "argument_bytes": m.argument_size_in_bytes, "temp_bytes": m.temp_size_in_bytes}
        rows.append(row)
        a, t = row["argument_bytes"] / 2**20, row["temp_bytes"] / 2**20
        print(f"{name:<20}{a:>10.1f}{t:>10.1f}{a + t:>10.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "n_embd": base.n_embd, "n_layer": base.n_layer, "seq": seq,
                       "micro": args.micro, "remat": args.remat, "devices": n, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
