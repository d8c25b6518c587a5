"""The fused Pallas flash attention (`zerojax.models.flash_attention`, run by Pallas' interpreter
on CPU) against the published formula in float64 and against the dense-mask path: packed rows
whose documents it skips (a packer's, its padding segment 0 last), rows it may not skip (an id in
two runs), grouped-query heads, Mistral's window, a padded tail; its key-block bounds against a
brute-force count; a tiny Llama's logits and gradients (tests/long/test_attention.py); shapes it
does not take refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.models.attention import causal_attention
from zerojax.models.flash_attention import FlashBlocks, flash_attention, visible_bounds

# small tiles, so a short row has several blocks of each kind (the kernel's loops and bounds run)
BLOCKS = FlashBlocks(q=32, k=16, q_dkv=16, kv_dkv=32, q_dq=32, kv_dq=16)


def _formula(q, k, v, seg, window):
    """softmax over the keys a query may see, numpy float64, GQA head h -> h // (H / K)."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for b in range(B):
        for i in range(T):
            ok = [j for j in range(i + 1) if seg[b, j] == seg[b, i] and (window is None or i - j < window)]
            for h in range(H):
                s = q[b, i, h].astype(np.float64) @ k[b, ok, h // G].astype(np.float64).T / np.sqrt(D)
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ v[b, ok, h // G].astype(np.float64)
    return out


@pytest.mark.parametrize("window", [None, 9], ids=["causal", "window"])
def test_flash_equals_formula_and_dense_gradients(window):
    rng = np.random.default_rng(0)
    B, T, H, K, D = 2, 90, 4, 2, 16  # T = 90: padded to 96, the tail's keys never seen
    q, k, v = (rng.normal(size=(B, T, n, D)).astype(np.float32) for n in (H, K, K))
    # row 0: a packer's row, two documents and its padding segment 0 (the key blocks before each
    # skipped); row 1: one id in two runs (nothing skipped but the causal blocks)
    seg = np.stack([np.repeat([1, 2, 0], [37, 30, 23]), np.repeat([5, 2, 5], [20, 40, 30])]).astype(np.int32)
    out = flash_attention(*map(jnp.asarray, (q, k, v)), segment_ids=jnp.asarray(seg), window=window, blocks=BLOCKS)
    np.testing.assert_allclose(np.asarray(out), _formula(q, k, v, seg, window), rtol=1e-5, atol=1e-5)

    cot = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)

    def loss(f):
        return lambda q, k, v: (f(q, k, v) * cot).sum()

    got = jax.grad(loss(lambda q, k, v: flash_attention(q, k, v, segment_ids=seg, window=window, blocks=BLOCKS)),
                   argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(loss(lambda q, k, v: causal_attention(q, k, v, impl="xla", segment_ids=jnp.asarray(seg),
                                                         window=window)), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_bounds_are_exact_where_each_id_is_one_run_and_safe_elsewhere():
    seg = np.stack([np.repeat([1, 2, 3, 7], [5, 1, 8, 6]), np.repeat([3, 1, 3, 2], [5, 5, 5, 5]),
                    np.zeros(20, int), np.repeat([1, 2, 3, 0], [6, 4, 7, 3])]).astype(np.int32)
    T = seg.shape[1]
    for window in (None, 4):
        first, end = map(np.asarray, visible_bounds(jnp.asarray(seg), window))
        for b in range(seg.shape[0]):
            seen = np.array([[j <= i and seg[b, i] == seg[b, j] and (window is None or i - j < window)
                              for j in range(T)] for i in range(T)])
            lo = seen.argmax(axis=1)  # each query's first visible key (every query sees itself)
            hi = T - seen[::-1].argmax(axis=0)  # one past each key's last visible query
            assert (first[b] <= lo).all() and (end[b] >= hi).all()  # never skips what is seen
            if b != 1:  # one run per id (row 3: a packer's, padding 0 last): tight, documents skipped
                np.testing.assert_array_equal(first[b], lo)
                np.testing.assert_array_equal(end[b], hi)


def test_unsupported_shapes_and_blocks_refused():
    q = jnp.zeros((1, 16, 3, 24))
    with pytest.raises(ValueError, match="head_dim 24.*blockwise"):
        flash_attention(q, q, q)
    with pytest.raises(ValueError, match="kv_dkv=128 must equal q_dq=64"):
        FlashBlocks(kv_dkv=128)
    with pytest.raises(ValueError, match="FlashBlocks.k=48"):
        FlashBlocks(k=48)


@pytest.mark.parametrize("heads, kv_heads, head_dim, window", [(32, 8, 64, None), (32, 8, 128, 4096)])
def test_forward_and_backward_lower_to_triton_for_a_gpu(heads, kv_heads, head_dim, window):
    """The compiled kernels' Triton lowering (forward and backward), done here for CUDA without a
    GPU, at Llama-3.2-1B's and Llama-3.1-8B's head shapes (the latter with a window) on a row not a
    multiple of the tiles:
    Pallas refuses a load or store that is not a power-of-two block at this point."""
    sd = jax.ShapeDtypeStruct
    B, T = 1, 200
    q, kv = sd((B, T, heads, head_dim), jnp.bfloat16), sd((B, T, kv_heads, head_dim), jnp.bfloat16)
    seg = sd((B, T), jnp.int32)

    def loss(q, k, v, seg):
        return flash_attention(q, k, v, segment_ids=seg, window=window, interpret=False).astype(jnp.float32).sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, seg).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "zerojax_flash_forward" in text and "zerojax_flash_backward" in text
