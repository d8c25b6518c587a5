"""The commands' --model value: a registered family's named shape (`zerojax.models.registry`) or
`module:factory` (a callable returning an nnx.Module) -> `ModelChoice` (a factory the planner can
vary, a label, the model's maximum positions). A value that cannot be built raises
`ModelArgError`, one line naming the flag and what it accepts. Imports nothing heavy until
called: `zerojax --help` starts without JAX.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

MODEL_ACCEPTS = ("a named shape of a registered model family (zerojax.models.registry: GPT-2 tiny ... xl, the Llama "
                 "family's llama-3.2-1b, llama-3.1-8b, qwen3-0.6b, mistral-7b, ...) or module:factory (a callable "
                 "returning an nnx.Module, with no arguments or taking remat_policy= / dtype= / mlp_tile=; the "
                 "current directory is importable)")


DEFAULT_SEQ = 1024  # a model that names no maximum positions


class FlagError(ValueError):
    """A flag's value (or a pair of flags) this command cannot take: its `error:` line (trainer.exits)."""


class ModelArgError(FlagError):
    """A --model value the CLI cannot build: the message is the one line printed."""


@dataclasses.dataclass
class ModelChoice:
    """The model a command runs: `name` (--model's value; "hf" for a Hugging Face checkpoint's), the
    `label` the output prints, the model's maximum positions (0: it names none) and, where known:
    `factory` (remat_policy= / dtype= [/ mlp_tile=] keywords where the model takes them: the
    planner's variants), the registered family (`family_spec`, a `zerojax.models.registry.ModelFamily`)
    and its `config` (`zerojax train` builds from these)."""

    name: str
    label: str
    factory: Callable | None = None
    max_positions: int = 0
    family_spec: Any = None
    config: Any = None

    @classmethod
    def of_family(cls, family, config, name: str, label: str | None = None, factory=None) -> ModelChoice:
        """A registered family's model of `config`, named `name` (its label: the family's words for it)."""
        return cls(name, label if label is not None else family.label_of(name, config), factory,
                   family.max_positions(config), family, config)

    @property
    def size(self) -> str:
        """--model's name (the trainer's word for it)."""
        return self.name

    @property
    def family(self) -> str:
        """The registered family's name."""
        return self.family_spec.name

    @property
    def position_cap(self) -> int | None:
        """The longest row the model can take: its maximum positions where they are a table of that
        many rows (GPT-2's learned positions) or where an unregistered model names them; None for a
        registered family with rotary positions, which extend past the length it was trained at."""
        learned = self.family_spec is None or getattr(self.family_spec, "learned_positions", True)
        return (self.max_positions or None) if learned else None

    def seq_len(self, seq: int | None) -> int:
        """--seq, else the model's maximum positions, else DEFAULT_SEQ."""
        return seq or self.max_positions or DEFAULT_SEQ

    def build(self, seed: int, dtype, remat, param_dtype=None, mlp_tile=None):
        """A randomly initialised model of this family's config (compute dtype, remat policy, MLP
        tile; parameters in param_dtype, default fp32)."""
        import jax.numpy as jnp
        from flax import nnx

        if self.family_spec is None:
            raise ValueError(f"--model {self.name}: not a registered family's model, so it cannot be built "
                             "from a config; call its factory")
        return self.family_spec.build(self.config, rngs=nnx.Rngs(seed), dtype=dtype, remat_policy=remat,
                                      param_dtype=param_dtype or jnp.float32, **tile_options(mlp_tile))


def tile_options(mlp_tile) -> dict:
    """The model keywords for an MLP tile: none when untiled, so a family without `mlp_tile`
    (GPT-2) is built as before."""
    return {} if mlp_tile is None else {"mlp_tile": mlp_tile}


def configured_dtype(cfg_dict):
    import jax.numpy as jnp

    return (jnp.bfloat16 if (cfg_dict.get("bf16") or {}).get("enabled") is True
            else jnp.float16 if (cfg_dict.get("fp16") or {}).get("enabled") is True
            else jnp.float32)


def family_factory(shape, cfg_dict):
    """(the family, its config, model_factory(remat_policy=None, dtype=the config's[, mlp_tile=None]))
    for a registered family's named shape: the planner varies activation checkpointing, (when the
    config says "auto") the compute dtype and (where the model takes it) the MLP tile. None where
    no family has the shape."""
    import jax.numpy as jnp
    from flax import nnx

    from zerojax.models import registry

    family = registry.for_shape(shape)
    if family is None:
        return None
    config = family.config(shape)
    configured = configured_dtype(cfg_dict)

    def build(remat_policy, dtype, **options):
        return family.build(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32, remat_policy=remat_policy,
                            **options)

    # the planner varies the keywords the factory names: mlp_tile only where the model takes it
    if family.takes("mlp_tile"):
        return family, config, lambda remat_policy=None, dtype=configured, mlp_tile=None: build(
            remat_policy, dtype, mlp_tile=mlp_tile)
    return family, config, lambda remat_policy=None, dtype=configured: build(remat_policy, dtype)


_MAX_POSITION_NAMES = ("max_position_embeddings", "n_positions", "max_seq_len", "max_seq_length",
                       "max_len", "block_size", "context_length", "n_ctx")


def max_positions(model) -> int:
    """The model's maximum positions where it (or its `.config` / `.shape`) says them, else 0."""
    for owner in (model, getattr(model, "config", None), getattr(model, "shape", None)):
        for name in _MAX_POSITION_NAMES:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def resolve_model(spec: str, cfg_dict) -> ModelChoice:
    """--model's value -> ModelChoice: a GPT-2 size, a Llama-family shape, or module:factory.
    Raises ModelArgError (one line naming the flag and what it accepts)."""
    spec = str(spec).strip()
    if ":" in spec:
        return _imported_model(spec, cfg_dict)
    found = family_factory(spec.lower(), cfg_dict)
    if found is None:
        from zerojax.models import registry

        raise ModelArgError(f"--model {spec!r}: not a model zerojax knows; --model takes a registered shape "
                            f"({', '.join(registry.shape_names())}) or module:factory")
    family, config, factory = found
    return ModelChoice.of_family(family, config, spec.lower(), factory=factory)


def _imported_model(spec: str, cfg_dict) -> ModelChoice:
    import importlib
    import inspect

    from flax import nnx

    module_name, _, attr = spec.partition(":")
    what = f"--model {spec!r}"
    if not module_name or not attr:
        raise ModelArgError(f"{what}: write module:factory, e.g. mypkg.models:build ({MODEL_ACCEPTS})")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelArgError(f"{what}: cannot import {module_name} ({type(e).__name__}: {e}); "
                            "--model module:factory imports the module with the current directory on sys.path"
                            ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelArgError(f"{what}: {module_name} has no {attr}; --model module:factory names a callable in it")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelArgError(f"{what}: {attr} is a {type(obj).__name__}, not a callable; --model module:factory "
                            "names a function (or class) returning an nnx.Module")
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        params = ()
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p.name for p in params if p.default is p.empty and p.kind not in kinds]
    others = [n for n in required if n not in ("remat_policy", "dtype")]
    if others:
        raise ModelArgError(f"{what}: {attr} needs {', '.join(others)}; --model module:factory takes a callable "
                            "with no arguments, or with only remat_policy= / dtype= keywords")
    defaults = {"remat_policy": None, "dtype": configured_dtype(cfg_dict)}
    factory = functools.partial(obj, **{n: defaults[n] for n in required}) if required else obj
    try:
        model = nnx.eval_shape(factory)
    except Exception as e:  # noqa: BLE001 - the user's code: its error, on one line
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise ModelArgError(f"{what}: calling {attr}() failed: {type(e).__name__}: {first_line}") from None
    if not isinstance(model, nnx.Module):
        raise ModelArgError(f"{what}: {attr}() returned a {type(model).__name__}; --model module:factory must "
                            "return an nnx.Module")
    return ModelChoice(spec, f"{spec} ({type(model).__name__})", factory, max_positions(model))


__all__ = ["MODEL_ACCEPTS", "DEFAULT_SEQ", "FlagError", "ModelArgError", "ModelChoice", "configured_dtype",
           "family_factory", "max_positions", "resolve_model"]
