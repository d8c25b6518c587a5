"""An offloaded fp32 master kept as the device's bf16 compute copy plus a 16-bit remainder in host
memory (`EngineOptions.split_master`: on by default with `offload_loop="host"` and bf16 compute;
GPT-2 Large on one H200: 36.2k tokens/s at 8.8 GiB against 31.5k at 9.5), or on the device
without offload (`split_master="on"`).

Why: full optimizer offload moves the master and Adam's moments through PCIe both ways every step
and its step is bound by those transfers (a timeline of GPT-2 Large: the device-to-host
write-backs, one after the other at ~53 GB/s). The device holds the master rounded to bf16 anyway
(the compute params); what the master has beyond that fits in 16 bits, so the host keeps those
instead of all 32: 8 bytes a parameter cross each way instead of 10 with the bf16 first moment (10
instead of 12 with the fp32 one), and the host holds 2 bytes less a parameter.

Exact: the remainder is the difference of the bit patterns, bits(master) - bits(copy) << 16, an
integer in [-32768, 32768] when the copy is the master rounded to nearest (both have the same sign
and, but for the low 16 bits, the same bits). The one value int16 lacks, +32768, is an exact tie
that rounded down to an even copy; it is stored as 32767, which moves that weight by one fp32 ulp
(2^-24 of it): a tie has probability 2^-16 per weight and step. A master a backend flushes to a zero
copy (an fp32 denormal) is clipped the same way.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.offload.chunks import dynamic_piece, group, group_shardings, is_none, put_group, to_kind
from zerojax.offload.memory_kinds import DEVICE, host_zeros, to_device, with_memory_kind


def _high_bits(compute):
    """The bf16 copy's bit pattern as the top half of an int32."""
    bits = jax.lax.bitcast_convert_type(compute.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(jax.lax.shift_left(bits, jnp.uint32(16)), jnp.int32)


def remainder(master, compute):
    """int16: what fp32 `master` holds beyond its bf16 copy `compute` (`master.astype(bfloat16)`)."""
    diff = jax.lax.bitcast_convert_type(master.astype(jnp.float32), jnp.int32) - _high_bits(compute)
    return jnp.clip(diff, -32768, 32767).astype(jnp.int16)


def master_of(compute, rem):
    """The fp32 master from its bf16 copy and `remainder` (the inverse of `remainder`)."""
    return jax.lax.bitcast_convert_type(_high_bits(compute) + rem.astype(jnp.int32), jnp.float32)


def remainders(master, compute):
    """`remainder` leaf by leaf (None leaves stay None)."""
    return jax.tree.map(lambda m, c: None if m is None else remainder(m, c), master, compute, is_leaf=is_none)


def masters(compute, rems):
    """`master_of` leaf by leaf (None leaves stay None)."""
    return jax.tree.map(lambda c, r: None if r is None else master_of(c, r), compute, rems, is_leaf=is_none)


def convert(master: list, params, off, indices, *, to_split: bool, cache: dict | None = None,
            consume: bool = False) -> list:
    """`master` (a per-chunk list) with the chunks at `indices` turned into remainders against the
    compute `params` (`to_split`), or back into fp32 master chunks; each stays in its memory kind.
    One jitted program per chunk shape (kept in `cache` across calls), so the device holds one
    chunk's fp32 master at a time. consume: the list `master` itself is updated, a few leaves at a
    time (`CONSUME_BYTES` of them; each batch's old form dropped as its new one is made: host memory
    holds the chunk in both forms a batch at a time, not whole; one program per batch, a small
    chunk one batch), and returned."""
    cache = {} if cache is None else cache
    stacked = off.layout.treedef.unflatten(off.layout.stacked)
    out = master if consume else list(master)
    for i in indices:
        c = off.layout.chunks[i]
        groups = 1 if c.rest else c.loop

        def run(tree, leaves=None, c=c, i=i, groups=groups):
            key = (c.rest, c.hi - c.lo, groups, to_split, leaves)  # as HostLoop's programs: layer groups share one
            if key not in cache:
                cache[key] = _converter(stacked, c.rest, c.hi - c.lo, groups, to_split, off.master_shardings[i])
            return cache[key](tree, params, c.lo)

        if not consume:
            out[i] = run(master[i])
            continue
        leaves, treedef = jax.tree.flatten(out[i], is_leaf=is_none)
        out[i] = None
        for batch in _batches(leaves, CONSUME_BYTES):
            part = treedef.unflatten([x if j in batch else None for j, x in enumerate(leaves)])
            for k in batch:
                leaves[k] = None
            new = jax.tree.flatten(run(part, leaves=batch), is_leaf=is_none)[0]
            del part
            for k in batch:
                leaves[k] = new[k]
        out[i] = treedef.unflatten(leaves)
    return out


CONSUME_BYTES = 256 * 2**20   # a consuming conversion's batch of leaves (a small chunk: one batch)


def _batches(leaves, limit: int) -> list[tuple[int, ...]]:
    """The indices of the non-None `leaves` in order, in runs of at most `limit` bytes (a leaf
    above it alone)."""
    out, run, size = [], [], 0
    for k, x in enumerate(leaves):
        if x is None:
            continue
        b = x.size * x.dtype.itemsize
        if run and size + b > limit:
            out.append(tuple(run))
            run, size = [], 0
        run.append(k)
        size += b
    return out + [tuple(run)] if run else out


def _converter(stacked, rest, n, groups, to_split, shardings):
    """The conversion of one chunk of `n` layers (the non-layer chunk: `rest`) in `groups` layer
    groups: a loop chunk (offload_loop "in_place": every host layer in one chunk) is converted a
    group at a time on the device, each group written into a new host buffer in place, so the
    device never holds more than one group's fp32 master (a whole chunk is 32 GB at 8B)."""
    if groups <= 1:
        dev = with_memory_kind(shardings, DEVICE)

        def run(m, params, lo):
            m = jax.device_put(m, dev)
            # (offload_param: the compute params are host-resident; the arithmetic runs on the device)
            piece = to_device(dynamic_piece(params, stacked, rest, n, lo))
            return remainders(m, piece) if to_split else masters(piece, m)
        return jax.jit(run, out_shardings=shardings)

    per = n // groups
    g_sh = group_shardings(shardings, per)
    dtype = jnp.int16 if to_split else jnp.float32

    def body(m, params, lo, j, out):
        mj = to_kind(group(m, j, per), g_sh, DEVICE)
        piece = to_device(dynamic_piece(params, stacked, False, per, lo + j * per))
        r = remainders(mj, piece) if to_split else masters(piece, mj)
        return put_group(out, jax.device_put(r, g_sh), j, per)  # (g_sh: the chunk's host memory kind)

    loop = jax.jit(lambda m, params, lo, out: jax.lax.fori_loop(
        0, groups, lambda j, o: body(m, params, lo, j, o), out), out_shardings=shardings, donate_argnums=3)

    def run(m, params, lo):
        # the new buffer made in host memory directly (zeros built on the device would need the
        # whole chunk there)
        out = jax.tree.map(lambda x, s: None if x is None else host_zeros(x.shape, dtype, s),
                           m, shardings, is_leaf=is_none)
        return loop(m, params, lo, out)
    run.loop = loop  # (the jitted loop over the groups, out the donated new buffer: for inspection)
    return run
