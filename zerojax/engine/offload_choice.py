"""Which offload an engine runs, from its config and `EngineOptions`: what DeepSpeed's
offload_optimizer / offload_param sections act on, which offload loop ("in_place" or "host") and
which master split apply, and the chunk layout that follows (`offload_layout`). Pure functions of
the config and the options: `zerojax.engine.layout.build_layout` reads them, so does the planner.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax import offload as O
from zerojax.precision import compute_dtype as compute_dtype_of
from zerojax.precision import loss_scaler_from_config


def offloads(cfg) -> tuple[bool, bool]:
    """(offload_optimizer, offload_param) as DeepSpeed acts on them: the optimizer at stage >= 1,
    the params at stage 3, each to cpu or nvme."""
    zero = cfg.zero_optimization
    stage = int(zero.stage)
    return (zero.offload_optimizer.device in ("cpu", "nvme") and stage >= 1,
            zero.offload_param.device in ("cpu", "nvme") and stage == 3)


def _precision_name(cfg) -> str:
    """"bf16", "fp16" or "fp32": the config's compute dtype as the split-master errors name it."""
    return {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "fp16"}.get(
        jnp.dtype(compute_dtype_of(cfg)), "fp32")


def split_master_applies(precision: str, loop: str | None, offloaded: bool,
                         master_on_host: bool) -> tuple[bool, bool]:
    """(host split, device split): where EngineOptions.split_master can act. The master's top half
    is the bf16 compute copy, so both need bf16 compute; the host split an offload loop over a
    master in host memory (`loop` "host", or "in_place" with `master_on_host`: the optimizer
    offloaded to cpu, not to NVMe files), the device split the state whole on the device (not
    `offloaded`)."""
    bf16 = precision == "bf16"
    return bf16 and (loop == "host" or (loop == "in_place" and master_on_host)), bf16 and not offloaded


def _master_on_host(cfg) -> bool:
    """The optimizer (its fp32 master) offloaded to cpu memory."""
    opt = cfg.zero_optimization.offload_optimizer
    return offloads(cfg)[0] and opt.device == "cpu"


def resolve_split_master(options, cfg, loop: str | None, offloaded: bool) -> tuple[bool, bool]:
    """EngineOptions.split_master checked against this config -> (host split, device split).
    "auto": the host split with the "host" loop; "on": every split that applies (the in_place
    loop's host split too), an error where none does; "off": neither."""
    if options.split_master == "off":
        return False, False
    precision = _precision_name(cfg)
    host, device = split_master_applies(precision, loop, offloaded, _master_on_host(cfg))
    if options.split_master == "auto":
        return host and loop == "host", False
    if not (host or device):
        raise ValueError(f"EngineOptions.split_master='on' needs bf16 compute with no offload or with the "
                         f"optimizer offloaded to cpu (this config: {precision}, offload {loop or 'none'}, "
                         f"optimizer {'in cpu memory' if _master_on_host(cfg) else 'not in cpu memory'}); enable "
                         f"\"bf16\" (with optimizer offload to cpu, or none), or use split_master='auto'")
    return host, device


def options_for_config(options, cfg):
    """`options` with what this config cannot take set back to "auto", for the planner's candidates
    (a user's split_master="on" or offload_loop="host" is a choice about one layout; a plan that
    offloads, or does not, must not fail for it)."""
    offload_optimizer, offload_param = offloads(cfg)
    changes = {}
    if options.offload_loop == "host" and not chunk_loops_apply(cfg.zero_optimization, offload_optimizer,
                                                                offload_param):
        changes["offload_loop"] = "auto"
    if options.split_master == "on":
        loop = resolve_offload_loop(options.replace(**changes), cfg.zero_optimization, offload_optimizer,
                                    offload_param) if offload_optimizer or offload_param else None
        if not any(split_master_applies(_precision_name(cfg), loop, offload_optimizer or offload_param,
                                        _master_on_host(cfg))):
            changes["split_master"] = "auto"
    return options.replace(**changes) if changes else options


def chunk_loops_apply(zero, offload_optimizer: bool, offload_param: bool) -> bool:
    """Whether offload_loop "host" can run: optimizer offload to cpu alone (one host chunk per
    layer group, compute copies on the device; the NVMe tier and offload_param's host compute
    copies stream a stacked layer buffer)."""
    return offload_optimizer and zero.offload_optimizer.device == "cpu" and not offload_param


def resolve_offload_loop(options, zero, offload_optimizer: bool, offload_param: bool) -> str:
    """EngineOptions.offload_loop checked against this config (`chunk_loops_apply`): "auto" is
    "host" where it applies, else "in_place"."""
    applies = chunk_loops_apply(zero, offload_optimizer, offload_param)
    if options.offload_loop == "auto":
        return "host" if applies else "in_place"
    if options.offload_loop == "host" and not applies:
        raise ValueError(f"EngineOptions.offload_loop='host' works with offload_optimizer to cpu alone "
                         f"(offload_param: {zero.offload_param.device!r}, offload_optimizer: "
                         f"{zero.offload_optimizer.device!r}); use offload_loop='auto' or 'in_place'")
    return options.offload_loop


def offload_layout(cfg, options, tx, abstract_master, shardings, mesh, fp16, offload_optimizer,
                    offload_param, stacked=None):
    """(OffloadLayout, its settings, the opt-state shardings, the fp16 loss scaler or None).

    "in_place": one layer a group (the least device memory; faster than fewer, larger groups),
    the non-layer leaves one more chunk. "host": one chunk per group of the fewest layers holding
    offload_host_chunk_bytes of master per device (fewer transfers and dispatches)."""
    zero = cfg.zero_optimization
    loop = resolve_offload_loop(options, zero, offload_optimizer, offload_param)
    if loop == "host":
        k = O.groups_of_at_least(abstract_master, options.offload_host_chunk_bytes, shardings.master,
                                 stacked=stacked)
    else:
        k = O.chunk_layout(abstract_master, 1, stacked=stacked).num_layers or 1
    if offload_optimizer:
        kind = O.host_memory_kind(bool(zero.offload_optimizer.pin_memory))
        ratio = float(zero.offload_optimizer.ratio)
    else:  # offload_param alone: the optimizer state stays on the device (one device chunk)
        kind, ratio = O.DEVICE, 0.0
    off = O.offload_layout(tx, abstract_master, shardings.master, k, kind=kind, ratio=ratio,
                           per_group=loop == "host", stacked=stacked)
    settings = dict(chunks=k, ratio=ratio, kind=kind, loop=loop)
    scaler = loss_scaler_from_config(cfg.fp16) if fp16 else None
    opt_shardings = off.shardings.opt_state
    if scaler is not None:
        rep = NamedSharding(mesh, P())
        ls = jax.eval_shape(lambda: scaler.init(None))
        opt_shardings = jax.tree.map(lambda _: rep, ls)._replace(inner_state=opt_shardings)
    return off, settings, opt_shardings, scaler


__all__ = ["offloads", "split_master_applies", "resolve_split_master", "options_for_config", "chunk_loops_apply",
           "resolve_offload_loop", "offload_layout"]
