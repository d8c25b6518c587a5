"""Reward models (DeepSpeed-Chat's step 2): the method's loss, the Bradley-Terry loss on preference
pairs. The model (a registered family's model with a scalar head, in and out of Hugging Face's
`<Family>ForSequenceClassification`, num_labels = 1) is `zerojax.scoring.reward_model`'s,
re-exported here.

    model = reward_from_hf("Llama-3.2-1B")           # a CausalLM or SequenceClassification folder
    engine = zerojax.shard(lambda: model, cfg, loss_fn=reward_loss)
    ...
    save_reward_hf(engine.model, "rm/")             # transformers' AutoModelForSequenceClassification loads it

The score: `score` [hidden, 1] (no bias; Hugging Face's `score.weight` [1, hidden] transposed)
applied to the final hidden state of each sequence's last non-pad token, transformers'
`GenericForSequenceClassification` rule: the rightmost position whose id is not pad_token_id
(left or right padding alike; a row of pads only reads position 0); with no pad_token_id, the
last position, and a batch of more than one row is refused, as transformers refuses it. The
score is computed in fp32 on the picked hidden state.

The model's base keeps no LM head (as Hugging Face's classifier has none): an untied `lm_head`
is dropped, so it takes no memory, gradient or optimizer state.
"""
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
