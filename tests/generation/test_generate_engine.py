"""Generation from an engine's live weights (ZeRO-3, tensor parallel 2, parameters offloaded to
the host, pipeline stages; LoRA at ZeRO-2 and 3) gives the plain model's tokens; a LoRA model
(adapters applied, not merged; an nf4 base) gives its merged model's."""
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax import lora
from zerojax.models import Llama, LlamaConfig, llama_loss

MODEL = LlamaConfig.named("tiny")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}
PROMPTS = [[3, 17, 42, 9, 100], [7, 8]]
NEW = 8


def _model():
    return Llama(MODEL, rngs=nnx.Rngs(0))


def _config(stage, **extra):
    return {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def _tokens(model_or_engine):
    return zerojax.generate(model_or_engine, PROMPTS, max_new_tokens=NEW, ignore_eos=True).tokens


@pytest.fixture(scope="module")
def reference():
    return _tokens(_model())


OFFLOAD = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu"},
           "offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize("cfg", [_config(3), _config(1, tensor_parallel={"autotp_size": 2}),
                                 _config(3, zero_optimization=OFFLOAD), _config(1, pipeline={"stages": 2})],
                         ids=["zero3", "tensor2", "offload_param", "pipeline2"])
def test_engine_generates_the_plain_models_tokens(cfg, reference):
    engine = zerojax.shard(_model, cfg, loss_fn=llama_loss)
    assert _tokens(engine) == reference


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_engine_generates_the_merged_models_tokens(stage):
    engine = zerojax.shard(lambda: lora.apply(_model(), LORA), _config(stage), loss_fn=llama_loss)
    rows = np.random.default_rng(0).integers(0, MODEL.vocab_size, (8, 16)).astype(np.int32)
    engine.train_step({"input_ids": rows})  # adapters trained, live in the engine
    merged = _tokens(lora.merge(engine.model))
    assert merged != _tokens(_model())  # the (non-zero) adapters change the tokens
    assert _tokens(engine) == merged


def test_quantized_lora_model_generates_its_merged_models_tokens():
    model = lora.apply(_model(), {**LORA, "quantize": "nf4", "lora_dropout": 0.5})
    model.train()  # lora_dropout on for training: generation still runs without it
    assert _tokens(model) == _tokens(lora.merge(model))
    assert not model.lora_dropout.deterministic  # the user's model is left in its mode
