"""Which leaf of a state holds inf / NaN: the check before a checkpoint is written.

A run whose learning rate overflowed (`--lr 1e39`: inf in fp32) or whose Adam eps was 0 wrote a
checkpoint of all-NaN weights, `latest` named it, and `--keep 1` then deleted the last good one.
The save now refuses non-finite state. Device arrays are reduced on the device (one small program:
a bool per leaf), host-memory arrays shard by shard in numpy, so nothing large moves; leaves that a
checkpoint streams a layer group at a time (NVMe, host offload) are checked block by block as they
are written (`zerojax.checkpoint.stream.write_leaf`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.checkpoint.errors import CheckpointError
from zerojax.precision import finite_leaves


class NonFiniteState(CheckpointError):
    """A checkpoint was asked of a state holding inf or NaN."""


_finite_flags = jax.jit(finite_leaves)  # a bool per device leaf, one small program


def _floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


_BLOCK = 1 << 20  # elements a host check reads at once: its temporary stays 1 MiB, not a bool per element


def _all_finite(a: np.ndarray) -> bool:
    flat = a.reshape(-1)
    return all(bool(np.isfinite(flat[i:i + _BLOCK]).all()) for i in range(0, flat.size, _BLOCK))


def _host_finite(x) -> bool:
    """This process's shards of a host-memory array (or a numpy array), checked in numpy a block at a time."""
    if isinstance(x, np.ndarray):
        return _all_finite(x)
    return all(_all_finite(np.asarray(s.data)) for s in x.addressable_shards)


def first_nonfinite(tree) -> str | None:
    """The path (`jax.tree_util.keystr`) of the first floating leaf of `tree` that holds inf or NaN,
    or None. Leaves that are neither jax nor numpy arrays (streamed leaves) are not read here."""
    from zerojax.offload.memory_kinds import is_host

    named = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree) if _floating(x)]
    on_device = [(n, x) for n, x in named if isinstance(x, jax.Array) and not is_host(x)]
    in_host = [(n, x) for n, x in named if isinstance(x, np.ndarray) or (isinstance(x, jax.Array) and is_host(x))]
    ok = {}
    if on_device:
        flags = np.asarray(jax.device_get(_finite_flags([x for _, x in on_device])))
        ok.update({n: bool(f) for (n, _), f in zip(on_device, flags, strict=True)})
    if in_host:
        flags = np.asarray([_host_finite(x) for _, x in in_host])
        if jax.process_count() > 1:  # each process read its own shards
            from jax.experimental import multihost_utils

            flags = np.all(multihost_utils.process_allgather(flags), axis=0)
        ok.update({n: bool(f) for (n, _), f in zip(in_host, flags, strict=True)})
    return next((n for n, _ in named if ok.get(n) is False), None)


def check_block(name: str, rows) -> None:
    """A streamed leaf's block of rows, as it is written: NonFiniteState where it holds inf / NaN."""
    rows = np.asarray(rows)
    if jnp.issubdtype(rows.dtype, jnp.inexact) and not _all_finite(rows):
        raise NonFiniteState(f"{name} holds inf or NaN")


__all__ = ["NonFiniteState", "first_nonfinite", "check_block"]
