"""Hugging Face Llama-family folders in and out: Llama, Mistral, Qwen2, Qwen3.

Torch's `nn.Linear` stores [out, in]; ours are [in, out] with the heads axis spelled out, so a
q_proj [H*Dh, d] is read as its transpose reshaped to [d, H, Dh], o_proj [d, H*Dh] as
[H, Dh, d], gate / up / down as their transposes. Per-layer tensors are stacked on the "layers"
axis one tensor at a time (`hf.TensorReader`). HF's checkpoints are already in the rotate-half
layout our rotary embedding uses: no permutation. A tied model's `lm_head.weight` is not
written (as `save_pretrained` does) and ignored when present.

The Llama family's record (`zerojax.models.registry`) is registered here, beside its reader and writer.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import numpy as np
from flax import nnx

from zerojax.models import registry
from zerojax.models.hf import (
    MAX_SHARD_BYTES,
    TensorReader,
    get_path,
    layer,
    module_from_leaves,
    plain_arrays,
    read_config_json,
    set_path,
    storage_dtype,
    write_tensors,
)
from zerojax.models.llama import MODEL_TYPES, Llama, LlamaConfig, chunked_llama_loss, llama_loss
from zerojax.models.pieces import LlamaPieces

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# transformers' own defaults for keys a config.json may leave out (its config classes)
_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048, rms_norm_eps=1e-6),
    "mistral": dict(max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, sliding_window=4096,
                    num_key_value_heads=8),
    "qwen2": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, num_key_value_heads=32),
    "qwen3": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, num_key_value_heads=32, head_dim=128),
}


def config_from_hf(hf: Mapping, **overrides) -> LlamaConfig:
    """LlamaConfig from a config.json dict; refuses what the model does not run, naming the key."""
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"config.json model_type={kind!r}: the Llama family reads {MODEL_TYPES}")
    get = lambda key, default=None: hf.get(key, _DEFAULTS[kind].get(key, default))  # noqa: E731
    problems = []
    if get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu', SwiGLU)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true (MLP biases)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if isinstance(rope.get("full_attention"), Mapping):  # per-layer-type rope parameters
        rope = dict(rope["full_attention"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        problems.append(f"rope scaling type {rope_type!r} (supported: default, linear, llama3)")
    if hf.get("use_sliding_window") and kind in ("qwen2", "qwen3"):
        problems.append("use_sliding_window=true (per-layer sliding windows)")
    if hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor != 1")
    if problems:
        raise ValueError(f"config.json ({kind}): not supported: " + "; ".join(problems))
    bias = bool(hf.get("attention_bias", False))
    qkv_bias, out_bias = {"llama": (bias, bias), "qwen3": (bias, bias), "qwen2": (True, False),
                          "mistral": (False, False)}[kind]
    eos = hf.get("eos_token_id")
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=get("head_dim"), max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=get("rms_norm_eps"), rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_type=rope_type, rope_factor=float(rope.get("factor", 1.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position_embeddings=rope.get("original_max_position_embeddings"),
        attention_bias=qkv_bias, attention_out_bias=out_bias, qk_norm=kind == "qwen3",
        sliding_window=get("sliding_window") if kind == "mistral" else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        initializer_range=hf.get("initializer_range", 0.02), model_type=kind,
        bos_token_id=hf.get("bos_token_id"), eos_token_id=tuple(eos) if isinstance(eos, list) else eos)
    return LlamaConfig(**{**fields, **overrides})


def config_to_hf(config: LlamaConfig, dtype: str = "float32") -> dict:
    """config.json for `config` (transformers 5's `rope_parameters`, and rope_theta / rope_scaling
    as transformers 4 reads them)."""
    kind = config.model_type
    if kind == "qwen2" and (not config.attention_bias or config.attention_out_bias):
        raise ValueError("qwen2 has q/k/v biases and no o_proj bias: attention_bias=True, attention_out_bias=False")
    if kind in ("llama", "qwen3") and config.attention_bias != config.attention_out_bias:
        raise ValueError(f"{kind}'s attention_bias sets the q/k/v and o_proj biases together; "
                         f"got attention_bias={config.attention_bias}, attention_out_bias={config.attention_out_bias}")
    if kind == "mistral" and (config.attention_bias or config.attention_out_bias):
        raise ValueError("mistral has no attention biases")
    if config.qk_norm != (kind == "qwen3"):
        raise ValueError(f"qk_norm={config.qk_norm} with model_type={kind!r}: only qwen3 has q/k norms")
    if config.sliding_window is not None and kind != "mistral":
        raise ValueError(f"sliding_window with model_type={kind!r}: only mistral's is written")
    rope = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type != "default":
        rope["factor"] = config.rope_factor
    if config.rope_type == "llama3":
        rope.update(low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                    original_max_position_embeddings=config.rope_original_max_position_embeddings
                    or config.max_position_embeddings)
    eos = config.eos_token_id
    out = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.kv_heads,
        "head_dim": config.dim_per_head, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "hidden_act": "silu", "initializer_range": config.initializer_range,
        "tie_word_embeddings": config.tie_word_embeddings, "use_cache": True, "attention_dropout": 0.0,
        "rope_parameters": rope, "rope_theta": config.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if config.rope_type != "default" else None,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "dtype": dtype,
    }
    if kind in ("llama", "qwen3"):
        out["attention_bias"] = config.attention_bias
    if kind == "llama":
        out["mlp_bias"] = False
    if kind == "mistral":
        out["sliding_window"] = config.sliding_window
    if kind in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_hidden_layers)
    return out


def layer_entries(config: LlamaConfig, mlp: bool = True):
    """[(HF name after "model.layers.{i}.", our path under "layers", our per-layer shape, to_ours,
    to_hf)] for this config's tensors (mlp=False: without the dense MLP's). A name with "{e}" is
    one tensor per expert: our leaf's first per-layer axis runs over them, to_ours / to_hf convert
    one expert's tensor; a tuple of names is several tensors fused on our next-to-last axis (gate
    and up: [d, 2, m])."""
    d, m, H, K, Dh = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.kv_heads, config.dim_per_head)
    out = [("input_layernorm.weight", ("input_layernorm", "scale"), (d,), None, None),
           ("post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), (d,), None, None)]
    for name, heads in (("q_proj", H), ("k_proj", K), ("v_proj", K)):
        out.append((f"self_attn.{name}.weight", ("self_attn", name, "kernel"), (d, heads, Dh),
                    lambda a, s=(d, heads, Dh): a.T.reshape(s), lambda a, n=heads * Dh: a.reshape(d, n).T))
        if config.attention_bias:
            out.append((f"self_attn.{name}.bias", ("self_attn", name, "bias"), (heads, Dh),
                        lambda a, s=(heads, Dh): a.reshape(s), lambda a: a.reshape(-1)))
    out.append(("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), (H, Dh, d),
                lambda a: a.T.reshape(H, Dh, d), lambda a: a.reshape(H * Dh, d).T))
    if config.attention_out_bias:
        out.append(("self_attn.o_proj.bias", ("self_attn", "o_proj", "bias"), (d,), None, None))
    if config.qk_norm:
        out += [("self_attn.q_norm.weight", ("self_attn", "q_norm", "scale"), (Dh,), None, None),
                ("self_attn.k_norm.weight", ("self_attn", "k_norm", "scale"), (Dh,), None, None)]
    for name, shape in (("gate_proj", (d, m)), ("up_proj", (d, m)), ("down_proj", (m, d))) if mlp else ():
        out.append((f"mlp.{name}.weight", ("mlp", name, "kernel"), shape, lambda a: a.T, lambda a: a.T))
    return out


def _per_expert(name) -> bool:
    return "{e}" in (name if isinstance(name, str) else name[0])


def _stack_layers(take, name, shape, to_ours, L):
    """One stacked leaf [L, *shape] read tensor by tensor (`take(HF name)`), per expert where the
    name has "{e}", fused where it is a tuple (`layer_entries`)."""
    experts = range(shape[0]) if _per_expert(name) else [None]
    fused = name if isinstance(name, tuple) else (name,)
    stacked = None
    for i in range(L):
        for e in experts:
            parts = [take(f"model.layers.{i}.{n.format(e=e)}") for n in fused]
            parts = [to_ours(a) if to_ours else a for a in parts]
            a = np.stack(parts, axis=-2) if isinstance(name, tuple) else parts[0]
            if stacked is None:
                stacked = np.empty((L, *shape), a.dtype)
            stacked[(i, e) if e is not None else i] = a
    return stacked


def _layer_tensors(name, stacked, i, shape, to_hf):
    """[(HF name, () -> the tensor read when written, HF shape)] of layer i of a stacked leaf:
    one per expert where the name has "{e}", one per fused part where it is a tuple."""
    one = shape[1:] if _per_expert(name) else shape
    fused = name if isinstance(name, tuple) else (name,)
    part_shape = one[:-2] + one[-1:] if isinstance(name, tuple) else one
    hf_shape = to_hf(np.empty(part_shape, np.int8)).shape if to_hf else part_shape
    out = []
    for e in (range(shape[0]) if _per_expert(name) else [None]):
        for j, n in enumerate(fused):
            def get(get_layer=layer(stacked, i), e=e, j=j):  # noqa: B008 - binds this iteration's getter
                a = np.asarray(get_layer())
                a = a if e is None else a[e]
                a = a[..., j, :] if isinstance(name, tuple) else a
                return to_hf(a) if to_hf else a
            out.append((f"model.layers.{i}.{n.format(e=e)}", get, hf_shape))
    return out


def _pad_rows(a, config):
    rows = config.padded_vocab_size
    if a.shape[0] == rows:
        return a
    if a.shape[0] != config.vocab_size:
        raise ValueError(f"embedding has {a.shape[0]} rows; the config has vocab_size={config.vocab_size}")
    return np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


def read_leaves(path: str, dtype=None, *, skip=(), config_from=None, entries=layer_entries, **config_overrides):
    """(LlamaConfig, iterator of (our path, numpy array)) for a Hugging Face folder, one stacked
    leaf at a time (each per-layer tensor read once from the files; the caller consumes a leaf
    before the next is read). dtype: cast to it (default: the file's). skip: tensor names the
    caller reads itself (a sequence classifier's `score.weight`). config_from(config.json dict,
    **overrides) -> config and entries(config) -> `layer_entries` rows: another family's (the
    mixture-of-experts one, `zerojax.models.hf_moe`); default this family's."""
    with open(os.path.join(path, "config.json")) as f:
        config = (config_from or config_from_hf)(json.load(f), **config_overrides)

    def leaves():
        with TensorReader(path) as reader:
            used = set()

            def take(name):
                used.add(name)
                a = reader.get(name)
                return a if dtype is None else a.astype(dtype)

            yield ("embed_tokens",), _pad_rows(take("model.embed_tokens.weight"), config)
            L = config.num_hidden_layers
            for name, ours, shape, to_ours, _ in entries(config):
                yield ("layers", *ours), _stack_layers(take, name, shape, to_ours, L)
            yield ("norm", "scale"), take("model.norm.weight")
            if not config.tie_word_embeddings:
                yield ("lm_head",), _pad_rows(take("lm_head.weight"), config)
            extra = [k for k in reader.names if k not in used and k not in skip and not (k == "lm_head.weight"
                                                                         or k.endswith("rotary_emb.inv_freq"))]
            if extra:
                raise ValueError(f"{path!r}: tensors this {config.model_type} model does not have: {sorted(extra)[:8]}")

    return config, leaves()


def load_llama_hf(path: str, dtype=None, **config_overrides) -> tuple[LlamaConfig, dict]:
    """(LlamaConfig, params pure dict of numpy arrays) of a Hugging Face folder (`load_hf`'s shape)."""
    config, leaves = read_leaves(path, dtype, **config_overrides)
    params: dict = {}
    for ours, a in leaves:
        set_path(params, ours, a)
    return config, params


def save_llama_hf(params, config: LlamaConfig, out_dir: str, dtype=None, *,
                  max_shard_size: int = MAX_SHARD_BYTES, head: bool = True, extra=None,
                  config_updates=None, entries=layer_entries, config_json=None) -> str:
    """Write config.json + safetensors (sharded above max_shard_size bytes, with an index) that
    `transformers`' `<Family>ForCausalLM.from_pretrained(out_dir)` loads -> the weights path.
    params: the model, its `nnx.state` or pure dict; dtype: the saved dtype (default: as given).
    Another head (`zerojax.methods.reward`'s `<Family>ForSequenceClassification`): head=False
    leaves the LM head out, extra {HF name: array} adds tensors, config_updates overrides
    config.json keys (architectures, num_labels, ...). entries / config_json(config, dtype name):
    another family's tensors and config.json (`zerojax.models.hf_moe`)."""
    params = plain_arrays(params)
    L, V = config.num_hidden_layers, config.vocab_size
    tensors = []

    def entry(name, get, shape, kind, convert=None):  # get() -> the array, called when written
        out = np.dtype(dtype) if dtype is not None else np.dtype(kind)
        tensors.append((name, shape, out, lambda: convert(get()) if convert else get()))

    def whole(name, a, rows=None):  # read when written (an offloaded run's: a block of rows at a time)
        rows = a.shape[0] if rows is None else rows
        entry(name, lambda: np.asarray(a)[:rows], (rows, *a.shape[1:]), a.dtype)

    emb = get_path(params, ("embed_tokens",))
    d = emb.shape[1]
    whole("model.embed_tokens.weight", emb, V)
    for i in range(L):
        for name, ours, shape, _, to_hf in entries(config):
            stacked = get_path(params, ("layers", *ours))
            if stacked.shape != (L, *shape):
                raise ValueError(f"layers/{'/'.join(ours)}: shape {stacked.shape}, expected {(L, *shape)}")
            for hf_name, get, hf_shape in _layer_tensors(name, stacked, i, shape, to_hf):
                entry(hf_name, get, hf_shape, stacked.dtype)
    whole("model.norm.weight", get_path(params, ("norm", "scale")))
    if head and not config.tie_word_embeddings:
        whole("lm_head.weight", get_path(params, ("lm_head",)), V)
    for name, a in (extra or {}).items():
        whole(name, np.asarray(a))
    assert d == config.hidden_size
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**(config_json or config_to_hf)(config, np.dtype(tensors[0][2]).name), **(config_updates or {})},
                  f, indent=2, sort_keys=True)
    return write_tensors(tensors, out_dir, max_shard_size)


def config_from_record(record: Mapping) -> LlamaConfig:
    """The LlamaConfig of a checkpoint's `checkpoint_record()` (JSON lists back to tuples)."""
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    cfg = {k: (tuple(v) if isinstance(v, list) else v) for k, v in record["config"].items() if k in fields}
    return LlamaConfig(**cfg)


def read_llama(path: str, dtype=None, **model_kwargs) -> Llama:
    """The Llama family's reader (`from_hf` for llama, mistral, qwen2, qwen3)."""
    param_dtype = storage_dtype(dtype)
    config, leaves = read_leaves(path)
    make = lambda: Llama(config, rngs=nnx.Rngs(0), param_dtype=param_dtype, **model_kwargs)  # noqa: E731
    return module_from_leaves(make, leaves, param_dtype)


# ------------------------------------------------------------------------------ the family


# LlamaConfig fields that do not change the model a checkpoint holds
_NOT_SHAPE = ("initializer_range", "bos_token_id", "eos_token_id")

registry.register(registry.ModelFamily(
    name="llama", label="the Llama family", config_class=LlamaConfig, model_class=Llama,
    # the published shapes; the test shapes renamed so that "tiny" stays GPT-2's
    shapes={**{s: s for s in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-0.5b", "qwen3-0.6b",
                              "mistral-7b", "mistral-7b-v0.3")},
            "tiny-llama": "tiny", "tiny-qwen2": "tiny-qwen2", "tiny-qwen3": "tiny-qwen3"},
    loss=llama_loss, chunked_loss=chunked_llama_loss, hf_model_types=MODEL_TYPES, from_hf=read_llama,
    writer=save_llama_hf, config_from_record=config_from_record,
    hf_config=lambda path: config_from_hf(read_config_json(path)),
    shape_keys=tuple(f.name for f in dataclasses.fields(LlamaConfig) if f.name not in _NOT_SHAPE),
    peft=registry.PeftTargets(
        stack="layers", prefix="model.layers.{i}.",
        linears={"self_attn.q_proj": (("self_attn", "q_proj"), 1), "self_attn.k_proj": (("self_attn", "k_proj"), 1),
                 "self_attn.v_proj": (("self_attn", "v_proj"), 1), "self_attn.o_proj": (("self_attn", "o_proj"), 2),
                 "mlp.gate_proj": (("mlp", "gate_proj"), 1), "mlp.up_proj": (("mlp", "up_proj"), 1),
                 "mlp.down_proj": (("mlp", "down_proj"), 1)},
        savable={"embed_tokens": ("embed_tokens", "model.embed_tokens.weight"),
                 "lm_head": ("lm_head", "lm_head.weight")}),
    label_of=lambda shape, config: f"{shape} ({config.model_type})",
    pieces=LlamaPieces))


