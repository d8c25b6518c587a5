"""The serving step: one compiled program over a paged KV cache that takes, for each of R rows, a
run of up to C tokens at that row's own positions (a decode's one token, or a chunk of a prompt),
writes their keys and values into the rows' pages, attends over each row's pages, and samples the
next token of every row from its last token's logits.

The cache pool is keys / values [layers, num_pages, kv_heads, page_size, head_dim]: a page holds
`page_size` slots of each kv head contiguous (a page of one head is one [page_size, head_dim] tile,
the block of generate's decode kernel), a row's page table [R, P] lists its pages in order, and token
position p of a row lives in page table[p // page_size] at slot p % page_size. The layers run
through the model family's public pieces (`zerojax.models.pieces`, through
`zerojax.generation.decoder.run_layers`, as `zerojax.generate`); only the write (a scatter at the
rows' page slots) and the attention's reading of the pages are the pool's own. On a GPU the
attention reads each row's pages where they lie, through its page table, in generate's fused
kernel (`zerojax.generation.decode_attention`): a decode's one token, or a prompt chunk's tokens
(`chunk_attention`: each page read once for a block of the chunk's tokens, the scores on chip).
The XLA path gathers the rows' pages into one [R, kv_heads, P * page_size, head_dim] operand and
computes the chunk's [C, P * page_size] scores in memory: a 2,048-token chunk over a 4,096-slot
table is 1 GiB of fp32 scores a layer (in a profile of the server on an H100 at concurrency 64,
the transpose and reduce fusions run once a layer of each chunk step took 8.7 of the card's 29
busy ms a step).

Each row computes only from its own tokens, pages and random key, so a row's tokens never depend
on which other rows share the step. The shapes (R, C, P) come from a small set of buckets; the
sampling values are arguments, so no request compiles anything new.

The token board (int32 [slots + 1], donated like the pool) carries a decode's input token from one
step to the next on the device: each step writes its rows' sampled tokens at their slots, and a
row marked `chained` feeds its slot's token, so the engine can dispatch a step before it has read
the tokens of the step before (`zerojax.serving.engine`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zerojax.generation import cache, decoder
from zerojax.generation.families import decode_logits, family_of
from zerojax.generation.sampling import apply_repetition_penalty, top_k_top_p_filter
from zerojax.models.pieces import Geometry


class Rows(NamedTuple):
    """One step's rows (host arrays; padding rows have count 0)."""

    tokens: jax.Array  # int32 [R, C]: the tokens fed, left-aligned
    start: jax.Array  # int32 [R]: the position of tokens[:, 0]
    count: jax.Array  # int32 [R]: tokens fed (0: a padding row)
    pages: jax.Array  # int32 [R, P]: the page table (unused entries: the scratch page 0)
    adapter: jax.Array | None = None  # int32 [R]: each row's adapter in a stacked-adapters model (0: none)
    slot: jax.Array | None = None  # int32 [R]: each row's entry of the token board (padding rows: the last)
    chained: jax.Array | None = None  # bool [R]: its token fed is the board's (sampled by the step before, unread)


class RowSampling(NamedTuple):
    temperature: jax.Array  # fp32 [R], 0: greedy
    top_p: jax.Array  # fp32 [R], 1: off
    top_k: jax.Array  # int32 [R], 0: off
    seed: jax.Array  # uint32 [R]: the request's random stream
    index: jax.Array  # int32 [R]: which new token this is (folded into the stream)


class Penalties(NamedTuple):
    """The tokens a row's penalties count: ids [R, H] (-1 padding) and whether each was generated
    (presence / frequency count generated tokens only; the repetition penalty prompt + generated)."""

    ids: jax.Array
    generated: jax.Array  # bool [R, H]
    repetition: jax.Array  # fp32 [R], 1: none
    presence: jax.Array  # fp32 [R]
    frequency: jax.Array  # fp32 [R]


class StepOut(NamedTuple):
    tokens: jax.Array  # int32 [R]: each row's next token (meaningless for a row mid-prompt)
    logprob: jax.Array  # fp32 [R]: its log-probability under the model's raw distribution
    top_ids: jax.Array  # int32 [R, N]: the N most likely tokens (N = 0 unless asked for)
    top_logprobs: jax.Array  # fp32 [R, N]


def empty_pool(geometry: Geometry, num_pages: int, page_size: int, dtype):
    """(keys, values) zeros [layers, num_pages, kv_heads, page_size, head_dim]."""
    shape = (geometry.layers, num_pages, geometry.kv_heads, page_size, geometry.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def pool_bytes_per_page(geometry: Geometry, page_size: int, dtype) -> int:
    return 2 * geometry.layers * page_size * geometry.kv_heads * geometry.head_dim * jnp.dtype(dtype).itemsize


def _page_slots(pages, positions, page_size: int):
    """(page, slot in page) of `positions` [R, T] through page tables [R, P]."""
    page = jnp.take_along_axis(pages, jnp.clip(positions // page_size, 0, pages.shape[1] - 1), axis=1)
    return page, positions % page_size


def _write(keys, values, layer, at, k, v):
    """k, v [R, C, K, Dh] into pool layer `layer` at `at` = (page, slot in page), each [R, C]."""
    page, slot = (a.reshape(-1) for a in at)
    K, Dh = k.shape[2:]
    # the indices (layer, page, slot) are split by the kv-head axis: the update is [R * C, K, Dh]
    keys = keys.at[layer, page, :, slot].set(k.reshape(-1, K, Dh).astype(keys.dtype))
    values = values.at[layer, page, :, slot].set(v.reshape(-1, K, Dh).astype(values.dtype))
    return keys, values


def _write_and_gather(keys, values, layer, at, q, k, v, *, pages, mask):
    """Write k, v at `at`, then attend q over the rows' pages [R, P] gathered into one operand,
    under mask [R, 1, C, P * page_size]."""
    keys, values = _write(keys, values, layer, at, k, v)
    R, P = pages.shape

    def rows(pool):  # [N, K, ps, Dh] -> the rows' [R, P, K, ps, Dh] -> the [R, K, P * ps, Dh] `cache.attend` reads
        x = jax.lax.dynamic_index_in_dim(pool, layer, 0, keepdims=False)[pages]
        return x.swapaxes(1, 2).reshape(R, x.shape[2], P * x.shape[3], x.shape[4]).astype(q.dtype)

    return keys, values, cache.attend(q, rows(keys), rows(values), mask)


def _write_and_read_pages(keys, values, layer, at, q, k, v, *, pages, first, last):
    """Write k, v at `at`, then attend q [R, C, H, Dh] over each token's slots first .. last [R, C],
    read from its row's pages where they lie: one token a row in the fused decode kernel, a prompt
    chunk's in its chunk form (`zerojax.generation.decode_attention`)."""
    from zerojax.generation import decode_attention as kernels  # Pallas loads only when used

    keys, values = _write(keys, values, layer, at, k, v)
    if q.shape[1] == 1:
        o = kernels.decode_attention(q[:, 0], keys, values, layer, first[:, 0], last[:, 0], pages=pages)[:, None]
    else:
        o = kernels.chunk_attention(q, keys, values, layer, first, last, pages=pages)
    return keys, values, o


def _penalize(logits, p: Penalties):
    rows = jnp.arange(logits.shape[0])[:, None]
    cols = jnp.where(p.ids >= 0, p.ids, logits.shape[-1])  # padding: out of range, dropped
    seen = jnp.zeros(logits.shape, bool).at[rows, cols].set(True, mode="drop")
    counts = jnp.zeros(logits.shape, jnp.float32).at[rows, cols].add(p.generated.astype(jnp.float32), mode="drop")
    logits = apply_repetition_penalty(logits, seen, p.repetition[:, None])
    return logits - p.presence[:, None] * (counts > 0) - p.frequency[:, None] * counts


def _sample(logits, s: RowSampling, filtered: bool):
    """Each row's token: argmax where its temperature is 0, else sampled from its own stream after
    temperature, top_k, top_p (Hugging Face's order; `filtered`: some row asks for top_k or top_p,
    the host knows which, and only then is the vocabulary sorted). Every step computes both the
    argmax and the draw: choosing by a `lax.cond` on the rows' temperatures made the GPU copy the
    predicate to the host and the host wait for it inside every step (measured on an H100 at one
    stream: 70 tokens/s with it, 108 without), and the steps could not overlap."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    if filtered:
        logits = top_k_top_p_filter(logits, s.top_k[:, None], s.top_p[:, None])
    keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(s.seed, s.index)
    tok = jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
    return jnp.where(s.temperature > 0, tok, greedy)


def _board_tokens(board, rows: Rows):
    """The rows' tokens, a chained row's first (a decode's one) read from the board on the device:
    the host dispatches a step before it has read the tokens the step before sampled."""
    if board is None:
        return rows.tokens
    return rows.tokens.at[:, 0].set(jnp.where(rows.chained, board[rows.slot], rows.tokens[:, 0]))


def _step(weights, keys, values, rows: Rows, sampling: RowSampling, penalties: Penalties | None = None, board=None,
          *, source, page_size: int, top_logprobs: int = 0, kernel: bool = False, filtered: bool = True):
    """-> (keys, values, board, StepOut): the rows' tokens through every layer (their keys and
    values written to the pool, donated), and each row's next token from its last fed token, also
    written to the token board (int32 [slots + 1], donated; None: none) at the row's slot. kernel:
    the attention read from the pages by the fused kernels (decode or chunk), not gathered.
    filtered: the variant that applies the rows' top_k / top_p (`SamplingParams.filtered`)."""
    model = source.model(weights)
    rows = rows._replace(tokens=_board_tokens(board, rows))
    # each row's own adapter (zerojax.serving.adapters), else the model's projections
    rows_linear = None if rows.adapter is None else functools.partial(model.adapter.rows_linear, rows=rows.adapter)
    fam = family_of(model, linear=rows_linear)
    R, C = rows.tokens.shape
    offsets = jnp.arange(C, dtype=jnp.int32)
    valid = offsets[None] < rows.count[:, None]
    positions = jnp.where(valid, rows.start[:, None] + offsets[None], 0)
    page, slot = _page_slots(rows.pages, positions, page_size)
    # padding tokens write to the scratch page 0
    at = (jnp.where(valid, page, 0), jnp.where(valid, slot, offsets[None] % page_size))
    window = fam.geometry.window
    if kernel:  # each token's slots: first .. its position (a padding token: none, last < first)
        last = jnp.where(valid, positions, -1)
        first = jnp.zeros_like(last) if window is None else jnp.maximum(0, positions - (window - 1))
        attend_layer = functools.partial(_write_and_read_pages, pages=rows.pages, first=first, last=last)
    else:
        span = jnp.arange(rows.pages.shape[1] * page_size, dtype=jnp.int32)
        visible = span[None, None] <= positions[:, :, None]  # [R, C, L]: no future slot (nor another row's)
        if window is not None:
            visible &= positions[:, :, None] - span[None, None] < window
        attend_layer = functools.partial(_write_and_gather, pages=rows.pages, mask=visible[:, None])
    x, keys, values = decoder.run_layers(fam, fam.embed(rows.tokens, positions), keys, values, at, attend_layer,
                                         positions, unroll=C == 1)
    last = jnp.take_along_axis(x, jnp.maximum(rows.count - 1, 0)[:, None, None], axis=1)
    logits = decode_logits(fam, last)[:, 0]
    raw = jax.nn.log_softmax(logits, axis=-1)
    if penalties is not None:
        logits = _penalize(logits, penalties)
    tok = _sample(logits, sampling, filtered)
    logprob = jnp.take_along_axis(raw, tok[:, None], axis=1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(raw, top_logprobs)
    if board is not None:
        board = board.at[rows.slot].set(tok)
    return keys, values, board, StepOut(tok, logprob, top_ids.astype(jnp.int32), top_lp)


# The step as two compiled functions with generate's XLA options (zerojax.generation.decoder: each
# layer's weights read as a slice of the stack where it lies, not copied first; the decode's
# products left unmerged): `step` for rows of one token (decodes), `chunk_step` for prompt chunks.
_JIT = dict(static_argnames=("source", "page_size", "top_logprobs", "kernel", "filtered"),
            donate_argnames=("keys", "values", "board"))
step = jax.jit(_step, compiler_options=decoder.DECODE_COMPILER_OPTIONS, **_JIT)
chunk_step = jax.jit(_step, compiler_options=decoder.COMPILER_OPTIONS, **_JIT)


__all__ = ["Rows", "RowSampling", "Penalties", "StepOut", "step", "chunk_step", "empty_pool", "pool_bytes_per_page"]
