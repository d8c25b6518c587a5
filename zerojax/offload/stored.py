"""The stored (layout-free) form of a host-offloaded state, read a layer group at a time.

Why: a checkpoint stores each stacked [L, ...] leaf whole (`merge_chunks`' form). Handed to orbax,
a host-resident leaf is copied whole into numpy first, and orbax holds many such copies at once:
saving the CPU-offloaded state of an 8B model needed its ~80 GB of host memory a second time.

What: `stored_tree` is `merge_chunks` with a `ChunkRows` in place of every leaf that has a piece in
a host chunk: the checkpoint writes it as a streamed leaf (`zerojax.checkpoint.stream`), a layer
group at a time (a leaf without layers, e.g. the embedding: a block of rows at a time), each
block's rows brought through the device into numpy (a slice of a host array can only be read by a
program, and XLA's GPU programs run on the device). With the host split of the master
(`offload.split_master`) a group's fp32 rows
are rebuilt there from its compute copy and remainder, so the fp32 master is never whole anywhere.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from zerojax.offload.chunks import Chunk, ChunkLayout, is_none, merge_chunks, slice_sharding
from zerojax.offload.memory_kinds import DEVICE, PINNED_HOST, UNPINNED_HOST
from zerojax.offload.split_master import master_of
from zerojax.streamed import StreamedLeaf


class ChunkRows(StreamedLeaf):
    """A leaf of the stored form whose rows (a stacked leaf's layers, or an embedding's rows) lie in
    chunk pieces: `parts` is [(lo, hi, per, read)], read(start) -> numpy rows lo + start .. lo +
    start + per. A checkpoint writes it with `blocks()` (`chunk_rows`: rows per file chunk);
    `row(i)` reads one row (the block holding it, the last one kept)."""

    alone = True

    def __init__(self, parts, shape, dtype, chunk_rows: int = 1):
        self.parts, self.shape, self.dtype = parts, tuple(shape), np.dtype(dtype)
        self.chunk_rows = chunk_rows
        self._last = None

    def blocks(self):
        for lo, hi, per, read in self.parts:
            for start in range(0, hi - lo, per):
                yield lo + start, lo + start + per, read(start)

    def row(self, i: int) -> np.ndarray:
        for lo, hi, per, read in self.parts:
            if lo <= i < hi:
                start = (i - lo) // per * per
                if self._last is None or self._last[0] != (lo, start):
                    self._last = ((lo, start), read(start))
                return self._last[1][i - lo - start]
        raise IndexError(f"row {i} of a leaf of {self.shape[0]} rows")

    def __array__(self, dtype=None, copy=None):
        """The whole leaf (a writer that takes arrays only), assembled a layer group at a time."""
        out = np.empty(self.shape, dtype or self.dtype)
        for lo, hi, rows in self.blocks():
            out[lo:hi] = rows
        return out

    def fill(self, read):
        raise NotImplementedError("ChunkRows is written by a checkpoint, not restored into")


@functools.cache
def _rows_program(per: int, sharding):
    """rows(x, start): `per` rows of the chunk piece x from `start`, on the device."""
    dev = slice_sharding(sharding, per).with_memory_kind(DEVICE)
    # sliced where it lies, then moved: only the rows cross to the device
    return jax.jit(lambda x, start: jax.device_put(jax.lax.dynamic_slice_in_dim(x, start, per, axis=0), dev),
                   out_shardings=dev)


@functools.cache
def _master_rows_program(per: int, sharding):
    """rows(rem, compute, start, at): the fp32 master of `per` rows, rebuilt on the device from the
    remainder piece's rows from `start` and the compute params' rows from `at`."""
    dev = slice_sharding(sharding, per).with_memory_kind(DEVICE)

    def rows(rem, compute, start, at):
        r = jax.device_put(jax.lax.dynamic_slice_in_dim(rem, start, per, axis=0), dev)
        c = jax.device_put(jax.lax.dynamic_slice_in_dim(compute, at, per, axis=0), dev)
        return master_of(c, r)
    return jax.jit(rows, out_shardings=dev)


def _reader(x, c, per, compute):
    """read(start) of chunk `c`'s piece x: its rows, or with `compute` (the remainder's compute
    params leaf, unchunked) the fp32 master rebuilt from both."""
    if compute is None:
        prog = _rows_program(per, x.sharding)
        return lambda start: np.asarray(prog(x, start))
    prog = _master_rows_program(per, x.sharding)
    return lambda start: np.asarray(prog(x, compute, start, c.lo + start))


BLOCK_BYTES = 256 * 2**20   # a block of a leaf without layers, read and written at a time


def rows_per_block(x, block_bytes: int | None = None) -> int:
    """The most rows of x (a leaf without layers, e.g. an embedding) within block_bytes (default
    BLOCK_BYTES) that divide its row count (every block the same shape: one program reads them all)."""
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    n = int(x.shape[0])
    row = max(1, int(np.prod(x.shape[1:], dtype=np.int64)) * np.dtype(x.dtype).itemsize)
    return next(n // d for d in range(1, n + 1) if n % d == 0 and (n // d) * row <= block_bytes or d == n)


def stored_tree(trees, layout: ChunkLayout, *, split_compute=None, dtype=np.float32):
    """`merge_chunks(trees, layout)` with a `ChunkRows` for each leaf a host chunk holds a piece of:
    a stacked leaf read a layer group at a time (the chunk's loop groups, one layer a group where
    it has none), a leaf of the host rest chunk (embeddings, the head) a block of rows at a time
    (`rows_per_block`); the other leaves merged as there. split_compute: the compute params
    (unchunked) where the host chunks of `trees` (the master) hold the host split's int16
    remainders: their rows are rebuilt as the fp32 master (`dtype`), a scalar whole."""
    flat = [jax.tree.flatten(t, is_leaf=is_none) for t in trees]
    treedef = flat[0][1]
    c_leaves = jax.tree.leaves(split_compute) if split_compute is not None else None
    rows = {}
    for i in range(treedef.num_leaves):
        parts = [(c, xs[i]) for c, (xs, _) in zip(layout.chunks, flat) if xs[i] is not None]
        split = [c_leaves is not None and c.host and x.dtype == np.int16 for c, x in parts]
        if any(x.ndim == 0 for _, x in parts) or not any(c.host for c, _ in parts):
            if any(split):  # a split scalar (the leaves with rows are rebuilt below, a block at a time)
                (c, x), = parts
                rows[i] = np.asarray(jax.jit(master_of)(np.asarray(c_leaves[i]), np.asarray(x)))
            continue
        pieces, chunk_rows = [], 1
        for (c, x), s in zip(parts, split):
            if c.rest:  # not stacked: its one piece, a block of rows at a time
                per = chunk_rows = rows_per_block(x)
                pieces.append((0, x.shape[0], per, _reader(x, c, per, c_leaves[i] if s else None)))
            else:
                per = (c.hi - c.lo) // max(c.loop, 1)
                pieces.append((c.lo, c.hi, per, _reader(x, c, per, c_leaves[i] if s else None)))
        shape = parts[0][1].shape if parts[0][0].rest else (layout.num_layers, *parts[0][1].shape[1:])
        rows[i] = ChunkRows(pieces, shape, dtype if any(split) else parts[0][1].dtype, chunk_rows)
    merged = jax.tree.flatten(merge_chunks(
        [treedef.unflatten([None if i in rows else x for i, x in enumerate(xs)]) for xs, _ in flat], layout),
        is_leaf=is_none)[0]
    return treedef.unflatten([rows.get(i, x) for i, x in enumerate(merged)])


def stored_params(params, layout: ChunkLayout):
    """`params` with a `ChunkRows` for each stacked leaf (in host memory under offload_param, else on
    the device: either way never copied whole into host memory), read as many layers at a time as
    the host layer chunk's groups hold, and for each other leaf with rows in host memory (the
    embeddings under offload_param), read a block of rows at a time; the rest as they are."""
    leaves, treedef = jax.tree.flatten(params)
    if len(leaves) != len(layout.stacked):
        return params
    loops = [c for c in layout.chunks if c.host and not c.rest]
    per = (loops[0].hi - loops[0].lo) // max(loops[0].loop, 1) if loops else 1
    per = per if layout.num_layers % per == 0 else 1
    c, rest = Chunk(rest=False, lo=0, hi=layout.num_layers), Chunk(rest=True, lo=0, hi=0)

    def stored(x, stacked):
        if stacked and x.shape[:1] == (c.hi,):
            return ChunkRows([(0, c.hi, per, _reader(x, c, per, None))], x.shape, x.dtype)
        if x.ndim and getattr(x.sharding, "memory_kind", None) in (PINNED_HOST, UNPINNED_HOST):
            block = rows_per_block(x)
            return ChunkRows([(0, x.shape[0], block, _reader(x, rest, block, None))], x.shape, x.dtype, block)
        return x
    return treedef.unflatten([stored(x, st) for x, st in zip(leaves, layout.stacked)])


__all__ = ["ChunkRows", "stored_tree", "stored_params"]
