"""Memory kinds and the per-layer fetch: where an array lives (device / pinned_host /
unpinned_host), moving a layer's params to the device inside the layer scan (`fetch`), and the
prefetching layer scan handed to a model for parameter offload (`prefetch_scan`)."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._jax_compat import memory_space, memory_space_kinds
from zerojax.models.layer_stack import WithFrozen

DEVICE = "device"
PINNED_HOST = "pinned_host"
UNPINNED_HOST = "unpinned_host"

is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731


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
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings, is_leaf=is_sharding)


def host_zeros(shape, dtype, sharding) -> jax.Array:
    """Zeros of `shape` placed by `sharding` (a host memory kind), each shard filled from numpy: a
    zero-filled array built on the device first would need the device memory it exists to spare."""
    shape = tuple(shape)
    return jax.make_array_from_callback(shape, sharding, lambda idx: np.zeros(sharding.shard_shape(shape), dtype))


def is_host(x) -> bool:
    """Whether an array (or a tracer inside jit) lives in host memory."""
    space, kinds = memory_space(x), memory_space_kinds()
    if space is not None and kinds is not None:
        return space == kinds.Host
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return kind in (PINNED_HOST, UNPINNED_HOST)


def fetch(tree, shardings):
    """Bring `tree` to device memory inside jit: `device_put` to each sharding's "device" kind.

    Use on a layer's parameter slice inside the layer scan (stage 3 `offload_param`): `shardings`
    are the per-layer shardings (`layer_shardings(stacked_shardings)`).
    """
    return jax.device_put(tree, with_memory_kind(shardings, DEVICE))


def to_device(tree):
    """`tree` with its host-resident leaves (`is_host`) brought to device memory, each keeping its
    sharding; the others as they are. Inside jit."""
    space = memory_space_kinds()
    return jax.tree.map(lambda a: jax.device_put(a, space.Device) if space is not None and is_host(a) else a, tree)


def layer_shardings(stacked_shardings):
    """Shardings of one layer's slice: each NamedSharding's spec without its leading entry."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(*tuple(s.spec)[1:]), memory_kind=s.memory_kind),
                        stacked_shardings, is_leaf=is_sharding)


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
    `layers` may be a `zerojax.models.layer_stack.WithFrozen`: its frozen part (a LoRA's base) is
    read with each layer (`fetch` takes and returns the pair; a host-resident frozen slice is
    brought to the device here) and gets no gradient.
    """
    with_frozen = isinstance(layers, WithFrozen)
    trained = layers.params if with_frozen else layers
    n = jax.tree.leaves(trained)[0].shape[0]
    # each weight gradient goes where its weight lives (JAX types a cotangent like its primal)
    spaces = jax.tree.map(memory_space, trained)
    host = memory_space_kinds()
    to_home = lambda g, sp: jax.device_put(g, sp) if host is not None and sp == host.Host else g  # noqa: E731

    def take(stacked, frozen, i):  # one layer's slice, read out of host memory by a dynamic index
        pick = lambda t: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), t)  # noqa: E731
        return fetch(WithFrozen(pick(stacked), to_device(pick(frozen))) if with_frozen else pick(stacked))

    def forward(x, stacked, frozen):
        def step(carry, i):
            h, cur = carry
            nxt = take(stacked, frozen, jnp.minimum(i + 1, n - 1))
            return (block(h, cur), nxt), (jax.device_put(h, host.Host) if inputs_to_host else h)

        (h, _), inputs = jax.lax.scan(step, (x, take(stacked, frozen, 0)), jnp.arange(n))
        return h, (inputs, stacked, frozen)

    def backward(res, g):
        inputs, stacked, frozen = res

        def step(carry, xs):
            gh, cur = carry
            h, i = xs
            if inputs_to_host:
                h = jax.device_put(h, host.Device)
            prv = take(stacked, frozen, jnp.maximum(i - 1, 0))
            if with_frozen:  # the weight gradient of the trained part only
                _, vjp = jax.vjp(lambda h, p: block(h, WithFrozen(p, cur.frozen)), h, cur.params)
            else:
                _, vjp = jax.vjp(block, h, cur)
            gh, gw = vjp(gh)
            return (gh, prv), jax.tree.map(to_home, gw, spaces)

        (gx, _), gws = jax.lax.scan(step, (g, take(stacked, frozen, n - 1)), (inputs, jnp.arange(n)),
                                    reverse=True)
        return gx, gws, None  # None: no cotangent for the frozen part

    run = jax.custom_vjp(lambda x, stacked, frozen: forward(x, stacked, frozen)[0])
    run.defvjp(forward, backward)
    return run(x, trained, layers.frozen if with_frozen else None)
