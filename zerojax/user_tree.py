"""The user's own parameter tree for a model whose list of blocks the engine runs as one scan.

The engine replaces a provably pure list of blocks (`zerojax.model.stack_blocks`) by a
`StackedBlocks`, whose variables lead with a layer axis: inside, the tree reads
`["layers"]["block"]["attn"]...` with [L, ...] leaves. Everything a user reads or keeps --
`master_params`, `params`, `engine.model`, checkpoints and what is exported from them -- is in the
model's own structure, `["layers"][0]["attn"]...`: `to_user` and `from_user` convert any tree
holding such subtrees (parameters, master weights, each optimizer moment).

`lists`: {path of the stacked list (keys): layers}, from `stacked_lists(module)`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from zerojax.streamed import StreamedLeaf

BLOCK = "block"   # the StackedBlocks attribute holding the stacked block (zerojax.model)


def stacked_lists(module) -> dict[tuple, int]:
    """{key path: layers} of every `StackedBlocks` in `module`'s graph (the engine's stacked lists)."""
    from zerojax.model import StackedBlocks

    return {tuple(_key(k) for k in path): node.layers for path, node in nnx.iter_graph(module)
            if isinstance(node, StackedBlocks)}


class LayerRows(StreamedLeaf):
    """Layer `i` of a stacked leaf a checkpoint reads a layer group at a time (`ChunkRows`: host
    offload), written as a leaf of its own: one block, the layer's rows."""

    def __init__(self, stacked, i: int):
        self.stacked, self.i = stacked, i
        self.shape, self.dtype = tuple(stacked.shape[1:]), np.dtype(stacked.dtype)
        self.chunk_rows = max(self.shape[0], 1) if self.shape else 1

    def _layer(self) -> np.ndarray:
        return np.asarray(self.stacked.row(self.i))

    def blocks(self):
        yield 0, self.shape[0], self._layer()

    def row(self, j: int) -> np.ndarray:
        return self._layer()[j]

    def __array__(self, dtype=None, copy=None):
        return self._layer().astype(dtype or self.dtype)


def take_layer(x, i: int):
    """Layer i of a stacked leaf of a stored tree: a view of a leaf read a layer group at a time
    (`LayerRows`), else the array's slice."""
    return LayerRows(x, i) if hasattr(x, "row") else x[i]


def _key(k):
    return int(k) if isinstance(k, str) and k.isdigit() else k


def _resolve(node, path):
    """The subtree of the dict `node` at `path`, or None."""
    for k in path:
        if not isinstance(node, dict):
            return None
        node = node.get(k, node.get(str(k)) if isinstance(k, int) else None)
        if node is None:
            return None
    return node


def _replaced(node: dict, path, value) -> dict:
    """A copy of the dict `node` with `value` at `path` (the dicts on the way copied, nothing else)."""
    out = dict(node)
    head = path[0] if path[0] in node else str(path[0])
    out[head] = value if len(path) == 1 else _replaced(node[head], path[1:], value)
    return out


def _is_stacked_root(lists):
    def test(node):
        return isinstance(node, dict) and any(
            isinstance(sub := _resolve(node, p), dict) and set(sub) == {BLOCK} for p in lists)
    return test


def _is_user_root(lists):
    def test(node):
        return isinstance(node, dict) and any(
            isinstance(sub := _resolve(node, p), dict) and sub and set(sub) == set(range(n)) for p, n in lists.items())
    return test


def to_user(tree, lists: dict, take: Callable[[Any, int], Any] | None = None):
    """`tree` with every stacked list's `{"block": [L, ...] leaves}` turned into `{0: layer 0, ...}`
    (take(leaf, i) -> layer i of a stacked leaf; default `leaf[i]`). Unchanged without `lists`."""
    if not lists:
        return tree
    take = take or (lambda x, i: x[i])

    def convert(node):
        if not _is_stacked_root(lists)(node):
            return node
        for path, n in lists.items():
            sub = _resolve(node, path)
            if isinstance(sub, dict) and set(sub) == {BLOCK}:
                block = sub[BLOCK]
                node = _replaced(node, path, {i: jax.tree.map(lambda x, i=i: None if x is None else take(x, i), block,
                                                              is_leaf=lambda x: x is None) for i in range(n)})
        return node

    return jax.tree.map(convert, tree, is_leaf=lambda x: _is_stacked_root(lists)(x) or x is None)


def from_user(tree, lists: dict, join: Callable[[list], Any] | None = None):
    """The inverse of `to_user`: `{0: ..., L-1: ...}` joined into `{"block": ...}` (join(layers) ->
    the stacked leaf; default `np.stack` of the layers read into host memory)."""
    if not lists:
        return tree
    join = join or (lambda xs: np.stack([np.asarray(x) for x in xs]))
    none = lambda x: x is None  # noqa: E731

    def convert(node):
        if not _is_user_root(lists)(node):
            return node
        for path, n in lists.items():
            sub = _resolve(node, path)
            if isinstance(sub, dict) and set(sub) == set(range(n)):
                layers = [jax.tree.leaves(sub[i], is_leaf=none) for i in range(n)]
                joined = [None if parts[0] is None else join(list(parts)) for parts in zip(*layers)]
                node = _replaced(node, path, {BLOCK: jax.tree.structure(sub[0], is_leaf=none).unflatten(joined)})
        return node

    return jax.tree.map(convert, tree, is_leaf=lambda x: _is_user_root(lists)(x) or x is None)


__all__ = ["stacked_lists", "to_user", "from_user", "take_layer", "LayerRows", "BLOCK"]
