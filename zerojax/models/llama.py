"""The Llama family in Flax NNX: Llama 2 / 3 / 3.1 / 3.2, Mistral, Qwen2 / 2.5, Qwen3.

Numerically Hugging Face's `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` /
`Qwen3ForCausalLM` (eval mode): pre-RMSNorm blocks, rotary positions (rotate-half layout, the
`llama3` and `linear` frequency scalings), grouped-query attention, SwiGLU MLP, optional q/k/v
biases (Qwen2), per-head q/k RMSNorm (Qwen3), a sliding attention window (Mistral v0.1), tied or
untied embeddings. The blocks are stacked on a leading "layers" axis and run by one scan, with
the same engine hooks as `zerojax.models.gpt2.GPT2` (`layer_fetch`, `layer_scan`, `scan_unroll`,
`activation_sharding`, `checkpoint_record`; docs/CONTRACTS.md), so every engine feature that
works on GPT-2 works here with no special case. Remat policy names and save points are GPT-2's.

Logical axis names (as GPT-2's, read with `nnx.get_partition_spec(nnx.state(model))`):

  "vocab"     embedding / LM head rows (padded vocabulary), the logits' last dim
  "embed"     the model width d
  "layers"    the stacked-block axis
  "heads"     query heads
  "kv_heads"  key / value heads (`KV_HEADS`): split where the tensor size divides them (the q
              heads of tensor rank r then use exactly the kv heads of rank r), whole otherwise
  "head_dim"  per-head width
  "mlp"       the MLP's hidden width

Packed documents: `model(input_ids, segment_ids=..., positions=...)` keeps attention inside each
document (segment ids equal) and restarts the rotary positions per document (derived from the
segment ids when `positions` is not given).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from zerojax.models.attention import DEFAULT_BLOCK, causal_attention, check_block
from zerojax.models.gpt2 import (  # the shared pieces: one remat vocabulary, one LM head, one loss
    ATTENTION_IMPLS,
    ATTENTION_OUT,
    ATTENTION_RESIDUAL,
    LOGITS,
    QKV_PROJ,
    REMAT_POLICIES,
    RESIDUAL,
    SEQ_WHOLE,
    adapted_layers,
    check_remat_policy,
    fused_cross_entropy,
    lm_head,
    mean_over_tokens,
    nll_sum,
    plain_linear,
    resolve_attention,
    run_layers,
    unconstrained,
)
from zerojax.models.tiling import check_tile, tiled_over_sequence

# The logical name of the key / value heads axis. "heads" splits them over the tensor axis with
# the query heads (Megatron's GQA layout); a tensor size that does not divide the kv heads is then
# refused by the engine's tensor rules (ConfigError naming k_proj), as an indivisible q heads axis is.
KV_HEADS = "kv_heads"
ROPE_TYPES = ("default", "linear", "llama3")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hugging Face's field names and meanings (`LlamaConfig`, `Qwen3Config`, ...); rope scaling
    spelled out as fields (hashable), `model_type` the family config.json is written as."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: = num_attention_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_position_embeddings: int | None = None  # llama3 (None: max_position_embeddings)
    attention_bias: bool = False  # q / k / v biases (Qwen2: True)
    attention_out_bias: bool = False  # o_proj bias (Llama's attention_bias sets both)
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotation (Qwen3)
    sliding_window: int | None = None  # attend to the last `sliding_window` positions (Mistral v0.1)
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | tuple | None = None
    # as GPT2Config's: embedding / LM head rows padded to a multiple (padding rows zero, their
    # logits -inf); 1 keeps Hugging Face's exact shapes. Every named vocabulary below divides 128.
    make_vocab_size_divisible_by: int = 128
    # the model_types this config class takes (a subclass, e.g. the mixture-of-experts family's, has its own)
    model_types: ClassVar[tuple] = MODEL_TYPES

    def __post_init__(self):
        if isinstance(self.eos_token_id, list):  # JSON (config.json, a checkpoint record) has lists
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        problems = []
        if self.num_attention_heads % self.kv_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                            f"num_key_value_heads={self.kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            problems.append(f"hidden_size={self.hidden_size} must be divisible by num_attention_heads="
                            f"{self.num_attention_heads} (or give head_dim)")
        if self.dim_per_head % 2:
            problems.append(f"head_dim={self.dim_per_head} must be even (rotary pairs)")
        if self.rope_type not in ROPE_TYPES:
            problems.append(f"rope_type={self.rope_type!r}; choose one of {ROPE_TYPES}")
        if self.model_type not in self.model_types:
            problems.append(f"model_type={self.model_type!r}; choose one of {self.model_types}")
        m = self.make_vocab_size_divisible_by
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            problems.append(f"make_vocab_size_divisible_by={m!r}: an int >= 1 (1 = no padding)")
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    # GPT-2's names, read by the planner and the mesh search (n_layer, n_embd, n_head)
    @property
    def n_layer(self) -> int:
        return self.num_hidden_layers

    @property
    def n_embd(self) -> int:
        return self.hidden_size

    @property
    def n_head(self) -> int:
        return self.num_attention_heads

    @classmethod
    def named(cls, name: str, **overrides) -> LlamaConfig:
        """Hugging Face's published shapes: "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b",
        "qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b" (v0.1), "mistral-7b-v0.3"; and for tests
        "tiny" (Llama 3 style, GQA 4:2), "tiny-qwen2", "tiny-qwen3" (byte vocabulary 256)."""
        llama3 = dict(model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_type="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                      rope_original_max_position_embeddings=8192, max_position_embeddings=131072,
                      bos_token_id=128000, eos_token_id=128001)
        qwen = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                    bos_token_id=151643)
        mistral = dict(model_type="mistral", intermediate_size=14336, hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                       rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
        tiny = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        sizes = {
            "llama-3.2-1b": dict(llama3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_factor=32.0,
                                 tie_word_embeddings=True),
            "llama-3.2-3b": dict(llama3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                 num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_factor=32.0,
                                 tie_word_embeddings=True),
            "llama-3.1-8b": dict(llama3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_factor=8.0),
            "qwen2.5-0.5b": dict(qwen, model_type="qwen2", hidden_size=896, intermediate_size=4864,
                                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                 max_position_embeddings=32768, attention_bias=True, eos_token_id=151643),
            "qwen3-0.6b": dict(qwen, model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                               num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=40960, qk_norm=True, eos_token_id=151645),
            "mistral-7b": dict(mistral, vocab_size=32000, sliding_window=4096),
            "mistral-7b-v0.3": dict(mistral, vocab_size=32768, rope_theta=1000000.0),
            "tiny": dict(tiny, rms_norm_eps=1e-5, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
                         rope_original_max_position_embeddings=16),
            "tiny-qwen2": dict(tiny, model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
            "tiny-qwen3": dict(tiny, model_type="qwen3", qk_norm=True, head_dim=32, tie_word_embeddings=True),
        }
        key = name.lower()
        if key not in sizes:
            raise ValueError(f"unknown Llama-family shape {name!r}; choose one of {sorted(sizes)}")
        return cls(**{**sizes[key], **overrides})


def _layer_params(config: LlamaConfig) -> int:
    d, m, H, K, Dh = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.kv_heads, config.dim_per_head)
    attn = d * H * Dh + 2 * d * K * Dh + H * Dh * d
    attn += (H + 2 * K) * Dh if config.attention_bias else 0
    attn += d if config.attention_out_bias else 0
    attn += 2 * Dh if config.qk_norm else 0
    return 2 * d + attn + 3 * d * m


def num_params(config: LlamaConfig) -> int:
    """All parameters, a tied embedding counted once (HF's `num_parameters()`); the real
    vocabulary's rows only (padding rows never train)."""
    embed = config.vocab_size * config.hidden_size
    head = 0 if config.tie_word_embeddings else embed
    return embed + head + config.num_hidden_layers * _layer_params(config) + config.hidden_size


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token, 6N + 12*L*(H*Dh)*T: GPT-2's convention (`gpt2.flops_per_token`),
    N the parameters that take part in a matmul: all of them, but an untied input embedding (a
    lookup; tied, it is the LM head and counted once, as GPT-2's wte). The attention term uses the
    attention width H*Dh, which is d for every named shape but Qwen3's (16 x 128 on d = 1024)."""
    n = num_params(config) - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    width = config.num_attention_heads * config.dim_per_head
    return 6.0 * n + 12.0 * config.num_hidden_layers * width * seq_len


# --------------------------------------------------------------------------- parameters


def _param(value, names):
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def _normal(rngs, shape, std, dtype, names):
    return _param(std * jax.random.normal(rngs.params(), shape, dtype), names)


class Linear(nnx.Module):
    def __init__(self, rngs, shape, names, std, dtype, bias_axes: int = 0):
        """kernel `shape` / `names`; with bias_axes k > 0 a zero bias of the kernel's last k axes."""
        self.kernel = _normal(rngs, shape, std, dtype, names)
        if bias_axes:
            self.bias = _param(jnp.zeros((shape[0], *shape[-bias_axes:]), dtype), (names[0], *names[-bias_axes:]))


class RMSNorm(nnx.Module):
    def __init__(self, shape, names, dtype):
        self.scale = _param(jnp.ones(shape, dtype), names)


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs, dtype):
        L, d, H, K, Dh = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                          config.kv_heads, config.dim_per_head)
        std, qkv_bias = config.initializer_range, 2 if config.attention_bias else 0
        self.q_proj = Linear(rngs, (L, d, H, Dh), ("layers", "embed", "heads", "head_dim"), std, dtype, qkv_bias)
        self.k_proj = Linear(rngs, (L, d, K, Dh), ("layers", "embed", KV_HEADS, "head_dim"), std, dtype, qkv_bias)
        self.v_proj = Linear(rngs, (L, d, K, Dh), ("layers", "embed", KV_HEADS, "head_dim"), std, dtype, qkv_bias)
        self.o_proj = Linear(rngs, (L, H, Dh, d), ("layers", "heads", "head_dim", "embed"), std, dtype,
                             1 if config.attention_out_bias else 0)
        if config.qk_norm:
            self.q_norm = RMSNorm((L, Dh), ("layers", "head_dim"), dtype)
            self.k_norm = RMSNorm((L, Dh), ("layers", "head_dim"), dtype)


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs, dtype):
        L, d, m, std = config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.initializer_range
        self.gate_proj = Linear(rngs, (L, d, m), ("layers", "embed", "mlp"), std, dtype)
        self.up_proj = Linear(rngs, (L, d, m), ("layers", "embed", "mlp"), std, dtype)
        self.down_proj = Linear(rngs, (L, m, d), ("layers", "mlp", "embed"), std, dtype)


class Blocks(nnx.Module):
    """All decoder layers, each parameter stacked on a leading "layers" axis."""

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs, dtype):
        L, d = config.num_hidden_layers, config.hidden_size
        self.input_layernorm = RMSNorm((L, d), ("layers", "embed"), dtype)
        self.self_attn = Attention(config, rngs, dtype)
        self.post_attention_layernorm = RMSNorm((L, d), ("layers", "embed"), dtype)
        self.mlp = MLP(config, rngs, dtype)


# --------------------------------------------------------------------------- forward


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2] (fp32, as HF computes them), scaled."""
    dim = config.dim_per_head
    inv = (1.0 / (np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    inv = inv.astype(np.float32)
    if config.rope_type == "linear":
        return (inv / np.float32(config.rope_factor)).astype(np.float32)
    if config.rope_type != "llama3":
        return inv
    factor, low, high = (np.float32(config.rope_factor), np.float32(config.rope_low_freq_factor),
                         np.float32(config.rope_high_freq_factor))
    old = np.float32(config.rope_original_max_position_embeddings or config.max_position_embeddings)
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _rotate(x, cos, sin, dtype):
    """Rotary embedding, HF's rotate-half layout: x [B, T, N, Dh], cos / sin [B, T, Dh / 2] fp32."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[:, :, None], sin[:, :, None]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(dtype)


def _rms_norm(x, scale, eps, dtype):
    """HF's LlamaRMSNorm: normalised in fp32, cast to the compute dtype, then scaled."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return y.astype(dtype) * scale.astype(dtype)


def positions_from_segments(segment_ids):
    """Positions [B, T] restarting at 0 where the segment id changes along each row."""
    T = segment_ids.shape[-1]
    t = jnp.arange(T, dtype=jnp.int32)
    change = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], dtype=bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(change, t, 0), axis=1)
    return t - start


def attention_inputs(x, p, *, config: LlamaConfig, dtype, positions, constrain=unconstrained, linear=plain_linear):
    """One layer's q [B, T, H, Dh] and k, v [B, T, K, Dh] from its input x [B, T, d]: the input norm,
    the projections (+ biases), Qwen3's q / k norm and the rotation at `positions` [B, T]. Apart
    from the attention itself so that a decoder with a KV cache (`zerojax.generation`) runs the
    same code as training."""
    c = lambda a: a.astype(dtype)  # noqa: E731
    eps = config.rms_norm_eps
    a = p["self_attn"]
    h = _rms_norm(x, p["input_layernorm"]["scale"], eps, dtype)

    def project(name, heads_name):
        y = linear("btd,dnh->btnh", h, a[name], dtype)
        if "bias" in a[name]:
            y = y + c(a[name]["bias"])
        return checkpoint_name(constrain(y, ("batch", "seq", heads_name, "head_dim")), QKV_PROJ)

    q, k, v = project("q_proj", "heads"), project("k_proj", KV_HEADS), project("v_proj", KV_HEADS)
    if config.qk_norm:
        q = _rms_norm(q, a["q_norm"]["scale"], eps, dtype)
        k = _rms_norm(k, a["k_norm"]["scale"], eps, dtype)
    # rotary angles, in fp32 (computed here, inside the layer, so that an engine's layer scan needs
    # nothing but x: a recompute is a few element-wise ops)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_frequencies(config))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return _rotate(q, cos, sin, dtype), _rotate(k, cos, sin, dtype), v


def attention_output_and_mlp(x, o, p, *, config: LlamaConfig, dtype, constrain=unconstrained, linear=plain_linear,
                              mlp_tile: int | None = None, feed_forward=None):
    """The rest of a layer after the attention: o [B, T, H, Dh] through o_proj into the residual
    x [B, T, d], then the MLP half (shared by training's `_block` and the KV-cache decoder); with
    `mlp_tile` the MLP runs `mlp_tile` positions at a time (`tiled_over_sequence`).
    `feed_forward(h, p["mlp"], linear)` -> [B, T, d], when given, replaces the dense SwiGLU MLP (a
    mixture of experts, `zerojax.models.moe`)."""
    a, m = p["self_attn"], p["mlp"]
    out = linear("btnh,nhd->btd", o, a["o_proj"], dtype)
    if "bias" in a["o_proj"]:
        out = out + a["o_proj"]["bias"].astype(dtype)
    x = checkpoint_name(x + constrain(out, RESIDUAL), ATTENTION_RESIDUAL)

    h = _rms_norm(x, p["post_attention_layernorm"]["scale"], config.rms_norm_eps, dtype)
    if feed_forward is not None:
        return x + constrain(feed_forward(h, m, linear), RESIDUAL)

    def mlp(h):
        gate = linear("btd,dm->btm", h, m["gate_proj"], dtype)
        up = linear("btd,dm->btm", h, m["up_proj"], dtype)
        h = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
        return linear("btm,md->btd", h, m["down_proj"], dtype)

    return x + constrain(mlp(h) if mlp_tile is None else tiled_over_sequence(mlp, h, mlp_tile), RESIDUAL)


def _block(x, p, *, config: LlamaConfig, dtype, attention_impl, segment_ids=None, positions=None,
           constrain=unconstrained, linear=plain_linear, attention_block=DEFAULT_BLOCK, mlp_tile=None,
           feed_forward=None):
    """One pre-RMSNorm decoder layer on [B, T, d]; p holds this layer's slice of `Blocks`.

    Save points as GPT-2's: "layer_input", q / k / v projections (QKV_PROJ, before the norm and the
    rotation, which are cheap to redo), the attention output, the residual after attention."""
    B, T = x.shape[:2]
    x = checkpoint_name(constrain(x, RESIDUAL), "layer_input")
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if positions is None else positions
    q, k, v = attention_inputs(x, p, config=config, dtype=dtype, positions=pos, constrain=constrain, linear=linear)

    # packed documents: no attention across them (segment ids)
    o = causal_attention(q, k, v, impl=attention_impl, segment_ids=segment_ids, window=config.sliding_window,
                         block=attention_block)
    o = constrain(o, ("batch", "seq", "heads", "head_dim"))
    if attention_impl != "cudnn":  # as GPT-2: cuDNN's forward outputs are saved by primitive
        o = checkpoint_name(o, ATTENTION_OUT)
    return attention_output_and_mlp(x, o, p, config=config, dtype=dtype, constrain=constrain, linear=linear,
                                     mlp_tile=mlp_tile, feed_forward=feed_forward)


class Llama(nnx.Module):
    """`Llama(config, rngs=nnx.Rngs(0))(input_ids [B, T] int) -> logits [B, T, vocab] float32`.

    Keywords as `GPT2`'s: dtype (compute), param_dtype (storage), remat_policy (GPT-2's names,
    `zerojax.models.gpt2.REMAT_POLICIES` and "dots_<k>"), offload_activations, attention_impl
    (None: cuDNN on GPU where it applies, the blockwise attention for packed rows, else XLA;
    "blockwise": `zerojax.models.attention`, no [T, T] mask or scores; "flash": the fused Pallas kernel,
    `zerojax.models.flash_attention`, the default for packed rows on one GPU), attention_block (its keys
    per step), mlp_tile (None, or the positions per piece of a tiled MLP: ALST's TiledMLP, the
    [B, T, intermediate] activations held one piece at a time), scan_unroll. The engine's hooks
    (`layer_fetch`, `layer_scan`, `activation_sharding`) are GPT-2's, with GPT-2's meaning.
    `adapter` (set by `zerojax.lora.apply`, absent otherwise): `adapter.linear(eq, h, entry, dtype)`
    computes each projection (a quantized kernel, LoRA terms) and `adapter.layer_inputs(model)`
    gives the untrained per-layer inputs (the frozen base) scanned beside the trained parameters.
    """

    blocks_class = Blocks  # the stacked layers' parameters (a subclass swaps the MLP for experts)

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, remat_policy: str | None = None,
                 offload_activations: bool = False, attention_impl: str | None = None,
                 scan_unroll: int = 1, attention_block: int = DEFAULT_BLOCK, mlp_tile: int | None = None):
        if offload_activations:
            if remat_policy not in (None, "offload"):
                raise ValueError(f"offload_activations=True conflicts with {remat_policy=}")
            remat_policy = "offload"
        self.attention_block = check_block(attention_block)
        self.mlp_tile = check_tile(mlp_tile, "mlp_tile")
        if remat_policy is not None:
            check_remat_policy(remat_policy, config.num_hidden_layers)
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"{attention_impl=}; choose one of {ATTENTION_IMPLS}")
        if isinstance(scan_unroll, bool) or not isinstance(scan_unroll, int) or scan_unroll < 1:
            raise ValueError(f"{scan_unroll=}: an int >= 1 (layers per iteration of the layer scan)")
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.remat_policy = remat_policy
        self.attention_impl = attention_impl
        self.scan_unroll = scan_unroll
        self.layer_fetch = None  # engine hooks, as GPT2's (docs/CONTRACTS.md)
        self.layer_scan = None
        self.activation_sharding = None
        V, Vp, d, std = config.vocab_size, config.padded_vocab_size, config.hidden_size, config.initializer_range

        def table():  # the real rows drawn as an unpadded model's, padding rows zero
            w = std * jax.random.normal(rngs.params(), (V, d), param_dtype)
            return _param(jnp.pad(w, ((0, Vp - V), (0, 0))), ("vocab", "embed"))

        self.embed_tokens = table()
        self.layers = self.blocks_class(config, rngs, param_dtype)
        self.norm = RMSNorm((d,), ("embed",), param_dtype)
        if not config.tie_word_embeddings:
            self.lm_head = table()

    def checkpoint_record(self) -> dict:
        """What a checkpoint stores about this model (JSON): `zerojax.models.weights_writer`
        writes a Hugging Face folder from it."""
        return {"type": self.config.model_type, "family": "llama", "config": dataclasses.asdict(self.config)}

    def head_weight(self):
        """The LM head's [padded vocab, d] rows (the embedding when tied)."""
        w = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return w[...].astype(self.dtype)

    def __call__(self, input_ids, segment_ids=None, positions=None):
        """Logits [B, T, vocab_size] in fp32 (Hugging Face's logits)."""
        h = self.hidden_states(input_ids, segment_ids=segment_ids, positions=positions)
        return self.padded_logits(h)[..., :self.config.vocab_size]

    def padded_logits(self, x, head=lm_head):
        """LM head on [B, T, d] -> fp32 [B, T, padded vocab], padding columns -inf (GPT-2's; `head`
        the product, as there)."""
        constrain = getattr(self, "activation_sharding", None) or unconstrained
        logits = constrain(head(constrain(x, SEQ_WHOLE), self.head_weight()), LOGITS)
        cfg = self.config
        if cfg.padded_vocab_size == cfg.vocab_size:
            return logits
        return jnp.where(jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size, logits, -jnp.inf)

    def hidden_states(self, input_ids, segment_ids=None, positions=None):
        """The final norm's output [B, T, d] in the compute dtype (logits = it @ head.T).

        segment_ids [B, T] int: packed documents (attention only within equal ids); positions
        [B, T] int: rotary positions (default: from the segment ids, else 0 .. T-1)."""
        return self.hidden_states_and_extras(input_ids, segment_ids=segment_ids, positions=positions)[0]

    def stack_carry(self, x, body, token_mask):
        """(what the layer scan carries, the layer body over it) for the residual stream x: x and
        `body` themselves here; a subclass carries more beside x (the mixture-of-experts family's
        router statistics) and returns it from `hidden_states_and_extras`."""
        return x, body

    def hidden_states_and_extras(self, input_ids, segment_ids=None, positions=None, token_mask=None):
        """(`hidden_states`, what `stack_carry` carried beside the residual stream, or None);
        token_mask [B, T] (1 = a real token) weighs such statistics (None: every token)."""
        cfg, dtype = self.config, self.dtype
        constrain = getattr(self, "activation_sharding", None) or unconstrained
        if segment_ids is not None and positions is None:
            positions = positions_from_segments(segment_ids)
        x = self.embed(input_ids)

        adapter = getattr(self, "adapter", None)  # e.g. zerojax.lora's: frozen base, LoRA terms
        body = functools.partial(
            _block, config=cfg, dtype=dtype, constrain=constrain, segment_ids=segment_ids, positions=positions,
            attention_impl=resolve_attention(self.attention_impl, dtype, cfg.dim_per_head,
                                             packed=segment_ids is not None, heads=cfg.num_attention_heads,
                                             kv_heads=cfg.kv_heads),
            attention_block=getattr(self, "attention_block", DEFAULT_BLOCK), mlp_tile=getattr(self, "mlp_tile", None),
            linear=plain_linear if adapter is None else adapter.linear)
        x, body = self.stack_carry(x, body, token_mask)
        policy = self.remat_policy
        fetch = getattr(self, "layer_fetch", None)
        layers = nnx.to_pure_dict(nnx.state(self.layers, nnx.Param))
        layer_scan = getattr(self, "layer_scan", None)
        if adapter is not None:  # its frozen base scanned beside the trained layers (GPT-2's helper)
            body, layers, fetch = adapted_layers(adapter, self, body, layers, fetch=fetch, layer_scan=layer_scan,
                                                 stack="layers")
        if layer_scan is not None and (segment_ids is not None or positions is not None):
            # an engine's layer scan (pipeline stages, offload_param's prefetch) carries the hidden
            # states only: per-row side inputs would be cut into micro-batches out of step with them
            raise ValueError("packed documents (segment_ids / positions) with pipeline.stages > 1 or "
                             "offload_param: the engine's layer scan carries only the hidden states; "
                             "give padded batches (one example per row, no segment_ids)")
        x = run_layers(body, x, layers, policy=policy, fetch=fetch, layer_scan=layer_scan,
                       n_layer=cfg.num_hidden_layers, unroll=getattr(self, "scan_unroll", 1) or 1)
        x, extras = x if isinstance(x, tuple) else (x, None)
        return self.final_norm(x), extras

    def embed(self, input_ids):
        """The token embedding of input_ids [B, T] -> [B, T, d] in the compute dtype (the residual
        stream's input; the KV-cache decoder calls it too)."""
        constrain = getattr(self, "activation_sharding", None) or unconstrained
        return constrain(constrain(self.embed_tokens[...][input_ids].astype(self.dtype), SEQ_WHOLE), RESIDUAL)

    def final_norm(self, x):
        """The final RMSNorm of the residual stream x [B, T, d] (before the LM head)."""
        return _rms_norm(x, self.norm.scale[...], self.config.rms_norm_eps, self.dtype)


# --------------------------------------------------------------------------- loss


def shifted_labels(batch):
    """Next-token targets [B, T-1]: batch["labels"] (HF's convention: aligned with input_ids,
    -100 not counted) if given, else the input ids where batch["loss_mask"] (1 = a target; [B, T])
    is set, else every input id; shifted by one here, as HF does."""
    ids = batch["input_ids"]
    labels = batch.get("labels")
    if labels is None:
        mask = batch.get("loss_mask")
        labels = ids if mask is None else jnp.where(jnp.asarray(mask) != 0, ids, -100)
    return labels[:, 1:]


def hidden_inputs(batch) -> dict:
    """The keywords of `Llama.hidden_states` a batch holds: input_ids, segment_ids, positions."""
    return dict(input_ids=batch["input_ids"], segment_ids=batch.get("segment_ids"), positions=batch.get("positions"))


def _hidden(model, batch):
    return model.hidden_states(**hidden_inputs(batch))


def llama_loss(model: Llama, batch):
    """Next-token cross entropy in fp32, mean over counted targets -> (loss, {"tokens": n}).

    batch: "input_ids" [B, T]; optional "labels" (-100: no loss) or "loss_mask"; optional
    "segment_ids" / "positions" for packed documents (`zerojax.data.finetune` makes all of them;
    a document's first token is never a target of the one before it: its label is -100)."""
    labels = shifted_labels(batch)
    logits = model.padded_logits(_hidden(model, batch))
    return mean_over_tokens(nll_sum(logits[:, :-1], labels), labels)


def chunked_llama_loss(chunk: int = 128):
    """`llama_loss` computed `chunk` positions at a time (GPT-2's `fused_cross_entropy`: the full
    [B, T, vocab] logits never exist) -> a loss_fn(model, batch)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r}: the positions per piece of the cross entropy, an int >= 1")

    def loss_fn(model: Llama, batch):
        return chunked_cross_entropy(model, _hidden(model, batch), batch, chunk)

    return loss_fn


def chunked_cross_entropy(model: Llama, x, batch, chunk: int):
    """The mean next-token cross entropy of the final hidden states x [B, T, d] against the batch's
    targets, the LM head and loss run `chunk` positions at a time -> (loss, {"tokens": n})."""
    labels = shifted_labels(batch)
    constrain = getattr(model, "activation_sharding", None) or unconstrained
    x = constrain(x, SEQ_WHOLE)
    targets = jnp.pad(labels, ((0, 0), (0, 1)), constant_values=-100)
    total = fused_cross_entropy(x, model.head_weight(), targets, model.config.vocab_size, chunk, constrain)
    return mean_over_tokens(total, labels)


__all__ = ["Llama", "LlamaConfig", "attention_inputs", "attention_output_and_mlp", "llama_loss", "chunked_llama_loss",
           "chunked_cross_entropy", "hidden_inputs", "num_params", "flops_per_token",
           "rope_frequencies", "positions_from_segments", "REMAT_POLICIES", "KV_HEADS"]
