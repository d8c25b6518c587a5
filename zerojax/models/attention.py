"""Causal attention for packed and long rows that never forms a [T, T] mask or score matrix.

`blockwise_attention(q, k, v, segment_ids=..., window=..., block=...)` is flash attention written
in plain JAX: a `lax.scan` over key blocks with an online softmax, forward and backward (a
`custom_vjp` that keeps only the output and the log-sum-exp and recomputes each block's scores in
the backward scan), so its memory is O(T x block) per head where the XLA path of
`jax.nn.dot_product_attention` with a mask holds [B, H, T, T]. It runs on any backend; on GPU
the cuDNN fused kernel is faster where it applies (`jax.nn.dot_product_attention`'s public
signature, in JAX 0.10 and 0.11 alike, takes no segment ids, so packed rows come here).

Masking: a query at row index i sees a key at index j when j <= i (causal by index), both carry
the same segment id (packed documents; a packer's padding segment attends only to itself), and,
with `window` = w, i - j < w (Mistral's sliding window: the last w positions, itself included).
Grouped-query attention: q [B, T, H, Dh] with k, v [B, T, K, Dh], H a multiple of K.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zerojax.models.attention_window import check_window

# keys per step of the scan: scores of one step are [B, H, T, block] fp32
DEFAULT_BLOCK = 512
_NEG = -1e30  # a finite "minus infinity": a fully masked block leaves exp(s - m) at 0, never NaN


def blockwise_attention(q, k, v, *, segment_ids=None, window: int | None = None, block: int = DEFAULT_BLOCK,
                        scale: float | None = None):
    """Causal softmax(q k^T * scale) v per head -> [B, T, H, Dh] in q's dtype (products of q's dtype
    accumulated in fp32, the softmax in fp32)."""
    B, T, H, Dh = q.shape
    K = k.shape[2]
    if H % K:
        raise ValueError(f"blockwise_attention: {H} query heads are not a multiple of {K} key / value heads")
    check_block(block)
    check_window(window)
    scale = float(Dh ** -0.5 if scale is None else scale)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    return _attention(q, k, v, seg, min(block, T), window, scale)


def _blocks(k, v, seg, block):
    """Keys, values, their segment ids and row indices cut into [n, block, ...] (the row padded to
    a multiple of `block` with keys at index >= T, which no query sees)."""
    B, T = seg.shape
    n = -(-T // block)
    pad = n * block - T
    if pad:
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
        seg = jnp.pad(seg, ((0, 0), (0, pad)))
    cut = lambda x: jnp.moveaxis(x.reshape(B, n, block, *x.shape[2:]), 1, 0)  # noqa: E731
    index = jnp.arange(n * block, dtype=jnp.int32).reshape(n, block)
    return cut(k), cut(v), cut(seg), index


def _scores(qg, kb, seg_q, seg_k, index_k, *, window, scale):
    """Masked scores [B, K, G, T, block] fp32 of grouped queries qg [B, T, K, G, Dh] and one key block."""
    s = _dot("btkgd,bskd->bkgts", qg, kb) * scale
    T = qg.shape[1]
    i = jnp.arange(T, dtype=jnp.int32)[:, None]
    j = index_k[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (i - j < window)
    ok = ok[None] & (seg_q[:, :, None] == seg_k[:, None, :])  # [B, T, block]
    return jnp.where(ok[:, None, None], s, _NEG), ok


def _tied(qg, seg, sb, ib):
    """(qg, seg, sb, ib) through one optimization barrier, so that the masks' integer inputs read
    as depending on the queries. Inside a differentiated `lax.scan` (a model's layer scan) JAX
    hoists what does not vary across layers out of that scan, and the masks (built from segment
    ids and block indices alone) would be computed there for every key block at once and stacked:
    [n blocks, B, K, G, T, block] booleans (Llama-3.2-1B at 32K: 32 GiB), where the key-block scan
    builds one block's at a time."""
    return jax.lax.optimization_barrier((qg, seg, sb, ib))


def _dot(spec, a, b):
    """einsum of a, b in a's dtype (b and a probability / gradient cast to it), accumulated in
    fp32: flash attention's products, bf16 operands on the tensor cores for a bf16 model, fp32
    operands (exact as before) for an fp32 one."""
    return jnp.einsum(spec, a, b.astype(a.dtype), preferred_element_type=jnp.float32)


def _grouped(q, K):
    B, T, H, Dh = q.shape
    return q.reshape(B, T, K, H // K, Dh)


def _forward(q, k, v, seg, *, block, window, scale):
    B, T, H, Dh = q.shape
    K = k.shape[2]
    qg = _grouped(q, K)
    kb, vb, sb, ib = _blocks(k, v, seg, block)
    qg, seg, sb, ib = _tied(qg, seg, sb, ib)

    def step(carry, xs):
        m, l, acc = carry  # running max, normaliser [B, K, G, T], output sum [B, K, G, T, Dh]
        kj, vj, sj, ij = xs
        s, ok = _scores(qg, kj, seg, sj, ij, window=window, scale=scale)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(ok[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + _dot("bkgts,bskd->bkgtd", p.astype(q.dtype), vj)
        return (m_new, l, acc), None

    G = H // K
    init = (jnp.full((B, K, G, T), _NEG, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, Dh), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, sb, ib))
    l = jnp.maximum(l, 1e-30)  # every query sees itself; the guard is for rows of zeros only
    out = acc / l[..., None]
    lse = m + jnp.log(l)
    o = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, H, Dh).astype(q.dtype)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, seg, block, window, scale):
    return _forward(q, k, v, seg, block=block, window=window, scale=scale)[0]


def _attention_fwd(q, k, v, seg, block, window, scale):
    o, lse = _forward(q, k, v, seg, block=block, window=window, scale=scale)
    return o, (q, k, v, seg, o, lse)


def _attention_bwd(block, window, scale, res, do):
    q, k, v, seg, o, lse = res
    B, T, H, Dh = q.shape
    K = k.shape[2]
    G = H // K
    qg = _grouped(q, K)
    dog = jnp.transpose(do.astype(jnp.float32).reshape(B, T, K, G, Dh), (0, 2, 3, 1, 4))  # [B, K, G, T, Dh]
    og = jnp.transpose(o.astype(jnp.float32).reshape(B, T, K, G, Dh), (0, 2, 3, 1, 4))
    delta = (dog * og).sum(-1)  # [B, K, G, T]
    dog_mm = dog.astype(q.dtype)  # the products' operand
    kb, vb, sb, ib = _blocks(k, v, seg, block)
    qg, seg, sb, ib = _tied(qg, seg, sb, ib)

    def step(dq, xs):
        kj, vj, sj, ij = xs
        s, ok = _scores(qg, kj, seg, sj, ij, window=window, scale=scale)
        p = jnp.where(ok[:, None, None], jnp.exp(s - lse[..., None]), 0.0)  # [B, K, G, T, s]
        dv = _dot("bkgts,bkgtd->bskd", p.astype(q.dtype), dog_mm)
        dp = _dot("bkgtd,bskd->bkgts", dog_mm, vj)
        ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)  # the products' operand
        dq = dq + _dot("bkgts,bskd->btkgd", ds, kj)
        dk = _dot("bkgts,btkgd->bskd", ds, qg)
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(qg.shape, jnp.float32), (kb, vb, sb, ib))
    join = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, -1, K, Dh)[:, :T]  # noqa: E731
    return (dq.reshape(B, T, H, Dh).astype(q.dtype), join(dk).astype(k.dtype), join(dv).astype(v.dtype), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def causal_attention(q, k, v, *, impl: str, segment_ids=None, window: int | None = None,
                     block: int = DEFAULT_BLOCK):
    """The models' one attention call: "blockwise" (above), "flash" (the fused Pallas kernel,
    `zerojax.models.flash_attention`; `block` is the blockwise scan's alone) or
    `jax.nn.dot_product_attention` with `implementation=impl` ("xla" / "cudnn"; packed rows there as
    a dense [B, 1, T, T] mask)."""
    if impl == "blockwise":
        return blockwise_attention(q, k, v, segment_ids=segment_ids, window=window, block=block)
    if impl == "flash":
        from zerojax.models.flash_attention import flash_attention  # Pallas loads only when asked for

        return flash_attention(q, k, v, segment_ids=segment_ids, window=window)
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=local,
                                        implementation=impl)


def check_block(block) -> int:
    """`attention_block` validated: the keys per step of the blockwise attention."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"attention_block={block!r}: the keys per step of the blockwise attention, an int >= 1 "
                         f"(default {DEFAULT_BLOCK})")
    return block


__all__ = ["blockwise_attention", "causal_attention", "check_block", "check_window", "DEFAULT_BLOCK"]
