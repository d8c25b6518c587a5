"""Fine-tune GPT-2 (Large by default on a GPU) with any DeepSpeed config.

    python examples/gpt2_large.py --config configs/zero2_bf16.json            # GPU: GPT-2 Large
    python examples/gpt2_large.py --model tiny --steps 200                     # CPU: a tiny GPT-2
    python examples/gpt2_large.py --hf-checkpoint ./gpt2-large --data corpus.jsonl --save runs/ft

Without --data it trains on an embedded corpus (Python's own documentation), so it runs on a
fresh machine with no download. Without --hf-checkpoint the model starts from GPT-2's random init.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# `python examples/gpt2_large.py` from a checkout works without installing.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# datasheet dense bf16 peak per device, for MFU (override with --peak-tflops)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0, "4090": 165.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "zero2_bf16.json"),
                   help="a DeepSpeed JSON config (its \"auto\" values are filled from the flags below)")
    p.add_argument("--model", default="auto", choices=["auto", "tiny", "small", "medium", "large", "xl"],
                   help="GPT-2 size; auto = large on a GPU, tiny on CPU")
    p.add_argument("--hf-checkpoint", help="local Hugging Face GPT-2 folder (config.json, model.safetensors)")
    p.add_argument("--data", help=".txt / .jsonl file or folder; default: the embedded corpus")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the checkpoint's, else byte-level)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300 on CPU, 100 on GPU)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 1024; tiny: 128)")
    p.add_argument("--micro-batch", default=None,
                   help="fills train_micro_batch_size_per_gpu \"auto\": a number, or auto = the largest "
                        "that fits the device (XLA's compiled peak, found before anything is allocated); "
                        "default 8 on a GPU, 4 on CPU")
    p.add_argument("--grad-accum", type=int, default=1, help="fills gradient_accumulation_steps \"auto\"")
    p.add_argument("--lr", type=float, default=None, help="fills optimizer/scheduler lr \"auto\"")
    p.add_argument("--remat", choices=["none", "full", "dots", "offload"], default=None,
                   help="activation checkpointing per layer (default: from the config's "
                        "activation_checkpointing section; cpu_checkpointing -> offload)")
    p.add_argument("--save", help="checkpoint folder (orbax); saved at the end")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save")
    p.add_argument("--export-hf", help="write the trained weights as a Hugging Face GPT-2 folder")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="cross entropy N positions at a time (zerojax.models.chunked_gpt2_loss): the "
                        "full batch x seq x vocab fp32 logits are never held; 0 = full logits")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU")
    return p.parse_args(argv)


def _loss_fn(loss_chunk: int):
    from zerojax.models.gpt2 import chunked_gpt2_loss, gpt2_loss

    return chunked_gpt2_loss(loss_chunk) if loss_chunk else gpt2_loss


def _micro_is_auto(path) -> bool:
    """The config leaves train_micro_batch_size_per_gpu to "auto" (the planner picks it)."""
    import hjson

    with open(path) as f:
        return hjson.load(f).get("train_micro_batch_size_per_gpu") == "auto"


def _plan_micro_batch(cfg, gpt_cfg, dtype, remat, explore_remat, seq_len, loss_fn):
    """train_micro_batch_size_per_gpu "auto": the planner's fastest choice that fits the device
    (zerojax.planner: remat, micro-batch x accumulation keeping the global batch, stage, offload;
    compiled before anything is allocated). -> (config, remat)."""
    from flax import nnx

    import zerojax
    from zerojax import planner
    from zerojax.memory import device_budget
    from zerojax.models.gpt2 import GPT2

    budget = device_budget()
    if budget is None:
        print(f"micro-batch auto: this device reports no memory limit; using "
              f"{cfg.train_micro_batch_size_per_gpu}")
        return cfg, remat
    if explore_remat:  # the planner varies activation checkpointing
        def factory(remat_policy=None):
            return GPT2(gpt_cfg, rngs=nnx.Rngs(0), dtype=dtype, remat_policy=remat_policy)
    else:  # --remat given: kept
        def factory():
            return GPT2(gpt_cfg, rngs=nnx.Rngs(0), dtype=dtype, remat_policy=remat)
    found = planner.search(factory, cfg.to_dict(), budget, seq_len, loss_fn=loss_fn, max_plans=1)
    if not found.plans:
        raise zerojax.WillNotFitError(min((p.peak_bytes for p, _ in found.tried if p.peak_bytes), default=0),
                                      budget, (), what="every plan tried")
    best = found.plans[0]
    print(f"micro-batch auto: {found.explain(best)}")
    cfg = zerojax.load_config(best.apply(cfg.to_dict()), world_size=cfg.world_size)
    return cfg, (best.remat if explore_remat else remat)


def main(argv=None):
    args = parse_args(argv)
    from zerojax.distributed import init_distributed

    init_distributed()  # several processes (zerojax launch, srun, ...): before any device use
    import jax
    import numpy as np
    from flax import nnx
    from tqdm import tqdm

    # Each process feeds only its rows: the data loader splits every global batch by
    # jax.process_index(). Progress and prints come from process 0 only.
    quiet = jax.process_index() != 0
    if quiet:
        sys.stdout = open(os.devnull, "w")
    import zerojax
    from zerojax.data import load_text_data
    from zerojax.models.gpt2 import GPT2, GPT2Config, flops_per_token
    from zerojax.precision import compute_dtype

    gpu = jax.default_backend() == "gpu"
    size = args.model if args.model != "auto" else ("large" if gpu else "tiny")
    steps = args.steps or (100 if gpu else 300)

    hf = None
    if args.hf_checkpoint:
        from zerojax.models.hf import load_hf
        gpt_cfg, hf = load_hf(args.hf_checkpoint)
        tok_file = os.path.join(args.hf_checkpoint, "tokenizer.json")
        args.tokenizer = args.tokenizer or (tok_file if os.path.exists(tok_file) else None)
    else:
        gpt_cfg = GPT2Config.named(size)
    seq_len = args.seq_len or min(1024, gpt_cfg.n_positions)
    data = load_text_data(args.data, seq_len=seq_len, tokenizer=args.tokenizer)
    if data.vocab_size > gpt_cfg.vocab_size:
        sys.exit(f"the tokenizer has {data.vocab_size} tokens but the model's vocab is {gpt_cfg.vocab_size}")

    micro = int(args.micro_batch) if args.micro_batch not in (None, "auto") else (8 if gpu else 4)
    lr = args.lr or (1e-4 if hf is not None else 1e-3 if size == "tiny" else 3e-4)
    fill = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer.params.lr": lr, "optimizer.params.betas": [0.9, 0.999],
        "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0,
        "scheduler.params.warmup_min_lr": 0.0, "scheduler.params.warmup_max_lr": lr,
        "scheduler.params.warmup_num_steps": max(1, steps // 10),
        "scheduler.params.total_num_steps": steps,
        "gradient_clipping": 1.0,
        "bf16.enabled": gpu, "fp16.enabled": False,
    }
    cfg = zerojax.load_config(args.config, fill=fill)
    if cfg.optimizer is None:
        # DeepSpeed then expects a client optimizer (deepspeed.initialize(optimizer=...)), as the
        # Hugging Face Trainer supplies; ours is AdamW with the flags' lr.
        print(f"{args.config} has no optimizer section: using AdamW(lr={lr})")
        cfg = zerojax.load_config({**cfg.to_dict(), "optimizer": {"type": "AdamW", "params": {"lr": lr}}},
                                  world_size=cfg.world_size)

    if cfg.fp16.enabled and not gpu:
        sys.exit(f"{args.config} enables fp16, whose matrix products XLA does not run on CPU "
                 f"('F16_F16_F32' is not supported by dot_general); use a GPU or a bf16 config "
                 f"such as configs/zero2_bf16.json")
    remat = args.remat
    if remat is None:
        ac = cfg.activation_checkpointing
        remat = "none" if ac is None else ("offload" if ac.cpu_checkpointing else "full")
    remat = None if remat == "none" else remat
    dtype = compute_dtype(cfg)
    loss_fn = _loss_fn(args.loss_chunk)

    if args.micro_batch == "auto" or (args.micro_batch is None and _micro_is_auto(args.config)):
        cfg, remat = _plan_micro_batch(cfg, gpt_cfg, dtype, remat, args.remat is None, seq_len, loss_fn)
    if hf is not None:
        from zerojax.models.hf import gpt2_from_params
        model = gpt2_from_params(gpt_cfg, hf, dtype=dtype, remat_policy=remat)
    else:  # built shard by shard on the devices, never whole on one
        model = lambda: GPT2(gpt_cfg, rngs=nnx.Rngs(args.seed), dtype=dtype, remat_policy=remat)  # noqa: E731
    engine = zerojax.shard(model, cfg, loss_fn=loss_fn)
    del model, hf

    start = 0
    if args.resume:
        if not args.save:
            sys.exit("--resume needs --save DIR (the checkpoint folder to continue from)")
        engine.load_checkpoint(args.save)
        start = engine.global_steps
    batches = data.train_batches(cfg.train_batch_size, seed=args.seed, start_step=start,
                                 num_steps=max(0, steps - start))

    n_dev = jax.device_count()
    kind = jax.devices()[0].device_kind
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)
    fpt = flops_per_token(gpt_cfg, seq_len)
    print(f"GPT-2 {size} ({sum(x.size for x in jax.tree.leaves(engine.master_params)) / 1e6:.1f}M params), "
          f"{n_dev} x {kind}, ZeRO stage {cfg.zero_optimization.stage}, {dtype.name if hasattr(dtype, 'name') else dtype}, "
          f"batch {cfg.train_batch_size} = {cfg.train_micro_batch_size_per_gpu} x {cfg.gradient_accumulation_steps} "
          f"x {cfg.world_size}, seq {seq_len}, remat {remat}")

    tokens_per_step = cfg.train_batch_size * seq_len
    bar = tqdm(batches, total=max(0, steps - start), initial=0, desc="train", dynamic_ncols=True,
               disable=quiet)
    first_loss = last_loss = None
    t0, timed_tokens = None, 0
    for i, rows in enumerate(bar):
        metrics = engine.train_step({"input_ids": rows})
        if i == 0:
            first_loss = float(metrics["loss"])  # waits for the compile + first step
            t0 = time.perf_counter()
            continue
        timed_tokens += tokens_per_step
        if i % 10 == 0 or i == steps - start - 1:
            last_loss = float(metrics["loss"])
            tps = timed_tokens / (time.perf_counter() - t0)
            post = {"loss": f"{last_loss:.3f}", "tok/s": f"{tps:,.0f}"}
            if peak:
                post["MFU"] = f"{100 * tps * fpt / (peak * 1e12 * n_dev):.1f}%"
            stats = jax.local_devices()[0].memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                post["mem"] = f"{stats['peak_bytes_in_use'] / 2**30:.1f}GiB"
            bar.set_postfix(post)
    engine.synchronize()
    jax.block_until_ready(engine.state)
    bar.close()
    summary = {"model": size, "config": os.path.basename(args.config), "devices": n_dev,
               "stage": cfg.zero_optimization.stage, "train_batch_size": cfg.train_batch_size,
               "seq_len": seq_len, "remat": remat}
    if t0 is not None and timed_tokens:
        tps = timed_tokens / (time.perf_counter() - t0) / n_dev
        summary["tokens_per_s_per_device"] = round(tps)
        if peak:
            summary["mfu"] = round(tps * fpt / (peak * 1e12), 4)
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        summary["peak_gib_device0"] = round(stats["peak_bytes_in_use"] / 2**30, 2)

    val_losses = [float(engine.eval_step({"input_ids": rows}))
                  for _, rows in zip(range(args.eval_batches), data.val_batches(cfg.train_batch_size))]
    if val_losses:
        v = float(np.mean(val_losses))
        print(f"validation loss {v:.4f}, perplexity {math.exp(min(v, 50)):.2f}")
    if first_loss is not None and last_loss is not None:
        print(f"train loss {first_loss:.4f} -> {last_loss:.4f}")
    print(engine.memory_report())
    summary.update(first_loss=first_loss, last_loss=last_loss, val_loss=val_losses and float(np.mean(val_losses)))
    print("SUMMARY " + json.dumps(summary), flush=True)

    if args.save:
        engine.save_checkpoint(args.save)
        print(f"checkpoint saved under {args.save}")
    if args.export_hf:
        from zerojax.models.hf import save_hf
        save_hf(engine.master_params, gpt_cfg, args.export_hf)
        print(f"Hugging Face weights written to {args.export_hf}")
    engine.close()
    return summary


if __name__ == "__main__":
    from zerojax.config import ConfigError
    from zerojax.memory import WillNotFitError

    try:
        main()
    except (ConfigError, WillNotFitError, FileNotFoundError, FloatingPointError) as e:
        # the message names the key / file / step and the fix: no traceback needed
        sys.exit(f"error: {e}")
