"""The decode step's fused attention kernel (Pallas' interpreter on CPU) against the softmax formula
computed in float64 with numpy, row by row, over each row's visible slots."""
import jax
import numpy as np
import pytest

from zerojax.generation.decode_attention import (
    chunk_attention,
    decode_attention,
    paged_attention_supported,
    slot_block,
    split_count,
)


def _reference(q, keys, values, layer, first, last):
    B, H, Dh = q.shape
    G = H // keys.shape[2]
    out = np.zeros(q.shape)
    for b in range(B):
        for h in range(H):
            k, v = keys[layer, b, h // G, first[b]:last[b] + 1], values[layer, b, h // G, first[b]:last[b] + 1]
            s = k @ q[b, h] / np.sqrt(Dh)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v
    return out


@pytest.mark.parametrize("splits", [1, 3])
def test_equals_the_formula_over_each_rows_visible_slots(splits):
    """Rows whose visible slots start and end inside a block, span several blocks, or are one slot;
    a layer other than the first; 4 query heads per kv head (padded to the kernel's 16 rows). One
    program per (row, kv head), normalising in the kernel, or three over a block each, merged
    after (rows with no visible slot in some of them)."""
    rng = np.random.default_rng(0)
    L, B, K, S, Dh, H = 3, 4, 2, 96, 16, 8
    q = rng.standard_normal((B, H, Dh))
    keys, values = rng.standard_normal((2, L, B, K, S, Dh))
    first, last = np.array([0, 5, 70, 95]), np.array([10, 64, 95, 95])
    with jax.enable_x64(True):
        got = decode_attention(q, keys, values, np.int32(1), first, last, block=32, splits=splits)
    assert got.dtype == np.float64
    np.testing.assert_allclose(np.asarray(got), _reference(q, keys, values, 1, first, last), rtol=1e-12, atol=1e-12)


def _paged(rng, L, B, K, Dh, ps, P, N):
    """A pool [2, L, N, K, ps, Dh] and page tables [B, P] (no page in two rows; page 0 the
    scratch page) holding the slots of `dense` [2, L, B, K, P * ps, Dh]."""
    dense = rng.standard_normal((2, L, B, K, P * ps, Dh))
    pages = rng.permutation(np.arange(1, N))[:B * P].reshape(B, P).astype(np.int32)
    pool = rng.standard_normal((2, L, N, K, ps, Dh))
    for b in range(B):
        for j in range(P):
            pool[:, :, pages[b, j]] = dense[:, :, b, :, j * ps:(j + 1) * ps]
    return dense, pool, pages


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_pool_equals_the_formula_over_each_rows_pages(splits):
    """The serving pool's layout [L, pages, K, page_size, Dh]: each row's slots scattered over
    pages in its own order (shared pages, the scratch page 0 past a row's end), read through its
    page table; equal to the formula over the same slots laid out contiguously."""
    rng = np.random.default_rng(1)
    L, B, K, Dh, H, ps, P, N = 3, 4, 2, 16, 8, 16, 4, 20
    q = rng.standard_normal((B, H, Dh))
    dense, pool, pages = _paged(rng, L, B, K, Dh, ps, P, N)  # no page in two rows...
    pages[1, 0] = pages[0, 0]  # ...but a shared prefix page, holding the same slots in both
    dense[:, :, 1, :, :ps] = dense[:, :, 0, :, :ps]
    pages[3, 2:] = 0  # row 3 ends in its second page: the table's rest is the scratch page
    first, last = np.array([0, 5, 20, 0]), np.array([10, 63, 40, 31])
    with jax.enable_x64(True):
        got = decode_attention(q, pool[0], pool[1], np.int32(2), first, last, pages=pages, splits=splits)
    np.testing.assert_allclose(np.asarray(got), _reference(q, dense[0], dense[1], 2, first, last), rtol=1e-12,
                               atol=1e-12)


def test_chunk_form_equals_the_formula_for_each_token():
    """A prompt chunk's tokens (C a row) attend from the pool, each over its own slots: causal
    within the chunk after a prefix already in the pages (row 0 from slot 40, across pages), a
    chunk from slot 0 (row 1), a sliding window's first slots (row 2), padding tokens past a
    row's count (their output undefined, the rest unaffected); 3 query heads a kv head (padded to
    4: a program's rows are (token, head) pairs), several programs a row, 13 tokens (padded to 16:
    whole programs)."""
    rng = np.random.default_rng(2)
    L, B, K, Dh, H, ps, P, N, C = 2, 3, 2, 16, 6, 16, 8, 30, 13
    dense, pool, pages = _paged(rng, L, B, K, Dh, ps, P, N)
    q = rng.standard_normal((B, C, H, Dh))
    start, count = np.array([40, 0, 70]), np.array([13, 11, 13])
    pos = start[:, None] + np.arange(C)[None]
    last = np.where(np.arange(C)[None] < count[:, None], pos, -1)
    first = np.zeros_like(last)
    first[2] = np.maximum(0, pos[2] - 9)  # a window of 10 slots
    with jax.enable_x64(True):
        got = np.asarray(chunk_attention(q, pool[0], pool[1], np.int32(1), first, last, pages=pages,
                                         rows_per_program=16))
    assert got.shape == q.shape
    for b in range(B):
        for c in range(count[b]):
            want = _reference(q[b, c][None], dense[0, :, b:b + 1], dense[1, :, b:b + 1], 1, first[b, c:c + 1],
                              last[b, c:c + 1])
            np.testing.assert_allclose(got[b, c], want[0], rtol=1e-12, atol=1e-12)


def test_slot_block_split_count_and_refusals():
    assert (slot_block(512), slot_block(96), slot_block(48), slot_block(40)) == (64, 32, 16, None)
    # batch 64 x 8 kv heads fills the GPU with one program each; one row of 8 splits its 6 blocks
    assert (split_count(64 * 8, 8), split_count(8, 6), split_count(8, 64), split_count(2, 1)) == (1, 6, 33, 1)
    q = np.zeros((1, 4, 12), np.float32)
    cache = np.zeros((1, 1, 2, 32, 12), np.float32)
    with pytest.raises(ValueError, match="head_dim 12"):
        decode_attention(q, cache, cache, 0, np.zeros(1, np.int32), np.zeros(1, np.int32))
    # pages: a power of two of 16 slots or more, a power-of-two table
    assert paged_attention_supported(128, 32, 8, 16, 256) and not paged_attention_supported(128, 32, 8, 8, 256)
    assert not paged_attention_supported(128, 32, 8, 24, 256) and not paged_attention_supported(128, 32, 8, 16, 3)
    with pytest.raises(ValueError, match="pages of 8 slots"):
        decode_attention(np.zeros((1, 4, 16)), np.zeros((1, 3, 2, 8, 16)), np.zeros((1, 3, 2, 8, 16)), 0,
                         np.zeros(1, np.int32), np.zeros(1, np.int32), pages=np.zeros((1, 2), np.int32))


@pytest.mark.parametrize("layers, batch, kv_heads, slots, head_dim, heads", [
    (24, 64, 2, 512, 64, 14),   # Qwen2.5-0.5B at batch 64: 7 query heads a kv head, 24 layers
    (32, 1, 8, 384, 128, 32),   # Llama-3.1-8B at batch 1: 6 splits, merged after
    (3, 4, 2, 48, 64, 48),      # 24 query heads a kv head (padded to 32 rows), 16-slot blocks
])
def test_lowers_to_triton_for_a_gpu(layers, batch, kv_heads, slots, head_dim, heads):
    """The compiled kernel's Triton lowering, done here for CUDA without a GPU: its loads and stores
    must be power-of-two blocks (Pallas refuses others at this point), whatever the model's
    layers, batch and query heads per kv head."""
    import jax.numpy as jnp

    sd = jax.ShapeDtypeStruct
    cache = sd((layers, batch, kv_heads, slots, head_dim), jnp.bfloat16)
    rows = sd((batch,), jnp.int32)
    fn = jax.jit(lambda *a: decode_attention(*a, interpret=False))
    text = fn.trace(sd((batch, heads, head_dim), jnp.bfloat16), cache, cache, sd((), jnp.int32), rows,
                    rows).lower(lowering_platforms=("cuda",)).as_text()
    assert "zerojax_decode_attention" in text
    # the serving pool read through page tables: pages of 16 slots, tables of slots / 16 pages
    pool = sd((layers, 64, kv_heads, 16, head_dim), jnp.bfloat16)
    paged = jax.jit(lambda *a: decode_attention(*a[:-1], pages=a[-1], interpret=False))
    text = paged.trace(sd((batch, heads, head_dim), jnp.bfloat16), pool, pool, sd((), jnp.int32), rows, rows,
                       sd((batch, 1 << (slots // 16 - 1).bit_length()), jnp.int32)).lower(
                           lowering_platforms=("cuda",)).as_text()
    assert "zerojax_decode_attention" in text
    # a prompt chunk of 64 tokens read from the same pool
    chunk = jax.jit(lambda *a: chunk_attention(*a[:-1], pages=a[-1], interpret=False))
    bounds = sd((batch, 64), jnp.int32)
    text = chunk.trace(sd((batch, 64, heads, head_dim), jnp.bfloat16), pool, pool, sd((), jnp.int32), bounds,
                       bounds, sd((batch, 1 << (slots // 16 - 1).bit_length()), jnp.int32)).lower(
                           lowering_platforms=("cuda",)).as_text()
    assert "zerojax_decode_attention" in text
