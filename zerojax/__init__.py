"""zerojax: DeepSpeed's ZeRO, mixed precision, offload and JSON configs on JAX/Flax.

Public names only. They are imported lazily (PEP 562) so that `import zerojax` stays cheap and
a command such as `zerojax estimate` does not pay for modules it never uses.
"""
from importlib import import_module as _import_module

from zerojax import pinned_pool as _pinned_pool
from zerojax.version import __version__

_pinned_pool.raise_cap()  # before any JAX backend starts: XLA reads it once (zerojax/pinned_pool.py)

# public name -> module that defines it
_PUBLIC = {
    "load_config": "config",
    "Config": "config",
    "ConfigError": "config",
    "build_optimizer": "optim",
    "build_schedule": "optim",
    "dynamic_loss_scale": "precision",
    "DynamicLossScaleState": "precision",
    "static_loss_scale": "precision",
    "loss_scale_from_config": "precision",
    "make_mesh": "sharding.partition",
    "shard": "api",
    "EngineOptions": "options",
    "Engine": "train.engine",
    "MemoryReport": "train.engine",
    "TrainState": "train.step",
    "WillNotFitError": "train.memory",
    "check_fits": "train.memory",
    "fit_micro_batch": "planning.planner",
    "plan": "planning.planner",
    "search_mesh": "planning.mesh_search",
    "init_distributed": "launch.distributed",
    "apply_xla_flags": "xla_flags",
    "generate": "generation",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


# subpackages reachable as attributes (`zerojax.lora.apply`) without an import of their own
_SUBMODULES = ("lora", "models", "model", "generation")


def __getattr__(name):
    if name in _SUBMODULES:
        value = _import_module(f"zerojax.{name}")
        globals()[name] = value
        return value
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'zerojax' has no attribute {name!r}")
    value = getattr(_import_module(f"zerojax.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
