"""What the KV-cache decoder needs of a model: its family's public `LayerPieces`
(`zerojax.models.pieces`: embed, attention inputs, attention output + MLP, final norm, logits), the
code training runs, so that only the attention over the cache is the decoder's own.

`family_of(model)` is those pieces in eval mode (LoRA dropout off); `decode_logits` the next-token
logits as transformers' generate computes them; `geometry_of_config` the cache's shape from a
config alone.
"""
from __future__ import annotations

import functools
import warnings

from zerojax.models import registry
from zerojax.models.gpt2 import decode_head
from zerojax.models.pieces import Geometry, LayerPieces, pieces_class


def family_class(model) -> type[LayerPieces]:
    """The `LayerPieces` class of `model`'s registered family (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
    Mixtral, GPT-2, and any family registered with one)."""
    cls = pieces_class(model)
    if cls is None:
        able = [f.label for f in registry.families().values() if f.pieces]
        raise TypeError(f"zerojax.generate: {type(model).__name__} has no KV-cache decoder; generation runs the "
                        f"registered families with one: {', '.join(able)}")
    return cls


def family_of(model, linear=None) -> LayerPieces:
    """The decoder's pieces of `model`, a module merged inside the program (set to eval mode: this is
    the program's own merge, not the user's model); linear: the projections (default the model's)."""
    cls = family_class(model)
    drop = getattr(model, "lora_dropout", None)
    if drop is not None:  # generation is eval mode, whatever mode training left
        drop.deterministic = True
    return cls(model, linear=linear)


def decode_logits(fam: LayerPieces, x):
    """fp32 next-token logits [B, T, padded vocab] of the residual stream x (padding columns -inf),
    the head's product in the compute dtype (`decode_head`: as transformers' generate)."""
    return fam.logits(fam.final_norm(x), head=decode_head)


@functools.cache
def geometry_of_config(config) -> Geometry:
    """The cache geometry from a model config alone (before any program is traced)."""
    fam = registry.for_config(config)
    if fam is None or fam.pieces is None:
        raise TypeError(f"zerojax.generate: no KV-cache decoder for a {type(config).__name__}")
    return fam.pieces.geometry_of(config)


# the decoder's per-family classes before the families' protocol was public: one release with a warning
_RENAMED = {"Family": "LayerPieces", "LlamaFamily": "LlamaPieces", "MoEFamily": "MoEPieces",
            "GPT2Family": "GPT2Pieces"}


def __getattr__(name):
    if name in _RENAMED:
        warnings.warn(f"zerojax.generation.families.{name} is zerojax.models.pieces.{_RENAMED[name]}; import it "
                      "from there (the old name goes in the next release)", DeprecationWarning, stacklevel=2)
        from zerojax.models import pieces

        return getattr(pieces, _RENAMED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Geometry", "family_class", "family_of", "decode_logits", "geometry_of_config"]
