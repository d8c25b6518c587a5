"""Issue #15 on ONE device: the pipeline's schedule with a stage's layers scanned vs unrolled.

The 2-GPU machine is rarely lent; the pipeline's own cost is not communication (NCCL was 9 ms of
a 499 ms step) but what the schedule does on each device. Here zerojax.pipeline's layer scan runs
S stages on a one-device mesh (the "pipe" axis of size 1 holds all S slots: the device does every
stage's work, so each variant does the same per-token work as the plain model plus the bubble's
idle iterations), against the plain model accumulating the same micro-batches, as ZeRO-1 does:

    plain mbMxA        the model's own layer scan inside a scan over A micro-batches of M rows,
                       weight gradients summed in fp32 (the engine's grad_accum_dtype)
    pipeS mbmxM scan   zerojax.pipeline, a stage's layers a scan nested in the iterations' scan
                       (EngineOptions.pipeline_stage_loop "scan", the form measured at 61% of ZeRO-1)
    pipeS ... unrolled_sliced  a stage's layers unrolled, each iteration slicing their weights out
                       of the stage's stack (session 6's "unrolled", measured at 425 ms)
    pipeS ... unrolled the default: unrolled, each layer's weights cut out once, before the loop
    pipeS ... unrolled +zero_init_elim  "unrolled" compiled with XLA:GPU's option
                       xla_gpu_enable_dus_accumulator_zero_init_elimination (scan's zero-filled stacks of
                       saved activations left uninitialised), what the engine compiles a pipelined step
                       with on GPU (session 7: 309.5 vs 329.5 ms)

Forward + backward only (no optimizer: it is the same for all). Prints ms per step, tokens/s,
each vs plain, XLA's predicted peak and the compiled steps' bytes written by kind of op
(benchmarks/hlo_bytes.py);
JSON with --json. Runs on CPU too (--size small-cpu).

    python benchmarks/pipe_stage_loop_1gpu.py --size large --rows 16 --micro 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="large", help="GPT-2 size, or small-cpu")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=16, help="rows a step (all variants)")
    ap.add_argument("--micro", type=int, default=2, help="rows a pipeline micro-batch")
    ap.add_argument("--plain-micro", type=int, default=8, help="rows a micro-batch of the plain model")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    # the new form first: should memory run short on a shared device, the comparison that matters comes first
    ap.add_argument("--only", default="unrolled,sliced,plain",
                    help="variants to run, comma separated: unrolled, unrolled_zi, sliced, scan, plain")
    ap.add_argument("--top", type=int, default=6, help="top ops by bytes listed per variant")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, Mesh

    sys.path.insert(0, HERE)
    from hlo_bytes import SMALL, bytes_by_kind, table
    from zerojax.memory import CompiledMemory
    from zerojax.models.gpt2 import GPT2, GPT2Config, gpt2_loss
    from zerojax.partition import DATA, PIPE, TENSOR
    from zerojax.pipeline import PipelineSchedule, pipeline_scan

    config = GPT2Config.named("tiny", **SMALL) if args.size == "small-cpu" else GPT2Config.named(args.size)
    seq = min(args.seq, config.n_positions)
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), (DATA, PIPE, TENSOR),
                axis_types=(AxisType.Auto,) * 3)
    model = GPT2(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32)
    graphdef, master, rest = nnx.split(model, nnx.Param, ...)  # master: the fp32 weights
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (args.rows, seq)), jnp.int32)

    def loss_of(layer_scan):
        model.layer_scan = layer_scan  # the hook the engine sets (zerojax.layout)
        graphdef = nnx.split(model, nnx.Param, ...)[0]

        def loss(master, input_ids):
            params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), master)  # the compute copy, as the engine
            return gpt2_loss(nnx.merge(graphdef, params, rest), {"input_ids": input_ids})[0]
        return loss

    plain_loss = loss_of(None)

    def plain_step(master, input_ids):
        loss = plain_loss
        mbs = input_ids.reshape(-1, args.plain_micro, seq)

        def body(acc, mb):
            value, grads = jax.value_and_grad(loss)(master, mb)
            return jax.tree.map(jnp.add, acc, grads), value
        grads, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, master), mbs)
        return losses.mean(), grads

    def pipe_step(stage_loop):
        schedule = PipelineSchedule(stages=args.stages, microbatches=args.rows // args.micro,
                                    grad_accum_dtype="float32", stage_loop=stage_loop)
        loss = loss_of(pipeline_scan(schedule, mesh))
        return lambda master, input_ids: jax.value_and_grad(loss)(master, input_ids)

    variants = {"plain": (f"plain mb{args.plain_micro}x{args.rows // args.plain_micro}", plain_step),
                "scan": (f"pipe{args.stages} mb{args.micro}x{args.rows // args.micro} scan", pipe_step("scan")),
                "sliced": (f"pipe{args.stages} mb{args.micro}x{args.rows // args.micro} unrolled_sliced",
                           pipe_step("unrolled_sliced")),
                "unrolled": (f"pipe{args.stages} mb{args.micro}x{args.rows // args.micro} unrolled",
                             pipe_step("unrolled")),
                # "unrolled" with XLA:GPU's own pass for scan's zero-filled stacks (off by default in
                # XLA; the compile fails where the XLA has no such option)
                "unrolled_zi": (f"pipe{args.stages} mb{args.micro}x{args.rows // args.micro} unrolled +zero_init_elim",
                                pipe_step("unrolled"))}
    compiler_options = {"unrolled_zi": {"xla_gpu_enable_dus_accumulator_zero_init_elimination": True}}
    results, texts = {}, {}
    for key in args.only.split(","):
        name, fn = variants[key]
        print(f"== {name}: compiling", flush=True)
        try:
            t0 = time.perf_counter()
            compiled = jax.jit(fn).lower(master, ids).compile(compiler_options=compiler_options.get(key))
            compile_s = time.perf_counter() - t0
            for _ in range(args.warmup):
                jax.block_until_ready(compiled(master, ids))
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = compiled(master, ids)
            jax.block_until_ready(out)
            step_s = (time.perf_counter() - t0) / args.steps
            texts[name] = compiled.as_text()
            written = bytes_by_kind(texts[name])
            results[name] = dict(step_ms=step_s * 1e3, tokens_per_s=args.rows * seq / step_s, compile_s=compile_s,
                                 peak_gib=CompiledMemory.of(compiled).peak / 2**30, loss=float(out[0]),
                                 written_gib=sum(written.values()) / 2**30,
                                 copies_gib=sum(v for k, v in written.items() if "copy" in k) / 2**30)
            print(f"   {json.dumps({k: round(v, 3) for k, v in results[name].items()})}", flush=True)
        except Exception as e:  # noqa: BLE001 -- report, and measure the others
            results[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(f"   FAILED {results[name]['error']}", flush=True)
    base = next((r for n, r in results.items() if n.startswith("plain") and "error" not in r), None)
    print(f"\n{'variant':<28}{'ms/step':>9}{'tok/s':>9}{'vs plain':>10}{'peak GiB':>10}{'GiB written':>13}"
          f"{'of it copies':>14}{'compile s':>11}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<28}FAILED {r['error'][:100]}")
            continue
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.1%}" if base else "-"
        print(f"{name:<28}{r['step_ms']:>9.1f}{r['tokens_per_s']:>9,.0f}{vs:>10}{r['peak_gib']:>10.2f}"
              f"{r['written_gib']:>13.1f}{r['copies_gib']:>14.1f}{r['compile_s']:>11.1f}")
    print("\nbytes the compiled steps write per device (benchmarks/hlo_bytes.py; kinds over 1% of the most)")
    print(table(texts, n_top=args.top, min_share=0.01))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": str(jax.devices()[0]), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
