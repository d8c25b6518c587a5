"""Weight quantization for a frozen base (QLoRA, `zerojax.lora`): int8 per output channel, nf4 /
int4 in 64-element blocks (QLoRA, Dettmers et al. 2023), each stacked kernel quantized one layer at
a time and dequantized on use inside the layer scan.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

QUANTIZE = (None, "int8", "nf4", "int4")
BLOCK = 64  # QLoRA's block size for nf4 / int4
# NF4's 16 levels (QLoRA, Dettmers et al. 2023, appendix E; bitsandbytes' table)
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)


def quantize_int8(w, n_in: int, lead: int = 0, device=None):
    """Per output channel absmax int8 of a stacked kernel [L, *lead, *in, *out] (lead: e.g. the
    experts axis) -> (codes int8, scale fp32 [L, *lead, 1.., *out]); |w - codes * scale| <= scale / 2.
    Layer by layer (see `_per_layer`; device: where the codes go, a host `w` moved a layer at a time)."""
    return _per_layer(functools.partial(_int8_layer, n_in=n_in, lead=lead), w, device)


def _int8_layer(w, n_in, lead=0):
    w = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=tuple(range(lead, lead + n_in)), keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    return jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale


def quantize_4bit(w, kind: str, device=None):
    """nf4 / int4 of a stacked kernel [L, *s]: each layer's weight in blocks of 64 (row-major), one
    fp32 absmax per block -> (codes uint8 [L, *s[:-1], s[-1] / 2], two per byte, absmax [L, n / 64])."""
    shape = w.shape[1:]
    if math.prod(shape) % BLOCK or shape[-1] % 2:
        raise ValueError(f"{kind}: a layer's weight {shape} must have a multiple of {BLOCK} elements and an even "
                         "last dimension; use quantize \"int8\" for this model")
    return _per_layer(functools.partial(_4bit_layer, kind=kind), w, device)


def _4bit_layer(w, kind):
    shape = w.shape
    blocks = w.astype(jnp.float32).reshape(-1, BLOCK)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    x = blocks / jnp.where(absmax > 0, absmax, 1.0)[..., None]
    if kind == "nf4":
        mids = jnp.asarray((NF4[1:] + NF4[:-1]) / 2)
        codes = jnp.searchsorted(mids, x)  # the nearest level
    else:  # int4: symmetric levels -7 .. 7 of absmax / 7, stored + 8
        codes = jnp.clip(jnp.round(x * 7), -7, 7) + 8
    codes = codes.astype(jnp.uint8).reshape(*shape[:-1], shape[-1] // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), absmax


def _per_layer(fn, w, device=None):
    """fn over a stacked kernel's leading layer axis, one layer at a time (`lax.map` under jit): the
    fp32 working copy is one layer's, never the stack's (Llama-3.1-8B's stacked MLP kernel in fp32
    is 7 GiB, more than a 24 GB card has beside its bf16 base). With `device`, `w` (on the host) is
    moved there one layer at a time, each layer's results written into the stacked outputs in
    place: Qwen3-30B-A3B's stacked experts are 38 GB in bf16, their nf4 codes 10 GB."""
    if device is None:
        return jax.jit(lambda w: jax.lax.map(fn, w))(w)
    one = jax.jit(fn)
    shapes = jax.eval_shape(fn, jax.ShapeDtypeStruct(w.shape[1:], w.dtype))
    _check_room(device, w, sum(w.shape[0] * x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)))
    with jax.default_device(device):
        outs = jax.tree.map(lambda x: jnp.zeros((w.shape[0], *x.shape), x.dtype), shapes)
    put = jax.jit(lambda outs, x, i: jax.tree.map(lambda o, v: o.at[i].set(v), outs, x), donate_argnums=0)
    for i in range(w.shape[0]):
        outs = put(outs, one(jax.device_put(w[i], device)), i)
    return outs


def _check_room(device, w, need: int) -> None:
    """A clear error, before any copy, where the stacked codes of `w` will not fit `device`'s free
    memory (the allocator's limit less what is in use; not known on CPU): a raw out-of-memory in
    the middle of quantizing a base says neither which weight nor how far off."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = {}
    if "bytes_limit" not in stats or "bytes_in_use" not in stats:
        return
    limit, used = int(stats["bytes_limit"]) / 2**30, int(stats["bytes_in_use"]) / 2**30
    if need / 2**30 > limit - used:
        raise MemoryError(f"quantizing the base onto {device}: a stacked weight {tuple(w.shape)}'s codes need "
                          f"{need / 2**30:.2f} GiB and the device has {limit - used:.2f} GiB free ({used:.2f} GiB in "
                          f"use of {limit:.2f}): the quantized base does not fit; use a device with more memory (or a "
                          "larger XLA_PYTHON_CLIENT_MEM_FRACTION), or a smaller model")


def _levels(kind):
    return jnp.asarray(NF4) if kind == "nf4" else (jnp.arange(16, dtype=jnp.float32) - 8) / 7


def dequantize_4bit(codes, absmax, kind: str, dtype=jnp.float32):
    """One layer's (no leading L axis) packed codes and block absmax -> its weight [*s] in dtype."""
    pair = jnp.stack([codes & 15, codes >> 4], axis=-1)
    shape = (*codes.shape[:-1], codes.shape[-1] * 2)
    x = _levels(kind)[pair.astype(jnp.int32)].reshape(-1, BLOCK) * absmax[:, None]
    return x.reshape(shape).astype(dtype)


def quantization_bound(kind: str, scale):
    """The largest |w - dequantized w| for a block / channel of `scale` (int8: its scale; nf4 /
    int4: its absmax): half the widest gap between neighbouring levels."""
    if kind == "int8":
        return scale / 2
    gap = np.max(np.diff(np.asarray(_levels(kind))))
    return scale * gap / 2


def kernel_of(entry, dtype):
    """A projection's (one layer's) weight from its dict: stored, int8 or nf4 / int4."""
    if "kernel" in entry:
        return entry["kernel"].astype(dtype)
    if "kernel_int8" in entry:
        return (entry["kernel_int8"].astype(jnp.float32) * entry["kernel_scale"]).astype(dtype)
    for kind in ("nf4", "int4"):
        if f"kernel_{kind}" in entry:
            return dequantize_4bit(entry[f"kernel_{kind}"], entry["kernel_absmax"], kind, dtype)
    raise KeyError(f"no kernel among {sorted(entry)}")


__all__ = ["QUANTIZE", "BLOCK", "NF4", "quantize_int8", "quantize_4bit", "dequantize_4bit", "quantization_bound",
           "kernel_of"]
