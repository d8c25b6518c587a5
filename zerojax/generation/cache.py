"""The KV cache: its size (and the guard that refuses one that would not fit), the attention mask
of left-padded rows, and one layer's write + attention.

Layout: keys and values each [layers, batch, kv_heads, length, head_dim] in the compute dtype,
carried whole through the layer scan and written with `dynamic_update_slice` at (layer, slot):
with the decode program's cache argument donated, XLA updates it in place (a scan that emitted
each layer's cache as an output would copy the whole cache every token). The kv heads sit before
the slots so that the attention's two batched dots (batch dims batch and kv heads) read a layer's
cache as it lies: with [.., length, kv_heads, ..] XLA transposed each layer's keys and values into
a new buffer every token (a read and a write of the whole cache per decode step on top of the
attention's own read: at Llama-3.1-8B, batch 64 x 1024 slots, 17 GB more traffic per step by count).

Rows are left-padded (see `zerojax.generation.buckets`): every row writes the same slot at each
step, so a write is one `dynamic_update_slice` at a scalar index, not a per-row scatter; each row's
positions (rotary angles, GPT-2's position rows) are its slot minus its padding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.generation.families import Geometry


class CacheTooLargeError(MemoryError):
    """The KV cache of a generate call would not fit the device's free memory."""


def per_rank(heads: int, tensor: int) -> int:
    """Heads a tensor rank holds: split over `tensor` ranks where they divide, as the model's tensor
    rules split them, else all."""
    return heads // tensor if heads % tensor == 0 else heads


def cache_bytes(geometry: Geometry, batch: int, length: int, dtype, tensor: int = 1) -> int:
    """Bytes per device of the keys + values for `batch` rows of `length` slots (`per_rank` kv heads)."""
    return (2 * geometry.layers * batch * length * per_rank(geometry.kv_heads, tensor) * geometry.head_dim
            * np.dtype(dtype).itemsize)


def check_cache_fits(nbytes: int, batch: int, length: int, free: int | None, scores: int = 0) -> None:
    """Raise `CacheTooLargeError` (one line) when `nbytes` of cache plus `scores` (the prefill's
    attention scores of one piece, held beside it) exceed `free` (None: unknown, no check; CPU
    reports none)."""
    if free is not None and nbytes + scores > free:
        raise CacheTooLargeError(
            f"zerojax.generate: the KV cache for batch {batch} x length {length} needs {nbytes / 2**30:.2f} GiB "
            f"per device ({nbytes:,} bytes)"
            + (f" and the prefill's attention scores {scores / 2**30:.2f} GiB ({scores:,} bytes)" if scores else "")
            + f" but the device has {free / 2**30:.2f} GiB free ({free:,} bytes); "
            "generate fewer prompts at a time or fewer new tokens")


def empty(geometry: Geometry, batch: int, length: int, dtype):
    """(keys, values), zeros [layers, batch, kv_heads, length, head_dim]."""
    shape = (geometry.layers, batch, geometry.kv_heads, length, geometry.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def attention_mask(query_slots, pad, length: int, window: int | None):
    """bool [B, 1, T, length]: query slot s of row r sees key slot j when the key is no padding of
    the row (j >= pad[r]), not in the future (j <= s) and inside the sliding window (s - j < window).
    A padding query sees itself, so that no softmax row is empty (its output is never read)."""
    j = jnp.arange(length, dtype=jnp.int32)
    s = query_slots[:, None]  # [T, 1]
    visible = (j[None, None] >= pad[:, None, None]) & (j <= s)[None]
    if window is not None:
        visible &= (s - j < window)[None]
    return (visible | (j == s)[None])[:, None]


def positions(query_slots, pad):
    """Each row's positions [B, T] at the query slots: the slot minus the row's padding (clipped
    at 0 on padding, whose outputs are never read)."""
    return jnp.maximum(query_slots[None, :] - pad[:, None], 0).astype(jnp.int32)


def write(keys, values, layer, slot, k, v):
    """This layer's new k, v [B, T, K, Dh] written at `slot` of cache layer `layer`."""
    at = (layer, 0, 0, slot, 0)
    keys = jax.lax.dynamic_update_slice(keys, k.swapaxes(1, 2)[None].astype(keys.dtype), at)
    values = jax.lax.dynamic_update_slice(values, v.swapaxes(1, 2)[None].astype(values.dtype), at)
    return keys, values


def write_and_attend(keys, values, layer, slot, q, k, v, mask):
    """Write this layer's new k, v [B, T, K, Dh] at `slot` of cache layer `layer`, then attend q
    [B, T, H, Dh] over the layer's first mask.shape[-1] slots -> (keys, values, o [B, T, H, Dh]).
    (The prefill's mask spans the prompt alone: the empty slots after it would double its
    attention's work and its [B, H, T, slots] logits.)"""
    keys, values = write(keys, values, layer, slot, k, v)
    span = mask.shape[-1]
    k_all = jax.lax.dynamic_index_in_dim(keys, layer, 0, keepdims=False)[:, :, :span]
    v_all = jax.lax.dynamic_index_in_dim(values, layer, 0, keepdims=False)[:, :, :span]
    return keys, values, attend(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask)


def write_and_attend_kernel(keys, values, layer, slot, q, k, v, first, last):
    """`write_and_attend` of one decode step (T = 1) with the attention as one fused kernel
    (`zerojax.generation.decode_attention`) over each row's visible slots first .. last [B]."""
    from zerojax.generation.decode_attention import decode_attention  # Pallas loads only when used

    keys, values = write(keys, values, layer, slot, k, v)
    return keys, values, decode_attention(q[:, 0], keys, values, layer, first, last)[:, None]


def visible_slots(slot, pad, window: int | None):
    """(first [B], last [B]) int32: the slots a decode step's query at `slot` sees in each row (no
    padding, inside the sliding window), as `attention_mask` draws them."""
    first = pad if window is None else jnp.maximum(pad, slot - (window - 1))
    return first.astype(jnp.int32), jnp.broadcast_to(slot, pad.shape).astype(jnp.int32)


def attend(q, keys, values, mask):
    """Grouped-query attention of q [B, T, H, Dh] over one layer's cache keys, values [B, K, S, Dh]
    under mask bool [B, 1, T, S] -> o [B, T, H, Dh].

    `jax.nn.dot_product_attention`'s XLA path, step for step (fp32 logits from the operands'
    dtype, scaled by 1 / sqrt(Dh), masked with its large negative, fp32 softmax, probabilities cast
    to the cache dtype), with the cache read in its own [B, K, S, Dh] layout (that function wants
    [B, S, K, Dh]; cuDNN's takes no arbitrary mask)."""
    B, T, H, Dh = q.shape
    K = keys.shape[1]
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
    logits = jnp.einsum("btkgd,bksd->bkgts", q.reshape(B, T, K, H // K, Dh), keys, precision=precision,
                        preferred_element_type=jnp.float32)
    logits *= jnp.float32(1.0 / np.sqrt(Dh))
    logits = jnp.where(mask[:, :, None], logits, jnp.float32(-0.7 * np.finfo(np.float32).max))
    probs = jax.nn.softmax(logits, axis=-1).astype(keys.dtype)
    return jnp.einsum("bkgts,bksd->btkgd", probs, values).reshape(B, T, H, Dh)


__all__ = ["CacheTooLargeError", "per_rank", "cache_bytes", "check_cache_fits", "empty", "attention_mask", "positions",
           "write", "write_and_attend", "write_and_attend_kernel", "visible_slots", "attend"]
