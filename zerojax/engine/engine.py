"""`Engine`: runs one model under one config -- init, train / eval step, save, load.

The engine executes an `EngineLayout` (`zerojax.engine.layout.build_layout`: shardings, offload layout,
per-layer hooks, the step's settings); it decides nothing about where state lives. The user's
entry point is `zerojax.shard` (zerojax/api.py), which also hands the engine the planner.

State placement. Two ways in, neither makes a full replicated copy on one device:
- a zero-argument callable that builds the model (`lambda: GPT2(c, rngs=nnx.Rngs(0))`): traced
  under `nnx.eval_shape`, then run once by `jax.jit(init, out_shardings=...)`, so every device
  materialises only its shards (flax's recommended pattern; use it for models that do not fit one
  device);
- a model built eagerly (the usual case for small and medium models): each parameter is sent
  straight to its target sharding with `jax.device_put`, leaf by leaf (several processes:
  `jax.make_array_from_callback` from the host copy, each process placing its own shards).
`abstract_engine(...)` builds the same engine with a state of ShapeDtypeStructs (nothing
allocated): it lowers and compiles the real step, for the memory planner.
The train state (`zerojax.engine.step.TrainState`) is donated to every step.

Errors from the step are checked lazily, one step behind, so the host never waits for the device
on an ordinary step: after dispatching step k the engine reads step k-1's `nonfinite` /
`overflow_at_min` flags (already computed, or nearly). `engine.synchronize()` checks the last step.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax import model as contract
from zerojax import offload as O
from zerojax import user_tree
from zerojax._jax_compat import is_tracer, no_eager_sharding
from zerojax.checkpoint import engine_io
from zerojax.engine import memory
from zerojax.engine import step as step_mod
from zerojax.engine.init_state import grad_accumulator, initial_state
from zerojax.engine.layout import EngineLayout, build_layout
from zerojax.engine.monitor import Monitor
from zerojax.engine.step_checks import StepChecks
from zerojax.options import EngineOptions
from zerojax.sharding import partition
from zerojax.user_tree import take_layer

logger = logging.getLogger("zerojax")


class MemoryReport(dict):
    """Per-device bytes; `str()` is a small table."""

    def __str__(self):
        gib = lambda b: f"{b / 2**20:10.2f} MiB" if b is not None else "       n/a"  # noqa: E731
        master = "master (int16 remainder)" if self.get("master_split") else "fp32 master"
        rows = [("params (compute dtype)", "params"), ("gradients (accumulator)", "gradients"),
                (master, "master"), ("optimizer state", "optimizer_state"),
                ("model states total", "model_states"), ("host memory", "host"),
                ("XLA compiled peak", "compiled_peak")]
        return "\n".join(f"{label:26s}{gib(self.get(key))}" for label, key in rows)


def abstract_engine(model, cfg, *, loss_fn: Callable, mesh: Mesh | None = None,
                    options: EngineOptions | None = None) -> Engine:
    """An Engine whose state is ShapeDtypeStructs with the real shardings: it lowers and compiles
    the real train step (memory analysis, planning) but holds no device memory. The one abstract
    engine: the planner compiles its candidates through it."""
    return Engine(model, cfg, loss_fn=loss_fn, mesh=mesh, options=options, abstract=True)


# Engine.<old name> -> the EngineLayout field it read (`Engine.__getattr__`: deprecated, one release)
LAYOUT_FIELDS = {name: name for name in (
    "stage", "fp16", "compute_dtype", "accum_dtype", "offload_param", "tx", "schedule", "shardings",
    "param_shardings", "master_shardings", "opt_shardings", "rest_shardings", "state_shardings",
    "offload_settings", "stage3_gather", "pipeline")} | {"offload_layout": "offload"}


class Engine:
    """Trains one model under one config. See the module docstring and `zerojax.engine.step`.

    model: an nnx.Module, or a zero-argument callable returning one (traced, then built sharded).
    cfg: a Config, or anything `load_config` accepts; mesh: default all devices.
    options: `EngineOptions` (knobs beyond the DeepSpeed config).
    abstract: build the layout and a state of ShapeDtypeStructs only (see `abstract_engine`).
    plans_for: `plans_for(engine, batch_shapes, budget) -> plans`, called when the memory guard
        fails, so the WillNotFitError lists plans that fit (`zerojax.shard` passes the planner's).
    """

    def __init__(self, model, cfg, *, loss_fn: Callable, mesh: Mesh | None = None,
                 options: EngineOptions | None = None, abstract: bool = False,
                 plans_for: Callable | None = None):
        options = options if options is not None else EngineOptions()
        if not isinstance(options, EngineOptions):
            raise TypeError(f"options={options!r}: pass a zerojax.EngineOptions")
        init_fn = None
        if isinstance(model, nnx.Module):
            module = contract.stack_blocks(model)
            user = model
        elif callable(model):
            init_fn = functools.partial(_stacked, model)
            built = []  # whether the callable hands back a model already built (`lambda: model`)
            with no_eager_sharding():
                module = nnx.eval_shape(functools.partial(_noting_if_built, model, built))
            if built[0]:
                # its weights exist already: placed leaf by leaf as a built model's are, not traced
                # into the init program as constants (an 8B model's 16 GB, compiled for minutes)
                user = model()
                module, init_fn, stacked = contract.stack_blocks(user), None, False
            else:
                stacked = any(isinstance(m, contract.StackedBlocks) for _, m in nnx.iter_graph(module))
                with no_eager_sharding():
                    user = nnx.eval_shape(model) if stacked else module
            if not abstract and stacked:
                # a list of blocks, each initialised by its own code: as one XLA program they compile
                # in minutes at real depths (28 blocks: over 100 s), run eagerly on the host in
                # seconds; each device then receives only its own shards (`init_state.initial_state`'s values)
                with jax.default_device(jax.devices("cpu")[0]), no_eager_sharding():
                    module, init_fn = init_fn(), None
        else:
            raise TypeError(
                f"shard() takes a flax.nnx.Module or a zero-argument callable returning one, got "
                f"{type(model).__name__}; for a Linen module wrap it with flax.nnx.bridge.ToNNX"
            )
        self.layout: EngineLayout = build_layout(module, cfg, loss_fn=loss_fn, mesh=mesh, options=options)
        _warn_fp32_compute(module, self.layout.compute_dtype)
        # the model's own structure, for what users read (`model`, `params`, `master_params`)
        self._user_split = _abstract_split(user) if self.layout.layer_lists else None
        self.loss_fn = loss_fn
        self._plans_for = plans_for
        record = getattr(module, "checkpoint_record", None)
        self._model_record = record() if callable(record) else None
        if abstract:
            self.state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      jax.eval_shape(functools.partial(initial_state, self.layout, init_fn, module)),
                                      self.layout.state_shardings._replace(grad_accumulator=None))
        else:
            self.state = initial_state(self.layout, init_fn, module)
        self.state = self.state._replace(grad_accumulator=grad_accumulator(self.layout, self.state.params, abstract))
        del model, module, user  # drop our references to the host copy

        # the new state comes out exactly where the state went in: left free, XLA may pick another
        # sharding for a small leaf (which the AOT-compiled step then refuses on the next call) or
        # place an output it may choose, e.g. unpinned_host, in device memory
        settings = self.layout.step
        self._host_loop = None
        out_shardings = (self.layout.state_shardings, None)
        if settings.offload is not None and settings.offload.loop == "host":
            # the host chunks (non-layer leaves, each layer group) are updated after the step's jit, from Python
            self._host_loop = O.host_loop.HostLoop(settings.offload.layout, settings.offload.tx,
                                                   compute_dtype=settings.compute_dtype,
                                                   params_shardings=self.layout.state_shardings.params,
                                                   window=self.options.offload_host_window,
                                                   prefetch=self.options.offload_host_prefetch,
                                                   split_master=settings.offload.split_master)
            out_shardings = (self._without_host_chunks(self.layout.state_shardings)._replace(params=None), None)
            # the params come in apart and are not donated: the step returns none (the host loop
            # writes the new ones into them, in place), so JAX would alias their buffers to other
            # outputs of the same shape, host-memory ones included
            self._train = jax.jit(lambda state, params, batch: step_mod.train_step(
                settings, state._replace(params=params), batch), donate_argnums=0, out_shardings=out_shardings)
        else:
            self._train = jax.jit(functools.partial(step_mod.train_step, settings), donate_argnums=0,
                                  out_shardings=out_shardings)
        self._eval = jax.jit(functools.partial(step_mod.eval_step, settings))
        self._compiled: dict = {}
        self._global_steps = 0
        self._pending = None  # the last step's (number, metrics), its flags read after the next dispatch
        self._checks = StepChecks(self.layout.compute_dtype, self.layout.fp16, self.cfg.fp16.loss_scale,
                                  params=lambda: self.state.params)
        self._last_batch_shapes = None
        self._guarded: set = set()  # batch shapes whose step passed the memory guard
        cfg = self.cfg
        self.monitor = Monitor(cfg, is_writer=jax.process_index() == 0)
        betas = (cfg.optimizer.params.get("betas") if cfg.optimizer is not None else None) or (0.9, 0.999)
        self._mom = tuple(float(b) for b in betas)

    # ------------------------------------------------------------------ what it was built with

    # The engine's inputs; everything else static about it is its layout (`engine.layout`, an
    # `EngineLayout`: shardings, offload layout, pipeline schedule, dtypes, optimizer).
    cfg = property(lambda self: self.layout.cfg, doc="The resolved DeepSpeed config (a zerojax Config).")
    mesh = property(lambda self: self.layout.mesh, doc="The device mesh the state is sharded over.")
    options = property(lambda self: self.layout.options, doc="The EngineOptions it runs with.")
    step_settings = property(lambda self: self.layout.step,
                             doc="The step's static settings (a `StepSettings`: graphdef, templates).")

    @property
    def pipeline_bubble(self) -> float:
        """The share of pipeline stage-iterations that idle, (S - 1) / (M R + S - 1); 0.0 unpipelined."""
        return self.layout.pipeline.bubble_fraction if self.layout.pipeline is not None else 0.0

    def __getattr__(self, name):
        # the layout's fields the engine once passed through, one release with a warning
        moved = LAYOUT_FIELDS.get(name)
        if moved is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"Engine.{name} is deprecated and goes in the next release: read engine.layout.{moved}",
                      DeprecationWarning, stacklevel=2)
        return getattr(self.layout, moved)

    # ------------------------------------------------------------------ batches

    @functools.cached_property
    def _local_fraction(self) -> tuple[int, int]:
        """(data indices this process feeds, data size)."""
        devs = np.asarray(self.mesh.devices)
        axes = partition.data_axes(self.mesh)
        data_axes = [self.mesh.axis_names.index(a) for a in ((axes,) if isinstance(axes, str) else axes)]
        mine = {tuple(idx[i] for i in data_axes) for idx in np.ndindex(devs.shape)
                if devs[idx].process_index == jax.process_index()}
        return len(mine), partition.data_size(self.mesh)

    def _place_batch(self, batch, rows: int | None, what: str):
        sharding = NamedSharding(self.mesh, P(partition.data_axes(self.mesh)))
        mine, n = self._local_fraction
        cfg = self.cfg

        def place(path, x):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                local, expect = x.shape[0], rows  # already global
            else:
                local = np.shape(x)[0] if np.ndim(x) else None
                expect = None if rows is None else rows * mine // n
            if expect is not None and local != expect:
                name = jax.tree_util.keystr(path) or "batch"
                share = "" if mine == n else (
                    f"; with {jax.process_count()} processes this process feeds {expect} of them "
                    f"(its {mine} of {n} data-parallel devices)")
                raise ValueError(
                    f"{what}: {name} has leading dim {local}, expected train_batch_size={rows} rows "
                    f"(train_micro_batch_size_per_gpu={cfg.train_micro_batch_size_per_gpu} x "
                    f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} x world size="
                    f"{cfg.world_size}, tensor ranks counted as DeepSpeed does){share}")
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return x
            if local is None or local % mine:
                raise ValueError(f"{what}: {jax.tree_util.keystr(path)} has shape {np.shape(x)}; every "
                                 f"leaf needs a leading batch dim divisible by {mine} local data devices")
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))

        return jax.tree_util.tree_map_with_path(place, batch)

    def _abstract_batch(self, batch_shapes):
        sharding = NamedSharding(self.mesh, P(partition.data_axes(self.mesh)))
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), batch_shapes)

    # ------------------------------------------------------------------ steps

    def train_step(self, batch) -> dict:
        """One optimizer step on the global batch (this process's rows); metrics as jax arrays."""
        placed = self._place_batch(batch, self.cfg.train_batch_size, "train_step")
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), placed)
        self._last_batch_shapes = shapes
        key = self._shape_key(shapes)
        if key not in self._guarded and self.options.memory_guard:
            self._check_fits(shapes)
            self._guarded.add(key)
        # the AOT-compiled step: one compile shared with memory_report() and the planner
        if self._host_loop is None:
            self.state, metrics = self.compiled_step(shapes)(self.state, placed)
        else:  # EngineOptions.offload_loop="host": the host chunks' update, driven from here
            hl, lay = self._host_loop, self.layout
            master, opt = self.state.master, lay.chunk_states(self.state.opt_state)
            step = self.compiled_step(shapes)
            ready = hl.prefetch(master, opt)  # dispatched before the jit: these reads overlap it
            state, metrics = step(*self._step_args(self.state, placed))
            work = metrics.pop("host_work")
            # the metrics' trip to the host is queued now, ahead of the chunks' write-backs: the
            # next step's check of them would otherwise wait behind those on the same copy queue,
            # and so would the next step's dispatch (measured: ~30 ms a step on GPT-2 Large)
            for x in jax.tree.leaves(metrics):
                x.copy_to_host_async()
            # master / opt (the state's own lists) are updated in place, chunk by chunk
            params = hl(master, opt, work.compute, work.grads, work.skip, work.grad_scale, self.state.params,
                        ready=ready)
            new_opt = lay.with_chunk_states(state.opt_state, hl.merge(lay.chunk_states(state.opt_state), opt))
            self.state = state._replace(params=params, master=hl.merge(state.master, master), opt_state=new_opt)
        self._global_steps += 1
        previous, self._pending = self._pending, (self._global_steps, metrics)
        if previous is not None:
            self._check(*previous)
        self.monitor.record(self._global_steps * self.cfg.train_batch_size, metrics)
        spp = self.cfg.steps_per_print
        if spp and self._global_steps % spp == 0:
            self._log(metrics)
            self.monitor.flush()
        return metrics

    def _step_args(self, state, batch) -> tuple:
        """The train step's arguments (offload_loop="host": the state without the host-updated
        chunks and without its params, the params, the batch)."""
        if self._host_loop is None:
            return state, batch
        return self._without_host_chunks(state)._replace(params=None), state.params, batch

    def _without_host_chunks(self, state):
        """`state` (or its shardings) with None for the host-updated chunks' master and
        optimizer state: the step's jit neither reads nor returns them (offload_loop="host")."""
        loops = set(self._host_loop.loops)
        drop = lambda xs: [None if i in loops else x for i, x in enumerate(xs)]  # noqa: E731
        lay = self.layout
        return state._replace(master=drop(state.master),
                              opt_state=lay.with_chunk_states(state.opt_state, drop(lay.chunk_states(state.opt_state))))

    def eval_step(self, batch):
        """The loss on `batch` with the current compute params (no gradients)."""
        mine, n = self._local_fraction
        rows = jax.tree.leaves(batch)[0].shape[0]
        placed = self._place_batch(batch, rows * n // mine if rows % mine == 0 else None, "eval_step")
        return self._eval(self.state.params, self.state.rest, placed)

    def _check_fits(self, shapes) -> None:
        """Before the first step of a batch shape: XLA's predicted peak against the device's
        memory; WillNotFitError (listing the plans `plans_for` finds) instead of an
        out-of-memory mid-step. Kept apart from the compile cache: a step compiled earlier
        (memory_report, the planner, compiled_step) is still checked before it first runs."""
        budget = memory.device_budget()
        if budget is None:  # CPU: no limit known
            return
        plans_for = self._plans_for
        memory.guard(self, shapes, budget, plans=(lambda: plans_for(self, shapes, budget)) if plans_for else (),
                     notes=self._memory_notes())

    def _memory_notes(self) -> tuple[str, ...]:
        """For WillNotFitError: the engine options that would hold less for this layout, with the
        bytes they save (the host loop's chunks; the device master split)."""
        if self._host_loop is not None:
            return self._host_loop_notes()
        lay = self.layout
        if (self.state.master is not None and lay.offload is None and not lay.step.split_master
                and jnp.dtype(lay.compute_dtype) == jnp.dtype(jnp.bfloat16)):
            master = memory.resident_bytes(self.state.master)
            return (f"EngineOptions(split_master='on') keeps the fp32 master ({memory.fmt_bytes(master)} on this "
                    f"device) as the bf16 params plus an int16 remainder: {memory.fmt_bytes(master // 2)} less, "
                    f"the same training but for exact ties (one fp32 ulp); 0.3% slower on GPT-2 Large.",)
        return ()

    def _host_loop_notes(self) -> tuple[str, ...]:
        """For WillNotFitError under offload_loop="host": what its chunks hold on the device and
        the options that hold less."""
        o, chunks = self.options, self.layout.offload_settings["chunks"]
        opt = self.layout.chunk_states(self.state.opt_state)
        during_jit, during_loop = self._host_loop.device_bytes(self.state.master, opt)
        return (f"Of that, offload_loop='host' keeps up to {memory.fmt_bytes(max(during_jit, during_loop))} of "
                f"optimizer-state chunks on the device ({chunks} layer groups; offload_host_prefetch="
                f"{o.offload_host_prefetch}, offload_host_window={o.offload_host_window}). "
                f"EngineOptions(offload_loop='in_place') holds one layer's state at a time (slower); or keep "
                f"\"host\" with smaller chunks (a lower offload_host_chunk_bytes, now "
                f"{o.offload_host_chunk_bytes:,}) or a lower offload_host_prefetch / offload_host_window.",)

    def step_memory(self, batch_shapes, *, planning: bool = False) -> memory.CompiledMemory:
        """The train step's predicted per-device bytes: the one figure the guard, the planner and
        `memory_report` use. The compiled step's (`planning`: a throwaway compile with planning's
        compiler options, `memory.compile_engine_step`); with offload_loop="host" the host chunks'
        state on the device counts as temporaries too: during the jit the prefetched chunks and the
        previous step's last write-backs, beside its own temporaries; during the loop (after the
        jit, beside the params and gradients it leaves) its chunks in flight. The larger of the two."""
        mem = memory.CompiledMemory.of(memory.compile_engine_step(self, batch_shapes, planning=planning))
        if self._host_loop is not None:
            opt = self.layout.chunk_states(self.state.opt_state)
            during_jit, during_loop = self._host_loop.device_bytes(self.state.master, opt)
            mem = dataclasses.replace(mem, temp=max(mem.temp + during_jit, during_loop))
        return mem

    def close(self) -> None:
        """Check the last step and write out the monitors' buffered events (csv / tensorboard / wandb)."""
        self.synchronize()
        self.monitor.close()
        if self.layout.nvme is not None:  # swap files are scratch: removed with the engine
            self.layout.nvme.close()

    def synchronize(self) -> None:
        """Wait for the last step and raise if it overflowed at the minimum scale / went non-finite."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._check(*pending)

    def _check(self, step: int, metrics: dict) -> None:
        self._checks.check(step, metrics)

    def _log(self, metrics) -> None:
        """DeepSpeed's steps_per_print line. No speed in it: a wall-clock rate over the steps since the
        last line (compiles included, all devices) read beside the trainer's tokens/s per device
        (zerojax.engine.monitor.SpeedMeter) gave two figures for one step."""
        loss = float(metrics["loss"])  # waits for this step
        line = (f"[Rank {jax.process_index()}] step={self._global_steps}, skipped={self.skipped_steps}, "
                f"lr=[{float(metrics['lr']):g}], mom=[{self._mom}], loss={loss:.4f}")
        if jax.process_index() == 0:
            logger.info(line)
            print(line, flush=True)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, save_dir, tag=None, client_state=None, *, keep: int | None = None) -> str:
        """DeepSpeed's save_checkpoint (zerojax.checkpoint.engine_io); returns the checkpoint path.
        keep=N: then delete all but the N newest checkpoints, never `latest`'s (Hugging Face's
        save_total_limit; zerojax.checkpoint.files.prune)."""
        self.synchronize()
        return engine_io.save_engine_state(self.layout, self.state, save_dir, steps=self._global_steps,
                                           model_record=self._model_record, tag=tag, client_state=client_state,
                                           keep=keep)

    def load_checkpoint(self, load_dir, tag=None, *, load_optimizer_states=True, load_module_only=False):
        """DeepSpeed's load_checkpoint: installs the restored state; returns (path, client_state)."""
        self.synchronize()
        self.state, got = engine_io.load_engine_state(
            self.layout, self.state, load_dir, free_bytes=memory.device_free_bytes, tag=tag,
            load_optimizer_states=load_optimizer_states, load_module_only=load_module_only)
        if got.global_steps is not None:
            self._global_steps = int(got.global_steps)
        self._pending = None
        self._checks.reset()
        return got.path, got.client_state

    # ------------------------------------------------------------------ ahead of time

    def lower_step(self, batch_shapes, *, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """Lower the train step for a global batch of ShapeDtypeStructs (nothing runs). `platforms`
        (e.g. ("cuda",)): lower for those instead of this machine's, to read another backend's
        StableHLO (it cannot be compiled here)."""
        abstract_state = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.state)
        args = self._step_args(abstract_state, self._abstract_batch(batch_shapes))
        if platforms:
            return self._train.trace(*args).lower(lowering_platforms=tuple(platforms))
        return self._train.lower(*args)

    @staticmethod
    def _shape_key(batch_shapes) -> str:
        return str(jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), batch_shapes))

    def compiled_step(self, batch_shapes) -> jax.stages.Compiled:
        """The compiled train step (`jax.stages.Compiled`) for these batch shapes, cached."""
        key = self._shape_key(batch_shapes)
        if key not in self._compiled:
            lowered, options = self.lower_step(batch_shapes), self.compiler_options
            try:
                self._compiled[key] = lowered.compile(compiler_options=options or None)
            except Exception as e:  # noqa: BLE001 - an XLA without one of these options: compile without them
                if not any(name in str(e) for name in options):
                    raise
                warnings.warn(f"this XLA refused the compile options {sorted(options)} ({e}); the train step is "
                              "compiled without them (same results, slower: Engine.compiler_options)",
                              RuntimeWarning, stacklevel=2)
                self._compiled[key] = lowered.compile()
        return self._compiled[key]

    @property
    def compiler_options(self) -> dict:
        """XLA options the train step is compiled with. On GPU: XLA:GPU's
        `xla_gpu_enable_dus_accumulator_zero_init_elimination` (off by default in XLA), which drops the
        zero-fill of the loop buffers that a layer scan (or the pipeline's iterations) saves activations
        into, where XLA proves each element is written before it is read. Measured on one H200
        (benchmarks/RESULTS.md): GPT-2 Large pipe 2 329.5 -> 309.5 ms a step; ZeRO-2
        micro 8 70,435 -> 71,101 tokens/s, "dots_16" 71,187 -> 72,458; peaks unchanged. Nothing on
        other platforms (a GPU-only option)."""
        return step_compiler_options(platform=self.mesh.devices.flat[0].platform)

    # ------------------------------------------------------------------ views

    @property
    def global_steps(self) -> int:
        return self._global_steps

    @property
    def skipped_steps(self) -> int:
        return int(self.state.skipped_steps)

    @property
    def global_samples(self) -> int:
        return int(self.state.global_samples)

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return float(self.layout.schedule(self.state.step - self.state.skipped_steps))

    @property
    def params(self):
        """The compute-dtype weights the step uses (pure dict, the model's own tree)."""
        return user_tree.to_user(self.state.params, self.layout.layer_lists)

    @property
    def master_params(self):
        """fp32 master weights (pure dict, the model's own tree) in the optimizer sharding (fp32
        runs: the params); a list of blocks the engine runs as one scan comes back as the list.

        Whole by definition: with NVMe offload the swapped layers' master is read back from the files
        into host memory and merged on the device (4 bytes per parameter of each, once). For a model
        whose state exceeds host memory, export from a checkpoint instead (`zerojax export`, which
        reads the master alone, never the moments) -- docs/nvme.md."""
        return user_tree.to_user(self._stacked_master(), self.layout.layer_lists)

    def _stacked_master(self):
        """`master_params` in the engine's own tree (a stacked list of blocks as one stack)."""
        off = self.layout.offload
        if off is not None:  # the host chunks merged into one tree on the device
            if not hasattr(self, "_merge_master"):
                self._merge_master = jax.jit(lambda m: O.offload_master(O.OffloadState(m, []), off),
                                             out_shardings=self.layout.shardings.master)
            master = self.layout.split_master(self.state.master, self.state.params, to_split=False)
            if self.layout.nvme is not None:  # read back from the swap files
                master = self.layout.nvme.fill(master, None)[0]
            return self._merge_master(master)
        if self.state.master is None:
            return self.state.params
        return self.layout.split_master(self.state.master, self.state.params, to_split=False)

    def consolidated_master(self):
        """The fp32 master for writing out (a Hugging Face folder, safetensors): `master_params`,
        but under CPU offload (one process) each stacked layer leaf is a `ChunkRows`, read a layer
        group at a time when written (`row(i)`, `np.asarray`): neither the device nor host memory
        ever holds the whole fp32 master (32 GB at 8B). The writers in `zerojax.models` take it."""
        lay = self.layout
        if lay.offload is None or lay.nvme is not None or jax.process_count() > 1:
            return self.master_params
        self.synchronize()
        return user_tree.to_user(lay.to_stored(self.state, stream=True).master, lay.layer_lists, take=take_layer)

    @property
    def model(self) -> nnx.Module:
        """An nnx module holding the current fp32 master weights, of the model's own structure."""
        self.synchronize()
        if self._user_split is None:
            return step_mod.merge(self.step_settings, self.master_params, self.state.rest)
        graphdef, params, rest = (jax.tree.map(lambda x: x, t) for t in self._user_split)
        nnx.replace_by_pure_dict(params, self.master_params)
        nnx.replace_by_pure_dict(rest, self.state.rest)
        return nnx.merge(graphdef, params, rest)

    def memory_report(self, batch_shapes=None) -> MemoryReport:
        """Per-device bytes of the model states (read from the arrays) and of XLA's compiled step."""
        s = self.state
        # offload_param: each micro-batch's gradients come to host memory (compute dtype); with
        # accumulation they are summed into the host accumulator the state carries
        host_grads = self.layout.offload_param
        gdtype = self.layout.compute_dtype if host_grads else self.layout.accum_dtype
        grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, gdtype), s.params)
        grad_bytes = partition.per_device_bytes(grads, self.layout.shardings.grads)
        report = MemoryReport(
            params=memory.resident_bytes(s.params),
            gradients=0 if host_grads else grad_bytes,
            master=memory.resident_bytes(s.master),
            optimizer_state=memory.resident_bytes(s.opt_state),
            host=(memory.resident_bytes((s.params, s.master, s.opt_state, s.grad_accumulator), host=True)
                  + (grad_bytes if host_grads else 0)),
        )
        report["model_states"] = sum(report[k] for k in ("params", "gradients", "master", "optimizer_state"))
        if self.layout.step.split_master:  # EngineOptions.split_master (device): the master's bytes are its remainders
            report["master_split"] = True
        shapes = batch_shapes if batch_shapes is not None else self._last_batch_shapes
        report["compiled_peak"] = None
        if shapes is not None:
            try:  # the guard's figure (offload_loop="host": the loop's chunks in flight included)
                report["compiled_peak"] = self.step_memory(shapes).peak
            except RuntimeError:  # a backend without memory analysis
                pass
        return report


# XLA:GPU option (off by default in XLA) every GPU train step is compiled with: Engine.compiler_options
ZERO_INIT_OPTION = "xla_gpu_enable_dus_accumulator_zero_init_elimination"


def step_compiler_options(*, platform: str) -> dict:
    """The XLA options a train step is compiled with (see `Engine.compiler_options`)."""
    return {ZERO_INIT_OPTION: True} if platform == "gpu" else {}


def _abstract_split(module):
    """(graphdef, Param state, other state) of `module` with ShapeDtypeStruct leaves (no arrays kept)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    abstract = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))  # noqa: E731
    return graphdef, jax.tree.map(abstract, params), jax.tree.map(abstract, rest)


def _stacked(factory):
    """The model `factory` builds, its list of blocks (if any) stacked (`zerojax.model.stack_blocks`)."""
    return contract.stack_blocks(factory())


def _noting_if_built(factory, built: list):
    """factory()'s model, stacked, under tracing; appends to `built` whether most of its state's
    bytes are concrete arrays: made before the trace (a model built outside the callable, or its
    weights read from files inside it), not by initialisers that the trace can run sharded."""
    module = factory()
    concrete = traced = 0
    for x in jax.tree.leaves(nnx.state(module)):
        if not hasattr(x, "dtype") or jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue
        nbytes = int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
        if is_tracer(x):
            traced += nbytes
        else:
            concrete += nbytes
    built.append(concrete > 0 and concrete >= traced)
    return contract.stack_blocks(module)


def _warn_fp32_compute(module, compute_dtype) -> None:
    """DeepSpeed's bf16 / fp16 runs the forward in that dtype; a zerojax model computes in its own
    `dtype` attribute, which the config does not change: say so where a model built with fp32
    compute meets a bf16 / fp16 config (its weights are stored in bf16 / fp16, every product and
    the KV-cache decoder's reads upcast to fp32: about half the speed)."""
    own = getattr(module, "dtype", None)
    try:
        own = jnp.dtype(own)
    except TypeError:
        return
    if own == jnp.float32 and jnp.dtype(compute_dtype) != jnp.float32:
        warnings.warn(f"the config trains in {jnp.dtype(compute_dtype).name} but {type(module).__name__} computes in "
                      f"float32 (its dtype): build it with dtype=jnp.{jnp.dtype(compute_dtype).name} for DeepSpeed's "
                      f"{jnp.dtype(compute_dtype).name} forward", stacklevel=3)


__all__ = ["Engine", "abstract_engine", "MemoryReport", "LAYOUT_FIELDS"]
