"""Gradient accumulation: one `lax.scan` over micro-batches (after levanter's grad_accum.py).

This is the only place the micro-batch loop lives; a pipeline-parallel schedule replaces it later.

DeepSpeed's arithmetic: each micro-batch loss is divided by gradient_accumulation_steps before
backward (and multiplied by the loss scale under fp16), gradients are summed, and the reported loss
is the mean of the micro-batch losses. The sum is kept in an accumulator of `accum_dtype` (fp32
unless `data_types.grad_accum_dtype` says otherwise), constrained every iteration to the gradient
sharding: at ZeRO stage >= 2 that sharding is split over "data", so XLA reduces each micro-batch's
gradient straight into its shard (a reduce-scatter) instead of all-reducing a full copy.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# loss_fn(params, micro_batch, carry) -> (loss, aux, carry); `carry` is non-trained model state
# (e.g. rng counters) threaded through the micro-batches; aux is a dict of scalars.
LossFn = Callable[[Any, Any, Any], tuple[jax.Array, dict, Any]]


def split_microbatches(batch, steps: int, mesh: Mesh | None = None, axis: str | tuple = "data"):
    """[steps * micro * dp, ...] -> [steps, micro * dp, ...], each micro-batch spread over `axis`
    (a mesh axis, or a tuple of them: the rows' PartitionSpec entry).

    Rows are grouped device-major, as DeepSpeed's ranks see them: with the batch sharded over
    `axis`, device d holds rows [d*steps*micro, (d+1)*steps*micro) and its k-th micro-batch is the
    k-th `micro` of those. The reshape therefore moves no data between devices.
    """
    n = math.prod(int(mesh.shape.get(a, 1)) for a in ((axis,) if isinstance(axis, str) else axis)) \
        if mesh is not None else 1

    def split(x):
        rows = x.shape[0]
        if rows % (steps * n):
            raise ValueError(
                f"batch leading dim {rows} is not divisible by gradient_accumulation_steps={steps} "
                f"x data-parallel size={n}"
            )
        micro = rows // (steps * n)
        rest = x.shape[1:]
        x = x.reshape(n, steps, micro, *rest).swapaxes(0, 1).reshape(steps, n * micro, *rest)
        if mesh is not None and n > 1:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, axis)))
        return x

    return jax.tree.map(split, batch)


def _reduce_aux(stacked: dict) -> dict:
    # Integer metrics are counts (tokens, examples): summed. Floats are per-micro-batch means: averaged.
    def reduce(x):
        if jnp.issubdtype(x.dtype, jnp.integer):
            return x.sum(axis=0)
        return x.astype(jnp.float32).mean(axis=0)

    return jax.tree.map(reduce, stacked)


def accumulate_gradients(
    loss_fn: LossFn,
    params,
    batch,
    *,
    steps: int,
    mesh: Mesh | None = None,
    grad_shardings=None,
    accum_dtype=jnp.float32,
    loss_scale=1.0,
    carry=None,
    add_into: Callable | None = None,
    acc_init=None,
    data_axes: str | tuple = "data",
):
    """Sum of gradients of `loss / steps * loss_scale` over `steps` micro-batches of `batch`.

    Returns `(grads, loss, aux, carry)`: grads in `accum_dtype` and `grad_shardings`, loss the fp32
    mean of the (unscaled) micro-batch losses, aux the reduced auxiliary metrics.
    With steps == 1, accum_dtype=None
    keeps the gradients as they come (no cast, no sharding constraint: host-resident gradients
    stay where they are and are cast chunk by chunk later).
    add_into: `add_into(acc, grads, first) -> acc` sums a micro-batch's gradients into an
    accumulator the caller owns (`acc_init`, a donated buffer whose contents are ignored: `first`
    is True on the first micro-batch, which overwrites it). Host offload of params: the fp32
    accumulator lives in host memory and is added to layer group by layer group on the device, so
    the device never holds a whole fp32 gradient (DeepSpeed accumulates offloaded gradients in
    host memory too).
    data_axes: the mesh axes the batch's rows are split over (`split_microbatches`' axis).
    """
    if steps < 1:
        raise ValueError(f"gradient_accumulation_steps={steps} must be >= 1")

    def micro(mb, carry):
        def objective(p):
            loss, aux, new_carry = loss_fn(p, mb, carry)
            loss = jnp.asarray(loss).astype(jnp.float32)
            return loss / steps * loss_scale, (loss, aux, new_carry)

        grads, (loss, aux, new_carry) = jax.grad(objective, has_aux=True)(params)
        return grads, loss, aux, new_carry

    def constrain(tree):
        if grad_shardings is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, grad_shardings)

    if steps == 1:
        grads, loss, aux, carry = micro(batch, carry)
        if accum_dtype is None:
            return grads, loss, aux, carry
        grads = constrain(jax.tree.map(lambda g: g.astype(accum_dtype), grads))
        return grads, loss, aux, carry

    def body(c, mb):
        acc, carry = c
        grads, loss, aux, carry = micro(mb, carry)
        acc = constrain(jax.tree.map(lambda a, g: a + g.astype(accum_dtype), acc, grads))
        return (acc, carry), (loss, aux)

    micro_batches = split_microbatches(batch, steps, mesh, data_axes)
    if add_into is not None:
        def body_into(c, xs):
            (acc, carry), (mb, k) = c, xs
            grads, loss, aux, carry = micro(mb, carry)
            return (add_into(acc, grads, k == 0), carry), (loss, aux)

        (acc, carry), (losses, aux) = jax.lax.scan(
            body_into, (acc_init, carry), (micro_batches, jnp.arange(steps)))
        return acc, losses.mean(), _reduce_aux(aux), carry
    if accum_dtype is None:
        raise ValueError("accum_dtype=None (keep gradients as they come) needs steps == 1")
    acc = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, accum_dtype), params))
    (acc, carry), (losses, aux) = jax.lax.scan(body, (acc, carry), micro_batches)
    return acc, losses.mean(), _reduce_aux(aux), carry


__all__ = ["accumulate_gradients", "split_microbatches"]
