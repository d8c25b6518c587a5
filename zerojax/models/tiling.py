"""A position-wise function run over the sequence one tile at a time (ALST's TiledMLP).

`tiled_over_sequence(fn, x, tile)` computes `fn(x)` for x [B, T, d] as a `lax.scan` over pieces
of `tile` positions, each piece under `jax.checkpoint`: the forward keeps only each piece's input
and the backward recomputes the piece, so a wide intermediate (an MLP's [B, T, 4d] or
[B, T, intermediate]) exists for one tile at a time instead of the whole row. `fn` must act on
each position independently (an MLP, a norm), which makes the result equal to `fn(x)`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def check_tile(tile, name: str) -> int | None:
    """`tile` validated: None (untiled) or an int >= 1 (positions per piece); `name` is the option."""
    if tile is None:
        return None
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"{name}={tile!r}: None (untiled) or the positions per piece, an int >= 1")
    return tile


def tiled_over_sequence(fn, x, tile: int):
    """fn(x) for x [B, T, ...], `tile` positions at a time (T padded to a multiple, then cut back)."""
    B, T = x.shape[:2]
    tile = min(tile, T)
    n = -(-T // tile)
    pad = n * tile - T
    xp = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) if pad else x
    pieces = jnp.moveaxis(xp.reshape(B, n, tile, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one(piece):
        return fn(piece)

    _, out = jax.lax.scan(lambda carry, piece: (carry, one(piece)), None, pieces)
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape(B, n * tile, *out.shape[3:])[:, :T]


__all__ = ["tiled_over_sequence", "check_tile"]
