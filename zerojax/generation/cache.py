"""The KV cache: its size (and the guard that refuses one that would not fit), the attention mask
of left-padded rows, and one layer's write + attention.

Layout: keys and values each [layers, batch, length, kv_heads, head_dim] in the compute dtype,
carried whole through the layer scan and written with `dynamic_update_slice` at (layer, slot):
with the decode program's cache argument donated, XLA updates it in place (a scan that emitted
each layer's cache as an output would copy the whole cache every token).

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


def cache_bytes(geometry: Geometry, batch: int, length: int, dtype, tensor: int = 1) -> int:
    """Bytes per device of the keys + values for `batch` rows of `length` slots (kv heads split
    over `tensor` ranks where they divide, as the model's tensor rules split them)."""
    heads = geometry.kv_heads // tensor if geometry.kv_heads % tensor == 0 else geometry.kv_heads
    return 2 * geometry.layers * batch * length * heads * geometry.head_dim * np.dtype(dtype).itemsize


def check_cache_fits(nbytes: int, batch: int, length: int, free: int | None) -> None:
    """Raise `CacheTooLargeError` (one line) when `nbytes` exceed `free` (None: unknown, no check;
    CPU reports none)."""
    if free is not None and nbytes > free:
        raise CacheTooLargeError(
            f"zerojax.generate: the KV cache for batch {batch} x length {length} needs {nbytes / 2**30:.2f} GiB "
            f"per device ({nbytes:,} bytes) but the device has {free / 2**30:.2f} GiB free ({free:,} bytes); "
            "generate fewer prompts at a time or fewer new tokens")


def empty(geometry: Geometry, batch: int, length: int, dtype):
    """(keys, values), zeros [layers, batch, length, kv_heads, head_dim]."""
    shape = (geometry.layers, batch, length, geometry.kv_heads, geometry.head_dim)
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


def write_and_attend(keys, values, layer, slot, q, k, v, mask):
    """Write this layer's new k, v [B, T, K, Dh] at `slot` of cache layer `layer`, then attend q
    [B, T, H, Dh] over the layer's first mask.shape[-1] slots -> (keys, values, o [B, T, H, Dh]).
    (The prefill's mask spans the prompt alone: the empty slots after it would double its
    attention's work and its [B, H, T, slots] logits.)

    `jax.nn.dot_product_attention`'s XLA path: grouped kv heads, fp32 logits and softmax, an
    arbitrary mask (cuDNN's takes no such mask)."""
    at = (layer, 0, slot, 0, 0)
    keys = jax.lax.dynamic_update_slice(keys, k[None].astype(keys.dtype), at)
    values = jax.lax.dynamic_update_slice(values, v[None].astype(values.dtype), at)
    span = mask.shape[-1]
    k_all = jax.lax.dynamic_index_in_dim(keys, layer, 0, keepdims=False)[:, :span]
    v_all = jax.lax.dynamic_index_in_dim(values, layer, 0, keepdims=False)[:, :span]
    o = jax.nn.dot_product_attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask=mask,
                                     implementation="xla")
    return keys, values, o


__all__ = ["CacheTooLargeError", "cache_bytes", "check_cache_fits", "empty", "attention_mask", "positions",
           "write_and_attend"]
