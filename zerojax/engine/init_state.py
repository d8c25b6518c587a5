"""An engine's initial state, from its layout (`zerojax.engine.layout.EngineLayout`): the fp32
master, the compute copy and the optimizer state built straight into their shardings and memory
kinds (one jit, or a group of leaves at a time where the whole would not fit the device), never a
full copy on one device first. `zerojax.engine.engine.Engine` calls `initial_state` once.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax import offload as O
from zerojax._jax_compat import is_tracer, no_eager_sharding
from zerojax.engine import memory
from zerojax.engine import step as step_mod
from zerojax.engine.step import TrainState, pure_dict
from zerojax.offload.memory_kinds import host_zeros


def initial_state(lay, init_fn, module) -> TrainState:
    """The initial state: built sharded from `init_fn` (a callable model) or placed leaf by
    leaf from `module`'s values (a built model)."""
    values = None
    if init_fn is None:
        _, params, rest = nnx.split(module, nnx.Param, ...)
        values = pure_dict(params), pure_dict(rest)
    if lay.offload is not None:
        return _offloaded_state(lay, init_fn, values)
    if lay.step.split_master:
        return _split_master_state(lay, init_fn, values)
    sh = lay.shardings
    fp32 = lay.compute_dtype == jnp.float32
    # The master lives in the optimizer sharding; with fp32 compute the params are the master.
    target = sh.params if fp32 else sh.master
    if init_fn is not None:
        master, rest = jax.jit(lambda: init_pure(init_fn), out_shardings=(target, lay.rest_shardings))()
    else:
        master = jax.tree.map(lambda x, s: place(x, s, jnp.float32), values[0], target)
        rest = jax.tree.map(place, values[1], lay.rest_shardings)
    if fp32:
        params, master = master, None
        master_view = params
    else:
        cast = lambda t: jax.tree.map(lambda x: x.astype(lay.compute_dtype), t)  # noqa: E731
        params = jax.jit(cast, out_shardings=sh.params)(master)
        master_view = master
    opt_state = jax.jit(lay.tx.init, out_shardings=lay.opt_shardings)(master_view)
    return _fresh_state(lay, params, master, opt_state, rest)


def _split_master_state(lay, init_fn, values) -> TrainState:
    """The device split master's initial state (bf16 params + int16 remainders), allocated
    longest-lived first and the fp32 master, needed only to derive both, last. Why: the GPU
    allocator hands out contiguous ranges from the front of its pool; an fp32 master allocated
    first and freed after the split leaves a hole of 4 bytes a parameter at the front, and the
    step's temporary buffer (one contiguous range, 8.4 GiB for GPT-2 Large at micro 8) then did
    not fit in the 16 GiB the compiled peak (15.65 GiB) promised (an H200 capped at 16 GiB).
    Allocated last, the master's range is freed back into the free tail. The
    optimizer state is initialised from zeros of the master's shapes: zerojax's optimizers
    (`zerojax.optim`) keep no parameter values in their state."""
    sh = lay.shardings
    if init_fn is not None:
        rest = jax.jit(lambda: init_pure(init_fn)[1], out_shardings=lay.rest_shardings)()
        master_of = jax.jit(lambda: init_pure(init_fn)[0], out_shardings=sh.master)
    else:
        rest = jax.tree.map(place, values[1], lay.rest_shardings)
        master_of = lambda: jax.tree.map(lambda x, s: place(x, s, jnp.float32), values[0], sh.master)  # noqa: E731
    opt_state = jax.jit(lambda: lay.tx.init(zeros(lay.abstract_master)), out_shardings=lay.opt_shardings)()
    params = jax.jit(lambda: zeros(lay.abstract_master, lay.compute_dtype), out_shardings=sh.params)()
    abstract_rems = jax.eval_shape(functools.partial(step_mod.stored_master, lay.step), lay.abstract_master)
    rems = jax.jit(lambda: zeros(abstract_rems), out_shardings=sh.master)()
    master = master_of()
    params, rems = split_into_program(lay)(master, params, rems)
    del master
    return _fresh_state(lay, params, rems, opt_state, rest)


def grad_accumulator(lay, params, abstract: bool):
    """offload_param with accumulation: the host-memory gradient accumulator the step adds each
    micro-batch into (`TrainState.grad_accumulator`), allocated shard by shard straight in host
    memory (a zero-filled array built on the device first would need the device memory it
    exists to spare); else None. Its contents are scratch: each step's first micro-batch
    overwrites them."""
    if not step_mod.needs_grad_accumulator(lay.step):
        return None
    dtype = jnp.dtype(lay.step.accum_dtype)
    sh = lay.state_shardings.grad_accumulator
    if abstract:
        return jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, dtype, sharding=s), params, sh)
    return jax.tree.map(lambda p, s: host_zeros(p.shape, dtype, s), params, sh)


def _fresh_state(lay, params, master, opt_state, rest) -> TrainState:
    zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(lay.mesh, P()))  # noqa: E731
    return TrainState(params=params, master=master, opt_state=opt_state, rest=rest,
                      step=zero(), skipped_steps=zero(), global_samples=zero())


def _offloaded_state(lay, init_fn, values) -> TrainState:
    """Master chunks and optimizer states built straight into their memory kinds (one jit)."""
    off, sh, cd, tx = lay.offload, lay.shardings, lay.compute_dtype, lay.tx
    layout_leaves = off.layout.treedef.flatten_up_to

    def build(master):
        chunks = O.to_chunks(master, off.layout)
        states = [tx.init(m) for m in chunks]
        compute = jax.tree.map(lambda x: x.astype(cd), master)
        return chunks, states, compute

    outs = (list(off.master_shardings), list(off.state_shardings), lay.param_shardings)
    groups = init_groups(lay)
    # NVMe: the swapped layers' state is written to the files a layer group at a time
    # (`NvmeTier.init_files`), never built whole in host memory
    to_files = init_fn is not None and lay.nvme is not None and lay.nvme.leaf_state_files(tx) is not None
    split_done = False
    if init_fn is not None and (len(groups) > 1 or to_files):
        skip = lay.nvme.chunk if to_files else None
        chunks, params, rest = _offloaded_by_leaves(lay, init_fn, groups, skip=skip)
        # the host split now, each fp32 chunk freed as its remainder is made, and the moments
        # after it from the chunks' shapes (zerojax's optimizers start from zeros, whatever the
        # weights): host memory never holds the fp32 master beside the final state (32 GB at 8B)
        chunks, split_done = lay.split_master(chunks, params, to_split=True, consume=True), True
        state_sh = lay.nvme.live(list(off.state_shardings), "state") if to_files else off.state_shardings
        m_tmpl, _ = O.chunk_templates(tx, lay.abstract_master, off.layout)
        if skip is not None:  # the swap files' chunk, None in the live state: its state from that
            m_tmpl[skip] = chunks[skip]
        states = [jax.jit(lambda m=m: tx.init(zeros(m)), out_shardings=s)() for m, s in zip(m_tmpl, state_sh)]
        if to_files and not any(is_tracer(x) for x in jax.tree.leaves(states)):
            # (traced: an abstract engine, no files)
            lay.nvme.init_files(tx, lambda i: layout_leaves(init_pure(init_fn)[0])[i], init_limit(lay.options))
    elif init_fn is not None:
        def init():
            p, r = init_pure(init_fn)
            return build(p), r

        (chunks, states, params), rest = jax.jit(init, out_shardings=(outs, lay.rest_shardings))()
    else:
        master = jax.tree.map(lambda x, s: place(x, s, jnp.float32), values[0], sh.master)
        rest = jax.tree.map(place, values[1], lay.rest_shardings)
        with warnings.catch_warnings():
            # the donation frees the fp32 copy where XLA can alias it (fp32 compute params
            # sharded as the master: ZeRO-3); elsewhere no output can take it and JAX says
            # so in a warning the user can do nothing about (`del master` frees it then)
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            chunks, states, params = jax.jit(build, out_shardings=outs, donate_argnums=0)(master)
        del master
    if lay.nvme is not None and not to_files:  # the layers' master and moments into the swap files
        chunks, states = lay.nvme.spill(list(chunks), list(states))
    opt_state = states
    if lay.fp16:
        ls = jax.jit(lambda: lay.step.offload.scaler.init(None),
                     out_shardings=NamedSharding(lay.mesh, P()))()
        opt_state = ls._replace(inner_state=states)
    if not split_done:
        chunks = lay.split_master(list(chunks), params, to_split=True, consume=True)
    return _fresh_state(lay, params, chunks, opt_state, rest)


def init_groups(lay) -> list[list[int]]:
    """Param leaves (flat indices) grouped so that a group's fp32 values stay under
    `options.init_group_bytes` (default: a quarter of the device's memory limit; CPU: no
    limit, one group). One jit builds each group, so the device never holds every fp32 weight."""
    leaves = lay.offload.layout.treedef.flatten_up_to(lay.abstract_master)
    limit = init_limit(lay.options)
    if not limit:
        return [list(range(len(leaves)))]
    groups, size = [[]], 0
    for i, x in enumerate(leaves):
        n = int(np.prod(x.shape)) * 4
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def init_limit(options) -> int:
    """`options.init_group_bytes`, else a quarter of the device's memory limit (0: none known, CPU)."""
    if options.init_group_bytes:
        return options.init_group_bytes
    budget = memory.device_budget()
    return budget // 4 if budget else 0


def _offloaded_by_leaves(lay, init_fn, groups, skip=None):
    """Offload init for models too large to initialise on the device at once: per group of
    leaves, one jit runs the model's initialiser, keeps only that group (XLA drops the other
    leaves' random draws as dead code) and writes its master pieces and compute copy to their
    memory kinds; chunk `skip` (the NVMe tier's, filled by `NvmeTier.init_files`) is left None.
    -> (master chunks, compute params, rest)."""
    off, cd = lay.offload, lay.compute_dtype
    layout = off.layout
    n_chunks = len(layout.chunks)
    m_sh = [layout.treedef.flatten_up_to(s) for s in off.master_shardings]
    p_sh = layout.treedef.flatten_up_to(lay.param_shardings)
    pieces = [[None] * len(layout.stacked) for _ in range(n_chunks)]
    compute = [None] * len(layout.stacked)

    for group in groups:
        def build(group=group):
            leaves = layout.treedef.flatten_up_to(init_pure(init_fn)[0])
            out = []
            for i in group:
                x = leaves[i]
                out.append(([None if j == skip else O.piece(x, layout.stacked[i], c)
                             for j, c in enumerate(layout.chunks)], x.astype(cd)))
            return out

        shardings = [([None if j == skip else m_sh[j][i] for j in range(n_chunks)], p_sh[i]) for i in group]
        for i, (ps, c) in zip(group, jax.jit(build, out_shardings=shardings)()):
            compute[i] = c
            for j in range(n_chunks):
                pieces[j][i] = ps[j]
    rest = jax.jit(lambda: init_pure(init_fn)[1], out_shardings=lay.rest_shardings)()
    chunks = [layout.treedef.unflatten(p) for p in pieces]
    return chunks, layout.treedef.unflatten(compute), rest


def split_into_program(lay):
    """jit(master, params, rems) -> (params, rems): the fp32 master's compute copy and int16
    remainders (EngineOptions.split_master, device) written into the donated `params` / `rems` buffers.
    keep_unused: jit drops unused arguments by default, and a dropped donated buffer is freed, not
    reused (measured on an H200: 2.9 GiB more at init and a fragmented pool)."""
    def split(master, params, rems):
        del params, rems  # only their buffers are used: the outputs alias them
        cast = jax.tree.map(lambda m: m.astype(lay.compute_dtype), master)
        return cast, step_mod.stored_master(lay.step, master)

    return jax.jit(split, donate_argnums=(1, 2), keep_unused=True,
                   out_shardings=(lay.shardings.params, lay.shardings.master))


def zeros(tree, dtype=None):
    """Zeros shaped like the abstract `tree` (in `dtype`, default each leaf's own)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, dtype or s.dtype), tree)


def init_pure(init_fn):
    """(fp32 params, rest) of a fresh model from its init callable, as pure dicts; call under jit."""
    with no_eager_sharding():
        _, p, r = nnx.split(init_fn(), nnx.Param, ...)
    return jax.tree.map(lambda x: x.astype(jnp.float32), pure_dict(p)), pure_dict(r)


def place(x, sharding, dtype=None):
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
        x = x.astype(dtype)
    if jax.process_count() == 1:
        # a copy, never the caller's buffer: the engine donates its state at every step, and a leaf
        # that aliased a model built on the device (another engine's live weights: a PPO critic
        # made from its actor) would be deleted under its owner
        return jax.device_put(x, sharding, may_alias=False)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # rng keys: place the raw key data
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(place(jax.random.key_data(x), sharding), impl=impl)
    host = np.asarray(jax.device_get(x))  # every process built the same model
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


__all__ = ["initial_state", "grad_accumulator", "init_groups", "init_limit", "init_pure", "split_into_program", "place",
           "zeros"]
