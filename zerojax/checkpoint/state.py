"""Checkpoints on orbax: save, resume exactly, reshard into another stage / mesh, export weights.

Layout (DeepSpeed's: one directory per tag, and a `latest` file naming the newest):

    save_dir/
      latest                  text file: the newest finalized tag, e.g. "global_step10"
      global_step10/          one orbax checkpoint; written to a tmp dir, renamed on finalize
        meta/                 JSON: format, zerojax version, resolved config, counters, scheduler
                              and data position, model config, client_state, a manifest of every
                              saved leaf (path, shape, dtype)
        master/               fp32 master weights (fp32 runs: the params, which are the master)
        params/               compute-dtype weights (bf16 / fp16 runs only)
        opt_state/            optimizer state (fp16: the loss-scale state around it)
        rest/                 the model's non-Param state: nnx rng keys (as key data) and counts
        streamed/             NVMe offload only: the swapped layer leaves, one zarr array each, written
                              a layer group at a time (zerojax/checkpoint/stream.py); orbax's items
                              hold None there and the metadata's "streamed" record names them
        model.safetensors     stage 3 + stage3_gather_16bit_weights_on_model_save: consolidated
        config.json           compute-dtype weights (GPT-2: Hugging Face layout with config.json;
                              DeepSpeed writes pytorch_model.bin, a torch pickle: we use safetensors)

Every process writes its own shards (orbax, OCDBT); `latest` is replaced (write tmp + os.replace)
by process 0 only after orbax has finalized the tag, so a crash mid-save leaves the previous
checkpoint loadable and `latest` pointing at it. Restore reads each array straight into the
caller's shardings (abstract target = the current state's shapes, dtypes, shardings), so a
checkpoint from any stage or device count loads into any other without gathering on one device.

This module knows pytrees, not engines: `save` takes a `TrainState` in the layout-free form (the
engine converts an offloaded, chunked state with `EngineLayout.to_stored`) plus a small JSON
description of the run; `restore` takes the current state and its shardings as the target and
returns the restored trees; `export` writes weights through the model's own writer
(`zerojax.models.weights_writer`), or flat safetensors.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from zerojax.checkpoint import checksums, space, stream
from zerojax.checkpoint.errors import CheckpointError
from zerojax.checkpoint.tags import LATEST, TMP_MARK, TagError, check_tag
from zerojax.precision import DynamicLossScaleState
from zerojax.train_state import TrainState
from zerojax.version import __version__

FORMAT = "zerojax-checkpoint/1"


# ---------------------------------------------------------------------------------------------
# helpers


def _checkpointer():
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_json(k) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def _manifest(tree) -> list[dict]:
    """[{path, keys, shape, dtype}] for every leaf (prng keys as their key data)."""
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if _is_key(x):
            x = jax.random.key_data(x)
        out.append({"path": jax.tree_util.keystr(path), "keys": [_key_json(k) for k in path],
                    "shape": list(x.shape), "dtype": np.dtype(x.dtype).name})
    return out


def _saveable(tree):
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract(live_tree, shardings=None, dtype=None):
    """ShapeDtypeStructs with shardings: the restore target (prng keys as key data)."""
    def one(x, s=None):
        if stream.is_streamed(x):  # a restore sink (NVMe swap files): filled a group at a time
            return x
        if _is_key(x):
            x = jax.eval_shape(jax.random.key_data, x)
        s = s if s is not None else x.sharding
        return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s)

    if shardings is None:
        return jax.tree.map(one, live_tree)
    return jax.tree.map(one, live_tree, shardings)


def _rewrap_keys(restored, live):
    return jax.tree.map(
        lambda r, x: jax.random.wrap_key_data(r, impl=jax.random.key_impl(x)) if _is_key(x) else r,
        restored, live)


def _tag_dir(save_dir, tag) -> str:
    return os.path.abspath(os.path.join(os.fspath(save_dir), check_tag(tag)))


def list_tags(save_dir) -> list[str]:
    """Finalized tags in `save_dir` (orbax tmp dirs of an interrupted save excluded), by mtime."""
    save_dir = os.fspath(save_dir)
    if not os.path.isdir(save_dir):
        return []
    tags = [d for d in os.listdir(save_dir)
            if TMP_MARK not in d and os.path.isdir(os.path.join(save_dir, d, "meta"))]
    return sorted(tags, key=lambda d: os.path.getmtime(os.path.join(save_dir, d)))


def _resolve_tag(load_dir, tag) -> str:
    load_dir = os.fspath(load_dir)
    found = list_tags(load_dir)
    if tag is not None:
        tag = check_tag(tag)
    else:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.exists(latest):
            raise FileNotFoundError(
                f"no checkpoint to load: {latest!r} does not exist (tags found in {load_dir!r}: "
                f"{found or 'none'}); pass tag=... or save a checkpoint there first")
        with open(latest) as f:
            tag = f.read().strip()
        try:
            check_tag(tag)
        except TagError:
            raise CheckpointError(f"{latest} names {tag!r}, not a checkpoint tag (tags found in {load_dir!r}: "
                                  f"{found or 'none'}); pass tag=... (--tag) to load one of them") from None
    path = _tag_dir(load_dir, tag)
    if tag not in found:
        raise FileNotFoundError(
            f"no finalized checkpoint {path!r} (tags found in {load_dir!r}: {found or 'none'})")
    return tag


def read_meta(load_dir, tag=None) -> dict:
    """The JSON metadata of a checkpoint (tag None: `latest`)."""
    tag = _resolve_tag(load_dir, tag)
    path = _tag_dir(load_dir, tag)
    try:
        meta = _checkpointer().restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 - orbax raises deep, varied errors
        raise _corrupt(load_dir, tag, "meta", e) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path!r}: item 'meta' is not a {FORMAT} metadata record")
    return meta


def verify_files(load_dir, tag) -> bool:
    """The tag's files against the checksums written when it was saved (`zerojax.checkpoint.checksums`),
    by process 0, the verdict shared with the others; CheckpointError naming the first file that
    differs. False where the tag has no checksums (saved before they were written)."""
    others = [t for t in list_tags(load_dir) if t != tag]
    error, ok = None, False
    if jax.process_index() == 0:
        try:
            ok = checksums.verify(_tag_dir(load_dir, tag), others)
        except CheckpointError as e:
            error = e
    if jax.process_count() > 1:
        failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
        if failed and error is None:
            raise CheckpointError(f"{_tag_dir(load_dir, tag)}: process 0 found a file that differs from its "
                                  f"checksum; load another tag ({others or 'none other found'})")
    if error is not None:
        raise error
    return ok


def _corrupt(load_dir, tag, item, e) -> CheckpointError:
    others = [t for t in list_tags(load_dir) if t != tag]
    return CheckpointError(
        f"cannot read item {item!r} of checkpoint {_tag_dir(load_dir, tag)!r}: "
        f"{type(e).__name__}: {str(e)[:400]}. The checkpoint is corrupt or incomplete; "
        f"load another tag ({others or 'none other found'}) with load_checkpoint(dir, tag=...)")


def _host_leaf(x) -> np.ndarray:
    """One array, whole, on this host (several processes: all gather it; leaf by leaf)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _flat_names(tree) -> dict[str, Any]:
    return {".".join(str(_key_json(k)) for k in path): x
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def write_safetensors(params: dict, out_dir, dtype=None) -> str:
    """Consolidated weights as one safetensors file of flat dotted names (any model)."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    cast = (lambda a: np.ascontiguousarray(a, dtype)) if dtype is not None else np.ascontiguousarray
    path = os.path.join(out_dir, "model.safetensors")
    save_file({k: cast(v) for k, v in _flat_names(params).items()}, path, metadata={"format": "np"})
    return path


# ---------------------------------------------------------------------------------------------
# save


def save(save_dir, state: TrainState, *, steps: int, info: dict, tag=None, client_state=None,
         export_weights: Callable | None = None) -> str:
    """Write `state` under save_dir/tag (default global_step{steps}); update `latest`.

    state: the layout-free TrainState (fp32 runs: master None, the params are the master).
    info: JSON description of the run, stored in the metadata: compute_dtype, zero_stage, mesh,
        config, model (the model's `checkpoint_record()`, read back by `export`).
    export_weights: `writer(params, out_dir)`; when given, the compute-dtype params are gathered
        leaf by leaf and written into the tag directory (DeepSpeed's
        stage3_gather_16bit_weights_on_model_save).
    """
    steps = int(steps)
    tag = check_tag(tag) if tag is not None else f"global_step{steps}"
    save_dir = os.fspath(save_dir)
    path = _tag_dir(save_dir, tag)
    fp32 = state.master is None
    items = {"master": state.params if fp32 else state.master, "opt_state": state.opt_state,
             "rest": _saveable(state.rest)}
    if not fp32:
        items["params"] = state.params
    items = {k: v for k, v in items.items() if jax.tree.leaves(v)}  # orbax refuses empty trees
    streamed = {k: _streamed_leaves(k, v) for k, v in items.items()}
    streamed = {k: v for k, v in streamed.items() if v}
    skipped = int(state.skipped_steps)
    meta = {
        "format": FORMAT,
        "zerojax_version": __version__,
        "tag": tag,
        "global_steps": steps,
        "skipped_steps": skipped,
        "global_samples": int(state.global_samples),
        "scheduler_position": steps - skipped,  # lr(k) of the k-th applied update
        "data_position": steps,                 # batches consumed: resume the data iterator here
        **info,
        "process_count": jax.process_count(),
        "items": {k: _manifest(v) for k, v in items.items()},
        # {item: {leaf path: folder in streamed/}}: the leaves written a layer group at a time
        "streamed": {k: {p: name for p, (name, _) in v.items()} for k, v in streamed.items()},
        "client_state": client_state,
    }
    try:
        meta = json.loads(json.dumps(meta))
    except TypeError as e:
        raise TypeError(f"save_checkpoint: client_state must be JSON-serializable "
                        f"(dicts, lists, str, numbers, bool, None): {e}") from e
    trees = {k: jax.tree.map(lambda x: None if stream.is_streamed(x) else x, v) for k, v in items.items()}
    args = {k: ocp.args.PyTreeSave(v) for k, v in trees.items() if jax.tree.leaves(v)}
    if streamed:  # an orbax item of its own: written inside orbax's tmp dir, so the atomic finalize covers it
        args[stream.ITEM] = stream.StreamedSave({name: leaf for v in streamed.values() for name, leaf in v.values()})
    os.makedirs(save_dir, exist_ok=True)
    space.check_room(save_dir, tag, items, extra=space.tree_bytes(state.params) if export_weights is not None else 0)
    # Orbax writes into <tag>.orbax-checkpoint-tmp-*, then renames it to <tag> (atomic finalize). force:
    # a tag saved again replaces the old one (DeepSpeed's behaviour); a tag is a name, never the folder.
    with space.one_line_when_full(save_dir, tag):
        _checkpointer().save(path, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args),
                             force=True)
    if export_weights is not None:
        # leaf by leaf: every process joins each gather, only process 0 keeps the host copy
        keep = jax.process_index() == 0

        def gather(x):
            if hasattr(x, "row"):  # a leaf read a layer group at a time (host offload): written so
                return x if keep else None
            g = _host_leaf(x)
            return g if keep else None

        weights = jax.tree.map(gather, state.params)
        if keep:
            with space.one_line_when_full(save_dir, tag):
                export_weights(weights, path)
        del weights
    if jax.process_index() == 0:
        checksums.write(path)  # before `latest` names the tag
        tmp = os.path.join(save_dir, f".{LATEST}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(save_dir, LATEST))
    _barrier("zerojax_save_checkpoint")
    return path


def _streamed_leaves(item: str, tree) -> dict[str, tuple[str, stream.StreamedLeaf]]:
    """{leaf path: (folder name, leaf)} of the `StreamedLeaf`s in an item's tree."""
    return {jax.tree_util.keystr(path): (stream.leaf_file(item, i), x)
            for i, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(tree)) if stream.is_streamed(x)}


def _barrier(name):
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ---------------------------------------------------------------------------------------------
# load


def _check_shapes(path, item, saved: list[dict], target) -> None:
    want = {e["path"]: e for e in _manifest(target)}
    have = {e["path"]: e for e in saved}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise ValueError(
            f"checkpoint {path!r} item {item!r} does not match the model: leaves the model has but "
            f"the checkpoint lacks: {missing[:6] or 'none'}; leaves saved but not in the model: "
            f"{extra[:6] or 'none'}")
    wrong = [f"leaf {name} was saved with shape {tuple(have[name]['shape'])}, the model expects "
             f"{tuple(e['shape'])}" for name, e in want.items()
             if list(have[name]["shape"]) != list(e["shape"])]
    if wrong:
        more = f" (and {len(wrong) - 8} more)" if len(wrong) > 8 else ""
        raise ValueError(f"checkpoint {path!r} item {item!r} does not fit the model: "
                         + "; ".join(wrong[:8]) + more)


def _restore_item(load_dir, tag, item, target, streamed: dict | None = None):
    """Item `item` into `target` (ShapeDtypeStructs with shardings; `StreamedLeaf` sinks: the NVMe swap
    files). streamed: the metadata's "streamed" record ({item: {leaf path: folder}}).

    Leaves saved streamed are read a block of layers at a time: into a sink group by group, or into an
    array, each process reading its slices. A sink whose leaf orbax holds (a checkpoint saved without
    NVMe: one chunk per shard) gets it read whole into host memory, one leaf at a time."""
    apart = (streamed or {}).get(item, {})
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(target)]
    leaves, treedef = jax.tree.flatten(target)
    whole = [i for i, (p, x) in enumerate(zip(paths, leaves)) if stream.is_streamed(x) and p not in apart]

    def orbax_read(targets, restore_args):
        if all(x is None for x in targets):
            return [None] * len(leaves)
        args = ocp.args.PyTreeRestore(item=treedef.unflatten(targets), restore_args=treedef.unflatten(restore_args))
        try:
            return treedef.flatten_up_to(_checkpointer().restore(
                _tag_dir(load_dir, tag), args=ocp.args.Composite(**{item: args}))[item])
        except Exception as e:  # noqa: BLE001 - orbax raises deep, varied errors
            raise _corrupt(load_dir, tag, item, e) from e

    # orbax reads the arrays it holds first: a corrupt item fails before any swap file is overwritten
    ob = [None if p in apart or stream.is_streamed(x) else x for p, x in zip(paths, leaves)]
    got = orbax_read(ob, [None if x is None else ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape,
                                                                      dtype=x.dtype) for x in ob])
    # a sink's leaf alone per orbax call (orbax's other leaves None: it reads that one only); the export's
    # whole-host targets in one call
    calls = [[i] for i in whole if leaves[i].alone] + [[i for i in whole if not leaves[i].alone]]
    for call in calls:
        one, args = [None] * len(leaves), [None] * len(leaves)
        for i in call:
            one[i] = jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype)
            args[i] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaves[i].dtype)
        read = orbax_read(one, args)
        for i in call:
            rows, read[i] = read[i], None
            leaves[i].fill(lambda lo, hi, rows=rows: rows[lo:hi] if rows.ndim else rows)
            got[i] = leaves[i]
            del rows
    folder = os.path.join(_tag_dir(load_dir, tag), stream.ITEM)
    for i, (p, x) in enumerate(zip(paths, leaves)):
        if p in apart:
            try:
                store = stream.open_leaf(os.path.join(folder, apart[p]))
            except Exception as e:  # noqa: BLE001 - tensorstore's errors
                raise _corrupt(load_dir, tag, f"{item} {p} ({stream.ITEM}/{apart[p]})", e) from e
            if stream.is_streamed(x):
                x.fill(stream.rows_reader(store, x.dtype))
                got[i] = x
            else:
                got[i] = stream.read_array(store, x)
    return treedef.unflatten(got)


def _opt_state_target(path, saved, live, shardings, scalar):
    """(target, finish) for the optimizer state into the live optimizer sharding, its shapes checked:
    `finish(what was read)` is the optimizer state. fp16 <-> bf16 / fp32 keep the moments.

    fp16 wraps the optimizer's state in the loss-scale state (`.inner_state`): an fp16 checkpoint
    loaded without fp16 drops the loss-scale counters; a bf16 / fp32 one loaded with fp16 starts
    the loss scale afresh (initial_scale_power), as turning fp16 on does.
    """
    saved_fp16 = any(e["path"].startswith(".inner_state") for e in saved)
    live_fp16 = isinstance(live, DynamicLossScaleState)

    def checked(target, finish):
        try:
            _check_shapes(path, "opt_state", saved, target)
        except ValueError as e:
            raise ValueError(
                f"{e}. The optimizer state's structure differs (another optimizer type or "
                f"settings); load the weights alone with load_optimizer_states=False") from None
        return target, finish

    if saved_fp16 == live_fp16:
        return checked(_abstract(live, shardings), lambda read: read)
    if live_fp16:  # the loss-scale fields stay the live ones (scalars: never released)
        return checked(_abstract(live.inner_state, shardings.inner_state),
                       lambda inner: live._replace(inner_state=inner))
    fields = {e["path"].lstrip("."): jax.ShapeDtypeStruct((), np.dtype(e["dtype"]), sharding=scalar)
              for e in saved if not e["path"].startswith(".inner_state")}
    try:
        target = DynamicLossScaleState(inner_state=_abstract(live, shardings), **fields)
    except TypeError as e:
        raise ValueError(f"checkpoint {path!r} item 'opt_state': unknown loss-scale state fields "
                         f"{sorted(fields)}; load with load_optimizer_states=False") from e
    return checked(target, lambda read: read.inner_state)


class Restored(NamedTuple):
    """What `restore` read, in the layout-free form; None where it read nothing (the caller keeps
    its own: the optimizer state without load_optimizer_states, the rest and counters under
    load_module_only)."""

    path: str
    params: Any
    master: Any              # None for fp32 runs (the params are the master)
    opt_state: Any
    rest: Any
    counters: dict | None    # step, skipped_steps, global_samples as replicated int32 arrays
    global_steps: int | None
    client_state: Any


def restore(load_dir, current: TrainState, shardings: TrainState, *, compute_dtype, tag=None,
            load_optimizer_states=True, load_module_only=False,
            before_reads: Callable[[list], None] | None = None) -> Restored:
    """Read a checkpoint into the shardings / precision of `current`.

    current: the state to restore into, layout-free (leaves may be ShapeDtypeStructs where the
        caller keeps nothing of them); its `master` is None for fp32 compute.
    shardings: a TrainState of shardings like `current` (the restore targets).
    compute_dtype: the params' dtype (from another dtype: the params are cast from the master).
    before_reads: called once, after every check of the checkpoint against `current` has passed and
        before the first read, with the trees of abstract arrays (shape, dtype, sharding) it is
        about to read (the engine releases there the live arrays the restore replaces, where the
        device has no room for both: `current` is then read for shapes only, but its rest and
        scalar leaves must stay).
    """
    load_dir = os.fspath(load_dir)
    tag = _resolve_tag(load_dir, tag)
    path = _tag_dir(load_dir, tag)
    verify_files(load_dir, tag)
    meta = read_meta(load_dir, tag)
    saved = meta["items"]
    fp32 = current.master is None
    if saved["master"] and isinstance(saved["master"][0]["keys"][0], int):
        raise CheckpointError(
            f"checkpoint {path!r} holds a host-offloaded state chunk by chunk, as zerojax stored it "
            "before checkpoints became layout-free; it cannot be resumed. Export its weights "
            "(`zerojax export`) and start from them (GPT-2: --hf-checkpoint)")
    param_sh = shardings.params
    master_live, master_sh = (current.params, param_sh) if fp32 else (current.master, shardings.master)

    # master: fp32, into the optimizer sharding (fp32 runs: into the param sharding, it is the params)
    target = _abstract(master_live, master_sh, jnp.float32)
    _check_shapes(path, "master", saved["master"], target)
    streamed = meta.get("streamed") or {}
    if not fp32:
        ptarget = _abstract(current.params, param_sh)
        same = "params" in saved and all(e["dtype"] == np.dtype(compute_dtype).name
                                         for e in saved["params"])
        if same:
            _check_shapes(path, "params", saved["params"], ptarget)
    opt_plan = None
    if load_optimizer_states and not load_module_only and jax.tree.leaves(current.opt_state):
        if "opt_state" not in saved:
            raise CheckpointError(f"checkpoint {path!r} has no optimizer state; "
                                  f"load it with load_optimizer_states=False")
        opt_plan = _opt_state_target(path, saved["opt_state"], current.opt_state, shardings.opt_state,
                                     shardings.step)
    rtarget = None
    if jax.tree.leaves(current.rest) and not load_module_only and "rest" in saved:
        rtarget = _abstract(current.rest, shardings.rest)
        _check_shapes(path, "rest", saved["rest"], rtarget)
    if before_reads is not None:
        before_reads([target] + ([ptarget] if not fp32 and same else []) + ([opt_plan[0]] if opt_plan else [])
                     + ([rtarget] if rtarget is not None else []))

    master = _restore_item(load_dir, tag, "master", target, streamed)
    if fp32:
        params, master = master, None
    else:
        if same:
            params = _restore_item(load_dir, tag, "params", ptarget, streamed)
        elif any(stream.is_streamed(x) for x in jax.tree.leaves(target)):
            # the master went to the swap files: the params read from the saved master, cast on reading
            params = _restore_item(load_dir, tag, "master", ptarget, streamed)
        else:  # from an fp32 run (or another compute dtype): the step's own cast of the master
            cast = lambda t: jax.tree.map(lambda x: x.astype(compute_dtype), t)  # noqa: E731
            params = jax.jit(cast, out_shardings=param_sh)(master)

    opt_state = None
    if opt_plan is not None:
        opt_target, finish = opt_plan
        opt_state = finish(_restore_item(load_dir, tag, "opt_state", opt_target, streamed))
    rest = None
    if rtarget is not None:
        rest = _rewrap_keys(_restore_item(load_dir, tag, "rest", rtarget, streamed), current.rest)

    counters = steps = None
    if not load_module_only:  # DeepSpeed's load_module_only: the weights only; the run's counters stay
        steps = meta["global_steps"]
        put = lambda v: jax.device_put(jnp.asarray(v, jnp.int32), shardings.step)  # noqa: E731
        counters = dict(step=put(steps), skipped_steps=put(meta["skipped_steps"]),
                        global_samples=put(meta["global_samples"]))
    return Restored(path, params, master, opt_state, rest, counters, steps, meta.get("client_state"))


# ---------------------------------------------------------------------------------------------
# export


def export(load_dir, out_dir, tag=None, dtype: str = "fp32", *,
           writer_for: Callable[[dict | None], Callable | None] | None = None) -> str:
    """Consolidated weights of a checkpoint: `writer_for(record)` (the model's `checkpoint_record`
    saved in the metadata) gives the model's own writer (`zerojax.models.weights_writer`: GPT-2
    writes a Hugging Face folder); without one, flat safetensors.

    Reads only the master weights item into host memory (numpy); never the optimizer state.
    """
    np_dtype = {"fp32": np.float32, "bf16": jnp.bfloat16, "fp16": np.float16}.get(dtype)
    if np_dtype is None:
        raise ValueError(f"export dtype={dtype!r}; accepted: fp32, bf16, fp16")
    meta, master = read_master(load_dir, tag)
    writer = (writer_for(meta.get("model")) if writer_for is not None else None) or write_safetensors
    return writer(master, os.fspath(out_dir), dtype=np_dtype)


def read_master(load_dir, tag=None) -> tuple[dict, dict]:
    """(the checkpoint's metadata, its trained weights: the master, a nested dict of whole numpy
    arrays as the model's state names them; a LoRA run's holds its adapters alone). Reads only
    the master item into host memory, never the optimizer state."""
    load_dir = os.fspath(load_dir)
    tag = _resolve_tag(load_dir, tag)
    verify_files(load_dir, tag)
    meta = read_meta(load_dir, tag)
    entries = meta["items"]["master"]
    # zerojax before layout-free checkpoints stored an offloaded master chunk by chunk:
    # [chunk index, *keys of the leaf], layer pieces in layer order ("chunked" layout, no groups)
    n_chunks = 1 + max(e["keys"][0] for e in entries) if isinstance(entries[0]["keys"][0], int) else 0
    if n_chunks:
        chunked = [dict(e, keys=e["keys"][1:]) for e in entries]
        target = [_nested([e for e, c in zip(chunked, entries) if c["keys"][0] == j], chunked)
                  for j in range(n_chunks)]
    else:
        target = _nested(entries)
    if n_chunks:
        restore_args = jax.tree.map(lambda t: ocp.RestoreArgs(restore_type=np.ndarray, dtype=t.dtype), target)
        try:
            master = _checkpointer().restore(_tag_dir(load_dir, tag), args=ocp.args.Composite(
                master=ocp.args.PyTreeRestore(item=target, restore_args=restore_args)))["master"]
        except Exception as e:  # noqa: BLE001
            raise _corrupt(load_dir, tag, "master", e) from e
    else:  # an NVMe run's layer leaves (streamed) read whole too: the export is the whole master
        whole = jax.tree.map(lambda t: _WholeHost(t.shape, t.dtype), target)
        master = _restore_item(load_dir, tag, "master", whole, meta.get("streamed"))
    if n_chunks:  # each leaf's pieces joined on the layers axis
        flat = [jax.tree.flatten(c, is_leaf=lambda x: x is None) for c in master]
        leaves = []
        for i in range(flat[0][1].num_leaves):
            parts = [x for xs, _ in flat if (x := xs[i]) is not None]
            leaves.append(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0))
        master = flat[0][1].unflatten(leaves)
    return meta, jax.tree.map(lambda x: x.rows if isinstance(x, _WholeHost) else x, master)


class _WholeHost(stream.StreamedLeaf):
    """A restore target that gathers a leaf whole into one numpy array (the export): `_restore_item` fills
    it from orbax's numpy read or from a streamed leaf's rows; `rows` is the array."""

    alone = False   # every leaf of the export in one orbax read

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.rows = tuple(shape), np.dtype(dtype), None

    def fill(self, read):
        self.rows = read(0, self.shape[0] if self.shape else 1)

def _nested(entries, every=None) -> dict:
    """The tree of ShapeDtypeStructs that manifest `entries` describe; with `every` (all chunks'
    entries), the leaves a chunk lacks are None, as in the saved chunk."""
    target: dict = {}
    for e in (every or entries):
        node = target
        for k in e["keys"][:-1]:
            node = node.setdefault(k, {})
        node[e["keys"][-1]] = None
    for e in entries:
        node = target
        for k in e["keys"][:-1]:
            node = node[k]
        node[e["keys"][-1]] = jax.ShapeDtypeStruct(tuple(e["shape"]), np.dtype(e["dtype"]))
    return target


__all__ = ["CheckpointError", "Restored", "save", "restore", "export", "read_master", "read_meta", "list_tags",
           "write_safetensors"]
