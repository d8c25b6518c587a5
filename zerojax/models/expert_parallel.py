"""Expert parallelism (DeepSpeed-MoE's `ep_size`): each device of an expert-parallel group (a mesh
axis of ep devices) holds E / ep of every sparse layer's experts, and the (token, expert) pairs
travel to their expert's device in the group and back by two all-to-alls over that axis, inside a
`jax.shard_map`. Groups side by side (a data-parallel size larger than ep) each hold every expert
and route their own tokens: the tokens are split over every data-parallel axis, the all-to-alls
run over the expert axis alone.

Dropless: each device sends every device a buffer of N x k rows (its N local tokens' k pairs could
all choose that device's experts), filled up to the pairs that did, the rest marked as padding;
the receiving device sorts what it got by its local expert and runs the same grouped products as
one device does (`zerojax.models.moe.grouped_experts`), padding rows outside every group. Per
token, the same products as without expert parallelism. The receive buffers are ep x N x k rows
of the hidden width: ep times the activations a token-capacity scheme would hold, for no dropped
token and no capacity factor to tune.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _local_experts(h, weights, experts, p, dtype, *, compute, axis: str, ep: int):
    """One device's part: h [N, d] its tokens, weights / experts [N, k] their routing (global
    expert ids), p its experts' kernels (E / ep of them) -> [N, d]."""
    N, k = experts.shape
    d = h.shape[-1]
    E_loc = p["router"]["kernel"].shape[-1] // ep
    C = N * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert, hence by destination device
    sorted_e = flat[order]
    dest = sorted_e // E_loc
    counts = jnp.bincount(dest, length=ep)
    slot = jnp.arange(C) - (jnp.cumsum(counts) - counts)[dest]  # the pair's row in its device's buffer
    send = jnp.zeros((ep, C, d), dtype).at[dest, slot].set(h[order // k].astype(dtype))
    send_ids = jnp.full((ep, C), E_loc, jnp.int32).at[dest, slot].set((sorted_e % E_loc).astype(jnp.int32))
    recv = jax.lax.all_to_all(send, axis, 0, 0).reshape(ep * C, d)
    recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0).reshape(-1)  # E_loc: padding
    by_expert = jnp.argsort(recv_ids, stable=True)
    group_sizes = (recv_ids[:, None] == jnp.arange(E_loc)).sum(0).astype(jnp.int32)
    out = compute(recv[by_expert], p, group_sizes, dtype)
    out = jax.lax.all_to_all(out[jnp.argsort(by_expert)].reshape(ep, C, d), axis, 0, 0)
    pairs = out[dest, slot][jnp.argsort(order)].reshape(N, k, d)  # back in (token, slot) order
    return jnp.einsum("nkd,nk->nd", pairs, weights.astype(dtype))


def expert_parallel_experts(h, weights, experts, p, dtype, *, mesh, axis: str, compute, rows=None):
    """`zerojax.models.moe.grouped_experts` with the experts split over `axis` of `mesh` (every
    leaf of p but the router's split on its leading experts axis, whole over the other axes): h
    [N, d] and the routing [N, k] split on N over `rows` (a PartitionSpec entry: the data-parallel
    axes, `axis` among them; default `axis`). compute(x, p, group_sizes, dtype) -> the experts'
    outputs for rows x grouped by (local) expert (`moe.expert_swiglu`)."""
    ep = mesh.shape[axis]
    if any("kernel_absmax" in entry for entry in p.values()):
        raise ValueError("expert parallelism with nf4 / int4 quantized experts: their block scales are not split "
                         "by expert; quantize \"int8\", or ep_size 1")
    expert_spec = lambda x: P(axis, *([None] * (x.ndim - 1)))  # noqa: E731
    p_specs = {name: jax.tree.map(expert_spec if name != "router" else (lambda x: P()), entry)
               for name, entry in p.items()}
    fn = lambda h, w, e, p: _local_experts(h, w, e, p, dtype, compute=compute, axis=axis, ep=ep)  # noqa: E731
    tokens = P(axis if rows is None else rows)
    # unchecked: the experts' cotangents are summed over the axes their spec leaves out (the
    # expert-parallel groups side by side), the data-parallel gradient sum
    return jax.shard_map(fn, mesh=mesh, in_specs=(tokens, tokens, tokens, p_specs), out_specs=tokens,
                         check_vma=False)(h, weights, experts, p)


__all__ = ["expert_parallel_experts"]
