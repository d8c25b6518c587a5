"""Stacked leaves a checkpoint writes and reads a block of layers at a time, never whole in host memory.

Why: an NVMe-offloaded run's layer state lives in swap files because it does not fit host memory
(zerojax/offload/nvme/swapper.py); orbax saves a jax.Array whole (it copies the array to host memory first),
so a checkpoint that went through orbax would need host memory for the whole state once more.

What: a `StreamedLeaf` stands in a checkpoint's tree for such a stacked [L, ...] leaf. On save,
`save` (zerojax/checkpoint/state.py) puts None in orbax's tree there and hands the leaves to the
`streamed` item: `StreamedHandler`, an orbax handler, so each leaf is written inside orbax's tmp
directory and orbax's atomic finalize covers it. Each leaf is a zarr array (tensorstore, orbax's own
I/O library) with one layer per chunk, uncompressed: `blocks()` yields the leaf's rows a layer group
at a time and each block is written as its own chunks. On restore the reader reads any rows [lo, hi)
of it by reading those chunks only: into the swap files a group at a time (`StreamedLeaf.fill`), or
into a jax.Array of any sharding (`read_array`: a run resumed with CPU offload or none, another mesh).

The checkpoint stays layout-free: the leaves have the shapes and dtypes (the manifest) a run without
NVMe saves; only where their bytes lie differs (the metadata's "streamed" record names them).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from zerojax.checkpoint.finite import check_block
from zerojax.streamed import StreamedLeaf, is_streamed  # noqa: F401 (read here by checkpoint/state.py)

ITEM = "streamed"   # the orbax item (a folder of the tag) holding the streamed leaves


def leaf_file(item: str, index: int) -> str:
    """The folder name of an item's streamed leaf number `index` (its flat index in the item's tree)."""
    return f"{item}.{index}"


def _spec(path: str) -> dict:
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": os.fspath(path)}}


def write_leaf(path: str, leaf: StreamedLeaf) -> None:
    """`leaf` as a zarr array at `path`, one block at a time (one block's write in flight while the next
    is read); `leaf.chunk_rows` rows per chunk (a layer: a reader reads any layer range alone)."""
    shape = [int(d) for d in leaf.shape]
    chunks = [int(leaf.chunk_rows)] + shape[1:]
    store = ts.open({**_spec(path), "metadata": {"shape": shape, "chunks": chunks, "compressor": None,
                                                 "dtype": _zarr_dtype(leaf.dtype), "fill_value": 0},
                     # chunks of zeros are written too: a -0.0 read back as +0.0 would not be bitwise
                     "store_data_equal_to_fill_value": True}, create=True).result()
    pending, done = None, 0
    for lo, hi, rows in leaf.blocks():
        check_block(f"{os.path.basename(os.fspath(path))} rows {lo}:{hi}", rows)  # never a non-finite checkpoint
        if lo != done:
            raise ValueError(f"streamed checkpoint leaf {path!r}: blocks must cover the rows in order (got "
                             f"{lo}:{hi} after row {done})")
        fut = store[lo:hi].write(rows)
        if pending is not None:
            pending.result()
        pending, done = fut, hi
    if pending is not None:
        pending.result()
    if done != shape[0]:
        raise ValueError(f"streamed checkpoint leaf {path!r}: blocks covered {done} of {shape[0]} rows")


def _zarr_dtype(dtype) -> str:
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def open_leaf(path: str):
    """A streamed leaf for reading: index it like numpy (`store[lo:hi]`) and `.read().result()`."""
    return ts.open(_spec(path), open=True, read=True).result()


def rows_reader(store, dtype) -> Callable[[int, int], np.ndarray]:
    """read(lo, hi): rows lo:hi of a streamed leaf as numpy in `dtype` (a bf16 moment into fp32: exact)."""
    return lambda lo, hi: np.asarray(store[lo:hi].read().result(), dtype)


def read_array(store, target) -> jax.Array:
    """A streamed leaf as a jax.Array of `target` (a ShapeDtypeStruct with a sharding): each process reads
    only the slices its devices hold."""
    dtype = np.dtype(target.dtype)
    return jax.make_array_from_callback(tuple(target.shape), target.sharding,
                                        lambda idx: np.asarray(store[idx].read().result(), dtype))


# ---------------------------------------------------------------------------------------------
# the orbax item


@dataclasses.dataclass
class StreamedSave(ocp.args.CheckpointArgs):
    """Args of the `streamed` item: {folder name: StreamedLeaf}."""

    leaves: dict


class StreamedHandler(ocp.CheckpointHandler):
    """Writes each leaf into the item's folder of orbax's tmp directory (a synchronous handler: orbax runs
    it in a thread and finalizes the tag after it returns). Restore is `open_leaf` on the final folder."""

    def save(self, directory, args: StreamedSave):
        for name, leaf in args.leaves.items():
            write_leaf(os.path.join(os.fspath(directory), name), leaf)

    def restore(self, directory, args=None):
        raise NotImplementedError("streamed checkpoint leaves are read with zerojax.checkpoint.stream.open_leaf")


@dataclasses.dataclass
class StreamedRestore(ocp.args.CheckpointArgs):
    """Orbax's registry wants restore args for every handler; restoring goes through `open_leaf`."""


ocp.args.register_with_handler(StreamedHandler, for_save=True)(StreamedSave)
ocp.args.register_with_handler(StreamedHandler, for_restore=True)(StreamedRestore)


__all__ = ["ITEM", "StreamedLeaf", "StreamedSave", "StreamedHandler", "is_streamed", "leaf_file", "write_leaf",
           "open_leaf", "rows_reader", "read_array"]
