"""An engine's checkpoint save / load: its state through its layout (`zerojax.engine.layout.EngineLayout`)
to the layout-free form `checkpoint.state` stores, and back, with the device memory a restore needs.

Takes the layout and the state, never the engine: `Engine.save_checkpoint` / `load_checkpoint` are
thin calls into `save_engine_state` / `load_engine_state`.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax import byte_sizes, user_tree
from zerojax.checkpoint import files as checkpoint_files
from zerojax.checkpoint import lock as checkpoint_lock
from zerojax.checkpoint import state as checkpoint
from zerojax.checkpoint.finite import NonFiniteState, first_nonfinite
from zerojax.checkpoint.tags import check_tag
from zerojax.models import weights_writer
from zerojax.offload.memory_kinds import host_memory_kind, is_host
from zerojax.sharding.partition import held_bytes
from zerojax.train_state import TrainState


def save_engine_state(layout, state: TrainState, save_dir, *, steps: int, model_record, tag=None,
                      client_state=None, keep: int | None = None) -> str:
    """DeepSpeed's save_checkpoint for an engine's `state` under `layout`; returns the checkpoint
    path. keep=N: then delete all but the N newest checkpoints, never `latest`'s."""
    if keep is not None:
        checkpoint_files.check_keep(keep)
    if tag is not None:
        tag = check_tag(tag)
    cfg = layout.cfg
    export = None
    if layout.stage == 3 and cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        export = weights_writer(model_record) or checkpoint.write_safetensors
    info = {"compute_dtype": np.dtype(layout.compute_dtype).name, "zero_stage": layout.stage,
            "mesh": {k: int(v) for k, v in layout.mesh.shape.items()}, "config": cfg.to_dict(),
            "model": model_record}
    # NVMe offload: the swapped layers' leaves are streamed from the files a group at a time
    stored = layout.to_stored(state, stream=True)
    bad = first_nonfinite(stored)
    if bad is not None:
        latest = checkpoint_files.latest_tag(save_dir)
        raise NonFiniteState(
            f"checkpoint of step {steps} not written: {bad} holds inf or NaN (a checkpoint is written only from "
            f"finite weights and optimizer state); the newest checkpoint in {save_dir} is "
            + (f"{latest!r}, untouched" if latest else "none"))
    lists = _user_lists(layout)
    if lists:  # a list of blocks the engine stacked: stored as the model's own list
        stored = user_tree.to_user(stored, lists, take=user_tree.take_layer)
        info["layer_lists"] = {_list_name(p): n for p, n in lists.items()}
    with checkpoint_lock.holding(save_dir):  # a second run on this folder is refused, not interleaved
        path = checkpoint.save(save_dir, stored, steps=steps, info=info, tag=tag,
                               client_state=client_state, export_weights=export)
        if keep is not None:
            checkpoint_files.prune(save_dir, keep)
    return path


def load_engine_state(layout, live: TrainState, load_dir, *, free_bytes: Callable[[], int | None], tag=None,
                      load_optimizer_states=True, load_module_only=False):
    """DeepSpeed's load_checkpoint into an engine's `live` state under `layout` -> (the new state, the
    `checkpoint.Restored`). free_bytes(): the device's free memory, None where unknown (CPU): where
    the restore beside the live arrays could exceed it, they are released first; after a restore on
    such a device the state is repacked (`_repacked`)."""
    # NVMe offload: the swapped layers' leaves are written into the files a group at a time
    current, shardings = layout.stored_targets(live, stream=True)
    lists = _user_lists(layout)
    if lists and checkpoint.read_meta(load_dir, tag).get("layer_lists") != {_list_name(p): n for p, n in lists.items()}:
        lists = {}  # saved stacked (before the list was stored as the model's own)
    stacked_shardings = shardings
    if lists:  # read as the model's own list, each layer in its stacked leaf's sharding less the layer axis
        current = user_tree.to_user(current, lists, take=_layer_target)
        shardings = user_tree.to_user(shardings, lists, take=_layer_sharding)
    replaced = [live.params, live.master] + (
        [live.opt_state] if load_optimizer_states and not load_module_only else [])
    released = []

    def make_room(reads):  # after the checkpoint's checks passed, before its reads
        if layout.offload is None:
            short = _needs_room(reads, replaced, free_bytes())
        else:  # the state in host memory: the restore beside it would need the host's memory twice
            mine = jax.local_devices()
            short = held_bytes(reads, mine) + held_bytes(replaced, mine) > byte_sizes.host_free_bytes()
        if short:
            released.extend(x for x in jax.tree.leaves(replaced) if isinstance(x, jax.Array) and x.ndim)
            for x in released:
                x.delete()

    try:
        got = checkpoint.restore(load_dir, current, shardings, compute_dtype=layout.compute_dtype, tag=tag,
                                 load_optimizer_states=load_optimizer_states,
                                 load_module_only=load_module_only, before_reads=make_room)
    except Exception as e:
        if released:
            raise checkpoint.CheckpointError(
                f"{e}\n(to make room for the restore this engine released its parameters and optimizer "
                "state first, the device having too little memory free for both, so it holds no "
                "trainable state now: build a new engine and load a readable checkpoint)") from e
        raise
    if lists:
        got = _restacked(got, lists, stacked_shardings)
    master, opt_state = layout.from_stored(got.master, got.opt_state)
    if layout.offload is not None:
        # the chunks hold the stored leaves themselves: dropped from `got`, each batch of fp32 leaves
        # the host split converts is freed as its remainders are made (the fp32 master whole once)
        got = got._replace(master=None, opt_state=None)
    master = layout.split_master(master, got.params, to_split=True, consume=layout.offload is not None)
    state = live._replace(
        params=got.params, master=master,
        opt_state=live.opt_state if opt_state is None else opt_state,
        rest=live.rest if got.rest is None else got.rest, **(got.counters or {}))
    if layout.offload is None and free_bytes() is not None:  # a GPU, not CPU
        # superseded: the live arrays the restore replaced, what it read but converted (the
        # split master's fp32 read)
        state = _repacked(state, superseded=(replaced, got.params, got.master, got.opt_state, got.rest))
    return state, got


def _user_lists(layout) -> dict:
    """The stacked lists a checkpoint stores as the model's own list: all but under NVMe offload,
    whose swap files stream whole stacked leaves (a checkpoint's leaves are then stacked)."""
    return {} if layout.streams_nvme() else layout.layer_lists


def _list_name(path) -> str:
    return ".".join(str(k) for k in path)


def _layer_target(x, i):
    return None if x is None else jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype)


def _layer_sharding(s, i):
    """One layer's sharding: the stacked leaf's, its layer axis dropped."""
    if not isinstance(s, NamedSharding):
        return s
    spec = tuple(s.spec)[1:]
    return NamedSharding(s.mesh, P(*spec), memory_kind=s.memory_kind)


def _restacked(got, lists, shardings):
    """`got` (read as the model's own lists) with each list stacked again and placed where the
    engine keeps it (`shardings`: the stored form's)."""
    def stack(layers):
        if jax.process_count() == 1:  # through host memory: the layers may lie in a host memory kind
            return np.stack([np.asarray(x) for x in layers])
        return jnp.stack(layers)

    def restack(tree, where):
        if tree is None:
            return None
        joined = user_tree.from_user(tree, lists, join=stack)
        return jax.tree.map(lambda x, s: jax.device_put(x, s) if isinstance(x, np.ndarray) else x, joined, where,
                            is_leaf=lambda x: x is None)

    return got._replace(params=restack(got.params, shardings.params),
                        master=restack(got.master, shardings.master) if got.master is not None else None,
                        opt_state=restack(got.opt_state, shardings.opt_state) if got.opt_state is not None else None)


def _needs_room(reads, replaced, free: int | None) -> bool:
    """Whether a restore beside the live arrays it replaces could pass the first device's `free`
    memory (never where that is unknown, e.g. CPU). The restore's peak is bounded by everything it
    reads (`reads`: abstract arrays in the stored dtypes, e.g. the fp32 master) plus everything it
    converts that into (the live forms of `replaced`: the params cast from the master, the split
    master's remainders, ...): counting only the reads kept the live state on an H200 capped at
    16 GiB, and the split master's conversion then ran out of memory."""
    if free is None:
        return False
    first = jax.local_devices()[:1]
    return held_bytes(reads, first) + held_bytes(replaced, first) > free


def _repacked(state: TrainState, superseded=()) -> TrainState:
    """The state's device arrays moved to host memory and back, so that they sit packed at the front
    of the device's pool again; first the arrays of `superseded` that the state does not hold are
    freed (now, not when the caller lets go of them: one left in place splits the free range). Why:
    a restore allocates in its reading order (the fp32 master first, freed again by the split
    master's conversion; the stored moments before their cast; the step counters after
    everything), which leaves holes between the arrays that stay; on an H200 capped at 16 GiB
    GPT-2 Large's restored 7.2 GiB left no free range for the step's one 8.4 GiB temporary buffer,
    and the first step after the resume ran out of memory. Allocated anew, one after another, into
    a pool emptied of them, the arrays leave the free memory in one range. Costs one round trip
    over the host link (about 0.3 s for 7 GiB at 50 GB/s). Without a host memory kind the state
    stays as it is. The allocator may pad an array by up to 128 MiB (XLA's BFC allocator keeps a
    free chunk whole when the excess is smaller); that padding is freed with its array."""
    kept = {id(x) for x in jax.tree.leaves(state)}
    for x in jax.tree.leaves(superseded):
        if isinstance(x, jax.Array) and id(x) not in kept and not x.is_deleted():
            x.delete()
    try:
        kind = host_memory_kind()
    except ValueError:
        return state
    leaves, tree = jax.tree.flatten(state)
    moved = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not is_host(x)]
    placed = [leaves[i].sharding for i in moved]
    hosted = jax.device_put([leaves[i] for i in moved], [s.with_memory_kind(kind) for s in placed])
    jax.block_until_ready(hosted)
    for i in moved:  # (jax cannot donate across memory kinds)
        leaves[i].delete()
    for i, h, sharding in zip(moved, hosted, placed):  # one at a time: each next to the one before
        leaves[i] = jax.device_put(h, sharding)
    jax.block_until_ready([leaves[i] for i in moved])
    return jax.tree.unflatten(tree, leaves)


__all__ = ["save_engine_state", "load_engine_state"]
