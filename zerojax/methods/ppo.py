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
every token, from a reward model folder as DeepSpeed-Chat initialises it, else the policy's weights
and a fresh head. The critic's pieces live in `zerojax.scoring.critic` (below both this method and
the rollouts that train the critic) and are re-exported here.
"""
from __future__ import annotations

from zerojax.methods.grpo import make_grpo_loss
from zerojax.rl.ppo_rollouts import check_ppo_options as check_options
from zerojax.scoring.critic import (  # noqa: F401 - the critic's names, read from here too
    completion_values,
    make_critic,
    make_critic_loss,
    value_loss,
)


def make_actor_loss(*, cliprange: float = 0.2, iterations: int = 1, temperature: float = 1.0):
    """-> `loss_fn(model, batch)` for the actor's engine, on `PPORollouts`' batches (per-token
    "advantages" [B, C]; "old_logps" read where iterations > 1, else the current log-probs without
    gradient: the same values, the policy that generated is the one training)."""
    return make_grpo_loss(eps_low=cliprange, eps_high=cliprange, kl_coef=0.0, loss_level="token",
                          iterations=iterations, temperature=temperature)


__all__ = ["check_options", "completion_values", "value_loss", "make_critic_loss", "make_actor_loss", "make_critic"]
