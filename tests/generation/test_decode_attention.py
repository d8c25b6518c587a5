"""The decode step's fused attention kernel (Pallas' interpreter on CPU) against the softmax formula
computed in float64 with numpy, row by row, over each row's visible slots."""
import jax
import numpy as np
import pytest

from zerojax.generation.decode_attention import decode_attention, slot_block, split_count


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


def test_slot_block_split_count_and_refusals():
    assert (slot_block(512), slot_block(96), slot_block(48), slot_block(40)) == (64, 32, 16, None)
    # batch 64 x 8 kv heads fills the GPU with one program each; one row of 8 splits its 6 blocks
    assert (split_count(64 * 8, 8), split_count(8, 6), split_count(8, 64), split_count(2, 1)) == (1, 6, 33, 1)
    q = np.zeros((1, 4, 12), np.float32)
    cache = np.zeros((1, 1, 2, 32, 12), np.float32)
    with pytest.raises(ValueError, match="head_dim 12"):
        decode_attention(q, cache, cache, 0, np.zeros(1, np.int32), np.zeros(1, np.int32))


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
