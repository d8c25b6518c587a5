"""Rollouts on a live engine (8 virtual CPU devices): a tiny Llama learns the built-in "digit"
task (the mean reward rises); a ZeRO-2 LoRA engine's greedy rollouts are `zerojax.generate`'s
tokens on the merged model, its reference log-probs the base's (adapters off) and its old-policy
log-probs the merged model's; a resumed run generates and trains what the uninterrupted one did;
the "grpo" method wires it for the trainer."""
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax import lora
from zerojax.data.rows import ByteTokens
from zerojax.methods import get as get_method
from zerojax.methods.grpo import make_grpo_loss
from zerojax.models import Llama, LlamaConfig
from zerojax.rl import RolloutBatches, RolloutOptions, load_prompts, train
from zerojax.scoring.logprobs import completion_logps

MODEL = LlamaConfig.named("tiny")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}


def _model():
    return Llama(MODEL, rngs=nnx.Rngs(0))


def _cfg(rows, lr, stage=2):
    return {"train_batch_size": rows, "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "zero_optimization": {"stage": stage}}


@pytest.fixture(scope="module")
def digits():
    return load_prompts("digit", ByteTokens(), seq_len=11)  # "nn:" + 8 new bytes


def test_reward_rises_on_the_digit_task(digits):
    engine = zerojax.shard(_model, _cfg(32, 2e-2), loss_fn=make_grpo_loss(kl_coef=0.0))
    rollouts = RolloutBatches(engine, digits, "digit", RolloutOptions(group=8, kl_coef=0.0), seed=0, num_steps=14)
    history = train(engine, rollouts)
    first, last = np.mean([h["reward/mean"] for h in history[:3]]), np.mean([h["reward/mean"] for h in history[-3:]])
    assert first < 0.05 and last > 0.3, [round(h["reward/mean"], 3) for h in history]
    assert all(h["completion/length"] == 8 for h in history)
    assert history[-1]["time/train_s"] > 0 and history[-1]["time/generate_s"] > 0


def test_lora_rollouts_are_the_merged_models(digits):
    engine = zerojax.shard(lambda: lora.apply(_model(), LORA), _cfg(16, 1e-3),
                           loss_fn=make_grpo_loss(kl_coef=0.1, iterations=2))
    options = RolloutOptions(group=4, temperature=0.0, kl_coef=0.1, iterations=2, max_new_tokens=6)
    batch = next(RolloutBatches(engine, digits, "digit", options, seed=1, num_steps=1))
    assert RolloutBatches(engine, digits, "digit", options, seed=1).reference == "adapters_off"
    merged = lora.merge(engine.model)
    rows = [r[:n] for r, n in zip(batch["input_ids"], batch["prompt_lengths"])]
    want = zerojax.generate(merged, rows, max_new_tokens=6).tokens
    got = [list(r[n:n + 6]) for r, n in zip(batch["input_ids"], batch["prompt_lengths"])]
    assert got == want and batch["completion_mask"][:, :6].all() and not batch["completion_mask"][:, 6:].any()
    np.testing.assert_allclose(batch["old_logps"], np.asarray(completion_logps(merged, batch)), atol=2e-5)
    np.testing.assert_allclose(batch["ref_logps"], np.asarray(completion_logps(_model(), batch)), atol=2e-5)
    assert not np.allclose(batch["old_logps"], batch["ref_logps"])  # the adapters are not zero
    metrics = engine.train_step(batch)  # old = current: ratio 1, nothing clipped
    assert abs(float(metrics["policy/ratio"]) - 1) < 1e-4 and float(metrics["policy/clip_fraction"]) == 0


def _run(digits, steps, *, start=0, load=None, save=None):
    engine = zerojax.shard(_model, _cfg(16, 1e-2), loss_fn=make_grpo_loss(kl_coef=0.05))
    options = RolloutOptions(group=4, kl_coef=0.05, reference="copy", max_new_tokens=5)
    # made before the restore: the reference copy is the starting model's, as in the first run
    rollouts = RolloutBatches(engine, digits, "digit", options, seed=3, start_step=start, num_steps=steps)
    if load:
        engine.load_checkpoint(load)
    batches = []
    for batch in rollouts:
        batches.append(batch["input_ids"].copy())
        engine.train_step(batch)
        if save and len(batches) == save[1]:
            engine.save_checkpoint(save[0])
    return batches, engine


def test_resume_equals_the_uninterrupted_run(digits, tmp_path):
    whole, engine = _run(digits, 4, save=(tmp_path, 2))
    resumed, engine2 = _run(digits, 2, start=2, load=tmp_path)
    for a, b in zip(whole[2:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax_leaves(engine.params), jax_leaves(engine2.params), strict=True):
        np.testing.assert_array_equal(a, b)


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_grpo_method_for_the_trainer(digits):
    method = get_method("grpo")
    with pytest.raises(ValueError, match="did you mean 'kl_coef'"):
        method.resolve({"kl_coeff": 0.1})
    with pytest.raises(ValueError, match="decode_attention='fast': choose one of"):
        RolloutOptions.from_options(method.resolve({"decode_attention": "fast"})).check(16, 8)
    data = method.data("digit", ByteTokens(), 11, 16)
    options = method.resolve({"group": 4, "kl_coef": 0.0, "max_new_tokens": 3}, data)
    assert options["reward"] == "digit"
    sample = next(iter(data.train_batches(16, seed=0, start_step=0, num_steps=1)))
    engine = zerojax.shard(_model, _cfg(16, 1e-3), loss_fn=method.loss(options))
    batches = method.rollouts(engine, data, options, seed=0, start_step=5, num_steps=2)
    got = list(batches)
    assert len(got) == 2 and batches.metrics["step"] == 6
    for batch in got:
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {k: (v.shape, v.dtype) for k, v in sample.items()}
    assert np.isfinite(float(engine.train_step(got[0])["loss"]))


def test_dapo_drops_groups_without_reward_variance(digits):
    engine = zerojax.shard(_model, _cfg(16, 1e-3), loss_fn=make_grpo_loss(kl_coef=0.0, loss_level="token"))
    # greedy: a group's completions are one completion, its rewards equal: every group dropped
    options = RolloutOptions(group=4, temperature=0.0, kl_coef=0.0, drop_zero_variance=True, max_refills=1,
                             loss_level="token", scale_std=False, max_new_tokens=3)
    rollouts = RolloutBatches(engine, digits, "digit", options, seed=0, num_steps=1)
    batch = next(rollouts)
    assert rollouts.metrics["groups/dropped"] == 8 and rollouts.metrics["groups/generations"] == 2
    assert rollouts.metrics["rows/trained"] == 0 and not batch["completion_mask"].any()
    assert float(engine.train_step(batch)["loss"]) == 0.0
    sampled = RolloutBatches(engine, digits, "digit", {**vars(options), "temperature": 1.0}, seed=0, num_steps=1)
    batch = next(sampled)
    kept = sampled.metrics["rows/trained"]
    assert kept > 0 and batch["completion_mask"][:kept, :3].all() and not batch["completion_mask"][kept:].any()
    np.testing.assert_allclose(batch["token_weights"], 16 / batch["completion_mask"].sum())


def test_byte_level_decode_reads_ids_past_the_bytes_as_a_bad_byte():
    """A model whose vocabulary is larger than the byte tokenizer's (a random-init Llama-3.1-8B
    shape on the built-in task) samples ids >= 256: they decode as U+FFFD, as an invalid byte
    does, and the reward sees the rest of the text."""
    from zerojax.rl.prompts import decode

    assert decode(object(), [52, 50, 300, 255, 10]) == "42" + "\ufffd" + b"\xff".decode("utf-8", "replace") + "\n"


def test_grpo_and_ppo_settings_have_one_home():
    """The trainer's --method-option defaults, the rollouts' and the loss's keywords are the options
    dataclasses' fields: a default changed there changes it everywhere, and no setting is missing."""
    import dataclasses
    import inspect

    from zerojax import methods
    from zerojax.methods.grpo import make_grpo_loss
    from zerojax.rl.ppo_rollouts import PPOOptions
    from zerojax.rl.rollouts import GRPOOptions

    grpo, ppo = methods.get("grpo").options, methods.get("ppo").options
    assert grpo == {f.name: f.default for f in dataclasses.fields(GRPOOptions)}
    assert {f.name for f in dataclasses.fields(RolloutOptions)} < set(grpo)
    assert all(ppo[k] == getattr(PPOOptions(), k) for k in ppo) and {"kl_ctl", "critic", "reward"} <= set(ppo)
    loss_defaults = {k: p.default for k, p in inspect.signature(make_grpo_loss).parameters.items() if k != "group"}
    assert loss_defaults == {k: grpo[k] for k in loss_defaults}
