"""Per-token log-probs of rollouts whose rows come in groups sharing one prompt (GRPO: `group`
completions of each prompt), with each prompt run through the layers once per group, not once per
row.

A rollout row is [prompt, completion, padding]. Under causal attention a prompt token's hidden
states do not depend on what follows it, so the `group` rows of one prompt compute the same prompt
activations `group` times over. Here each layer runs two streams:

- the prompts, one row per group [groups, P], causal among themselves;
- the completions [rows, C], each attending over its group's prompt keys / values and its own
  earlier tokens: the model's own attention over the whole rows, laid out again from both streams
  (the prompt's queries are attended again; the projections and the MLP are not).

The result equals `logprobs.completion_logps` on the whole rows (the same per-layer pieces: the
family's public `LayerPieces`, `zerojax.models.pieces`, which training's layers are made of); the
gradient too, since the
prompt's keys and values reach every row of its group and autodiff sums their cotangents. What
it saves: at GRPO's group 8 with prompts as long as completions, 7 of every 16 token-layers of
the forward and backward passes (the Prefix Grouper paper, 2025, computes GRPO this way).

Rows of a group are consecutive (`zerojax.rl.RolloutBatches` packs them so). The families with
`LayerPieces` take it; any other model, an engine's own layer scan
(pipeline stages, offload_param's prefetch) and LoRA dropout in training mode take the plain path.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zerojax.models.gpt2 import run_layers, token_nll
from zerojax.models.layer_stack import LAYER_INPUT
from zerojax.models.pieces import pieces_class, pieces_of


def shared_prompt_runs(model, rows: int, group: int | None) -> bool:
    """Whether `completion_logps_shared` takes this model and these rows (else the plain path)."""
    if group is None or group < 2 or rows % group:
        return False
    if pieces_class(model) is None or getattr(model, "layer_scan", None) is not None:
        return False
    # training-mode dropout draws per-token masks of the whole rows
    drop = getattr(model, "lora_dropout", None)
    return drop is None or drop.deterministic


def completion_logps_shared(model, batch, *, group: int, temperature: float = 1.0):
    """`logprobs.completion_logps` (per-token log-probs [B, C] fp32 of each row's completion) with
    each group of `group` consecutive rows' prompt run once (see the module's docstring).

    batch: "input_ids" [B, T] (prompt from position 0, completion after it), "prompt_lengths" [B]
    (equal within a group), "completion_mask" [B, C]; the prompts fit the first T - C positions."""
    fam = pieces_of(model)  # training-mode LoRA dropout took the plain path (`shared_prompt_runs`)
    ids = jnp.asarray(batch["input_ids"])
    mask = jnp.asarray(batch["completion_mask"])
    plen = jnp.asarray(batch["prompt_lengths"], jnp.int32)
    B, T = ids.shape
    C = mask.shape[-1]
    P, groups = T - C, B // group

    prompt_ids = ids[::group, :P]
    at = jnp.clip(plen[:, None] + jnp.arange(C, dtype=jnp.int32)[None], 0, T - 1)  # the completion's slots
    completion_ids = jnp.take_along_axis(ids, at, axis=1)
    pos_p = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (groups, P))
    pos_c = plen[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    # a whole row laid out again from the two streams: slot j < plen its group's prompt slot j,
    # plen <= j < plen + C its completion's slot j - plen (beyond: never a query that is read). The
    # prompt side is a broadcast and a pad (its backward a sum over the group), the completion side
    # one gather whose slots outside the completion are filled, not clipped, so that its backward
    # scatters each cotangent once (a clipped index would gather one slot for a whole prompt)
    slot = jnp.arange(T, dtype=jnp.int32)[None]
    from_prompt = (slot < plen[:, None])[..., None, None]
    completion_slot = (slot - plen[:, None])[..., None, None]
    row_group = jnp.arange(B) // group

    def whole_rows(prompt_part, completion_part):
        """[groups, P, n, Dh] and [B, C, n, Dh] -> the rows' [B, T, n, Dh]."""
        prompts = jnp.pad(jnp.repeat(prompt_part, group, axis=0), ((0, 0), (0, C), (0, 0), (0, 0)))
        completions = jnp.take_along_axis(completion_part, completion_slot, axis=1, mode="fill", fill_value=0)
        return jnp.where(from_prompt, prompts, completions)

    def layer(carry, p):
        x_p, x_c = (checkpoint_name(x, LAYER_INPUT) for x in carry)  # as the models' blocks name it (remat)
        q_p, k_p, v_p = fam.attention_inputs(x_p, p, pos_p)  # q [groups, P, H, Dh], k / v [groups, P, K, Dh]
        q_c, k_c, v_c = fam.attention_inputs(x_c, p, pos_c)
        o_p = fam.attention(q_p, k_p, v_p)  # the prompt's padding comes after it: causality hides it
        # the completions: the model's attention over whole rows, as the plain path runs it (the
        # prompt's queries again too: attention is the small part; the projections and the MLP,
        # the large part, ran once per group above)
        o = fam.attention(whole_rows(q_p, q_c), whole_rows(k_p, k_c), whole_rows(v_p, v_c))
        o_c = jnp.take_along_axis(o, at[..., None, None], axis=1)
        return fam.attention_output_and_mlp(x_p, o_p, p), fam.attention_output_and_mlp(x_c, o_c, p)

    body, layers, fetch = fam.layers(layer)
    x_p, x_c = run_layers(body, (fam.embed(prompt_ids, pos_p), fam.embed(completion_ids, pos_c)), layers,
                          policy=getattr(model, "remat_policy", None), fetch=fetch, layer_scan=None,
                          n_layer=fam.geometry.layers)
    # completion token t is predicted at the prompt's last position (t = 0), else at completion t - 1
    last_prompt = x_p[row_group, jnp.maximum(plen - 1, 0)][:, None]
    x = fam.final_norm(jnp.concatenate([last_prompt, x_c[:, :-1]], axis=1))
    logits = fam.logits(x)
    if temperature != 1.0:
        logits = logits.astype(jnp.float32) / temperature
    return -token_nll(logits, jnp.where(mask != 0, completion_ids, -100))


__all__ = ["shared_prompt_runs", "completion_logps_shared"]
