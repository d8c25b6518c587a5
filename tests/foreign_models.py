"""Two language models written the way other projects write them, not the way zerojax's GPT-2 is:
the engine must serve them through the model contract alone (zerojax.model), with no hook of its own.

`ListQwen`: Qwen3-style, as a Flax NNX port from another project would be: a Python list
(`nnx.List`) of decoder blocks, q / k / v kernels shaped [d, heads, head_dim] (`nnx.LinearGeneral`),
GQA, q / k RMSNorm, RMSNorm, SwiGLU, rotary positions, an (unused here) KV-cache argument, and
no logical axis names on any parameter. Its loop is `x = layer(x, positions)`: the engine stacks it.

`CacheListLM`: blocks in an `nnx.List` run by `for layer, c in zip(self.layers, cache): x = layer(x,
c, segment_ids)`, each writing its own cache Variable: a loop the engine must leave as it is.

`ScanLM`: layers built with `nnx.vmap` and run with `nnx.scan` (one stacked module), other
parameter names (wq / wk / wv / wo, w1 / w2 / w3, tok_embeddings, output), untied head,
LayerNorm, no logical names either.

Both are plain Flax: they import nothing of zerojax.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class QwenShape:
    vocab: int = 64
    d: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    mlp: int = 64
    layers: int = 4
    rope_theta: float = 10000.0


def _rope(x, positions, theta):
    """Rotary embedding on the last axis of x [B, T, H, Dh] (half-split convention)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * freqs          # [B, T, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _attention(q, k, v):
    """Causal attention with GQA: q [B, T, H, Dh], k / v [B, T, KV, Dh]."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
    t = q.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)


class QwenAttention(nnx.Module):
    def __init__(self, s: QwenShape, *, rngs, dtype):
        lin = lambda i, o, ax=-1: nnx.LinearGeneral(i, o, axis=ax, use_bias=False, dtype=dtype, rngs=rngs)  # noqa: E731
        self.q_proj = lin(s.d, (s.heads, s.head_dim))
        self.k_proj = lin(s.d, (s.kv_heads, s.head_dim))
        self.v_proj = lin(s.d, (s.kv_heads, s.head_dim))
        self.o_proj = lin((s.heads, s.head_dim), s.d, ax=(-2, -1))
        self.q_norm = nnx.RMSNorm(s.head_dim, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.k_norm = nnx.RMSNorm(s.head_dim, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.theta = s.rope_theta

    def __call__(self, x, positions, cache=None):
        q = _rope(self.q_norm(self.q_proj(x)), positions, self.theta)
        k = _rope(self.k_norm(self.k_proj(x)), positions, self.theta)
        v = self.v_proj(x)
        if cache is not None:  # decoding: not used in training
            k, v = jnp.concatenate([cache[0], k], 1), jnp.concatenate([cache[1], v], 1)
        return self.o_proj(_attention(q, k, v))


class QwenMLP(nnx.Module):
    def __init__(self, s: QwenShape, *, rngs, dtype):
        self.gate_proj = nnx.Linear(s.d, s.mlp, use_bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = nnx.Linear(s.d, s.mlp, use_bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = nnx.Linear(s.mlp, s.d, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenBlock(nnx.Module):
    def __init__(self, s: QwenShape, *, rngs, dtype):
        self.input_layernorm = nnx.RMSNorm(s.d, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.self_attn = QwenAttention(s, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = nnx.RMSNorm(s.d, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.mlp = QwenMLP(s, rngs=rngs, dtype=dtype)

    def __call__(self, x, positions, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class ListQwen(nnx.Module):
    def __init__(self, s: QwenShape = QwenShape(), *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.shape = s
        self.embed_tokens = nnx.Embed(s.vocab, s.d, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([QwenBlock(s, rngs=rngs, dtype=dtype) for _ in range(s.layers)])
        self.norm = nnx.RMSNorm(s.d, epsilon=1e-6, dtype=dtype, rngs=rngs)

    def __call__(self, input_ids):
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.embed_tokens.attend(self.norm(x)).astype(jnp.float32)  # tied head


@dataclasses.dataclass(frozen=True)
class ScanShape:
    vocab: int = 64
    d: int = 32
    heads: int = 4
    mlp: int = 64
    layers: int = 4


class ScanBlock(nnx.Module):
    def __init__(self, s: ScanShape, *, rngs, dtype):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=True, dtype=dtype, rngs=rngs)  # noqa: E731
        self.attention_norm = nnx.LayerNorm(s.d, dtype=dtype, rngs=rngs)
        self.wq, self.wk, self.wv, self.wo = lin(s.d, s.d), lin(s.d, s.d), lin(s.d, s.d), lin(s.d, s.d)
        self.ffn_norm = nnx.LayerNorm(s.d, dtype=dtype, rngs=rngs)
        self.w1, self.w3, self.w2 = lin(s.d, s.mlp), lin(s.d, s.mlp), lin(s.mlp, s.d)
        self.heads = s.heads

    def __call__(self, x):
        b, t, d = x.shape
        h = self.attention_norm(x)
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        a = _attention(split(self.wq(h)), split(self.wk(h)), split(self.wv(h))).reshape(b, t, d)
        x = x + self.wo(a)
        h = self.ffn_norm(x)
        return x + self.w2(jax.nn.gelu(self.w1(h)) * self.w3(h))


class ScanLM(nnx.Module):
    def __init__(self, s: ScanShape = ScanShape(), *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.shape = s
        self.tok_embeddings = nnx.Embed(s.vocab, s.d, dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=s.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return ScanBlock(s, rngs=rngs, dtype=dtype)

        self.blocks = make(rngs)
        self.norm = nnx.LayerNorm(s.d, dtype=dtype, rngs=rngs)
        self.output = nnx.Linear(s.d, s.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok_embeddings(tokens)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, x):
            return block(x)

        x = run(self.blocks, x)
        return self.output(self.norm(x)).astype(jnp.float32)


def lm_loss(model, batch):
    """Mean next-token cross-entropy over batch["input_ids"] [B, T] (fp32)."""
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return nll.mean()


# ------------------------------------------------------------------ a decoder with a per-layer cache


class KVCache(nnx.Variable):
    """One layer's key / value cache: state outside the parameters, written as the layer runs."""


def make_cache(layers: int, rows: int, seq: int, kv_heads: int, head_dim: int, dtype=jnp.float32) -> list:
    """The per-layer caches a decoding helper makes outside the model (one Variable a layer)."""
    return [KVCache(jnp.zeros((2, rows, seq, kv_heads, head_dim), dtype)) for _ in range(layers)]


class CacheBlock(nnx.Module):
    """A pre-norm block whose attention stays inside each packed document (segment ids) and
    writes this layer's keys and values into its cache Variable."""

    def __init__(self, s: QwenShape, *, rngs, dtype):
        self.norm1 = nnx.RMSNorm(s.d, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.q_proj = nnx.Linear(s.d, s.heads * s.head_dim, use_bias=False, dtype=dtype, rngs=rngs)
        self.k_proj = nnx.Linear(s.d, s.kv_heads * s.head_dim, use_bias=False, dtype=dtype, rngs=rngs)
        self.v_proj = nnx.Linear(s.d, s.kv_heads * s.head_dim, use_bias=False, dtype=dtype, rngs=rngs)
        self.o_proj = nnx.Linear(s.heads * s.head_dim, s.d, use_bias=False, dtype=dtype, rngs=rngs)
        self.norm2 = nnx.RMSNorm(s.d, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(s.d, s.mlp, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(s.mlp, s.d, use_bias=False, dtype=dtype, rngs=rngs)
        self.s = s

    def __call__(self, x, cache: KVCache, segment_ids):
        s, (b, t, _) = self.s, x.shape
        h = self.norm1(x)
        q = self.q_proj(h).reshape(b, t, s.heads, s.head_dim)
        k = self.k_proj(h).reshape(b, t, s.kv_heads, s.head_dim)
        v = self.v_proj(h).reshape(b, t, s.kv_heads, s.head_dim)
        cache[...] = cache[...].at[:, :, :t].set(jnp.stack([k, v]).astype(cache.dtype))
        rep = s.heads // s.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / jnp.sqrt(s.head_dim)
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = jnp.tril(jnp.ones((t, t), bool))[None] & same
        scores = jnp.where(mask[:, None], scores, -1e30)
        a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)
        x = x + self.o_proj(a.reshape(b, t, -1))
        return x + self.down(jax.nn.silu(self.up(self.norm2(x))))


class CacheListLM(nnx.Module):
    """Blocks in an `nnx.List`, run by a loop that hands each its own cache Variable (written in
    the loop) and the segment ids: a loop the engine cannot run as one scan."""

    def __init__(self, s: QwenShape = QwenShape(), *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.shape = s
        self.embed = nnx.Embed(s.vocab, s.d, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([CacheBlock(s, rngs=rngs, dtype=dtype) for _ in range(s.layers)])
        self.norm = nnx.RMSNorm(s.d, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(s.d, s.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, input_ids, cache, segment_ids):
        x = self.embed(input_ids)
        for layer, c in zip(self.layers, cache):
            x = layer(x, c, segment_ids)
        return self.head(self.norm(x)).astype(jnp.float32)


def cache_lm_loss(model, batch):
    """Mean next-token cross-entropy of `CacheListLM` over packed rows (batch "input_ids",
    "segment_ids" [B, T]); a fresh cache a call, as a decoding helper would make it."""
    ids, seg = batch["input_ids"], batch["segment_ids"]
    s = model.shape
    cache = make_cache(s.layers, ids.shape[0], ids.shape[1] - 1, s.kv_heads, s.head_dim)
    logits = model(ids[:, :-1], cache, seg[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    keep = (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)  # no loss across a document boundary
    return (nll * keep).sum() / keep.sum()
