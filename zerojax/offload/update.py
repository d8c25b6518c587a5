"""The offloaded optimizer update, one family: each chunk of (master, optimizer state) brought
from host memory to the device, updated (`apply_chunk`), cast to the compute dtype, and written
back. "in_place" runs it inside the step's jit (`streamed_update`); "host" runs the device chunk
there (`deferred_update`) and the host chunks from Python (`offload.host_loop`); the NVMe tier
runs its loop chunk over swap files (`offload.nvme.tier`). All three use the chunk API below."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from zerojax.offload import split_master
from zerojax.offload.chunks import (
    OffloadLayout,
    OffloadState,
    from_chunks,
    group,
    group_shardings,
    is_none,
    put_group,
    slice_sharding,
    to_chunks,
    to_kind,
)
from zerojax.offload.memory_kinds import DEVICE, is_host

# -- the chunk API: what the in-jit loop, the host loop (`offload.host_loop`) and the NVMe tier
#    (`offload.nvme.tier`) share


def grads_in(g, m_sh):
    """A chunk's gradients on the device: device-resident ones pass through, host-resident ones
    (offload_param) are brought in, in the master's sharding `m_sh`."""
    move = lambda x, s: x if x is None or not is_host(x) else jax.device_put(x, s.with_memory_kind(DEVICE))  # noqa: E731
    return jax.tree.map(move, g, m_sh, is_leaf=is_none)


def apply_chunk(tx, g, s, m, compute_dtype, skip, grad_scale=None):
    """One chunk's optimizer update on the device -> (new master, new state, new compute copy).
    grad_scale: multiplied into the gradients first (1 / loss scale x clip coefficient); skip: a
    bool scalar, True keeps master and state as they were."""
    if grad_scale is not None:
        g = jax.tree.map(lambda x: x.astype(jnp.float32) * grad_scale, g)
    u, s_new = tx.update(g, s, m)
    m_new = optax.apply_updates(m, u)
    if skip is not None:
        keep = lambda new, old: jnp.where(skip, old, new)  # noqa: E731
        m_new, s_new = jax.tree.map(keep, m_new, m), jax.tree.map(keep, s_new, s)
    return m_new, s_new, jax.tree.map(lambda x: x.astype(compute_dtype), m_new)


# -- the in-jit update


def _loop_update(tx, c, g, m, s, cp, m_sh, s_sh, *, kind, compute_dtype, skip, grad_scale, compute_kind,
                 split=False):
    """A loop chunk `c`: one fori_loop over its groups; iteration j reads group j of the stored
    arrays (master, state, compute copy), updates it on the device and writes it back where it was
    read (in place). State leaves with the chunk's leading layers dim are sliced per group; the
    others (counts) are read from the step's input by every group, so each group sees the same
    count. split (EngineOptions.split_master, host split): `m` holds int16 remainders against the
    compute copy `cp`; each group's fp32 master is rebuilt from both on the device and stored as
    its new remainder. -> (master, state, compute copy)."""
    n = c.hi - c.lo
    per = n // c.loop
    s_leaves, s_def = jax.tree.flatten(s)
    stacked = [x.ndim >= 1 and x.shape[0] == n for x in s_leaves]
    s_dev = [slice_sharding(x, per) if f else x for x, f in zip(s_def.flatten_up_to(s_sh), stacked)]
    m_dev = group_shardings(m_sh, per)

    def body(j, carry):
        m, s_l, cp = carry
        mm = to_kind(group(m, j, per), m_dev, DEVICE)
        if split:  # the fp32 master from the group's compute copy (read before it is replaced)
            mm = split_master.masters(to_kind(group(cp, j, per), m_dev, DEVICE), mm)
        st = [jax.lax.dynamic_slice_in_dim(x, j * per, per, axis=0) if f else x0
              for x, x0, f in zip(s_l, s_leaves, stacked)]
        st = jax.device_put(st, [x.with_memory_kind(DEVICE) for x in s_dev])
        mm, st, cc = apply_chunk(tx, grads_in(group(g, j, per), m_dev), s_def.unflatten(st), mm,
                                 compute_dtype, skip, grad_scale)
        if split:
            mm = split_master.remainders(mm, cc)
        mm = to_kind(mm, m_dev, kind)
        st = jax.device_put(jax.tree.leaves(st), [x.with_memory_kind(kind) for x in s_dev])
        if compute_kind is not None:
            cc = to_kind(cc, m_dev, compute_kind)
        s_l = [jax.lax.dynamic_update_slice_in_dim(b, x, j * per, axis=0) if f else x
               for b, x, f in zip(s_l, st, stacked)]
        return put_group(m, mm, j, per), s_l, put_group(cp, cc, j, per)

    m, s_l, cp = jax.lax.fori_loop(0, c.loop, body, (m, s_leaves, cp))
    return m, s_def.unflatten(s_l), cp


def _empty_like(m, m_sh, compute_dtype, compute_kind):
    """A compute-copy buffer for a loop chunk when no previous compute params are given."""
    z = jax.tree.map(lambda x: None if x is None else jnp.zeros(x.shape, compute_dtype), m, is_leaf=is_none)
    if compute_kind is not None:
        return to_kind(z, m_sh, compute_kind)
    return jax.tree.map(lambda x, s: None if x is None else jax.lax.with_sharding_constraint(
        x, NamedSharding(s.mesh, s.spec)), z, m_sh, is_leaf=is_none)


def streamed_update(tx, grads, state: OffloadState, off: OffloadLayout, *,
                    compute_dtype=jnp.bfloat16, skip=None, grad_scale=None, compute_kind=None,
                    compute_init=None, nvme=None, split=False):
    """One optimizer step over offloaded chunks (EngineOptions.offload_loop="in_place"); call
    inside the step's jit.

    tx: an elementwise optax transform (no global-norm clipping inside: clip `grads` before).
    grads: fp32 gradients, params-shaped, on device (or host-resident, see `fetch`).
    skip: optional bool scalar (e.g. fp16 overflow): when True master and state stay as they were.
    grad_scale: optional fp32 scalar multiplied into each gradient chunk once it is on the device
        (1 / loss scale x clip coefficient: host-resident gradients are never computed on in place).
    compute_kind: None (compute params returned in device memory) or a host kind: each chunk's
        compute copy is sent there as soon as it is made (stage 3 `offload_param`).
    compute_init: the previous compute params (params-shaped, donated by the caller): a loop
        chunk writes its new compute copy into them in place.
    nvme: an `nvme.tier.NvmeTier`: its loop chunk's master and moments live in swap files
        (`nvme_loop_update`); the state holds None there.
    split: EngineOptions.split_master's host split: the host chunks' master is int16 remainders
        against `compute_init` (`offload.split_master`), rebuilt and split again chunk by chunk.
    -> (compute params tree in `compute_dtype`, new OffloadState in place).
    """
    out_c, out_m, out_s = _update_chunks(
        tx, grads, state, off, compute_dtype=compute_dtype, skip=skip, grad_scale=grad_scale,
        compute_kind=compute_kind, compute_init=compute_init, nvme=nvme, split=split)
    return from_chunks(out_c, off.layout), OffloadState(out_m, out_s)


def deferred_update(tx, grads, state: OffloadState, off: OffloadLayout, *, compute_dtype=jnp.bfloat16,
                    skip=None, grad_scale=None):
    """`streamed_update` without the host chunks (EngineOptions.offload_loop="host"; call inside the
    step's jit): the device chunk (offload_optimizer.ratio < 1) is updated; the host chunks' master
    and state are not read (the caller passes None there; they come out as given) and are left,
    with the whole gradients, to `offload.host_loop.HostLoop`, which updates them a chunk at a time
    from Python. -> (compute chunks: a list with None at the host chunks, OffloadState)."""
    out_c, out_m, out_s = _update_chunks(tx, grads, state, off, compute_dtype=compute_dtype, skip=skip,
                                         grad_scale=grad_scale, host_later=True)
    return out_c, OffloadState(out_m, out_s)


def _update_chunks(tx, grads, state: OffloadState, off: OffloadLayout, *, compute_dtype, skip, grad_scale,
                   compute_kind=None, compute_init=None, nvme=None, host_later=False, split=False):
    """The body of `streamed_update` / `deferred_update` (`host_later`: the host chunks passed
    through untouched; `split`: the host chunks' master held as remainders against `compute_init`)
    -> (compute chunks, master chunks, state chunks)."""
    if split and compute_init is None:
        raise ValueError("the host split of the master (EngineOptions.split_master) needs the compute params "
                         "(compute_init) its remainders are against")
    layout = off.layout
    g_chunks = to_chunks(grads, layout)
    init_chunks = to_chunks(compute_init, layout) if compute_init is not None else None
    n = len(layout.chunks)
    out_c, out_m, out_s = [None] * n, [None] * n, [None] * n
    for i, (c, g, m, s) in enumerate(zip(layout.chunks, g_chunks, state.master, state.opt_state)):
        m_sh, s_sh = off.master_shardings[i], off.state_shardings[i]
        if c.host and host_later:  # left to offload.host_loop (the non-layer chunk too)
            out_m[i], out_s[i] = m, s
            continue
        if c.loop:
            nv = nvme is not None and i == nvme.chunk
            cp = (init_chunks[i] if init_chunks is not None
                  else _empty_like(nvme.m_template if nv else m, m_sh, compute_dtype, compute_kind))
            if nv:  # the NVMe tier's loop chunk: its own loop over the files
                s, cp = nvme.loop_update(tx, g, s, cp, compute_dtype=compute_dtype, skip=skip,
                                         grad_scale=grad_scale, compute_kind=compute_kind)
            else:
                m, s, cp = _loop_update(tx, c, g, m, s, cp, m_sh, s_sh, kind=off.kind, compute_dtype=compute_dtype,
                                        skip=skip, grad_scale=grad_scale, compute_kind=compute_kind,
                                        split=split and c.host)
            out_c[i], out_m[i], out_s[i] = cp, m, s
            continue
        # the whole chunk at once (the rest leaves; the device chunk, with no transfer)
        if c.host:
            m, s = to_kind(m, m_sh, DEVICE), to_kind(s, s_sh, DEVICE)
            if split:
                m = split_master.masters(to_kind(init_chunks[i], m_sh, DEVICE), m)
        m, s, cp = apply_chunk(tx, grads_in(g, m_sh), s, m, compute_dtype, skip, grad_scale)
        if c.host:
            if split:
                m = split_master.remainders(m, cp)
            m, s = to_kind(m, m_sh, off.kind), to_kind(s, s_sh, off.kind)
        if compute_kind is not None:
            cp = to_kind(cp, m_sh, compute_kind)
        out_c[i], out_m[i], out_s[i] = cp, m, s
    return out_c, out_m, out_s


def grad_stats(grads, off: OffloadLayout):
    """(sum of squares in fp32, all finite) of a params-shaped gradient tree, chunk by chunk.

    Host-resident leaves (offload_param's gradients) are brought to the device one chunk of the
    layout at a time, reduced there and dropped: nothing is computed in host memory.
    """
    def stats(g, m_sh, acc):
        total, finite = acc
        for x in jax.tree.leaves(grads_in(g, m_sh)):
            x = x.astype(jnp.float32)
            total = total + jnp.sum(jnp.square(x))
            finite = finite & jnp.all(jnp.isfinite(x))
        return total, finite

    acc = (jnp.float32(0.0), jnp.asarray(True))
    for c, g, m_sh in zip(off.layout.chunks, to_chunks(grads, off.layout), off.master_shardings):
        if c.loop:  # one group of layers on the device at a time, as the update does
            per = (c.hi - c.lo) // c.loop
            dev = group_shardings(m_sh, per)
            acc = jax.lax.fori_loop(0, c.loop, lambda j, a, g=g, dev=dev, per=per: stats(
                group(g, j, per), dev, a), acc)
        else:
            acc = stats(g, m_sh, acc)
    return acc


def accumulate_chunks(acc, grads, off: OffloadLayout, first, *, kind: str):
    """`acc + grads` (or `grads` where `first`) into the host-resident accumulator `acc` in place,
    chunk by chunk: each layer group of both is brought to the device, added there in `acc`'s
    dtype, and written back into `acc`'s buffer (dynamic_update_slice, as the update writes the
    master). Device memory holds one group; nothing is computed in host memory.

    acc: params-shaped, in memory `kind` (the offloaded params' shardings); its contents are
    ignored where `first` (a bool scalar) is True, so the caller's buffer needs no zeroing.
    grads: params-shaped, host-resident or on the device (compute dtype). -> the new `acc`.
    """
    def add(a, g):
        if a is None:
            return None
        return jnp.where(first, jnp.zeros((), a.dtype), a) + g.astype(a.dtype)

    out = []
    for c, a, g, m_sh in zip(off.layout.chunks, to_chunks(acc, off.layout), to_chunks(grads, off.layout),
                             off.master_shardings):
        if c.loop:  # a group of layers on the device at a time, written back in place
            per = (c.hi - c.lo) // c.loop
            dev = group_shardings(m_sh, per)

            def body(j, a, g=g, dev=dev, per=per):
                aa = to_kind(group(a, j, per), dev, DEVICE)
                new = to_kind(jax.tree.map(add, aa, grads_in(group(g, j, per), dev), is_leaf=is_none), dev, kind)
                return put_group(a, new, j, per)

            out.append(jax.lax.fori_loop(0, c.loop, body, a))
        else:  # the non-layer leaves (or a device chunk): whole
            out.append(to_kind(jax.tree.map(add, to_kind(a, m_sh, DEVICE), grads_in(g, m_sh), is_leaf=is_none), m_sh,
                               kind))
    return from_chunks(out, off.layout)


__all__ = ["to_kind", "grads_in", "apply_chunk", "slice_sharding", "group_shardings", "group", "put_group",
           "streamed_update", "deferred_update", "grad_stats", "accumulate_chunks"]
