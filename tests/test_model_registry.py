"""Adding a model family is one module: a toy family registered from this test file trains and
exports through `zerojax train`, with nothing else of zerojax changed (zerojax.models.registry).

The toy is a byte-level MLP language model with its own config, loss, and a folder format of its
own (config.json + safetensors under its own names). Checks: `zerojax train --model toy-small`
trains it (loss falls, read from `--summary-json`); with `--steps 0` the exported folder holds
exactly the weights a fresh model of the same seed draws (the registry's build, writer and reader
agree); `--hf-checkpoint` of that folder reads the family back by its model_type; the registry
refuses a second family claiming a taken shape.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from zerojax import cli
from zerojax.models import registry


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 256
    n_embd: int = 32
    n_layer: int = 2
    n_head: int = 1
    max_position_embeddings: int = 512

    @classmethod
    def named(cls, name, **overrides):
        sizes = {"small": {}, "wide": {"n_embd": 64}}
        return cls(**{**sizes[name], **overrides})


class ToyLM(nnx.Module):
    def __init__(self, config: ToyConfig, *, rngs, dtype=jnp.float32, param_dtype=jnp.float32, remat_policy=None):
        self.config, self.dtype = config, dtype
        self.embed = nnx.Embed(config.vocab_size, config.n_embd, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(config.n_embd, config.n_embd, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(config.n_layer)])

    def __call__(self, ids):
        x = self.embed(ids).astype(self.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.embed.attend(jax.nn.gelu(x)).astype(jnp.float32)


def toy_loss(model, batch):
    ids = batch["input_ids"]
    logp = jax.nn.log_softmax(model(ids[:, :-1]), axis=-1)
    return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()


def _names(params):
    return {jax.tree_util.keystr(p).replace("'", ""): np.asarray(a, np.float32)
            for p, a in jax.tree_util.tree_leaves_with_path(params)}


def write_toy(params, config, out_dir, dtype=None, **_):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"model_type": "toy", **dataclasses.asdict(config)}, f)
    path = os.path.join(out_dir, "toy.safetensors")
    params = nnx.to_pure_dict(nnx.state(params, nnx.Param)) if isinstance(params, nnx.Module) else params
    save_file(_names(params), path)
    return path


def toy_config(path):
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    return ToyConfig(**{k: v for k, v in raw.items() if k != "model_type"})


def read_toy(path, dtype=None, **model_kwargs):
    model = ToyLM(toy_config(path), rngs=nnx.Rngs(0), param_dtype=dtype or jnp.float32, **model_kwargs)
    tensors = load_file(os.path.join(path, "toy.safetensors"))
    state = nnx.state(model, nnx.Param)
    flat = _names(nnx.to_pure_dict(state))
    assert set(flat) == set(tensors), (sorted(flat), sorted(tensors))
    leaves = [jnp.asarray(tensors[jax.tree_util.keystr(p).replace("'", "")]) for p, _ in
              jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))]
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(jax.tree.structure(nnx.to_pure_dict(state)), leaves))
    nnx.update(model, state)
    return model


TOY = registry.ModelFamily(
    name="toy", label="the toy family", config_class=ToyConfig, model_class=ToyLM,
    shapes={"toy-small": "small", "toy-wide": "wide"}, loss=toy_loss, chunked_loss=lambda chunk: toy_loss,
    hf_model_types=("toy",), from_hf=read_toy, writer=write_toy,
    config_from_record=lambda record: ToyConfig(**record["config"]), hf_config=toy_config,
    shape_keys=("vocab_size", "n_embd", "n_layer"))


@pytest.fixture(scope="module")
def toy_family():
    registry.register(TOY)
    yield TOY
    registry.unregister(TOY.name)


def _train(*argv):
    assert cli.main(["train", *argv]) == 0


@pytest.mark.slow
def test_a_registered_family_trains_and_exports_through_zerojax_train(toy_family, tmp_path):
    summary_path = tmp_path / "summary.json"
    _train("--model", "toy-small", "--steps", "12", "--seq-len", "32", "--micro-batch", "1", "--lr", "3e-2",
           "--eval-batches", "0", "--summary-json", str(summary_path), "--export-hf", str(tmp_path / "trained"))
    summary = json.loads(summary_path.read_text())
    assert summary["family"] == "toy" and summary["model"] == "toy-small"
    assert summary["last_loss"] < summary["first_loss"] - 0.3, summary
    trained = read_toy(str(tmp_path / "trained"))
    fresh = ToyLM(ToyConfig.named("small"), rngs=nnx.Rngs(0))
    moved = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(nnx.state(trained, nnx.Param)),
                                                          jax.tree.leaves(nnx.state(fresh, nnx.Param)), strict=True)]
    assert min(moved) > 0, moved  # every weight trained and written

    # no training: the export is the seed's initial model, read back by its model_type
    _train("--model", "toy-small", "--steps", "0", "--seq-len", "32", "--micro-batch", "1", "--eval-batches", "0",
           "--export-hf", str(tmp_path / "init"))
    back = read_toy(str(tmp_path / "init"))
    for a, b in zip(jax.tree.leaves(nnx.state(back, nnx.Param)), jax.tree.leaves(nnx.state(fresh, nnx.Param)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert registry.for_hf_type("toy") is toy_family
    _train("--hf-checkpoint", str(tmp_path / "init"), "--steps", "2", "--seq-len", "32", "--micro-batch", "1",
           "--eval-batches", "0", "--summary-json", str(summary_path))
    assert json.loads(summary_path.read_text())["family"] == "toy"


def test_a_taken_shape_or_model_type_is_refused(toy_family):
    with pytest.raises(ValueError, match="named shape 'large' is 'gpt2''s already"):
        registry.register(dataclasses.replace(TOY, name="other", shapes={"large": "small"}, hf_model_types=()))
    with pytest.raises(ValueError, match="model type 'llama' is 'llama''s already"):
        registry.register(dataclasses.replace(TOY, name="other", shapes={}, hf_model_types=("llama",)))
