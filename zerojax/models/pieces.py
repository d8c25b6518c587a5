"""A model family's public protocol: its forward pass in the pieces that anything running the layers
one at a time calls -- the KV-cache decoder (`zerojax.generation`), the serving step
(`zerojax.serving.step`), the shared-prompt log-probs of RL (`zerojax.scoring.shared_prompt`).

A family implements `LayerPieces` (docs/extending.md) and names the class in its registry record
(`zerojax.models.registry.ModelFamily.pieces`):

    embed(ids, positions)                  -> the residual stream x [B, T, d]
    attention_inputs(x, p, positions)      -> q [B, T, H, Dh], k, v [B, T, K, Dh] of one layer
    attention(q, k, v)                     -> o [B, T, H, Dh], the model's causal attention (whole rows)
    attention_output_and_mlp(x, o, p)      -> the layer's output [B, T, d]
    final_norm(x), logits(x, head=...)     -> fp32 logits [B, T, padded vocab]
    layers(body)                           -> the stacked per-layer params `p` as training scans them

Training's own layer is these pieces with the attention between them, so the callers above run
exactly the code training runs; only what they do around the attention (a cache, pages, two
streams) is theirs. GPT-2, the Llama family and the mixture-of-experts family implement it here.
"""
from __future__ import annotations

import abc
import dataclasses

from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from zerojax.models import gpt2, llama, moe, registry
from zerojax.models.attention import DEFAULT_BLOCK, causal_attention


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The KV cache's per-layer shape: `layers` x [batch, length, kv_heads, head_dim], and the
    query heads attending over it."""

    layers: int
    kv_heads: int
    head_dim: int
    window: int | None  # attend to the last `window` positions only (Mistral v0.1), None: all
    max_positions: int | None  # learned position rows (GPT-2); None: rotary, no table to run past
    heads: int  # query heads (a multiple of kv_heads)


class LayerPieces(abc.ABC):
    """One model's forward pass in pieces (see the module's docstring); built inside a traced
    program on a merged model. `linear(eq, h, entry, dtype)` computes every projection: the plain
    einsum, a LoRA / quantized adapter's (`model.adapter.linear`), or a caller's own (serving's
    per-row adapters).

    A family subclasses it with `stack` (the model's attribute holding the stacked layers),
    `geometry_of`, `embed`, `attention_inputs` and `attention_output_and_mlp`; the rest reads the
    model's documented hooks (`final_norm`, `padded_logits`, `dtype`, `attention_impl`,
    `activation_sharding`, `adapter`, `layer_fetch`) and is shared."""

    stack: str

    def __init__(self, model, linear=None):
        self.model = model
        self.constrain = getattr(model, "activation_sharding", None) or gpt2.unconstrained
        adapter = getattr(model, "adapter", None)
        self.linear = linear or (gpt2.plain_linear if adapter is None else adapter.linear)

    @staticmethod
    @abc.abstractmethod
    def geometry_of(config) -> Geometry:
        """The cache geometry of a model config (before any model is built)."""

    @abc.abstractmethod
    def embed(self, ids, positions):
        """The residual stream's input [B, T, d] for token ids [B, T] at positions [B, T]."""

    @abc.abstractmethod
    def attention_inputs(self, x, p, positions):
        """One layer's (q, k, v) from its input x [B, T, d]; p: the layer's params (`layers`)."""

    @abc.abstractmethod
    def attention_output_and_mlp(self, x, o, p):
        """The rest of the layer after the attention output o [B, T, H, Dh] -> [B, T, d]."""

    @property
    def geometry(self) -> Geometry:
        return self.geometry_of(self.model.config)

    def attention(self, q, k, v):
        """The model's own causal attention over whole rows q [B, T, H, Dh], k / v [B, T, K, Dh]
        (no cache, no packing): the implementation its training picks (cuDNN on a GPU, XLA on
        CPU), its window, and its remat name on the output."""
        m = self.model
        impl = gpt2.resolve_attention(getattr(m, "attention_impl", None), m.dtype, q.shape[-1], heads=q.shape[2],
                                      kv_heads=k.shape[2])
        o = causal_attention(q, k, v, impl=impl, window=self.geometry.window,
                             block=getattr(m, "attention_block", DEFAULT_BLOCK))
        o = self.constrain(o, ("batch", "seq", "heads", "head_dim"))
        return o if impl == "cudnn" else checkpoint_name(o, gpt2.ATTENTION_OUT)  # as the models' layers name it

    def final_norm(self, x):
        return self.model.final_norm(x)

    def logits(self, x, head=gpt2.lm_head):
        """fp32 logits [B, T, padded vocab] of final-normed x (padding columns -inf); head: the
        product (`gpt2.lm_head`, training's; `gpt2.decode_head`, transformers' generate's)."""
        return self.model.padded_logits(x, head=head)

    def layers(self, body):
        """(body, stacked layer inputs, fetch) as training's layer scan gets them: a LoRA model's
        frozen base scanned beside its adapters (`gpt2.adapted_layers`), the engine's per-layer
        fetch (ZeRO-3's gather on use, offload_param's host -> device copy) kept."""
        m = self.model
        layers = nnx.to_pure_dict(nnx.state(getattr(m, self.stack), nnx.Param))
        fetch = getattr(m, "layer_fetch", None)
        adapter = getattr(m, "adapter", None)
        if adapter is not None:
            return gpt2.adapted_layers(adapter, m, body, layers, fetch=fetch, layer_scan=None, stack=self.stack)
        return body, layers, fetch


class LlamaPieces(LayerPieces):
    """Llama, Mistral, Qwen2, Qwen3 (`zerojax.models.llama`)."""

    stack = "layers"

    @staticmethod
    def geometry_of(config) -> Geometry:
        return Geometry(config.num_hidden_layers, config.kv_heads, config.dim_per_head, config.sliding_window, None,
                        config.num_attention_heads)

    def embed(self, ids, positions):
        return self.model.embed(ids)  # rotary: the positions act inside each layer

    def _kw(self):
        return dict(config=self.model.config, dtype=self.model.dtype, constrain=self.constrain, linear=self.linear)

    def attention_inputs(self, x, p, positions):
        return llama.attention_inputs(x, p, positions=positions, **self._kw())

    def attention_output_and_mlp(self, x, o, p):
        return llama.attention_output_and_mlp(x, o, p, **self._kw())


class MoEPieces(LlamaPieces):
    """Qwen3-MoE, Mixtral: the Llama family's layer with the sparse block (`zerojax.models.moe`)."""

    def attention_output_and_mlp(self, x, o, p):
        m = self.model
        ff = moe.sparse_feed_forward(m.config, m.dtype, ragged=getattr(getattr(m, "adapter", None), "ragged", None))
        return llama.attention_output_and_mlp(x, o, p, feed_forward=ff, **self._kw())


class GPT2Pieces(LayerPieces):
    """GPT-2 (`zerojax.models.gpt2`)."""

    stack = "h"

    @staticmethod
    def geometry_of(config) -> Geometry:
        return Geometry(config.n_layer, config.n_head, config.head_dim, None, config.n_positions, config.n_head)

    def embed(self, ids, positions):
        return self.model.embed(ids, positions)

    def _kw(self):
        return dict(eps=self.model.config.layer_norm_epsilon, dtype=self.model.dtype, constrain=self.constrain,
                    linear=self.linear)

    def attention_inputs(self, x, p, positions):
        return gpt2.attention_inputs(x, p, **self._kw())  # learned positions: added by `embed`

    def attention_output_and_mlp(self, x, o, p):
        return gpt2.attention_output_and_mlp(x, o, p, **self._kw())


def pieces_class(model) -> type[LayerPieces] | None:
    """The `LayerPieces` class of `model`'s registered family, or None (none registered, or a
    family without one)."""
    family = registry.for_model(model)
    return None if family is None else family.pieces


def pieces_of(model, linear=None) -> LayerPieces:
    """`model`'s pieces; a TypeError naming the families that have them where it has none."""
    cls = pieces_class(model)
    if cls is None:
        able = [f.label for f in registry.families().values() if f.pieces]
        raise TypeError(f"{type(model).__name__} has no LayerPieces (zerojax.models.pieces), which generation, "
                        f"serving and the shared-prompt pass run; the registered families with them: "
                        f"{', '.join(able)}")
    return cls(model, linear=linear)


__all__ = ["Geometry", "LayerPieces", "LlamaPieces", "MoEPieces", "GPT2Pieces", "pieces_class", "pieces_of"]
