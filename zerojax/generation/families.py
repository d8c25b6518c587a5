"""What the KV-cache decoder needs of each model family, built from the model module's own pieces
(`_attention_inputs`, `_attention_output_and_mlp`, `embed`, `final_norm`, `padded_logits`), so that
generation runs exactly the code training runs and only the attention over the cache is new.

A `Family` answers: the cache's geometry (layers, kv heads, head dim, sliding window), the
residual stream's input for token ids at per-row positions, one layer split around its attention,
and the stacked layers (with a LoRA adapter's frozen base beside them, as training scans them).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from zerojax.models import gpt2 as gpt2_mod
from zerojax.models import llama as llama_mod
from zerojax.models import moe as moe_mod
from zerojax.models import registry
from zerojax.models.attention import DEFAULT_BLOCK, causal_attention
from zerojax.models.gpt2 import ATTENTION_OUT, adapted_layers, decode_head, resolve_attention, unconstrained


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


class Family:
    """The decoder's view of one model (an nnx module merged inside the traced program)."""

    stack: str  # the model's attribute holding the stacked layers

    def __init__(self, model):
        self.model = model
        self.constrain = getattr(model, "activation_sharding", None) or unconstrained
        adapter = getattr(model, "adapter", None)  # zerojax.lora's: quantized base, LoRA terms (not merged)
        self.linear = self.plain_linear if adapter is None else adapter.linear
        drop = getattr(model, "lora_dropout", None)
        if drop is not None:  # generation is eval mode, whatever mode training left (this module is
            drop.deterministic = True  # the program's own merge, not the user's model)

    def layers(self, body):
        """(body, stacked layer inputs, fetch) as training's layer scan gets them: a LoRA model's
        frozen base scanned beside its adapters (`adapted_layers`), the engine's per-layer fetch
        (ZeRO-3's gather on use, offload_param's host -> device copy) kept."""
        m = self.model
        layers = nnx.to_pure_dict(nnx.state(getattr(m, self.stack), nnx.Param))
        fetch = getattr(m, "layer_fetch", None)
        adapter = getattr(m, "adapter", None)
        if adapter is not None:
            return adapted_layers(adapter, m, body, layers, fetch=fetch, layer_scan=None, stack=self.stack)
        return body, layers, fetch

    @property
    def geometry(self) -> Geometry:
        return geometry_of_config(self.model.config)

    def plain_attention(self, q, k, v):
        """The model's own causal attention over whole rows q [B, T, H, Dh], k / v [B, T, K, Dh]
        (no cache, no packing): the implementation its training picks (cuDNN on a GPU, XLA on
        CPU), its window, and its remat name on the output."""
        m = self.model
        impl = resolve_attention(getattr(m, "attention_impl", None), m.dtype, q.shape[-1], heads=q.shape[2],
                                 kv_heads=k.shape[2])
        o = causal_attention(q, k, v, impl=impl, window=self.geometry.window,
                             block=getattr(m, "attention_block", DEFAULT_BLOCK))
        o = self.constrain(o, ("batch", "seq", "heads", "head_dim"))
        return o if impl == "cudnn" else checkpoint_name(o, ATTENTION_OUT)  # as the models' blocks name it

    def logits(self, x):
        """fp32 logits [B, T, padded vocab] of the residual stream (padding columns -inf), the
        head's product in the compute dtype (`decode_head`: as transformers' generate)."""
        return self.model.padded_logits(self.model.final_norm(x), head=decode_head)


class LlamaFamily(Family):
    stack = "layers"
    plain_linear = staticmethod(llama_mod._linear)

    @staticmethod
    def geometry_of(config) -> Geometry:
        return Geometry(config.num_hidden_layers, config.kv_heads, config.dim_per_head, config.sliding_window, None,
                        config.num_attention_heads)

    def embed(self, ids, positions):
        return self.model.embed(ids)  # rotary: the positions act inside each layer

    def _kw(self):
        return dict(config=self.model.config, dtype=self.model.dtype, constrain=self.constrain, linear=self.linear)

    def attention_inputs(self, x, p, positions):
        return llama_mod._attention_inputs(x, p, positions=positions, **self._kw())

    def after_attention(self, x, o, p):
        return llama_mod._attention_output_and_mlp(x, o, p, **self._kw())


class MoEFamily(LlamaFamily):
    """Qwen3-MoE, Mixtral: the Llama family's layer with the sparse block (`zerojax.models.moe`)."""

    def after_attention(self, x, o, p):
        m = self.model
        ff = moe_mod.sparse_feed_forward(m.config, m.dtype, ragged=getattr(getattr(m, "adapter", None), "ragged", None))
        return llama_mod._attention_output_and_mlp(x, o, p, feed_forward=ff, **self._kw())


class GPT2Family(Family):
    stack = "h"
    plain_linear = staticmethod(gpt2_mod._linear)

    @staticmethod
    def geometry_of(config) -> Geometry:
        return Geometry(config.n_layer, config.n_head, config.head_dim, None, config.n_positions, config.n_head)

    def embed(self, ids, positions):
        return self.model.embed(ids, positions)

    def _kw(self):
        return dict(eps=self.model.config.layer_norm_epsilon, dtype=self.model.dtype, constrain=self.constrain,
                    linear=self.linear)

    def attention_inputs(self, x, p, positions):
        return gpt2_mod._attention_inputs(x, p, **self._kw())  # learned positions: added by `embed`

    def after_attention(self, x, o, p):
        return gpt2_mod._attention_output_and_mlp(x, o, p, **self._kw())


def family_class(model) -> type[Family]:
    """The decoder's `Family` class of `model`'s registered family (`zerojax.models.registry`'s
    `decoder`: Llama, Mistral, Qwen2, Qwen3, GPT-2, and any family registered with one)."""
    fam = registry.for_model(model)
    if fam is None or fam.decoder is None:
        able = [f.label for f in registry.families().values() if f.decoder]
        raise TypeError(f"zerojax.generate: {type(model).__name__} has no KV-cache decoder; generation runs the "
                        f"registered families with one: {', '.join(able)}")
    return _resolve(fam.decoder)


def _resolve(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def family_of(model) -> Family:
    """The decoder's view of `model`, a module merged inside the program (it is set to eval mode)."""
    return family_class(model)(model)


@functools.lru_cache(maxsize=None)
def geometry_of_config(config) -> Geometry:
    """The cache geometry from a model config alone (before any program is traced)."""
    fam = registry.for_config(config)
    if fam is None or fam.decoder is None:
        raise TypeError(f"zerojax.generate: no KV-cache decoder for a {type(config).__name__}")
    return _resolve(fam.decoder).geometry_of(config)


__all__ = ["Geometry", "Family", "LlamaFamily", "MoEFamily", "GPT2Family", "family_class", "family_of", "geometry_of_config"]
