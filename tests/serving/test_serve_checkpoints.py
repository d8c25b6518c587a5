"""Serving what training saved: a whole model's checkpoint (`zerojax serve --checkpoint SAVE_DIR`)
and a LoRA run's checkpoint as an adapter (`--adapter NAME=SAVE_DIR`) over the base read from its
Hugging Face folder. Each is a checkpoint the training engine wrote after a step; the served greedy
tokens equal `zerojax.generate` on that engine."""
import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax import lora
from zerojax.models import from_hf, llama_loss
from zerojax.serving import LLM, SamplingParams
from zerojax.serving.checkpoints import TRAIN_SETTINGS
from zerojax.serving.llm import load_checkpoint_model, load_model

pytest.importorskip("torch")

from generation.test_generate_cli import folder  # noqa: E402,F401 (a fixture: tiny llama3, word tokenizer)

NEW = 6
CONFIG = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
          "zero_optimization": {"stage": 2}}


def _trained(model, save_dir, settings=None):
    """The engine over `model` after one step, its checkpoint in save_dir (a LoRA run's settings in
    its client_state, where `zerojax train` keeps them)."""
    engine = zerojax.shard(model, CONFIG, loss_fn=llama_loss)
    rng = np.random.default_rng(0)
    engine.train_step({"input_ids": rng.integers(2, model.config.vocab_size, (8, 12)).astype(np.int32)})
    engine.save_checkpoint(save_dir, client_state={TRAIN_SETTINGS: {"lora": settings}})
    return engine


def _served(llm, prompt, adapter=None):
    return llm.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True), adapter=adapter)[0].token_ids


def test_whole_model_and_lora_checkpoints_serve_as_the_training_engine_generates(folder, tmp_path):
    prompts = [[5, 17, 9, 33], [40, 2, 2, 71, 8, 13, 60]]
    whole = _trained(from_hf(folder), tmp_path / "whole")
    model, _, _ = load_checkpoint_model(str(tmp_path / "whole"))
    llm = LLM(model, page_size=4, kv_cache_tokens=128, max_num_seqs=4)
    for p in prompts:
        assert _served(llm, p) == zerojax.generate(whole, p, max_new_tokens=NEW, ignore_eos=True).tokens[0]

    # lora_B drawn at random (not PEFT's zeros) and large, so that the adapter changes the greedy tokens; the
    # settings saved as `zerojax train --lora` saves them (lora_B zero at init: only the checkpoint's
    # weights make the served adapter differ from the base)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
    tuned = lora.apply(from_hf(folder), {**settings, "init_lora_weights": False})
    nnx.update(tuned, jax.tree.map(lambda x: 30 * x, nnx.state(tuned, nnx.Param)))
    lora_run = _trained(tuned, tmp_path / "lora", lora.from_config_dict(settings))
    with pytest.raises(ValueError, match="a LoRA run's checkpoint holds its adapters only"):
        load_checkpoint_model(str(tmp_path / "lora"))
    base, tok, adapters = load_model(str(folder), adapters={"tuned": str(tmp_path / "lora")})
    llm = LLM(base, tok, adapters=adapters, page_size=4, kv_cache_tokens=128, max_num_seqs=4)
    for p in prompts:
        expected = zerojax.generate(lora_run, p, max_new_tokens=NEW, ignore_eos=True).tokens[0]
        assert _served(llm, p, "tuned") == expected != _served(llm, p)  # the trained adapter, not the base
    with pytest.raises(ValueError, match="a checkpoint of a run without LoRA"):
        load_model(str(folder), adapters={"x": str(tmp_path / "whole")})
