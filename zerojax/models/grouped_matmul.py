"""The grouped matrix product of a mixture of experts' layers, and which implementation runs it.

x [M, in] with rows grouped by expert (`group_sizes` [E]; rows past their sum belong to no group
and give zeros) times w [E, in, out]: row i of group e times w[e]. Two implementations:

- "xla": `jax.lax.ragged_dot`. On CPU and on NVIDIA GPUs, XLA's `RaggedDotRewriter` expands it to
  a dense product over every expert, with the other experts' rows masked: E times the FLOPs and an
  [M, E, in] temporary (`planning.estimate`'s `grouped_transient_values` counts that temporary). For
  OLMoE's 64 experts that is 64x the work of the layer's MLP. XLA's cuDNN ragged-dot fusion covers
  the forward only and needs cuDNN 9.22 or newer.
- "mosaic": the grouped kernels JAX itself ships for Hopper GPUs
  (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` / `transposed_ragged_dot_mgpu`, Pallas
  Mosaic GPU), under a VJP here: the input gradient is the grouped product with the kernels
  transposed, the kernel gradient contracts each group's rows. Shipped with jax, they always match
  the installed version. They tile the in and out widths by 128 (narrower ones, a LoRA adapter's
  rank-r factors, are padded with zeros) and need equal bf16 / fp16 operands (others take XLA's).
  tokamax 0.0.12's grouped kernel, tried before these, calls a Mosaic GPU API that JAX 0.11 no
  longer has (a TypeError on an H100).

"auto", the default, is "mosaic" on one Hopper GPU (compute capability 9.x) and "xla" everywhere
else (several devices too: XLA does not partition a Pallas kernel). `use(...)` picks one for the
programs traced inside it, as the MoE benchmark does to put them side by side.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

CHOICES = ("auto", "xla", "mosaic")
_choice = contextvars.ContextVar("zerojax_grouped_matmul", default="auto")


@contextlib.contextmanager
def use(choice: str):
    """Programs traced inside run their grouped products with `choice` (one of CHOICES). The choice
    is read when a program is traced: a function JAX has traced already (a `jax.jit` called before)
    keeps the products it was traced with."""
    if choice not in CHOICES:
        raise ValueError(f"grouped_matmul.use({choice!r}): one of {', '.join(map(repr, CHOICES))}")
    token = _choice.set(choice)
    try:
        yield
    finally:
        _choice.reset(token)


def resolved() -> str:
    """The implementation a grouped product traced now takes: "xla" or "mosaic"."""
    choice = _choice.get()
    if choice == "auto":
        return "mosaic" if _one_hopper() else "xla"
    return choice


def _one_hopper() -> bool:
    """One Hopper GPU. Over several devices a Pallas kernel is not split by XLA's SPMD partitioner
    (it would gather its operands to every device); the kernels wait for a shard_map there."""
    devices = jax.devices()
    return (len(devices) == 1 and devices[0].platform == "gpu"
            and str(getattr(devices[0], "compute_capability", "")).startswith("9"))


def grouped_product(x, w, group_sizes):
    """x [M, in] grouped by expert times w [E, in, *out] (out axes flattened for the product)
    -> [M, *out], by the implementation `resolved()` names."""
    return _CHECKPOINTED[resolved()](x, w, group_sizes)


def _product(x, w, group_sizes, *, name):
    E, n_in, *outs = w.shape
    w = w.reshape(E, n_in, -1)
    if name == "mosaic" and _mosaic_fits(x, w):
        y = _mosaic_ragged_dot(*_padded_to_tiles(x, w), group_sizes)[:, :w.shape[-1]]
    else:
        y = jax.lax.ragged_dot(x, w, group_sizes)
    return y.reshape(x.shape[0], *outs)


# Tile sizes of JAX's Mosaic GPU kernels: 128-row / 128-column output tiles over 64-wide slices
# of the contraction, four slices in flight (the shapes its own autotuning sweeps).
_MOSAIC_TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
_MOSAIC_WIDTH = 128  # in and out widths the tiles divide (the kernel gradient tiles both)
# the operands the kernels take, by the compute precision's name (planning counts by those names)
_MOSAIC_PRECISIONS = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
_MOSAIC_DTYPES = tuple(_MOSAIC_PRECISIONS.values())


def kernel_precisions() -> tuple[str, ...]:
    """The compute precisions ("bf16", "fp16") whose grouped products, traced now, run as grouped
    kernels; () where XLA's dense expansion runs them at every precision."""
    return tuple(_MOSAIC_PRECISIONS) if resolved() == "mosaic" else ()


def _mosaic_fits(x, w) -> bool:
    return x.dtype == w.dtype and x.dtype in _MOSAIC_DTYPES


def _padded_to_tiles(x, w):
    """x and w with zeros appended to their in and out widths up to whole tiles: a LoRA adapter's
    rank-16 factors become 128 wide, a few times their own small work, where XLA's product would
    expand to every expert with an [M, E, in] temporary."""
    _, n_in, n_out = w.shape
    pad_in, pad_out = -n_in % _MOSAIC_WIDTH, -n_out % _MOSAIC_WIDTH
    if pad_in:
        x = jnp.pad(x, ((0, 0), (0, pad_in)))
    if pad_in or pad_out:
        w = jnp.pad(w, ((0, 0), (0, pad_in), (0, pad_out)))
    return x, w


def _mosaic_kernels():
    """(grouped product, its transposed form): JAX's Mosaic GPU kernels (Hopper only)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    def product(x, w, group_sizes, transpose_rhs=False):
        return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=group_sizes, transpose_rhs=transpose_rhs,
                                          **_MOSAIC_TILES)

    def contract_groups(x, dy, group_sizes):
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(x, dy, group_sizes=group_sizes, **_MOSAIC_TILES)

    return product, contract_groups


def _grouped_rows(y, group_sizes):
    """y with the rows past the groups' sum zeroed: the kernels leave them unwritten."""
    rows = jnp.arange(y.shape[0], dtype=group_sizes.dtype)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), y, jnp.zeros((), y.dtype))


@jax.custom_vjp
def _mosaic_ragged_dot(x, w, group_sizes):
    product, _ = _mosaic_kernels()
    return _grouped_rows(product(x, w, group_sizes), group_sizes)


def _mosaic_forward(x, w, group_sizes):
    return _mosaic_ragged_dot(x, w, group_sizes), (x, w, group_sizes)


def _mosaic_backward(saved, dy):
    x, w, group_sizes = saved
    product, contract_groups = _mosaic_kernels()
    dy = dy.astype(x.dtype)
    dx = _grouped_rows(product(dy, w, group_sizes, transpose_rhs=True), group_sizes)  # dy[rows of e] @ w[e].T
    dw = contract_groups(x, dy, group_sizes)  # x[rows of e].T @ dy[rows of e]
    return dx, dw.astype(w.dtype), None


_mosaic_ragged_dot.defvjp(_mosaic_forward, _mosaic_backward)


# Checkpointed: the backward rebuilds the flattened kernel from w rather than keep it, which in
# the layer scan would save a copy of every layer's experts (all of them, gathered at ZeRO-3)
# beside the activations; the product itself is not rerun (its backward needs x and w only).
# One checkpointed function per implementation.
_CHECKPOINTED = {name: jax.checkpoint(functools.partial(_product, name=name)) for name in CHOICES[1:]}


__all__ = ["CHOICES", "use", "resolved", "kernel_precisions", "grouped_product"]
