"""The chunk layout of an offloaded state: how a params-shaped tree is cut into chunks (the rest
leaves, the host layers, a device chunk), where each chunk is stored, and the codec between the
chunked form and the unchunked (layout-free) form a checkpoint keeps (`merge_chunks` /
`split_chunks`).

The library builds one layout, the one that won on the GPU ("loop", README "Measured"): the
non-layer leaves as one chunk, the host layers as one [L, ...] chunk updated in place by a loop
over K groups, and (offload_optimizer.ratio < 1) the last pieces as one device chunk. A
`ChunkLayout` is plain data, so other cuts (the candidates that lost: one chunk per layer group,
everything at once) can be built from `Chunk`s and run by the same update."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.offload.memory_kinds import DEVICE, PINNED_HOST, is_sharding, with_memory_kind

is_none = lambda x: x is None  # noqa: E731


# --------------------------------------------------------------------------- chunk layout


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk: rest leaves (if `rest`), stacked leaves' layers [lo, hi); `host`: lives in host
    memory; `loop` > 0: updated in place by a fori_loop of `loop` iterations over equal layer
    groups (else all at once)."""

    rest: bool
    lo: int
    hi: int
    host: bool = True
    loop: int = 0


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """How a params-shaped tree is cut into chunks (static: hashable, usable as a jit static arg)."""

    treedef: Any
    stacked: tuple[bool, ...]      # per leaf (leaf order of `treedef`)
    num_layers: int
    chunks: tuple[Chunk, ...]

    def __len__(self):
        return len(self.chunks)


def _stacked_flags(leaves, stacked) -> tuple[int, tuple[bool, ...]]:
    if stacked is None:  # the most common leading dim among leaves of rank >= 2, if shared
        lead = [x.shape[0] for x in leaves if len(x.shape) >= 2]
        counts = {d: lead.count(d) for d in lead}
        stacked = max(counts, key=counts.get) if counts and max(counts.values()) >= 2 else 0
    if isinstance(stacked, int):
        flags = tuple(bool(stacked) and len(x.shape) >= 1 and x.shape[0] == stacked for x in leaves)
        return (stacked if any(flags) else 0), flags
    flags = tuple(bool(f) for f in stacked)
    lengths = {leaves[i].shape[0] for i, f in enumerate(flags) if f}
    if len(lengths) > 1:
        raise ValueError(f"stacked leaves must share their leading (layers) dim; got {sorted(lengths)}")
    return (lengths.pop() if lengths else 0), flags


def layer_pieces(tree, k: int, *, ratio: float = 1.0, stacked=None):
    """(treedef, stacked flags, L, host pieces, device pieces): `tree`'s pieces [rest, layer group
    1, ..., group k] (groups: `np.array_split(range(L), k)`; the rest piece only if there are rest
    leaves), the first ceil(ratio * pieces) of them in host memory (ZeRO-Offload++'s ratio). A
    piece is (is_rest, lo, hi).

    stacked: None (auto: leaves whose leading dim is the most common leading dim of rank >= 2
    leaves), an int L (leaves with leading dim L), or a tree of bools like `tree`.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"offload_optimizer.ratio={ratio} must be in [0, 1]")
    leaves, treedef = jax.tree.flatten(tree)
    if stacked is not None and not isinstance(stacked, int):
        stacked = treedef.flatten_up_to(stacked)
    L, flags = _stacked_flags(leaves, stacked)
    k = max(1, min(int(k), L)) if L else 0
    has_rest = not all(flags)
    bounds = [(int(g[0]), int(g[-1]) + 1) for g in np.array_split(np.arange(L), k)] if L else []
    pieces = ([(True, 0, 0)] if has_rest else []) + [(False, lo, hi) for lo, hi in bounds]
    n_host = math.ceil(ratio * len(pieces) - 1e-9)
    return treedef, flags, L, pieces[:n_host], pieces[n_host:]


def groups_of_at_least(tree, min_bytes: int, shardings=None, *, stacked=None) -> int:
    """The layer-group count K (a divisor of the layer count L) whose groups are the fewest
    layers holding at least `min_bytes` of `tree`'s stacked leaves per device (each leaf's shard
    under `shardings`, a tree like `tree`, else the whole leaf); 1 when all L layers hold less,
    L when one layer holds that much. Used for offload_loop="host" (EngineOptions.
    offload_host_chunk_bytes): its chunks are moved by one runtime transfer and updated by one
    jitted call each, so larger chunks mean fewer dispatches."""
    leaves, treedef = jax.tree.flatten(tree)
    if stacked is not None and not isinstance(stacked, int):
        stacked = treedef.flatten_up_to(stacked)
    L, flags = _stacked_flags(leaves, stacked)
    if not L:
        return 1
    shards = (jax.tree.leaves(shardings) if shardings is not None else [None] * len(leaves))
    if len(shards) != len(leaves):
        raise ValueError(f"shardings: {len(shards)} leaves for a tree of {len(leaves)}")
    per_layer = sum(math.prod(s.shard_shape(x.shape) if s is not None else x.shape) * jnp.dtype(x.dtype).itemsize
                    for x, s, f in zip(leaves, shards, flags) if f) / L
    for per_group in range(1, L + 1):
        if L % per_group == 0 and per_group * per_layer >= min_bytes:
            return L // per_group
    return 1


def device_chunk(dev) -> list[Chunk]:
    """The device pieces (ratio < 1) as one chunk updated in place, with no transfer."""
    if not dev:
        return []
    r = dev[0][0]
    lo = dev[1][1] if r and len(dev) > 1 else dev[0][1]
    return [Chunk(rest=r, lo=lo, hi=dev[-1][2], host=False)]


def chunk_layout(tree, k: int, *, ratio: float = 1.0, stacked=None, per_group: bool = False) -> ChunkLayout:
    """The layout of `tree` (arrays or ShapeDtypeStructs) with its host layers in `k` groups: the
    rest piece, then the host layer groups as one chunk updated in place a group at a time (needs
    k | L), or with `per_group` one chunk per group (offload_loop="host": each moved whole), then
    the device chunk (see `layer_pieces` for ratio and stacked)."""
    treedef, flags, L, host, dev = layer_pieces(tree, k, ratio=ratio, stacked=stacked)
    chunks: list[Chunk] = []
    if host and host[0][0]:
        chunks.append(Chunk(rest=True, lo=0, hi=0))
    groups = [p for p in host if not p[0]]
    if groups:
        k = len([p for p in host + dev if not p[0]])
        if L % k:  # the loop's groups must be equal
            raise ValueError(f"the layer count {L} is not divisible by k={k} layer groups")
        if per_group:
            chunks += [Chunk(rest=False, lo=lo, hi=hi, loop=1) for _, lo, hi in groups]
        else:
            chunks.append(Chunk(rest=False, lo=groups[0][1], hi=groups[-1][2], loop=len(groups)))
    return ChunkLayout(treedef, flags, L, tuple(chunks + device_chunk(dev)))


def piece(x, stacked: bool, c: Chunk):
    if not stacked:
        return x if c.rest else None
    if c.hi <= c.lo:
        return None
    return x[c.lo:c.hi]


def dynamic_piece(tree, stacked, rest: bool, per: int, lo):
    """`piece` of a whole params-shaped tree inside a jit, the first layer `lo` a traced value (one
    program for every layer group of `per` layers): the non-layer leaves for the non-layer chunk
    (`rest`), else the stacked leaves' layers lo .. lo + per; None where the chunk has no piece."""
    def cut(x, st):
        if rest:
            return None if st else x
        return jax.lax.dynamic_slice_in_dim(x, lo, per, axis=0) if st else None
    return jax.tree.map(cut, tree, stacked)


# --------------------------------------------------------------------------- layer groups of a chunk


def to_kind(tree, shardings, kind):
    """`tree` moved to `shardings` in memory `kind` (None leaves stay None)."""
    return jax.device_put(tree, with_memory_kind(shardings, kind))


def slice_sharding(s, n: int):
    """A chunk sharding for a slice of `n` layers: the layers axis unsplit where n does not divide."""
    return NamedSharding(s.mesh, P(*unsplit_layers(list(tuple(s.spec)), s.mesh, n)),
                         memory_kind=s.memory_kind)


def group_shardings(m_sh, per: int):
    """A chunk's master shardings for one group of `per` layers (`slice_sharding` of each)."""
    return jax.tree.map(lambda x: slice_sharding(x, per), m_sh, is_leaf=is_sharding)


def group(tree, j, per: int):
    """Layer group j (`per` layers) of a chunk tree's stacked leaves, by dynamic slice (None stays None)."""
    return jax.tree.map(lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, j * per, per, axis=0),
                        tree, is_leaf=is_none)


def put_group(buf, x, j, per: int):
    """`buf` with layer group j replaced by `x` cast to its dtype (dynamic_update_slice: in place where
    `buf` is donated or a loop carry). None leaves stay None."""
    return jax.tree.map(lambda b, v: None if b is None else jax.lax.dynamic_update_slice_in_dim(
        b, v.astype(b.dtype), j * per, axis=0), buf, x, is_leaf=is_none)


def to_chunks(tree, layout: ChunkLayout | int, **kw) -> list:
    """Split a params-shaped tree into chunks (`layout` or a group count k plus chunk_layout's kw)."""
    if isinstance(layout, int):
        layout = chunk_layout(tree, layout, **kw)
    leaves = layout.treedef.flatten_up_to(tree)
    return [layout.treedef.unflatten([piece(x, s, c) for x, s in zip(leaves, layout.stacked)])
            for c in layout.chunks]


def from_chunks(chunks: Sequence, layout: ChunkLayout | None = None):
    """Merge chunks back into one tree: a leaf's pieces concatenated on the layers axis in order."""
    flat = [jax.tree.flatten(c, is_leaf=is_none) for c in chunks]
    treedef = flat[0][1]
    out = []
    for i in range(treedef.num_leaves):
        parts = [leaves[i] for leaves, _ in flat if leaves[i] is not None]
        out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))
    return treedef.unflatten(out)


def unsplit_layers(spec: list, mesh, n: int) -> list:
    """`spec` with its layers-axis (first) entry dropped where `n` layers do not divide over it."""
    if spec and spec[0] is not None:
        size = math.prod(mesh.shape[a] for a in (spec[0] if isinstance(spec[0], tuple) else (spec[0],)))
        if n % size:
            spec = [None] + list(spec[1:])
    return spec


def _chunk_sharding(s, shape, c: Chunk, stacked: bool, kind: str):
    spec = list(tuple(s.spec)) + [None] * (len(shape) - len(tuple(s.spec)))
    if stacked and c.hi > c.lo:
        spec = unsplit_layers(spec, s.mesh, c.hi - c.lo)
    return NamedSharding(s.mesh, P(*spec), memory_kind=kind)


# --------------------------------------------------------------------------- layout and state


class OffloadState(NamedTuple):
    """Per-chunk fp32 master weights and optimizer states (lists, in the layout's chunk order)."""

    master: list
    opt_state: list


@dataclasses.dataclass(frozen=True, eq=False)
class OffloadLayout:
    """Layout plus, per chunk, the shardings of master and opt state where they are stored."""

    layout: ChunkLayout
    master_shardings: tuple   # per chunk: tree like the chunk (None where absent)
    state_shardings: tuple    # per chunk: tree like tx.init(chunk)
    kind: str

    @property
    def shardings(self) -> OffloadState:
        """out_shardings / in_shardings for an `OffloadState` under jit."""
        return OffloadState(list(self.master_shardings), list(self.state_shardings))


def offload_layout(tx, abstract_master, shardings, k: int | ChunkLayout, *, kind: str = PINNED_HOST,
                   ratio: float = 1.0, stacked=None, per_group: bool = False) -> OffloadLayout:
    """Chunk layout (`chunk_layout` with k groups, or a ChunkLayout given) and shardings for master
    weights `abstract_master` sharded by `shardings`.

    Host chunks get memory `kind`, device chunks (ratio < 1) "device". Optimizer-state leaves that
    mirror a param take its chunk sharding (`optax.tree_map_params`); others (counts) replicated.
    """
    layout = k if isinstance(k, ChunkLayout) else chunk_layout(abstract_master, k, ratio=ratio, stacked=stacked,
                                                               per_group=per_group)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_master)
    leaves = layout.treedef.flatten_up_to(abstract)
    sh = layout.treedef.flatten_up_to(shardings)
    mesh = sh[0].mesh
    m_sh, s_sh = [], []
    for c, chunk in zip(layout.chunks, jax.eval_shape(lambda t: to_chunks(t, layout), abstract)):
        ck = kind if c.host else DEVICE
        tree = layout.treedef.unflatten([
            _chunk_sharding(s, x.shape, c, f, ck) if (c.rest if not f else c.hi > c.lo) else None
            for x, s, f in zip(leaves, sh, layout.stacked)])
        m_sh.append(tree)
        state = jax.eval_shape(tx.init, chunk)
        non_param = lambda x, ck=ck: NamedSharding(mesh, P(*([None] * len(x.shape))), memory_kind=ck)  # noqa: E731
        s_sh.append(_state_shardings(tx, state, chunk, tree, non_param))
    return OffloadLayout(layout, tuple(m_sh), tuple(s_sh), kind)


def _state_shardings(tx, state, chunk, chunk_shardings, non_param):
    # state leaves that mirror a param take its sharding: optax.tree_map_params, else by shape
    try:
        out = optax.tree_map_params(tx, lambda _, s: s, state, chunk_shardings,
                                    transform_non_params=non_param,
                                    is_leaf=lambda x: is_sharding(x) or x is None)
        if jax.tree.structure(out, is_leaf=is_sharding) == jax.tree.structure(state):
            return out
    except Exception:  # noqa: BLE001 - a transform that defeats the placeholder trick
        pass
    by_shape = {}
    for x, s in zip(jax.tree.leaves(chunk), jax.tree.leaves(chunk_shardings, is_leaf=is_sharding)):
        by_shape.setdefault(tuple(x.shape), s)
    return jax.tree.map(lambda x: by_shape.get(tuple(x.shape)) or non_param(x), state)


def init_offloaded(tx, master_tree, k: int, shardings, kind: str = PINNED_HOST, **kw):
    """-> (OffloadState, OffloadLayout): master chunks and `tx.init` states built straight into
    their memory kind (one jit with out_shardings); kw: ratio, stacked."""
    off = offload_layout(tx, master_tree, shardings, k, kind=kind, **kw)

    def build(master):
        chunks = to_chunks(master, off.layout)
        return OffloadState(chunks, [tx.init(m) for m in chunks])

    return jax.jit(build, out_shardings=off.shardings)(master_tree), off


def offload_master(state: OffloadState, off: OffloadLayout):
    """The fp32 master tree merged in device memory (checkpoints, export, tests)."""
    dev = [with_memory_kind(s, DEVICE) for s in off.master_shardings]
    return from_chunks([jax.device_put(m, s) for m, s in zip(state.master, dev)], off.layout)


# --------------------------------------------------------------------------- layout-free form


def merge_chunks(trees: Sequence, layout: ChunkLayout):
    """Per-chunk trees (master pieces, or per-chunk optimizer states) -> one tree of the unchunked
    layout (`tx.init(master)`'s, for states): what a checkpoint stores, whatever the offload.

    A leaf held whole by one chunk (every leaf of the default "loop" layout) is returned as it is,
    in place: nothing is copied. Layer pieces are joined on the layers axis; optimizer counters,
    the same in every chunk, are taken from the first."""
    flat = [jax.tree.flatten(t, is_leaf=is_none) for t in trees]
    treedef = flat[0][1]
    out = []
    for i in range(treedef.num_leaves):
        parts = [xs[i] for xs, _ in flat if xs[i] is not None]
        if not parts:  # None in every chunk: None in the state itself
            out.append(None)
        elif len(parts) == len(trees) > 1 and all(x.ndim == 0 for x in parts):  # a counter
            out.append(parts[0])
        elif len(parts) == 1:
            out.append(parts[0])
        else:
            out.append(jax.jit(lambda *p: jnp.concatenate(p, axis=0))(*parts))
    return treedef.unflatten(out)


def split_chunks(tree, layout: ChunkLayout, templates: Sequence, shardings: Sequence) -> list:
    """The inverse of `merge_chunks`: one tree of the unchunked layout -> per-chunk trees shaped
    like `templates` (abstract per-chunk trees, None where a chunk lacks a leaf) and placed by
    `shardings`. A leaf a chunk holds whole is placed as it is (no copy where the sharding already
    matches); layer pieces are sliced; counters are broadcast to the chunk's shape."""
    leaves = jax.tree.leaves(tree, is_leaf=is_none)
    out = []
    for c, tmpl, shs in zip(layout.chunks, templates, shardings):
        t_leaves, t_def = jax.tree.flatten(tmpl, is_leaf=is_none)
        s_leaves = t_def.flatten_up_to(shs)
        if len(t_leaves) != len(leaves):
            raise ValueError(f"split_chunks: the tree has {len(leaves)} leaves, a chunk {len(t_leaves)}")
        pieces = []
        for x, t, sh in zip(leaves, t_leaves, s_leaves):
            if t is None or x is None:
                pieces.append(None)
            elif x.ndim == 0:  # a counter: each chunk its own buffer (the step donates them)
                pieces.append(jax.jit(lambda v, t=t: jnp.broadcast_to(v, t.shape), out_shardings=sh)(x))
            elif tuple(t.shape) == tuple(x.shape):
                pieces.append(x if x.sharding == sh else jax.device_put(x, sh))
            else:
                pieces.append(jax.jit(lambda v, t=t: v[c.lo:c.hi].reshape(t.shape), out_shardings=sh)(x))  # noqa: B023 - called within this iteration
        out.append(t_def.unflatten(pieces))
    return out


def chunk_templates(tx, abstract_master, layout: ChunkLayout):
    """(master chunk templates, optimizer-state chunk templates): abstract, None where absent."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), abstract_master)
    chunks = jax.eval_shape(lambda t: to_chunks(t, layout), abstract)
    states = [jax.eval_shape(tx.init, m) for m in chunks]
    return chunks, states
