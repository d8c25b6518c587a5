"""`from_hf` / `to_hf`: a Hugging Face folder of any registered family, in and out, dispatched on
config.json's model_type through `zerojax.models.registry` (gpt2 -> `GPT2`; llama, mistral, qwen2,
qwen3 -> `Llama`)."""
from __future__ import annotations

import json
import os

from zerojax.models import registry
from zerojax.models.hf import MAX_SHARD_BYTES, TensorReader

# safetensors' dtype codes of the floating types a model's weights are stored in
_SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _read_model_type(path: str) -> str:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"no config.json in {path!r}")
    with open(cfg_file) as f:
        return json.load(f).get("model_type", "gpt2")


def from_hf(path, dtype=None, **model_kwargs):
    """The model of a local Hugging Face folder (config.json + `model.safetensors`, or shards with
    `model.safetensors.index.json`), by its config's model_type (the registered family reading it:
    gpt2 -> `GPT2`; llama, mistral, qwen2, qwen3 -> `zerojax.models.llama.Llama`). `model(input_ids)`
    gives fp32 logits over the checkpoint's vocabulary. Read tensor by tensor, each stacked leaf
    placed before the next is read. dtype: the parameters' storage dtype (default float32);
    model_kwargs go to the model (compute dtype, remat_policy, attention_impl, ...)."""
    path = os.fspath(path)
    kind = _read_model_type(path)
    family = registry.for_hf_type(kind)
    if family is None:
        raise ValueError(f"{path!r}: config.json model_type {kind!r}; zerojax reads "
                         f"{', '.join(registry.hf_model_types())}")
    return family.from_hf(path, dtype, **model_kwargs)


def to_hf(model, out_dir, dtype=None, *, max_shard_size: int = MAX_SHARD_BYTES) -> str:
    """Write `model` (of a registered family: `GPT2`, `Llama`, ...) as a Hugging Face folder that
    `transformers` loads: config.json + model.safetensors, or shards of at most `max_shard_size`
    bytes with model.safetensors.index.json (transformers' default 5 GB). dtype: the saved dtype
    (default: the parameters'). Returns the weights file's (or the index's) path."""
    family = registry.for_model(model)
    if family is None:
        raise TypeError(f"to_hf: {type(model).__name__} is not a model of a registered family "
                        f"({', '.join(registry.families())})")
    return family.writer(model, model.config, os.fspath(out_dir), dtype=dtype, max_shard_size=max_shard_size)


def stored_dtype(path) -> str:
    """The dtype a Hugging Face folder's weights are stored in, read as transformers'
    `from_pretrained(dtype="auto")` reads it: config.json's `dtype` (`torch_dtype` before
    transformers 4.56), else the first floating tensor's in the safetensors files. A name such as
    "float32" / "bfloat16"."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    named = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(named, str) and named in _SAFETENSORS_FLOATS.values():
        return named
    with TensorReader(path) as reader:
        for name in reader.names:
            code = reader.dtype_code(name)
            if code in _SAFETENSORS_FLOATS:
                return _SAFETENSORS_FLOATS[code]
    raise ValueError(f"{path!r}: no floating-point tensor in its safetensors files and no dtype in config.json")
