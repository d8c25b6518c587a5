"""Model families by name: one record a family, registered by the module that defines it.

Everything that needs to know a family reads it here -- the trainer and `zerojax train` (named
shapes, losses), `from_hf` / `to_hf` and the checkpoint's Hugging Face writer (model types, readers,
writers), LoRA (PEFT's module names), the planner's loss -- so adding a family is one module: a
config, a model, and a `register(ModelFamily(...))` call (torchtitan's `ModelSpec`, levanter's
`LmConfig.register_subclass`). GPT-2 registers in `zerojax.models.hf`, the Llama family in
`zerojax.models.hf_llama`, the mixture-of-experts family (Qwen3-MoE, Mixtral) in
`zerojax.models.hf_moe` (each beside its Hugging Face reader and writer); a look-up imports them.

This module imports nothing of jax, so the CLI can list names cheaply.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

# the modules of the families zerojax ships, imported on first look-up
BUILTIN = ("zerojax.models.hf", "zerojax.models.hf_llama", "zerojax.models.hf_moe")


@dataclasses.dataclass(frozen=True)
class PeftTargets:
    """What LoRA (`zerojax.lora`) needs of a family, in PEFT's (Hugging Face's) names.

    stack: the model attribute holding the stacked layers; prefix: PEFT's name of layer {i},
    before a module name; linears: PEFT's module name -> (our path under the stack, how many
    leading axes of a layer's kernel are its input); savable: modules_to_save name -> (our
    attribute, Hugging Face tensor name); fan_in_fan_out: PEFT's flag for these modules (True for
    Conv1D's [in, out] weights); parameters: PEFT's `target_parameters` names (3-D expert weights,
    e.g. "mlp.experts.gate_up_proj") -> (our path, input axes, leading expert axes), in the order
    PEFT nests their wrappers (the first innermost)."""

    stack: str
    prefix: str
    linears: dict
    savable: dict
    fan_in_fan_out: bool = False
    parameters: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family.

    name: the key (and the model's `checkpoint_record()["family"]`); label: for messages.
    config_class: its config dataclass; shapes: {name a run takes (`--model`): the name
        `config_class.named` takes}.
    model_class: `model_class(config, *, rngs, dtype, param_dtype, remat_policy)`, and any further
        keyword its __init__ takes (`takes`: e.g. the Llama family's mlp_tile).
    loss / chunked_loss: `loss(model, batch)`; `chunked_loss(chunk)` -> a loss computing the
        logits `chunk` tokens at a time.
    hf_model_types: config.json model_types it reads; from_hf(path, dtype=None, **model_kwargs)
        -> model; writer(params, config, out_dir, dtype=None) -> the weights file written (a
        Hugging Face folder); config_from_record(record) -> config (a checkpoint's model record).
    hf_config(path) -> the config of a Hugging Face folder (config.json), before any weight is read.
    shape_keys: the config fields that decide the parameters' shapes (a resume compares them).
    learned_positions: a position table of `max_positions(config)` rows (GPT-2): no longer sequence
        runs; packs: the model takes `segment_ids` / `positions` (packed documents stay apart).
    counts(config, seq_len) -> (training FLOPs per token, parameters), or None: read off the
        parameter tree (`zerojax.model.model_dims`).
    peft: PEFT's module names for LoRA, or None (no LoRA).
    pieces: its `zerojax.models.pieces.LayerPieces` class (the forward pass in the pieces generation,
        serving and the shared-prompt pass run), or None (none of those).
    label_of(shape, config) -> the words a run prints for a named shape."""

    name: str
    label: str
    config_class: type
    model_class: type
    shapes: dict
    loss: Callable
    chunked_loss: Callable
    hf_model_types: tuple
    from_hf: Callable
    writer: Callable
    config_from_record: Callable
    hf_config: Callable
    shape_keys: tuple
    learned_positions: bool = False
    packs: bool = True
    counts: Callable | None = None
    peft: PeftTargets | None = None
    pieces: type | None = None
    max_positions: Callable[[Any], int] = lambda config: config.max_position_embeddings
    label_of: Callable[[str, Any], str] = lambda shape, config: shape

    def config(self, shape: str, **overrides):
        """The config of the named shape `shape` (a key of `shapes`)."""
        return self.config_class.named(self.shapes[shape], **overrides)

    def build(self, config, *, rngs, dtype, param_dtype, remat_policy=None, **options):
        """A model of `config`; `options`: further keywords of the model class (see `takes`)."""
        return self.model_class(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype, remat_policy=remat_policy,
                                **options)

    def takes(self, keyword: str) -> bool:
        """Whether the model class's __init__ takes `keyword` (a build option such as mlp_tile;
        read off __init__: an nnx.Module class's own signature is its metaclass's *args)."""
        return keyword in inspect.signature(self.model_class.__init__).parameters


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add `family`; its name, named shapes and model types must be new (re-registering the same
    name replaces it: a module imported twice, or a test's toy family)."""
    others = [f for f in _FAMILIES.values() if f.name != family.name]
    for what, mine in (("model type", family.hf_model_types), ("named shape", family.shapes)):
        taken = {x: f.name for f in others for x in (f.hf_model_types if what == "model type" else f.shapes)}
        clash = [x for x in mine if x in taken]
        if clash:
            raise ValueError(f"register({family.name!r}): {what} {clash[0]!r} is {taken[clash[0]]!r}'s already")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove the family `name` (a test's toy family)."""
    _FAMILIES.pop(name, None)


def _load_builtin():
    for module in BUILTIN:
        importlib.import_module(module)


def families() -> dict[str, ModelFamily]:
    """Every registered family by name (the built-in ones first)."""
    _load_builtin()
    return dict(_FAMILIES)


def get(name: str) -> ModelFamily:
    fams = families()
    if name not in fams:
        raise KeyError(f"no model family {name!r}; registered: {', '.join(fams)}")
    return fams[name]


def for_shape(shape: str) -> ModelFamily | None:
    """The family with the named shape `shape` (e.g. "large", "llama-3.2-1b"), or None."""
    return next((f for f in families().values() if shape in f.shapes), None)


def for_hf_type(model_type: str) -> ModelFamily | None:
    """The family reading config.json's `model_type`, or None."""
    return next((f for f in families().values() if model_type in f.hf_model_types), None)


def _closest(obj, cls_of) -> ModelFamily | None:
    """The family whose class (`cls_of(family)`) `obj` is an instance of, the most derived one
    first: a family built on another's classes (mixture of experts on the Llama family's) wins."""
    matches = [f for f in families().values() if isinstance(obj, cls_of(f))]
    return min(matches, key=lambda f: type(obj).__mro__.index(cls_of(f)), default=None)


def for_model(model) -> ModelFamily | None:
    """The family whose model class `model` is an instance of (the most derived), or None."""
    return _closest(model, lambda f: f.model_class)


def for_config(config) -> ModelFamily | None:
    """The family whose config class `config` is an instance of (the most derived), or None."""
    return _closest(config, lambda f: f.config_class)


def for_record(record: dict | None) -> ModelFamily | None:
    """The family of a checkpoint's model record (`checkpoint_record()`), or None."""
    if not record:
        return None
    name = record.get("family") or record.get("type")
    return families().get(name)


def hf_model_types() -> list[str]:
    return [t for f in families().values() for t in f.hf_model_types]


def shape_names() -> list[str]:
    return [s for f in families().values() for s in f.shapes]


__all__ = ["ModelFamily", "PeftTargets", "register", "unregister", "families", "get", "for_shape", "for_hf_type",
           "for_model",
           "for_config", "for_record", "hf_model_types", "shape_names"]
