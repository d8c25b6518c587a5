"""GRPO (Shao et al. 2024, DeepSeekMath) as TRL's `GRPOTrainer` computes it, with DAPO's options
(Yu et al. 2025): the loss of one optimizer step on rollouts made by `zerojax.rl.RolloutBatches`.

Per completion token t of row i, with ratio = exp(logp - old_logp) and advantage A_i:

    loss_t = -min(ratio A_i, clip(ratio, 1 - eps_low, 1 + eps_high) A_i) + kl_coef KL_t
    KL_t   = exp(ref_logp - logp) - (ref_logp - logp) - 1          (the k3 estimator, >= 0)

averaged per sequence then over rows (loss_level "sequence": GRPO), or over every completion token
of the optimizer step (loss_level "token": DAPO; the rollouts' "token_weights" carry the step's
token count, so accumulation and data parallelism give the same mean). With iterations = 1 the
old policy is the current one (ratio 1 in value, the gradient of the ratio is the policy
gradient): `old_logps` is then logp without gradient, as TRL does.

Metrics: policy/kl (KL_t's mean over completion tokens), policy/clip_fraction (tokens whose
clipped term is the one taken: ratio < 1 - eps_low with A < 0 or ratio > 1 + eps_high with
A > 0), policy/clip_low, policy/clip_high, policy/ratio (mean), policy/logp (mean).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.rl.rollouts import LOSS_LEVELS, GRPOOptions
from zerojax.scoring.logprobs import completion_logps, masked_mean, with_loss_terms


def check_options(eps_low, eps_high, kl_coef, loss_level) -> None:
    for name, v in (("eps_low", eps_low), ("eps_high", eps_high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v:
            raise ValueError(f"{name}={v!r}: the clip range's width, a number >= 0 (GRPO 0.2; DAPO eps_high 0.28)")
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef!r}: the KL term's weight, a number >= 0 (DeepSeekMath 0.04; 0: none)")
    if loss_level not in LOSS_LEVELS:
        raise ValueError(f"loss_level={loss_level!r}; choose one of {LOSS_LEVELS}")


def policy_loss(logps, old_logps, ref_logps, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.2,
                kl_coef: float = 0.04, loss_level: str = "sequence", token_weights=None):
    """(loss, metrics) from per-token log-probs [B, C] (policy, old policy, reference or None),
    advantages [B] (or per token [B, C]: PPO) and the completion mask [B, C]. token_weights [B]
    (loss_level "token"): each row's tokens weigh token_weights / B (the rollouts give rows / the
    step's token count); None: the mean over this batch's tokens."""
    check_options(eps_low, eps_high, kl_coef, loss_level)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    logps, old_logps, advantages, mask = f32(logps), f32(old_logps), f32(advantages), f32(mask)
    if advantages.ndim == 1:  # a sequence's (GRPO); PPO's are per token [B, C]
        advantages = advantages[:, None]
    ratio = jnp.exp(logps - old_logps)
    clipped = jnp.clip(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
    metrics = {}
    if kl_coef:
        delta = f32(ref_logps) - logps
        kl = jnp.exp(delta) - delta - 1
        per_token = per_token + kl_coef * kl
        metrics["policy/kl"] = jax.lax.stop_gradient(masked_mean(kl, mask))
    if loss_level == "sequence":
        loss = ((per_token * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).mean()
    elif token_weights is None:
        loss = masked_mean(per_token, mask)
    else:
        loss = ((per_token * mask).sum(-1) * f32(token_weights)).mean()
    r = jax.lax.stop_gradient(ratio)
    low = ((r < 1 - eps_low) & (advantages < 0)).astype(jnp.float32)
    high = ((r > 1 + eps_high) & (advantages > 0)).astype(jnp.float32)
    metrics.update({"policy/clip_low": masked_mean(low, mask), "policy/clip_high": masked_mean(high, mask),
                    "policy/clip_fraction": masked_mean(jnp.maximum(low, high), mask),
                    "policy/ratio": masked_mean(r, mask),
                    "policy/logp": jax.lax.stop_gradient(masked_mean(logps, mask))})
    return loss, metrics


def make_grpo_loss(*, eps_low: float = GRPOOptions.eps_low, eps_high: float = GRPOOptions.eps_high,
                   kl_coef: float = GRPOOptions.kl_coef, loss_level: str = GRPOOptions.loss_level,
                   iterations: int = GRPOOptions.iterations, temperature: float = GRPOOptions.temperature,
                   group: int | None = None):
    """-> `loss_fn(model, batch) -> (loss, metrics)` for `zerojax.shard`, on `RolloutBatches`'
    batches ("input_ids", "prompt_lengths", "completion_mask", "advantages", "old_logps" (read
    where iterations > 1), "ref_logps" (read where kl_coef > 0), "token_weights"). group: the
    rollouts' completions per prompt, their rows consecutive: each prompt then runs through the
    model once per group, not once per row (`zerojax.scoring.shared_prompt`; same loss). None: every
    row whole. A model with loss terms of its own (a mixture of experts' router losses,
    `MoELlama.loss_terms`) adds them and their metrics, its rows run whole."""
    check_options(eps_low, eps_high, kl_coef, loss_level)
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise ValueError(f"group={group!r}: completions per prompt, an int >= 1 (or None)")

    def loss_fn(model, batch):
        # the model's own loss terms (a mixture of experts' router losses), where it has them
        terms = [] if callable(getattr(model, "loss_terms", None)) else None
        logps = completion_logps(model, batch, temperature=temperature or 1.0, group=group, terms=terms)
        old = batch["old_logps"] if iterations > 1 else jax.lax.stop_gradient(logps)
        loss, metrics = policy_loss(logps, old, batch["ref_logps"] if kl_coef else None, batch["advantages"],
                                    batch["completion_mask"], eps_low=eps_low, eps_high=eps_high, kl_coef=kl_coef,
                                    loss_level=loss_level,
                                    token_weights=batch["token_weights"] if loss_level == "token" else None)
        return with_loss_terms(loss, metrics, terms or [])

    loss_fn.shared_prompt_group = group  # what the rollouts check their batches against
    return loss_fn


__all__ = ["policy_loss", "make_grpo_loss", "masked_mean", "check_options"]
