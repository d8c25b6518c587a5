"""The streamed optimizer update: each chunk of (master, optimizer state) brought from host
memory to the device, updated, cast to the compute dtype, and written back, inside the step's jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.offload.chunks import (OffloadLayout, OffloadState, from_chunks, is_none, to_chunks,
                                    unsplit_layers)
from zerojax.offload.memory_kinds import DEVICE, is_host, is_sharding, with_memory_kind
from zerojax.options import OFFLOAD_LOOPS



def _to(tree, shardings, kind):
    return jax.device_put(tree, with_memory_kind(shardings, kind))


def _grads_in(g, m_sh):
    # gradients already on device pass through; host-resident ones (offload_param) come in
    move = lambda x, s: x if x is None or not is_host(x) else jax.device_put(x, s.with_memory_kind(DEVICE))  # noqa: E731
    return jax.tree.map(move, g, m_sh, is_leaf=is_none)


def _apply(tx, g, s, m, compute_dtype, skip, grad_scale=None):
    if grad_scale is not None:  # unscale x clip, applied chunk by chunk on the device
        g = jax.tree.map(lambda x: x.astype(jnp.float32) * grad_scale, g)
    u, s_new = tx.update(g, s, m)
    m_new = optax.apply_updates(m, u)
    if skip is not None:
        keep = lambda new, old: jnp.where(skip, old, new)  # noqa: E731
        m_new, s_new = jax.tree.map(keep, m_new, m), jax.tree.map(keep, s_new, s)
    return m_new, s_new, jax.tree.map(lambda x: x.astype(compute_dtype), m_new)


def _slice_sharding(s, n: int):
    """A chunk sharding for a slice of `n` layers: the layers axis unsplit where n does not divide."""
    return NamedSharding(s.mesh, P(*unsplit_layers(list(tuple(s.spec)), s.mesh, n)),
                         memory_kind=s.memory_kind)


def _group_shardings(m_sh, per: int):
    """A chunk's master shardings for one group of `per` layers (`_slice_sharding` of each)."""
    return jax.tree.map(lambda x: _slice_sharding(x, per), m_sh, is_leaf=is_sharding)


def _group(tree, j, per: int):
    """Layer group j (`per` layers) of a chunk tree's stacked leaves, by dynamic slice (None stays None)."""
    return jax.tree.map(lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, j * per, per, axis=0),
                        tree, is_leaf=is_none)


def _put_group(buf, x, j, per: int):
    """`buf` with layer group j replaced by `x` cast to its dtype (dynamic_update_slice: in place where
    `buf` is donated or a loop carry). None leaves stay None."""
    return jax.tree.map(lambda b, v: None if b is None else jax.lax.dynamic_update_slice_in_dim(
        b, v.astype(b.dtype), j * per, axis=0), buf, x, is_leaf=is_none)


def _write_in_place(buf, x, s, kind: str, pieces: int):
    """Device array `x` written into the donated host buffer `buf` (sharding `s`) by
    dynamic_update_slice, in `pieces` slices along its longest unsharded axis.

    Why: a device->host copy into a fresh pinned output ran at 4.1 GB/s on an H200, into a donated
    buffer by dynamic_update_slice (or in pieces) at 55 GB/s (issue #18). One full-size
    dynamic_update_slice would be simplified by XLA into the update itself (a fresh output), hence
    at least two pieces. A leaf with no unsharded axis of `pieces` elements (biases, counts) is
    small and is moved whole."""
    spec = tuple(s.spec) + (None,) * (x.ndim - len(tuple(s.spec)))
    axes = [a for a in range(x.ndim) if spec[a] is None and x.shape[a] >= pieces]
    host = s.with_memory_kind(kind)
    if pieces < 2 or not axes:
        return jax.device_put(x, host)
    ax = max(axes, key=lambda a: x.shape[a])
    bounds = [x.shape[ax] * i // pieces for i in range(pieces + 1)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = jax.device_put(jax.lax.slice_in_dim(x, lo, hi, axis=ax), host)
        buf = jax.lax.dynamic_update_slice_in_dim(buf, part, lo, axis=ax)
    return buf


def _loop_update(tx, cs, gs, ms, ss, cps, m_shs, s_shs, *, kind, compute_dtype, skip, grad_scale,
                 compute_kind):
    """Loop chunks `cs` (lists, one entry per chunk, all with the same `loop`): one fori_loop over
    the groups; iteration j takes group j of every chunk, carrying the stored arrays (master,
    state, compute copy) and writing each group back where it was read (in place). The chunks'
    chains are independent, so XLA may overlap one chunk's write-back with another's read.

    State leaves with the chunk's leading layers dim are sliced per group; the others (counts)
    are read from the step's input by every group, so each group sees the same count."""
    loops = {c.loop for c in cs}
    if len(loops) != 1:
        raise ValueError(f"loop chunks updated together need the same group count; got {sorted(loops)}")
    plans = []
    for c, s, m_sh, s_sh in zip(cs, ss, m_shs, s_shs):
        n = c.hi - c.lo
        per = n // c.loop
        s_leaves, s_def = jax.tree.flatten(s)
        stacked = [x.ndim >= 1 and x.shape[0] == n for x in s_leaves]
        s_dev = [_slice_sharding(x, per) if f else x for x, f in zip(s_def.flatten_up_to(s_sh), stacked)]
        plans.append((per, s_leaves, s_def, stacked, s_dev, _group_shardings(m_sh, per)))

    def one(j, plan, g, carry):
        per, s_leaves, s_def, stacked, s_dev, m_dev = plan
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, j * per, per, axis=0)  # noqa: E731
        put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, j * per, axis=0)  # noqa: E731
        m, s_l, cp = carry
        mm = _to(_group(m, j, per), m_dev, DEVICE)
        st = [sl(x) if f else x0 for x, x0, f in zip(s_l, s_leaves, stacked)]
        st = jax.device_put(st, [x.with_memory_kind(DEVICE) for x in s_dev])
        gg = _grads_in(_group(g, j, per), m_dev)
        mm, st, cc = _apply(tx, gg, s_def.unflatten(st), mm, compute_dtype, skip, grad_scale)
        mm = _to(mm, m_dev, kind)
        st = jax.device_put(jax.tree.leaves(st), [x.with_memory_kind(kind) for x in s_dev])
        if compute_kind is not None:
            cc = _to(cc, m_dev, compute_kind)
        m = _put_group(m, mm, j, per)
        s_l = [put(b, x) if f else x for b, x, f in zip(s_l, st, stacked)]
        cp = _put_group(cp, cc, j, per)
        return m, s_l, cp

    def body(j, carries):
        return tuple(one(j, p, g, c) for p, g, c in zip(plans, gs, carries))

    init = tuple((m, p[1], cp) for m, p, cp in zip(ms, plans, cps))
    out = jax.lax.fori_loop(0, cs[0].loop, body, init)
    return [(m, p[2].unflatten(s_l), cp) for (m, s_l, cp), p in zip(out, plans)]


def _empty_like(m, m_sh, compute_dtype, compute_kind):
    """A compute-copy buffer for a loop chunk when no previous compute params are given."""
    z = jax.tree.map(lambda x: None if x is None else jnp.zeros(x.shape, compute_dtype), m, is_leaf=is_none)
    if compute_kind is not None:
        return _to(z, m_sh, compute_kind)
    return jax.tree.map(lambda x, s: None if x is None else jax.lax.with_sharding_constraint(
        x, NamedSharding(s.mesh, s.spec)), z, m_sh, is_leaf=is_none)


def _paired_update(tx, gs, ms, ss, m_shs, s_shs, *, kind, compute_dtype, skip, grad_scale):
    """Loop chunks of one group each, updated one after another in an unrolled loop, each chunk's
    stored arrays read whole into the device and written whole back (into its donated buffers).
    Chunk i+1's read is gated on chunk i's update by an optimization barrier, so XLA issues it
    beside chunk i's write-back: a pair of whole-array copies, one each way, which can run at
    once (pcie_probe.py: 51 GB/s each way), where a slice read of a stacked host buffer and a
    slice write run one after the other on the compute stream (d2h_loop_probe.py: 27 GB/s each
    way, issue #18). Device memory holds about two chunks' state. -> [(master, state, compute
    copy)] per chunk; the compute copies are new device arrays (joined by `from_chunks`)."""
    def read(m, s_leaves, m_sh, s_sh):
        return _to(m, m_sh, DEVICE), jax.device_put(s_leaves, [x.with_memory_kind(DEVICE) for x in s_sh])

    def write(mm, st, m_sh, s_sh):
        return _to(mm, m_sh, kind), jax.device_put(jax.tree.leaves(st), [x.with_memory_kind(kind) for x in s_sh])

    flat = [jax.tree.flatten(s) for s in ss]
    s_shs = [s_def.flatten_up_to(sh) for (_, s_def), sh in zip(flat, s_shs)]
    out = []
    cur = read(ms[0], flat[0][0], m_shs[0], s_shs[0])
    for i, (g, m_sh, s_sh, (_, s_def)) in enumerate(zip(gs, m_shs, s_shs, flat)):
        mm, st, cc = _apply(tx, _grads_in(g, m_sh), s_def.unflatten(cur[1]), cur[0], compute_dtype, skip, grad_scale)
        if i + 1 < len(ms):
            # the next chunk's read waits for this update (so it is issued beside its write-back),
            # and the next update waits for both copies of the pair: 48 GB/s each way in
            # d2h_loop_probe.py ("gated2"), against 32 with the first barrier alone ("gated")
            (m_next, s_next), (mm, st) = jax.lax.optimization_barrier(((ms[i + 1], flat[i + 1][0]), (mm, st)))
            back, cur = jax.lax.optimization_barrier((write(mm, st, m_sh, s_sh),
                                                      read(m_next, s_next, m_shs[i + 1], s_shs[i + 1])))
        else:
            back = write(mm, st, m_sh, s_sh)
        out.append((back[0], s_def.unflatten(back[1]), cc))
    return out


def _all_loops(tx, loops, layout, g_chunks, state, off, init_chunks, out_c, out_m, out_s, *, compute_dtype,
               skip, grad_scale, compute_kind, loop="in_place"):
    """The loop chunks (indices `loops`) updated together by `_loop_update`, or (loop "paired",
    one group a chunk, compute copies on the device) by `_paired_update`; results into out_*."""
    pick = lambda xs: [xs[i] for i in loops]  # noqa: E731
    kw = dict(kind=off.kind, compute_dtype=compute_dtype, skip=skip, grad_scale=grad_scale)
    if loop == "paired" and compute_kind is None and all(layout.chunks[i].loop == 1 for i in loops):
        done = _paired_update(tx, pick(g_chunks), pick(state.master), pick(state.opt_state),
                              pick(off.master_shardings), pick(off.state_shardings), **kw)
    else:
        cps = [init_chunks[i] if init_chunks is not None
               else _empty_like(state.master[i], off.master_shardings[i], compute_dtype, compute_kind)
               for i in loops]
        done = _loop_update(tx, pick(layout.chunks), pick(g_chunks), pick(state.master), pick(state.opt_state),
                            cps, pick(off.master_shardings), pick(off.state_shardings), compute_kind=compute_kind, **kw)
    for i, (m, s, cp) in zip(loops, done):
        out_m[i], out_s[i], out_c[i] = m, s, cp


def streamed_update(tx, grads, state: OffloadState, off: OffloadLayout, *,
                    compute_dtype=jnp.bfloat16, skip=None, grad_scale=None, compute_kind=None,
                    compute_init=None, write_pieces: int = 0, nvme=None, loop: str = "in_place"):
    """One optimizer step over offloaded chunks; call inside the step's jit.

    tx: an elementwise optax transform (no global-norm clipping inside: clip `grads` before).
    grads: fp32 gradients, params-shaped, on device (or host-resident, see `fetch`).
    skip: optional bool scalar (e.g. fp16 overflow): when True master and state stay as they were.
    grad_scale: optional fp32 scalar multiplied into each gradient chunk once it is on the device
        (1 / loss scale x clip coefficient: host-resident gradients are never computed on in place).
    compute_kind: None (compute params returned in device memory) or a host kind: each chunk's
        compute copy is sent there as soon as it is made (stage 3 `offload_param`).
    compute_init: the previous compute params (params-shaped, donated by the caller): a "loop"
        chunk writes its new compute copy into them in place.
    write_pieces: 0 = a host chunk updated whole (the non-layer leaves) is returned as a new host
        array; >= 2 = written into its donated host buffer in that many pieces (`_write_in_place`).
    nvme: an `nvme_tier.NvmeTier`: its loop chunk's master and moments live in swap files
        (`nvme_loop_update`); the state holds None there.
    loop: how the loop chunks are updated (EngineOptions.offload_loop): "in_place" (`_loop_update`)
        or "paired" (`_paired_update`: needs one group a loop chunk, `chunk_layout(streams=0)`,
        and compute copies on the device; elsewhere "in_place" runs). "host" runs outside the
        jit: `deferred_update` here, then `offload.host_loop.HostLoop`.
    -> (compute params tree in `compute_dtype`, new OffloadState in place).
    """
    if loop not in OFFLOAD_LOOPS or loop == "host":
        raise ValueError(f"streamed_update(loop={loop!r}): one of {[x for x in OFFLOAD_LOOPS if x != 'host']} "
                         "(EngineOptions.offload_loop; \"host\" is deferred_update + offload.host_loop)")
    out_c, out_m, out_s = _update_chunks(
        tx, grads, state, off, compute_dtype=compute_dtype, skip=skip, grad_scale=grad_scale,
        compute_kind=compute_kind, compute_init=compute_init, write_pieces=write_pieces, nvme=nvme, loop=loop)
    return from_chunks(out_c, off.layout), OffloadState(out_m, out_s)


def deferred_update(tx, grads, state: OffloadState, off: OffloadLayout, *, compute_dtype=jnp.bfloat16,
                    skip=None, grad_scale=None):
    """`streamed_update` without the host chunks (EngineOptions.offload_loop="host"; call inside the
    step's jit): the device chunk (offload_optimizer.ratio < 1) is updated; the host chunks' master
    and state are not read (the caller passes None there; they come out as given) and are left,
    with the whole gradients (cut per chunk there: cutting them here would copy them all), to
    `offload.host_loop.HostLoop`, which updates them a chunk at a time from Python (the runtime's
    transfers run both ways at once; XLA's inside one program ran them one after the other,
    docs/offload-transfers.md). -> (compute chunks: a list with None at the host chunks, OffloadState)."""
    out_c, out_m, out_s = _update_chunks(tx, grads, state, off, compute_dtype=compute_dtype, skip=skip,
                                         grad_scale=grad_scale, loop="host")
    return out_c, OffloadState(out_m, out_s)


def _update_chunks(tx, grads, state: OffloadState, off: OffloadLayout, *, compute_dtype, skip, grad_scale,
                   compute_kind=None, compute_init=None, write_pieces: int = 0, nvme=None, loop: str = "in_place"):
    """The body of `streamed_update` / `deferred_update` (loop "host": the host chunks passed
    through untouched) -> (compute chunks, master chunks, state chunks)."""
    layout = off.layout
    g_chunks = to_chunks(grads, layout)
    init_chunks = to_chunks(compute_init, layout) if compute_init is not None else None
    n = len(layout.chunks)
    out_c, out_m, out_s = [None] * n, [None] * n, [None] * n
    loops = [i for i, c in enumerate(layout.chunks) if c.loop and (nvme is None or i != nvme.chunk)]
    for i, (c, g, m, s) in enumerate(zip(layout.chunks, g_chunks, state.master, state.opt_state)):
        if nvme is not None and i == nvme.chunk:  # the NVMe tier's loop chunk: its own loop over the files
            cp0 = (init_chunks[i] if init_chunks is not None
                   else _empty_like(nvme.m_template, off.master_shardings[i], compute_dtype, compute_kind))
            s, cp = nvme.loop_update(tx, g, s, cp0, compute_dtype=compute_dtype, skip=skip,
                                     grad_scale=grad_scale, compute_kind=compute_kind)
            out_c[i], out_m[i], out_s[i] = cp, m, s
            continue
        if c.host and loop == "host":  # left to offload.host_loop (the non-layer chunk too)
            out_m[i], out_s[i] = m, s
            continue
        if c.loop:
            if i == loops[0]:  # every loop chunk in one fori_loop, traced where the first one is
                _all_loops(tx, loops, layout, g_chunks, state, off, init_chunks, out_c, out_m, out_s,
                           compute_dtype=compute_dtype, skip=skip, grad_scale=grad_scale,
                           compute_kind=compute_kind, loop=loop)
            continue
        # the whole chunk at once (the rest leaves; the device chunk, with no transfer)
        m_sh, s_sh = off.master_shardings[i], off.state_shardings[i]
        m0, s0 = m, s
        if c.host:
            m, s = _to(m, m_sh, DEVICE), _to(s, s_sh, DEVICE)
        m, s, cp = _apply(tx, _grads_in(g, m_sh), s, m, compute_dtype, skip, grad_scale)
        if c.host and write_pieces >= 2:
            back = lambda b, x, sh: None if b is None else _write_in_place(b, x, sh, off.kind, write_pieces)  # noqa: E731
            m = jax.tree.map(back, m0, m, m_sh, is_leaf=is_none)
            s = jax.tree.map(back, s0, s, s_sh, is_leaf=is_none)
        elif c.host:
            m, s = _to(m, m_sh, off.kind), _to(s, s_sh, off.kind)
        if compute_kind is not None:
            cp = _to(cp, m_sh, compute_kind)
        out_c[i], out_m[i], out_s[i] = cp, m, s
    return out_c, out_m, out_s


def grad_stats(grads, off: OffloadLayout):
    """(sum of squares in fp32, all finite) of a params-shaped gradient tree, chunk by chunk.

    Host-resident leaves (offload_param's gradients) are brought to the device one chunk of the
    layout at a time, reduced there and dropped: nothing is computed in host memory.
    """
    def stats(g, m_sh, acc):
        total, finite = acc
        for x in jax.tree.leaves(_grads_in(g, m_sh)):
            x = x.astype(jnp.float32)
            total = total + jnp.sum(jnp.square(x))
            finite = finite & jnp.all(jnp.isfinite(x))
        return total, finite

    acc = (jnp.float32(0.0), jnp.asarray(True))
    for c, g, m_sh in zip(off.layout.chunks, to_chunks(grads, off.layout), off.master_shardings):
        if c.loop:  # one group of layers on the device at a time, as the update does
            per = (c.hi - c.lo) // c.loop
            dev = _group_shardings(m_sh, per)
            acc = jax.lax.fori_loop(0, c.loop, lambda j, a, g=g, dev=dev, per=per: stats(
                _group(g, j, per), dev, a), acc)
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
            dev = _group_shardings(m_sh, per)

            def body(j, a, g=g, dev=dev, per=per):
                aa = _to(_group(a, j, per), dev, DEVICE)
                new = _to(jax.tree.map(add, aa, _grads_in(_group(g, j, per), dev), is_leaf=is_none), dev, kind)
                return _put_group(a, new, j, per)

            out.append(jax.lax.fori_loop(0, c.loop, body, a))
        else:  # the non-layer leaves (or a device chunk): whole
            out.append(_to(jax.tree.map(add, _to(a, m_sh, DEVICE), _grads_in(g, m_sh), is_leaf=is_none), m_sh, kind))
    return from_chunks(out, off.layout)
