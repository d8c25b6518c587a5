"""PPO's critic, DeepSpeed-Chat's step 3 (`dschat/rlhf/ppo_trainer.py`): a model of the policy's
family with a scalar head on every token (`zerojax.scoring.reward_model.RewardModel`'s head, read at
every position rather than the last), from a reward model folder as DeepSpeed-Chat initialises it,
else the policy's weights and a fresh head; its values and its loss.

Critic loss (`make_critic_loss`): values V_t of the completion positions, the values at rollout
V_old and the GAE returns R_t: 0.5 masked mean of max((V - R)^2, (clip(V, V_old - cliprange_value,
V_old + cliprange_value) - R)^2). The rollouts that train it are `zerojax.rl.ppo_rollouts`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.scoring.logprobs import completion_hidden_states, masked_mean


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


def make_critic(policy, *, critic=None, seed: int = 0):
    """The critic model: `critic` a reward model folder (`reward_from_hf`: DeepSpeed-Chat starts the
    critic from the reward model), else `policy` (a causal LM of a registered family; a LoRA model
    merged) with a fresh scalar head from `seed`."""
    from zerojax.scoring.reward_model import RewardModel, reward_from_hf

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


__all__ = ["completion_values", "value_loss", "make_critic_loss", "make_critic"]
