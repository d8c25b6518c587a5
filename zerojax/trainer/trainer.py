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
from collections.abc import Callable
from typing import Any

from zerojax.data.rows import load_data, load_method_data
from zerojax.model_arg import ModelChoice, tile_options
from zerojax.trainer.choice import checkpoint_model, hf_model_type, named_model
from zerojax.trainer.errors import ConfigMismatch
from zerojax.trainer.export import export_hf, host_peak_rss
from zerojax.trainer.flags import parse_args
from zerojax.trainer.report import closing_line, last_good_checkpoint, rollout_summary, stopped_line
from zerojax.trainer.setup import (
    batch_note,
    check_lora_resume,
    check_method,
    check_task_data,
    configured_remat,
    data_source,
    engine_options,
    filled_autos,
    from_checkpoint,
    longest_seq_len,
    lora_settings,
    loss_fn_for,
    offload_loop_auto,
    plan_micro_batch,
    print_run,
    remat_named,
    requested_options,
    resolve_mlp_tile,
    resolved_config_source,
    resume_data,
    run_folders,
    seq_len_why,
    summary_line,
    training_method,
    warn_replicated,
)
from zerojax.trainer.stopping import StopRequest


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn(step)` after every `every`-th training step of a run (and after its last): the step's
    `StepInfo` (global step, metrics as device scalars, the engine, the trainer)."""

    every: int
    fn: Callable[[StepInfo], None]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    step: int          # the global step just taken (1-based)
    last: bool         # the run's last step
    metrics: dict      # the step's metrics (device scalars: reading one waits for the step)
    engine: Any
    trainer: Trainer


class Trainer:
    """A training run resolved from its flags (`args`: `zerojax.trainer.flags.parse_args`); `run()`
    resolves it, builds it, trains, evaluates, saves, exports, and returns the SUMMARY dict.

    Phases, each a method a subclass may override (torchtitan's `Trainer` is the model):
    `resolve()` (every setting, read and refused before anything is compiled: the checkpoint folder,
    the model, the config, the method and its data, the plan), `build()` (the model and the engine,
    the rollouts, the resume), `batches()`, `train_step(batch)` (forward, backward, update: the
    step's metrics), `train()` (the loop and its hooks), `evaluate(info)`, `save(info)`, `finish()`
    (the summary, the last save, the export) and `close()`. Hooks run every N steps: the built-in
    ones log (every 10), evaluate (`--eval-every`) and save (`--save-every`); `add_hook(every, fn)`
    adds one of a program's own. The run's settings are attributes set by the phase that resolves
    them (`self.cfg`, `self.choice`, `self.method`, `self.data`, `self.engine`, ...)."""

    def __init__(self, args):
        self.args = args
        self.hooks: list[Hook] = []

    def add_hook(self, every: int, fn: Callable[[StepInfo], None]) -> None:
        if int(every) < 1:
            raise ValueError(f"add_hook: every={every!r}; give a step count >= 1")
        self.hooks.append(Hook(int(every), fn))

    def run(self) -> dict:
        from zerojax.launch.distributed import init_distributed

        init_distributed()  # several processes (zerojax launch, srun, ...): before any device use
        save = self.args.save
        if not save:
            return self._phases()
        from zerojax.checkpoint import lock

        note = lock.acquire(save)  # one run per folder: before its clean-up of interrupted saves
        if note:
            print(note)
        try:
            return self._phases()
        except FloatingPointError as e:  # the step's cause, and where the run's good weights are
            raise FloatingPointError(f"{e}. {last_good_checkpoint(save)}") from None
        finally:
            lock.release(save)

    def _phases(self) -> dict:
        self.resolve()
        self.build()
        if self.train():
            return self.finish()
        return self.stopped()

    # ------------------------------------------------------------------ resolve: nothing built yet

    def resolve(self) -> None:
        """Every setting of the run, refused in one line before anything is compiled."""
        import jax

        # Each process feeds only its rows: the data loader splits every global batch by
        # jax.process_index(). Progress and prints come from process 0 only.
        self.quiet = jax.process_index() != 0
        if self.quiet:
            sys.stdout = open(os.devnull, "w")
        self.gpu = jax.default_backend() == "gpu"
        self.read_save_folder()
        self.choose_model()
        self.load_config()
        self.choose_remat()
        self.fit_seq_len()
        self.read_data()
        self.plan()

    def read_save_folder(self) -> None:
        """The checkpoint folder first: leftovers of a killed save, and what a resumed run continues."""
        from zerojax.checkpoint import files as checkpoint_files

        args = self.args
        self.saved, self.notes, self.meta = {}, [], None
        if args.save:
            for path in checkpoint_files.remove_interrupted_saves(args.save):
                print(f"removed {path}: left by an interrupted save (the checkpoint it was writing never "
                      f"finished; `latest` still names the one before)")
        if args.resume:
            from zerojax.checkpoint.state import read_meta

            self.meta = read_meta(args.save)
            self.saved = ((self.meta.get("client_state") or {}).get("gpt2_large_example") or {})
            if not self.saved:
                self.notes.append("the checkpoint records no run settings (not saved by this example): "
                                  "schedule, lr and seed come from the flags")
            resume_data(args, self.saved, self.notes)  # the run's own data unless --data says otherwise

    def choose_model(self) -> None:
        """The model (a named shape, a Hugging Face folder, or the checkpoint's), the steps, the
        schedule, the seed, the row length and the learning rate."""
        args, saved, notes = self.args, self.saved, self.notes
        size = args.model if args.model != "auto" else ("large" if self.gpu else "tiny")
        self.steps = args.steps if args.steps is not None else (100 if self.gpu else 300)
        self.schedule_steps = from_checkpoint("schedule_steps", "--schedule-steps", args.schedule_steps, saved,
                                              max(self.steps, 1), notes)  # steps 0: the schedule is never used
        self.seed = from_checkpoint("seed", "--seed", args.seed, saved, 0, notes)
        if args.hf_checkpoint:  # its config now; its weights once the model's settings are known
            from zerojax.models import registry

            kind = hf_model_type(args.hf_checkpoint)
            family = registry.for_hf_type(kind)
            choice = ModelChoice.of_family(family, family.hf_config(args.hf_checkpoint), "hf",
                                           f"{kind} from {args.hf_checkpoint}")
            if os.path.exists(os.path.join(args.hf_checkpoint, "tokenizer.json")):
                args.tokenizer = args.tokenizer or args.hf_checkpoint  # the folder: its chat template too
        else:
            choice = named_model(size)
        if self.meta is not None:  # the checkpoint's model, before anything is built
            choice = checkpoint_model(self.meta, args, choice)
        self.choice, self.size = choice, choice.size
        self.seq_why = ""  # said in the run header where the length was searched (--seq-len auto)
        self.seq_len = args.seq_len if args.seq_len is not None else min(1024, choice.max_positions)
        if self.seq_len == "auto":
            self.seq_len = None  # the longest row that fits: found once the config is read (fit_seq_len)
        elif self.seq_len > choice.max_positions and choice.family_spec.learned_positions:
            raise ConfigMismatch(f"--seq-len {self.seq_len}: {choice.family_spec.label} has "
                                 f"{choice.max_positions} positions")
        tiny = self.size == "tiny" or self.size.startswith("tiny-")
        self.lr_default = 1e-4 if args.hf_checkpoint else 1e-3 if tiny else 3e-4
        self.lr = from_checkpoint("lr", "--lr", args.lr, saved, self.lr_default, notes)

    def load_config(self) -> None:
        """The DeepSpeed config, its "auto"s filled from the flags; precision, LoRA and the method."""
        import jax

        import zerojax
        from zerojax.engine.monitor import check_monitors
        from zerojax.precision import compute_dtype

        args, lr, gpu = self.args, self.lr, self.gpu
        micro = args.micro_batch if args.micro_batch not in (None, "auto") else (8 if gpu else 4)
        self.fill = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": args.grad_accum or 1,
            "optimizer.params.lr": lr, "optimizer.params.betas": [0.9, 0.999],
            "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0,
            "scheduler.params.warmup_min_lr": 0.0, "scheduler.params.warmup_max_lr": lr,
            "scheduler.params.warmup_num_steps": max(1, self.schedule_steps // 10),
            "scheduler.params.total_num_steps": self.schedule_steps,
            "gradient_clipping": 1.0,
        }
        hidden = self.choice.config.n_embd
        self.raw, self.precision, self.precision_why, replaced = resolved_config_source(
            args, self.fill, hidden, jax.devices()[0])
        self.notes += replaced
        # hidden_size: the ZeRO bucket / persistence "auto"s as the Hugging Face Trainer fills them
        cfg = zerojax.load_config(self.raw, fill=self.fill, hidden_size=hidden, name=args.config)
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
                                 f"not run on CPU ('F16_F16_F32' is not supported by dot_general); add --bf16 (its "
                                 f"fp16 section then off, the rest as written), or run it on a GPU")
        check_monitors(cfg)  # a monitor that cannot start (e.g. wandb not installed): now, not after the build
        self.cfg = cfg
        # the planner runs for --micro-batch auto, or for the config's "auto" where no flag fills it
        self.planner_runs = args.micro_batch == "auto" or (
            args.micro_batch is None and self.raw.get("train_micro_batch_size_per_gpu") == "auto")
        # refused before the data is read
        self.mlp_tile, self.mlp_tile_why = resolve_mlp_tile(args, self.choice, self.planner_runs)
        self.dtype = compute_dtype(cfg)
        # LoRA's refusals: before the data and the model
        self.lora_cfg = lora_settings(args, cfg, self.dtype, self.saved.get("lora"))
        if args.resume and self.saved:
            check_lora_resume(args, self.saved.get("lora"), self.lora_cfg, self.notes)
        self.method, self.method_opts = training_method(args, self.lora_cfg)  # None: sft (the next-token loss)
        if args.resume and self.saved and self.saved.get("method", "sft") != args.method:
            from zerojax.checkpoint.state import CheckpointError

            raise CheckpointError(f"{args.save}: this checkpoint trained --method {self.saved.get('method', 'sft')}, "
                                  f"this run asks for --method {args.method}; resume with the checkpoint's method, "
                                  "or start another --save folder")

    def read_data(self) -> None:
        """The data (and the sample prompts), read and refused before anything is compiled; one
        batch's shapes for the planner and the tokens a step trains on."""
        import numpy as np

        args, method, cfg = self.args, self.method, self.cfg
        check_task_data(args, method)
        if method is None:
            self.data = load_data(args, self.choice, self.seq_len, cfg.train_batch_size, self.notes)
        else:
            self.data = load_method_data(args, method, self.choice, self.seq_len, cfg.train_batch_size)
            self.method_opts = method.resolve(self.method_opts, self.data)
            check_method(method, self.method_opts, cfg, self.data)
        self.samples = None
        if args.sample_prompts:  # read and tokenized now: a bad file stops the run before anything compiles
            from zerojax.data.rows import run_tokenizer
            from zerojax.trainer.samples import SamplePrompts

            self.samples = SamplePrompts(args.sample_prompts, run_tokenizer(args), args.sample_tokens)
        # one batch's shapes (a method's batches are not {"input_ids"}): what the planner and the
        # offload probe compile, and the tokens a step trains on
        sample = next(iter(self.data.train_batches(cfg.train_batch_size, seed=self.seed, start_step=0,
                                                   num_steps=1)))
        self.batch_fn = None if method is None else (lambda rows, seq: {
            k: np.zeros((rows, *np.shape(v)[1:]), np.asarray(v).dtype) for k, v in sample.items()})
        self.row_tokens = self.seq_len if method is None else sum(
            np.shape(v)[1] for k, v in sample.items() if k.endswith("_ids"))

    def choose_remat(self) -> None:
        """The remat policy: the flag's, else the config's."""
        args, cfg = self.args, self.cfg
        remat, configured = args.remat, configured_remat(cfg, lambda: self.choice.build(self.seed, self.dtype, None))
        self.remat_why = "--remat" + (f", replacing the config's activation_checkpointing ({configured})"
                                      if configured not in (None, remat) else "")
        if remat is None:
            remat = configured or "none"
            self.remat_why = ("the config has no activation_checkpointing section" if cfg.activation_checkpointing
                              is None else "the config's activation_checkpointing section")
        self.remat = None if remat == "none" else remat

    def fit_seq_len(self) -> None:
        """--seq-len auto: the longest row whose compiled step fits the device and the host memory,
        before the data is cut into rows of it (`zerojax.trainer.setup.longest_seq_len`)."""
        if self.seq_len is not None:
            return
        tile = None if self.mlp_tile == "auto" else self.mlp_tile  # micro-batch auto then tiles the row found
        # where micro-batch auto chooses the remat, the longest row is the one its heaviest choice ("full") reaches
        remat = "full" if self.planner_runs and not remat_named(self.args, self.cfg) else self.remat
        found, micro = longest_seq_len(
            self.args, self.cfg, self.method, lambda: self.build_model(remat, mlp_tile=tile),
            loss_fn_for(self.args.loss_chunk, self.choice.family_spec), self.choice.position_cap, self.planner_runs)
        self.seq_len, self.seq_why = found.seq_len, seq_len_why(found, micro, remat, self.planner_runs)

    def plan(self) -> None:
        """LoRA's shapes, the planner's micro-batch (--micro-batch auto), the offload loop and the
        FLOPs a token; the run's header printed."""
        import jax

        args = self.args
        self.loss_fn = (loss_fn_for(args.loss_chunk, self.choice.family_spec) if self.method is None
                        else self.method.loss(self.method_opts))
        if self.lora_cfg is not None:
            self._lora_shapes()
        self.planned = False
        if self.planner_runs:
            self._plan_micro_batch()
        if self.mlp_tile == "auto":  # no planner ran (the device reports no memory limit to plan against)
            self.mlp_tile = None
            self.mlp_tile_why = "--mlp-tile auto, but no planner ran: this device reports no memory limit"
        if self.meta is not None and batch_note(self.meta, self.cfg):
            self.notes.append(batch_note(self.meta, self.cfg))
        print_run(args, self.cfg, self.choice.label, self.size, self.steps, self.schedule_steps, self.lr,
                  self.lr_default, self.precision, self.precision_why, self.remat, self.remat_why, self.seq_len,
                  self.data, self.saved, self.notes, filled=filled_autos(self.raw, self.fill, self.cfg),
                  lora=self.lora_cfg, mlp_tile=self.mlp_tile, mlp_tile_why=self.mlp_tile_why,
                  row_tokens=self.row_tokens, seq_why=self.seq_why)
        self.make_model = functools.partial(self.build_model, self.remat, mlp_tile=self.mlp_tile)
        shapes = None if self.batch_fn is None else jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.batch_fn(self.cfg.train_batch_size, self.seq_len))
        self.loop, self.loop_why = (args.offload_loop, "--offload-loop") if args.offload_loop else offload_loop_auto(
            self.cfg, self.make_model, self.seq_len, self.loss_fn, shapes)
        self.flops_per_token, self.n_params = self._counts()

    def _lora_shapes(self) -> None:
        """The adapters' shapes, and LoRA's refusals (e.g. nf4 on a layer whose size is not a multiple
        of its block), before anything is compiled."""
        from flax import nnx

        import zerojax
        from zerojax import lora

        try:
            shaped = nnx.eval_shape(functools.partial(self.build_model, self.remat, prepare=False))
        except ValueError as e:
            if isinstance(e, zerojax.ConfigError):
                raise
            raise ConfigMismatch(f"LoRA on {self.choice.label}: {e}") from None
        self.lora_targets, self.lora_trained = shaped.adapter.targets, lora.trainable_count(shaped)

    def _plan_micro_batch(self) -> None:
        args, cfg = self.args, self.cfg
        planned_remat = self.remat
        self.cfg, self.remat, self.mlp_tile = plan_micro_batch(
            cfg, self.build_model, self.dtype, self.remat, not remat_named(args, cfg), self.seq_len, self.loss_fn,
            requested_options(args), lora=self.lora_cfg is not None, batch_fn=self.batch_fn, mlp_tile=self.mlp_tile)
        self.planned = True
        if self.remat != planned_remat:
            self.remat_why = "chosen by the planner (micro-batch auto)"
        if args.mlp_tile == "auto":
            self.mlp_tile_why = "--mlp-tile auto: chosen by the planner"

    def _counts(self) -> tuple[float, int]:
        """FLOPs a token for MFU and the parameter count: the family's own count, else read off the
        parameter tree (zerojax.model); a frozen LoRA base takes no weight gradients (2 of its 6)."""
        choice = self.choice
        if choice.family_spec.counts is not None:
            fpt, n_params = choice.family_spec.counts(choice.config, self.seq_len)
        else:
            from flax import nnx

            from zerojax.model import model_dims

            dims = model_dims(nnx.eval_shape(lambda: choice.build(self.seed, self.dtype, self.remat)))
            fpt, n_params = dims.flops_per_token(self.seq_len), dims.params
        if self.lora_cfg is not None:
            fpt -= 2.0 * n_params
        return fpt, n_params

    def build_model(self, remat_policy, prepare=True, mlp_tile=None):
        """A randomly initialised model (the planner's and the offload probe's too), with LoRA's
        adapters and the method's change (`prepare`)."""
        choice, seed, dtype, lora_cfg = self.choice, self.seed, self.dtype, self.lora_cfg
        if lora_cfg is None:
            model = choice.build(seed, dtype, remat_policy, mlp_tile=mlp_tile)
        else:
            # LoRA: the base drawn in its stored dtype (an fp32 Llama-3.1-8B would not fit a 24 GB
            # card before it is cast), the adapters applied: what the planner compiles is what runs
            from zerojax import lora

            base_dtype = lora_cfg.get("base_dtype") or dtype
            model = lora.apply(choice.build(seed, dtype, remat_policy, param_dtype=base_dtype, mlp_tile=mlp_tile),
                               lora_cfg)
        return self.prepared(model) if prepare else model

    def prepared(self, model):
        """The method's change to the model (a reward head), after LoRA."""
        if self.method is None or self.method.prepare_model is None:
            return model
        return self.method.prepare_model(model, self.method_opts)

    # ------------------------------------------------------------------ build

    def build(self) -> None:
        """The model and the engine; the RL rollouts; the checkpoint read back (--resume)."""
        import zerojax

        model = self._initial_model()
        # e.g. a frozen model's reference log-probs: from the model read here, else (drawn on the devices)
        # from the engine's as built, before a checkpoint loads (the uninterrupted run's starting point)
        method = self.method
        reference_later = method is not None and method.prepare_data is not None and not _is_module(model)
        if method is not None and method.prepare_data is not None and not reference_later:
            self.data = method.prepare_data(self.data, model, self.method_opts, self.cfg.train_batch_size)
        options = engine_options(self.args, self.cfg, self.loop, self.planned)
        self.peak, self.peak_why = self._mfu_ceiling()
        self.engine = zerojax.shard(model, self.cfg, loss_fn=self.loss_fn, options=options)
        del model
        if reference_later:
            self.data = method.prepare_data(self.data, self.engine.model, self.method_opts, self.cfg.train_batch_size)
        self._say_built()
        self._resume()
        self._describe()

    def _initial_model(self):
        """The model the engine starts from: read from --hf-checkpoint, quantized on arrival (QLoRA on
        a GPU), or the factory the engine runs shard by shard on the devices."""
        import jax
        import numpy as np

        args, choice, lora_cfg, dtype = self.args, self.choice, self.lora_cfg, self.dtype
        if args.hf_checkpoint:  # read tensor by tensor (fp32 storage), computing in dtype
            # (with LoRA: the frozen base read straight into its stored dtype, never whole in fp32)
            base_dtype = (lora_cfg.get("base_dtype") or dtype) if lora_cfg is not None else None
            model = choice.family_spec.from_hf(args.hf_checkpoint, base_dtype, remat_policy=self.remat,
                                               **tile_options(self.mlp_tile))
            model.dtype = np.dtype(dtype)
        elif lora_cfg is not None and lora_cfg.get("quantize") and self.gpu:
            from zerojax import lora

            # QLoRA: the base drawn on the host, each kernel quantized on the device as it arrives, so
            # the device never holds the unquantized base (lora.apply's `device`)
            with jax.default_device(jax.devices("cpu")[0]):
                model = lora.apply(choice.build(self.seed, dtype, self.remat, param_dtype=dtype,
                                                mlp_tile=self.mlp_tile), lora_cfg, device=jax.devices()[0])
        else:  # built shard by shard on the devices, never whole on one
            model = self.make_model
        if lora_cfg is not None:
            from zerojax import lora

            if _is_module(model) and getattr(model, "adapter", None) is None:  # read from a folder
                model = lora.apply(model, lora_cfg)
            print(f"LoRA: rank {lora_cfg['r']}, alpha {lora_cfg['lora_alpha']:g}, targets "
                  f"{', '.join(self.lora_targets)}; {self.lora_trained:,} trained parameters, the base "
                  f"frozen" + (f" and stored {lora_cfg['quantize']}" if lora_cfg.get("quantize") else
                               f" in {lora_cfg['base_dtype']}"))
        # read from a folder or quantized on arrival: the method's change now (the factory makes it itself)
        return self.prepared(model) if _is_module(model) else model

    def _mfu_ceiling(self) -> tuple[float | None, str]:
        """MFU's denominator: --peak-tflops, else the matmul ceiling in the run's precision, measured
        before the engine holds any memory (its buffers are freed); none where no step is timed (the
        first one compiles), nor on CPU, where the measured rate is not stable (zerojax.planning.ceiling)."""
        import numpy as np

        from zerojax.planning.ceiling import ceiling_is_stable, measure_matmul_ceiling

        if self.args.peak_tflops is not None:
            return self.args.peak_tflops, "--peak-tflops"
        if self.steps < 2:
            return None, "no MFU (fewer than 2 steps: none is timed)"
        if not ceiling_is_stable():
            return None, ("no MFU on CPU: its matmul rate varies from run to run, so there is no ceiling to "
                          "measure against (--peak-tflops gives one)")
        return (measure_matmul_ceiling(dtype=self.dtype)["ceiling_tflops"],
                f"the {np.dtype(self.dtype).name} matmul ceiling measured here")

    def _say_built(self) -> None:
        import jax

        engine, cfg = self.engine, self.cfg
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_in_use" in stats and "bytes_limit" in stats:
            print(f"device memory after building: {stats['bytes_in_use'] / 2**30:.2f} GiB in use of "
                  f"{stats['bytes_limit'] / 2**30:.2f} (build peak {stats.get('peak_bytes_in_use', 0) / 2**30:.2f})")
        warn_replicated(engine, cfg)
        if engine.layout.offload_settings and cfg.zero_optimization.offload_optimizer.device == "cpu":
            o = engine.layout.offload_settings
            print(f"optimizer offload: {o['loop']} loop, {o['chunks']} layer group(s), "
                  f"master {'split (bf16 copy + 16-bit host remainder)' if o.get('split_master') else 'fp32'}, "
                  f"first moment {engine.options.adam_mu_dtype or 'fp32'}"
                  + (f" ({self.loop_why})" if self.loop_why else ""))

    def _resume(self) -> None:
        """The RL rollouts (made before the checkpoint loads: a "copy" reference and PPO's critic start
        from the weights as built, the uninterrupted run's starting point, the critic's own state then
        read back beside the actor's), then the checkpoint (--resume)."""
        args, engine, steps = self.args, self.engine, self.steps
        self.start = start = 0 if self.meta is None else int(self.meta.get("global_steps") or 0)
        self.rollouts = None
        if self.method is not None and self.method.rollouts is not None:
            self.rollouts = self.method.rollouts(engine, self.data, self.method_opts, seed=self.seed,
                                                 start_step=start, num_steps=max(0, steps - start))
        if not args.resume:
            return
        path, _ = engine.load_checkpoint(args.save)
        if engine.global_steps != start:
            raise RuntimeError(f"{path}: its record says step {start}, the engine read step {engine.global_steps}")
        if hasattr(self.rollouts, "load"):
            self.rollouts.load(args.save, tag=os.path.basename(path))
        epoch, k = divmod(start, self.data.steps_per_epoch)
        print(f"resumed from {path} at step {start} (data position: batch {start}, i.e. epoch {epoch} "
              f"batch {k} of {self.data.steps_per_epoch}, seed {self.seed})")
        if start >= steps:
            print(f"the checkpoint is at step {start} >= --steps {steps}: nothing to train "
                  f"(raise --steps to continue)")

    def _describe(self) -> None:
        """The run's one line before the first step: model, devices, stage, dtype, batch, MFU's ceiling."""
        import jax
        import numpy as np
        from flax import nnx

        cfg, choice, dtype, lora_cfg = self.cfg, self.choice, self.dtype, self.lora_cfg
        n_dev, kind = jax.device_count(), jax.devices()[0].device_kind
        # from shapes: under offload `master_params` merges every host chunk on the device (32 GB at 8B)
        self.trained = sum(x.size for x in jax.tree.leaves(self.engine.layout.abstract_master))
        whole = self.trained if lora_cfg is None else sum(  # LoRA: the frozen base's too
            int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
                lambda: choice.build(self.seed, dtype, self.remat)), nnx.Param)))
        peak = self.peak
        print(f"{choice.label} ({whole / 1e6:.1f}M params" + (f"; LoRA: {self.trained:,} trained" if lora_cfg else "")
              + f"), {n_dev} x {kind}, ZeRO stage {cfg.zero_optimization.stage}, "
              f"{dtype.name if hasattr(dtype, 'name') else dtype}, "
              f"batch {cfg.train_batch_size} = {cfg.train_micro_batch_size_per_gpu} x "
              f"{cfg.gradient_accumulation_steps} "
              f"x {cfg.world_size}, seq {self.seq_len}, remat {self.remat}; " + (
                  f"MFU against {peak:.3g} TFLOP/s per device ({self.peak_why})" if peak else self.peak_why)
              + "; tokens/s are per device, steps that compile excluded")

    # ------------------------------------------------------------------ train

    def batches(self):
        """This run's batches from its start step: the rollouts' (RL), else the data's."""
        if self.rollouts is not None:
            return self.rollouts
        return self.data.train_batches(self.cfg.train_batch_size, seed=self.seed, start_step=self.start,
                                       num_steps=max(0, self.steps - self.start))

    def train_step(self, batch) -> dict:
        """Forward, backward and update on one global batch: the step's metrics (device scalars), the
        rollout's own (reward/mean, ...) beside the loss's; the method's to the monitors (csv, ...) too."""
        metrics = self.engine.train_step(batch)
        if self.rollouts is not None:
            metrics = {**metrics, **{k: v for k, v in self.rollouts.metrics.items()
                                     if "/" in k and not k.startswith("time/")}}
        self.engine.monitor.record_method(self.engine.global_steps * self.cfg.train_batch_size, metrics)
        return metrics

    def train(self) -> bool:
        """The loop: a step, its hooks, until --steps; False where a signal stopped it after a step."""
        from tqdm import tqdm

        from zerojax.engine.monitor import SpeedMeter

        start, steps = self.start, self.steps
        # one definition of speed (zerojax.engine.monitor.SpeedMeter): tokens/s per device over the steps
        # that compiled nothing, in the progress bar, the log lines and the SUMMARY alike
        self.meter = SpeedMeter(self.cfg.train_batch_size * self.row_tokens, _device_count(), self.flops_per_token,
                                self.peak)
        # a progress bar on a terminal; elsewhere (a log file, a pipe) one line every 10 steps
        self.interactive = not self.quiet and sys.stderr.isatty()
        self.bar = tqdm(self.batches(), total=max(0, steps - start), initial=0, desc="train", dynamic_ncols=True,
                        disable=not self.interactive)
        self.losses, self.method_keys, self.last_metrics, self.saved_at = [], [], {}, []
        hooks = [Hook(10, self.log_progress)] + self._builtin_hooks() + self.hooks
        began = time.perf_counter()  # the training loop's wall time, compiles included: the closing line's
        self.stop = StopRequest().install()  # SIGTERM / Ctrl-C: stop after the step, save, exit 0
        try:
            for i, batch in enumerate(self.bar):
                self.meter.before_step()
                metrics = self.train_step(batch)
                self.losses.append(metrics["loss"])  # device scalars, read once at the end (no host sync a step)
                self.meter.after_step(metrics["loss"])
                if not self.method_keys:  # TRL's names: rewards/chosen, ...; a family's own: router/aux_loss (experts)
                    self.method_keys = sorted(k for k in metrics if "/" in k)
                self.last_metrics = metrics
                last = i == steps - start - 1
                info = StepInfo(step=start + i + 1, last=last, metrics=metrics, engine=self.engine, trainer=self)
                for hook in hooks:  # counted in this run's steps, the last one always
                    if (i + 1) % hook.every == 0 or (last and hook.fn == self.log_progress):
                        hook.fn(info)
                if not last and self.stop.agreed(i + 1):
                    self.bar.close()
                    return False
        finally:
            self.stop.uninstall()
        self.engine.synchronize()
        _block_until_ready(self.engine.state)
        self.bar.close()
        self.train_seconds = time.perf_counter() - began
        return True

    def _builtin_hooks(self) -> list[Hook]:
        hooks = []
        if self.args.eval_every:
            hooks.append(Hook(self.args.eval_every, self.evaluate))
        if self.args.save_every:
            hooks.append(Hook(self.args.save_every, self.save))
        return hooks

    def log_progress(self, info: StepInfo) -> None:
        """The progress bar's figures (a terminal), else one line (a log): loss, the method's metrics,
        tokens/s per device, MFU, device peak."""
        import jax

        metrics, meter = info.metrics, self.meter
        meter.sync(metrics["loss"])
        post = {"loss": f"{float(metrics['loss']):.3f}"}
        for key in self.method_keys:  # the method's own metrics (DPO's rewards/margins, ...)
            post[key] = f"{float(metrics[key]):.3f}"
        if meter.tokens_per_s_per_device is not None:
            post["tok/s/device"] = f"{meter.tokens_per_s_per_device:,.0f}"
        if meter.mfu is not None:
            post["MFU"] = f"{100 * meter.mfu:.1f}%"
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            post["mem"] = f"{stats['peak_bytes_in_use'] / 2**30:.1f}GiB"
        if self.interactive:
            self.bar.set_postfix(post)
        elif not self.quiet:
            print(f"step {info.step}/{self.steps}: loss {post['loss']}"
                  + "".join(f", {k} {post[k]}" for k in self.method_keys)
                  + (f", {post['tok/s/device']} tokens/s per device" if "tok/s/device" in post else "")
                  + (f", MFU {post['MFU']}" if "MFU" in post else "")
                  + (f", peak memory {post['mem']}" if "mem" in post else ""), flush=True)

    def validation_losses(self) -> list[float]:
        return [float(self.engine.eval_step(b)) for _, b in
                zip(range(self.args.eval_batches), self.data.val_batches(self.cfg.train_batch_size))]

    def evaluate(self, info: StepInfo) -> None:
        """--eval-every's hook: the validation loss, and the sample prompts' answers."""
        import numpy as np

        vals = self.validation_losses()
        if vals:
            print(f"step {info.step}: validation loss {float(np.mean(vals)):.4f}", flush=True)
        if self.samples is not None:
            self.samples.print_samples(self.engine, f"step {info.step}")

    def save(self, info: StepInfo) -> None:
        """--save-every's hook."""
        path = self.save_checkpoint()
        self.saved_at.append(info.step)
        print(f"step {info.step}: checkpoint saved: {path}", flush=True)

    def save_checkpoint(self) -> str:
        """The engine's checkpoint in --save (pruned to --keep), and the RL rollouts' own state (PPO's
        critic) beside it; the run's settings in its client_state, for --resume."""
        args = self.args
        client_state = {"gpt2_large_example": {
            "schedule_steps": self.schedule_steps, "lr": self.lr, "seed": self.seed, "lora": self.lora_cfg,
            "method": args.method, "method_options": self.method_opts, "data": data_source(args.data),
            **run_folders(args)}}
        path = self.engine.save_checkpoint(args.save, client_state=client_state, keep=args.keep)
        if hasattr(self.rollouts, "save"):
            self.rollouts.save(args.save, tag=os.path.basename(path), keep=args.keep)
        return path

    # ------------------------------------------------------------------ end

    def stopped(self) -> dict:
        """The loop stopped on a signal after a whole step: save (where the run has a folder), close, one line."""
        step = self.engine.global_steps
        path = self.save_checkpoint() if self.args.save else None
        self.close()
        print(stopped_line(self.stop.signal, step, path), flush=True)
        return {"interrupted": self.stop.signal, "step": step, "checkpoint": path,
                "exit_status": self.stop.exit_status(saved=path is not None)}

    def summary(self) -> dict:
        """The run's SUMMARY (settings, every loss, speed, memory) before the validation and the save."""
        import jax

        args, cfg, meter = self.args, self.cfg, self.meter
        summary = {"model": self.size, "family": self.choice.family, "config": os.path.basename(args.config),
                   "devices": _device_count(), "stage": cfg.zero_optimization.stage,
                   "train_batch_size": cfg.train_batch_size, "seq_len": self.seq_len, "remat": self.remat,
                   "mlp_tile": self.mlp_tile, "precision": self.precision, "start_step": self.start,
                   "steps": self.steps, "schedule_steps": self.schedule_steps, "lr": self.lr,
                   "master_split": self.engine.layout.master_split, "trained_params": int(self.trained),
                   "lora": self.lora_cfg, "train_seconds": round(self.train_seconds, 2)}
        if self.method is not None:
            summary.update(method=args.method, method_options=self.method_opts,
                           method_metrics={k: float(self.last_metrics[k]) for k in self.method_keys})
        elif self.method_keys:  # the model's loss terms beside the cross entropy (a mixture of experts' router losses)
            summary["loss_metrics"] = {k: float(self.last_metrics[k]) for k in self.method_keys}
        summary.update(rollout_summary(self.rollouts, cfg.train_batch_size))
        if meter.tokens_per_s_per_device is not None:
            summary["tokens_per_s_per_device"] = round(meter.tokens_per_s_per_device)
        if meter.mfu is not None:
            summary["mfu"] = round(meter.mfu, 4)
            summary["mfu_against_tflops"] = float(f"{self.peak:.3g}")
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            summary["peak_gib_device0"] = round(stats["peak_bytes_in_use"] / 2**30, 2)
        host_peak = host_peak_rss()
        if host_peak is not None:  # offload's state lives there: the host's share of "never an OOM"
            summary["host_peak_rss_gib"] = round(host_peak / 2**30, 2)
            print(f"host peak RSS {host_peak / 2**30:.2f} GiB (this process, building included)")
        return summary

    def finish(self) -> dict:
        """The last validation, the SUMMARY, the last save, the export; the closing line."""
        import numpy as np

        args, engine = self.args, self.engine
        losses = [float(x) for x in self.losses]
        summary = self.summary()
        val_losses = self.validation_losses()
        if val_losses:
            v = float(np.mean(val_losses))
            print(f"validation loss {v:.4f}" + (f", perplexity {math.exp(min(v, 50)):.2f}" if self.method is None
                                                else ""))
        if losses:
            print(f"train loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        if self.samples is not None:
            summary["samples"] = self.samples.print_samples(engine, f"step {engine.global_steps}")
        print(engine.memory_report())
        summary.update(first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                       losses=losses, val_loss=float(np.mean(val_losses)) if val_losses else None)
        # for programs (benchmarks/ and the tests grep `^SUMMARY `); people get the closing line below
        print("SUMMARY " + summary_line(summary), flush=True)
        if args.summary_json and not self.quiet:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=1)
        # a resumed run that trained nothing changed nothing; --save-every may have saved the last step already
        if args.save and (losses or not args.resume) and self.saved_at[-1:] != [engine.global_steps]:
            self._last_save()
        if args.export_hf:
            export_hf(args, engine, self.choice, self.lora_cfg, method=self.method)
        self.close()
        print(closing_line(summary), flush=True)  # last: what people read of a run
        return summary

    def _last_save(self) -> None:
        from zerojax.checkpoint import files as checkpoint_files

        before = set(checkpoint_files.finalized_tags(self.args.save))
        print(f"checkpoint saved: {self.save_checkpoint()}")
        removed = sorted(before - set(checkpoint_files.finalized_tags(self.args.save)))
        if removed:
            print(f"--keep {self.args.keep}: removed the older checkpoint(s) {', '.join(removed)}")

    def close(self) -> None:
        """The engine's last step checked, its monitors written, its scratch files removed."""
        self.engine.close()


def _is_module(model) -> bool:
    from flax import nnx

    return isinstance(model, nnx.Module)


def _device_count() -> int:
    import jax

    return jax.device_count()


def _block_until_ready(tree) -> None:
    import jax

    jax.block_until_ready(tree)


def main(argv=None, *, prog=None, description=None):
    """Train as the flags say (`zerojax.trainer.flags`); returns the run's SUMMARY dict."""
    return Trainer(parse_args(argv, prog=prog, description=description)).run()


def run_cli(argv=None, *, prog=None, description=None) -> int:
    """`main` for a command line: a user's mistake (an error that names its key, file or step and the
    fix) ends the run with that one `error:` line (exit status 1), Ctrl-C with one line (130), no
    traceback; --debug shows it (zerojax.trainer.exits)."""
    from zerojax.trainer.exits import run_command, split_debug

    argv, debug = split_debug(list(sys.argv[1:] if argv is None else argv))

    def train() -> int:
        summary = main(argv, prog=prog, description=description)
        return summary.get("exit_status", 0)  # a signal that stopped the run with nothing saved: 128 + its number

    return run_command(train, debug)
