"""Per-sequence log-probabilities of the completion tokens, for DPO / IPO and their reference.

`sequence_logps(model, batch) -> (logps [B] fp32, tokens [B] int32)`: for each row the sum of
log p(token t | tokens < t) over the positions whose label (Hugging Face's convention: aligned
with input_ids, -100 = not a target, shifted by one here) is a target, and how many there are.
Any model of a registered family runs it: it uses the models' shared pieces, `hidden_states`
(with "segment_ids" / "positions" where the batch has them: the Llama family) and
`padded_logits` (the LM head, padding columns -inf), and the cross entropy of the models'
own loss (`zerojax.models.gpt2.token_nll`: a masked sum over the vocabulary rather than a
gather, so a vocabulary split over "tensor" reduces [B, T] numbers).

Memory: by default the [B, T, vocab] fp32 logits exist whole, as in the models' plain loss.
`chunk=c` computes them c positions at a time in a scan whose body is rematerialised
(`jax.checkpoint`): the forward keeps only the per-row sums, the backward recomputes each
chunk's logits. (The models' fused loss, `fused_cross_entropy`, forms the head's gradients in the
forward pass because its output is one scalar; here the output is a [B] vector, so the
remat scan is the cheap way to the same memory.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.models.gpt2 import token_nll
from zerojax.models.llama import shifted_labels


def hidden_states(model, batch, terms: list | None = None, token_mask=None):
    """The model's final hidden states [B, T, d] for batch["input_ids"] (packed-document inputs
    passed on where present). terms: a list that gets the model's own loss terms for this pass,
    `model.loss_terms(extras)` -> (loss, metrics), where the model has them (a mixture of experts'
    router losses), weighing its statistics by token_mask [B, T] (1: a real token; None: all)."""
    extra = {k: batch[k] for k in ("segment_ids", "positions") if batch.get(k) is not None}
    if terms is None or not callable(getattr(model, "loss_terms", None)):
        return model.hidden_states(batch["input_ids"], **extra)
    x, extras = model.hidden_states_and_extras(batch["input_ids"], **extra, token_mask=token_mask)
    terms.append(model.loss_terms(extras))
    return x


def with_loss_terms(loss, metrics: dict, terms: list):
    """(loss plus the model's own terms that `hidden_states` collected, metrics with theirs): the
    router losses of a mixture of experts, which the trainer logs beside the method's metrics."""
    for extra, extra_metrics in terms:
        loss = loss + extra
        metrics = {**metrics, **extra_metrics}
    return loss, metrics


def sequence_logps(model, batch, *, chunk: int | None = None, terms: list | None = None):
    """(sum of the target tokens' log-probs [B] fp32, target count [B] int32) of each row.

    batch: "input_ids" [B, T] and "labels" [B, T] (-100: not a target) or "loss_mask".
    chunk: compute the logits `chunk` positions at a time (see the module's docstring).
    terms: gets the model's own loss terms (`hidden_states`), its statistics weighed over each
    row's tokens up to its last target (the padding after it left out)."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk={chunk!r}: positions per piece of the log-probs, an int >= 1 (or None)")
    labels = shifted_labels(batch)
    # every position's target, the last one none: the hidden states need no [:, :-1] copy
    targets = jnp.pad(labels, ((0, 0), (0, 1)), constant_values=-100)
    T_in = targets.shape[1]
    last = jnp.max(jnp.where(targets != -100, jnp.arange(T_in)[None], -1), axis=1)  # the last predicting position
    x = hidden_states(model, batch, terms, (jnp.arange(T_in)[None] <= last[:, None] + 1).astype(jnp.float32))
    counts = (labels != -100).sum(-1).astype(jnp.int32)
    B, T = targets.shape
    if chunk is None or chunk >= T:
        return -token_nll(model.padded_logits(x), targets).sum(-1), counts

    pad = -T % chunk
    xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, chunk, x.shape[-1]).swapaxes(0, 1)
    ts = jnp.pad(targets, ((0, 0), (0, pad)), constant_values=-100).reshape(B, -1, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def piece(xc, tc):
        return token_nll(model.padded_logits(xc), tc).sum(-1)

    total, _ = jax.lax.scan(lambda acc, xt: (acc + piece(*xt), None), jnp.zeros((B,), jnp.float32), (xs, ts))
    return -total, counts


def masked_mean(x, mask):
    """The mean of per-token values `x` over the positions `mask` selects (0 where none does)."""
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def completion_hidden_states(model, batch, terms: list | None = None):
    """(final hidden states [B, C, d] at the C positions that predict each row's completion
    tokens, those positions [B, C] int32) for a rollout batch ("input_ids", "prompt_lengths",
    "completion_mask": see `completion_logps`)."""
    ids = jnp.asarray(batch["input_ids"])
    C = batch["completion_mask"].shape[-1]
    start = jnp.asarray(batch["prompt_lengths"], jnp.int32)[:, None] - 1
    at = jnp.clip(start + jnp.arange(C, dtype=jnp.int32)[None], 0, ids.shape[1] - 2)  # the predicting positions
    # a row's real tokens: its prompt and completion, not the padding after them
    ends = start[:, 0] + 1 + jnp.asarray(batch["completion_mask"]).astype(jnp.int32).sum(-1)
    real = (jnp.arange(ids.shape[1])[None] < ends[:, None]).astype(jnp.float32)
    x = hidden_states(model, {"input_ids": ids}, terms, real)
    return jnp.take_along_axis(x, at[..., None], axis=1), at


def completion_logps(model, batch, *, temperature: float = 1.0, group: int | None = None,
                     terms: list | None = None):
    """Per-token log-probs [B, C] fp32 of each row's completion (RL's rollouts, `zerojax.rl`).

    batch: "input_ids" [B, T] (each row: its prompt from position 0, then its completion, then
    padding: causal attention never sees the padding, so no mask or positions are needed),
    "prompt_lengths" int32 [B], and the completion length C from "completion_mask" [B, C] (where
    0, the value is 0). Only the C positions that predict a completion token go through the LM
    head (gathered from the hidden states per row): the prompt's logits are never formed.
    temperature: the logits divided by it first, as the tokens were sampled (TRL's rule).
    group: rows come in groups of `group` consecutive rows sharing one prompt (GRPO's rollouts):
    each prompt then runs once per group where the model allows
    (`zerojax.scoring.shared_prompt`), with the same result.
    terms: gets the model's own loss terms (`hidden_states`, over each row's prompt and
    completion); the rows then run whole, not through the shared-prompt pass."""
    from zerojax.scoring.shared_prompt import completion_logps_shared, shared_prompt_runs

    if terms is None and shared_prompt_runs(model, batch["input_ids"].shape[0], group):
        return completion_logps_shared(model, batch, group=group, temperature=temperature)
    ids = jnp.asarray(batch["input_ids"])
    mask = jnp.asarray(batch["completion_mask"])
    x, at = completion_hidden_states(model, batch, terms)
    targets = jnp.where(mask != 0, jnp.take_along_axis(ids, at + 1, axis=1), -100)
    logits = model.padded_logits(x)
    if temperature != 1.0:
        logits = logits.astype(jnp.float32) / temperature
    return -token_nll(logits, targets)


def pair_batch(batch, sides=("chosen", "rejected")):
    """One batch of both sides' rows, chosen first: {"input_ids", "labels"} [2B, T] from a
    preference batch's "chosen_ids" / "chosen_labels" / "rejected_ids" / "rejected_labels"
    (one forward pass for both, as TRL's `concatenated_forward`)."""
    return {"input_ids": jnp.concatenate([jnp.asarray(batch[f"{s}_ids"]) for s in sides]),
            "labels": jnp.concatenate([jnp.asarray(batch[f"{s}_labels"]) for s in sides])}


__all__ = ["masked_mean", "sequence_logps", "completion_logps", "completion_hidden_states", "hidden_states",
           "pair_batch", "with_loss_terms"]
