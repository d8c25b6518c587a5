"""GRPO rollouts on the serving engine (`RolloutOptions(generator="serving")`) over the live
weights of a LoRA engine (8 virtual CPU devices, ZeRO-2): at temperature 0, with a stop id that
ends rows at different lengths, each step's batch (completions, masks) equals the default path's
(`zerojax.generate`), and so does each step's loss (the adapters drawn non-zero, so the KL term
against the adapters-off reference makes the loss, and the weights the next rollout uses, move)."""
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax import lora
from zerojax.data.rows import ByteTokens
from zerojax.methods.grpo import make_grpo_loss
from zerojax.models import Llama, LlamaConfig
from zerojax.rl import RolloutBatches, RolloutOptions, load_prompts
from zerojax.serving import step as step_mod

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}
STEPS, ROWS, NEW = 3, 16, 8


def _engine():
    return zerojax.shard(lambda: lora.apply(Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0)), LORA),
                         {"train_batch_size": ROWS, "optimizer": {"type": "AdamW", "params": {"lr": 3e-2}},
                          "zero_optimization": {"stage": 2}}, loss_fn=make_grpo_loss(kl_coef=0.1))


def _run(engine, digits, options):
    """(each step's batch, each step's loss) of a short GRPO run."""
    batches, losses = [], []
    for batch in RolloutBatches(engine, digits, "digit", options, seed=1, num_steps=STEPS):
        batches.append({k: np.array(v) for k, v in batch.items()})
        losses.append(float(engine.train_step(batch)["loss"]))
    return batches, losses


def test_serving_rollouts_equal_generates_and_train_alike():
    digits = load_prompts("digit", ByteTokens(), seq_len=3 + NEW)
    engine = _engine()
    options = RolloutOptions(group=4, temperature=0.0, kl_coef=0.1, max_new_tokens=NEW)
    # a stop id from the greedy completions (the 4th token of the first): rows end at different lengths
    prompts = np.repeat(digits.indices(ROWS // 4, seed=1, step=0), 4)
    stop = RolloutBatches(engine, digits, "digit", options, seed=1).generate(prompts, 0)[0][0][3]
    options = RolloutOptions(**{**vars(options), "stop": (int(stop),)})
    want, want_losses = _run(engine, digits, options)
    served_before = step_mod.step._cache_size()
    got, got_losses = _run(_engine(), digits, RolloutOptions(**{**vars(options), "generator": "serving"}))
    assert step_mod.step._cache_size() > served_before  # the serving engine's step made them
    lengths = want[0]["completion_mask"].sum(1)
    assert lengths.min() < lengths.max()  # rows finished at different lengths
    for a, b in zip(want, got, strict=True):
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert len(set(want_losses)) == STEPS  # the weights moved between rollouts
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6, atol=0)


def test_generator_is_checked():
    with pytest.raises(ValueError, match="generator='vllm'; choose one of"):
        RolloutOptions(generator="vllm").check(8, 8)
    with pytest.raises(ValueError, match="decode_attention='xla' is generate's"):
        RolloutOptions(generator="serving", decode_attention="xla").check(8, 8)
