"""Hugging Face GPT-2 weights in and out: a local folder with config.json + model.safetensors.

HF's GPT-2 uses Conv1D, whose weight is already [in, out], so kernels need only a reshape
(c_attn [d, 3d] -> [d, 3, heads, head_dim]; attn.c_proj [d, d] -> [heads, head_dim, d]) and
stacking over layers. The attn.bias / attn.masked_bias causal-mask buffers are ignored; the
lm_head is tied to wte, so HF omits lm_head.weight on save and so do we.

The params tree is the pure-dict form of `nnx.state(GPT2(...), nnx.Param)` (`nnx.to_pure_dict`):
nested dicts with array leaves, e.g. params["h"]["attn"]["c_attn"]["kernel"] [layers, d, 3, H, Dh].
Export takes that dict, an `nnx.State`, or the model itself, so a checkpoint exporter can call
it without building a model. Only numpy and safetensors here; no torch.

Vocabulary padding (`GPT2Config.make_vocab_size_divisible_by`): Hugging Face's files hold the real
vocabulary (config.json's vocab_size rows of wte); our params hold `padded_vocab_size` rows, the
extra ones zero. Import appends the zero rows, export drops them.

GPT-2's family record (`zerojax.models.registry`) is registered here, where its reader and writer are.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np
from flax import nnx

from zerojax.local_files import file_in_folder
from zerojax.models import registry
from zerojax.models.gpt2 import GPT2, GPT2Config, chunked_gpt2_loss, flops_per_token, gpt2_loss, num_params
from zerojax.models.pieces import GPT2Pieces

_LAYER_KEYS = (  # HF per-layer name -> our path under "h"
    ("ln_1.weight", ("ln_1", "scale")),
    ("ln_1.bias", ("ln_1", "bias")),
    ("attn.c_attn.weight", ("attn", "c_attn", "kernel")),
    ("attn.c_attn.bias", ("attn", "c_attn", "bias")),
    ("attn.c_proj.weight", ("attn", "c_proj", "kernel")),
    ("attn.c_proj.bias", ("attn", "c_proj", "bias")),
    ("ln_2.weight", ("ln_2", "scale")),
    ("ln_2.bias", ("ln_2", "bias")),
    ("mlp.c_fc.weight", ("mlp", "c_fc", "kernel")),
    ("mlp.c_fc.bias", ("mlp", "c_fc", "bias")),
    ("mlp.c_proj.weight", ("mlp", "c_proj", "kernel")),
    ("mlp.c_proj.bias", ("mlp", "c_proj", "bias")),
)
_TOP_KEYS = (
    ("wte.weight", ("wte",)),
    ("wpe.weight", ("wpe",)),
    ("ln_f.weight", ("ln_f", "scale")),
    ("ln_f.bias", ("ln_f", "bias")),
)
_IGNORED_SUFFIXES = ("attn.bias", "attn.masked_bias", "lm_head.weight")


def config_from_hf(hf: Mapping, **overrides) -> GPT2Config:
    """GPT2Config from a Hugging Face config.json dict; refuses variants this model does not run.
    `overrides`: GPT2Config fields HF does not have (make_vocab_size_divisible_by)."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"model_type={hf.get('model_type')!r}: only 'gpt2' is supported")
    unsupported = {
        "activation_function": ("gelu_new", hf.get("activation_function", "gelu_new")),
        "scale_attn_weights": (True, hf.get("scale_attn_weights", True)),
        "scale_attn_by_inverse_layer_idx": (False, hf.get("scale_attn_by_inverse_layer_idx", False)),
        "reorder_and_upcast_attn": (False, hf.get("reorder_and_upcast_attn", False)),
        "tie_word_embeddings": (True, hf.get("tie_word_embeddings", True)),
    }
    for key, (want, got) in unsupported.items():
        if got != want:
            raise ValueError(f"config.json {key}={got!r} is not supported; zerojax's GPT-2 needs {want!r}")
    return GPT2Config(
        vocab_size=hf["vocab_size"], n_positions=hf["n_positions"], n_embd=hf["n_embd"],
        n_layer=hf["n_layer"], n_head=hf["n_head"], n_inner=hf.get("n_inner"),
        layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        initializer_range=hf.get("initializer_range", 0.02), **overrides)


def pad_vocab(wte: np.ndarray, config: GPT2Config) -> np.ndarray:
    """wte with config.padded_vocab_size rows: the real rows, then zeros (HF's [vocab, d] -> ours)."""
    rows = wte.shape[0]
    if rows == config.padded_vocab_size:
        return wte
    if rows != config.vocab_size:
        raise ValueError(f"wte has {rows} rows; GPT2Config has vocab_size={config.vocab_size} "
                         f"(padded_vocab_size={config.padded_vocab_size})")
    return np.concatenate([wte, np.zeros((config.padded_vocab_size - rows, *wte.shape[1:]), wte.dtype)])


def check_vocab_rows(rows: int, config: GPT2Config) -> None:
    """Refuses a wte row count that is neither the vocabulary nor its padded size."""
    if rows not in (config.vocab_size, config.padded_vocab_size):
        raise ValueError(f"wte has {rows} rows; GPT2Config has vocab_size={config.vocab_size} "
                         f"(padded_vocab_size={config.padded_vocab_size})")


def unpad_vocab(wte: np.ndarray, config: GPT2Config) -> np.ndarray:
    """wte's real vocabulary rows (ours -> HF's [vocab, d]); refuses a row count of neither size."""
    check_vocab_rows(wte.shape[0], config)
    return wte[:config.vocab_size]


def config_to_hf(config: GPT2Config, dtype: str = "float32") -> dict:
    special = min(50256, config.vocab_size - 1)  # GPT-2's <|endoftext|>, kept inside small vocabs
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.n_positions,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head,
        "n_inner": config.n_inner, "activation_function": "gelu_new",
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        # zerojax trains without dropout; these are GPT-2's published values for HF users
        "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "summary_first_dropout": 0.1,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": special, "eos_token_id": special, "dtype": dtype,
    }


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a folder's safetensors (single file or sharded), as numpy arrays."""
    with TensorReader(path) as reader:
        return {name: reader.get(name) for name in reader.names}


class TensorReader:
    """The tensors of a Hugging Face folder (`model.safetensors`, or the shards a
    `model.safetensors.index.json` lists), read one at a time (`get(name)`), so a model is never
    held in host memory twice while it is converted. Use as a context manager (closes the files)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = os.fspath(path)
        single = os.path.join(self.path, "model.safetensors")
        index = single + ".index.json"
        if os.path.exists(single):
            files = {"model.safetensors": single}
        elif os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no \"weight_map\" object (tensor name -> shard file); the index "
                                 "save_pretrained writes has one")
            # a shard's name comes from the file: one outside the folder is refused, never opened
            files = {name: file_in_folder(self.path, name, index) for name in sorted(set(weight_map.values()), key=str)}
        else:
            raise FileNotFoundError(f"no model.safetensors (or model.safetensors.index.json) in {self.path!r}")
        self._handles = {}
        self._where = {}
        for name, full in files.items():
            if not os.path.exists(full):
                raise FileNotFoundError(f"{index}: lists {name!r}, which is not in {self.path!r}")
            handle = safe_open(full, framework="numpy")
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = name
        self.names = list(self._where)

    def __contains__(self, name):
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"{self.path!r}: tensor {name!r} missing from the safetensors files")
        return self._handles[self._where[name]].get_tensor(name)

    def dtype_code(self, name: str) -> str:
        """safetensors' code for the tensor's stored dtype ("F32", "BF16", ...), read from the
        header alone (numpy has no bfloat16 to read the tensor into)."""
        return self._handles[self._where[name]].get_slice(name).get_dtype()

    def close(self):
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# Hugging Face's default `max_shard_size` for save_pretrained ("5GB", decimal)
MAX_SHARD_BYTES = 5 * 10**9


def write_tensors(entries, out_dir: str, max_shard_size: int = MAX_SHARD_BYTES) -> str:
    """Write `entries` [(name, shape, dtype, make)] (make() -> the numpy array, called once, in
    order) as Hugging Face's safetensors: one `model.safetensors`, or shards of at most
    `max_shard_size` bytes (a tensor larger than that alone in its shard) with a
    `model.safetensors.index.json`, as `save_pretrained` writes them. Only one shard's tensors
    are held at a time. Returns the path of the weights file (or of the index)."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    shards, size = [[]], 0
    for entry in entries:
        nbytes = int(np.prod(entry[1], dtype=np.int64)) * np.dtype(entry[2]).itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    for stale in ("model.safetensors", "model.safetensors.index.json"):
        if os.path.exists(os.path.join(out_dir, stale)):
            os.remove(os.path.join(out_dir, stale))
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, shard in zip(names, shards):
        tensors = {}
        for name, shape, dtype, make in shard:
            a = np.ascontiguousarray(make(), dtype=dtype)
            if a.shape != tuple(shape):
                raise ValueError(f"{name}: shape {a.shape}, expected {tuple(shape)}")
            tensors[name] = a
            weight_map[name] = file
            total += a.nbytes
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        del tensors
    if len(shards) == 1:
        return os.path.join(out_dir, names[0])
    index = os.path.join(out_dir, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return index


def _shapes(config: GPT2Config) -> dict:
    """Per-layer shapes of our kernels, keyed by HF name, for the reshapes both ways."""
    d, H, Dh = config.n_embd, config.n_head, config.head_dim
    return {"attn.c_attn.weight": (d, 3, H, Dh), "attn.c_attn.bias": (3, H, Dh),
            "attn.c_proj.weight": (H, Dh, d)}


def set_path(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get_path(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def load_hf(path: str, dtype=None, **config_overrides) -> tuple[GPT2Config, dict]:
    """Read a Hugging Face GPT-2 folder -> (GPT2Config, params pure dict of numpy arrays).

    dtype: cast every tensor to it (default: keep the file's dtype). The params are laid out as
    the returned config's model holds them: wte padded to padded_vocab_size rows with zeros
    (`config_overrides`, e.g. make_vocab_size_divisible_by=1 for HF's exact shapes).
    """
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"no config.json in {path!r}")
    with open(cfg_file) as f:
        config = config_from_hf(json.load(f), **config_overrides)
    with TensorReader(path) as reader:
        # GPT2LMHeadModel saves "transformer.h.0..."; GPT2Model (and the hub's gpt2) saves "h.0..."
        full = {k.removeprefix("transformer."): k for k in reader.names}
        cast = (lambda a: np.asarray(a, dtype)) if dtype is not None else np.asarray
        shapes = _shapes(config)
        params: dict = {}
        used = set()

        def take(name):
            if name not in full:
                raise KeyError(f"{path!r}: tensor {name!r} missing from the safetensors file")
            used.add(name)
            return reader.get(full[name])

        for name, ours in _TOP_KEYS:
            tensor = take(name)
            set_path(params, ours, cast(pad_vocab(tensor, config) if ours == ("wte",) else tensor))
        for name, ours in _LAYER_KEYS:
            first = take(f"h.0.{name}")
            shape = shapes.get(name, first.shape)
            stacked = np.empty((config.n_layer, *shape), dtype if dtype is not None else first.dtype)
            for i in range(config.n_layer):
                stacked[i] = (first if i == 0 else take(f"h.{i}.{name}")).reshape(shape)
            set_path(params, ("h", *ours), stacked)
        extra = [k for k in full if k not in used and not k.endswith(_IGNORED_SUFFIXES)]
    if extra:
        raise ValueError(f"{path!r}: unexpected tensors for GPT-2: {sorted(extra)[:8]}")
    return config, params


def plain_arrays(tree):
    """An nnx.Module / nnx.State / nested dict of Params or arrays -> nested dict of numpy arrays
    (a stacked leaf read a layer at a time, one with `row(i)`, stays as it is: see `layer`)."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Param)
    if isinstance(tree, nnx.Variable):
        return np.asarray(tree[...])
    if isinstance(tree, Mapping):
        return {k: plain_arrays(v) for k, v in tree.items()}
    if hasattr(tree, "row"):
        return tree
    return np.asarray(tree)  # a multi-host sharded array must be gathered by the caller first


def layer(stacked, i: int):
    """() -> layer i of a stacked leaf, read when called: a numpy array's row, or the row of a leaf
    read a layer group at a time (`row(i)`: an offloaded run's `zerojax.offload.stored.ChunkRows`),
    so a writer holds one shard's tensors, never the whole model."""
    return (lambda: stacked.row(i)) if hasattr(stacked, "row") else (lambda: stacked[i])


def save_hf(params, config: GPT2Config, out_dir: str, dtype=None, *,
            max_shard_size: int = MAX_SHARD_BYTES) -> str:
    """Write config.json + model.safetensors that `GPT2LMHeadModel.from_pretrained(out_dir)` loads
    (sharded with an index above `max_shard_size` bytes) -> the weights file's (or index's) path.

    params: the model, `nnx.state(model)` or its pure dict (`nnx.to_pure_dict`).
    dtype: the saved dtype (e.g. np.float32, jnp.bfloat16; default: as given).
    """
    params = plain_arrays(params)
    shapes = _shapes(config)
    entries = []

    def entry(name, get, shape, kind, reshape=None):  # get() -> the array, called when written
        out = np.dtype(dtype) if dtype is not None else np.dtype(kind)
        shape = reshape or shape
        entries.append((name, shape, out, lambda: get().reshape(shape)))

    for name, ours in _TOP_KEYS:
        tensor = get_path(params, ours)   # read when written (an offloaded run's: a block of rows at a time)
        if ours == ("wte",):
            check_vocab_rows(tensor.shape[0], config)   # now, before any tensor is read
            entry(f"transformer.{name}", lambda t=tensor: unpad_vocab(np.asarray(t), config),
                  (config.vocab_size, *tensor.shape[1:]), tensor.dtype)
        else:
            entry(f"transformer.{name}", lambda t=tensor: np.asarray(t), tensor.shape, tensor.dtype)
    for i in range(config.n_layer):
        for name, ours in _LAYER_KEYS:
            stacked = get_path(params, ("h", *ours))
            if stacked.shape[0] != config.n_layer:
                raise ValueError(f"h/{'/'.join(ours)} has {stacked.shape[0]} layers, config says {config.n_layer}")
            entry(f"transformer.h.{i}.{name}", layer(stacked, i), stacked.shape[1:], stacked.dtype,
                  _hf_shape(name, config) if name in shapes else None)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_to_hf(config, np.dtype(entries[0][2]).name), f, indent=2, sort_keys=True)
    return write_tensors(entries, out_dir, max_shard_size)


def _hf_shape(name, config):
    d = config.n_embd
    return {"attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
            "attn.c_proj.weight": (d, d)}[name]


def gpt2_from_hf(path: str, **model_kwargs) -> GPT2:
    """Build a GPT2 module holding the weights of a Hugging Face folder, with no random init.

    model_kwargs go to GPT2 (dtype, param_dtype, remat_policy, attention_impl, ...); the weights
    are stored in param_dtype (default float32).
    """
    config, params = load_hf(path)
    return gpt2_from_params(config, params, **model_kwargs)


def gpt2_from_params(config: GPT2Config, params: Mapping, **model_kwargs) -> GPT2:
    """A GPT2 module holding `params` (pure dict as from load_hf), built via nnx.eval_shape; a wte
    of the real vocabulary's rows (Hugging Face's shape) is padded to the config's."""
    import jax
    import jax.numpy as jnp

    if "wte" in params:
        params = {**params, "wte": pad_vocab(np.asarray(params["wte"]), config)}

    param_dtype = model_kwargs.get("param_dtype", jnp.float32)
    abstract = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0), **model_kwargs))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, param_dtype), params))
    return nnx.merge(graphdef, state)


def module_from_leaves(make, leaves, param_dtype):
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


def storage_dtype(dtype):
    import jax.numpy as jnp

    return jnp.dtype(dtype or jnp.float32)


def read_gpt2(path: str, dtype=None, **model_kwargs) -> GPT2:
    """GPT-2's reader (`from_hf` for model_type gpt2)."""
    param_dtype = storage_dtype(dtype)
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
    return module_from_leaves(make, leaves(), param_dtype)


# ------------------------------------------------------------------------------ the family


def read_config_json(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


registry.register(registry.ModelFamily(
    name="gpt2", label="GPT-2", config_class=GPT2Config, model_class=GPT2,
    shapes={s: s for s in ("tiny", "small", "medium", "large", "xl")},
    loss=gpt2_loss, chunked_loss=chunked_gpt2_loss, hf_model_types=("gpt2",), from_hf=read_gpt2,
    writer=save_hf, config_from_record=lambda record: GPT2Config(**record["config"]),
    hf_config=lambda path: config_from_hf(read_config_json(path)), learned_positions=True, packs=False,
    counts=lambda config, seq_len: (flops_per_token(config, seq_len), num_params(config)),
    # the fields that decide the parameters' shapes
    shape_keys=("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "make_vocab_size_divisible_by"),
    # c_attn [d, 3, heads, head_dim] (HF's fused [q|k|v] columns), attn.c_proj [heads, head_dim, d]:
    # row-major, as Hugging Face's Conv1D weights [in, out] flatten; the input embedding is the LM
    # head (tied): neither trains whole apart from the other
    peft=registry.PeftTargets(
        stack="h", prefix="transformer.h.{i}.",
        linears={"attn.c_attn": (("attn", "c_attn"), 1), "attn.c_proj": (("attn", "c_proj"), 2),
                 "mlp.c_fc": (("mlp", "c_fc"), 1), "mlp.c_proj": (("mlp", "c_proj"), 1)},
        savable={"wte": ("wte", "transformer.wte.weight"), "lm_head": ("wte", "lm_head.weight")},
        fan_in_fan_out=True),
    max_positions=lambda config: config.n_positions,
    label_of=lambda shape, config: f"GPT-2 {shape}",
    pieces=GPT2Pieces))
