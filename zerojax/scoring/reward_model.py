"""Reward models (DeepSpeed-Chat's step 2): a registered family's model with a scalar head, trained
on preference pairs with the Bradley-Terry loss (`zerojax.methods.reward.reward_loss`), in and out
of Hugging Face's `<Family>ForSequenceClassification` (num_labels = 1); PPO's critic is one too.

    model = reward_from_hf("Llama-3.2-1B")           # a CausalLM or SequenceClassification folder
    engine = zerojax.shard(lambda: model, cfg, loss_fn=reward_loss)
    ...
    save_reward_hf(engine.model, "rm/")             # transformers' AutoModelForSequenceClassification loads it

The score: `score` [hidden, 1] (no bias; Hugging Face's `score.weight` [1, hidden] transposed)
applied to the final hidden state of each sequence's last non-pad token, transformers'
`GenericForSequenceClassification` rule: the rightmost position whose id is not pad_token_id
(left or right padding alike; a row of pads only reads position 0); with no pad_token_id, the
last position, and a batch of more than one row is refused, as transformers refuses it. The
score is computed in fp32 on the picked hidden state.

The model's base keeps no LM head (as Hugging Face's classifier has none): an untied `lm_head`
is dropped, so it takes no memory, gradient or optimizer state.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax.scoring.logprobs import hidden_states

SEQ_CLS = "ForSequenceClassification"


def last_token_index(input_ids, pad_token_id):
    """[B] index of each row's last non-pad token (transformers' rule; see the module docstring)."""
    T = input_ids.shape[-1]
    if pad_token_id is None:
        if input_ids.shape[0] != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined (transformers' rule): "
                             "give the reward model a pad_token_id")
        return jnp.full(input_ids.shape[:1], T - 1, jnp.int32)
    non_pad = (input_ids != pad_token_id).astype(jnp.int32)
    return jnp.argmax(jnp.arange(T, dtype=jnp.int32) * non_pad, axis=-1)


class RewardModel(nnx.Module):
    """`RewardModel(base, pad_token_id=...)(input_ids [B, T]) -> scores [B] fp32`.

    base: a model of a registered family (`zerojax.models.Llama`, `GPT2`; LoRA'd or not) -- its
    `hidden_states` is read; score: the head's initial [hidden, 1] values (default: Hugging Face's
    initialisation, normal with the config's initializer_range, from `seed`)."""

    def __init__(self, base, *, pad_token_id: int | None, score=None, seed: int = 0):
        config = base.config
        d = getattr(config, "hidden_size", None) or config.n_embd
        if not getattr(config, "tie_word_embeddings", True) and hasattr(base, "lm_head"):
            del base.lm_head  # a classifier has no LM head
        self.model = base
        self.pad_token_id = None if pad_token_id is None else int(pad_token_id)
        if score is None:
            std = getattr(config, "initializer_range", 0.02)
            score = std * jax.random.normal(jax.random.key(seed), (d, 1), jnp.float32)
        score = jnp.asarray(score, jnp.float32).reshape(d, 1)
        self.score = nnx.Param(score, out_sharding=("embed", None), eager_sharding=False)

    @property
    def config(self):
        return self.model.config

    def checkpoint_record(self) -> dict:
        """What a checkpoint stores about it: the base's record under "base" (export: `save_reward_hf`)."""
        base = self.model.checkpoint_record() if hasattr(self.model, "checkpoint_record") else None
        return {"type": "reward", "base": base, "pad_token_id": self.pad_token_id}

    def __call__(self, input_ids, segment_ids=None, positions=None):
        x = hidden_states(self.model, {"input_ids": input_ids, "segment_ids": segment_ids, "positions": positions})
        last = last_token_index(input_ids, self.pad_token_id)
        picked = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
        return (picked.astype(jnp.float32) @ self.score[...].astype(jnp.float32))[:, 0]


def as_reward_model(model, *, pad_token_id: int | None, seed: int = 0) -> RewardModel:
    """`model` (a family's causal LM, or already a RewardModel) as a reward model."""
    if isinstance(model, RewardModel):
        return model
    return RewardModel(model, pad_token_id=pad_token_id, seed=seed)


def _llama_family(model_type: str, path):
    from zerojax.models.llama import MODEL_TYPES

    if model_type not in MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r}; reward models read and write the Llama family "
                         f"({', '.join(MODEL_TYPES)})")


def reward_from_hf(path, dtype=None, *, pad_token_id: int | None = None, seed: int = 0, **model_kwargs) -> RewardModel:
    """A reward model from a Hugging Face folder of the Llama family: a `...ForCausalLM` (its LM
    head ignored, the score head initialised as transformers initialises it) or a
    `...ForSequenceClassification` with num_labels 1 (its `score.weight` read). pad_token_id:
    default config.json's. dtype / model_kwargs: as `zerojax.models.from_hf`."""
    from zerojax.models.hf import TensorReader, module_from_leaves, storage_dtype
    from zerojax.models.hf_llama import read_leaves
    from zerojax.models.llama import Llama

    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    _llama_family(hf.get("model_type"), path)
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or None)
    is_classifier = any(a.endswith(SEQ_CLS) for a in hf.get("architectures") or ())
    if is_classifier and labels not in (None, 1):
        raise ValueError(f"{path}: a sequence classifier with {labels} labels; a reward model has one (num_labels=1)")
    # read as tied (no LM head leaf): the classifier has none, a causal LM's is not used
    config, leaves = read_leaves(path, skip=("score.weight",), tie_word_embeddings=True)
    param_dtype = storage_dtype(dtype)
    base = module_from_leaves(lambda: Llama(config, rngs=nnx.Rngs(0), param_dtype=param_dtype, **model_kwargs),
                              leaves, param_dtype)
    base.config = dataclasses.replace(config, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))
    score = None
    with TensorReader(path) as reader:
        if "score.weight" in reader.names:
            score = np.asarray(reader.get("score.weight"), np.float32).T  # [1, d] -> [d, 1]
    if pad_token_id is None:
        pad_token_id = hf.get("pad_token_id")
    return RewardModel(base, pad_token_id=pad_token_id, score=score, seed=seed)


def save_reward_hf(model: RewardModel, out_dir, dtype=None) -> str:
    """Write `model` as Hugging Face's `<Family>ForSequenceClassification` (config.json with its
    architectures, num_labels 1, pad_token_id; safetensors with the base under "model." and
    `score.weight` [1, hidden]), which `transformers.AutoModelForSequenceClassification` loads
    with the same scores. A LoRA base is merged first. -> the weights file's path."""
    from zerojax.models.hf_llama import ARCHITECTURES, save_llama_hf

    base = model.model
    if getattr(base, "adapter", None) is not None:
        from zerojax import lora

        base = lora.merge(base)
    _llama_family(base.config.model_type, out_dir)
    score = np.asarray(jax.device_get(model.score[...]), np.float32).T
    if dtype is not None:
        score = score.astype(dtype)
    updates = {"architectures": [ARCHITECTURES[base.config.model_type].replace("ForCausalLM", SEQ_CLS)],
               "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "num_labels": 1,
               "pad_token_id": model.pad_token_id}
    return save_llama_hf(base, base.config, os.fspath(out_dir), dtype=dtype, head=False,
                         extra={"score.weight": score}, config_updates=updates)


__all__ = ["RewardModel", "as_reward_model", "reward_from_hf", "save_reward_hf", "last_token_index", "SEQ_CLS"]
