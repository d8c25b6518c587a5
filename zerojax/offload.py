"""Host offload through memory kinds: optimizer state streamed in chunks, params per layer.

DeepSpeed's `offload_optimizer: {device: cpu}` keeps the fp32 master weights and optimizer moments
in host memory and runs the update on the CPU. Here they stay in host memory too (a sharding whose
`memory_kind` is "pinned_host"), but the update runs on the accelerator: inside the jitted step each
chunk of (master, state) is copied to the device (`jax.device_put` to a "device" sharding), updated,
cast to the compute dtype, and copied back. Device memory then holds a few chunks, never the whole
optimizer state.

Chunk layout. The tree's leaves are either *stacked* (a leading "layers" axis of size L, scanned by
the model) or *rest* (embeddings, final norm). Pieces are `[rest, layers group 1, ..., group K]`
(groups: `np.array_split(range(L), K)`; the rest piece only if there are rest leaves). With
`ratio` (ZeRO-Offload++'s fraction of the optimizer state offloaded) the first ceil(ratio * pieces)
pieces live in host memory; the others form one device chunk updated in place, with no transfer.
How the host pieces are grouped into transfers is the *candidate*:

- "whole":   all host pieces in one chunk, moved in and out at once (MaxText's way);
- "chunked": one chunk per piece, in an unrolled Python loop: independent chains, so XLA may copy
             chunk k+1 in while chunk k computes and chunk k-1 goes out. `window=w` adds
             `optimization_barrier`s so that chunk k+w's copy-in waits for chunk k's update,
             bounding device memory to about w+1 chunks whatever the scheduler decides;
- "scan":    the host layer groups stacked as [K, L/K, ...] and updated by one `lax.scan` that
             copies one group in and out per iteration (needs K | L);
- "loop":    the host layers as one [L, ...] chunk updated by a `fori_loop` over K groups of L/K
             layers (needs K | L) that carries the stored arrays themselves: each iteration
             slices its group out of host memory, updates it on the device and writes it back
             into the same host buffer (dynamic_update_slice), and writes the new compute copy
             into the previous step's compute params (`compute_init`). Everything is updated in
             place: no concatenation of the layers' new weights on the device (what "chunked"
             does to return a stacked compute copy) and no second host copy of the state (what
             "scan"'s outputs need). Device memory holds one group's state.

A chunk is a tree of the original structure with `None` in place of the leaves it lacks (so optax
masks written as functions of the params tree keep working); its stacked leaves are slices
`leaf[lo:hi]` (or, in a scan chunk, `leaf[lo:hi].reshape(K', (hi-lo)/K', ...)`).

Parameter offload (stage 3 `offload_param`) is `fetch` called on a layer's slice inside the
model's layer scan (or `scan_layers`, which also prefetches the next layer). JAX's typing rule
makes the gradient of a host-resident input host-resident: the backward pass sends each layer's
gradient to host as it is computed. `streamed_update` accepts host-resident gradients and streams
them in with their chunk.

On CPU the host memory kinds exist (device, pinned_host, unpinned_host) but are one address
space: `device_put` between them inside jit lowers to nothing; only the entry computation's layout
marks host buffers (`S(5)`). On GPU/TPU each such `device_put` lowers to an
`annotate_device_placement` custom call, which XLA's host-offload passes turn into copies between
memory spaces (async copy-start/copy-done on GPU).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

DEVICE = "device"
PINNED_HOST = "pinned_host"
UNPINNED_HOST = "unpinned_host"
CANDIDATES = ("whole", "chunked", "scan", "loop")

_is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
_is_none = lambda x: x is None  # noqa: E731


# --------------------------------------------------------------------------- memory kinds


def memory_kinds(device=None) -> tuple[str, ...]:
    """The memory kinds `device` (default: the first device) can address."""
    device = jax.devices()[0] if device is None else device
    try:
        return tuple(m.kind for m in device.addressable_memories())
    except Exception:  # noqa: BLE001 - a backend without memories API
        return (DEVICE,)


def host_memory_kind(pin_memory: bool = True, device=None) -> str:
    """"pinned_host" (DeepSpeed's `pin_memory: true`) or "unpinned_host" where the device offers it.

    GPUs address only pinned host memory from a kernel; `pin_memory: false` falls back to
    "pinned_host" there. Raises if the backend has no host memory kind at all.
    """
    kinds = memory_kinds(device)
    want = PINNED_HOST if pin_memory else UNPINNED_HOST
    if want in kinds:
        return want
    if PINNED_HOST in kinds:
        return PINNED_HOST
    raise ValueError(f"host offload needs a host memory kind; this device offers only {kinds} "
                     f"(set offload_optimizer/offload_param device to \"none\")")


def with_memory_kind(shardings, kind: str):
    """The same tree of shardings, each moved to memory `kind` (None leaves stay None)."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings, is_leaf=_is_sharding)


def is_host(x) -> bool:
    """Whether an array (or a tracer inside jit) lives in host memory."""
    space = getattr(jax.typeof(x), "memory_space", None)
    if space is not None and hasattr(jax, "memory"):
        return space == jax.memory.Space.Host
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return kind in (PINNED_HOST, UNPINNED_HOST)


def fetch(tree, shardings):
    """Bring `tree` to device memory inside jit: `device_put` to each sharding's "device" kind.

    Use on a layer's parameter slice inside the layer scan (stage 3 `offload_param`): `shardings`
    are the per-layer shardings (`layer_shardings(stacked_shardings)`).
    """
    return jax.device_put(tree, with_memory_kind(shardings, DEVICE))


def layer_shardings(stacked_shardings):
    """Shardings of one layer's slice: each NamedSharding's spec without its leading entry."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(*tuple(s.spec)[1:]), memory_kind=s.memory_kind),
                        stacked_shardings, is_leaf=_is_sharding)


def scan_layers(body: Callable, carry, stacked_params, shardings, *, prefetch: bool = True):
    """`lax.scan(body, carry, stacked_params)` over host-resident layers, each fetched to device.

    `body(carry, layer_params) -> carry`; `shardings`: the stacked params' shardings (any memory
    kind). prefetch=True carries layer i+1's device copy through iteration i, so its host->device
    copy is independent of (and can overlap) layer i's compute; device memory holds two layers.
    """
    dev = layer_shardings(shardings)
    if not prefetch:
        return jax.lax.scan(lambda c, p: (body(c, fetch(p, dev)), None), carry, stacked_params)[0]

    # static slices only: a dynamic index into host memory would transpose (backward) into a
    # dynamic_update_slice mixing memory spaces, which JAX rejects
    first = fetch(jax.tree.map(lambda x: x[0], stacked_params), dev)
    rest = jax.tree.map(lambda x: x[1:], stacked_params)

    def step(state, nxt):
        c, cur = state
        return (body(c, cur), fetch(nxt, dev)), None

    (carry, last), _ = jax.lax.scan(step, (carry, first), rest)
    carry = body(carry, last)
    return carry


def prefetch_scan(block: Callable, x, layers, fetch: Callable, *, inputs_to_host: bool = False):
    """`x` through `block(x, layer)` for each layer of the stacked host-resident `layers`, each
    layer's host->device copy issued one layer ahead, forward and backward.

    `fetch(layer_slice)` moves one layer's slice to the device. Forward: the scan carries layer
    i+1's device copy while layer i computes, and saves only each layer's input. Backward (a
    custom VJP, since autodiff of a carried copy would save every layer's device copy): a reverse
    scan recomputes layer i from its saved input, carries layer i-1's copy, and sends layer i's
    weight gradient to host memory as soon as it is made. Device memory: two layers' weights.
    Recomputing every layer in the backward pass is "full" remat at layer granularity, which is
    what parameter offload implies anyway (a saved device copy per layer is what it avoids).
    inputs_to_host: keep the saved layer inputs in host memory too (DeepSpeed's
    `cpu_checkpointing`; the model's remat policy "offload").
    """
    n = jax.tree.leaves(layers)[0].shape[0]
    # each weight gradient goes where its weight lives (JAX types a cotangent like its primal)
    spaces = jax.tree.map(lambda a: getattr(jax.typeof(a), "memory_space", None), layers)
    host = getattr(getattr(jax, "memory", None), "Space", None)
    to_home = lambda g, sp: jax.device_put(g, sp) if host is not None and sp == host.Host else g  # noqa: E731

    def take(stacked, i):  # one layer's slice, read out of host memory by a dynamic index
        return fetch(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked))

    def forward(x, stacked):
        def step(carry, i):
            h, cur = carry
            nxt = take(stacked, jnp.minimum(i + 1, n - 1))
            return (block(h, cur), nxt), (jax.device_put(h, host.Host) if inputs_to_host else h)

        (h, _), inputs = jax.lax.scan(step, (x, take(stacked, 0)), jnp.arange(n))
        return h, (inputs, stacked)

    def backward(res, g):
        inputs, stacked = res

        def step(carry, xs):
            gh, cur = carry
            h, i = xs
            if inputs_to_host:
                h = jax.device_put(h, host.Device)
            prv = take(stacked, jnp.maximum(i - 1, 0))
            _, vjp = jax.vjp(block, h, cur)
            gh, gw = vjp(gh)
            return (gh, prv), jax.tree.map(to_home, gw, spaces)

        (gx, _), gws = jax.lax.scan(step, (g, take(stacked, n - 1)), (inputs, jnp.arange(n)),
                                    reverse=True)
        return gx, gws

    run = jax.custom_vjp(lambda x, stacked: forward(x, stacked)[0])
    run.defvjp(forward, backward)
    return run(x, layers)


# --------------------------------------------------------------------------- chunk layout


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk: rest leaves (if `rest`), stacked leaves' layers [lo, hi), `groups` > 0: stacked
    as [groups, (hi - lo) / groups, ...] and updated by a scan; `loop` > 0: stored as [hi - lo, ...]
    and updated in place by `loop` iterations; `host`: lives in host memory."""

    rest: bool
    lo: int
    hi: int
    groups: int = 0
    host: bool = True
    loop: int = 0  # > 0: updated in place by a fori_loop of `loop` iterations (candidate "loop")


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


def chunk_layout(tree, k: int, *, candidate: str = "chunked", ratio: float = 1.0,
                 stacked=None) -> ChunkLayout:
    """The layout of `tree` (arrays or ShapeDtypeStructs) in `k` layer groups for `candidate`.

    stacked: None (auto: leaves whose leading dim is the most common leading dim of rank >= 2
    leaves), an int L (leaves with leading dim L), or a tree of bools like `tree`.
    """
    if candidate not in CANDIDATES:
        raise ValueError(f"candidate={candidate!r}; choose one of {CANDIDATES}")
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
    host, dev = pieces[:n_host], pieces[n_host:]

    chunks: list[Chunk] = []
    if host:
        if candidate == "whole":
            lo, hi = (host[1][1] if host[0][0] and len(host) > 1 else host[0][1]), host[-1][2]
            chunks.append(Chunk(rest=host[0][0], lo=lo, hi=hi))
        elif candidate == "chunked":
            chunks += [Chunk(rest=r, lo=lo, hi=hi) for r, lo, hi in host]
        else:  # scan / loop: the rest piece, then the host layer groups as one chunk
            if host[0][0]:
                chunks.append(Chunk(rest=True, lo=0, hi=0))
            groups = [p for p in host if not p[0]]
            if groups:
                if L % k:
                    raise ValueError(f"candidate={candidate!r} needs the layer count {L} divisible by "
                                     f"k={k} (EngineOptions.offload_chunks)")
                n = len(groups)
                chunks.append(Chunk(rest=False, lo=groups[0][1], hi=groups[-1][2],
                                    groups=n if candidate == "scan" else 0,
                                    loop=n if candidate == "loop" else 0))
    if dev:
        r = dev[0][0]
        lo = dev[1][1] if r and len(dev) > 1 else dev[0][1]
        chunks.append(Chunk(rest=r, lo=lo, hi=dev[-1][2], host=False))
    return ChunkLayout(treedef, flags, L, tuple(chunks))


def piece(x, stacked: bool, c: Chunk):
    if not stacked:
        return x if c.rest else None
    if c.hi <= c.lo:
        return None
    x = x[c.lo:c.hi]
    return x.reshape(c.groups, -1, *x.shape[1:]) if c.groups else x


def to_chunks(tree, layout: ChunkLayout | int, **kw) -> list:
    """Split a params-shaped tree into chunks (`layout` or a group count k plus chunk_layout's kw)."""
    if isinstance(layout, int):
        layout = chunk_layout(tree, layout, **kw)
    leaves = layout.treedef.flatten_up_to(tree)
    return [layout.treedef.unflatten([piece(x, s, c) for x, s in zip(leaves, layout.stacked)])
            for c in layout.chunks]


def from_chunks(chunks: Sequence, layout: ChunkLayout | None = None):
    """Merge chunks back into one tree: a leaf's pieces concatenated on the layers axis in order."""
    flat = [jax.tree.flatten(c, is_leaf=_is_none) for c in chunks]
    treedef = flat[0][1]
    out = []
    for i in range(treedef.num_leaves):
        parts = []
        for j, (leaves, _) in enumerate(flat):
            x = leaves[i]
            if x is None:
                continue
            if layout is not None and layout.chunks[j].groups:
                x = x.reshape(-1, *x.shape[2:])
            parts.append(x)
        out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))
    return treedef.unflatten(out)


def _unsplit_layers(spec: list, mesh, n: int) -> list:
    """`spec` with its layers-axis (first) entry dropped where `n` layers do not divide over it."""
    if spec and spec[0] is not None:
        size = math.prod(mesh.shape[a] for a in (spec[0] if isinstance(spec[0], tuple) else (spec[0],)))
        if n % size:
            spec = [None] + list(spec[1:])
    return spec


def _chunk_sharding(s, shape, c: Chunk, stacked: bool, kind: str):
    spec = list(tuple(s.spec)) + [None] * (len(shape) - len(tuple(s.spec)))
    if stacked and c.hi > c.lo:
        spec = _unsplit_layers(spec, s.mesh, (c.hi - c.lo) // max(c.groups, 1))
        if c.groups:
            spec = [None] + spec
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
    window: int | None = None

    @property
    def shardings(self) -> OffloadState:
        """out_shardings / in_shardings for an `OffloadState` under jit."""
        return OffloadState(list(self.master_shardings), list(self.state_shardings))


def init_chunk(tx, chunk, c: Chunk):
    return jax.vmap(tx.init)(chunk) if c.groups else tx.init(chunk)


def offload_layout(tx, abstract_master, shardings, k: int, *, kind: str = PINNED_HOST,
                 candidate: str = "chunked", ratio: float = 1.0, stacked=None,
                 window: int | None = None) -> OffloadLayout:
    """Chunk layout and shardings for master weights `abstract_master` sharded by `shardings`.

    Host chunks get memory `kind`, device chunks (ratio < 1) "device". Optimizer-state leaves that
    mirror a param take its chunk sharding (`optax.tree_map_params`); others (counts) replicated.
    """
    layout = chunk_layout(abstract_master, k, candidate=candidate, ratio=ratio, stacked=stacked)
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
        state = jax.eval_shape(lambda m, c=c: init_chunk(tx, m, c), chunk)
        rep = NamedSharding(mesh, P(), memory_kind=ck)
        non_param = lambda x, rep=rep, c=c: (  # noqa: E731 - vmapped counts keep their [groups] axis
            NamedSharding(mesh, P(*([None] * len(x.shape))), memory_kind=ck) if len(x.shape) else rep)
        s_sh.append(_state_shardings(tx, state, chunk, tree, non_param))
    return OffloadLayout(layout, tuple(m_sh), tuple(s_sh), kind, window)


def _state_shardings(tx, state, chunk, chunk_shardings, non_param):
    # state leaves that mirror a param take its sharding: optax.tree_map_params, else by shape
    try:
        out = optax.tree_map_params(tx, lambda _, s: s, state, chunk_shardings,
                                    transform_non_params=non_param,
                                    is_leaf=lambda x: _is_sharding(x) or x is None)
        if jax.tree.structure(out, is_leaf=_is_sharding) == jax.tree.structure(state):
            return out
    except Exception:  # noqa: BLE001 - a transform that defeats the placeholder trick
        pass
    by_shape = {}
    for x, s in zip(jax.tree.leaves(chunk), jax.tree.leaves(chunk_shardings, is_leaf=_is_sharding)):
        by_shape.setdefault(tuple(x.shape), s)
    return jax.tree.map(lambda x: by_shape.get(tuple(x.shape)) or non_param(x), state)


def init_offloaded(tx, master_tree, k: int, shardings, kind: str = PINNED_HOST, **kw):
    """-> (OffloadState, OffloadLayout): master chunks and `tx.init` states built straight into
    their memory kind (one jit with out_shardings); kw: candidate, ratio, stacked, window."""
    off = offload_layout(tx, master_tree, shardings, k, kind=kind, **kw)

    def build(master):
        chunks = to_chunks(master, off.layout)
        return OffloadState(chunks, [init_chunk(tx, m, c) for m, c in zip(chunks, off.layout.chunks)])

    return jax.jit(build, out_shardings=off.shardings)(master_tree), off


def offload_master(state: OffloadState, off: OffloadLayout):
    """The fp32 master tree merged in device memory (checkpoints, export, tests)."""
    dev = [with_memory_kind(s, DEVICE) for s in off.master_shardings]
    return from_chunks([jax.device_put(m, s) for m, s in zip(state.master, dev)], off.layout)


# --------------------------------------------------------------------------- layout-free form


def _is_count(x, c: Chunk) -> bool:
    # an optimizer counter: a scalar (a scan chunk's vmapped init: one per group)
    return x.ndim == (1 if c.groups else 0)


def merge_chunks(trees: Sequence, layout: ChunkLayout):
    """Per-chunk trees (master pieces, or per-chunk optimizer states) -> one tree of the unchunked
    layout (`tx.init(master)`'s, for states): what a checkpoint stores, whatever the offload.

    A leaf held whole by one chunk (every leaf of the default "loop" layout) is returned as it is,
    in place: nothing is copied. Layer pieces are joined on the layers axis; optimizer counters,
    the same in every chunk, are taken from the first."""
    flat = [jax.tree.flatten(t, is_leaf=_is_none) for t in trees]
    treedef = flat[0][1]
    out = []
    for i in range(treedef.num_leaves):
        parts = [(xs[i], c) for (xs, _), c in zip(flat, layout.chunks) if xs[i] is not None]
        if not parts:  # None in every chunk: None in the state itself
            out.append(None)
        elif len(parts) == len(trees) > 1 and all(_is_count(x, c) for x, c in parts):
            x, c = parts[0]
            out.append(x[0] if c.groups else x)
        elif len(parts) == 1 and not parts[0][1].groups:
            out.append(parts[0][0])
        else:
            pieces = [x.reshape(-1, *x.shape[2:]) if c.groups else x for x, c in parts]
            out.append(jax.jit(lambda *p: jnp.concatenate(p, axis=0))(*pieces))
    return treedef.unflatten(out)


def split_chunks(tree, layout: ChunkLayout, templates: Sequence, shardings: Sequence) -> list:
    """The inverse of `merge_chunks`: one tree of the unchunked layout -> per-chunk trees shaped
    like `templates` (abstract per-chunk trees, None where a chunk lacks a leaf) and placed by
    `shardings`. A leaf a chunk holds whole is placed as it is (no copy where the sharding already
    matches); layer pieces are sliced; counters are broadcast to the chunk's shape."""
    leaves = jax.tree.leaves(tree, is_leaf=_is_none)
    out = []
    for c, tmpl, shs in zip(layout.chunks, templates, shardings):
        t_leaves, t_def = jax.tree.flatten(tmpl, is_leaf=_is_none)
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
                pieces.append(jax.jit(lambda v, t=t: v[c.lo:c.hi].reshape(t.shape), out_shardings=sh)(x))
        out.append(t_def.unflatten(pieces))
    return out


def chunk_templates(tx, abstract_master, layout: ChunkLayout):
    """(master chunk templates, optimizer-state chunk templates): abstract, None where absent."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), abstract_master)
    chunks = jax.eval_shape(lambda t: to_chunks(t, layout), abstract)
    states = [jax.eval_shape(lambda m, c=c: init_chunk(tx, m, c), m) for m, c in zip(chunks, layout.chunks)]
    return chunks, states


# --------------------------------------------------------------------------- the streamed update


def _to(tree, shardings, kind):
    return jax.device_put(tree, with_memory_kind(shardings, kind))


def _grads_in(g, m_sh):
    # gradients already on device pass through; host-resident ones (offload_param) come in
    move = lambda x, s: x if x is None or not is_host(x) else jax.device_put(x, s.with_memory_kind(DEVICE))  # noqa: E731
    return jax.tree.map(move, g, m_sh, is_leaf=_is_none)


def _apply(tx, g, s, m, compute_dtype, skip, grad_scale=None):
    if grad_scale is not None:  # unscale x clip, applied chunk by chunk on the device
        g = jax.tree.map(lambda x: x.astype(jnp.float32) * grad_scale, g)
    u, s_new = tx.update(g, s, m)
    m_new = optax.apply_updates(m, u)
    if skip is not None:
        keep = lambda new, old: jnp.where(skip, old, new)  # noqa: E731
        m_new, s_new = jax.tree.map(keep, m_new, m), jax.tree.map(keep, s_new, s)
    return m_new, s_new, jax.tree.map(lambda x: x.astype(compute_dtype), m_new)


def _strip(shardings):
    # per-group sharding inside a scan chunk: drop the leading [groups] axis
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(*tuple(s.spec)[1:]), memory_kind=s.memory_kind),
                        shardings, is_leaf=_is_sharding)


def _slice_sharding(s, n: int):
    """A chunk sharding for a slice of `n` layers: the layers axis unsplit where n does not divide."""
    return NamedSharding(s.mesh, P(*_unsplit_layers(list(tuple(s.spec)), s.mesh, n)),
                         memory_kind=s.memory_kind)


def _loop_update(tx, c: Chunk, g, m, s, cp, m_sh, s_sh, *, kind, compute_dtype, skip, grad_scale,
                 compute_kind):
    """Candidate "loop": a fori_loop over `c.loop` groups of layers carrying the stored arrays
    (master, state, compute copy) and writing each group back where it was read (in place).

    State leaves with the chunk's leading layers dim are sliced per group; the others (counts)
    are read from the step's input by every group, so each group sees the same count."""
    n = c.hi - c.lo
    per = n // c.loop
    s_leaves, s_def = jax.tree.flatten(s)
    stacked = [x.ndim >= 1 and x.shape[0] == n for x in s_leaves]
    s_sh_leaves = s_def.flatten_up_to(s_sh)
    m_dev = jax.tree.map(lambda x: _slice_sharding(x, per), m_sh, is_leaf=_is_sharding)
    s_dev = [_slice_sharding(x, per) if f else x for x, f in zip(s_sh_leaves, stacked)]
    sl = lambda x, j: jax.lax.dynamic_slice_in_dim(x, j * per, per, axis=0)  # noqa: E731
    put = lambda buf, x, j: jax.lax.dynamic_update_slice_in_dim(buf, x, j * per, axis=0)  # noqa: E731
    tmap = lambda f, *t: jax.tree.map(f, *t, is_leaf=_is_none)  # noqa: E731

    def body(j, carry):
        m, s_l, cp = carry
        mm = _to(tmap(lambda x: None if x is None else sl(x, j), m), m_dev, DEVICE)
        ss = [sl(x, j) if f else x0 for x, x0, f in zip(s_l, s_leaves, stacked)]
        ss = jax.device_put(ss, [x.with_memory_kind(DEVICE) for x in s_dev])
        gg = _grads_in(tmap(lambda x: None if x is None else sl(x, j), g), m_dev)
        mm, ss, cc = _apply(tx, gg, s_def.unflatten(ss), mm, compute_dtype, skip, grad_scale)
        mm = _to(mm, m_dev, kind)
        ss = jax.device_put(jax.tree.leaves(ss), [x.with_memory_kind(kind) for x in s_dev])
        if compute_kind is not None:
            cc = _to(cc, m_dev, compute_kind)
        m = tmap(lambda b, x: None if b is None else put(b, x, j), m, mm)
        s_l = [put(b, x, j) if f else x for b, x, f in zip(s_l, ss, stacked)]
        cp = tmap(lambda b, x: None if b is None else put(b, x.astype(b.dtype), j), cp, cc)
        return m, s_l, cp

    m, s_l, cp = jax.lax.fori_loop(0, c.loop, body, (m, s_leaves, cp))
    return m, s_def.unflatten(s_l), cp


def _empty_like(m, m_sh, compute_dtype, compute_kind):
    """A compute-copy buffer for a loop chunk when no previous compute params are given."""
    z = jax.tree.map(lambda x: None if x is None else jnp.zeros(x.shape, compute_dtype), m, is_leaf=_is_none)
    if compute_kind is not None:
        return _to(z, m_sh, compute_kind)
    return jax.tree.map(lambda x, s: None if x is None else jax.lax.with_sharding_constraint(
        x, NamedSharding(s.mesh, s.spec)), z, m_sh, is_leaf=_is_none)


def streamed_update(tx, grads, state: OffloadState, off: OffloadLayout, *,
                    compute_dtype=jnp.bfloat16, skip=None, grad_scale=None, compute_kind=None,
                    compute_init=None):
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
    -> (compute params tree in `compute_dtype`, new OffloadState in place).
    """
    layout = off.layout
    g_chunks = to_chunks(grads, layout)
    init_chunks = to_chunks(compute_init, layout) if compute_init is not None else None
    out_c, out_m, out_s = [], [], []
    results = []
    for i, (c, g, m, s) in enumerate(zip(layout.chunks, g_chunks, state.master, state.opt_state)):
        m_sh, s_sh = off.master_shardings[i], off.state_shardings[i]
        w = off.window
        if c.host and w is not None and i - w >= 0 and results[i - w] is not None:
            # chunk i's copy-in may start only after chunk i-w's update: <= w+1 chunks on device
            (m, s), _ = jax.lax.optimization_barrier(((m, s), results[i - w]))
        if c.loop:
            cp0 = (init_chunks[i] if init_chunks is not None
                   else _empty_like(m, m_sh, compute_dtype, compute_kind))
            m, s, cp = _loop_update(tx, c, g, m, s, cp0, m_sh, s_sh, kind=off.kind,
                                    compute_dtype=compute_dtype, skip=skip, grad_scale=grad_scale,
                                    compute_kind=compute_kind)
        elif c.groups:
            gm, gs = _strip(m_sh), _strip(s_sh)

            def body(_, xs, gm=gm, gs=gs):
                gg, mm, ss = xs
                mm, ss = _to(mm, gm, DEVICE), _to(ss, gs, DEVICE)
                mm, ss, cc = _apply(tx, _grads_in(gg, gm), ss, mm, compute_dtype, skip, grad_scale)
                if compute_kind is not None:
                    cc = _to(cc, gm, compute_kind)
                return None, (_to(mm, gm, off.kind), _to(ss, gs, off.kind), cc)

            _, (m, s, cp) = jax.lax.scan(body, None, (g, m, s))
        else:
            if c.host:
                m, s = _to(m, m_sh, DEVICE), _to(s, s_sh, DEVICE)
            m, s, cp = _apply(tx, _grads_in(g, m_sh), s, m, compute_dtype, skip, grad_scale)
            if c.host:
                m, s = _to(m, m_sh, off.kind), _to(s, s_sh, off.kind)
            if compute_kind is not None:
                cp = _to(cp, m_sh, compute_kind)
        results.append(cp if c.host else None)
        out_c.append(cp)
        out_m.append(m)
        out_s.append(s)
    return from_chunks(out_c, layout), OffloadState(out_m, out_s)


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
            sl = lambda x, j: None if x is None else jax.lax.dynamic_slice_in_dim(x, j * per, per, 0)  # noqa: E731
            dev = jax.tree.map(lambda x: _slice_sharding(x, per), m_sh, is_leaf=_is_sharding)
            acc = jax.lax.fori_loop(0, c.loop, lambda j, a, g=g, dev=dev, sl=sl: stats(
                jax.tree.map(lambda x: sl(x, j), g, is_leaf=_is_none), dev, a), acc)
        else:
            acc = stats(g, m_sh, acc)
    return acc


def whole_update(tx, grads, master, opt_state, master_shardings, state_shardings, *,
                 compute_dtype=jnp.bfloat16):
    """Candidate A without chunks: whole master + state in, update, whole out (MaxText's way).

    Same result as `streamed_update` with candidate="whole"; here for callers that keep the plain
    (unchunked) tree layout. -> (compute params, master, opt_state).
    """
    m = _to(master, master_shardings, DEVICE)
    s = _to(opt_state, state_shardings, DEVICE)
    m, s, cp = _apply(tx, grads, s, m, compute_dtype, None)
    kind = jax.tree.leaves(master_shardings, is_leaf=_is_sharding)[0].memory_kind
    return cp, _to(m, master_shardings, kind), _to(s, state_shardings, kind)


__all__ = [
    "DEVICE", "PINNED_HOST", "UNPINNED_HOST", "CANDIDATES", "memory_kinds", "host_memory_kind",
    "with_memory_kind", "is_host", "fetch", "layer_shardings", "scan_layers", "prefetch_scan", "Chunk", "ChunkLayout",
    "chunk_layout", "to_chunks", "from_chunks", "OffloadState", "OffloadLayout", "offload_layout",
    "init_offloaded", "offload_master", "init_chunk", "piece", "merge_chunks", "split_chunks", "chunk_templates",
    "streamed_update", "grad_stats", "whole_update",
]
