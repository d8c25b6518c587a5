"""The device mesh, and each ZeRO stage as a choice of `NamedSharding`s.

A ZeRO stage decides which of three trees is split over the "data" axis (DESIGN.md, stage table):

| stage | compute params | gradients / accumulator | fp32 master + optimizer state |
|-------|----------------|-------------------------|-------------------------------|
| 0     | replicated     | replicated              | replicated                    |
| 1     | replicated     | replicated              | sharded                       |
| 2     | replicated     | sharded                 | sharded                       |
| 3     | sharded        | sharded                 | sharded                       |

"Replicated" here means replicated over "data": a parameter may still be split over "tensor"
through its logical axis names (flax's `nnx.with_partitioning`) mapped by ordered rules.
Everything here is a pure function of shapes, metadata and a mesh; nothing touches arrays.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA = "data"
TENSOR = "tensor"
PIPE = "pipe"
AXES = (DATA, TENSOR)

# Logical axis name -> mesh axis, first match wins (flax's logical_axis_rules). Used only when the
# mesh's "tensor" axis is larger than 1; every other logical name stays unsharded.
DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("mlp", TENSOR),
    ("heads", TENSOR),
    ("qkv", TENSOR),
    ("vocab", TENSOR),
)


def make_mesh(data: int | None = None, tensor: int = 1, devices: Sequence[Any] | None = None,
              pipe: int = 1) -> Mesh:
    """A ("data", "tensor") mesh over `devices` (default: all devices of all processes); with
    `pipe` > 1 (pipeline.stages) a ("data", "pipe", "tensor") mesh.

    Axes are `AxisType.Auto` (GSPMD propagation): with explicit axes ordinary ops such as an
    embedding gather would need an `out_sharding` argument.
    """
    devices = list(jax.devices() if devices is None else devices)
    if tensor < 1 or len(devices) % tensor:
        raise ValueError(
            f"tensor={tensor} (tensor_parallel.autotp_size) must divide the {len(devices)} devices"
        )
    if pipe < 1 or len(devices) % (pipe * tensor):
        raise ValueError(f"pipe={pipe} (pipeline.stages) x tensor={tensor} must divide the {len(devices)} "
                         f"devices; stage counts that would: "
                         f"{[s for s in range(1, len(devices) + 1) if len(devices) % (s * tensor) == 0]}")
    if data is None:
        data = len(devices) // (tensor * pipe)
    inner = tensor * pipe
    if data * inner != len(devices):
        if data * inner > len(devices):
            raise ValueError(f"mesh data={data} x pipe={pipe} x tensor={tensor} needs {data * inner} devices; "
                             f"only {len(devices)} are available")
        devices = devices[: data * inner]
    shape, names = ((data, pipe, tensor), (DATA, PIPE, TENSOR)) if pipe > 1 else ((data, tensor), AXES)
    axis_types = (AxisType.Auto,) * len(shape)
    if len(devices) == len(jax.devices()) and devices == list(jax.devices()):
        # jax.make_mesh picks a physical device order that keeps "tensor" neighbours close.
        return jax.make_mesh(shape, names, axis_types=axis_types)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), names, axis_types=axis_types)


def pipe_size(mesh: Mesh) -> int:
    return int(mesh.shape.get(PIPE, 1))


def data_size(mesh: Mesh) -> int:
    return int(mesh.shape.get(DATA, 1))


# ---------------------------------------------------------------------------------------------
# Logical axes -> mesh axes


def _logical_axes(variable) -> tuple | None:
    """Logical axis names a flax Variable was annotated with, across flax versions."""
    get = getattr(variable, "get_metadata", None)
    meta = get() if get is not None else getattr(variable, "metadata", {}) or {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names:
            if isinstance(names, NamedSharding):
                names = names.spec
            return tuple(names)
    return None


def tensor_specs(state, mesh: Mesh, rules=None) -> Any:
    """PartitionSpecs (tensor axes only) for every Variable of an `nnx.State`, as a pure dict.

    The result has the structure of `state.to_pure_dict()`; leaves without logical axes get P().
    """
    from flax import nnx

    specs = jax.tree.map(
        lambda v: logical_to_mesh(_logical_axes(v), mesh, rules),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return _pure(specs)


def _pure(state):
    # nnx.State.to_pure_dict() without requiring array leaves
    out = {}
    for key, value in state.items():
        if hasattr(value, "items"):
            out[key] = _pure(value)
        else:
            out[key] = value.get_value() if hasattr(value, "get_value") else getattr(value, "value", value)
    return out


def logical_to_mesh(names: Iterable | None, mesh: Mesh, rules=None) -> P:
    """Translate logical axis names with ordered rules; keep names that are mesh axes already."""
    if not names:
        return P()
    if rules is None:
        rules = DEFAULT_RULES if mesh.shape.get(TENSOR, 1) > 1 else ()
        if pipe_size(mesh) > 1:  # the stacked layers split into pipeline stages
            rules = (*rules, ("layers", PIPE))
    used: set[str] = set()
    out = []
    for name in names:
        target = None
        if name in mesh.axis_names:
            target = name
        else:
            for logical, mesh_axis in rules:
                if logical == name and mesh_axis is not None and mesh_axis not in used:
                    target = mesh_axis
                    break
        if target is not None and mesh.shape[target] > 1 and target not in used:
            used.add(target)
            out.append(target)
        else:
            out.append(None)
    return P(*out)


# ---------------------------------------------------------------------------------------------
# The ZeRO leaf rule


def zero_spec(shape: Sequence[int], base: P, n_data: int, *, min_elements: int = 0) -> P:
    """Add "data" to `base` on the largest dim divisible by `n_data` not used by another axis.

    Leaves with fewer than `min_elements` elements, or with no such dim, keep `base`.
    """
    shape = tuple(shape)
    spec = list(base) + [None] * (len(shape) - len(base))
    if n_data <= 1 or not shape or math.prod(shape) < min_elements:
        return P(*spec)
    if any(DATA == s or (isinstance(s, tuple) and DATA in s) for s in spec):
        return P(*spec)
    free = [i for i, d in enumerate(shape) if spec[i] is None and d % n_data == 0 and d > 0]
    if not free:
        return P(*spec)
    i = max(free, key=lambda i: (shape[i], -i))  # largest; the first of equals
    spec[i] = DATA
    return P(*spec)


class StageShardings(NamedTuple):
    """Sharding trees (same structure as the params) for one ZeRO stage."""

    params: Any   # compute-dtype params
    grads: Any    # gradients and the accumulation buffer
    master: Any   # fp32 master weights (optimizer-state leaves with a param's shape follow these)


def _shapes(tree):
    return jax.tree.map(lambda x: tuple(x.shape), tree)


def stage_specs(shapes, base_specs, stage: int, n_data: int, *, persistence_threshold: int = 0):
    """PartitionSpec trees (params, grads, master) for `stage` from shapes and tensor-only specs."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage={stage!r}; accepted: 0, 1, 2, 3")
    def tree(on: bool, min_elements: int = 0):
        return jax.tree.map(
            lambda b, s: zero_spec(s, b, n_data if on else 1, min_elements=min_elements),
            base_specs, shapes, is_leaf=lambda x: isinstance(x, P),
        )

    return StageShardings(
        params=tree(stage >= 3, persistence_threshold),
        grads=tree(stage >= 2),
        master=tree(stage >= 1),
    )


def stage_shardings(
    abstract_params,
    mesh: Mesh,
    stage: int,
    *,
    base_specs=None,
    persistence_threshold: int = 0,
    memory_kind: str | None = None,
) -> StageShardings:
    """NamedSharding trees for params / grads / master of one stage.

    `abstract_params`: a tree of arrays or ShapeDtypeStructs. `base_specs`: a matching tree of
    PartitionSpecs over the non-"data" axes (e.g. `tensor_specs(nnx_state, mesh)`), or None.
    `memory_kind` applies to the master tree (and so to optimizer moments), e.g. "pinned_host".
    """
    shapes = _shapes(abstract_params)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)  # noqa: E731
    base = base_specs if base_specs is not None else jax.tree.map(lambda s: P(), shapes, is_leaf=is_shape)
    specs = stage_specs(shapes, base, stage, data_size(mesh), persistence_threshold=persistence_threshold)
    named = lambda tree, kind=None: jax.tree.map(  # noqa: E731
        lambda p: NamedSharding(mesh, p, memory_kind=kind), tree, is_leaf=lambda x: isinstance(x, P)
    )
    return StageShardings(named(specs.params), named(specs.grads), named(specs.master, memory_kind))


# ---------------------------------------------------------------------------------------------
# Optimizer state


def opt_state_shardings(
    tx, abstract_master, master_shardings, mesh: Mesh, *, memory_kind: str | None = None
):
    """Shardings for `tx.init(master)`: leaves shaped like a param take that param's sharding.

    Non-param leaves (step counts, loss scale, ...) are replicated on device. Uses
    `optax.tree_map_params` to find which state leaves mirror params; if a transform defeats that,
    falls back to matching by shape (the leaf rule applied to the leaf itself).
    """
    import optax

    abstract_state = jax.eval_shape(tx.init, abstract_master)
    replicated = NamedSharding(mesh, P())
    kind = lambda s: s if memory_kind is None else s.with_memory_kind(memory_kind)  # noqa: E731
    try:
        out = optax.tree_map_params(
            tx,
            lambda _, s: kind(s),
            abstract_state,
            master_shardings,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        if jax.tree.structure(out, is_leaf=lambda x: isinstance(x, NamedSharding)) == jax.tree.structure(
            abstract_state
        ):
            return _fix_mismatches(out, abstract_state, mesh, kind)
    except Exception:  # noqa: BLE001 - fall back to shape matching below
        pass
    return _by_shape(abstract_state, abstract_master, master_shardings, mesh, kind)


def _fix_mismatches(shardings, abstract_state, mesh, kind):
    # A sharding must divide its leaf; if a transform stored something else under a param's slot
    # (e.g. a factored second moment), re-derive from the leaf's own shape.
    def fix(s, x):
        try:
            s.shard_shape(tuple(x.shape))
            return s
        except Exception:  # noqa: BLE001
            return kind(NamedSharding(mesh, zero_spec(x.shape, P(), data_size(mesh))))

    return jax.tree.map(fix, shardings, abstract_state, is_leaf=lambda x: isinstance(x, NamedSharding))


def _by_shape(abstract_state, abstract_master, master_shardings, mesh, kind):
    by_shape: dict = {}
    for x, s in zip(jax.tree.leaves(abstract_master), jax.tree.leaves(master_shardings)):
        by_shape.setdefault((tuple(x.shape), x.dtype), s)
    n = data_size(mesh)

    def pick(x):
        if not getattr(x, "shape", ()):
            return NamedSharding(mesh, P())
        s = by_shape.get((tuple(x.shape), x.dtype))
        if s is None:
            s = NamedSharding(mesh, zero_spec(x.shape, P(), n))
        return kind(s)

    return jax.tree.map(pick, abstract_state)


def replicated(mesh: Mesh, tree) -> Any:
    """A replicated NamedSharding for every leaf of `tree`."""
    s = NamedSharding(mesh, P())
    return jax.tree.map(lambda _: s, tree)


def per_device_bytes(shapes_dtypes, shardings) -> int:
    """Bytes one device holds for a tree of (ShapeDtypeStruct-like, NamedSharding) pairs."""
    total = 0
    for x, s in zip(jax.tree.leaves(shapes_dtypes), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
    return total


__all__ = [
    "DATA", "TENSOR", "PIPE", "DEFAULT_RULES", "make_mesh", "data_size", "pipe_size", "tensor_specs",
    "logical_to_mesh", "zero_spec", "StageShardings", "stage_specs", "stage_shardings",
    "opt_state_shardings", "replicated", "per_device_bytes",
]
