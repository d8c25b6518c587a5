"""The grouped matrix product of a mixture of experts' layers, and which implementation runs it.

x [M, in] with rows grouped by expert (`group_sizes` [E]; rows past their sum belong to no group
and give zeros) times w [E, in, out]: row i of group e times w[e]. Two implementations:

- "xla": `jax.lax.ragged_dot`. On CPU and on NVIDIA GPUs, XLA's `RaggedDotRewriter` expands it to
  a dense product over every expert, with the other experts' rows masked: E times the FLOPs and an
  [M, E, in] temporary (`planning.estimate`'s `grouped_transient_values` counts that temporary). For
  OLMoE's 64 experts that is 64x the work of the layer's MLP. XLA's cuDNN ragged-dot fusion covers
  the forward only and needs cuDNN 9.22 or newer.
- "tokamax": `tokamax.ragged_dot` (Google DeepMind's kernel library on PyPI). It is grouped on
  GPUs: a Pallas Mosaic GPU kernel on Hopper and newer, a Pallas Triton kernel on older cards,
  and its own XLA fallback elsewhere. Its VJP is also grouped products (the input gradient is a
  grouped product with the kernels transposed; the kernel gradient contracts over each group's
  rows).

"auto", the default, is "tokamax" on a GPU backend where tokamax is installed (the `cuda12` /
`cuda13` extras install it) and "xla" everywhere else. `use("xla")` / `use("tokamax")` pick one
for the programs traced inside it, as the MoE benchmark does to put them side by side.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util

import jax

CHOICES = ("auto", "xla", "tokamax")
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
    """The implementation a grouped product traced now takes: "xla" or "tokamax"."""
    choice = _choice.get()
    if choice == "auto":
        return "tokamax" if jax.default_backend() == "gpu" and importlib.util.find_spec("tokamax") else "xla"
    return choice


def _ragged_dot(name: str):
    if name == "xla":
        return jax.lax.ragged_dot
    try:
        import tokamax
    except ImportError:
        raise ImportError("grouped_matmul 'tokamax': tokamax is not installed; pip install tokamax "
                          "(the zerojax[cuda12] / [cuda13] extras include it) or use 'xla'") from None
    from absl import flags

    # tokamax reads its settings from absl flags, and parses sys.argv for them on first use when
    # nothing has: the program's own arguments (`zerojax train --hf-checkpoint ...`, pytest's) are
    # not absl flags and would fail that parse. Marked parsed, its flags keep their defaults.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax.ragged_dot


def grouped_product(x, w, group_sizes):
    """x [M, in] grouped by expert times w [E, in, *out] (out axes flattened for the product)
    -> [M, *out], by the implementation `resolved()` names."""
    return _CHECKPOINTED[resolved()](x, w, group_sizes)


def _product(x, w, group_sizes, *, name):
    E, n_in, *outs = w.shape
    y = _ragged_dot(name)(x, w.reshape(E, n_in, -1), group_sizes)
    return y.reshape(x.shape[0], *outs)


# Checkpointed: the backward rebuilds the flattened kernel from w rather than keep it, which in
# the layer scan would save a copy of every layer's experts (all of them, gathered at ZeRO-3)
# beside the activations; the product itself is not rerun (its backward needs x and w only).
# One checkpointed function per implementation.
_CHECKPOINTED = {name: jax.checkpoint(functools.partial(_product, name=name)) for name in ("xla", "tokamax")}


__all__ = ["CHOICES", "use", "resolved", "grouped_product"]
