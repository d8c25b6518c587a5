"""The decode program of a plain model, lowered and compiled from shapes alone (nothing allocated):
for reading what one decode step costs (XLA's cost analysis, the HLO) next to what it must read.

    lowered, compiled = decode_program(model, batch=1, length=384)
    compiled.cost_analysis()["bytes accessed"], compiled.as_text()

`model` may hold real arrays or be `nnx.eval_shape`'s abstract module (an 8B shape costs nothing).
XLA's cost analysis counts a while loop's body once: the figure is one decode iteration with one
pass of the layer scan's body (the LM head, one layer's weights and cache), not all layers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.generation import decoder, sampling
from zerojax.generation.families import geometry_of_config

STOP_SLOTS = 8  # as zerojax.generation.api pads stop ids


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def decode_program(model, *, batch: int, length: int, out_len: int = 16, sampler=None,
                   decode_attention: str = "xla"):
    """(lowered, compiled) decode program of `model` (greedy unless `sampler`) for `batch` rows and
    a cache of `length` slots, compiled for the default backend (decode_attention: generate's)."""
    graphdef, state = nnx.split(model)
    g = geometry_of_config(model.config)
    kv = jax.ShapeDtypeStruct((g.layers, batch, g.kv_heads, length, g.head_dim), model.dtype)
    vocab = model.config.padded_vocab_size
    sampler = sampler or sampling.Sampler()
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    state_in = decoder.DecodeState(kv, kv, S((batch, out_len), i32), S((batch,), i32), S((), i32),
                                   S((batch,), bool), S((batch, vocab if sampler.penalty else 1), bool))
    values = sampling.settings()[1]
    lowered = decoder.decode.lower(_abstract(state), state_in, S((batch,), i32), S((), i32), S((), i32), values,
                                   S((STOP_SLOTS,), i32), jax.random.key(0), source=decoder.ModuleSource(graphdef),
                                   sampler=sampler,
                                   kernel=decoder.check_decode_attention(decode_attention, g, length))
    return lowered, lowered.compile()


def bytes_accessed(compiled) -> float:
    """XLA's "bytes accessed" of a compiled program (one while body counted once)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["bytes accessed"])


__all__ = ["decode_program", "bytes_accessed"]
