"""Several LoRA adapters over one base in one step: their lora_A / lora_B stacked on an axis after
the layers' (a zero adapter first: the base alone), and each row's projections adding its own
adapter's term, gathered by the row's adapter index. One program and one pass over the base's
weights serve every adapter in the batch (not a call per adapter).

Adapters stack where they share a configuration (targets, rank, alpha, no quantized base, no
modules_to_save): what PEFT folders trained with one LoraConfig have. Others run a call each.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.lora import LoraAdapter, kernel_of

# settings that change only how an adapter was initialised, not what it computes
_INIT_ONLY = ("seed", "init_lora_weights")


@dataclasses.dataclass(frozen=True)
class StackedLora(LoraAdapter):
    """A LoRA model's adapter whose lora_A [N, *ins, r] / lora_B [N, r, *outs] (per layer) hold N
    adapters; `rows_linear` applies row b's adapter rows[b] to row b."""

    def rows_linear(self, eq, h, entry, dtype, *, rows):
        """base(h) + scale * B[rows](A[rows](h)), h [R, ..., *ins] (no dropout: serving is eval)."""
        y = jnp.einsum(eq, h, kernel_of(entry, dtype))
        if "lora_A" not in entry:
            return y
        a, b = entry["lora_A"][rows].astype(dtype), entry["lora_B"][rows].astype(dtype)
        n_in = a.ndim - 2
        lead, R, r = h.shape[:h.ndim - n_in], h.shape[0], a.shape[-1]
        u = jnp.einsum("btk,bkr->btr", h.reshape(R, -1, math.prod(h.shape[h.ndim - n_in:])), a.reshape(R, -1, r))
        d = jnp.einsum("btr,bro->bto", u, b.reshape(R, r, -1))
        return y + self.scale * d.reshape(*lead, *b.shape[2:])


def _configuration(adapter):
    return (type(adapter), adapter.scale, adapter.targets, adapter.savable, adapter.quantize, adapter.family,
            tuple((k, v) for k, v in adapter.settings if k not in _INIT_ONLY))


def stack_adapters(models: dict, stack: str):
    """(one model holding every adapter of `models` stacked, {name: its index}; index 0 is the zero
    adapter: the base alone), or None where they cannot stack (configurations differ, a quantized
    base, trained modules outside the layer stack `stack`)."""
    adapters = [getattr(m, "adapter", None) for m in models.values()]
    first = adapters[0]
    if (not isinstance(first, LoraAdapter) or first.quantize or first.savable
            or any(_configuration(a) != _configuration(first) for a in adapters)):
        return None
    trained = [nnx.state(m, nnx.Param) for m in models.values()]
    if any(set(t) != {stack} for t in trained):
        return None
    stacked = jax.tree.map(lambda *xs: jnp.stack([jnp.zeros_like(xs[0]), *xs], axis=1), *trained)
    graphdef, state = nnx.split(next(iter(models.values())))
    model = nnx.merge(graphdef, state)  # new module objects over the same arrays
    nnx.update(model, stacked)
    model.adapter = StackedLora(**{f.name: getattr(first, f.name) for f in dataclasses.fields(first)})
    return model, {name: i + 1 for i, name in enumerate(models)}


__all__ = ["StackedLora", "stack_adapters"]
