"""Reward models (DeepSpeed-Chat's step 2): the method's loss, the Bradley-Terry loss on preference
pairs (`reward_loss`). The model, a registered family's model with a scalar head in and out of
Hugging Face's `<Family>ForSequenceClassification` (`reward_from_hf`, `save_reward_hf`), is
`zerojax.scoring.reward_model`'s, re-exported here; its module docstring says how it scores."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.methods.dpo import preference_metrics
from zerojax.scoring.reward_model import (  # noqa: F401 - the model's names, read from here too
    SEQ_CLS,
    RewardModel,
    as_reward_model,
    last_token_index,
    reward_from_hf,
    save_reward_hf,
)


def reward_loss(model: RewardModel, batch):
    """The Bradley-Terry loss -log sigmoid(r_chosen - r_rejected), mean over the batch's pairs ->
    (loss, metrics): accuracy (r_chosen > r_rejected) and TRL's rewards/* (the raw scores).
    batch: "chosen_ids", "rejected_ids" [B, T] (`zerojax.data.preference`; labels unused)."""
    B = batch["chosen_ids"].shape[0]
    r = model(jnp.concatenate([jnp.asarray(batch["chosen_ids"]), jnp.asarray(batch["rejected_ids"])]))
    chosen, rejected = r[:B], r[B:]
    loss = -jax.nn.log_sigmoid(chosen - rejected).mean()
    metrics = preference_metrics(jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected))
    metrics["accuracy"] = metrics["rewards/accuracies"]
    return loss, metrics


__all__ = ["RewardModel", "as_reward_model", "reward_loss", "reward_from_hf", "save_reward_hf", "last_token_index"]
