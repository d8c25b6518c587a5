"""PPO on a live engine (8 virtual CPU devices): a tiny Llama learns the built-in "digit" task with
a critic engine beside it (the mean reward rises); the batch's GAE advantages are `zerojax.rl.gae`
on the actor's and critic's own outputs recomputed outside the engines; a run resumed from the
actor's checkpoint and the critic's (`PPORollouts.save` / `load`) trains what the uninterrupted
one did; the "ppo" method wires it for the trainer."""
import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.data.rows import ByteTokens
from zerojax.methods import get as get_method
from zerojax.methods.ppo import completion_values, make_actor_loss
from zerojax.models import Llama, LlamaConfig
from zerojax.rl import gae, load_prompts, train
from zerojax.rl.ppo_rollouts import PPOOptions, PPOPromptData, PPORollouts
from zerojax.rl.tasks import digit_reward
from zerojax.scoring.logprobs import completion_logps

MODEL = LlamaConfig.named("tiny")


def _model():
    return Llama(MODEL, rngs=nnx.Rngs(0))


def _cfg(rows, lr, opt="AdamW"):
    return {"train_batch_size": rows, "optimizer": {"type": opt, "params": {"lr": lr}},
            "zero_optimization": {"stage": 2}}


@pytest.fixture(scope="module")
def digits():
    return PPOPromptData.of(load_prompts("digit", ByteTokens(), seq_len=11))  # "nn:" + 8 new bytes


def test_reward_rises_on_the_digit_task(digits):
    engine = zerojax.shard(_model, _cfg(32, 2e-2), loss_fn=make_actor_loss())
    options = PPOOptions(group=4, kl_ctl=0.0, critic_lr=1e-2)
    rollouts = PPORollouts(engine, digits, "digit", options, seed=0, num_steps=14)
    history = train(engine, rollouts)
    first, last = np.mean([h["reward/mean"] for h in history[:3]]), np.mean([h["reward/mean"] for h in history[-3:]])
    assert first < 0.05 and last > 0.3, [round(h["reward/mean"], 3) for h in history]
    values = [h["critic/values"] for h in history]  # the critic follows the returns up
    assert np.mean(values[-3:]) > 0.2, [round(v, 3) for v in values]
    for key in ("policy/kl", "policy/clip_fraction", "critic/value_loss", "completion/length", "time/generate_s",
                "time/train_s", "time/critic_s", "reward/std"):
        assert np.isfinite(history[-1][key]), key


def _run(digits, steps, *, start=0, load=None, save=None):
    engine = zerojax.shard(_model, _cfg(8, 5e-2, "SGD"), loss_fn=make_actor_loss())
    options = PPOOptions(group=2, kl_ctl=0.05, reference="copy", max_new_tokens=4, critic_lr=5e-2)
    rollouts = PPORollouts(engine, digits, "digit", options, seed=3, start_step=start, num_steps=steps)
    if load:
        engine.load_checkpoint(load)
        rollouts.load(load)
    for k, batch in enumerate(rollouts):
        engine.train_step(batch)
        if save and k + 1 == save[1]:
            engine.save_checkpoint(save[0])
            rollouts.save(save[0])
    return engine, rollouts


def test_resume_with_the_critic_equals_the_uninterrupted_run(digits, tmp_path):
    whole, whole_rollouts = _run(digits, 4, save=(tmp_path, 2))
    resumed, resumed_rollouts = _run(digits, 2, start=2, load=tmp_path)
    assert (tmp_path / "critic").is_dir()
    assert [h["critic/value_loss"] for h in whole_rollouts.history[2:]] == \
        [h["critic/value_loss"] for h in resumed_rollouts.history]
    for a, b in ((whole, resumed), (whole_rollouts.critic, resumed_rollouts.critic)):
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_ppo_method_batches_are_gae_of_the_engines_outputs(digits):
    """The trainer's flow; the batch's advantages are `zerojax.rl.gae` on the actor's and the
    critic's outputs recomputed outside the engines, the critic stepped before it is handed out."""
    method = get_method("ppo")
    with pytest.raises(ValueError, match="did you mean 'kl_ctl'"):
        method.resolve({"kl_ctrl": 0.1})
    data = method.data("digit", ByteTokens(), 11, 8)
    with pytest.raises(ValueError, match="lam=1.5"):
        method.check(method.resolve({"lam": 1.5}, data), 8, data)
    options = method.resolve({"max_new_tokens": 5, "critic_lr": 1e-3}, data)
    assert options["reward"] == "digit" and options["kl_ctl"] == 0.1 and options["gamma"] == 1.0
    sample = next(iter(data.train_batches(8, seed=0, start_step=0, num_steps=1)))
    engine = zerojax.shard(_model, _cfg(8, 1e-3), loss_fn=method.loss(options))
    rollouts = method.rollouts(engine, data, options, seed=1, start_step=5, num_steps=1)
    assert rollouts.reference == "copy"
    graphdef, state = nnx.split(rollouts.critic.model)
    critic_before = nnx.merge(graphdef, jax.tree.map(np.array, state))  # its arrays are donated to its step
    batch = next(rollouts)
    assert rollouts.metrics["step"] == 5 and rollouts.critic.global_steps == 1
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {k: (v.shape, v.dtype) for k, v in sample.items()}
    logps = np.asarray(completion_logps(engine.model, batch))
    values = np.asarray(completion_values(critic_before, batch))
    mask = batch["completion_mask"]
    assert mask[:, :5].all() and not mask[:, 5:].any()
    np.testing.assert_allclose(batch["old_logps"], logps, atol=2e-5)
    np.testing.assert_allclose(batch["ref_logps"], logps, atol=2e-5)  # the copy: nothing trained yet
    texts = [bytes(int(t) for t in r[n:n + 5]).decode("utf-8", "replace")
             for r, n in zip(batch["input_ids"], batch["prompt_lengths"])]
    rewards = gae.token_rewards(logps, logps, digit_reward(None, texts), mask)
    advantages, _ = gae.advantages_and_returns(values, rewards, mask)
    np.testing.assert_allclose(batch["advantages"], advantages, atol=1e-4)
    assert np.isfinite(float(engine.train_step(batch)["loss"]))
