"""One decode step's attention as one fused Pallas (Triton) kernel: each row's new query heads over
its filled cache slots, read where they lie in the stacked cache.

Why a kernel: the XLA path (`cache.attend`) is two batched products and a softmax between them. At
a decode step each (row, kv head) pair is a [G, Dh] x [Dh, slots] product with G = query heads per
kv head (4 at Llama-3.2-1B), so cuBLAS runs thousands of tiny gemms; in a profile at batch 64 x 512
slots on an H100, the two small-tile batched gemms of each layer took 31 us where reading the
layer's keys and values (8 MiB) takes under 3 us.
Here one program per (row, kv head) streams that pair's keys and values once, with an online
softmax, and reads only the slots the row sees (from its first prompt token to the current slot),
not the whole length bucket. Where rows x kv heads are too few programs to fill the GPU (one row of
Llama-3.1-8B: 8), each pair's visible slots are split evenly over several programs and their
partial softmaxes merged after (`split_count`). A program's query rows each carry their own
bounds: `chunk_attention` puts a prompt chunk's (token, query head) pairs in a program's rows, each
token seeing the slots up to its own position (serving's chunked prefill).

The cache stays [layers, batch, kv_heads, length, head_dim] (`zerojax.generation.cache`) and is
handed over whole with the layer index as an operand: a slice of it would be a copy before a
custom call. The serving engine's paged pool, [layers, pages, kv_heads, page_size, head_dim]
(`zerojax.serving.step`), is read by the same kernel through each row's page table: a loop step is
one page, found in the table, so no row's pages are ever gathered into a copy.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zerojax.models.flash_attention import LOG2E, MASKED, triton_head_dim

_MIN_ROWS = 16  # Triton's dot takes 16 rows at least: a kv head's G query heads are padded to it


_BLOCKS = (64, 32, 16)  # slots per step of the kernel's loop: the largest that divides the cache length


def slot_block(length: int) -> int | None:
    """The kernel's slots per loop step for a cache of `length` slots (None: none divides it;
    generation's length buckets are multiples of 16)."""
    return next((b for b in _BLOCKS if length % b == 0), None)


def decode_attention_supported(head_dim: int, heads: int, kv_heads: int, length: int) -> bool:
    """Shapes the kernel takes: head_dim a power of two in 16..256, whole query groups, the cache
    length a multiple of 16."""
    return triton_head_dim(head_dim) and kv_heads > 0 and heads % kv_heads == 0 and slot_block(length) is not None


def paged_attention_supported(head_dim: int, heads: int, kv_heads: int, page_size: int, table_width: int) -> bool:
    """Shapes the kernel takes over a paged pool: as `decode_attention_supported`, with a page
    (a loop step) and the page table's width powers of two (Triton's blocks), a page 16 slots at
    least (Triton's dot)."""
    def pow2(n):
        return n >= 1 and not n & (n - 1)

    return (triton_head_dim(head_dim) and kv_heads > 0 and heads % kv_heads == 0 and pow2(page_size)
            and page_size >= 16 and pow2(table_width))


def decode_attention(q, keys, values, layer, first, last, *, pages=None, scale: float | None = None,
                     block: int | None = None, splits: int | None = None, warps: int = 4,
                     interpret: bool | None = None):
    """softmax(q k^T * scale) v of one new token per row -> [B, H, Dh] in q's dtype.

    q [B, H, Dh]; keys, values [L, B, K, S, Dh] (the whole cache); layer: int32 scalar, the cache
    layer read; first, last [B] int32: row b sees slots first[b] .. last[b] (both included).
    pages [B, P] int32 (a paged pool): keys, values are [L, N, K, page_size, Dh] and row b's slot s
    lies in page pages[b, s // page_size] at s % page_size; a loop step is one page. The
    scores in fp32 from q's dtype, the probabilities cast to the cache's dtype for their product
    with the values, fp32 accumulation (as `cache.attend`). block None: `slot_block(S)`. splits:
    programs per (row, kv head), each over its own share of the blocks that hold the row's visible
    slots, their partial softmaxes merged after (None: `split_count`). interpret None: compiled on
    GPU, Pallas' interpreter elsewhere."""
    B, H, Dh = q.shape
    if pages is not None:  # a paged pool: a page a block, the table's width in slots
        L, _, K, block, _ = keys.shape
        S = pages.shape[1] * block
        _check_paged(Dh, H, K, block, pages)
    else:
        L, _, K, S, _ = keys.shape
        block = slot_block(S) if block is None else block
    if pages is None and (not decode_attention_supported(Dh, H, K, S) or S % block):
        raise ValueError(f"decode_attention: head_dim {Dh}, {H} query / {K} kv heads, {S} slots, block {block}: "
                         "it takes a power-of-two head_dim in 16..256, whole query groups and slots a multiple "
                         "of the block (and of 16)")
    blocks = S // block
    splits = split_count(B * K, blocks) if splits is None else max(1, min(splits, blocks))
    G = H // K
    rows = max(1 << (G - 1).bit_length(), _MIN_ROWS)  # Triton's blocks are powers of two
    qg = q.reshape(B, K, G, Dh)
    if rows > G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - G), (0, 0)))
    # each query row's bounds: its row's
    first, last = (jnp.broadcast_to(jnp.asarray(x, jnp.int32)[:, None], (B, rows)) for x in (first, last))
    o = _attend(qg, keys, values, layer, first, last, pages, block=block, splits=splits, rows_per_program=rows,
                scale=scale, warps=warps, interpret=interpret)
    return o[:, :, :G].reshape(B, H, Dh)


def chunk_attention(q, keys, values, layer, first, last, *, pages, scale: float | None = None,
                    rows_per_program: int = 64, warps: int = 4, interpret: bool | None = None):
    """softmax(q k^T * scale) v of C new tokens per row (a prompt chunk) -> [B, C, H, Dh], read from
    a paged pool through each row's page table, as `decode_attention(..., pages=)` reads one.

    q [B, C, H, Dh]; keys, values [L, N, K, page_size, Dh]; pages [B, P]; first, last [B, C] int32:
    token c of row b sees slots first[b, c] .. last[b, c] (its own position last: causal; a padding
    token has last < first, and its output is undefined). One program per (row, kv head, block of
    `rows_per_program` query rows), a query row being one (token, query head of the kv head) pair:
    each kv page is read once for all the block's tokens and heads, never gathered into a copy."""
    B, C, H, Dh = q.shape
    L, _, K, block, _ = keys.shape
    _check_paged(Dh, H, K, block, pages)
    G = H // K
    Gp = 1 << (G - 1).bit_length()  # query heads of a kv head, to a power of two: whole blocks of rows
    if rows_per_program < _MIN_ROWS or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"chunk_attention: rows_per_program={rows_per_program}: a power of two >= {_MIN_ROWS}")
    # a program's rows: a power of two, Triton's dot's 16 at least, whole kv-head groups; the
    # tokens padded (as padding tokens, last < first) to whole programs
    bq = max(min(rows_per_program, 1 << (C * Gp - 1).bit_length()), _MIN_ROWS, Gp)
    Cp = -(-C * Gp // bq) * bq // Gp
    qg = jnp.pad(q.reshape(B, C, K, G, Dh), ((0, 0), (0, Cp - C), (0, 0), (0, Gp - G), (0, 0)))
    first, last = (jnp.pad(jnp.asarray(x, jnp.int32), ((0, 0), (0, Cp - C)), constant_values=v)
                   for x, v in ((first, 0), (last, -1)))
    R = Cp * Gp
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(B, K, R, Dh)  # row c * Gp + g: token c, query head g
    first, last = (jnp.repeat(x, Gp, axis=1) for x in (first, last))  # a token's bounds on each of its rows
    o = _attend(qg, keys, values, layer, first, last, pages, block=block, splits=1, rows_per_program=bq,
                scale=scale, warps=warps, interpret=interpret)
    return o.reshape(B, K, Cp, Gp, Dh)[:, :, :C, :G].transpose(0, 2, 1, 3, 4).reshape(B, C, H, Dh)


def _check_paged(Dh, H, K, block, pages):
    if not paged_attention_supported(Dh, H, K, block, pages.shape[1]):
        raise ValueError(f"paged attention: head_dim {Dh}, {H} query / {K} kv heads, pages of {block} slots, "
                         f"a table {pages.shape[1]} pages wide: it takes a power-of-two head_dim in 16..256, "
                         "whole query groups, power-of-two pages of 16 slots or more and a power-of-two table")


def _attend(q, keys, values, layer, first, last, pages, *, block, splits, rows_per_program, scale, warps, interpret):
    """The kernel's call: q [B, K, R, Dh] (R query rows per (row, kv head)), first, last [B, R] each
    query row's visible slots -> [B, K, R, Dh] in q's dtype."""
    B, K, R, Dh = q.shape
    bq = rows_per_program
    scale = float(Dh ** -0.5 if scale is None else scale)
    interpret = jax.default_backend() != "gpu" if interpret is None else bool(interpret)
    # [B, 4] (a power of two, as Triton's blocks): the layer read, in each row's first column
    layer = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (B, 4))
    whole = pl.BlockSpec(keys.shape, lambda b, h, r, s: (0, 0, 0, 0, 0))
    row_bounds = pl.BlockSpec((None, bq), lambda b, h, r, s: (b, r))
    table = [] if pages is None else [jnp.asarray(pages, jnp.int32)]
    table_spec = [] if pages is None else [pl.BlockSpec((None, table[0].shape[1]), lambda b, h, r, s: (b, 0))]
    acc_t = jnp.promote_types(q.dtype, jnp.float32)
    if splits == 1:  # the output itself, normalised in the kernel
        out_specs = pl.BlockSpec((None, None, bq, Dh), lambda b, h, r, s: (b, h, r, 0))
        out_shape = jax.ShapeDtypeStruct((B, K, R, Dh), q.dtype)
    else:  # each split's unnormalised sum and its softmax statistics (max in base 2, sum)
        out_specs = [pl.BlockSpec((None, None, None, bq, Dh), lambda b, h, r, s: (b, h, s, r, 0)),
                     pl.BlockSpec((None, None, None, bq), lambda b, h, r, s: (b, h, s, r)),
                     pl.BlockSpec((None, None, None, bq), lambda b, h, r, s: (b, h, s, r))]
        out_shape = [jax.ShapeDtypeStruct((B, K, splits, R, Dh), acc_t),
                     jax.ShapeDtypeStruct((B, K, splits, R), acc_t),
                     jax.ShapeDtypeStruct((B, K, splits, R), acc_t)]
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block=block, splits=splits, paged=pages is not None),
        grid=(B, K, R // bq, splits),
        in_specs=[pl.BlockSpec((None, None, bq, Dh), lambda b, h, r, s: (b, h, r, 0)), whole, whole,
                  pl.BlockSpec((None, 4), lambda b, h, r, s: (b, 0)), row_bounds, row_bounds, *table_spec],
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=2),
        interpret=interpret, name="zerojax_decode_attention",
    )(q, keys, values, layer, jnp.asarray(first, jnp.int32), jnp.asarray(last, jnp.int32), *table)
    if splits == 1:
        return out
    # the splits' online softmaxes merged; a split with no visible slot has m = -inf, weight 0
    acc, m, l = out
    w = jnp.exp2(m - m.max(axis=2, keepdims=True))
    return ((acc * w[..., None]).sum(2) / (l * w).sum(2)[..., None]).astype(q.dtype)


_TARGET_PROGRAMS = 264  # two programs per SM of an H100 (132 SMs)


def split_count(pairs: int, blocks: int) -> int:
    """Programs per (row, kv head): enough for `_TARGET_PROGRAMS` in all (a batch of 64 x 8 kv heads
    fills the GPU alone; one row of Llama-3.1-8B has 8 pairs), at most one per slot block."""
    return max(1, min(blocks, -(-_TARGET_PROGRAMS // pairs)))


def _kernel(q_ref, k_ref, v_ref, layer_ref, first_ref, last_ref, *refs, scale, block, splits, paged):
    """Program (row b, kv head h, block of query rows, split s): an online softmax per query row
    over split s's share of the slot blocks that hold the block's visible slots (the shares as even
    as whole blocks allow, however long the cache or page table: a short row's blocks are spread
    over every split, not left to the first ones); each query row masked to its own slots; scores
    in base 2 (exp2). One split: the normalised output; else the sum, max and denominator. paged:
    block j is the page the row's table names at j."""
    table_ref, out_refs = (refs[0], refs[1:]) if paged else (None, refs)
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    layer = layer_ref[0]
    first, last = first_ref[...], last_ref[...]
    q = q_ref[...]
    s_scale = scale * LOG2E
    acc_t = jnp.promote_types(q.dtype, jnp.float32)  # float64 in the exact reference

    def body(j, carry):
        acc, m, l = carry
        if paged:
            at = (layer, table_ref[j], h, slice(None), slice(None))
        else:
            at = (layer, b, h, pl.ds(j * block, block), slice(None))
        k = k_ref[at]
        qk = plgpu.dot(q, k.T).astype(acc_t) * s_scale
        cols = j * block + jnp.arange(block)
        qk = jnp.where((cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None]), qk, MASKED)
        m_new = jnp.maximum(m, qk.max(axis=-1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(qk - m_new[:, None])
        v = v_ref[at]
        acc = acc * corr[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(acc_t)
        return acc, m_new, l * corr + p.sum(axis=-1)

    rows, dh = q.shape
    init = (jnp.zeros((rows, dh), acc_t), jnp.full((rows,), -jnp.inf, acc_t), jnp.zeros((rows,), acc_t))
    # the blocks from the rows' first visible slot to their last (one run). A query row that sees
    # none of a block's slots scores it MASKED, a finite value: its sums there are dropped (scaled
    # by exp2(MASKED - m) = 0) at its first visible slot, which every real query row has in the run
    lo = lax.div(jnp.min(first), jnp.int32(block))
    hi = lax.div(jnp.maximum(jnp.max(last), 0), jnp.int32(block)) + 1
    per = lax.div(hi - lo + splits - 1, jnp.int32(splits))
    start = lo + s * per
    stop = jnp.minimum(start + per, hi)
    acc, m, l = lax.fori_loop(start, stop, body, init)
    if splits == 1:
        out_refs[0][...] = (acc / l[:, None]).astype(out_refs[0].dtype)
    else:
        out_refs[0][...], out_refs[1][...], out_refs[2][...] = acc, m, l


__all__ = ["decode_attention", "chunk_attention", "decode_attention_supported", "paged_attention_supported",
           "slot_block", "split_count"]
