"""The training loop: a run resolved from its flags (`zerojax.trainer.flags`), built and trained.

`zerojax train` and examples/gpt2_large.py are thin over `main`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable

from zerojax.data.rows import load_data, load_method_data
from zerojax.trainer.choice import ModelChoice, checkpoint_model, hf_model_type, named_model, tile_options
from zerojax.trainer.errors import ConfigMismatch
from zerojax.trainer.export import export_hf, host_peak_rss
from zerojax.trainer.flags import parse_args
from zerojax.trainer.setup import (batch_note, check_lora_resume, check_method, check_task_data, data_source,
                                   engine_options, filled_autos, from_checkpoint, lora_settings, loss_fn_for,
                                   offload_loop_auto, plan_micro_batch, print_run, requested_options,
                                   resolve_mlp_tile, resolved_config_source, resume_data, run_folders,
                                   summary_line, training_method, warn_replicated)


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn(step)` after every `every`-th training step of a run (and after its last): the step's
    `StepInfo` (global step, metrics as device scalars, the engine, the trainer)."""

    every: int
    fn: Callable[["StepInfo"], None]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    step: int          # the global step just taken (1-based)
    last: bool         # the run's last step
    metrics: dict      # the step's metrics (device scalars: reading one waits for the step)
    engine: Any
    trainer: "Trainer"


class Trainer:
    """A training run resolved from its flags (`args`: `zerojax.trainer.flags.parse_args`); `run()`
    builds it, trains, evaluates, saves, exports, and returns the SUMMARY dict. Hooks run every N
    steps: the built-in ones log (every 10), evaluate (`--eval-every`) and save (`--save-every`);
    `add_hook(every, fn)` adds one of a program's own."""

    def __init__(self, args):
        self.args = args
        self.hooks: list[Hook] = []

    def add_hook(self, every: int, fn: Callable[[StepInfo], None]) -> None:
        if int(every) < 1:
            raise ValueError(f"add_hook: every={every!r}; give a step count >= 1")
        self.hooks.append(Hook(int(every), fn))

    def run(self) -> dict:
        return _run(self)


def main(argv=None, *, prog=None, description=None):
    """Train as the flags say (`zerojax.trainer.flags`); returns the run's SUMMARY dict."""
    return Trainer(parse_args(argv, prog=prog, description=description)).run()


def _run(trainer: Trainer) -> dict:
    args = trainer.args
    from zerojax.launch.distributed import init_distributed

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
    from zerojax.checkpoint import files as checkpoint_files
    from zerojax.planning.ceiling import ceiling_is_stable, measure_matmul_ceiling
    from zerojax.train.monitor import SpeedMeter
    from zerojax.train.monitor import check_monitors
    from zerojax.precision import compute_dtype

    gpu = jax.default_backend() == "gpu"
    size = args.model if args.model != "auto" else ("large" if gpu else "tiny")
    steps = args.steps if args.steps is not None else (100 if gpu else 300)

    # the checkpoint folder first: leftovers of a killed save, and what a resumed run continues
    saved, notes, meta = {}, [], None
    if args.save:
        for path in checkpoint_files.remove_interrupted_saves(args.save):
            print(f"removed {path}: left by an interrupted save (the checkpoint it was writing never "
                  f"finished; `latest` still names the one before)")
    if args.resume:
        from zerojax.checkpoint.state import read_meta

        meta = read_meta(args.save)
        saved = ((meta.get("client_state") or {}).get("gpt2_large_example") or {})
        if not saved:
            notes.append("the checkpoint records no run settings (not saved by this example): "
                         "schedule, lr and seed come from the flags")
        resume_data(args, saved, notes)  # the run's own data unless --data says otherwise
    schedule_steps = from_checkpoint("schedule_steps", "--schedule-steps", args.schedule_steps, saved,
                                      max(steps, 1), notes)  # steps 0: the schedule is never used
    seed = from_checkpoint("seed", "--seed", args.seed, saved, 0, notes)

    if args.hf_checkpoint:  # its config now; its weights once the model's settings are known
        from zerojax.models import registry

        kind = hf_model_type(args.hf_checkpoint)
        family = registry.for_hf_type(kind)
        choice = ModelChoice(family, family.hf_config(args.hf_checkpoint), "hf", f"{kind} from {args.hf_checkpoint}")
        if os.path.exists(os.path.join(args.hf_checkpoint, "tokenizer.json")):
            args.tokenizer = args.tokenizer or args.hf_checkpoint  # the folder: its chat template too
    else:
        choice = named_model(size)
    if meta is not None:  # the checkpoint's model, before anything is built
        choice = checkpoint_model(meta, args, choice)
    size, family = choice.size, choice.family
    seq_len = args.seq_len if args.seq_len is not None else min(1024, choice.max_positions)
    if seq_len > choice.max_positions and choice.family_spec.learned_positions:
        raise ConfigMismatch(f"--seq-len {seq_len}: {choice.family_spec.label} has {choice.max_positions} positions")
    lr_default = 1e-4 if args.hf_checkpoint else 1e-3 if size == "tiny" or size.startswith("tiny-") else 3e-4
    lr = from_checkpoint("lr", "--lr", args.lr, saved, lr_default, notes)

    micro = args.micro_batch if args.micro_batch not in (None, "auto") else (8 if gpu else 4)
    fill = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": args.grad_accum or 1,
        "optimizer.params.lr": lr, "optimizer.params.betas": [0.9, 0.999],
        "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0,
        "scheduler.params.warmup_min_lr": 0.0, "scheduler.params.warmup_max_lr": lr,
        "scheduler.params.warmup_num_steps": max(1, schedule_steps // 10),
        "scheduler.params.total_num_steps": schedule_steps,
        "gradient_clipping": 1.0,
    }
    raw, precision, precision_why, replaced = resolved_config_source(args, fill, choice.config.n_embd, jax.devices()[0])
    notes += replaced
    # hidden_size: the ZeRO bucket / persistence "auto"s as the Hugging Face Trainer fills them
    cfg = zerojax.load_config(raw, fill=fill, hidden_size=choice.config.n_embd, name=args.config)
    if cfg.optimizer is None:
        # DeepSpeed then expects a client optimizer (deepspeed.initialize(optimizer=...)), as the
        # Hugging Face Trainer supplies; ours is AdamW with the flags' lr.
        print(f"{args.config} has no optimizer section: using AdamW(lr={lr})")
        cfg = zerojax.load_config({**cfg.to_dict(), "optimizer": {"type": "AdamW", "params": {"lr": lr}}},
                                  world_size=cfg.world_size)

    if cfg.fp16.enabled and not gpu:
        if args.precision == "fp16":
            raise ConfigMismatch("--fp16: XLA does not run fp16 matrix products on CPU ('F16_F16_F32' is not "
                                 "supported by dot_general); use --bf16 or --fp32 here, or --fp16 on a GPU")
        raise ConfigMismatch(f"{args.config} enables fp16 (fp16.enabled: true), whose matrix products XLA does "
                             f"not run on CPU ('F16_F16_F32' is not supported by dot_general); use a GPU, or "
                             f"a bf16 config such as configs/zero2_bf16.json")
    check_monitors(cfg)  # a monitor that cannot start (e.g. wandb not installed): now, not after the build
    # the planner runs for --micro-batch auto, or for the config's "auto" where no flag fills it
    planner_runs = args.micro_batch == "auto" or (args.micro_batch is None and
                                                  raw.get("train_micro_batch_size_per_gpu") == "auto")
    mlp_tile, mlp_tile_why = resolve_mlp_tile(args, choice, planner_runs)  # refused before the data is read
    dtype = compute_dtype(cfg)
    lora_cfg = lora_settings(args, cfg, dtype, saved.get("lora"))  # LoRA's refusals: before the data and the model
    if args.resume and saved:
        check_lora_resume(args, saved.get("lora"), lora_cfg, notes)
    method, method_opts = training_method(args, lora_cfg)  # None: sft (the next-token loss)
    if args.resume and saved and saved.get("method", "sft") != args.method:
        from zerojax.checkpoint.state import CheckpointError

        raise CheckpointError(f"{args.save}: this checkpoint trained --method {saved.get('method', 'sft')}, this run "
                              f"asks for --method {args.method}; resume with the checkpoint's method, or start "
                              "another --save folder")
    # read (and refuse) the data before anything is compiled
    check_task_data(args, method)
    if method is None:
        data = load_data(args, choice, seq_len, cfg.train_batch_size, notes)
    else:
        data = load_method_data(args, method, choice, seq_len, cfg.train_batch_size)
        method_opts = method.resolve(method_opts, data)
        check_method(method, method_opts, cfg, data)
    samples = None
    if args.sample_prompts:  # read and tokenized now: a bad file stops the run before anything compiles
        from zerojax.data.rows import run_tokenizer
        from zerojax.trainer.samples import SamplePrompts

        samples = SamplePrompts(args.sample_prompts, run_tokenizer(args), args.sample_tokens)
    # one batch's shapes (a method's batches are not {"input_ids"}): what the planner and the
    # offload probe compile, and the tokens a step trains on
    sample = next(iter(data.train_batches(cfg.train_batch_size, seed=seed, start_step=0, num_steps=1)))
    batch_fn = None if method is None else (lambda rows, seq: {
        k: np.zeros((rows, *np.shape(v)[1:]), np.asarray(v).dtype) for k, v in sample.items()})
    row_tokens = seq_len if method is None else sum(np.shape(v)[1] for k, v in sample.items() if k.endswith("_ids"))
    remat, configured_remat = args.remat, zerojax.config.remat_policy_for(cfg)
    remat_why = "--remat" + (f", replacing the config's activation_checkpointing ({configured_remat})"
                             if configured_remat not in (None, remat) else "")
    if remat is None:
        ac = cfg.activation_checkpointing
        remat = configured_remat or "none"
        remat_why = ("the config has no activation_checkpointing section" if ac is None else
                     "the config's activation_checkpointing section")
    remat = None if remat == "none" else remat
    loss_fn = loss_fn_for(args.loss_chunk, choice.family_spec) if method is None else method.loss(method_opts)

    def prepared(model):  # the method's change to the model (a reward head), after LoRA
        if method is None or method.prepare_model is None:
            return model
        return method.prepare_model(model, method_opts)

    # a randomly initialised model (the planner's and the offload probe's too)
    def build(remat_policy, prepare=True, mlp_tile=None):
        if lora_cfg is None:
            model = choice.build(seed, dtype, remat_policy, mlp_tile=mlp_tile)
        else:
            # LoRA: the base drawn in its stored dtype (an fp32 Llama-3.1-8B would not fit a 24 GB
            # card before it is cast), the adapters applied: what the planner compiles is what runs
            from zerojax import lora
            base_dtype = lora_cfg.get("base_dtype") or dtype
            model = lora.apply(choice.build(seed, dtype, remat_policy, param_dtype=base_dtype, mlp_tile=mlp_tile),
                               lora_cfg)
        return prepared(model) if prepare else model

    if lora_cfg is not None:  # the adapters' shapes, and LoRA's refusals (e.g. nf4 on a layer whose size
        from zerojax import lora  # is not a multiple of its block), before anything is compiled

        try:
            shaped = nnx.eval_shape(functools.partial(build, remat, prepare=False))
        except ValueError as e:
            if isinstance(e, zerojax.ConfigError):
                raise
            raise ConfigMismatch(f"LoRA on {choice.label}: {e}") from None
        lora_targets, lora_trained = shaped.adapter.targets, lora.trainable_count(shaped)
        del shaped
    planned = False
    if planner_runs:
        planned_remat = remat
        # the planner varies remat unless --remat or the config's remat_policy names one
        named = args.remat is not None or getattr(cfg.activation_checkpointing, "remat_policy", None) is not None
        cfg, remat, mlp_tile = plan_micro_batch(cfg, build, dtype, remat, not named, seq_len, loss_fn,
                                                requested_options(args), lora=lora_cfg is not None,
                                                batch_fn=batch_fn, mlp_tile=mlp_tile)
        planned = True
        if remat != planned_remat:
            remat_why = "chosen by the planner (micro-batch auto)"
        if args.mlp_tile == "auto":
            mlp_tile_why = "--mlp-tile auto: chosen by the planner"
    if mlp_tile == "auto":  # no planner ran (the device reports no memory limit to plan against)
        mlp_tile, mlp_tile_why = None, "--mlp-tile auto, but no planner ran: this device reports no memory limit"
    if meta is not None and batch_note(meta, cfg):
        notes.append(batch_note(meta, cfg))
    print_run(args, cfg, choice.label, size, steps, schedule_steps, lr, lr_default, precision, precision_why,
               remat, remat_why, seq_len, data, saved, notes, filled=filled_autos(raw, fill, cfg), lora=lora_cfg,
               mlp_tile=mlp_tile, mlp_tile_why=mlp_tile_why, row_tokens=row_tokens)
    make_model = functools.partial(build, remat, mlp_tile=mlp_tile)
    loop, loop_why = (args.offload_loop, "--offload-loop") if args.offload_loop else offload_loop_auto(
        cfg, make_model, seq_len, loss_fn,
        None if batch_fn is None else jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                                   batch_fn(cfg.train_batch_size, seq_len)))
    # FLOPs a token for MFU: the family's own count, else read off the parameter tree (zerojax.model)
    if choice.family_spec.counts is not None:
        fpt, n_params = choice.family_spec.counts(choice.config, seq_len)
    else:
        from zerojax.model import model_dims

        dims = model_dims(nnx.eval_shape(lambda: choice.build(seed, dtype, remat)))  # the whole model's
        fpt, n_params = dims.flops_per_token(seq_len), dims.params
    if lora_cfg is not None:  # a frozen base takes no weight gradients: 2 of its 6 FLOPs a parameter
        fpt -= 2.0 * n_params
    if args.hf_checkpoint:  # read tensor by tensor (fp32 storage), computing in dtype
        # (with LoRA: the frozen base read straight into its stored dtype, never whole in fp32)
        base_dtype = (lora_cfg.get("base_dtype") or dtype) if lora_cfg is not None else None
        model = choice.family_spec.from_hf(args.hf_checkpoint, base_dtype, remat_policy=remat, **tile_options(mlp_tile))
        model.dtype = np.dtype(dtype)
    elif lora_cfg is not None and lora_cfg.get("quantize") and gpu:
        # QLoRA: the base drawn on the host, each kernel quantized on the device as it arrives, so
        # the device never holds the unquantized base (lora.apply's `device`)
        with jax.default_device(jax.devices("cpu")[0]):
            model = lora.apply(choice.build(seed, dtype, remat, param_dtype=dtype, mlp_tile=mlp_tile), lora_cfg,
                               device=jax.devices()[0])
    else:  # built shard by shard on the devices, never whole on one
        model = make_model
    if lora_cfg is not None:
        from zerojax import lora

        if isinstance(model, nnx.Module) and getattr(model, "adapter", None) is None:  # read from a folder
            model = lora.apply(model, lora_cfg)
        print(f"LoRA: rank {lora_cfg['r']}, alpha {lora_cfg['lora_alpha']:g}, targets "
              f"{', '.join(lora_targets)}; {lora_trained:,} trained parameters, the base "
              f"frozen" + (f" and stored {lora_cfg['quantize']}" if lora_cfg.get("quantize") else
                           f" in {lora_cfg['base_dtype']}"))
    if isinstance(model, nnx.Module):  # read from a folder or quantized on arrival: the method's change now
        model = prepared(model)
    # e.g. a frozen model's reference log-probs: from the model read here, else (drawn on the devices)
    # from the engine's as built, before a checkpoint loads (the uninterrupted run's starting point)
    reference_later = method is not None and method.prepare_data is not None and not isinstance(model, nnx.Module)
    if method is not None and method.prepare_data is not None and not reference_later:
        data = method.prepare_data(data, model, method_opts, cfg.train_batch_size)
    options = engine_options(args, cfg, loop, planned)
    # MFU's denominator: --peak-tflops, else the matmul ceiling in the run's precision, measured
    # before the engine holds any memory (its buffers are freed); none where no step is timed (the
    # first one compiles), nor on CPU, where the measured rate is not stable (zerojax.planning.ceiling)
    peak, peak_why = args.peak_tflops, "--peak-tflops"
    if peak is None:
        if steps < 2:
            peak_why = "no MFU (fewer than 2 steps: none is timed)"
        elif not ceiling_is_stable():
            peak_why = ("no MFU on CPU: its matmul rate varies from run to run, so there is no ceiling to "
                        "measure against (--peak-tflops gives one)")
        else:
            peak = measure_matmul_ceiling(dtype=dtype)["ceiling_tflops"]
            peak_why = f"the {np.dtype(dtype).name} matmul ceiling measured here"
    engine = zerojax.shard(model, cfg, loss_fn=loss_fn, options=options)
    del model
    if reference_later:
        data = method.prepare_data(data, engine.model, method_opts, cfg.train_batch_size)
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats and "bytes_limit" in stats:
        print(f"device memory after building: {stats['bytes_in_use'] / 2**30:.2f} GiB in use of "
              f"{stats['bytes_limit'] / 2**30:.2f} (build peak {stats.get('peak_bytes_in_use', 0) / 2**30:.2f})")
    warn_replicated(engine, cfg)
    if engine.offload_settings and cfg.zero_optimization.offload_optimizer.device == "cpu":
        o = engine.offload_settings
        print(f"optimizer offload: {o['loop']} loop, {o['chunks']} layer group(s), "
              f"master {'split (bf16 copy + 16-bit host remainder)' if o.get('split_master') else 'fp32'}, "
              f"first moment {engine.options.adam_mu_dtype or 'fp32'}" + (f" ({loop_why})" if loop_why else ""))

    start = 0 if meta is None else int(meta.get("global_steps") or 0)
    rollouts = None
    if method is not None and method.rollouts is not None:
        # RL: batches generated each step on the live engine. Made before the checkpoint loads: a
        # "copy" reference and PPO's critic start from the weights as built (the uninterrupted
        # run's starting point), the critic's own state then read back beside the actor's
        rollouts = method.rollouts(engine, data, method_opts, seed=seed, start_step=start,
                                   num_steps=max(0, steps - start))
    if args.resume:
        path, _ = engine.load_checkpoint(args.save)
        if engine.global_steps != start:
            raise RuntimeError(f"{path}: its record says step {start}, the engine read step {engine.global_steps}")
        if hasattr(rollouts, "load"):
            rollouts.load(args.save, tag=os.path.basename(path))
    batches = rollouts if rollouts is not None else data.train_batches(
        cfg.train_batch_size, seed=seed, start_step=start, num_steps=max(0, steps - start))
    if args.resume:
        epoch, k = divmod(start, data.steps_per_epoch)
        print(f"resumed from {path} at step {start} (data position: batch {start}, i.e. epoch {epoch} "
              f"batch {k} of {data.steps_per_epoch}, seed {seed})")
        if start >= steps:
            print(f"the checkpoint is at step {start} >= --steps {steps}: nothing to train "
                  f"(raise --steps to continue)")

    n_dev = jax.device_count()
    kind = jax.devices()[0].device_kind
    # from shapes: under offload `master_params` merges every host chunk on the device (32 GB at 8B)
    trained = sum(x.size for x in jax.tree.leaves(engine.layout.abstract_master))
    whole = trained if lora_cfg is None else sum(  # LoRA: the frozen base's too
        int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: choice.build(seed, dtype, remat)),
                                                                 nnx.Param)))
    print(f"{choice.label} ({whole / 1e6:.1f}M params" + (f"; LoRA: {trained:,} trained" if lora_cfg else "") + "), "
          f"{n_dev} x {kind}, ZeRO stage {cfg.zero_optimization.stage}, {dtype.name if hasattr(dtype, 'name') else dtype}, "
          f"batch {cfg.train_batch_size} = {cfg.train_micro_batch_size_per_gpu} x {cfg.gradient_accumulation_steps} "
          f"x {cfg.world_size}, seq {seq_len}, remat {remat}; " + (
              f"MFU against {peak:.3g} TFLOP/s per device ({peak_why})" if peak else peak_why)
          + "; tokens/s are per device, steps that compile excluded")

    # one definition of speed (zerojax.train.monitor.SpeedMeter): tokens/s per device over the steps
    # that compiled nothing, in the progress bar, the log lines and the SUMMARY alike
    meter = SpeedMeter(cfg.train_batch_size * row_tokens, n_dev, fpt, peak)
    # a progress bar on a terminal; elsewhere (a log file, a pipe) one line every 10 steps
    interactive = not quiet and sys.stderr.isatty()
    bar = tqdm(batches, total=max(0, steps - start), initial=0, desc="train", dynamic_ncols=True,
               disable=not interactive)
    losses = []  # device scalars, read once at the end (no host sync per step)

    def log_progress(info: StepInfo):
        metrics = info.metrics
        meter.sync(metrics["loss"])
        post = {"loss": f"{float(metrics['loss']):.3f}"}
        for key in method_keys:  # the method's own metrics (DPO's rewards/margins, ...)
            post[key] = f"{float(metrics[key]):.3f}"
        if meter.tokens_per_s_per_device is not None:
            post["tok/s/device"] = f"{meter.tokens_per_s_per_device:,.0f}"
        if meter.mfu is not None:
            post["MFU"] = f"{100 * meter.mfu:.1f}%"
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            post["mem"] = f"{stats['peak_bytes_in_use'] / 2**30:.1f}GiB"
        if interactive:
            bar.set_postfix(post)
        elif not quiet:
            print(f"step {info.step}/{steps}: loss {post['loss']}"
                  + "".join(f", {k} {post[k]}" for k in method_keys)
                  + (f", {post['tok/s/device']} tokens/s per device" if "tok/s/device" in post else "")
                  + (f", MFU {post['MFU']}" if "MFU" in post else "")
                  + (f", peak memory {post['mem']}" if "mem" in post else ""), flush=True)

    def evaluate(info: StepInfo):
        vals = [float(engine.eval_step(b)) for _, b in zip(range(args.eval_batches), data.val_batches(cfg.train_batch_size))]
        if vals:
            print(f"step {info.step}: validation loss {float(np.mean(vals)):.4f}", flush=True)
        if samples is not None:
            samples.print_samples(engine, f"step {info.step}")

    saved_at = []  # the steps --save-every saved at (the run's end saves again only after another)

    def save(info: StepInfo):
        path = save_all()
        saved_at.append(info.step)
        print(f"step {info.step}: checkpoint saved: {path}", flush=True)

    def save_all():  # the engine's checkpoint, and the RL rollouts' own state (PPO's critic) beside it
        path = engine.save_checkpoint(args.save, client_state=client_state(), keep=args.keep)
        if hasattr(rollouts, "save"):
            rollouts.save(args.save, tag=os.path.basename(path), keep=args.keep)
        return path

    def client_state():
        return {"gpt2_large_example": {"schedule_steps": schedule_steps, "lr": lr, "seed": seed, "lora": lora_cfg,
                                       "method": args.method, "method_options": method_opts,
                                       "data": data_source(args.data), **run_folders(args)}}

    hooks = [Hook(10, log_progress)]
    if args.eval_every:
        hooks.append(Hook(args.eval_every, evaluate))
    if args.save_every:
        hooks.append(Hook(args.save_every, save))
    hooks += trainer.hooks
    method_keys: list = []
    last_metrics = {}
    began = time.perf_counter()  # the training loop's wall time, compiles included: the closing line's
    for i, batch in enumerate(bar):
        meter.before_step()
        metrics = engine.train_step(batch)
        if rollouts is not None:  # the rollout's metrics (reward/mean, ...) logged beside the loss's
            metrics = {**metrics, **{k: v for k, v in rollouts.metrics.items()
                                     if "/" in k and not k.startswith("time/")}}
        losses.append(metrics["loss"])
        meter.after_step(metrics["loss"])
        if method is not None and not method_keys:
            method_keys = sorted(k for k in metrics if "/" in k)  # TRL's names: rewards/chosen, ...
        last_metrics = metrics
        last = i == steps - start - 1
        info = StepInfo(step=start + i + 1, last=last, metrics=metrics, engine=engine, trainer=trainer)
        for hook in hooks:  # counted in this run's steps, the last one always
            if (i + 1) % hook.every == 0 or (last and hook.fn is log_progress):
                hook.fn(info)
    engine.synchronize()
    jax.block_until_ready(engine.state)
    bar.close()
    train_seconds = time.perf_counter() - began
    losses = [float(x) for x in losses]
    summary = {"model": size, "family": family, "config": os.path.basename(args.config), "devices": n_dev,
               "stage": cfg.zero_optimization.stage, "train_batch_size": cfg.train_batch_size,
               "seq_len": seq_len, "remat": remat, "mlp_tile": mlp_tile, "precision": precision, "start_step": start,
               "steps": steps, "schedule_steps": schedule_steps, "lr": lr,
               "master_split": engine.layout.master_split, "trained_params": int(trained),
               "lora": lora_cfg, "train_seconds": round(train_seconds, 2)}
    if method is not None:
        summary.update(method=args.method, method_options=method_opts,
                       method_metrics={k: float(last_metrics[k]) for k in method_keys})
    if rollouts is not None and len(rollouts.history) > 2:
        summary["rollouts"] = rollout_times(rollouts.history, cfg.train_batch_size)
    if meter.tokens_per_s_per_device is not None:
        summary["tokens_per_s_per_device"] = round(meter.tokens_per_s_per_device)
    if meter.mfu is not None:
        summary["mfu"] = round(meter.mfu, 4)
        summary["mfu_against_tflops"] = float(f"{peak:.3g}")
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        summary["peak_gib_device0"] = round(stats["peak_bytes_in_use"] / 2**30, 2)
    host_peak = host_peak_rss()
    if host_peak is not None:  # offload's state lives there: the host's share of "never an OOM"
        summary["host_peak_rss_gib"] = round(host_peak / 2**30, 2)
        print(f"host peak RSS {host_peak / 2**30:.2f} GiB (this process, building included)")

    val_losses = [float(engine.eval_step(batch))
                  for _, batch in zip(range(args.eval_batches), data.val_batches(cfg.train_batch_size))]
    if val_losses:
        v = float(np.mean(val_losses))
        print(f"validation loss {v:.4f}" + (f", perplexity {math.exp(min(v, 50)):.2f}" if method is None else ""))
    if losses:
        print(f"train loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if samples is not None:
        summary["samples"] = samples.print_samples(engine, f"step {engine.global_steps}")
    print(engine.memory_report())
    summary.update(first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                   losses=losses, val_loss=float(np.mean(val_losses)) if val_losses else None)
    # for programs (benchmarks/ and the tests grep `^SUMMARY `); people get the closing line below
    print("SUMMARY " + summary_line(summary), flush=True)
    if args.summary_json and not quiet:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)

    # a resumed run that trained nothing changed nothing; --save-every may have saved the last step already
    if args.save and (losses or not args.resume) and saved_at[-1:] != [engine.global_steps]:
        before = set(checkpoint_files.finalized_tags(args.save))
        path = save_all()
        print(f"checkpoint saved: {path}")
        removed = sorted(before - set(checkpoint_files.finalized_tags(args.save)))
        if removed:
            print(f"--keep {args.keep}: removed the older checkpoint(s) {', '.join(removed)}")
    if args.export_hf:
        export_hf(args, engine, choice, lora_cfg, method=method)
    engine.close()
    print(closing_line(summary), flush=True)  # last: what people read of a run
    return summary


def rollout_times(history: list, rows: int) -> dict:
    """An RL run's split of time over the steps that compiled nothing (the first is left out):
    seconds generating (rollouts, rewards, log-probs) and training, and completions trained a
    second. A step's training is timed when the next rollout starts (`history[k + 1]`'s
    "time/train_s"), so the last step, whose training no rollout follows, is left out too."""
    pairs = [(history[k]["time/generate_s"], history[k + 1]["time/train_s"]) for k in range(1, len(history) - 1)]
    generate, train = sum(g for g, _ in pairs), sum(t for _, t in pairs)
    total = generate + train
    return {"steps_timed": len(pairs), "generate_s": round(generate, 3), "train_s": round(train, 3),
            "generate_share": round(generate / total, 3) if total > 0 else None,
            "samples_per_s": round(rows * len(pairs) / total, 2) if total > 0 else None}


def closing_line(summary: dict) -> str:
    """The run in one line for people, from its SUMMARY: steps and time, loss first -> last,
    speed, validation loss, device peak."""
    losses, start = summary["losses"], summary["start_step"]
    if not losses:
        parts = [f"no training step (at global step {start})"]
    else:
        parts = [f"trained {len(losses)} step{'s' if len(losses) != 1 else ''}"
                 + (f" ({start} -> {start + len(losses)})" if start else "")
                 + f" in {summary['train_seconds']:.1f} s: loss {losses[0]:.2f} -> {losses[-1]:.2f}"]
    if summary.get("tokens_per_s_per_device") is not None:
        parts.append(f"{summary['tokens_per_s_per_device']:,} tokens/s per device")
    if summary.get("mfu") is not None:
        parts.append(f"MFU {100 * summary['mfu']:.1f}%")
    if summary.get("val_loss") is not None:
        parts.append(f"validation loss {summary['val_loss']:.2f}")
    if summary.get("peak_gib_device0") is not None:
        parts.append(f"peak {summary['peak_gib_device0']:.1f} GiB")
    elif summary.get("host_peak_rss_gib") is not None:  # CPU: its devices report no peak
        parts.append(f"host peak {summary['host_peak_rss_gib']:.1f} GiB")
    return ", ".join(parts)


def run_cli(argv=None, *, prog=None, description=None) -> int:
    """`main` for a command line: a user's mistake (an error that names its key, file or step and the
    fix) ends the run with that one `error:` line (exit status 1), Ctrl-C with one line (130), no
    traceback; --debug shows it (zerojax.trainer.exits)."""
    from zerojax.trainer.exits import run_command, split_debug

    argv, debug = split_debug(list(sys.argv[1:] if argv is None else argv))

    def train() -> int:
        main(argv, prog=prog, description=description)
        return 0

    return run_command(train, debug)
