"""Long-context training: tokens/s and peak memory at long rows, and the longest row that fits.

    python benchmarks/long_context_bench.py throughput --seq 2048 32768          # Llama-3.2-1B shape
    python benchmarks/long_context_bench.py longest --cap-gib 24                 # Llama-3.1-8B LoRA r16
    python benchmarks/long_context_bench.py throughput --tiny                    # CPU smoke test
    python benchmarks/long_context_bench.py longest --tiny

throughput: one row of each --seq length per device (micro 1), bf16 compute, fp32 master, AdamW,
ZeRO-2, full remat, the chunked loss, the attention --attention (default "blockwise": no [T, T]
scores; "cudnn": the fused kernel; "xla": the dense path, for the before), --mlp-tile (ALST's
tiled MLP) and --sp (sequence_parallel_size over the local devices). Each length runs in this
process after the previous one: tokens/s per device after warm-up, the allocator's peak, and the
compiled step's predicted peak (XLA's memory analysis).

longest: Llama-3.1-8B's shape with LoRA r16 alpha 32 on every linear layer (bf16 base, frozen),
micro 1; the row length doubles from --start until the compiled step's predicted peak passes
--cap-gib (nothing runs: abstract engines, compiled only), then one real step at the longest
length that fit, whose allocator peak is printed beside the prediction. Run it with the cap also
given to the allocator (XLA_PYTHON_CLIENT_MEM_FRACTION) so that the real step is held to it.

Prints one JSON line per measurement and writes them all to --out (default
long_context_results.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def ds_config(*, sp: int, stage: int = 2, lora: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
           "activation_checkpointing": {"remat_policy": "full"}, "sequence_parallel_size": sp,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}}
    if lora:
        cfg["optimizer"]["params"]["lr"] = 2e-4
    return cfg


def model_factory(name: str, *, attention: str, block: int, mlp_tile: int | None, lora: bool):
    import jax.numpy as jnp
    from flax import nnx

    from zerojax import lora as lora_mod
    from zerojax.models import Llama, LlamaConfig

    cfg = LlamaConfig.named(name)

    def make():
        param_dtype = jnp.bfloat16 if lora else jnp.float32
        m = Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=param_dtype, attention_impl=attention,
                  attention_block=block, mlp_tile=mlp_tile)
        if lora:
            m = lora_mod.apply(m, {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
        return m

    return make, cfg


def batch_of(rows: int, seq: int, vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, seq)).astype(np.int32)
    # four packed documents a row: the segment ids take the blockwise path's masking
    seg = np.repeat(np.arange(1, 5), -(-seq // 4))[:seq][None].repeat(rows, 0).astype(np.int32)
    return {"input_ids": ids, "segment_ids": seg}


def shapes_of(batch):
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)


def peak_gib():
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return round(stats["peak_bytes_in_use"] / 2**30, 3) if "peak_bytes_in_use" in stats else None


def throughput(args, emit):
    import jax

    import zerojax
    from zerojax.models import chunked_llama_loss
    from zerojax.planning.memory import CompiledMemory

    name = "tiny" if args.tiny else args.model
    make, cfg = model_factory(name, attention=args.attention, block=args.block, mlp_tile=args.mlp_tile, lora=False)
    for seq in args.seq:
        eng = zerojax.shard(make, ds_config(sp=args.sp), loss_fn=chunked_llama_loss(args.loss_chunk),
                            options=zerojax.EngineOptions(memory_guard=False))
        rows = eng.layout.cfg.train_batch_size
        batch = batch_of(rows, seq, cfg.vocab_size)
        predicted = CompiledMemory.of(eng.compiled_step(shapes_of(batch))).peak
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            eng.train_step(batch)
        eng.synchronize()
        t1 = time.perf_counter()
        for _ in range(args.steps):
            metrics = eng.train_step(batch)
        eng.synchronize()
        dt = (time.perf_counter() - t1) / args.steps
        emit({"bench": "throughput", "model": name, "seq": seq, "rows": rows, "sp": args.sp,
              "attention": args.attention, "mlp_tile": args.mlp_tile, "step_s": round(dt, 4),
              "warmup_s": round(t1 - t0, 2), "tokens_per_s_per_device": round(rows * seq / dt / jax.device_count(), 1),
              "predicted_peak_gib": round(predicted / 2**30, 3), "peak_gib": peak_gib(),
              "loss": float(metrics["loss"]), "device": jax.devices()[0].device_kind})
        del eng


def longest(args, emit):
    import jax

    import zerojax
    from zerojax.models import chunked_llama_loss
    from zerojax.planning.memory import CompiledMemory
    from zerojax.train.engine import abstract_engine

    name = "tiny" if args.tiny else args.lora_model
    make, cfg = model_factory(name, attention=args.attention, block=args.block, mlp_tile=args.mlp_tile, lora=True)
    cap = int(args.cap_gib * 2**30)
    loss_fn = chunked_llama_loss(args.loss_chunk)
    options = zerojax.EngineOptions(memory_guard=False)
    best, seq = None, args.start
    while seq <= args.limit:
        eng = abstract_engine(make, ds_config(sp=args.sp, lora=True), loss_fn=loss_fn, options=options)
        rows = eng.layout.cfg.train_batch_size
        try:
            peak = CompiledMemory.of(eng.compiled_step(shapes_of(batch_of(rows, seq, cfg.vocab_size)))).peak
        except Exception as e:  # noqa: BLE001 - a compile that runs out of memory ends the search
            emit({"bench": "longest", "seq": seq, "error": str(e).splitlines()[0][:200]})
            break
        emit({"bench": "longest-probe", "model": name, "seq": seq, "predicted_peak_gib": round(peak / 2**30, 3),
              "fits": peak <= cap})
        if peak > cap:
            break
        best, seq = seq, seq * 2
        del eng
    if best is None:
        emit({"bench": "longest", "model": name, "seq": None, "cap_gib": args.cap_gib})
        return
    eng = zerojax.shard(make, ds_config(sp=args.sp, lora=True), loss_fn=loss_fn, options=options)
    batch = batch_of(eng.layout.cfg.train_batch_size, best, cfg.vocab_size)
    eng.train_step(batch)
    eng.synchronize()
    t0 = time.perf_counter()
    metrics = eng.train_step(batch)
    eng.synchronize()
    dt = time.perf_counter() - t0
    emit({"bench": "longest", "model": name, "seq": best, "cap_gib": args.cap_gib, "step_s": round(dt, 3),
          "tokens_per_s_per_device": round(eng.layout.cfg.train_batch_size * best / dt / jax.device_count(), 1),
          "peak_gib": peak_gib(), "loss": float(metrics["loss"]), "device": jax.devices()[0].device_kind})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=("throughput", "longest"))
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--lora-model", default="llama-3.1-8b")
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--attention", default="blockwise", choices=("blockwise", "cudnn", "xla"))
    p.add_argument("--block", type=int, default=512, help="keys per step of the blockwise attention")
    p.add_argument("--mlp-tile", type=int, default=None, help="positions per piece of the tiled MLP")
    p.add_argument("--sp", type=int, default=1, help="sequence_parallel_size")
    p.add_argument("--loss-chunk", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cap-gib", type=float, default=24.0)
    p.add_argument("--start", type=int, default=4096)
    p.add_argument("--limit", type=int, default=1 << 20)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: the tiny Llama, short rows")
    p.add_argument("--out", default="long_context_results.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq = [s for s in (32, 64)]
        args.steps, args.warmup, args.block, args.loss_chunk = 2, 1, 16, 16
        args.start, args.limit, args.cap_gib = 32, 128, min(args.cap_gib, 24.0)
    results = []

    def emit(row):
        print(json.dumps(row), flush=True)
        results.append(row)

    (throughput if args.bench == "throughput" else longest)(args, emit)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
