"""`from_hf` / `to_hf`: a Hugging Face folder of any family zerojax runs, in and out, dispatched on
config.json's model_type (gpt2 -> `GPT2`; llama, mistral, qwen2, qwen3 -> `Llama`)."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

from flax import nnx

from zerojax.models.gpt2 import GPT2
from zerojax.models.hf import MAX_SHARD_BYTES, get_path, set_path, load_hf, save_hf
from zerojax.models.hf_llama import read_leaves, save_llama_hf
from zerojax.models.llama import Llama


def _read_model_type(path: str) -> str:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"no config.json in {path!r}")
    with open(cfg_file) as f:
        return json.load(f).get("model_type", "gpt2")


def _module_from_leaves(make, leaves, param_dtype):
    """make() built abstractly (nnx.eval_shape), its parameters filled from `leaves` (our path,
    numpy array) one at a time: each converted to a device array and dropped before the next."""
    import jax
    import jax.numpy as jnp

    abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(state)
    filled: dict = {}
    for path, a in leaves:
        want = get_path(shapes, path).shape
        if tuple(a.shape) != tuple(want):
            raise ValueError(f"{'/'.join(path)}: the checkpoint's shape {a.shape}, the model's {want}")
        set_path(filled, path, jnp.asarray(a, param_dtype))
        del a
    missing = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)
               if not _has(filled, [getattr(k, "key", k) for k in p])]
    if missing:
        raise ValueError(f"parameters the checkpoint did not fill: {missing[:8]}")
    nnx.replace_by_pure_dict(state, filled)
    return nnx.merge(graphdef, state)


def _has(tree, path):
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return False
        tree = tree[key]
    return True


def from_hf(path, dtype=None, **model_kwargs):
    """The model of a local Hugging Face folder (config.json + `model.safetensors`, or shards with
    `model.safetensors.index.json`), by its config's model_type: gpt2 -> `GPT2`; llama, mistral,
    qwen2, qwen3 -> `zerojax.models.llama.Llama`. `model(input_ids)` gives fp32 logits over the
    checkpoint's vocabulary. Read tensor by tensor, each stacked leaf placed before the next is
    read. dtype: the parameters' storage dtype (default float32); model_kwargs go to the model
    (compute dtype, remat_policy, attention_impl, ...)."""
    import jax.numpy as jnp

    path = os.fspath(path)
    kind = _read_model_type(path)
    param_dtype = jnp.dtype(dtype or jnp.float32)
    if kind == "gpt2":
        config, params = load_hf(path)

        def leaves():  # numpy leaves handed over (and released) one at a time
            stack = [((), params)]
            while stack:
                prefix, tree = stack.pop()
                for key in list(tree):
                    value = tree.pop(key)
                    if isinstance(value, dict):
                        stack.append(((*prefix, key), value))
                    else:
                        yield (*prefix, key), value

        make = lambda: GPT2(config, rngs=nnx.Rngs(0), param_dtype=param_dtype, **model_kwargs)  # noqa: E731
        return _module_from_leaves(make, leaves(), param_dtype)
    config, leaves = read_leaves(path)
    make = lambda: Llama(config, rngs=nnx.Rngs(0), param_dtype=param_dtype, **model_kwargs)  # noqa: E731
    return _module_from_leaves(make, leaves, param_dtype)


def to_hf(model, out_dir, dtype=None, *, max_shard_size: int = MAX_SHARD_BYTES) -> str:
    """Write `model` (a `GPT2` or a `Llama`) as a Hugging Face folder that `transformers` loads:
    config.json + model.safetensors, or shards of at most `max_shard_size` bytes with
    model.safetensors.index.json (transformers' default 5 GB). dtype: the saved dtype (default:
    the parameters'). Returns the weights file's (or the index's) path."""
    out_dir = os.fspath(out_dir)
    if isinstance(model, GPT2):
        return save_hf(model, model.config, out_dir, dtype=dtype, max_shard_size=max_shard_size)
    if isinstance(model, Llama):
        return save_llama_hf(model, model.config, out_dir, dtype=dtype, max_shard_size=max_shard_size)
    raise TypeError(f"to_hf: {type(model).__name__} is not a zerojax GPT2 or Llama model")
