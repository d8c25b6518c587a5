"""PPO's per-token rewards and GAE (DeepSpeed-Chat's step 3, `dschat/rlhf/ppo_trainer.py`), in
numpy over the completion tokens of fixed-shape rows ([B, C], `completion_mask` 1 on a row's
generated tokens, from column 0).

Rewards (`compute_rewards`): every completion token gets the KL penalty
-kl_ctl (logp - ref_logp) (the policy's log-prob at generation against the reference's), and the
last one also the sequence's reward-model score clipped to [-clip_reward_value, clip_reward_value].

Advantages (`get_advantages_and_returns`): backwards over the tokens,
delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, returns = A + V, with the
rewards and values after a row's last token zero (DeepSpeed-Chat zeroes them past the end).
DeepSpeed-Chat's index of the score is `start + tokens` of its left-padded rows: the position
after the last generated token's (a pad whose value it keeps); here the score goes on the last
generated token itself, the rows ending there.
"""
from __future__ import annotations

import numpy as np


def token_rewards(logps, ref_logps, scores, mask, *, kl_ctl: float = 0.1, clip_reward_value: float = 5.0):
    """fp32 [B, C]: -kl_ctl (logps - ref_logps) on every completion token, plus the clipped score
    [B] on each row's last one; 0 off the mask (a row without tokens gets nothing)."""
    mask = np.asarray(mask, np.float64)
    rewards = -kl_ctl * (np.asarray(logps, np.float64) - np.asarray(ref_logps, np.float64)) * mask
    lengths = mask.sum(-1).astype(np.int64)
    rows = np.flatnonzero(lengths > 0)
    clipped = np.clip(np.asarray(scores, np.float64), -clip_reward_value, clip_reward_value)
    rewards[rows, lengths[rows] - 1] += clipped[rows]
    return rewards.astype(np.float32)


def advantages_and_returns(values, rewards, mask, *, gamma: float = 1.0, lam: float = 0.95):
    """(advantages, returns) fp32 [B, C]: GAE over each row's completion tokens (values and
    rewards past the mask count as 0; both outputs are 0 there)."""
    mask = np.asarray(mask, np.float64)
    values = np.asarray(values, np.float64) * mask
    rewards = np.asarray(rewards, np.float64) * mask
    advantages = np.zeros_like(values)
    last = np.zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        following = values[:, t + 1] if t + 1 < values.shape[1] else 0.0
        last = rewards[:, t] + gamma * following - values[:, t] + gamma * lam * last
        advantages[:, t] = last
    advantages *= mask
    return advantages.astype(np.float32), ((advantages + values) * mask).astype(np.float32)


__all__ = ["token_rewards", "advantages_and_returns"]
