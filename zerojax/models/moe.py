"""Mixture-of-experts decoders in Flax NNX: Qwen3-MoE and Mixtral.

Numerically Hugging Face's `Qwen3MoeForCausalLM` / `MixtralForCausalLM` (eval mode): the Llama
family's attention, norms and rotary positions (`zerojax.models.llama`), with each layer's SwiGLU
MLP replaced by a sparse block of `num_experts` SwiGLU experts and a linear router.

Routing, as transformers does it: router logits in the compute dtype, softmax in fp32, the top
`num_experts_per_tok` probabilities (Qwen3-MoE renormalises them to sum 1 when `norm_topk_prob`;
Mixtral always does). Dropless: every chosen (token, expert) pair is computed. The pairs are sorted
by expert and each projection is one grouped matrix product over the experts' contiguous groups
(MaxText's `layers/moe.py`, megablox), not a loop over experts: `jax.lax.ragged_dot`, or on a Hopper
GPU JAX's Mosaic GPU grouped kernels (`zerojax.models.grouped_matmul`, which says why).

Expert weights are [E, in, out] leaves inside the stacked layers ([L, E, in, out], logical axes
"layers", "experts", "embed" / "mlp"), the router a [L, d, E] kernel. The layer scan carries the
router statistics beside the residual stream (`RouterStats`), from which `moe_loss` adds
transformers' load-balancing loss (`router_aux_loss_coef`, `load_balancing_loss_func`: counts
and probabilities summed over every layer's rows, the attention mask weighing them) and the
ST-MoE router z-loss (`router_z_loss_coef`), and returns both as metrics.

Every layer is sparse (Qwen3-MoE's `decoder_sparse_step` 1 and no `mlp_only_layers`, Mixtral):
a stack of identical layers is what the engine's layer scan runs; a config that mixes dense and
sparse layers is refused when read.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.models.expert_parallel import expert_parallel_experts
from zerojax.models.gpt2 import mean_over_tokens, nll_sum
from zerojax.models.grouped_matmul import grouped_product
from zerojax.models.llama import (
    Attention,
    Linear,
    Llama,
    LlamaConfig,
    RMSNorm,
    chunked_cross_entropy,
    hidden_inputs,
    num_params,
    shifted_labels,
)

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
EXPERTS = "experts"  # the logical name of the experts axis of expert weights


@dataclasses.dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """LlamaConfig plus Hugging Face's mixture-of-experts fields (`Qwen3MoeConfig`,
    `MixtralConfig`): `intermediate_size` is each expert's hidden width (Qwen3-MoE's
    `moe_intermediate_size`); router_z_loss_coef is the ST-MoE z-loss weight (zerojax's; 0: off)."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    model_type: str = "mixtral"
    model_types: ClassVar[tuple] = MOE_MODEL_TYPES

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            problems.append(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1 .. num_experts="
                            f"{self.num_experts}")
        for key in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, key) < 0:
                problems.append(f"{key}={getattr(self, key)} must be >= 0")
        if problems:
            raise ValueError("MoEConfig: " + "; ".join(problems))

    @classmethod
    def named(cls, name: str, **overrides) -> MoEConfig:
        """Published shapes: "qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b" (OLMoE's layer shape
        as a Qwen3-MoE: 64 experts, top 8, width 2048), "qwen1.5-moe-a2.7b" (its routed experts
        only: 60, top 4); tests: "tiny-qwen3-moe", "tiny-mixtral" (byte vocabulary 256)."""
        qwen = dict(model_type="qwen3_moe", qk_norm=True, rms_norm_eps=1e-6, rope_theta=1000000.0, head_dim=128,
                    norm_topk_prob=True, bos_token_id=151643, eos_token_id=151645)
        tiny = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_experts=4,
                    num_experts_per_tok=2)
        sizes = {
            "qwen3-30b-a3b": dict(qwen, vocab_size=151936, hidden_size=2048, intermediate_size=768,
                                  num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                  max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8),
            "olmoe-1b-7b": dict(qwen, vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                                num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, head_dim=None,
                                max_position_embeddings=4096, num_experts=64, num_experts_per_tok=8,
                                norm_topk_prob=False, bos_token_id=None, eos_token_id=50279),
            "qwen1.5-moe-a2.7b": dict(qwen, vocab_size=151936, hidden_size=2048, intermediate_size=1408,
                                      num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                                      head_dim=None, max_position_embeddings=8192, num_experts=60,
                                      num_experts_per_tok=4, norm_topk_prob=False),
            "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                 max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                                 num_experts=8, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2),
            "tiny-qwen3-moe": dict(tiny, model_type="qwen3_moe", qk_norm=True, head_dim=32, norm_topk_prob=False),
            "tiny-mixtral": dict(tiny, model_type="mixtral", rms_norm_eps=1e-5),
        }
        key = name.lower()
        if key not in sizes:
            raise ValueError(f"unknown mixture-of-experts shape {name!r}; choose one of {sorted(sizes)}")
        return cls(**{**sizes[key], **overrides})


def _expert_params(config: MoEConfig) -> tuple[int, int]:
    """(parameters of one layer's experts and router, of the experts a token runs)."""
    d, m, E, k = config.hidden_size, config.intermediate_size, config.num_experts, config.num_experts_per_tok
    return E * 3 * d * m + d * E, k * 3 * d * m + d * E


def moe_num_params(config: MoEConfig) -> int:
    """All parameters (HF's `num_parameters()`), every expert counted."""
    dense_mlp = 3 * config.hidden_size * config.intermediate_size
    return num_params(config) + config.num_hidden_layers * (_expert_params(config)[0] - dense_mlp)


def active_params(config: MoEConfig) -> int:
    """The parameters one token runs through (its top-k experts; MFU on active parameters)."""
    return moe_num_params(config) - config.num_hidden_layers * (_expert_params(config)[0] - _expert_params(config)[1])


def moe_flops_per_token(config: MoEConfig, seq_len: int) -> float:
    """Training FLOPs per token on the active parameters: 6 N_active + attention (as
    `llama.flops_per_token`, an untied input embedding not counted)."""
    n = active_params(config) - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    return 6.0 * n + 12.0 * config.num_hidden_layers * config.num_attention_heads * config.dim_per_head * seq_len


# --------------------------------------------------------------------------- parameters


class SparseMLP(nnx.Module):
    """One stacked sparse block: router [L, d, E], per-expert SwiGLU kernels gate_up [L, E, d, 2, m]
    (gate then up) and down [L, E, m, d]."""

    def __init__(self, config: MoEConfig, rngs: nnx.Rngs, dtype):
        L, d, m, E = config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_experts
        std = config.initializer_range
        self.router = Linear(rngs, (L, d, E), ("layers", "embed", None), std, dtype)
        # gate and up fused on an axis of 2 that is never split (as GPT-2's "qkv"): one grouped
        # product for both, and transformers 5's / PEFT's `experts.gate_up_proj` one to one
        self.gate_up_proj = Linear(rngs, (L, E, d, 2, m), ("layers", EXPERTS, "embed", "gate_up", "mlp"), std, dtype)
        self.down_proj = Linear(rngs, (L, E, m, d), ("layers", EXPERTS, "mlp", "embed"), std, dtype)


class MoEBlocks(nnx.Module):
    """All decoder layers, stacked on "layers"; the MLP is a `SparseMLP`."""

    def __init__(self, config: MoEConfig, rngs: nnx.Rngs, dtype):
        L, d = config.num_hidden_layers, config.hidden_size
        self.input_layernorm = RMSNorm((L, d), ("layers", "embed"), dtype)
        self.self_attn = Attention(config, rngs, dtype)
        self.post_attention_layernorm = RMSNorm((L, d), ("layers", "embed"), dtype)
        self.mlp = SparseMLP(config, rngs, dtype)


# --------------------------------------------------------------------------- routing and experts


class RouterStats(NamedTuple):
    """Router statistics summed over layers and (mask-weighted) rows, transformers'
    `load_balancing_loss_func` accumulators: `counts` [E] top-k assignments, `probs` [E] softmax
    probabilities, `rows` the rows counted, `z` the sum of logsumexp(logits)^2."""

    counts: jax.Array
    probs: jax.Array
    rows: jax.Array
    z: jax.Array

    @classmethod
    def zeros(cls, num_experts: int) -> RouterStats:
        e = jnp.zeros((num_experts,), jnp.float32)
        return cls(e, e, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))

    def __add__(self, other):
        return RouterStats(*(a + b for a, b in zip(self, other)))

    def aux_loss(self):
        """transformers' load-balancing loss: E * sum_e (counts_e / rows) (probs_e / rows)."""
        rows = jnp.maximum(self.rows, 1.0)
        return self.counts.shape[0] * jnp.sum((self.counts / rows) * (self.probs / rows))

    def z_loss(self):
        return self.z / jnp.maximum(self.rows, 1.0)


def route(h, router_kernel, config: MoEConfig, dtype):
    """h [N, d] -> (logits [N, E] in `dtype`, top-k weights [N, k] fp32, top-k expert ids [N, k])."""
    logits = jnp.einsum("nd,de->ne", h, router_kernel.astype(dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, config.num_experts_per_tok)
    if config.norm_topk_prob or config.model_type == "mixtral":  # Mixtral always renormalises
        weights = weights / weights.sum(-1, keepdims=True)
    return logits, weights, experts


def router_stats(logits, experts, token_mask) -> RouterStats:
    """One layer's `RouterStats` of its logits [N, E], chosen experts [N, k], mask [N] (fp32)."""
    E = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    chosen = jax.nn.one_hot(experts, E, dtype=jnp.float32).sum(1)  # [N, E]: 1 where chosen
    lse = jax.nn.logsumexp(logits, axis=-1)
    w = token_mask[:, None]
    return RouterStats(jax.lax.stop_gradient((chosen * w).sum(0)), (probs * w).sum(0), token_mask.sum(),
                       (lse * lse * token_mask).sum())


def grouped_experts(h, weights, experts, p, dtype, *, ragged=None):
    """The dropless sparse MLP of h [N, d] for the top-k `weights` / `experts` [N, k]: the N*k
    (token, expert) pairs sorted by expert, each projection one grouped product over the experts'
    groups, the outputs put back in token order and summed with their weights -> [N, d].

    ragged(x, entry, group_sizes, dtype) -> x's grouped product with entry["kernel"] [E, in, out]
    (an adapter's, e.g. LoRA's, replaces the plain `jax.lax.ragged_dot`)."""
    N, k = experts.shape
    E = p["router"]["kernel"].shape[-1]
    flat = experts.reshape(-1)
    if ragged is None and 2 * N * k <= E:  # few pairs (a decode step): read the chosen experts only
        out = expert_swiglu(jnp.repeat(h, k, axis=0), p, None, dtype, gathered_linear(flat))
    else:
        order = jnp.argsort(flat, stable=True)  # pair index, grouped by expert (token order inside a group)
        group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        out = expert_swiglu(h[order // k], p, group_sizes, dtype, ragged)  # [N*k, d]
        # back to (token, slot) order by the inverse permutation: a gather, no scatter-add
        out = out[jnp.argsort(order)]
    return jnp.einsum("nkd,nk->nd", out.reshape(N, k, -1), weights.astype(dtype))


def gathered_linear(experts):
    """A `ragged` for few (token, expert) pairs, as a decode step has (batch x top_k at most half
    the experts): rows x [M, in] in (token, slot) order, each times its own expert's kernel, that
    pair's `experts` [M] entry gathered, so the step reads the chosen experts' weights only. XLA's
    default rewrite of a grouped product pads every group to a dense product over all E experts,
    so a decode step can read every expert's kernels for its few chosen ones: OLMoE's batch-1
    decode measured 5.6 ms a step where its active weights take ~0.7 ms to read (one H100,
    benchmarks/RESULTS.md)."""

    def linear(x, entry, group_sizes, dtype):
        del group_sizes  # each row names its expert
        return jnp.einsum("mi,mi...->m...", x, entry["kernel"][experts].astype(dtype))

    return linear


def expert_swiglu(x, p, group_sizes, dtype, ragged=None):
    """The experts' SwiGLU on rows x [M, d] grouped by expert (`group_sizes` [E]; rows past their
    sum belong to no group and give zeros) -> [M, d]: two grouped products."""
    ragged = ragged or ragged_linear
    gate_up = ragged(x, p["gate_up_proj"], group_sizes, dtype)  # [M, 2, m]
    return ragged(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], p["down_proj"], group_sizes, dtype)


def ragged_linear(x, entry, group_sizes, dtype):
    """x [M, in] (rows grouped by expert, `group_sizes` [E]) times entry["kernel"] [E, in, *out]
    -> [M, *out]."""
    w = entry["kernel"].astype(dtype)
    return grouped_product(x, w, group_sizes)


def sparse_feed_forward(config: MoEConfig, dtype, token_mask=None, found=None, ragged=None, expert_parallel=None):
    """The `feed_forward(h, p_mlp, linear)` a layer runs (`llama.attention_output_and_mlp`):
    routing then `grouped_experts`; each call's `RouterStats` appended to `found` (a list) when
    given, weighted by token_mask [B, T]. expert_parallel: (mesh, expert axis, the rows' axes),
    the experts split over the expert axis (`zerojax.models.expert_parallel`), or None."""

    def feed_forward(h, p, linear):
        B, T, d = h.shape
        flat = h.reshape(B * T, d)
        logits, weights, experts = route(flat, p["router"]["kernel"], config, dtype)
        if found is not None:
            mask = jnp.ones((B * T,), jnp.float32) if token_mask is None else token_mask.reshape(-1)
            found.append(router_stats(logits, experts, mask.astype(jnp.float32)))
        if expert_parallel is not None:
            mesh, axis, rows = expert_parallel
            out = expert_parallel_experts(flat, weights, experts, p, dtype, mesh=mesh, axis=axis, rows=rows,
                                          compute=functools.partial(expert_swiglu, ragged=ragged))
        else:
            out = grouped_experts(flat, weights, experts, p, dtype, ragged=ragged)
        return out.reshape(B, T, d)

    return feed_forward


# --------------------------------------------------------------------------- model


class MoELlama(Llama):
    """`MoELlama(config, rngs=nnx.Rngs(0))(input_ids) -> logits`: the Llama family's model (every
    keyword and engine hook of `Llama`) with sparse layers. `hidden_states_and_extras` returns the
    router statistics (`RouterStats`) beside the final hidden states."""

    blocks_class = MoEBlocks

    def __init__(self, config: MoEConfig, **kwargs):
        super().__init__(config, **kwargs)
        self.expert_parallel = None  # engine hook: (mesh, expert axis, rows' axes) (EngineOptions.ep_size)

    def checkpoint_record(self) -> dict:
        return {"type": self.config.model_type, "family": "moe", "config": dataclasses.asdict(self.config)}

    def loss_terms(self, extras):
        """(what a training method adds to its loss, their metrics) for the `RouterStats` that
        `hidden_states_and_extras` returned: the router losses at the config's coefficients
        (`router_losses`), so DPO / GRPO on this model train the router as `moe_loss` does."""
        return router_losses(self, extras)

    def stack_carry(self, x, body, token_mask):
        cfg, dtype = self.config, self.dtype
        if getattr(self, "layer_scan", None) is not None:
            raise ValueError("a mixture-of-experts model runs its own layer scan (it carries the router "
                             "statistics): pipeline.stages > 1 and offload_param are not supported for it; "
                             "use ZeRO stage 3 without offload_param")
        ragged = getattr(getattr(self, "adapter", None), "ragged", None)

        def layer(carry, p):
            h, stats = carry
            found = []
            h = body(h, p, feed_forward=sparse_feed_forward(cfg, dtype, token_mask, found, ragged,
                                                            getattr(self, "expert_parallel", None)))
            return h, stats + found[0]

        return (x, RouterStats.zeros(cfg.num_experts)), layer


# --------------------------------------------------------------------------- loss


def token_mask_of(batch):
    """The rows' real tokens [B, T] (1) as transformers' aux loss weighs them: batch["attention_mask"]
    if given, else segment ids > 0 (packed rows' padding is segment 0), else None (every token)."""
    if batch.get("attention_mask") is not None:
        return jnp.asarray(batch["attention_mask"]).astype(jnp.float32)
    if batch.get("segment_ids") is not None:
        return (jnp.asarray(batch["segment_ids"]) > 0).astype(jnp.float32)
    return None


def router_losses(model: MoELlama, stats: RouterStats):
    """(the router terms added to the loss, their metrics {"router/aux_loss", "router/z_loss"}: named
    with a "/", which the trainer logs beside the loss)."""
    cfg = model.config
    aux, z = stats.aux_loss(), stats.z_loss()
    return cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z, {"router/aux_loss": aux, "router/z_loss": z}


def moe_loss(model: MoELlama, batch):
    """`llama_loss` (next-token cross entropy, mean over counted targets) plus
    router_aux_loss_coef x the load-balancing loss plus router_z_loss_coef x the z-loss ->
    (loss, {"tokens", "ce_loss", "router/aux_loss", "router/z_loss"})."""
    labels = shifted_labels(batch)
    x, stats = model.hidden_states_and_extras(**hidden_inputs(batch), token_mask=token_mask_of(batch))
    ce, metrics = mean_over_tokens(nll_sum(model.padded_logits(x)[:, :-1], labels), labels)
    extra, router_metrics = router_losses(model, stats)
    return ce + extra, {**metrics, "ce_loss": ce, **router_metrics}


def chunked_moe_loss(chunk: int = 128):
    """`moe_loss` with the cross entropy computed `chunk` positions at a time (`chunked_llama_loss`)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r}: the positions per piece of the cross entropy, an int >= 1")

    def loss_fn(model: MoELlama, batch):
        x, stats = model.hidden_states_and_extras(**hidden_inputs(batch), token_mask=token_mask_of(batch))
        ce, metrics = chunked_cross_entropy(model, x, batch, chunk)
        extra, router_metrics = router_losses(model, stats)
        return ce + extra, {**metrics, "ce_loss": ce, **router_metrics}

    return loss_fn


__all__ = ["MoEConfig", "MoELlama", "RouterStats", "SparseMLP", "MOE_MODEL_TYPES", "EXPERTS", "route",
           "router_stats", "grouped_experts", "expert_swiglu", "ragged_linear",
           "sparse_feed_forward", "moe_loss", "chunked_moe_loss",
           "moe_num_params", "active_params", "moe_flops_per_token", "token_mask_of"]
