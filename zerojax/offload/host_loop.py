"""The offloaded optimizer update driven from Python (EngineOptions.offload_loop="host").

Why outside the step's jit: inside one XLA program the reads of the host state and the write-backs
ran one after the other on an H200, at 25-27 GB/s each way, whatever the loop's form, while the
runtime's own transfers (`jax.device_put` between memory kinds, issued from Python) ran both ways
at once: GPT-2 Large's 36 layers of fp32 master + Adam moments (8.5 GB each way) took 334 ms in
one jitted program and 249 ms driven from Python, one batched `device_put` per layer group each way.

The step's jit (`offload.update.deferred_update`) updates the device chunk, if any, and hands over
the gradients with the step's skip flag and gradient factor; `HostLoop` then, for the non-layer
chunk and each layer group: brings its master and optimizer state to the device, runs the same
`apply_chunk` as the in-jit loop (one compiled program for every layer group), writes the new compute
copy into the step's input params in place, and sends the new state back to host memory. JAX
dispatches all of it asynchronously; Python waits only to keep `window` chunks in flight.

Where the transfers can overlap compute: the runtime starts a transfer dispatched after a jitted
program only once that program is done (measured on an H200: 2.15 GB
each way dispatched after a 98 ms program took 148 ms in all, dispatched before it 100 ms). So the
first `prefetch` chunks' state is brought in before the step's jit is dispatched
(`HostLoop.prefetch`): those reads run during the forward / backward; the last chunks' write-backs
likewise run during the next step's jit, which is dispatched after them. Inside the loop the next
chunk's read is dispatched before this chunk's update, so the link need not wait for the update.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from zerojax.offload.chunks import OffloadLayout, dynamic_piece, is_none
from zerojax.offload.memory_kinds import DEVICE, with_memory_kind
from zerojax.offload.split_master import masters, remainders
from zerojax.offload.update import apply_chunk


class HostLoop:
    """Updates the host chunks of an offloaded state (the non-layer chunk and each layer group),
    one chunk at a time.

    off: the state's OffloadLayout (one chunk per layer group: `chunk_layout(per_group=True)`).
    tx: the bare elementwise optimizer (`StepSettings.offload.tx`).
    params_shardings: the compute params' shardings (the stage's).
    window: chunks in flight. Before chunk j is brought in, chunk j - window's new state must be
        back in host memory (Python waits for it), so the loop holds at most window + 1 chunks'
        state on the device besides the params and gradients (`device_bytes`); 0 = no wait. The
        last `window` chunks' write-backs overlap the next step's jit.
    prefetch: chunks whose state `prefetch()` brings to the device before the step's jit is
        dispatched (their reads overlap the forward / backward; they sit on the device beside the
        jit's own buffers). The first chunks, not the last: prefetching the last measured no faster
        for more memory.
    split_master: the host chunks' master is stored as int16 remainders against the compute
        params (`offload.split_master`): each chunk's update rebuilds the fp32 master from them and
        the params it cuts its piece from, and stores the new remainders."""

    def __init__(self, off: OffloadLayout, tx, *, compute_dtype, params_shardings, window: int = 2,
                 prefetch: int = 0, split_master: bool = False):
        self.off, self.window, self.prefetch_chunks = off, int(window), int(prefetch)
        self.split_master = bool(split_master)
        self.loops = [i for i, c in enumerate(off.layout.chunks) if c.host]
        if any(c.loop > 1 for c in off.layout.chunks if c.host):
            raise ValueError("offload_loop='host' needs one layer group a chunk (chunk_layout(per_group=True))")
        self._dev = {i: (with_memory_kind(off.master_shardings[i], DEVICE),
                         with_memory_kind(off.state_shardings[i], DEVICE)) for i in self.loops}
        self._host = {i: (with_memory_kind(off.master_shardings[i], off.kind),
                          with_memory_kind(off.state_shardings[i], off.kind)) for i in self.loops}
        self._stacked = off.layout.treedef.unflatten(off.layout.stacked)
        self._params_shardings = params_shardings
        self._programs: dict = {}
        self._put = jax.jit(functools.partial(_put_compute, self._stacked), donate_argnums=0,
                            out_shardings=params_shardings)
        self._tx, self._compute_dtype = tx, compute_dtype

    def _program(self, chunk):
        """The update of one chunk kind: the non-layer chunk, or a layer group of `hi - lo` layers
        (its first layer an argument: one program for every group). Its device copies and the
        params are donated: the new state takes their buffers, and the new compute copy is written
        into the params in place (dynamic_update_slice on their layer axis). The gradients are
        read, not donated: every chunk cuts its own piece out of them."""
        key = (chunk.rest, chunk.hi - chunk.lo)
        if key not in self._programs:
            self._programs[key] = jax.jit(
                functools.partial(_update_into, self._tx, self._compute_dtype, self._stacked, self.split_master,
                                  *key),
                donate_argnums=(1, 2, 5), out_shardings=(None, None, self._params_shardings))
        return self._programs[key]

    def _bring(self, n: int, master: list, opt_state: list):
        """Dispatch the read of the n-th host chunk's state to the device (after waiting, with a
        window, for chunk n - window's new state to be back in host memory)."""
        if self.window and n >= self.window:
            jax.block_until_ready(master[self.loops[n - self.window]])
        i = self.loops[n]
        m_dev, s_dev = self._dev[i]
        return jax.device_put(master[i], m_dev), jax.device_put(opt_state[i], s_dev)

    def prefetch(self, master: list, opt_state: list) -> dict:
        """Start reading the first `prefetch` chunks' state to the device; call before dispatching
        the step's jit, pass the result to the call after it. -> {n: (master, state) on the device}"""
        return {n: self._bring(n, master, opt_state) for n in range(min(self.prefetch_chunks, len(self.loops)))}

    def __call__(self, master: list, opt_state: list, compute: list, grads, skip, grad_scale, params,
                 ready: dict | None = None):
        """Update the host chunks of `master` / `opt_state` (the per-chunk host state) in place:
        each chunk's entries are replaced as soon as its new state is on its way to host memory,
        so the old host copy is freed chunk by chunk (host memory never holds the state twice).
        compute: the compute copies the step's jit made (the device chunk's; None at the host
        chunks); grads: the step's gradients, params-shaped; params: the step's input compute
        params (dead after the step's jit; donated); ready: what `prefetch` returned.
        -> the new compute params."""
        chunks = self.off.layout.chunks
        for i, cp in enumerate(compute):
            if cp is not None:
                params = self._put(params, cp, chunks[i].lo)
        on_device = dict(ready or {})
        for n, i in enumerate(self.loops):
            for k in (n, n + 1):  # this chunk's state, and the next one's read ahead of this update
                if k < len(self.loops) and k not in on_device:
                    on_device[k] = self._bring(k, master, opt_state)
            m, s = on_device.pop(n)
            m, s, params = self._program(chunks[i])(grads, m, s, skip, grad_scale, params, chunks[i].lo)
            m_host, s_host = self._host[i]
            master[i], opt_state[i] = jax.device_put(m, m_host), jax.device_put(s, s_host)
        return params

    def device_bytes(self, master: list, opt_state: list) -> tuple[int, int]:
        """Per-device bytes of host chunks' state on the device besides the step's own buffers
        (the largest chunks; every chunk with window 0) -> (during the step's jit: the prefetched
        chunks and the previous step's last `window` chunks still being written back; during the
        loop: `window` + 1 chunks). Arrays or ShapeDtypeStructs with shardings."""
        sizes = sorted((_per_device(master[i]) + _per_device(opt_state[i]) for i in self.loops), reverse=True)
        if not self.window:
            return sum(sizes), sum(sizes)
        return sum(sizes[:self.prefetch_chunks + self.window]), sum(sizes[:self.window + 1])

    def merge(self, front: list, groups: list) -> list:
        """The per-chunk list of the step's jit (`front`, None at the host chunks) with the host
        chunks taken from `groups`."""
        loops = set(self.loops)
        return [groups[i] if i in loops else x for i, x in enumerate(front)]


def _per_device(tree) -> int:
    """Bytes of one device's shards of a tree of arrays / ShapeDtypeStructs (with shardings)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def _put_compute(stacked, params, cp, lo):
    """`params` with a chunk's compute copy `cp` written in: its stacked leaves at layer `lo`, its
    non-layer leaves whole (None leaves of the chunk keep the params')."""
    def put(c, p, st):
        if c is None:
            return p
        c = c.astype(p.dtype)
        return jax.lax.dynamic_update_slice_in_dim(p, c, lo, axis=0) if st else c
    return jax.tree.map(put, cp, params, stacked, is_leaf=is_none)


def _update_into(tx, compute_dtype, stacked, split, rest, per, grads, m, s, skip, grad_scale, params, lo):
    g = dynamic_piece(grads, stacked, rest, per, lo)
    if split:  # m holds remainders: the master is the compute copy (in params) and them
        m = masters(dynamic_piece(params, stacked, rest, per, lo), m)
    m, s, cp = apply_chunk(tx, g, s, m, compute_dtype, skip, grad_scale)
    if split:
        m = remainders(m, cp)
    return m, s, _put_compute(stacked, params, cp, lo)
