"""The engine's setup, apart from running it: `build_layout(model, cfg, ...) -> EngineLayout`.

A pure function of (the model's abstract state, the resolved config, the mesh, `EngineOptions`):
where every state leaf lives (the ZeRO stage's sharding trees, the offload's chunk layout and
memory kinds), the per-layer hook the model is handed (stage 3's gather on use, offload_param's
fetch), and the step's static settings (`zerojax.engine.step.StepSettings`). Nothing is allocated here;
`zerojax.engine.engine.Engine` executes the layout (init, step, save, load). A new parallelism axis or
offload tier changes this build, not the engine.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax import model as contract
from zerojax import offload as O
from zerojax import streamed as stream_mod
from zerojax import user_tree
from zerojax._jax_compat import (
    filter_state,
    no_eager_sharding,  # noqa: F401 - its old path, zerojax.engine.layout.no_eager_sharding
    variable_value,
)
from zerojax.config import Config, ConfigError, load_config, pipeline_stages, remat_policy_for
from zerojax.engine.model_hooks import (
    PARAM_HOOK_ERROR,
    activation_modules,
    attributes_set,
    check_needs_stack,
    config_error,
    hook_modules,
    install_layer_hook,
    model_type,
    modules_with,
    pipeline_layout,
    settings_applied,
    vmapped_stack,
)
from zerojax.engine.offload_choice import offload_layout, offloads, resolve_split_master
from zerojax.engine.step import (
    OffloadStep,
    StepSettings,
    TrainState,
    needs_grad_accumulator,
    pure_dict,
    rebuilt_master,
    stored_master,
)
from zerojax.offload.nvme.tier import check_params_in_cpu, nvme_tier
from zerojax.offload.stored import stored_params, stored_tree
from zerojax.optim import build_optimizer, build_schedule
from zerojax.options import EngineOptions
from zerojax.precision import compute_dtype as compute_dtype_of
from zerojax.precision import loss_scale_from_config
from zerojax.sharding import partition
from zerojax.sharding.experts import expert_parallel_hook, split_experts
from zerojax.sharding.pipeline import PipelineSchedule

_ACCUM_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


@dataclasses.dataclass(frozen=True, eq=False)
class EngineLayout:
    """Everything static about one engine: built once by `build_layout`, read by the engine."""

    cfg: Config
    mesh: Mesh
    options: EngineOptions
    stage: int
    fp16: bool
    compute_dtype: Any
    accum_dtype: Any
    offload_optimizer: bool
    offload_param: bool
    tx: Any                        # the optimizer the step applies (fp16, no offload: inside loss scaling)
    schedule: Callable
    abstract_master: Any           # fp32 ShapeDtypeStructs of the params tree (pure dict)
    shardings: partition.StageShardings   # params / grads / master of the ZeRO stage
    param_shardings: Any           # where state.params lives (offload_param: host memory)
    master_shardings: Any          # where state.master lives (offload: per-chunk trees)
    opt_shardings: Any             # where state.opt_state lives
    rest_shardings: Any
    offload: O.OffloadLayout | None    # the chunk layout of an offloaded state, or None
    offload_settings: dict | None      # the offload's resolved knobs (reported, e.g. by bench.py)
    stage3_gather: str | None          # "layer" when stage 3 gathers per layer in the model's scan
    step: StepSettings
    pipeline: PipelineSchedule | None = None   # pipeline.stages > 1: the schedule the model's scan runs
    nvme: Any = None                   # offload_optimizer device "nvme": the layers' state in swap files (NvmeTier)
    # {path: layers} of the lists of blocks the engine stacked (`zerojax.user_tree`): the state holds
    # them stacked, what users read and checkpoints hold is the model's own tree
    layer_lists: dict = dataclasses.field(default_factory=dict)

    @property
    def state_shardings(self) -> TrainState:
        """Where every state leaf lives (a TrainState of shardings; offload: host memory kinds)."""
        rep = NamedSharding(self.mesh, P())
        fp32 = self.compute_dtype == jnp.float32
        master = self.master_shardings if (self.offload is not None or not fp32) else None
        acc = self.step.offload.param_shardings if needs_grad_accumulator(self.step) else None
        return TrainState(params=self.param_shardings, master=master, opt_state=self.opt_shardings,
                          rest=self.rest_shardings, step=rep, skipped_steps=rep, global_samples=rep,
                          grad_accumulator=acc)

    # -- the layout-free form: how a checkpoint stores the state, whatever the offload

    def stored_opt_codec(self):
        """(wrap, unwrap) between the offload's bare optimizer state and the state a run without
        offload keeps: there, gradient clipping is a transform chained before the optimizer, so
        its state is (clip state, optimizer state); offload clips the whole gradient itself."""
        full = jax.eval_shape(build_optimizer(self.cfg, mu_dtype=self.options.adam_mu_dtype).init,
                              self.abstract_master)
        bare = jax.eval_shape(self.tx.init, self.abstract_master)
        if jax.tree.structure(full) == jax.tree.structure(bare):
            return (lambda st: st), (lambda st: st)
        if (isinstance(full, tuple) and len(full) == 2 and not jax.tree.leaves(full[0])
                and jax.tree.structure(full[1]) == jax.tree.structure(bare)):
            return (lambda st: (full[0], st)), (lambda st: st[1])
        raise ValueError("host offload: the optimizer state of this config has a form that cannot "
                         "be mapped to a run without offload")

    def streams_nvme(self) -> bool:
        """Whether checkpoints move the NVMe swap files' leaves a layer group at a time (`NvmeTier.streams`)."""
        return self.nvme is not None and self.nvme.streams

    def chunk_states(self, opt_state):
        """An offloaded state's per-chunk optimizer states (fp16: inside the loss scale's state)."""
        return opt_state.inner_state if self.fp16 else opt_state

    def with_chunk_states(self, opt_state, chunks):
        """`opt_state` with its per-chunk optimizer states replaced by `chunks`."""
        return opt_state._replace(inner_state=chunks) if self.fp16 else chunks

    def to_stored(self, state: TrainState, *, stream: bool = False) -> TrainState:
        """`state` in the unchunked layout a run without offload keeps (nothing copied for the
        default "loop" layout): what a checkpoint stores. NVMe: the files' leaves read back whole,
        or with `stream` (a checkpoint's save) `SwappedLeaf`s there, read a group at a time. Host
        offload with `stream` (one process): the host layer chunks' leaves as `ChunkRows`, read a
        layer group at a time (the host split's fp32 master rebuilt a group at a time)."""
        if self.offload is None:
            return state._replace(master=self.split_master(state.master, state.params, to_split=False))
        if self.nvme is not None:  # the files' leaves into the chunk
            jax.block_until_ready(state)   # the step's last group written (its callbacks ran) before reading
            into = self.nvme.swapped if stream and self.nvme.streams else self.nvme.fill
            master, inner = into(state.master, self.chunk_states(state.opt_state))
            state = state._replace(master=master, opt_state=self.with_chunk_states(state.opt_state, inner))
        wrap, _ = self.stored_opt_codec()
        if stream and self.nvme is None and jax.process_count() == 1:
            # a checkpoint's save: the host chunks' leaves read a layer group (a block of rows) at a time
            # (`ChunkRows`; the host split's fp32 master rebuilt block by block as it is read)
            merge = functools.partial(stored_tree, layout=self.offload.layout)
            master = merge(state.master, split_compute=state.params if self._host_split() else None)
            state = state._replace(params=stored_params(state.params, self.offload.layout))
        else:
            merge = lambda chunks: O.merge_chunks(chunks, self.offload.layout)  # noqa: E731
            master = merge(self.split_master(state.master, state.params, to_split=False))
        opt = self.with_chunk_states(state.opt_state, wrap(merge(self.chunk_states(state.opt_state))))
        return state._replace(master=master, opt_state=opt)

    def _host_split(self) -> bool:
        """Whether the host chunks hold the master as the host split's int16 remainders."""
        so = self.step.offload
        return so is not None and bool(so.split_master)

    @property
    def master_split(self) -> bool:
        """Whether EngineOptions.split_master acts in this layout (the device split or the host split)."""
        return bool(self.step.split_master) or self._host_split()

    def split_master(self, master: list, params, *, to_split: bool, consume: bool = False) -> list:
        """EngineOptions.split_master, host split: the host chunks of the per-chunk `master` turned
        into int16 remainders against the compute `params` (`to_split`) or back into fp32; device
        split: the same for the whole device-resident master (against its own bf16 rounding when
        splitting, which the compute `params` are); `master` unchanged without either. consume: the
        host split replaces the chunks in the list `master` itself, one at a time, so that each
        chunk it converted is freed before the next is made (the caller's list; nothing else may
        hold them)."""
        if self.step.split_master and master is not None:
            return self._device_split(to_split)(master, params)
        so = self.step.offload
        if so is None or not so.split_master or master is None:
            return master
        hosts = [i for i, c in enumerate(self.offload.layout.chunks) if c.host]
        return O.split_master.convert(master, params, self.offload, hosts, to_split=to_split, cache=so.converters,
                                      consume=consume)

    def _device_split(self, to_split: bool):
        """The device split master's conversion (fp32 master <-> int16 remainders), one jitted
        program each way, in the master's sharding."""
        cache = self.__dict__.setdefault("_device_split_programs", {})
        if to_split not in cache:  # the step's own conversions (`step.stored_master`, `step.rebuilt_master`)
            settings = self.step
            run = ((lambda m, p: stored_master(settings, m)) if to_split
                   else (lambda r, p: rebuilt_master(settings, p, r)))
            cache[to_split] = jax.jit(run, out_shardings=self.shardings.master)
        return cache[to_split]

    def stored_targets(self, state: TrainState, *, stream: bool = False) -> tuple[TrainState, TrainState]:
        """(the stored form of `state`, its shardings) for a restore: abstract where the stored form
        differs from the live one (offload: the unchunked master and optimizer state, in the
        offload's memory kind), the live arrays elsewhere. NVMe with `stream`: `SwappedLeaf` sinks
        at the files' leaves (the restore writes them a group at a time; `from_stored` skips them)."""
        shardings = self.state_shardings
        if self.offload is None:
            return state, shardings
        kind, sh = self.offload.kind, self.shardings
        wrap, _ = self.stored_opt_codec()
        master, opt = self.abstract_master, jax.eval_shape(self.tx.init, self.abstract_master)
        if stream and self.streams_nvme():
            jax.block_until_ready(state)   # no step still reading or writing the files the restore writes
            master, opt = self.nvme.sinks(master, opt)
        opt = wrap(opt)
        opt_sh = wrap(partition.opt_state_shardings(self.tx, self.abstract_master, sh.master, self.mesh,
                                                    memory_kind=kind))
        if self.fp16:  # the loss-scale state around the chunked one: keep its own fields
            opt, opt_sh = (state.opt_state._replace(inner_state=opt),
                           self.opt_shardings._replace(inner_state=opt_sh))
        target = state._replace(master=master, opt_state=opt)
        return target, shardings._replace(master=O.with_memory_kind(sh.master, kind), opt_state=opt_sh)

    def from_stored(self, master, opt_state):
        """The inverse of `to_stored` for (master, opt_state or None): chunked as the engine keeps them."""
        if self.offload is None:
            return master, opt_state
        off = self.offload
        # restored streamed (`stored_targets(stream=True)`): the files' leaves were written by the restore
        # itself; the live form keeps None there
        streamed = any(stream_mod.is_streamed(x) for x in jax.tree.leaves(master))
        if streamed:
            master, opt_state = jax.tree.map(lambda x: None if stream_mod.is_streamed(x) else x, (master, opt_state))
        m_tmpl, s_tmpl = O.chunk_templates(self.tx, self.abstract_master, off.layout)
        master = O.split_chunks(master, off.layout, m_tmpl, off.master_shardings)
        if opt_state is None:
            if self.nvme is not None and not streamed:  # the master to the files, the moments there stay
                master = self.nvme.spill_master(master)
            return master, None
        _, unwrap = self.stored_opt_codec()
        split = lambda st: O.split_chunks(unwrap(st), off.layout, s_tmpl, off.state_shardings)  # noqa: E731
        inner = split(opt_state.inner_state if self.fp16 else opt_state)
        if self.nvme is not None and not streamed:  # into the swap files; the state keeps None there
            master, inner = self.nvme.spill(master, inner)
        if self.fp16:
            return master, opt_state._replace(inner_state=inner)
        return master, inner


def resolve_config(cfg, mesh: Mesh | None) -> tuple[Config, Mesh]:
    """(Config, mesh): `cfg` loaded for the mesh's batch world size (default mesh: all devices,
    "tensor" sized by tensor_parallel.autotp_size).

    The batch rule's world size is every device of the data x tensor mesh, as DeepSpeed 0.19.8
    counts every rank (`partition.batch_world_size`): the global batch of train_batch_size rows is
    split over "data" only, each tensor group trains on its rows together, every row once.
    """
    if mesh is None:
        if not isinstance(cfg, Config):
            cfg = load_config(cfg)  # world size: devices / (sequence_parallel_size x pipeline.stages)
        try:
            mesh = partition.make_mesh(tensor=cfg.tensor_parallel.autotp_size, pipe=pipeline_stages(cfg.pipeline),
                                       seq=cfg.sequence_parallel_size)
        except ValueError as e:
            if isinstance(e, ConfigError):
                raise
            raise config_error(f"pipeline.stages = {cfg.pipeline.stages}: {e}") from None
    n = partition.batch_world_size(mesh)
    if not isinstance(cfg, Config):
        cfg = load_config(cfg, world_size=n)
    if cfg.world_size != n:
        raise ValueError(
            f"the config was resolved for world_size={cfg.world_size} devices but the mesh has "
            f"data={partition.data_size(mesh)} x tensor={partition.tensor_size(mesh)} = {n} (DeepSpeed's batch "
            f"rule counts tensor ranks too); load it with load_config(..., world_size={n})"
        )
    if cfg.sequence_parallel_size != partition.seq_size(mesh):
        raise ConfigError([f"sequence_parallel_size = {cfg.sequence_parallel_size} but the mesh's \"seq\" axis has "
                           f"{partition.seq_size(mesh)} devices; make them equal (or pass mesh=None to size the "
                           "axis from the config)"])
    if cfg.tensor_parallel.autotp_size != partition.tensor_size(mesh):
        raise ConfigError([f"tensor_parallel.autotp_size = {cfg.tensor_parallel.autotp_size} but the mesh's "
                           f"\"tensor\" axis has {partition.tensor_size(mesh)} devices; make them equal (or "
                           "pass mesh=None to size the axis from the config)"])
    return cfg, mesh


def build_layout(module: nnx.Module, cfg, *, loss_fn: Callable, mesh: Mesh | None = None,
                 options: EngineOptions | None = None) -> EngineLayout:
    """The layout of `module` (a built or an abstract nnx.Module) under `cfg` on `mesh`.

    Pure: reads only the module's structure and shapes; installs the per-layer hook and (tensor
    parallelism) the activation hook on a copy of its graph (`StepSettings.graphdef`), never on
    `module` itself.
    """
    cfg, mesh = resolve_config(cfg, mesh)
    if partition.seq_size(mesh) > 1:
        _check_heads_split(module, cfg.sequence_parallel_size, mesh)
    constrain = None
    if (cfg.tensor_parallel.partition_config or {}).get("use_default_specs", True):
        constrain = partition.activation_constraint(mesh)
    # ep_size > 1: the mesh's "data" axis split into ("data", "expert") for everything that follows
    experts, mesh = expert_parallel_hook(module, mesh, (options or EngineOptions()).ep_size, modules_with)
    with attributes_set(activation_modules(module) if constrain else [], activation_sharding=constrain), \
            attributes_set(modules_with(module, "expert_parallel") if experts else [], expert_parallel=experts), \
            settings_applied(_remat_settings(module, cfg)):
        return _build_layout(module, cfg, loss_fn=loss_fn, mesh=mesh, options=options)


def _check_heads_split(module, sp: int, mesh: Mesh) -> None:
    """sequence_parallel_size must divide the model's query and key / value heads (read from its
    config: Llama's num_attention_heads / kv_heads, GPT-2's n_head)."""
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", getattr(config, "n_head", None))
    if heads is None:
        raise ConfigError([f"sequence_parallel_size = {sp}: the model shows no attention heads (a config with "
                           "num_attention_heads or n_head); sequence parallelism splits them"])
    partition.check_sequence_parallel(sp, mesh.devices.size, heads=heads, kv_heads=getattr(config, "kv_heads", heads))


def _check_lora_applied(module, cfg) -> None:
    """A "lora" section is acted on by the adapters `zerojax.lora.apply` puts in the model; a model
    without them would train every weight in full, so the section is refused there, not ignored."""
    if not getattr(cfg, "lora", None):
        return
    from zerojax.lora import FrozenWeight

    if not any(isinstance(v, FrozenWeight) for v in jax.tree.leaves(
            nnx.state(module, FrozenWeight), is_leaf=lambda x: isinstance(x, nnx.Variable))):
        raise ConfigError(["lora: the config asks for LoRA adapters but the model has none; apply them "
                           "before zerojax.shard with zerojax.lora.apply(model, cfg.lora) (the example does), "
                           "or remove the \"lora\" section"])


def _remat_settings(module, cfg) -> list:
    """The activation_checkpointing section acted on for any model (`zerojax.model.remat_modules`):
    nothing without the section (the model's own remat stays), the policy it names on the block
    stack otherwise, and an error naming the hook where the model shows no blocks."""
    if cfg.activation_checkpointing is None:
        return []
    # number_checkpoints counts against the stack's layers (two-level segments where it is fewer)
    stack = contract.find_blocks(module) if cfg.activation_checkpointing.number_checkpoints else None
    policy = remat_policy_for(cfg, None if stack is None else stack.layers)
    if policy is None:
        return []
    try:
        return contract.remat_modules(module, policy)
    except ValueError as e:
        raise ConfigError([str(e)]) from None


def _build_layout(module, cfg: Config, *, loss_fn, mesh: Mesh, options) -> EngineLayout:
    options = options or EngineOptions()
    _check_lora_applied(module, cfg)
    dtype = jnp.dtype(compute_dtype_of(cfg))
    fp16 = bool(cfg.fp16.enabled)
    accum_dtype = jnp.dtype(_ACCUM_DTYPES.get(cfg.data_types.grad_accum_dtype or "fp32", jnp.float32))
    schedule = build_schedule(cfg)
    zero = cfg.zero_optimization
    stage = int(zero.stage)
    offload_optimizer, offload_param = offloads(cfg)
    offloading = offload_optimizer or offload_param
    check_needs_stack(module, cfg, offload_param)
    if offloading and cfg.optimizer is not None and "".join(
            c for c in cfg.optimizer.type.lower() if c.isalnum()) == "lamb":
        raise ConfigError(["zero_optimization.offload_optimizer / offload_param with optimizer.type "
                           f"{cfg.optimizer.type!r}: Lamb's per-tensor trust ratio needs whole tensors, "
                           "and the offloaded update runs on chunks of stacked layers; use Adam/AdamW, "
                           "Lion, SGD or Adagrad with offload, or turn offload off for Lamb"])
    # offload: the bare optimizer (clip, unscale and finite check run on the whole gradient first)
    tx = build_optimizer(cfg, clip=not offloading, mu_dtype=options.adam_mu_dtype)
    tx = loss_scale_from_config(tx, cfg.fp16) if (fp16 and not offloading) else tx

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    param_template, rest_template = jax.tree.map(abstract, params), jax.tree.map(abstract, rest)
    abstract_master = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), pure_dict(params))
    # the layer axis from the model contract (a "layers"-named axis, or the found block stack)
    prefixes = contract.stacked_prefixes(module)
    stacked = contract.stacked_flags(abstract_master, prefixes) if prefixes else None
    base_specs = partition.tensor_specs(params, mesh, tp=cfg.tensor_parallel, model_type=model_type(module),
                                        stacked_prefixes=prefixes)
    if options.ep_size > 1:  # experts split over "expert" at every stage (ZeRO adds "data" on another dim)
        base_specs = split_experts(params, base_specs)
    shardings = partition.stage_shardings(
        abstract_master, mesh, stage, base_specs=base_specs,
        persistence_threshold=int(zero.stage3_param_persistence_threshold or 0))
    rest_shardings = _rest_shardings(rest, mesh, cfg, stage, model_type(module), prefixes, options.ep_size,
                                     O.host_memory_kind(bool(zero.offload_param.pin_memory)) if offload_param else None)

    off = offload_settings = offload_step = fetch_rest = nvme = None
    stage3_gather = None
    param_shardings, master_shardings = shardings.params, shardings.master
    if offloading:
        off, offload_settings, opt_shardings, scaler = offload_layout(
            cfg, options, tx, abstract_master, shardings, mesh, fp16, offload_optimizer, offload_param, stacked)
        master_shardings = off.shardings.master
        if offload_optimizer and zero.offload_optimizer.device == "nvme":
            nvme = nvme_tier(cfg, tx, abstract_master, off)
            master_shardings = nvme.live(master_shardings, "master")
            opt_shardings = (opt_shardings._replace(inner_state=nvme.live(opt_shardings.inner_state, "state"))
                             if fp16 else nvme.live(opt_shardings, "state"))
            offload_settings = {**offload_settings, "nvme": nvme.settings["nvme_path"],
                                "nvme_disk_bytes": nvme.disk_bytes(),
                                "nvme_host_layers": int(zero.offload_optimizer.host_layers),
                                "nvme_host_bytes": nvme.host_tier_bytes()}
        if offload_param and zero.offload_param.device == "nvme":
            check_params_in_cpu(zero.offload_param, abstract_master)
        if offload_param:
            kind = O.host_memory_kind(bool(zero.offload_param.pin_memory))
            param_shardings = O.with_memory_kind(shardings.params, kind)
            # fetch layer i+1 while layer i computes (the model's layer scan, one layer per iteration)
            graphdef, fetch_rest = install_layer_hook(
                module, abstract_master, O.with_memory_kind(shardings.params, O.DEVICE), O.fetch,
                {"scan_unroll": 1, "layer_scan": O.prefetch_scan}, stacked)
    host_split, device_split = resolve_split_master(options, cfg, offload_settings and offload_settings["loop"],
                                                    offloading)
    if offloading:
        offload_settings = {**offload_settings, "split_master": host_split}
        offload_step = OffloadStep(layout=off, tx=tx, scaler=scaler, clip=float(cfg.gradient_clipping or 0.0),
                                   param_shardings=param_shardings if offload_param else None, nvme=nvme,
                                   loop=offload_settings["loop"], split_master=host_split)
    else:
        opt_shardings = partition.opt_state_shardings(tx, abstract_master, shardings.master, mesh)
    if (stage == 3 and not offload_param and partition.data_size(mesh) > 1
            and (hook_modules(module) or vmapped_stack(module))
            and any(O.chunk_layout(abstract_master, 1, stacked=stacked).stacked)):
        # ZeRO-3's "all-gather on use": each layer's weights constrained to their stage-0
        # sharding inside the layer scan. Left to itself, GSPMD may keep a sharded weight
        # sharded and move activations instead, or gather every layer at once; per layer, XLA
        # can pipeline the gather with the previous layer's compute. The non-layer leaves are
        # gathered too: left sharded, a hidden-sharded embedding made GSPMD gather the token
        # ids and the full-batch fp32 logits (3.3 GB for GPT-2 Large at micro-batch 8 on 2
        # GPUs) -- stage 3 ran at 60% of stage 2
        gathered = partition.stage_shardings(abstract_master, mesh, 0, base_specs=base_specs).params
        graphdef, fetch_rest = install_layer_hook(
            module, abstract_master, gathered, jax.lax.with_sharding_constraint,
            {"scan_unroll": 1, "layer_scan": None}, stacked)
        stage3_gather = "layer"

    schedule_ = None
    if partition.pipe_size(mesh) > 1 or pipeline_stages(cfg.pipeline) > 1:
        schedule_, graphdef, takeover = pipeline_layout(module, cfg, mesh, options, abstract_master, accum_dtype,
                                                         stacked)
        if takeover is not None:  # see _self_scanned_stages (pipelined: stage <= 1, no fetch_rest to keep)
            fetch_rest, checked = takeover
            loss_fn = checked(loss_fn)

    step = StepSettings(
        graphdef=graphdef, param_template=param_template, rest_template=rest_template,
        loss_fn=loss_fn, tx=tx, schedule=schedule, mesh=mesh, shardings=shardings,
        opt_shardings=opt_shardings, rest_shardings=rest_shardings, compute_dtype=dtype,
        # pipelined: the micro-batches flow through the stages inside one loss_fn call
        accum_dtype=accum_dtype, steps=1 if schedule_ else int(cfg.gradient_accumulation_steps),
        train_batch_size=int(cfg.train_batch_size), fp16=fp16, offload=offload_step, fetch_rest=fetch_rest,
        split_master=device_split)
    return EngineLayout(
        cfg=cfg, mesh=mesh, options=options, stage=stage, fp16=fp16, compute_dtype=dtype,
        accum_dtype=accum_dtype, offload_optimizer=offload_optimizer, offload_param=offload_param,
        tx=tx, schedule=schedule, abstract_master=abstract_master, shardings=shardings,
        param_shardings=param_shardings, master_shardings=master_shardings, opt_shardings=opt_shardings,
        rest_shardings=rest_shardings, offload=off, offload_settings=offload_settings,
        stage3_gather=stage3_gather, step=step, pipeline=schedule_, nvme=nvme,
        layer_lists=user_tree.stacked_lists(module))


def _rest_shardings(rest, mesh: Mesh, cfg: Config, stage: int, model_type, prefixes, ep_size: int,
                    host_kind=None):
    """The untrained state's shardings: replicated (rng counters, statistics), but for weights that
    carry logical axis names (a LoRA's frozen base: `zerojax.lora.FrozenWeight`): those are split
    as parameters are, by tensor parallelism and at stage 3 by ZeRO over "data", so that each
    device holds its part of a frozen 8B base, not all of it. host_kind (offload_param): a LoRA
    base's stacked layer weights live in that host memory kind, fetched a layer at a time with the
    trained layer (the non-layer ones, used whole, stay on the device)."""
    shardings = partition.replicated(mesh, pure_dict(rest))
    def weight(path, v):  # an annotated array, not a scalar counter
        value = variable_value(v)
        return partition.logical_axes(v) is not None and len(value.shape) > 0

    named = filter_state(rest, weight)
    if not jax.tree.leaves(named):
        return shardings
    specs = partition.tensor_specs(named, mesh, tp=cfg.tensor_parallel, model_type=model_type,
                                   stacked_prefixes=prefixes)
    if ep_size > 1:  # a frozen (LoRA) base's experts, split as trained ones are
        specs = split_experts(named, specs)
    if stage >= 3:
        threshold = int(cfg.zero_optimization.stage3_param_persistence_threshold or 0)
        specs = jax.tree.map(lambda b, x: partition.zero_spec(x.shape, b, partition.zero_axes(mesh),
                                                              min_elements=threshold),
                             specs, pure_dict(named), is_leaf=lambda x: isinstance(x, P))
    flat = dict(jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P)))
    on_host = set()
    if host_kind is not None:
        from zerojax.lora import FrozenWeight

        # a LoRA base's layer weight (its first logical axis is the stack's): the adapted layer
        # scan fetches it; any other untrained state is read where it is, so it stays on the device
        layer_axis = jax.tree.map(lambda v: isinstance(v, FrozenWeight)
                                  and (partition.logical_axes(v) or (None,))[0] == "layers", named,
                                  is_leaf=lambda x: isinstance(x, nnx.Variable))
        on_host = {path for path, f in jax.tree_util.tree_leaves_with_path(pure_dict(layer_axis)) if f}
    return jax.tree_util.tree_map_with_path(
        lambda path, s: NamedSharding(mesh, flat[path], memory_kind=host_kind if path in on_host else None)
        if path in flat else s, shardings)


__all__ = ["EngineLayout", "build_layout", "resolve_config", "PARAM_HOOK_ERROR"]
