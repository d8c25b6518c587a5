"""DPO and IPO: preference optimisation against a frozen reference, as TRL's `DPOTrainer` computes it.

    loss_fn = make_dpo_loss(beta=0.1, loss_type="sigmoid", reference="adapters_off")
    engine = zerojax.shard(lambda: lora.apply(from_hf(path), {...}), cfg, loss_fn=loss_fn)
    for batch in data.train_batches(cfg.train_batch_size, seed=0, start_step=0, num_steps=N):
        metrics = engine.train_step(batch)   # loss, rewards/chosen, rewards/margins, ...

With h = (log pi(y_w|x) - log pi(y_l|x)) - (log ref(y_w|x) - log ref(y_l|x)) per pair:

- "sigmoid" (DPO, Rafailov et al. 2023, eq. 7): -log sigmoid(beta h); with label_smoothing e
  the conservative DPO of Mitchell (2023) as TRL computes it:
  -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h);
- "ipo" (Azar et al. 2023, eq. 17, beta is their tau): (h - 1 / (2 beta))^2, on log-probs
  averaged over each sequence's completion tokens (TRL divides both the policy's and the
  reference's summed log-probs by the completion length for IPO).

The reference:
- "adapters_off": the model is a LoRA model (`zerojax.lora`) and the reference is its frozen
  base, run in the same loss on the same arrays with the LoRA terms at scale 0
  (`lora.adapters_zeroed`: the reference compiles as the differentiated policy pass does, kernels
  included) under `stop_gradient`: no second copy of the weights. At step 0, with PEFT's B = 0
  initialisation, reference = policy and the DPO loss is ln 2.
- "precomputed": the batch carries "ref_chosen_logps" / "ref_rejected_logps" (summed log-probs,
  [B] fp32), computed once before training by `precompute_reference(model, data, batch_size)`
  with the frozen starting model.

Metrics (means over the micro-batch's pairs, TRL's names): rewards/chosen, rewards/rejected
(beta x the policy-reference log-ratio), rewards/margins, rewards/accuracies (chosen reward >
rejected reward), logps/chosen, logps/rejected (the policy's; averaged per token for IPO, as TRL).

A model with loss terms of its own (a mixture of experts' router losses, `MoELlama.loss_terms`)
adds them to the loss at its config's coefficients (router_aux_loss_coef x the load-balancing
loss over both sides' tokens, as TRL adds `aux_loss_coef` x the policy pass's `aux_loss`) and logs
them (router/aux_loss, router/z_loss); the reference pass adds none.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.scoring.logprobs import pair_batch, sequence_logps, with_loss_terms

LOSS_TYPES = ("sigmoid", "ipo")
REFERENCES = ("adapters_off", "precomputed")
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def check_options(beta, loss_type, label_smoothing, reference=None):
    """Refuses settings the formulas do not take, naming the setting and the accepted values."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"beta={beta!r}: the strength of the reference's pull, a number > 0 (TRL's default 0.1)")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; choose one of {LOSS_TYPES}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing!r}: the probability a label is flipped, in [0, 0.5)")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing={label_smoothing} is conservative DPO's (loss_type=\"sigmoid\"); "
                         f"loss_type={loss_type!r} takes none: remove it")
    if reference is not None and reference not in REFERENCES:
        raise ValueError(f"reference={reference!r}; choose one of {REFERENCES}")


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0):
    """TRL's `dpo_loss`: per-pair (losses [B], chosen_rewards [B], rejected_rewards [B]) in fp32
    from the four per-sequence log-probs [B] (summed for "sigmoid", per-token averages for
    "ipo": `make_dpo_loss` passes them so). Rewards are beta x (policy - reference), without
    gradient."""
    check_options(beta, loss_type, label_smoothing)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    pc, pr, rc, rr = f32(policy_chosen), f32(policy_rejected), f32(ref_chosen), f32(ref_rejected)
    h = (pc - pr) - (rc - rr)
    if loss_type == "sigmoid":
        losses = (-jax.nn.log_sigmoid(beta * h) * (1 - label_smoothing)
                  - jax.nn.log_sigmoid(-beta * h) * label_smoothing)
    else:
        losses = (h - 1 / (2 * beta)) ** 2
    chosen_rewards = beta * jax.lax.stop_gradient(pc - rc)
    rejected_rewards = beta * jax.lax.stop_gradient(pr - rr)
    return losses, chosen_rewards, rejected_rewards


def preference_metrics(chosen_rewards, rejected_rewards) -> dict:
    """TRL's reward metrics of a batch of pairs (means)."""
    return {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32).mean()}


def check_reference(model, reference: str):
    """Refuses a model the reference cannot be had from (reference "adapters_off": a LoRA model
    without modules_to_save), naming the fix."""
    if reference != "adapters_off":
        return
    from zerojax import lora

    if getattr(model, "adapter", None) is None:
        raise ValueError("DPO reference=\"adapters_off\" trains LoRA adapters against their frozen base: apply "
                         "LoRA (zerojax.lora.apply), or for full fine-tuning give reference=\"precomputed\" (the "
                         "starting model's log-probs computed once before training: precompute_reference)")
    with lora.adapters_disabled(model):  # refuses modules_to_save (no frozen copy to run)
        pass


def reference_logps(model, pair, *, chunk=None):
    """The reference's summed log-probs [2B] of `pair` (`pair_batch`'s rows): the LoRA model's
    frozen base (adapters off), without gradient."""
    from zerojax import lora

    check_reference(model, "adapters_off")
    with lora.adapters_zeroed(model):  # the policy pass's program, not an undifferentiated one's
        logps, _ = sequence_logps(model, pair, chunk=chunk)
    return jax.lax.stop_gradient(logps)


def make_dpo_loss(beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                  reference: str = "adapters_off", chunk: int | None = None):
    """-> `loss_fn(model, batch) -> (loss, metrics)` for `zerojax.shard`: the mean DPO / IPO loss
    over the batch's pairs. batch: "chosen_ids", "chosen_labels", "rejected_ids",
    "rejected_labels" [B, T] (`zerojax.data.preference`), and with reference="precomputed"
    "ref_chosen_logps" / "ref_rejected_logps" [B]. chunk: the log-probs' logits `chunk`
    positions at a time (`zerojax.scoring.logprobs`)."""
    check_options(beta, loss_type, label_smoothing, reference)

    def loss_fn(model, batch):
        B = batch["chosen_ids"].shape[0]
        pair = pair_batch(batch)
        terms = []  # the model's own loss terms (a mixture of experts' router losses), as TRL adds them
        logps, counts = sequence_logps(model, pair, chunk=chunk, terms=terms)
        if reference == "adapters_off":
            ref = reference_logps(model, pair, chunk=chunk)
        else:
            missing = [k for k in REF_KEYS if k not in batch]
            if missing:
                raise KeyError(f"DPO reference=\"precomputed\": the batch has no {missing}; compute them once "
                               "before training with zerojax.methods.dpo.precompute_reference(model, data, batch_size)")
            ref = jnp.concatenate([jnp.asarray(batch[k], jnp.float32) for k in REF_KEYS])
        if loss_type == "ipo":  # TRL: IPO compares per-token averages
            n = jnp.maximum(counts, 1).astype(jnp.float32)
            logps, ref = logps / n, ref / n
        losses, chosen_r, rejected_r = dpo_loss(logps[:B], logps[B:], ref[:B], ref[B:], beta=beta,
                                                loss_type=loss_type, label_smoothing=label_smoothing)
        metrics = preference_metrics(chosen_r, rejected_r)
        metrics.update({"logps/chosen": jax.lax.stop_gradient(logps[:B]).mean(),
                        "logps/rejected": jax.lax.stop_gradient(logps[B:]).mean()})
        return with_loss_terms(losses.mean(), metrics, terms)

    return loss_fn


def precompute_reference(model, data, batch_size: int, *, chunk: int | None = None):
    """`data` (a `zerojax.data.preference.PreferenceRows`) with every pair's reference log-probs
    ("ref_chosen_logps", "ref_rejected_logps": summed, fp32 [rows]) from `model` as it is now (the
    frozen starting policy; a LoRA model counts its adapters). Runs `batch_size` pairs at a time
    in one jitted program on the model's own placement (a plain model on the default device, or
    an engine's sharded `engine.model`); the last batch is padded with unused rows."""
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, batch):
        logps, _ = sequence_logps(nnx.merge(graphdef, state), pair_batch(batch), chunk=chunk)
        return logps

    arrays = {k: data.arrays[k] for k in ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")}
    n = len(arrays["chosen_ids"])
    out = []
    for lo in range(0, n, batch_size):
        rows = {k: v[lo:lo + batch_size] for k, v in arrays.items()}
        short = batch_size - len(rows["chosen_ids"])
        if short:  # one program: the last batch filled up with copies of its first row
            rows = {k: np.concatenate([v, np.repeat(v[:1], short, 0)]) for k, v in rows.items()}
        logps = np.asarray(jax.device_get(run(state, rows)), np.float32)
        out.append(np.stack([logps[:batch_size], logps[batch_size:]], 1)[:batch_size - short])
    both = np.concatenate(out)
    return data.with_arrays(ref_chosen_logps=both[:, 0], ref_rejected_logps=both[:, 1])


__all__ = ["dpo_loss", "make_dpo_loss", "precompute_reference", "preference_metrics", "reference_logps",
           "check_reference",
           "check_options", "LOSS_TYPES", "REFERENCES"]
