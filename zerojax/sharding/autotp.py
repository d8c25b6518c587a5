"""AutoTP as DeepSpeed's AutoTP does it: Megatron splits inferred from parameter names and shapes.

For a parameter with no logical axis names (a model written without zerojax in mind), the name of
the module that owns it says what it is: the attention's q / k / v and the MLP's up projections
are column-parallel (their output features split over "tensor"), the attention's output and the
MLP's down projection row-parallel (their input features split), the token embedding and the LM
head vocab-parallel. DeepSpeed's `AutoTP` (deepspeed/module_inject/auto_tp.py) matches the same
Hugging Face / Megatron names; a `tensor_parallel.partition_config.layer_specs` entry still wins.

Shapes: Flax kernels are [in, out] (`nnx.Linear`) or [in, heads, head_dim] / [heads, head_dim,
out] (`nnx.LinearGeneral`, `nnx.Einsum`): a column split takes the heads axis of a 3-d kernel (not
head_dim), a row split the first axis. A stacked layer axis (scanned blocks) leads and is never
split. GQA: a k / v kernel whose kv-head count the tensor size does not divide stays whole.

Fused projections (GPT-2's `c_attn`, Falcon's `query_key_value`) are not inferred: a plain split
of their output axis would hand each rank a slice of q, k and v unequal in heads; such a model
needs logical names or a `layer_specs` entry (the error says so).
"""
from __future__ import annotations

from typing import NamedTuple

COLUMN_NAMES = frozenset({
    "q", "k", "v", "q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
    "gate", "up", "gate_proj", "up_proj", "w1", "w3", "c_fc", "fc1", "fc_in", "wi", "wi_0", "wi_1",
    "dense_h_to_4h", "in_proj",
})
ROW_NAMES = frozenset({
    "o", "o_proj", "out", "out_proj", "wo", "dense", "down", "down_proj", "w2", "c_proj", "fc2",
    "fc_out", "dense_4h_to_h",
})
EMBEDDING_NAMES = frozenset({"embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embed", "embedding",
                             "token_embedding", "embeddings"})
HEAD_NAMES = frozenset({"lm_head", "output", "unembed", "head"})
FUSED_NAMES = frozenset({"c_attn", "qkv", "qkv_proj", "query_key_value", "wqkv", "Wqkv"})
KERNEL_LEAVES = frozenset({"kernel", "weight", "w"})
BIAS_LEAVES = frozenset({"bias", "b"})
EMBEDDING_LEAVES = frozenset({"embedding", "weight"})


class Inferred(NamedTuple):
    """One parameter's inferred split: the axis of its per-layer shape split over "tensor"
    (None: whole), what it was taken for, and whether a kv-head count forced it whole."""

    axis: int | None
    role: str            # "column", "row", "vocab", "whole", "fused"


def _owner(path: tuple[str, ...]) -> tuple[str, str]:
    """(module name, leaf name): the last two path keys, list indices skipped."""
    keys = [k for k in path if not k.isdigit()]
    if len(keys) < 2:
        return "", keys[-1] if keys else ""
    return keys[-2], keys[-1]


def infer(path: tuple[str, ...], shape: tuple[int, ...], *, stacked: bool) -> Inferred | None:
    """The split of the parameter at `path` (its keys) with `shape`, or None when its name says
    nothing (norm scales, position embeddings, unknown modules). `stacked`: the shape leads with
    a layer axis, left out of the returned axis' count."""
    module, leaf = _owner(path)
    own = shape[1:] if stacked else shape
    if module in FUSED_NAMES:
        return Inferred(None, "fused")
    if leaf in KERNEL_LEAVES and len(own) >= 2:
        if module in COLUMN_NAMES:
            return Inferred(1 if len(own) == 3 else len(own) - 1, "column")
        if module in ROW_NAMES:
            return Inferred(0, "row")
        if module in HEAD_NAMES:
            return Inferred(len(own) - 1, "vocab")
    if leaf in BIAS_LEAVES and own:
        if module in COLUMN_NAMES:
            return Inferred(0, "column")
        if module in ROW_NAMES:
            return Inferred(None, "whole")  # added after the row-parallel all-reduce
        if module in HEAD_NAMES:
            return Inferred(0, "vocab")
    if leaf in EMBEDDING_LEAVES and len(own) == 2 and (module in EMBEDDING_NAMES or module == ""):
        return Inferred(0, "vocab")
    if module in EMBEDDING_NAMES and leaf in EMBEDDING_LEAVES | {"embedding"} and len(own) == 2:
        return Inferred(0, "vocab")
    return None


__all__ = ["infer", "Inferred", "COLUMN_NAMES", "ROW_NAMES", "EMBEDDING_NAMES", "HEAD_NAMES",
           "FUSED_NAMES"]
