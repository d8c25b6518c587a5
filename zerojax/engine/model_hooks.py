"""The hooks an engine hands a model (docs/CONTRACTS.md, "The model contract"): offload_param's
and stage 3's per-layer `layer_fetch`, the pipeline's `layer_scan`, the attributes set for the
duration of a split. Each returns the graphdef with its hook installed and leaves the user's module
as it was. `zerojax.engine.layout.build_layout` decides which hooks a layout needs; this module
installs them.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax import model as contract
from zerojax import offload as O
from zerojax._jax_compat import no_eager_sharding
from zerojax.config import ConfigError, pipeline_stages
from zerojax.sharding import partition
from zerojax.sharding.pipeline import PipelineSchedule, pipeline_scan, schedule_problems

PARAM_HOOK_ERROR = ("zero_optimization.offload_param: offload_param needs a model whose layer scan accepts a "
                    "fetch hook (a `layer_fetch` attribute applied to each layer's params inside the scan); "
                    "zerojax.models.gpt2.GPT2 does. {what}")


@contextlib.contextmanager
def settings_applied(settings):
    """(module, attribute, value) settings applied for the duration (a block class swapped
    through `object.__setattr__`), each put back after."""
    saved = [(m, name, m.__class__ if name == "__class__" else getattr(m, name)) for m, name, _ in settings]
    try:
        for m, name, value in settings:
            object.__setattr__(m, name, value) if name == "__class__" else setattr(m, name, value)
        yield
    finally:
        for m, name, value in reversed(saved):
            object.__setattr__(m, name, value) if name == "__class__" else setattr(m, name, value)


PIPELINE_HOOK_ERROR = ("pipeline.stages = {stages}: pipelining needs a model whose layers run as one stacked scan "
                       "with a `layer_scan` hook (docs/CONTRACTS.md; zerojax.models.gpt2.GPT2 has it). {what}")


SELF_SCAN_ERROR = ("pipeline.stages = {stages}: zerojax runs {model}'s nnx.vmap-stacked {block} in pipeline stages "
                   "by handing the model's own layer scan the whole stack as its one item, which needs a scan "
                   "whose body only calls the block on its carry (`x = block(x, ...)`); {what}. Give the module "
                   "that scans its layers the `layer_scan` hook (docs/CONTRACTS.md, \"The model contract\"), or "
                   "use pipeline.stages 1")


def check_needs_stack(module, cfg, offload_param: bool) -> None:
    """Pipeline stages and per-layer parameter offload run the blocks as one stacked scan: on a
    model whose list of blocks zerojax left as its own loop, the error names the loop's line."""
    note = contract.unstacked_list_note(module)
    if not note:
        return
    if pipeline_stages(cfg.pipeline) > 1:
        raise config_error(PIPELINE_HOOK_ERROR.format(stages=cfg.pipeline.stages, what=note.strip()))
    if offload_param:
        raise config_error(PARAM_HOOK_ERROR.format(what=note.strip()))


def pipeline_layout(module, cfg, mesh, options, abstract_master, accum_dtype, stacked=None):
    """(PipelineSchedule, the graphdef whose layer scan runs it, None or what a stack the model
    scans itself needs besides: `_self_scanned_stages`) for pipeline.stages > 1."""
    stages = pipeline_stages(cfg.pipeline)
    if partition.pipe_size(mesh) != stages:
        raise config_error(f"pipeline.stages = {cfg.pipeline.stages} but the mesh's \"pipe\" axis has size "
                            f"{partition.pipe_size(mesh)}; pass mesh=None or a mesh made with "
                            f"zerojax.make_mesh(pipe={stages})")
    hooked = [m for _, m in nnx.iter_graph(module) if isinstance(m, nnx.Module) and "layer_scan" in vars(m)]
    block = None if hooked else vmapped_stack(module)
    layers = O.chunk_layout(abstract_master, 1, stacked=stacked).num_layers
    if not (hooked or block is not None) or not layers:
        raise config_error(PIPELINE_HOOK_ERROR.format(
            stages=stages, what=f"{type(module).__name__} has no " + (
                "`layer_scan` attribute" if not hooked else "stacked (scanned) layer parameters")
            + "; use pipeline.stages 1 (data parallelism with ZeRO) for it"))
    schedule = PipelineSchedule(stages=stages, microbatches=int(cfg.gradient_accumulation_steps),
                                repeats=options.pipeline_repeats,
                                checkpoint_interval=int(cfg.pipeline.activation_checkpoint_interval),
                                grad_accum_dtype=jnp.dtype(accum_dtype).name)
    problems = schedule_problems(layers, stages, schedule.microbatches, schedule.repeats,
                                 schedule.checkpoint_interval)
    if problems:
        raise ConfigError(problems)
    if block is not None:
        return (schedule, *_self_scanned_stages(module, block, pipeline_scan(schedule, mesh), stacked, stages))
    return schedule, split_with(module, hooked, {"layer_scan": pipeline_scan(schedule, mesh)}), None


def _self_scanned_stages(module, block, layer_scan, stacked, stages):
    """(graphdef, (params transform, loss_fn wrapper)) that run an `nnx.vmap`-built stack the
    model scans itself (`nnx.scan` over the stacked block, no hooks) in pipeline stages. The
    model's scan cannot be replaced, so it is handed the whole stack as its one item: the transform
    gives every stacked leaf a leading axis of 1 ([L, ...] -> [1, L, ...]) before the model is
    built, and the block's swapped call, getting all L layers at once, runs them through
    `layer_scan` (`zerojax.model.hooked_block_class`). That equals the model's own loop only when
    its scan body does nothing but call the block on its carry: the wrapped loss_fn checks so on
    the traced program first (`zerojax.model.scans_block_alone`), an error naming the hook where
    not."""
    def error(what):
        return SELF_SCAN_ERROR.format(stages=stages, model=type(module).__name__, block=type(block).__name__,
                                      what=what)

    if jax.tree.leaves(nnx.state(block, nnx.Not(nnx.Param))):
        # its scan would take that state layer by layer, beside a stack of one item
        raise config_error(error(what="its blocks hold state besides their parameters (RNG streams, batch "
                                       "statistics), which that scan takes layer by layer"))
    path = contract.find_blocks(module).path
    whole_ndim = jax.tree.leaves(nnx.state(block, nnx.Param))[0].ndim
    cls = type(block)
    swapped = contract.hooked_block_class(cls, policy=getattr(cls, "_zerojax_policy", None), layer_scan=layer_scan,
                                          whole_ndim=whole_ndim)
    with settings_applied([(block, "__class__", swapped)]), no_eager_sharding():
        graphdef = nnx.split(module, nnx.Param, ...)[0]

    def whole(params):
        return jax.tree.map(lambda a, f: a.reshape(1, *a.shape) if f else a, params, stacked)

    def checked(loss_fn):
        def run(model, batch):
            try:
                alone = contract.scans_block_alone(lambda m: loss_fn(m, batch), model, path, whole_ndim)
            except Exception as e:
                raise config_error(error(what="tracing the model that way failed (the error above)")) from e
            if not alone:
                raise config_error(error(what="its scan does more than that (inputs scanned beside the "
                                               "blocks, work around the block call)"))
            return loss_fn(model, batch)
        return run

    return graphdef, (whole, checked)


def model_type(module) -> str:
    """The model's type for `layer_specs[].model_types`: its checkpoint record's, else its class."""
    record = getattr(module, "checkpoint_record", None)
    return (record() if callable(record) else {}).get("type") or type(module).__name__.lower()


def activation_modules(model) -> list:
    """The modules of `model` that expose the `activation_sharding` hook (docs/CONTRACTS.md)."""
    return modules_with(model, "activation_sharding")


def modules_with(model, hook: str) -> list:
    """The modules of `model` that have the attribute `hook` (an engine hook, docs/CONTRACTS.md)."""
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and hook in vars(m)]


@contextlib.contextmanager
def attributes_set(modules, **values):
    """Set `values` on `modules` for the duration, each only where the module has that attribute
    (graphdefs taken inside carry them); the user's modules are left as they were."""
    saved = [(m, {k: vars(m)[k] for k in values if k in vars(m)}) for m in modules]
    try:
        for m, old in saved:
            for k in old:
                setattr(m, k, values[k])
        yield
    finally:
        for m, old in saved:
            for k, v in old.items():
                setattr(m, k, v)


def vmapped_stack(model):
    """The block module of an `nnx.vmap`-built stack the model scans itself, else None."""
    stack = contract.find_blocks(model)
    return contract.at(model, stack.path) if stack is not None and stack.kind == "stacked" else None


def hook_modules(model) -> list:
    """The modules of `model` that expose the per-layer `layer_fetch` hook (docs/CONTRACTS.md)."""
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and "layer_fetch" in vars(m)]


def config_error(message):
    return ConfigError([message])


def install_layer_hook(module, abstract_master, targets, move, knobs: dict, stacked=None):
    """The model's graph with its per-layer hook installed -> (graphdef, fetch_rest).

    `layer_fetch` = `move(layer slice, that layer's `targets` shardings)`, applied by the model to
    each layer's params inside its scan: offload_param brings the layer from host to device
    memory (`offload.fetch`), stage 3 constrains it to its gathered sharding (ZeRO-3's all-gather
    on use). `knobs` (e.g. scan_unroll, layer_scan) are set where the module has them. The user's
    module is left as it was: the hook lives only in the returned graphdef. A model whose blocks
    are an `nnx.vmap`-built stack run by its own scan gets the hook through its block class
    (`zerojax.model.hooked_block_class`)."""
    probe = O.chunk_layout(abstract_master, 1, stacked=stacked)
    flags = probe.treedef.unflatten(list(probe.stacked))
    if not any(probe.stacked):
        raise config_error(PARAM_HOOK_ERROR.format(
            what="This model has no stacked (scanned) layer parameters to fetch layer by layer."))
    # every maximal subtree whose leaves are all stacked: its layer slice's structure -> shardings
    table: dict = {}

    def walk(f, d, root=False):
        if isinstance(f, dict):
            # the root is never one layer group: the model's scan takes its stacked subtrees
            if f and all(jax.tree.leaves(f)) and not root:
                key = jax.tree.structure(f)
                layer = O.layer_shardings(d)
                if key in table and table[key] != layer:
                    raise config_error(PARAM_HOOK_ERROR.format(
                        what="Two stacked parameter groups with one structure are sharded differently."))
                table[key] = layer
                return
            for name in f:
                walk(f[name], d[name])

    walk(flags, targets, root=True)

    def layer_fetch(p):
        target = table.get(jax.tree.structure(p))
        if target is None:
            raise ValueError("offload_param: the model's layer_fetch got a tree that matches no stacked "
                             f"parameter group: {jax.tree.structure(p)}")
        return move(p, target)

    def fetch_rest(tree):  # the non-layer leaves (embeddings, final norm): whole, where used
        return jax.tree.map(lambda x, f, s: x if f else move(x, s), tree, flags, targets)

    hooked = hook_modules(module)
    block = vmapped_stack(module)
    if not hooked and block is not None:
        cls = type(block)
        swapped = contract.hooked_block_class(cls, policy=getattr(cls, "_zerojax_policy", None), fetch=layer_fetch)
        with settings_applied([(block, "__class__", swapped)]), no_eager_sharding():
            return nnx.split(module, nnx.Param, ...)[0], fetch_rest
    if not hooked:
        raise config_error(PARAM_HOOK_ERROR.format(
            what=f"{type(module).__name__} has no `layer_fetch` attribute, so its parameters would "
                 "stay on the device."))
    return split_with(module, hooked, {"layer_fetch": layer_fetch, **knobs}), fetch_rest


def split_with(module, hooked, attrs: dict):
    """The graphdef of `module` with `attrs` set on the `hooked` modules where they have them,
    `module` itself left as it was."""
    with attributes_set(hooked, **attrs), no_eager_sharding():
        return nnx.split(module, nnx.Param, ...)[0]


__all__ = ["PARAM_HOOK_ERROR", "PIPELINE_HOOK_ERROR", "SELF_SCAN_ERROR", "settings_applied", "attributes_set",
           "check_needs_stack", "pipeline_layout", "model_type", "activation_modules", "modules_with", "vmapped_stack",
           "hook_modules", "config_error", "install_layer_hook", "split_with"]
