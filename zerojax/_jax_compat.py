"""Every use of a private or version-dependent JAX / Flax API, in one place.

zerojax runs on JAX 0.10.x and 0.11.x and the Flax NNX releases beside them. Where they differ, or
where the only way is a private module (`jax._src`), the code asks this module instead, so a new
release is one file to check. Nothing here imports jax at import time: `import zerojax` runs
`backends_started` (through `zerojax.pinned_pool`) before any JAX backend may start, and stays cheap.
"""
from __future__ import annotations

import contextlib
import sys

# JAX's cuDNN attention forward primitive (jax._src.cudnn.fused_attention_stablehlo; the same name
# in JAX 0.10 and 0.11): its outputs are the attention output and the softmax statistics
CUDNN_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"


# ---------------------------------------------------------------------------------------------
# backends and jax.distributed (private modules: read, never patched)


def backends_started(*, unknown: bool = True) -> bool:
    """Whether JAX has started a backend in this process (XLA_FLAGS and the pinned pool's cap were
    read then). Without jax imported: False. A JAX without the private check: `unknown`."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge  # no public equivalent in jax 0.10 / 0.11
    except ImportError:  # pragma: no cover -- a JAX without it
        return unknown
    check = getattr(xla_bridge, "backends_are_initialized", None)
    return unknown if check is None else bool(check())


def detected_cluster():
    """The cluster JAX's own detection finds in this environment (jax._src.clusters), or None
    (none found, or a JAX without it: jax.distributed.initialize() still detects for itself)."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:
        return None
    return next((c for c in ClusterEnv._cluster_types
                 if not c.opt_in_only_method and c.is_env_present()), None)


def distributed_state():
    """jax.distributed's state after initialize(): `.num_processes`, `.process_id`,
    `.coordinator_address`, read without starting the backend."""
    from jax._src.distributed import global_state

    return global_state


# ---------------------------------------------------------------------------------------------
# jaxprs and tracers


def jaxpr_core():
    """`jax.extend.core` (Jaxpr, Var, jaxprs_in_params): the jaxpr types a traced program is read with."""
    from jax.extend import core

    return core


def is_tracer(x) -> bool:
    """Whether `x` is a tracer (inside jit, grad, eval_shape), not a concrete array."""
    import jax

    return isinstance(x, jax.core.Tracer)


def memory_space(x):
    """The memory space JAX's type of `x` carries (arrays and tracers), or None where the JAX has none."""
    import jax

    return getattr(jax.typeof(x), "memory_space", None)


def memory_space_kinds():
    """`jax.memory.Space` (Device, Host, ...), or None where the JAX has no typed memory spaces."""
    import jax

    return getattr(getattr(jax, "memory", None), "Space", None)


# ---------------------------------------------------------------------------------------------
# Flax NNX states and variables


def to_pure_dict(state):
    """An nnx.State as nested dicts of its values."""
    from flax import nnx

    to_pure = getattr(nnx, "to_pure_dict", None)
    return to_pure(state) if to_pure is not None else state.to_pure_dict()


def filter_state(state, *filters):
    """The part of an nnx.State its `filters` select."""
    from flax import nnx

    return nnx.filter_state(state, *filters) if hasattr(nnx, "filter_state") else state.filter(*filters)


def flat_state(state):
    """(path, variable) pairs of an nnx.State."""
    from flax import nnx

    return nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state()


def variable_value(v):
    """The array an nnx Variable holds (a plain value passes through)."""
    return v.get_value() if hasattr(v, "get_value") else getattr(v, "value", v)


def variable_metadata(v) -> dict:
    """An nnx Variable's metadata (sharding names, ...); {} where it has none."""
    return v.get_metadata() if hasattr(v, "get_metadata") else {}


def no_eager_sharding():
    """A context in which annotated variables are not sharded at creation: flax >= 0.12 shards them
    then, which needs a mesh; zerojax shards later. Elsewhere a no-op."""
    from flax import nnx

    use = getattr(nnx, "use_eager_sharding", None)
    return contextlib.nullcontext() if use is None else use(False)
