"""Fused causal attention for packed and long rows on the GPU: a Pallas (Triton) flash attention
kernel, forward and backward, that skips the key blocks no query of a block can see.

`flash_attention(q, k, v, segment_ids=..., window=...)` computes what
`zerojax.models.attention.blockwise_attention` computes (same masking: causal by index, equal
segment ids, Mistral's sliding window; grouped-query heads) with each [block_q, block_k] score tile
kept on chip. The blockwise scan writes a [T, block] fp32 score tile to HBM per key block and visits
every block; at Llama-3.2-1B and 32K that held the step at 0.27 of its 2K FLOP rate.

Built on the Pallas GPU attention op of JAX (jax.experimental.pallas.ops.gpu.attention, Apache
2.0), which takes segment ids but skips causal blocks only and keeps one key / value head per
query head. Added here:
- grouped-query heads: the forward reads key / value head h // G; the backward runs one program per
  key / value head and its G query heads, so dk / dv are accumulated on chip, never per query head;
- packed rows skip whole documents: for rows where each segment id forms one run (what a packer
  writes, its padding included) each query block starts at the first key of its first document,
  and each key block's dk / dv stop after the last query of its last document; other rows fall
  back to causal bounds;
- the sliding window narrows the same bounds.

Runs compiled by Triton on NVIDIA GPUs and in Pallas' interpreter elsewhere (tests on CPU).
Requirements (`flash_supported`): head_dim a power of two in 16..256 and H / K a power of two.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zerojax.models.attention_window import check_window

LOG2E = math.log2(math.e)  # scores in base 2 (exp2)
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a masked score never makes NaN
_PAD_SEGMENT = 2**31 - 1  # the padded tail's segment: a run of its own after the row's


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """Tile sizes (powers of two). The backward's one program computes dk / dv of key block j and
    dq of query block j, so kv_dkv == q_dq."""
    q: int = 128
    k: int = 64
    q_dkv: int = 64
    kv_dkv: int = 64
    q_dq: int = 64
    kv_dq: int = 64
    warps: int = 4
    warps_bwd: int = 4
    stages: int = 3

    def __post_init__(self):
        for name in ("q", "k", "q_dkv", "kv_dkv", "q_dq", "kv_dq"):
            b = getattr(self, name)
            if not (isinstance(b, int) and b >= 16 and b & (b - 1) == 0):
                raise ValueError(f"FlashBlocks.{name}={b!r}: a power of two >= 16")
        if self.kv_dkv != self.q_dq:
            raise ValueError(f"FlashBlocks: kv_dkv={self.kv_dkv} must equal q_dq={self.q_dq} (one backward program "
                             "computes dk / dv of a key block and dq of the query block of the same index)")

    @property
    def row_multiple(self) -> int:
        return max(self.q, self.k, self.q_dkv, self.kv_dkv, self.q_dq, self.kv_dq)


def triton_head_dim(head_dim: int) -> bool:
    """A head_dim a Triton attention kernel takes (this one and the decoder's): a power of two in
    16..256, as Triton's tiles and dots need."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def flash_supported(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Shapes the kernel takes: Triton's tiles are powers of two."""
    g = heads // kv_heads if kv_heads and heads % kv_heads == 0 else 0
    return triton_head_dim(head_dim) and g > 0 and g & (g - 1) == 0


def flash_attention(q, k, v, *, segment_ids=None, window: int | None = None, scale: float | None = None,
                    blocks: FlashBlocks = FlashBlocks(), interpret: bool | None = None):
    """Causal softmax(q k^T * scale) v per head -> [B, T, H, Dh] in q's dtype; q [B, T, H, Dh],
    k, v [B, T, K, Dh]. interpret None: compiled on GPU, Pallas' interpreter on other backends."""
    B, T, H, Dh = q.shape
    K = k.shape[2]
    if not flash_supported(Dh, H, K):
        raise ValueError(f"flash_attention: head_dim {Dh} and {H} query / {K} key-value heads; it takes a head_dim "
                         "that is a power of two in 16..256 and a power-of-two number of query heads per key head "
                         "(attention_impl='blockwise' takes any)")
    check_window(window)
    scale = float(Dh ** -0.5 if scale is None else scale)
    interpret = jax.default_backend() != "gpu" if interpret is None else bool(interpret)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    pad = -T % blocks.row_multiple
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=_PAD_SEGMENT)
    first, end = visible_bounds(seg, window)
    o = _flash(q, k, v, seg, first, end, blocks, window, scale, interpret)
    return o[:, :T]


def visible_bounds(seg, window: int | None = None):
    """(first [B, T], end [B, T]) int32: query i sees no key before first[i], and key j is seen by
    no query at or after end[j]. From the document runs of rows where each segment id forms one
    run (what a packer writes, its padding segment included: 1 1 2 2 2 3 0 0); 0 and T for other
    rows; the window narrows both."""
    B, T = seg.shape
    idx = jnp.arange(T, dtype=jnp.int32)[None]
    new = jnp.concatenate([jnp.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)  # a run starts here
    ends = jnp.concatenate([seg[:, 1:] != seg[:, :-1], jnp.ones((B, 1), bool)], axis=1)  # a run ends here
    first = lax.cummax(jnp.where(new, idx, 0), axis=1)
    end = lax.cummin(jnp.where(ends, idx + 1, T), axis=1, reverse=True)
    sorted_ids = jnp.sort(seg, axis=1)
    distinct = 1 + jnp.sum(sorted_ids[:, 1:] != sorted_ids[:, :-1], axis=1, keepdims=True)
    one_run_each = jnp.sum(new, axis=1, keepdims=True) == distinct  # as many runs as segment ids
    first = jnp.where(one_run_each, first, 0)
    end = jnp.where(one_run_each, end, T)
    if window is not None:
        first = jnp.maximum(first, idx - (window - 1))
        end = jnp.minimum(end, idx + window)
    return first.astype(jnp.int32), end.astype(jnp.int32)


def _acc_dtype(dtype):
    """Accumulators and softmax statistics: fp32, or float64 for float64 inputs (the exact reference)."""
    return jnp.promote_types(dtype, jnp.float32)


def _div(a, b: int):
    """Integer a // b of a traced int32 (Triton's loop bounds; `//` does not lower there)."""
    return lax.div(jnp.asarray(a, jnp.int32), jnp.int32(b))


def _mask(qk, rows, cols, seg_q, seg_k, window):
    ok = (rows[:, None] >= cols[None, :]) & (seg_q[:, None] == seg_k[None, :])
    if window is not None:
        ok = ok & (rows[:, None] - cols[None, :] < window)
    return jnp.where(ok, qk, MASKED)


def _forward_kernel(q_ref, k_ref, v_ref, seg_ref, first_ref, o_ref, lse_ref, *, scale, window, bq, bk):
    """One query block of one head: an online softmax over the key blocks from the block's first
    visible key to its diagonal. Scores in base 2 (exp2), as the op this is built on."""
    i = pl.program_id(0)
    q = q_ref[...]
    rows = i * bq + jnp.arange(bq)
    seg_q = seg_ref[pl.ds(i * bq, bq)]
    start = _div(jnp.min(first_ref[...]), bk)
    stop = _div(bq * (i + 1) + bk - 1, bk)
    s_scale = scale * LOG2E

    def body(j, carry):
        acc, m, l = carry
        keys = pl.ds(j * bk, bk)
        qk = plgpu.dot(q, k_ref[keys, :].T) * s_scale
        qk = _mask(qk, rows, j * bk + jnp.arange(bk), seg_q, seg_ref[keys], window)
        m_new = jnp.maximum(m, qk.max(axis=-1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(qk - m_new[:, None])
        acc = acc * corr[:, None] + plgpu.dot(p.astype(v_ref.dtype), v_ref[keys, :])
        return acc, m_new, l * corr + p.sum(axis=-1)

    acc_t = _acc_dtype(q.dtype)
    init = (jnp.zeros((bq, q.shape[-1]), acc_t), jnp.full((bq,), -jnp.inf, acc_t), jnp.zeros((bq,), acc_t))
    acc, m, l = lax.fori_loop(start, stop, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _backward_kernel(q_ref, k_ref, v_ref, seg_ref, first_ref, end_ref, do_ref, lse_ref, delta_ref,
                     dq_ref, dk_ref, dv_ref, *, scale, window, groups, bq_dkv, bk_dkv, bq_dq, bk_dq):
    """Program (b, key head, j): dk, dv of key block j summed over the G query heads of this key
    head (query blocks from j's diagonal to the last one that sees it), then dq of query block j for
    each of those heads (key blocks from its first visible one to its diagonal)."""
    j = pl.program_id(2)
    s_scale = scale * LOG2E

    keys = pl.ds(j * bk_dkv, bk_dkv)
    k, v = k_ref[keys, :], v_ref[keys, :]
    cols = j * bk_dkv + jnp.arange(bk_dkv)
    seg_k = seg_ref[keys]
    q_start = _div(j * bk_dkv, bq_dkv)
    q_stop = _div(jnp.max(end_ref[keys]) + bq_dkv - 1, bq_dkv)
    dk = jnp.zeros(k.shape, _acc_dtype(k.dtype))
    dv = jnp.zeros(v.shape, _acc_dtype(k.dtype))
    for g in range(groups):
        def dkdv(i, carry, g=g):
            dk, dv = carry
            qs = pl.ds(i * bq_dkv, bq_dkv)
            q = q_ref[qs, g, :]
            do = do_ref[qs, g, :]
            qk = plgpu.dot(q, k.T) * s_scale
            qk = _mask(qk, i * bq_dkv + jnp.arange(bq_dkv), cols, seg_ref[qs], seg_k, window)
            p = jnp.exp2(qk - lse_ref[g, qs][:, None])
            dv = dv + plgpu.dot(p.astype(do.dtype).T, do)
            dp = plgpu.dot(do, v.T) - delta_ref[g, qs][:, None]
            ds = (p * dp * scale).astype(q.dtype)
            return dk + plgpu.dot(ds.T, q), dv

        dk, dv = lax.fori_loop(q_start, q_stop, dkdv, (dk, dv))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)

    queries = pl.ds(j * bq_dq, bq_dq)
    rows = j * bq_dq + jnp.arange(bq_dq)
    seg_q = seg_ref[queries]
    k_start = _div(jnp.min(first_ref[queries]), bk_dq)
    k_stop = _div((j + 1) * bq_dq + bk_dq - 1, bk_dq)
    for g in range(groups):
        q = q_ref[queries, g, :]
        do = do_ref[queries, g, :]
        lse = lse_ref[g, queries]
        delta = delta_ref[g, queries]

        def dq_step(i, dq, q=q, do=do, lse=lse, delta=delta):
            ks = pl.ds(i * bk_dq, bk_dq)
            k = k_ref[ks, :]
            qk = plgpu.dot(q, k.T) * s_scale
            qk = _mask(qk, rows, i * bk_dq + jnp.arange(bk_dq), seg_q, seg_ref[ks], window)
            p = jnp.exp2(qk - lse[:, None])
            dp = plgpu.dot(do, v_ref[ks, :].T) - delta[:, None]
            ds = (p * dp * scale).astype(k.dtype)
            return dq + plgpu.dot(ds, k)

        dq = lax.fori_loop(k_start, k_stop, dq_step, jnp.zeros(q.shape, _acc_dtype(q.dtype)))
        dq_ref[:, g, :] = dq.astype(dq_ref.dtype)


def _forward(q, k, v, seg, first, blocks, window, scale, interpret):
    B, T, H, Dh = q.shape
    G = H // k.shape[2]
    bq = blocks.q
    o, lse = pl.pallas_call(
        functools.partial(_forward_kernel, scale=scale, window=window, bq=bq, bk=blocks.k),
        grid=(T // bq, B, H),
        in_specs=[
            pl.BlockSpec((None, bq, None, Dh), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, T, None, Dh), lambda i, b, h: (b, 0, h // G, 0)),
            pl.BlockSpec((None, T, None, Dh), lambda i, b, h: (b, 0, h // G, 0)),
            pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
            pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        ],
        out_specs=[pl.BlockSpec((None, bq, None, Dh), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), _acc_dtype(q.dtype))],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.warps, num_stages=blocks.stages),
        interpret=interpret, name="zerojax_flash_forward",
    )(q, k, v, seg, first)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash(q, k, v, seg, first, end, blocks, window, scale, interpret):
    return _forward(q, k, v, seg, first, blocks, window, scale, interpret)[0]


def _flash_fwd(q, k, v, seg, first, end, blocks, window, scale, interpret):
    o, lse = _forward(q, k, v, seg, first, blocks, window, scale, interpret)
    return o, (q, k, v, seg, first, end, o, lse)


def _flash_bwd(blocks, window, scale, interpret, res, do):
    q, k, v, seg, first, end, o, lse = res
    B, T, H, Dh = q.shape
    K = k.shape[2]
    G = H // K
    # delta_i = sum_d o_id do_id, the softmax gradient's row term (one fused XLA reduction)
    acc_t = _acc_dtype(q.dtype)
    delta = jnp.einsum("bthd,bthd->bht", o.astype(acc_t), do.astype(acc_t))
    grouped = lambda x: x.reshape(B, T, K, G, Dh)  # noqa: E731
    per_key_head = lambda x: x.reshape(B, K, G, T)  # noqa: E731
    full_q = pl.BlockSpec((None, T, None, G, Dh), lambda b, h, j: (b, 0, h, 0, 0))
    full_k = pl.BlockSpec((None, T, None, Dh), lambda b, h, j: (b, 0, h, 0))
    row = pl.BlockSpec((None, T), lambda b, h, j: (b, 0))
    stats = pl.BlockSpec((None, None, G, T), lambda b, h, j: (b, h, 0, 0))
    dq, dk, dv = pl.pallas_call(
        functools.partial(_backward_kernel, scale=scale, window=window, groups=G, bq_dkv=blocks.q_dkv,
                          bk_dkv=blocks.kv_dkv, bq_dq=blocks.q_dq, bk_dq=blocks.kv_dq),
        grid=(B, K, T // blocks.kv_dkv),
        in_specs=[full_q, full_k, full_k, row, row, row, full_q, stats, stats],
        out_specs=[pl.BlockSpec((None, blocks.q_dq, None, G, Dh), lambda b, h, j: (b, j, h, 0, 0)),
                   pl.BlockSpec((None, blocks.kv_dkv, None, Dh), lambda b, h, j: (b, j, h, 0)),
                   pl.BlockSpec((None, blocks.kv_dkv, None, Dh), lambda b, h, j: (b, j, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, T, K, G, Dh), q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.warps_bwd, num_stages=2),
        interpret=interpret, name="zerojax_flash_backward",
    )(grouped(q), k, v, seg, first, end, grouped(do.astype(q.dtype)), per_key_head(lse), per_key_head(delta))
    return dq.reshape(q.shape), dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)

__all__ = ["FlashBlocks", "flash_attention", "flash_supported", "triton_head_dim", "visible_bounds", "MASKED",
           "LOG2E"]
