"""Choosing the next token from fp32 logits [B, V]: Hugging Face's logits processors and order
(repetition penalty, then temperature, top-k, top-p), greedy or sampled with jax.random.

Which processors run is static (`Sampler`, part of the compiled program's key); their values
(`SamplingValues`: temperature, top_p, penalty) are arguments, so another temperature or top_p
reuses the compiled program. top_k is static (`lax.top_k` needs k as a shape).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampler:
    """The processors a program runs: greedy (argmax; the others then do not apply), top_k (None:
    off), top_p / penalty (their values in `SamplingValues`)."""

    greedy: bool = True
    top_k: int | None = None
    top_p: bool = False
    penalty: bool = False


class SamplingValues(NamedTuple):
    temperature: jax.Array  # fp32 scalar, > 0 where sampling
    top_p: jax.Array  # fp32 scalar in (0, 1]
    penalty: jax.Array  # fp32 scalar > 0 (HF's repetition_penalty; 1: none)


def settings(temperature=0.0, top_k=None, top_p=None, repetition_penalty=None) -> tuple[Sampler, SamplingValues]:
    """Check the user's values -> (Sampler, SamplingValues). temperature 0: greedy (HF's
    do_sample=False)."""
    if temperature is None or temperature < 0:
        raise ValueError(f"temperature={temperature!r}: 0 (greedy) or a number > 0")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r}: an int >= 1 or None")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: a number in (0, 1] or None")
    if repetition_penalty is not None and not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty={repetition_penalty!r}: a number > 0 (1.0: none) or None")
    greedy = temperature == 0
    sampler = Sampler(greedy=greedy, top_k=None if greedy else top_k,
                      top_p=not greedy and top_p is not None and top_p < 1,
                      penalty=repetition_penalty is not None and repetition_penalty != 1)
    values = SamplingValues(jnp.float32(temperature or 1.0), jnp.float32(top_p or 1.0),
                            jnp.float32(repetition_penalty or 1.0))
    return sampler, values


def apply_repetition_penalty(logits, seen, penalty):
    """HF's RepetitionPenaltyLogitsProcessor: a seen token's logit divided by `penalty` where
    positive, multiplied where negative. seen: bool [B, V] (the prompt's and generated tokens)."""
    return jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)


def top_k_filter(logits, k: int):
    """HF's TopKLogitsWarper: logits below the k-th largest -> -inf (ties kept)."""
    k = min(k, logits.shape[-1])
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_filter(logits, top_p, descending=None):
    """HF's TopPLogitsWarper (the tokens whose ascending cumulative probability stays <= 1 - top_p
    removed, the most likely always kept) by one sort of values: a token is kept where the
    probability of the tokens before it in descending order is < top_p, so the kept tokens are
    those at or above the least kept logit (ties at that logit all kept). descending: the logits
    sorted descending, where the caller has them."""
    d = -jnp.sort(-logits, axis=-1) if descending is None else descending
    p = jax.nn.softmax(d, axis=-1)
    kept = jnp.sum(jnp.cumsum(p, axis=-1) - p < top_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(d, jnp.maximum(kept - 1, 0), axis=-1)
    # top_p 1 keeps every token exactly (the rounded sums could otherwise reach 1 before the last)
    cutoff = jnp.where(top_p < 1, cutoff, -jnp.inf)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def top_k_top_p_filter(logits, top_k, top_p):
    """HF's TopKLogitsWarper then TopPLogitsWarper with each row's own values over one sort:
    top_k int [B, 1] (0: off), top_p [B, 1] (1: off)."""
    descending = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(descending, jnp.clip(top_k - 1, 0, logits.shape[-1] - 1), axis=-1)
    kth = jnp.where(top_k > 0, kth, -jnp.inf)
    logits, descending = (jnp.where(x < kth, -jnp.inf, x) for x in (logits, descending))
    return top_p_filter(logits, top_p, descending)


def next_token(sampler: Sampler, values: SamplingValues, logits, seen, key):
    """int32 [B]: the next token of each row from fp32 logits [B, V]."""
    if sampler.penalty:
        logits = apply_repetition_penalty(logits, seen, values.penalty)
    if sampler.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / values.temperature
    if sampler.top_k is not None:
        logits = top_k_filter(logits, sampler.top_k)
    if sampler.top_p:
        logits = top_p_filter(logits, values.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


__all__ = ["Sampler", "SamplingValues", "settings", "apply_repetition_penalty", "top_k_filter", "top_p_filter",
           "next_token"]
