"""PPO with a critic, DeepSpeed-Chat's step 3 (`dschat/rlhf/ppo_trainer.py`): the actor's and the
critic's losses, and the critic model. The rollouts (generation, rewards, GAE, the critic's step)
are `zerojax.rl.ppo_rollouts.PPORollouts`; docs/rl.md.

Actor (`actor_loss_fn`): ratio = exp(logp - old_logp) per completion token, advantages A_t from
GAE, loss = masked mean of max(-A ratio, -A clip(ratio, 1 - cliprange, 1 + cliprange)) over the
step's completion tokens: `zerojax.methods.grpo.policy_loss` with per-token advantages, no KL term
(PPO's KL is in the rewards), loss_level "token".

Critic (`critic_loss_fn`): values V_t of the same positions, the values at rollout V_old and the
GAE returns R_t: 0.5 masked mean of max((V - R)^2, (clip(V, V_old - cliprange_value,
V_old + cliprange_value) - R)^2). The critic is a model of the policy's family with a scalar head on
every token (`zerojax.methods.reward.RewardModel`'s head, read at every position rather than the
last): from a reward model folder as DeepSpeed-Chat initialises it, else the policy's weights and a
fresh head.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.methods.grpo import make_grpo_loss, masked_mean
from zerojax.methods.logprobs import completion_hidden_states


def check_options(*, kl_ctl, clip_reward_value, gamma, lam, cliprange, cliprange_value, critic_lr=None) -> None:
    """Each setting a number in its range, else a ValueError naming it."""
    ranges = {"kl_ctl": (kl_ctl, 0, None, "the KL penalty's weight (DeepSpeed-Chat 0.1)"),
              "clip_reward_value": (clip_reward_value, 0, None, "the score's clip (DeepSpeed-Chat 5.0)"),
              "gamma": (gamma, 0, 1, "the discount (DeepSpeed-Chat 1.0)"),
              "lam": (lam, 0, 1, "GAE's lambda (DeepSpeed-Chat 0.95)"),
              "cliprange": (cliprange, 0, None, "the ratio's clip (DeepSpeed-Chat 0.2)"),
              "cliprange_value": (cliprange_value, 0, None, "the value's clip (DeepSpeed-Chat 0.2)")}
    if critic_lr is not None:
        ranges["critic_lr"] = (critic_lr, 0, None, "the critic's learning rate (None: the actor's)")
    for name, (v, low, high, what) in ranges.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < low or (high is not None and v > high):
            span = f"{low} to {high}" if high is not None else f">= {low}"
            raise ValueError(f"{name}={v!r}: {what}, a number {span}")


def completion_values(critic, batch):
    """fp32 [B, C]: the critic's value at each position that predicts a completion token (the state
    before the token), `critic` a `RewardModel` (its base's hidden states through its head)."""
    x, _ = completion_hidden_states(critic.model, batch)
    return x.astype(jnp.float32) @ critic.score[...].astype(jnp.float32)[:, 0]


def value_loss(values, old_values, returns, mask, *, cliprange_value: float = 0.2, token_weights=None):
    """(loss, metrics): DeepSpeed-Chat's clipped value loss on [B, C] values, values at rollout,
    returns and the completion mask. token_weights [B]: each row's tokens weigh token_weights / B
    (the rollouts give rows / the step's token count); None: the mean over this batch's tokens."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    values, old_values, returns, mask = f32(values), f32(old_values), f32(returns), f32(mask)
    clipped = jnp.clip(values, old_values - cliprange_value, old_values + cliprange_value)
    plain, far = (values - returns) ** 2, (clipped - returns) ** 2
    per_token = 0.5 * jnp.maximum(plain, far)
    if token_weights is None:
        loss = masked_mean(per_token, mask)
    else:
        loss = ((per_token * mask).sum(-1) * f32(token_weights)).mean()
    v = jax.lax.stop_gradient(values)
    metrics = {"critic/clip_fraction": masked_mean((jax.lax.stop_gradient(far) > jax.lax.stop_gradient(plain))
                                                   .astype(jnp.float32), mask),
               "critic/values": masked_mean(v, mask)}
    return loss, metrics


def make_critic_loss(*, cliprange_value: float = 0.2):
    """-> `loss_fn(critic, batch)` for the critic's engine, on "input_ids", "prompt_lengths",
    "completion_mask", "old_values", "returns", "token_weights"."""

    def loss_fn(critic, batch):
        return value_loss(completion_values(critic, batch), batch["old_values"], batch["returns"],
                          batch["completion_mask"], cliprange_value=cliprange_value,
                          token_weights=batch["token_weights"])

    return loss_fn


def make_actor_loss(*, cliprange: float = 0.2, iterations: int = 1, temperature: float = 1.0):
    """-> `loss_fn(model, batch)` for the actor's engine, on `PPORollouts`' batches (per-token
    "advantages" [B, C]; "old_logps" read where iterations > 1, else the current log-probs without
    gradient: the same values, the policy that generated is the one training)."""
    return make_grpo_loss(eps_low=cliprange, eps_high=cliprange, kl_coef=0.0, loss_level="token",
                          iterations=iterations, temperature=temperature)


def make_critic(policy, *, critic=None, seed: int = 0):
    """The critic model: `critic` a reward model folder (`reward_from_hf`: DeepSpeed-Chat starts the
    critic from the reward model), else `policy` (a causal LM of a registered family; a LoRA model
    merged) with a fresh scalar head from `seed`."""
    from zerojax.methods.reward import RewardModel, reward_from_hf

    if critic is not None:
        model = reward_from_hf(critic)
        want = getattr(getattr(policy, "config", None), "vocab_size", None)
        if want is not None and model.config.vocab_size != want:
            raise ValueError(f"critic={critic!r}: a vocabulary of {model.config.vocab_size} tokens, the policy's has "
                             f"{want}; the critic reads the policy's tokens: give a reward model of its tokenizer")
        return model
    if getattr(policy, "adapter", None) is not None:
        from zerojax import lora

        policy = lora.merge(policy)
    return RewardModel(policy, pad_token_id=None, seed=seed)


__all__ = ["check_options", "completion_values", "value_loss", "make_critic_loss", "make_actor_loss", "make_critic"]
