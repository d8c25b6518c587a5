"""Group-relative advantages (GRPO, Shao et al. 2024 / TRL's GRPOTrainer; DAPO's variants).

Rewards come as [prompts * group] (each prompt's `group` completions adjacent). A completion's
advantage is its reward minus its group's mean, divided by the group's standard deviation + eps
(TRL: torch's unbiased std, eps 1e-4) where `scale_std`; DAPO / Dr. GRPO leave the std out.
A group whose rewards are all equal teaches nothing (every advantage 0): `zero_variance` marks
them (DAPO's dynamic sampling drops them and draws more).
"""
from __future__ import annotations

import numpy as np


def group_advantages(rewards, group: int, *, scale_std: bool = True, eps: float = 1e-4) -> np.ndarray:
    """fp32 [rows]: (r - group mean) / (group std + eps), or r - group mean without scale_std."""
    r = np.asarray(rewards, np.float64).reshape(-1, group)
    adv = r - r.mean(1, keepdims=True)
    if scale_std:
        std = r.std(1, ddof=1, keepdims=True) if group > 1 else np.zeros_like(r[:, :1])
        adv = adv / (std + eps)
    return adv.reshape(-1).astype(np.float32)


def zero_variance(rewards, group: int) -> np.ndarray:
    """bool [prompts]: the groups whose rewards are all equal."""
    r = np.asarray(rewards, np.float64).reshape(-1, group)
    return np.all(r == r[:, :1], axis=1)


__all__ = ["group_advantages", "zero_variance"]
