"""Per-token log-probs of rollouts whose rows come in groups sharing one prompt (GRPO: `group`
completions of each prompt), with each prompt run through the layers once per group, not once per
row.

A rollout row is [prompt, completion, padding]. Under causal attention a prompt token's hidden
states do not depend on what follows it, so the `group` rows of one prompt compute the same prompt
activations `group` times over. Here each layer runs two streams:

- the prompts, one row per group [groups, P], causal among themselves;
- the completions [rows, C], each attending over its group's prompt keys / values (repeated to its
  rows) and its own earlier tokens.

The result equals `logprobs.completion_logps` on the whole rows (the same per-layer pieces:
the decoder's `Family`, built from the model's own layer code); the gradient too, since the
prompt's keys and values reach every row of its group and autodiff sums their cotangents. What
it saves: at GRPO's group 8 with prompts as long as completions, 7 of every 16 token-layers of
the forward and backward passes (Prefix Grouper, Liu et al. 2025, computes GRPO this way).

Rows of a group are consecutive (`zerojax.rl.RolloutBatches` packs them so). The models the
decoder runs take it (`zerojax.generation.families`); any other model, an engine's own layer scan
(pipeline stages, offload_param's prefetch) and LoRA dropout in training mode take the plain path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.generation.cache import attend
from zerojax.models.gpt2 import run_layers, token_nll


def shared_prompt_runs(model, rows: int, group: int | None) -> bool:
    """Whether `completion_logps_shared` takes this model and these rows (else the plain path)."""
    from zerojax.models import registry

    if group is None or group < 2 or rows % group:
        return False
    family = registry.for_model(model)
    if family is None or family.decoder is None or getattr(model, "layer_scan", None) is not None:
        return False
    drop = getattr(model, "lora_dropout", None)  # training-mode dropout draws per-token masks of the whole rows
    return drop is None or drop.deterministic or not drop.rate


def completion_logps_shared(model, batch, *, group: int, temperature: float = 1.0):
    """`logprobs.completion_logps` (per-token log-probs [B, C] fp32 of each row's completion) with
    each group of `group` consecutive rows' prompt run once (see the module's docstring).

    batch: "input_ids" [B, T] (prompt from position 0, completion after it), "prompt_lengths" [B]
    (equal within a group), "completion_mask" [B, C]; the prompts fit the first T - C positions."""
    from zerojax.generation.families import family_class

    fam = family_class(model)(model)
    # the decoder's Family sets LoRA dropout deterministic (generation is eval mode); shared_prompt_runs
    # already sent training-mode dropout to the plain path, so nothing changes here
    ids = jnp.asarray(batch["input_ids"])
    mask = jnp.asarray(batch["completion_mask"])
    plen = jnp.asarray(batch["prompt_lengths"], jnp.int32)
    B, T = ids.shape
    C = mask.shape[-1]
    P, groups = T - C, B // group
    window = fam.geometry.window

    prompt_ids, prompt_len = ids[::group, :P], plen[::group]
    at = jnp.clip(plen[:, None] + jnp.arange(C, dtype=jnp.int32)[None], 0, T - 1)
    completion_ids = jnp.take_along_axis(ids, at, axis=1)
    pos_p = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (groups, P))
    pos_c = plen[:, None] + jnp.arange(C, dtype=jnp.int32)[None]

    def visible(q_pos, k_pos, k_real):
        """bool [rows, 1, Tq, Tk]: causal by position, the key real, inside the window."""
        see = k_real[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
        if window is not None:
            see &= q_pos[:, :, None] - k_pos[:, None, :] < window
        return see[:, None]

    # the prompt's padding (positions >= its length) comes after its real tokens: causality hides it
    # from them; the completions must not see it
    mask_p = visible(pos_p, pos_p, jnp.ones((groups, P), bool))
    k_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)), pos_c], axis=1)
    k_real = jnp.concatenate([jnp.arange(P)[None] < plen[:, None], jnp.ones((B, C), bool)], axis=1)
    mask_c = visible(pos_c, k_pos, k_real)

    def layer(carry, p):
        x_p, x_c = carry
        q_p, k_p, v_p = fam.attention_inputs(x_p, p, pos_p)  # q [G, P, H, Dh], k / v [G, P, K, Dh]
        q_c, k_c, v_c = fam.attention_inputs(x_c, p, pos_c)
        o_p = attend(q_p, k_p.swapaxes(1, 2), v_p.swapaxes(1, 2), mask_p)
        keys = jnp.concatenate([jnp.repeat(k_p, group, axis=0), k_c], axis=1).swapaxes(1, 2)
        values = jnp.concatenate([jnp.repeat(v_p, group, axis=0), v_c], axis=1).swapaxes(1, 2)
        o_c = attend(q_c, keys, values, mask_c)
        return fam.after_attention(x_p, o_p, p), fam.after_attention(x_c, o_c, p)

    body, layers, fetch = fam.layers(layer)
    x_p, x_c = run_layers(body, (fam.embed(prompt_ids, pos_p), fam.embed(completion_ids, pos_c)), layers,
                          policy=getattr(model, "remat_policy", None), fetch=fetch, layer_scan=None,
                          n_layer=fam.geometry.layers)
    # completion token t is predicted at the prompt's last position (t = 0), else at completion t - 1
    last_prompt = x_p[jnp.arange(B) // group, jnp.maximum(plen - 1, 0)][:, None]
    x = model.final_norm(jnp.concatenate([last_prompt, x_c[:, :-1]], axis=1))
    logits = model.padded_logits(x)
    if temperature != 1.0:
        logits = logits.astype(jnp.float32) / temperature
    return -token_nll(logits, jnp.where(mask != 0, completion_ids, -100))


__all__ = ["shared_prompt_runs", "completion_logps_shared"]
