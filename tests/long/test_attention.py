"""The blockwise attention (`zerojax.models.attention`) against the dense-mask path of
`jax.nn.dot_product_attention`: a tiny Llama's logits and gradients on packed rows (several
documents per row, GQA 4:2, Mistral's sliding window), the flash kernel's beside it, GPT-2 on plain
rows, the choice of implementation, bad options, and the compiled program's memory growing as T,
not T^2."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax.models import GPT2, GPT2Config, Llama, LlamaConfig
from zerojax.models.attention import blockwise_attention, causal_attention
from zerojax.models.gpt2 import gpt2_loss, resolve_attention
from zerojax.models.llama import llama_loss

# fp32 on both sides, the same products summed in another order (online softmax): a few ulps
RTOL = ATOL = 2e-5
T = 24


def _packed_batch(rng, B=2, T=T, vocab=256):
    ids = rng.integers(0, vocab, size=(B, T)).astype(np.int32)
    # documents of uneven lengths, the last row one document only
    seg = np.stack([np.repeat([1, 2, 3, 4], [7, 5, 9, 3]), np.ones(T, np.int64)]).astype(np.int32)
    return {"input_ids": jnp.asarray(ids), "segment_ids": jnp.asarray(seg)}


def _logits_and_grads(model, batch, loss):
    g = nnx.grad(lambda m: loss(m, batch)[0])(model)
    logits = model(batch["input_ids"], segment_ids=batch.get("segment_ids"))
    return logits, jax.tree.leaves(nnx.to_pure_dict(g))


@pytest.mark.parametrize("window", [None, 6], ids=["llama", "mistral-window"])
def test_llama_blockwise_and_flash_equal_dense_mask(window):
    """Both mask-free attentions inside a tiny Llama (GQA 4:2, packed rows, the window) against
    the dense-mask path: logits and every gradient. The flash kernel runs in Pallas' interpreter."""
    cfg = LlamaConfig.named("tiny", sliding_window=window, model_type="mistral" if window else "llama")
    batch = _packed_batch(np.random.default_rng(0))
    l1, g1 = _logits_and_grads(Llama(cfg, rngs=nnx.Rngs(0), attention_impl="xla"), batch, llama_loss)
    # block 5 does not divide T = 24: the padded last block is exercised too; flash pads T to its tiles
    for model in (Llama(cfg, rngs=nnx.Rngs(0), attention_impl="blockwise", attention_block=5),
                  Llama(cfg, rngs=nnx.Rngs(0), attention_impl="flash")):
        l2, g2 = _logits_and_grads(model, batch, llama_loss)
        np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=RTOL, atol=ATOL)
        assert len(g1) == len(g2)
        for a, b in zip(g1, g2, strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_gpt2_blockwise_equals_xla():
    cfg = GPT2Config.named("tiny")
    batch = {"input_ids": jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, T)), jnp.int32)}
    loss = lambda m, b: (gpt2_loss(m, b)[0], None)  # noqa: E731
    dense = GPT2(cfg, rngs=nnx.Rngs(0), attention_impl="xla")
    blockwise = GPT2(cfg, rngs=nnx.Rngs(0), attention_impl="blockwise", attention_block=8)
    g1 = jax.tree.leaves(nnx.to_pure_dict(nnx.grad(lambda m: loss(m, batch)[0])(dense)))
    g2 = jax.tree.leaves(nnx.to_pure_dict(nnx.grad(lambda m: loss(m, batch)[0])(blockwise)))
    np.testing.assert_allclose(np.asarray(blockwise(batch["input_ids"])), np.asarray(dense(batch["input_ids"])),
                               rtol=RTOL, atol=ATOL)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_packed_rows_on_one_gpu_default_to_flash_where_it_applies(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert resolve_attention(None, jnp.bfloat16, 64, packed=True, heads=32, kv_heads=8) == "flash"
    assert resolve_attention(None, jnp.bfloat16, 64, packed=True, heads=24, kv_heads=8) == "blockwise"  # G = 3
    assert resolve_attention(None, jnp.float32, 64, packed=True, heads=32, kv_heads=8) == "blockwise"
    assert resolve_attention(None, jnp.bfloat16, 64, heads=32, kv_heads=8) == "cudnn"  # unpacked rows
    monkeypatch.setattr(jax, "device_count", lambda: 8)  # a mesh: GSPMD would gather a Pallas call's operands
    assert resolve_attention(None, jnp.bfloat16, 64, packed=True, heads=32, kv_heads=8) == "blockwise"


def test_packed_rows_default_to_blockwise_and_bad_options_refused():
    assert resolve_attention(None, jnp.float32, 64, packed=True) == "blockwise"
    assert resolve_attention(None, jnp.float32, 64) == "xla"  # CPU, plain rows
    assert resolve_attention("cudnn", jnp.bfloat16, 64, packed=True) == "cudnn"  # an explicit choice stays
    cfg = LlamaConfig.named("tiny")
    with pytest.raises(ValueError, match="attention_block=0"):
        Llama(cfg, rngs=nnx.Rngs(0), attention_block=0)
    with pytest.raises(ValueError, match="attention_impl"):
        Llama(cfg, rngs=nnx.Rngs(0), attention_impl="fused")


def _temp_bytes(impl, t):
    B, H, K, D = 1, 2, 1, 16
    q = jax.ShapeDtypeStruct((B, t, H, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, t, K, D), jnp.float32)
    seg = jax.ShapeDtypeStruct((B, t), jnp.int32)

    def loss(q, k, v, seg):
        return causal_attention(q, k, v, impl=impl, segment_ids=seg, block=64).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_in_sequence_length():
    # doubling T: the dense mask's scores grow 4x, the blockwise scan's [T, block] tiles 2x
    dense = _temp_bytes("xla", 1024) / _temp_bytes("xla", 512)
    blockwise = _temp_bytes("blockwise", 1024) / _temp_bytes("blockwise", 512)
    assert dense > 3.0, dense  # the measure sees T^2 where it exists
    assert blockwise < 2.5, blockwise
    assert _temp_bytes("blockwise", 1024) < _temp_bytes("xla", 1024) / 4


def test_blockwise_against_float64_formula():
    # the published formula in numpy float64: softmax over the keys a query may see
    rng = np.random.default_rng(2)
    B, t, H, K, D, w = 1, 11, 4, 2, 8, 4
    q, k, v = (rng.normal(size=(B, t, n, D)).astype(np.float32) for n in (H, K, K))
    seg = np.array([[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]], np.int32)
    out = np.asarray(blockwise_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), segment_ids=jnp.asarray(seg),
                                         window=w, block=3))
    ref = np.zeros_like(out, dtype=np.float64)
    for h in range(H):
        kh = h // (H // K)
        for i in range(t):
            ok = [j for j in range(t) if j <= i and i - j < w and seg[0, j] == seg[0, i]]
            s = q[0, i, h].astype(np.float64) @ k[0, ok, kh].astype(np.float64).T / np.sqrt(D)
            p = np.exp(s - s.max())
            ref[0, i, h] = (p / p.sum()) @ v[0, ok, kh].astype(np.float64)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_layer_scan_gradient_builds_one_key_blocks_mask_at_a_time():
    """Differentiated inside a layer scan (every model's), the masks do not vary across layers;
    JAX would hoist them out of that scan and build every key block's at once, stacked: a
    [n blocks, B, K, G, T, block] boolean (Llama-3.2-1B at 32K: 32 GiB). None of that shape is
    in the program, and the gradient is the one of the unscanned layers."""
    T, block = 64, 16
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, T, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, T, 2, 8)), jnp.float32)
    seg = jnp.asarray(np.repeat([1, 2], [40, 24])[None], jnp.int32)
    w = jnp.asarray(rng.normal(size=(2, 8, 8)) / 3, jnp.float32)

    def layer(h, wl):
        return blockwise_attention(jnp.einsum("bthd,de->bthe", h, wl), k, k, segment_ids=seg, block=block), None

    scanned = lambda w: jax.lax.scan(layer, x, w)[0].sum()  # noqa: E731
    unrolled = lambda w: layer(layer(x, w[0])[0], w[1])[0].sum()  # noqa: E731
    text = jax.jit(jax.grad(scanned)).lower(w).as_text()
    assert not re.search(rf"tensor<{T // block}x[\dx]*xi1>", text)
    np.testing.assert_allclose(jax.grad(scanned)(w), jax.grad(unrolled)(w), rtol=RTOL, atol=ATOL)


def test_bf16_products_on_bf16_operands_accumulated_in_fp32():
    """bf16 q, k, v: every product of the forward and backward takes bf16 operands (flash
    attention's tensor-core products) and returns fp32; output and gradients equal the dense fp32
    path on the same (bf16-rounded) values within bf16's rounding of the probabilities."""
    rng = np.random.default_rng(3)
    T, block = 40, 16
    q, k, v = (jnp.asarray(rng.normal(size=(1, T, n, 8)), jnp.bfloat16) for n in (4, 2, 2))
    seg = jnp.asarray(np.repeat([1, 2], [25, 15])[None], jnp.int32)
    cot = jnp.asarray(rng.normal(size=(1, T, 4, 8)), jnp.float32)

    def loss(impl, dtype):
        def f(q, k, v):
            q, k, v = (x.astype(dtype) for x in (q, k, v))
            return (causal_attention(q, k, v, impl=impl, segment_ids=seg, block=block).astype(jnp.float32) * cot).sum()
        return f

    text = jax.jit(jax.value_and_grad(loss("blockwise", jnp.bfloat16), argnums=(0, 1, 2))).lower(q, k, v).as_text()
    dots = re.findall(r"stablehlo\.dot_general[^\n]*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)", text)
    assert len(dots) == 7, dots  # forward: scores, p v; backward: the scores again, dv, dp, dq, dk
    assert all(a.endswith("xbf16>") and b.endswith("xbf16>") and out.endswith("xf32>") for a, b, out in dots), dots
    got = jax.value_and_grad(loss("blockwise", jnp.bfloat16), argnums=(0, 1, 2))(q, k, v)
    ref = jax.value_and_grad(loss("xla", jnp.float32), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        np.testing.assert_allclose(g, r, rtol=0, atol=0.03 * np.abs(r).max())
