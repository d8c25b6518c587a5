"""The two compiled programs of generation: `prefill` (the prompt bucket through every layer, its
keys and values into a fresh cache, the first new token) and `decode` (one token per iteration of
a `lax.while_loop`, until every row is done or the step limit). Each is compiled once per shape
bucket (`zerojax.generation.buckets`) and weights source; sampling values are arguments.

Why a `while_loop` and not a host loop per token: the loop's condition (`all rows done`) is read on
the device, so stopping early costs no host round trip and no per-token dispatch; the host takes
over only every few steps where stop strings need the tokenizer (`zerojax.generation.api`).

The weights come in as they live (an engine's compute-dtype params in their ZeRO / tensor
sharding, or a module's state) and the model is merged from them inside the trace: GSPMD inserts
the gathers the sharding needs, the engine's per-layer fetch (ZeRO-3's gather on use,
offload_param's copy) runs per layer as in training, and nothing is copied outside the program.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.generation import cache
from zerojax.generation.families import decode_logits, family_of
from zerojax.generation.sampling import Sampler, SamplingValues, next_token

NO_TOKEN = -1  # a row's output after it is done

# XLA options of both programs. Each product reads one layer's kernel out of the stacked weights
# [layers, ...]; XLA's Triton gemm fusions take no slice for an operand, so with them every slice
# became a device-to-device copy before its gemm (Llama-3.1-8B at batch 1 on an H100: 224 copies a
# token, 8.5 ms of a 15.4 ms step, the weights read twice and written once). cuBLAS gemms with
# dynamic-slice fusion read the slice where it lies (a pointer offset into the stack). Per program:
# training keeps XLA's defaults.
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True}
# The decode program also keeps XLA's dot merger off: it merges the products that share an input
# (q / k / v, gate / up) into one gemm over weights concatenated inside the loop, so every token
# copied those weights (Llama-3.2-1B at batch 64 on an H100: 32 concatenations of 13-41 us a step,
# each layer's q, k, v, gate and up read twice and written once; XLA merges weights of <= 32 MB,
# 1B's but not 8B's). Unmerged, each gemm reads its slice of the stack where it lies.
DECODE_COMPILER_OPTIONS = {**COMPILER_OPTIONS, "xla_gpu_dot_merger_threshold_mb": 0}


@dataclasses.dataclass(frozen=True)
class ModuleSource:
    """A plain nnx module: the weights are `nnx.split(model)`'s state."""

    graphdef: Any

    def model(self, weights):
        return nnx.merge(self.graphdef, weights)


@dataclasses.dataclass(frozen=True)
class EngineSource:
    """An engine's live weights: (state.params, state.rest) merged as its step merges them. Equal
    (one compiled program) for one engine: its StepSettings compare by identity."""

    settings: Any  # zerojax.engine.step.StepSettings

    def model(self, weights):
        from zerojax.engine import step as step_mod

        params, rest = weights
        if self.settings.fetch_rest is not None:  # stage 3 / offload_param: the non-layer leaves where used
            params = self.settings.fetch_rest(params)
        return step_mod.merge(self.settings, params, rest)


class DecodeState(NamedTuple):
    keys: jax.Array  # [layers, B, kv_heads, length, head_dim]
    values: jax.Array
    tokens: jax.Array  # int32 [B, out_len]: the new tokens, NO_TOKEN after a row is done
    last: jax.Array  # int32 [B]: the token fed next
    step: jax.Array  # int32: new tokens so far
    done: jax.Array  # bool [B]
    seen: jax.Array  # bool [B, vocab] (the repetition penalty's tokens) or [B, 1] without it


def run_layers(fam, x, keys, values, slot, attend_layer, positions, unroll: bool = False):
    """x through every layer, each writing its k, v at `slot` and attending over the cache
    (`attend_layer(keys, values, layer, slot, q, k, v) -> (keys, values, o)`): a `lax.scan` over the
    stacked layer params with the whole cache in the carry (unrolled for the decode step: see
    `decode`)."""

    def body(carry, p):
        x, keys, values, layer = carry
        q, k, v = fam.attention_inputs(x, p, positions)
        keys, values, o = attend_layer(keys, values, layer, slot, q, k, v)
        return fam.attention_output_and_mlp(x, o, p), keys, values, layer + 1

    body, layers, fetch = fam.layers(body)

    def step(carry, p):
        return body(carry, p if fetch is None else fetch(p)), None

    (x, keys, values, _), _ = jax.lax.scan(step, (x, keys, values, jnp.int32(0)), layers, unroll=unroll)
    return x, keys, values


def _is_stop(tokens, stop_ids):
    return (tokens[:, None] == stop_ids[None, :]).any(-1)


def _mark_seen(seen, tokens, sampler: Sampler):
    if not sampler.penalty:
        return seen
    rows = jnp.arange(tokens.shape[0])[:, None]
    cols = jnp.where(tokens >= 0, tokens, seen.shape[-1]).reshape(tokens.shape[0], -1)
    return seen.at[rows, cols].set(True, mode="drop")  # NO_TOKEN / padding: out of range, dropped


# The prefill's attention scores of one piece of the prompt, [batch, heads, piece, prompt] fp32, are
# kept under this: a longer prompt goes through the layers a piece of tokens at a time, each piece
# attending over the cache the earlier ones filled (chunked prefill). Whole, batch 256 x 1024 prompt
# tokens of Llama-3.2-1B would hold 32 GiB of scores (and [batch, prompt, ffn] MLP activations
# of 8 GiB), however small the cache; in pieces the transient shrinks with the piece.
PREFILL_SCORES_BYTES = 1 << 30


def prefill_piece(heads: int, batch: int, prompt_len: int) -> int:
    """Prompt tokens per prefill piece: the whole bucket where its scores fit `PREFILL_SCORES_BYTES`,
    else halved until they do, while a multiple of 32 (so a divisor of the bucket, at least 16)."""
    piece = prompt_len
    while piece % 32 == 0 and prefill_scores_bytes(heads, batch, prompt_len, piece) > PREFILL_SCORES_BYTES:
        piece //= 2
    return piece


def prefill_scores_bytes(heads: int, batch: int, prompt_len: int, piece: int) -> int:
    """Bytes of one prefill piece's fp32 attention scores: what the prefill holds beside the cache
    at the least (the cache guard counts them)."""
    return batch * heads * piece * prompt_len * 4


@functools.partial(jax.jit, static_argnames=("source", "sampler", "length", "out_len", "piece"),
                   compiler_options=COMPILER_OPTIONS)
def prefill(weights, ids, pad, live, values: SamplingValues, stop_ids, key, expand=None, *, source,
            sampler: Sampler, length: int, out_len: int, piece: int | None = None) -> DecodeState:
    """ids [B, P] left-padded (pad [B] padding tokens per row; live [B] False for the batch
    bucket's filler rows, done from the start) -> the state after the first new token: the cache
    [.., length, ..] holding the prompt at slots 0 .. P-1. piece: prompt tokens per pass through
    the layers (a divisor of P; None: all), each pass attending over the prompt's slots so far.
    expand: None, or int32 [rows]: the state's row r continues prompt row expand[r] (ids / pad are
    then the distinct prompts', live the state's rows): a prompt asked for several times (GRPO's
    group) goes through the layers once, its cache copied to its rows, each row sampling its own
    first token."""
    model = source.model(weights)
    fam = family_of(model)
    g = fam.geometry
    B, P = ids.shape
    piece = P if piece is None else piece
    keys, vals = cache.empty(g, B, length, model.dtype)

    def through_layers(start, keys, vals):
        """Prompt slots start .. start + piece - 1 through every layer -> (their last residual, cache)."""
        slots = start + jnp.arange(piece, dtype=jnp.int32)
        positions = cache.positions(slots, pad)
        mask = cache.attention_mask(slots, pad, P, g.window)  # the prompt's slots only (`write_and_attend`)
        tokens = jax.lax.dynamic_slice_in_dim(ids, start, piece, axis=1)
        x, keys, vals = run_layers(fam, fam.embed(tokens, positions), keys, vals, start,
                                    functools.partial(cache.write_and_attend, mask=mask), positions)
        return x[:, -1:], keys, vals

    if piece == P:
        x, keys, vals = through_layers(0, keys, vals)
    else:
        x = jnp.zeros_like(fam.embed(ids[:, :1], jnp.zeros((B, 1), jnp.int32)))  # the residual's [B, 1, d]
        x, keys, vals = jax.lax.fori_loop(0, P // piece, lambda i, c: through_layers(i * piece, *c[1:]),
                                          (x, keys, vals))
    if expand is not None:
        keys, vals, x, ids, pad = keys[:, expand], vals[:, expand], x[expand], ids[expand], pad[expand]
        B = expand.shape[0]
    logits = decode_logits(fam, x)[:, 0]
    slots = jnp.arange(P, dtype=jnp.int32)
    seen = jnp.zeros((B, logits.shape[-1] if sampler.penalty else 1), bool)
    seen = _mark_seen(seen, jnp.where(slots[None] >= pad[:, None], ids, NO_TOKEN), sampler)
    tok = next_token(sampler, values, logits, seen, jax.random.fold_in(key, 0))
    tokens = jnp.full((B, out_len), NO_TOKEN, jnp.int32).at[:, 0].set(tok)
    return DecodeState(keys, vals, tokens, tok, jnp.int32(1), ~live | _is_stop(tok, stop_ids),
                       _mark_seen(seen, tok, sampler))


# How a decode step attends over the cache: "xla", XLA's two batched products (`cache.attend`);
# "kernel", one fused Pallas kernel (`zerojax.generation.decode_attention`) reading each row's
# visible slots only (Pallas' interpreter off the GPU; over a mesh GSPMD would gather the cache
# whole for it, as for any custom call); "auto", the kernel on one GPU where it takes the model's
# shape, else XLA. Measured on an H100 at GRPO's Llama-3.2-1B shape (batch 64, 256 + 256): one
# generate call 0.528 s with the kernel, 0.639 s with XLA (benchmarks/RESULTS.md); the RL methods
# default to "auto". generate keeps "xla" until the kernel is timed at Llama-3.1-8B's shapes too.
DECODE_ATTENTIONS = ("auto", "xla", "kernel")


def check_decode_attention_choice(choice) -> None:
    """A decode_attention value validated (one of `DECODE_ATTENTIONS`), before any model is known."""
    if choice not in DECODE_ATTENTIONS:
        raise ValueError(f"decode_attention={choice!r}: choose one of {DECODE_ATTENTIONS}")


def check_decode_attention(choice, geometry, length: int, devices: int = 1) -> bool:
    """A decode_attention choice validated for this model and cache (over `devices` devices) ->
    whether the decode program runs the kernel."""
    check_decode_attention_choice(choice)
    if choice == "xla":
        return False
    from zerojax.generation.decode_attention import decode_attention_supported

    supported = decode_attention_supported(geometry.head_dim, geometry.heads, geometry.kv_heads, length)
    if choice == "auto":
        return supported and devices == 1 and jax.default_backend() == "gpu"
    if not supported:
        raise ValueError(f"decode_attention='kernel': the kernel takes a power-of-two head_dim in 16..256 (this "
                         f"model's is {geometry.head_dim}) and a cache length that is a multiple of 16 ({length}); "
                         "use decode_attention='xla'")
    return True


@functools.partial(jax.jit, static_argnames=("source", "sampler", "kernel"), donate_argnames=("state",),
                   compiler_options=DECODE_COMPILER_OPTIONS)
def decode(weights, state: DecodeState, pad, prompt_len, limit, values: SamplingValues, stop_ids, key, *,
           source, sampler: Sampler, kernel: bool = False) -> DecodeState:
    """New tokens until every row is done or `limit` tokens (all rows); the token fed at step t
    (t >= 1) sits at cache slot prompt_len + t - 1. kernel: the attention over the cache as one
    fused kernel (decode_attention "kernel", `DECODE_ATTENTIONS`).

    The layer loop is unrolled here (not in the prefill): a decode step is a few small kernels a
    layer, and a rolled loop is a device loop whose every iteration pays its own control (on a GPU
    the trip predicate read back by the host) and splits the step into pieces no command buffer
    spans; unrolled, one token is straight-line code over static slices of the stacked weights."""
    model = source.model(weights)
    fam = family_of(model)
    length = state.keys.shape[3]
    window = fam.geometry.window

    def body(s: DecodeState) -> DecodeState:
        slots = (prompt_len + s.step - 1)[None].astype(jnp.int32)
        positions = cache.positions(slots, pad)
        if kernel:
            first, last = cache.visible_slots(slots[0], pad, window)
            attend_layer = functools.partial(cache.write_and_attend_kernel, first=first, last=last)
        else:
            attend_layer = functools.partial(cache.write_and_attend,
                                             mask=cache.attention_mask(slots, pad, length, window))
        x, keys, vals = run_layers(fam, fam.embed(s.last[:, None], positions), s.keys, s.values, slots[0],
                                    attend_layer, positions, unroll=True)
        logits = decode_logits(fam, x)[:, 0]
        tok = next_token(sampler, values, logits, s.seen, jax.random.fold_in(key, s.step))
        tok = jnp.where(s.done, NO_TOKEN, tok)
        tokens = jax.lax.dynamic_update_slice(s.tokens, tok[:, None], (0, s.step))
        return DecodeState(keys, vals, tokens, jnp.maximum(tok, 0), s.step + 1, s.done | _is_stop(tok, stop_ids),
                           _mark_seen(s.seen, tok, sampler))

    def more(s: DecodeState):
        return (s.step < limit) & ~jnp.all(s.done)

    return jax.lax.while_loop(more, body, state)


__all__ = ["ModuleSource", "EngineSource", "DecodeState", "prefill", "decode", "run_layers", "DECODE_ATTENTIONS",
           "check_decode_attention", "check_decode_attention_choice", "prefill_piece",
           "prefill_scores_bytes", "PREFILL_SCORES_BYTES", "NO_TOKEN"]
