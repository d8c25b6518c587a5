"""The train state and the one jitted training step (docs/CONTRACTS.md).

`train_step(settings, state, batch)` is pure: split the batch into micro-batches (accumulate.py) ->
gradients in the gradient sharding -> unscale + finite check (fp16 loss-scale transform) -> clip ->
optimizer update on the fp32 master (`optimizer_update`, kept apart so host offload can wrap it)
-> new compute-dtype params in the param sharding -> metrics. The engine jits it with the state
donated.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from zerojax import offload as offload_mod
from zerojax._jax_compat import to_pure_dict as pure_dict
from zerojax.accumulate import accumulate_gradients
from zerojax.precision import all_finite
from zerojax.sharding.partition import StageShardings, data_axes
from zerojax.train_state import TrainState  # noqa: F401 (zerojax.engine.step.TrainState, a public path)


@dataclasses.dataclass(frozen=True, eq=False)
class StepSettings:
    """What the step needs besides the state: static, built once by `zerojax.engine.layout.build_layout`."""

    graphdef: Any                 # nnx.GraphDef of the model
    param_template: Any           # nnx.State of Params (abstract), filled with pure dicts to merge
    rest_template: Any            # nnx.State of the rest (abstract)
    loss_fn: Callable             # loss_fn(model, batch) -> loss | (loss, metrics)
    tx: optax.GradientTransformation   # loss scaling (fp16) around clip + optimizer
    schedule: Callable            # lr(k) of the k-th applied update
    mesh: Mesh
    shardings: StageShardings     # params / grads / master
    opt_shardings: Any
    rest_shardings: Any
    compute_dtype: Any
    accum_dtype: Any
    steps: int                    # gradient_accumulation_steps
    train_batch_size: int
    fp16: bool
    offload: OffloadStep | None = None   # host offload (zero_optimization.offload_*)
    # EngineOptions.split_master (device split; no offload, bf16): `TrainState.master` holds int16
    # remainders against `params` (`offload.split_master`), the fp32 master rebuilt in the update
    split_master: bool = False
    # the non-layer params -> where the forward uses them (stage 3: gathered; offload_param:
    # brought to the device); the layers are moved one at a time by the model's layer_fetch hook
    fetch_rest: Callable | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class OffloadStep:
    """Host offload of the optimizer (and, stage 3, of the params): built by `build_layout`.

    With it, `TrainState.master` is the list of per-chunk fp32 master pieces of `layout`
    (`zerojax.offload`; host memory; with `split_master` the host chunks' pieces are int16
    remainders against `params`, `offload.split_master`), `opt_state` the list of per-chunk states of `tx` (fp16: a
    LossScaleState whose `inner_state` is that list), and `params` the compute copy (fp32 compute
    too: a copy on the device apart from the host master).
    """

    layout: Any                   # offload.OffloadLayout: chunk layout, per-chunk shardings
    tx: optax.GradientTransformation   # the bare optimizer + schedule (no clip, no loss scale)
    scaler: Any                   # precision.LossScaler (fp16) or None
    clip: float                   # gradient_clipping; 0 = off
    param_shardings: Any = None   # offload_param: the compute params' host shardings
    loop: str = "in_place"        # EngineOptions.offload_loop, resolved: "in_place" | "host"
    nvme: Any = None              # offload.nvme_tier.NvmeTier: the layers' state in swap files
    split_master: bool = False    # EngineOptions.split_master (host split): host chunks' master as remainders
    # split_master's conversion programs (offload.split_master.convert), compiled once
    converters: dict = dataclasses.field(default_factory=dict, repr=False)


def merge(settings: StepSettings, params, rest):
    """An nnx module from the graphdef and pure-dict params / rest."""
    p = jax.tree.map(lambda x: x, settings.param_template)
    nnx.replace_by_pure_dict(p, params)
    r = jax.tree.map(lambda x: x, settings.rest_template)
    nnx.replace_by_pure_dict(r, rest)
    return nnx.merge(settings.graphdef, p, r)


def _call_loss(settings: StepSettings, params, batch, rest):
    if settings.fetch_rest is not None:
        params = settings.fetch_rest(params)
    model = merge(settings, params, rest)
    out = settings.loss_fn(model, batch)
    loss, aux = out if isinstance(out, tuple) else (out, {})
    new_rest = pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
    return jnp.asarray(loss).astype(jnp.float32), dict(aux), new_rest


def master_of(settings: StepSettings, state: TrainState):
    """The fp32 master in the optimizer sharding (a local slice of `params` when fp32; with
    `split_master`, rebuilt from the params' local slice and the remainders)."""
    if settings.split_master:
        return rebuilt_master(settings, state.params, state.master)
    if state.master is not None:
        return state.master
    return jax.lax.with_sharding_constraint(state.params, settings.shardings.master)


def rebuilt_master(settings: StepSettings, params, rems):
    """With `split_master`: the fp32 master from the compute `params`' local slice (in the master's
    sharding) and its int16 remainders `rems`."""
    compute = jax.lax.with_sharding_constraint(params, settings.shardings.master)
    return offload_mod.split_master.masters(compute, rems)


def stored_master(settings: StepSettings, master):
    """What `TrainState.master` keeps of an fp32 `master`: itself, or with `split_master` its
    int16 remainders against its own bf16 rounding (the compute params' local slice)."""
    if not settings.split_master:
        return master
    rems = offload_mod.split_master.remainders(master, jax.tree.map(lambda m: m.astype(settings.compute_dtype), master))
    return jax.lax.with_sharding_constraint(rems, settings.shardings.master)


def loss_scale_of(settings: StepSettings, opt_state):
    if settings.fp16:
        return jnp.asarray(opt_state.loss_scale, jnp.float32)
    return jnp.float32(1.0)


def optimizer_update(settings: StepSettings, grads, master, opt_state):
    """One optimizer update on the fp32 master: (new_master, new_opt_state).

    The seam for host offload: a variant moves `master` / `opt_state` in from pinned host memory,
    calls this, and moves them back.
    """
    updates, opt_state = settings.tx.update(grads, opt_state, master)
    master = optax.apply_updates(master, updates)
    master = jax.lax.with_sharding_constraint(master, settings.shardings.master)
    opt_state = jax.lax.with_sharding_constraint(opt_state, settings.opt_shardings)
    return master, opt_state


def _compute_params(settings: StepSettings, master):
    """The compute-dtype params the next step's forward pass reads, from the fp32 master."""
    params = jax.tree.map(lambda m: m.astype(settings.compute_dtype), master)
    return jax.lax.with_sharding_constraint(params, settings.shardings.params)


def train_step(settings: StepSettings, state: TrainState, batch):
    """One optimizer step -> (new state, metrics). With EngineOptions.offload_loop="host" the
    host chunks of the offloaded state are left to `offload.host_loop.HostLoop`: the new state has
    params None and those chunks' master / optimizer state as given, and metrics["host_work"] is
    the `HostWork` the loop takes (the engine pops it)."""
    scale = loss_scale_of(settings, state.opt_state)
    accum_dtype, add_into = settings.accum_dtype, None
    if settings.offload is not None and settings.offload.param_shardings is not None:
        # Gradients of host-resident params come back host-resident (JAX's typing rule). One
        # micro-batch: leave them there; the update streams them in chunk by chunk. Several:
        # add each micro-batch's into the host-memory accumulator the state carries, a layer
        # group at a time on the device (a whole fp32 accumulator on the device, 4 B/param,
        # would be the step's largest buffer: 30 GB at 7.5B params).
        if not needs_grad_accumulator(settings):
            accum_dtype = None
        else:
            off = settings.offload
            kind = _param_memory_kind(off)
            add_into = lambda acc, g, first: offload_mod.accumulate_chunks(acc, g, off.layout, first, kind=kind)  # noqa: E731
    grads, loss, aux, rest = accumulate_gradients(
        lambda p, mb, r: _call_loss(settings, p, mb, r),
        state.params, batch, steps=settings.steps, mesh=settings.mesh,
        grad_shardings=settings.shardings.grads, accum_dtype=accum_dtype,
        loss_scale=scale, carry=state.rest, add_into=add_into, acc_init=state.grad_accumulator,
        data_axes=data_axes(settings.mesh),
    )
    if settings.offload is not None:
        new_state, metrics = _offloaded_tail(settings, state, grads, loss, aux, rest, scale)
        return new_state._replace(grad_accumulator=grads if add_into is not None else None), metrics
    # DeepSpeed reports the norm of the unscaled gradients before clipping.
    grad_norm = _global_norm(grads) / scale
    lr = settings.schedule(state.step - state.skipped_steps)
    master = master_of(settings, state)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    if settings.fp16:
        # The loss-scale transform unscales, checks the gradients' finiteness and skips (zero
        # update, inner state untouched, scale lowered) by itself; a non-finite fp16 loss shows up
        # as non-finite gradients, so it is skipped there too (DeepSpeed's overflow path).
        new_master, new_opt = optimizer_update(settings, grads, master, state.opt_state)
        params = _compute_params(settings, new_master)
        skipped = jnp.asarray(new_opt.skipped, jnp.bool_)
        nonfinite = jnp.logical_not(jnp.isfinite(loss))
    else:
        # bf16 / fp32: never train on a non-finite loss or gradient; skip and let the engine raise.
        # The compute-dtype copy is made inside each branch: in the update's, XLA writes it in the
        # update's own pass over the master (a cast after the cond read the whole master again);
        # the skip branch casts the unchanged master rather than return the step's input params,
        # which would keep those alive through the update (they are dead after the backward pass).
        nonfinite = jnp.logical_not(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
        skipped = nonfinite

        def update():
            new_master, new_opt = optimizer_update(settings, grads, master, state.opt_state)
            return stored_master(settings, new_master), new_opt, _compute_params(settings, new_master)

        kept = state.master if settings.split_master else master
        new_master, new_opt, params = jax.lax.cond(
            nonfinite, lambda: (kept, state.opt_state, _compute_params(settings, master)), update)
    new_state = TrainState(
        params=params,
        master=new_master if state.master is not None else None,
        opt_state=new_opt,
        rest=jax.lax.with_sharding_constraint(rest, settings.rest_shardings),
        step=state.step + 1,
        skipped_steps=state.skipped_steps + skipped.astype(jnp.int32),
        global_samples=state.global_samples + settings.train_batch_size,
    )
    metrics = {
        **aux,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": jnp.asarray(lr, jnp.float32),
        "loss_scale": scale,
        "skipped": skipped,
        "nonfinite": nonfinite,
    }
    if settings.fp16:
        metrics["overflow_at_min"] = jnp.asarray(new_opt.overflow_at_min, jnp.bool_)
    return new_state, metrics


def _offloaded_tail(settings: StepSettings, state: TrainState, grads, loss, aux, rest, scale):
    """Unscale + finite check + clip on the whole gradient, then the update streamed chunk by
    chunk over host memory (`offload.streamed_update`). No `lax.cond` around host state: a
    skipped step keeps master and moments by a select inside each chunk."""
    off = settings.offload
    if any(offload_mod.is_host(g) for g in jax.tree.leaves(grads)):
        sumsq, finite = offload_mod.grad_stats(grads, off.layout)  # chunk by chunk on the device
        raw_norm = jnp.sqrt(sumsq)
    else:
        raw_norm, finite = _global_norm(grads), all_finite(grads)
    grad_norm = raw_norm / scale
    finite = finite & jnp.isfinite(grad_norm)  # an unscale that overflows
    lr = settings.schedule(state.step - state.skipped_steps)
    if settings.fp16:
        # precision's loss-scale logic, with the finiteness computed here
        new_ls = off.scaler.next_state(state.opt_state, finite)
        inner = state.opt_state.inner_state
        skip = ~finite
        nonfinite = jnp.logical_not(jnp.isfinite(loss))
    else:
        inner = state.opt_state
        nonfinite = jnp.logical_not(jnp.isfinite(loss) & finite)
        skip = nonfinite
    factor = (1.0 / scale).astype(jnp.float32)
    if off.clip and off.clip > 0:  # optim.clip_by_global_norm's formula, on the unscaled norm
        coef = off.clip / (grad_norm + 1e-6)
        factor = factor * jnp.where(coef < 1.0, coef, 1.0)
    # offload_param: each chunk's new compute copy goes to host memory as soon as it is made (in
    # a "scan" chunk: inside the scan, so the stacked copy is built in host memory, never whole
    # on the device)
    pkind = None if off.param_shardings is None else _param_memory_kind(off)
    host_work = {}
    if off.loop == "host":  # the host chunks are updated after this jit, from Python (offload.host_loop)
        compute, new_off = offload_mod.deferred_update(
            off.tx, grads, offload_mod.OffloadState(state.master, inner), off.layout,
            compute_dtype=settings.compute_dtype, skip=skip, grad_scale=factor)
        params, host_work = None, {"host_work": HostWork(compute, grads, skip, factor)}
    else:
        params, new_off = offload_mod.streamed_update(
            off.tx, grads, offload_mod.OffloadState(state.master, inner), off.layout,
            compute_dtype=settings.compute_dtype, skip=skip, grad_scale=factor, compute_kind=pkind,
            compute_init=state.params, nvme=off.nvme, split=off.split_master)
    if params is not None and off.param_shardings is not None:
        params = jax.device_put(params, off.param_shardings)
    elif params is not None:
        params = jax.lax.with_sharding_constraint(params, settings.shardings.params)
    new_opt = new_ls._replace(inner_state=new_off.opt_state) if settings.fp16 else new_off.opt_state
    new_state = TrainState(
        params=params, master=new_off.master, opt_state=new_opt,
        rest=jax.lax.with_sharding_constraint(rest, settings.rest_shardings),
        step=state.step + 1,
        skipped_steps=state.skipped_steps + skip.astype(jnp.int32),
        global_samples=state.global_samples + settings.train_batch_size,
    )
    metrics = {**aux, "loss": loss, "grad_norm": grad_norm, "lr": jnp.asarray(lr, jnp.float32),
               "loss_scale": scale, "skipped": skip, "nonfinite": nonfinite, **host_work}
    if settings.fp16:
        metrics["overflow_at_min"] = jnp.asarray(new_ls.overflow_at_min, jnp.bool_)
    return new_state, metrics


class HostWork(NamedTuple):
    """What the step's jit leaves to `offload.host_loop.HostLoop` (EngineOptions.offload_loop="host"):
    the compute copies of the chunks it updated (None at the host chunks), the gradients
    (params-shaped), the skip flag and the gradient factor (1 / loss scale x clip coefficient)."""

    compute: list
    grads: Any
    skip: Any
    grad_scale: Any


def _param_memory_kind(off: OffloadStep) -> str:
    """The host memory kind of offload_param's compute params."""
    return jax.tree.leaves(off.param_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0].memory_kind


def needs_grad_accumulator(settings: StepSettings) -> bool:
    """Whether the state carries `grad_accumulator` (offload_param with accumulation steps > 1)."""
    return settings.offload is not None and settings.offload.param_shardings is not None and settings.steps > 1


def _global_norm(tree):
    norm = getattr(getattr(optax, "tree", None), "norm", None)  # optax >= 0.2.5
    return norm(tree) if norm is not None else optax.global_norm(tree)


def eval_step(settings: StepSettings, params, rest, batch):
    loss, _, _ = _call_loss(settings, params, batch, rest)
    return loss


__all__ = ["TrainState", "StepSettings", "needs_grad_accumulator", "pure_dict", "OffloadStep", "train_step",
           "eval_step", "optimizer_update", "merge", "master_of",
           "rebuilt_master", "stored_master"]
