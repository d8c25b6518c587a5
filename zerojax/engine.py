"""`zerojax.shard(model, cfg, loss_fn=...)`: a Flax NNX model + a DeepSpeed config -> an Engine.

State placement. Two ways in, neither makes a full replicated copy on one device:
- a zero-argument callable that builds the model (`lambda: GPT2(c, rngs=nnx.Rngs(0))`): traced
  under `nnx.eval_shape`, then run once by `jax.jit(init, out_shardings=...)`, so every device
  materialises only its shards (flax's recommended pattern; use it for models that do not fit one
  device);
- a model built eagerly (the usual case for small and medium models): each parameter is sent
  straight to its target sharding with `jax.device_put`, leaf by leaf (several processes:
  `jax.make_array_from_callback` from the host copy, each process placing its own shards).
The train state (`zerojax.step.TrainState`) is donated to every step.

Errors from the step are checked lazily, one step behind, so the host never waits for the device
on an ordinary step: after dispatching step k the engine reads step k-1's `nonfinite` /
`overflow_at_min` flags (already computed, or nearly). `engine.synchronize()` checks the last step.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import partition, step as step_mod
from zerojax.step import StepPlan, TrainState

logger = logging.getLogger("zerojax")

_HOST_KINDS = ("pinned_host", "unpinned_host")

PARAM_HOOK_ERROR = ("zero_optimization.offload_param: offload_param needs a model whose layer scan accepts a "
                    "fetch hook (a `layer_fetch` attribute applied to each layer's params inside the scan); "
                    "zerojax.models.gpt2.GPT2 does. {what}")


def _env_or(value, name, cast, default=None):
    """`value` if given, else env `name` ("none" -> 0), else `default`."""
    if value is not None:
        return value
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    return 0 if raw.lower() == "none" else cast(raw)


def shard(model, cfg, *, loss_fn: Callable, mesh: Mesh | None = None, **offload_options) -> "Engine":
    """Wrap `model` (an nnx.Module, or a zero-argument callable returning one) for training.

    cfg: a Config, or anything `load_config` accepts (path, JSON text, dict).
    loss_fn(model, batch) -> loss, or (loss, metrics dict of scalars).
    mesh: a ("data", "tensor") mesh; default all devices, "tensor" = tensor_parallel.autotp_size.
    offload_options: offload_chunks, offload_candidate, offload_window, offload_unroll (tuning of
        host offload; see `Engine`; env ZEROJAX_OFFLOAD_CHUNKS / _CANDIDATE / _WINDOW / _UNROLL).
    """
    return Engine(model, cfg, loss_fn=loss_fn, mesh=mesh, **offload_options)


def _resolve_config(cfg, mesh):
    from zerojax.config import Config, load_config

    if mesh is None:
        if not isinstance(cfg, Config):
            cfg = load_config(cfg)  # world size: devices / autotp_size, the mesh made below
        mesh = partition.make_mesh(tensor=cfg.tensor_parallel.autotp_size)
    n = partition.data_size(mesh)
    if not isinstance(cfg, Config):
        cfg = load_config(cfg, world_size=n)
    if cfg.world_size != n:
        raise ValueError(
            f"the config was resolved for world_size={cfg.world_size} data-parallel devices but the "
            f"mesh has data={n}; load it with load_config(..., world_size={n})"
        )
    return cfg, mesh


def _nbytes(tree, host: bool) -> int:
    total = 0
    for a in jax.tree.leaves(tree):
        kind = getattr(a.sharding, "memory_kind", None)
        if (kind in _HOST_KINDS) == host:
            total += a.addressable_shards[0].data.nbytes
    return total


class MemoryReport(dict):
    """Per-device bytes; `str()` is a small table."""

    def __str__(self):
        gib = lambda b: f"{b / 2**20:10.2f} MiB" if b is not None else "       n/a"  # noqa: E731
        rows = [("params (compute dtype)", "params"), ("gradients (accumulator)", "gradients"),
                ("fp32 master", "master"), ("optimizer state", "optimizer_state"),
                ("model states total", "model_states"), ("host memory", "host"),
                ("XLA compiled peak", "compiled_peak")]
        return "\n".join(f"{label:26s}{gib(self.get(key))}" for label, key in rows)


class Engine:
    """Trains one model under one config. See module docstring and `zerojax.step`."""

    def __init__(self, model, cfg, *, loss_fn: Callable, mesh: Mesh | None = None,
                 offload_chunks: int | None = None, offload_candidate: str | None = None,
                 offload_window: int | None = None, offload_unroll: int | None = None):
        from zerojax.monitor import Monitor
        from zerojax.optim import build_optimizer, build_schedule
        from zerojax.precision import compute_dtype, loss_scale_from_config

        self.cfg, self.mesh = _resolve_config(cfg, mesh)
        cfg = self.cfg
        self.loss_fn = loss_fn
        self.compute_dtype = jnp.dtype(compute_dtype(cfg))
        self.fp16 = bool(cfg.fp16.enabled)
        accum = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
        self.accum_dtype = jnp.dtype(accum.get(cfg.data_types.grad_accum_dtype or "fp32", jnp.float32))
        self.schedule = build_schedule(cfg)
        zero = cfg.zero_optimization
        self.stage = int(zero.stage)
        # host offload (DeepSpeed: offload_optimizer at stage >= 1, offload_param at stage 3)
        self.offload_optimizer = zero.offload_optimizer.device == "cpu" and self.stage >= 1
        self.offload_param = zero.offload_param.device == "cpu" and self.stage == 3
        offloading = self.offload_optimizer or self.offload_param
        if offloading and cfg.optimizer is not None and "".join(
                c for c in cfg.optimizer.type.lower() if c.isalnum()) == "lamb":
            from zerojax.config import ConfigError

            raise ConfigError(["zero_optimization.offload_optimizer / offload_param with optimizer.type "
                               f"{cfg.optimizer.type!r}: Lamb's per-tensor trust ratio needs whole tensors, "
                               "and the offloaded update runs on chunks of stacked layers; use Adam/AdamW, "
                               "Lion, SGD or Adagrad with offload, or turn offload off for Lamb"])
        # offload: the bare optimizer (clip, unscale and finite check run on the whole gradient first)
        tx = build_optimizer(cfg, clip=not offloading)
        self.tx = loss_scale_from_config(tx, cfg.fp16) if (self.fp16 and not offloading) else tx

        # abstract model -> shardings
        init_fn = None
        if isinstance(model, nnx.Module):
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        elif callable(model):
            init_fn = model
            with _no_eager_sharding():
                model = nnx.eval_shape(init_fn)
                graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        else:
            raise TypeError(
                f"shard() takes a flax.nnx.Module or a zero-argument callable returning one, got "
                f"{type(model).__name__}; for a Linen module wrap it with flax.nnx.bridge.ToNNX"
            )
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
        param_template, rest_template = jax.tree.map(abstract, params), jax.tree.map(abstract, rest)
        pure_params, pure_rest = step_mod._pure(params), step_mod._pure(rest)
        abstract_master = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), pure_params)
        self.shardings = partition.stage_shardings(
            abstract_master, self.mesh, self.stage,
            base_specs=partition.tensor_specs(params, self.mesh),
            persistence_threshold=int(zero.stage3_param_persistence_threshold or 0),
        )
        self.rest_shardings = partition.replicated(self.mesh, pure_rest)
        self.off_plan, offload_step, self._fetch_rest = None, None, None
        self._abstract_master = abstract_master
        if offloading:
            graphdef, offload_step = self._setup_offload(
                model, graphdef, params, abstract_master, offload_chunks, offload_candidate,
                offload_window, offload_unroll)
        else:
            self.opt_shardings = partition.opt_state_shardings(
                self.tx, abstract_master, self.shardings.master, self.mesh)
            self.master_shardings = self.shardings.master
            self.param_shardings = self.shardings.params
        self.stage3_gather = None
        if self.stage == 3 and not self.offload_param and partition.data_size(self.mesh) > 1:
            graphdef = self._stage3_gather_hook(model, graphdef, params, abstract_master)
        self.plan = StepPlan(
            graphdef=graphdef, param_template=param_template, rest_template=rest_template,
            loss_fn=loss_fn, tx=self.tx, schedule=self.schedule, mesh=self.mesh,
            shardings=self.shardings, opt_shardings=self.opt_shardings,
            rest_shardings=self.rest_shardings, compute_dtype=self.compute_dtype,
            accum_dtype=self.accum_dtype, steps=int(cfg.gradient_accumulation_steps),
            train_batch_size=int(cfg.train_batch_size), fp16=self.fp16, offload=offload_step,
            fetch_rest=self._fetch_rest,
        )
        self.state = self._init_state(init_fn, pure_params, pure_rest)
        del model, params, rest, pure_params, pure_rest  # drop our references to the host copy

        # the new state comes out exactly where the state went in: left free, XLA may pick another
        # sharding for a small leaf (which the AOT-compiled step then refuses on the next call) or
        # place an output it may choose, e.g. unpinned_host, in device memory
        self._train = jax.jit(functools.partial(step_mod.train_step, self.plan), donate_argnums=0,
                              out_shardings=(self.state_shardings, None))
        self._eval = jax.jit(functools.partial(step_mod.eval_step, self.plan))
        self._compiled: dict = {}
        self._global_steps = 0
        self._pending = None
        self._last_batch_shapes = None
        self._guarded: set = set()  # batch shapes whose step passed the memory guard
        self._print_time, self._print_tokens = time.perf_counter(), 0
        self.monitor = Monitor(cfg, is_writer=jax.process_index() == 0)
        betas = (cfg.optimizer.params.get("betas") if cfg.optimizer is not None else None) or (0.9, 0.999)
        self._mom = tuple(float(b) for b in betas)

    # ------------------------------------------------------------------ host offload

    def _setup_offload(self, model, graphdef, params, abstract_master, chunks, candidate,
                       window, unroll):
        """Offload plan, shardings and (offload_param) the model's layer-fetch hook.

        Default: candidate "loop" with K = layers (the layers updated in place one at a time, the
        non-layer leaves as one more chunk). It beat "chunked" (K = ceil(layers / 3), window 2) on
        an H200 in speed and device memory, and is the only candidate under which a 6.2B GPT's
        parameter + optimizer offload fits 24 GB (README, "Measured")."""
        from zerojax import offload as O
        from zerojax.precision import loss_scaler_from_config
        from zerojax.step import OffloadStep

        zero = self.cfg.zero_optimization
        probe = O.chunk_layout(abstract_master, 1)
        layers = probe.num_layers
        chunks = _env_or(chunks, "ZEROJAX_OFFLOAD_CHUNKS", int)
        candidate = _env_or(candidate, "ZEROJAX_OFFLOAD_CANDIDATE", str) or "loop"
        window = _env_or(window, "ZEROJAX_OFFLOAD_WINDOW", int, default=2) or None  # 0 / none: no barriers
        unroll = _env_or(unroll, "ZEROJAX_OFFLOAD_UNROLL", int) or 1  # 2 hit an XLA layout error on GPU (jax 0.11.2)
        if chunks:
            k = chunks
        elif not layers:
            k = 1
        else:
            k = layers if candidate == "loop" else max(1, math.ceil(layers / 3))
        if self.offload_optimizer:
            kind = O.host_memory_kind(bool(zero.offload_optimizer.pin_memory))
            ratio = float(zero.offload_optimizer.ratio)
        else:  # offload_param alone: the optimizer state stays on the device (one device chunk)
            kind, ratio = O.DEVICE, 0.0
        self.off_plan = O.offload_plan(self.tx, abstract_master, self.shardings.master, k, kind=kind,
                                       candidate=candidate, ratio=ratio, window=window)
        self.offload_options = dict(chunks=k, candidate=candidate, window=window, ratio=ratio, kind=kind,
                                    unroll=unroll if self.offload_param else None)
        scaler = loss_scaler_from_config(self.cfg.fp16) if self.fp16 else None
        inner_sh = self.off_plan.shardings.opt_state
        if scaler is not None:
            rep = NamedSharding(self.mesh, P())
            ls = jax.eval_shape(lambda: scaler.init(None))
            self.opt_shardings = jax.tree.map(lambda _: rep, ls)._replace(inner_state=inner_sh)
        else:
            self.opt_shardings = inner_sh
        self.master_shardings = self.off_plan.shardings.master
        self.param_shardings = self.shardings.params
        param_host = None
        if self.offload_param:
            pkind = O.host_memory_kind(bool(zero.offload_param.pin_memory))
            param_host = O.with_memory_kind(self.shardings.params, pkind)
            self.param_shardings = param_host
            graphdef, self._fetch_rest = self._param_hook(model, params, probe, unroll)
        step = OffloadStep(plan=self.off_plan, tx=self.tx, scaler=scaler,
                           clip=float(self.cfg.gradient_clipping or 0.0),
                           param_shardings=param_host)
        return graphdef, step

    def _stage3_gather_hook(self, model, graphdef, params, abstract_master):
        """ZeRO-3's "all-gather on use": each layer's weights gathered inside the layer scan.

        Left to itself, GSPMD may keep a sharded weight sharded and move activations instead, or
        gather every layer at once; constraining the layer's slice to its stage-0 sharding makes
        the all-gather per layer, where XLA can pipeline it with the previous layer's compute.
        Models without a `layer_fetch` hook (or ZEROJAX_STAGE3_GATHER=auto) keep GSPMD's choice."""
        from zerojax import offload as O

        if os.environ.get("ZEROJAX_STAGE3_GATHER", "layer") == "auto":
            return graphdef
        if not _hook_modules(model):
            return graphdef
        probe = O.chunk_layout(abstract_master, 1)
        if not any(probe.stacked):
            return graphdef
        gathered = partition.stage_shardings(
            abstract_master, self.mesh, 0, base_specs=partition.tensor_specs(params, self.mesh)).params
        self.stage3_gather = "layer"
        # the non-layer leaves are gathered too: left sharded, a hidden-sharded embedding made
        # GSPMD gather the token ids and the full-batch fp32 logits (3.3 GB for GPT-2 Large at
        # micro-batch 8 on 2 GPUs) -- stage 3 ran at 60% of stage 2
        graphdef, self._fetch_rest = self._param_hook(model, params, probe, 1, targets=gathered,
                                                      move=jax.lax.with_sharding_constraint)
        return graphdef

    def _param_hook(self, model, params, probe, unroll, *, targets=None, move=None):
        """Install the per-layer fetch on the model (via its `layer_fetch` hook) -> (graphdef, fetch_rest).

        Default (offload_param): bring each layer's slice from host to device memory. Stage 3
        passes `targets` = the layer's gathered (stage-0) shardings and `move` = a sharding
        constraint: ZeRO-3's all-gather on use, one layer at a time, inside the layer scan."""
        from zerojax import offload as O

        flags = probe.treedef.unflatten(list(probe.stacked))
        host_layers = targets is None  # offload_param (else stage 3's gather on use)
        dev = O.with_memory_kind(self.shardings.params, O.DEVICE) if host_layers else targets
        move = move or O.fetch
        if not any(probe.stacked):
            raise _config_error(PARAM_HOOK_ERROR.format(
                what="This model has no stacked (scanned) layer parameters to fetch layer by layer."))
        # every maximal subtree whose leaves are all stacked: its layer slice's structure -> shardings
        table: dict = {}

        def walk(f, d):
            if isinstance(f, dict):
                if f and all(jax.tree.leaves(f)):
                    key = jax.tree.structure(f)
                    layer = O.layer_shardings(d)
                    if key in table and table[key] != layer:
                        raise _config_error(PARAM_HOOK_ERROR.format(
                            what="Two stacked parameter groups with one structure are sharded differently."))
                    table[key] = layer
                    return
                for name in f:
                    walk(f[name], d[name])

        walk(flags, dev)

        def layer_fetch(p):
            target = table.get(jax.tree.structure(p))
            if target is None:
                raise ValueError("offload_param: the model's layer_fetch got a tree that matches no stacked "
                                 f"parameter group: {jax.tree.structure(p)}")
            return move(p, target)

        def fetch_rest(tree):  # the non-layer leaves (embeddings, final norm): whole, where used
            return jax.tree.map(lambda x, f, s: x if f else move(x, s), tree, flags, dev)

        module = model  # the user's module, or the abstract one traced from the init callable
        targets = _hook_modules(module)
        if not targets:
            raise _config_error(PARAM_HOOK_ERROR.format(
                what=f"{type(module).__name__} has no `layer_fetch` attribute, so its parameters would "
                     "stay on the device."))
        # offload_param: the model's scan fetches one layer ahead (ZEROJAX_OFFLOAD_PREFETCH=0: off)
        prefetch = host_layers and bool(_env_or(None, "ZEROJAX_OFFLOAD_PREFETCH", int, default=1))
        knobs = {"scan_unroll": unroll, "layer_prefetch": prefetch}  # where the model has them
        saved = [(m, m.layer_fetch, {k: vars(m)[k] for k in knobs if k in vars(m)}) for m in targets]
        try:
            for m, _, old in saved:
                m.layer_fetch = layer_fetch
                for k in old:
                    setattr(m, k, knobs[k])
            with _no_eager_sharding():
                graphdef = nnx.split(module, nnx.Param, ...)[0]
        finally:
            for m, f, old in saved:
                m.layer_fetch = f
                for k, v in old.items():
                    setattr(m, k, v)
        return graphdef, fetch_rest

    def _init_offloaded(self, init_fn, pure_params, pure_rest) -> TrainState:
        """Master chunks and optimizer states built straight into their memory kinds (one jit)."""
        from zerojax import offload as O

        plan, sh, cd = self.off_plan, self.shardings, self.compute_dtype

        def build(master):
            chunks = O.to_chunks(master, plan.layout)
            states = [O._init_chunk(self.tx, m, c) for m, c in zip(chunks, plan.layout.chunks)]
            compute = jax.tree.map(lambda x: x.astype(cd), master)
            return chunks, states, compute

        outs = (list(plan.master_shardings), list(plan.state_shardings), self.param_shardings)
        groups = self._init_groups()
        if init_fn is not None and len(groups) > 1:
            chunks, params, rest = self._init_offloaded_by_leaves(init_fn, groups)
            states = [jax.jit(lambda m, c=c: O._init_chunk(self.tx, m, c), out_shardings=s)(m)
                      for m, c, s in zip(chunks, plan.layout.chunks, plan.state_shardings)]
        elif init_fn is not None:
            def init():
                p, r = _init_pure(init_fn)
                return build(p), r

            (chunks, states, params), rest = jax.jit(init, out_shardings=(outs, self.rest_shardings))()
        else:
            master = jax.tree.map(lambda x, s: _place(x, s, jnp.float32), pure_params, sh.master)
            rest = jax.tree.map(_place, pure_rest, self.rest_shardings)
            chunks, states, params = jax.jit(build, out_shardings=outs, donate_argnums=0)(master)
            del master
        opt_state = states
        if self.fp16:
            ls = jax.jit(lambda: self.plan.offload.scaler.init(None),
                         out_shardings=NamedSharding(self.mesh, P()))()
            opt_state = ls._replace(inner_state=states)
        zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))  # noqa: E731
        return TrainState(params=params, master=list(chunks), opt_state=opt_state, rest=rest,
                          step=zero(), skipped_steps=zero(), global_samples=zero())

    def _init_groups(self) -> list[list[int]]:
        """Param leaves (flat indices) grouped so that a group's fp32 values stay under
        ZEROJAX_INIT_GROUP_BYTES (default: a quarter of the device's memory limit; CPU: no limit,
        one group). One jit builds each group, so the device never holds every fp32 weight."""
        leaves = self.off_plan.layout.treedef.flatten_up_to(self._abstract_master)
        limit = _env_or(None, "ZEROJAX_INIT_GROUP_BYTES", int)
        if not limit:
            from zerojax.memory import device_budget

            budget = device_budget()
            limit = budget // 4 if budget else 0
        if not limit:
            return [list(range(len(leaves)))]
        groups, size = [[]], 0
        for i, x in enumerate(leaves):
            n = int(np.prod(x.shape)) * 4
            if groups[-1] and size + n > limit:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += n
        return groups

    def _init_offloaded_by_leaves(self, init_fn, groups):
        """Offload init for models too large to initialise on the device at once: per group of
        leaves, one jit runs the model's initialiser, keeps only that group (XLA drops the other
        leaves' random draws as dead code) and writes its master pieces and compute copy to their
        memory kinds. -> (master chunks, compute params, rest)."""
        from zerojax import offload as O

        plan, cd = self.off_plan, self.compute_dtype
        layout = plan.layout
        n_chunks = len(layout.chunks)
        m_sh = [layout.treedef.flatten_up_to(s) for s in plan.master_shardings]
        p_sh = layout.treedef.flatten_up_to(self.param_shardings)
        pieces = [[None] * len(layout.stacked) for _ in range(n_chunks)]
        compute = [None] * len(layout.stacked)

        for group in groups:
            def build(group=group):
                leaves = layout.treedef.flatten_up_to(_init_pure(init_fn)[0])
                out = []
                for i in group:
                    x = leaves[i]
                    out.append(([O._piece(x, layout.stacked[i], c) for c in layout.chunks], x.astype(cd)))
                return out

            shardings = [([m_sh[j][i] for j in range(n_chunks)], p_sh[i]) for i in group]
            for i, (ps, c) in zip(group, jax.jit(build, out_shardings=shardings)()):
                compute[i] = c
                for j in range(n_chunks):
                    pieces[j][i] = ps[j]
        rest = jax.jit(lambda: _init_pure(init_fn)[1], out_shardings=self.rest_shardings)()
        chunks = [layout.treedef.unflatten(p) for p in pieces]
        return chunks, layout.treedef.unflatten(compute), rest

    @property
    def state_shardings(self) -> TrainState:
        """Where every state leaf lives (a TrainState of shardings; offload: host memory kinds)."""
        rep = NamedSharding(self.mesh, P())
        fp32 = self.compute_dtype == jnp.float32
        master = self.master_shardings if (self.off_plan is not None or not fp32) else None
        return TrainState(params=self.param_shardings, master=master, opt_state=self.opt_shardings,
                          rest=self.rest_shardings, step=rep, skipped_steps=rep, global_samples=rep)

    # ------------------------------------------------------------------ state placement

    def _init_state(self, init_fn, pure_params, pure_rest) -> TrainState:
        if self.off_plan is not None:
            return self._init_offloaded(init_fn, pure_params, pure_rest)
        sh = self.shardings
        fp32 = self.compute_dtype == jnp.float32
        # The master lives in the optimizer sharding; with fp32 compute the params are the master.
        target = sh.params if fp32 else sh.master
        if init_fn is not None:
            master, rest = jax.jit(lambda: _init_pure(init_fn), out_shardings=(target, self.rest_shardings))()
        else:
            master = jax.tree.map(lambda x, s: _place(x, s, jnp.float32), pure_params, target)
            rest = jax.tree.map(_place, pure_rest, self.rest_shardings)
        if fp32:
            params, master = master, None
            master_view = params
        else:
            cast = lambda t: jax.tree.map(lambda x: x.astype(self.compute_dtype), t)  # noqa: E731
            params = jax.jit(cast, out_shardings=sh.params)(master)
            master_view = master
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(master_view)
        zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))  # noqa: E731
        return TrainState(params=params, master=master, opt_state=opt_state, rest=rest,
                          step=zero(), skipped_steps=zero(), global_samples=zero())

    # ------------------------------------------------------------------ batches

    @functools.cached_property
    def _local_fraction(self) -> tuple[int, int]:
        """(data indices this process feeds, data size)."""
        devs = np.asarray(self.mesh.devices)
        data_axis = self.mesh.axis_names.index(partition.DATA)
        mine = {idx[data_axis] for idx in np.ndindex(devs.shape)
                if devs[idx].process_index == jax.process_index()}
        return len(mine), partition.data_size(self.mesh)

    def _place_batch(self, batch, rows: int | None, what: str):
        sharding = NamedSharding(self.mesh, P(partition.DATA))
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
                    f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} x data-parallel "
                    f"world size={n}){share}")
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return x
            if local is None or local % mine:
                raise ValueError(f"{what}: {jax.tree_util.keystr(path)} has shape {np.shape(x)}; every "
                                 f"leaf needs a leading batch dim divisible by {mine} local data devices")
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))

        return jax.tree_util.tree_map_with_path(place, batch)

    def _abstract_batch(self, batch_shapes):
        sharding = NamedSharding(self.mesh, P(partition.DATA))
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), batch_shapes)

    # ------------------------------------------------------------------ steps

    def train_step(self, batch) -> dict:
        """One optimizer step on the global batch (this process's rows); metrics as jax arrays."""
        placed = self._place_batch(batch, self.cfg.train_batch_size, "train_step")
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), placed)
        self._last_batch_shapes = shapes
        key = self._shape_key(shapes)
        if key not in self._guarded and os.environ.get("ZEROJAX_MEMORY_GUARD", "1") != "0":
            # before the first step of a shape: XLA's predicted peak against the device's memory;
            # WillNotFitError (with the plans that fit) instead of an out-of-memory mid-step. Kept
            # apart from the compile cache: a step compiled earlier (memory_report, the planner,
            # compiled_step) is still checked before it first runs.
            from zerojax import memory

            memory.guard(self, shapes)
            self._guarded.add(key)
        # the AOT-compiled step: one compile shared with memory_report() and the planner
        self.state, metrics = self.compiled_step(shapes)(self.state, placed)
        self._global_steps += 1
        previous, self._pending = self._pending, (self._global_steps, metrics)
        if previous is not None:
            self._check(*previous)
        self._print_tokens += _tokens(placed)
        self.monitor.record(self._global_steps * self.cfg.train_batch_size, metrics)
        spp = self.cfg.steps_per_print
        if spp and self._global_steps % spp == 0:
            self._log(metrics)
            self.monitor.flush()
        return metrics

    def eval_step(self, batch):
        """The loss on `batch` with the current compute params (no gradients)."""
        mine, n = self._local_fraction
        rows = jax.tree.leaves(batch)[0].shape[0]
        placed = self._place_batch(batch, rows * n // mine if rows % mine == 0 else None, "eval_step")
        return self._eval(self.state.params, self.state.rest, placed)

    def close(self) -> None:
        """Check the last step and write out the monitors' buffered events (csv / tensorboard / wandb)."""
        self.synchronize()
        self.monitor.close()

    def synchronize(self) -> None:
        """Wait for the last step and raise if it overflowed at the minimum scale / went non-finite."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._check(*pending)

    def _check(self, step: int, metrics: dict) -> None:
        from zerojax.precision import MIN_SCALE_ERROR

        if self.fp16:
            if bool(metrics["overflow_at_min"]):
                raise FloatingPointError(f"step {step}: {MIN_SCALE_ERROR}")
            return
        if bool(metrics["nonfinite"]):
            dtype = "bf16" if self.compute_dtype == jnp.bfloat16 else "fp32"
            raise FloatingPointError(
                f"step {step}: the loss or gradients are not finite (loss={float(metrics['loss'])}, "
                f"grad_norm={float(metrics['grad_norm'])}) under {dtype}; the update was skipped, so "
                f"the weights are those after step {step - 1}. Usual causes: the learning rate is too "
                f"high (lr={float(metrics['lr']):g}; add warmup or lower it), no gradient_clipping, "
                f"inf/NaN in the batch, or values beyond the compute dtype's range (fp16 tops out at "
                f"65504: prefer bf16)")

    def _log(self, metrics) -> None:
        now = time.perf_counter()
        loss = float(metrics["loss"])  # waits for this step
        tps = self._print_tokens / max(now - self._print_time, 1e-9)
        self._print_time, self._print_tokens = time.perf_counter(), 0
        line = (f"[Rank {jax.process_index()}] step={self._global_steps}, skipped={self.skipped_steps}, "
                f"lr=[{float(metrics['lr']):g}], mom=[{self._mom}], loss={loss:.4f}, tokens/s={tps:.0f}")
        if jax.process_index() == 0:
            logger.info(line)
            print(line, flush=True)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, save_dir, tag=None, client_state=None, *, keep: int | None = None) -> str:
        """DeepSpeed's save_checkpoint (zerojax.checkpoint.save); returns the checkpoint path.
        keep=N: then delete all but the N newest checkpoints, never `latest`'s
        (Hugging Face's save_total_limit; zerojax.checkpoint_files.prune)."""
        from zerojax import checkpoint, checkpoint_files

        if keep is not None:
            checkpoint_files.check_keep(keep)
        path = checkpoint.save(self, save_dir, tag=tag, client_state=client_state)
        if keep is not None:
            checkpoint_files.prune(save_dir, keep)
        return path

    def load_checkpoint(self, load_dir, tag=None, *, load_optimizer_states=True, load_module_only=False):
        """DeepSpeed's load_checkpoint: installs the restored state; returns (path, client_state)."""
        from zerojax import checkpoint

        self.synchronize()
        path, state, steps, client_state = checkpoint.restore(
            self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only)
        self.state, self._global_steps, self._pending = state, int(steps), None
        return path, client_state

    # ------------------------------------------------------------------ ahead of time

    def lower_step(self, batch_shapes) -> jax.stages.Lowered:
        """Lower the train step for a global batch of ShapeDtypeStructs (nothing runs)."""
        abstract_state = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.state)
        return self._train.lower(abstract_state, self._abstract_batch(batch_shapes))

    @staticmethod
    def _shape_key(batch_shapes) -> str:
        return str(jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), batch_shapes))

    def compiled_step(self, batch_shapes) -> jax.stages.Compiled:
        """The compiled train step (`jax.stages.Compiled`) for these batch shapes, cached."""
        key = self._shape_key(batch_shapes)
        if key not in self._compiled:
            self._compiled[key] = self.lower_step(batch_shapes).compile()
        return self._compiled[key]

    compile_train_step = compiled_step

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
        return float(self.schedule(self.state.step - self.state.skipped_steps))

    @property
    def master_params(self):
        """fp32 master weights (pure dict) in the optimizer sharding (fp32 runs: the params)."""
        if self.off_plan is not None:  # the host chunks merged into one tree on the device
            from zerojax import offload as O

            if not hasattr(self, "_merge_master"):
                plan = self.off_plan
                self._merge_master = jax.jit(lambda m: O.offload_master(O.OffloadState(m, []), plan),
                                             out_shardings=self.shardings.master)
            return self._merge_master(self.state.master)
        return self.state.master if self.state.master is not None else self.state.params

    @property
    def model(self) -> nnx.Module:
        """An nnx module holding the current fp32 master weights."""
        self.synchronize()
        return step_mod.merge(self.plan, self.master_params, self.state.rest)

    def memory_report(self, batch_shapes=None) -> MemoryReport:
        """Per-device bytes of the model states (read from the arrays) and of XLA's compiled step."""
        s = self.state
        # offload_param with one micro-batch: the gradients stay in host memory (compute dtype)
        host_grads = self.offload_param and self.cfg.gradient_accumulation_steps == 1
        gdtype = self.compute_dtype if host_grads else self.accum_dtype
        grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, gdtype), s.params)
        grad_bytes = partition.per_device_bytes(grads, self.shardings.grads)
        report = MemoryReport(
            params=_nbytes(s.params, False),
            gradients=0 if host_grads else grad_bytes,
            master=_nbytes(s.master, False),
            optimizer_state=_nbytes(s.opt_state, False),
            host=_nbytes((s.params, s.master, s.opt_state), True) + (grad_bytes if host_grads else 0),
        )
        report["model_states"] = sum(report[k] for k in ("params", "gradients", "master", "optimizer_state"))
        shapes = batch_shapes if batch_shapes is not None else self._last_batch_shapes
        report["compiled_peak"] = None
        if shapes is not None:
            m = self.compiled_step(shapes).memory_analysis()
            if m is not None:
                report["compiled_peak"] = (m.temp_size_in_bytes + m.argument_size_in_bytes
                                           + m.output_size_in_bytes - m.alias_size_in_bytes)
        return report


def _config_error(message):
    from zerojax.config import ConfigError

    return ConfigError([message])


def _hook_modules(model) -> list:
    """The modules of `model` that expose the per-layer `layer_fetch` hook (docs/CONTRACTS.md)."""
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and "layer_fetch" in vars(m)]


def _init_pure(init_fn):
    """(fp32 params, rest) of a fresh model from its init callable, as pure dicts; call under jit."""
    with _no_eager_sharding():
        _, p, r = nnx.split(init_fn(), nnx.Param, ...)
    return jax.tree.map(lambda x: x.astype(jnp.float32), step_mod._pure(p)), step_mod._pure(r)


def _no_eager_sharding():
    # flax >= 0.12 shards annotated variables at creation, which needs a mesh; we shard later.
    use = getattr(nnx, "use_eager_sharding", None)
    if use is None:
        import contextlib

        return contextlib.nullcontext()
    return use(False)


def _place(x, sharding, dtype=None):
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
        x = x.astype(dtype)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # rng keys: place the raw key data
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(_place(jax.random.key_data(x), sharding), impl=impl)
    host = np.asarray(jax.device_get(x))  # every process built the same model
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _tokens(batch) -> int:
    if isinstance(batch, dict) and "input_ids" in batch:
        return math.prod(batch["input_ids"].shape)
    return jax.tree.leaves(batch)[0].shape[0]


__all__ = ["shard", "Engine", "MemoryReport"]
